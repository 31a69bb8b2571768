"""Data-parallel softmax regression in plain numpy, on synthetic data.

Every rank trains on its own shard; gradients are averaged with one grouped
allreduce per step, so every rank keeps identical weights.

    .venv/bin/mpitrainrun -np 2 python examples/numpy_softmax_regression.py
"""

import numpy as np

import mpitrain as mt

CLASSES, FEATURES, SAMPLES, STEPS, LEARNING_RATE = 10, 64, 4000, 200, 0.5


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=0.3, size=(CLASSES, FEATURES))
    labels = rng.integers(CLASSES, size=SAMPLES)
    points = centers[labels] + rng.normal(size=(SAMPLES, FEATURES))
    return points.astype(np.float32), labels


def gradients(weights, bias, points, labels):
    logits = points @ weights + bias
    logits -= logits.max(axis=1, keepdims=True)
    probabilities = np.exp(logits)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    loss = -np.log(probabilities[np.arange(len(labels)), labels]).mean()
    probabilities[np.arange(len(labels)), labels] -= 1
    probabilities /= len(labels)
    return loss, points.T @ probabilities, probabilities.sum(axis=0)


def main():
    mt.init()
    points, labels = make_data()
    split = int(0.8 * SAMPLES)
    train = slice(mt.rank(), split, mt.size())          # this rank's shard
    weights = np.zeros((FEATURES, CLASSES), np.float32)
    bias = np.zeros(CLASSES, np.float32)
    for step in range(STEPS):
        loss, grad_w, grad_b = gradients(weights, bias, points[train], labels[train])
        grad_w, grad_b = mt.grouped_allreduce([grad_w, grad_b], name="grads")
        weights -= LEARNING_RATE * grad_w
        bias -= LEARNING_RATE * grad_b
        if mt.rank() == 0 and step % 50 == 0:
            print(f"step {step:3d}  loss {mt.allreduce(np.float64(loss), name='loss'):.4f}")
        elif step % 50 == 0:
            mt.allreduce(np.float64(loss), name="loss")
    test = slice(split, SAMPLES)
    accuracy = ((points[test] @ weights + bias).argmax(axis=1) == labels[test]).mean()
    same = mt.allgather_object(weights.tobytes())
    if mt.rank() == 0:
        print(f"weights identical on all {mt.size()} ranks: {len(set(same)) == 1}")
        print(f"test accuracy: {accuracy:.2f}")


if __name__ == "__main__":
    main()
