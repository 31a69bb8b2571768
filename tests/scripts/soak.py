"""A long run: many steps of a small model, checking memory, handles and drift.

    soak.py STEPS OUT_DIR

The model's parameters are blocks of mixed sizes (a scalar to 1.1M values,
the largest beyond one 4 MiB chunk) and dtypes (float64, float32, float16,
bfloat16, int32, int64). Each step every rank computes the gradient of its
own loss, sum of |w - t|^2 / 2 with a target t that depends on the rank and
the step, submits the allreduces in its own random order and waits for them
in another, then applies the averages. Other collectives run every few
steps. Each rank writes OUT_DIR/rank<N>.json with its resident memory over
time, what the engine still holds at the end and a digest of its parameters.
"""

import gc
import hashlib
import json
import os
import random
import sys

import ml_dtypes
import numpy as np

import mpitrain as mt
from mpitrain.engine.handles import Handle

BLOCKS = {                       # name: (shape, dtype)
    "bias": ((1,), np.float64),
    "small": ((7,), np.float32),
    "embedding": ((100, 8), np.float16),
    "gate": ((500,), ml_dtypes.bfloat16),
    "dense": ((256, 64), np.float32),
    "large": ((1_100_000,), np.float32),
}
LEARNING_RATE = 0.05


def resident_kib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def handles_alive():
    return sum(isinstance(o, Handle) for o in gc.get_objects())


def engine_leftovers():
    """Entries the engine still holds in any process set (all should be empty)."""
    held = {}
    for set_id, controller in mt.api.basics.engine().controllers.items():
        for field in ("in_flight", "pending", "incoming", "_done"):
            count = len(getattr(controller, field))
            if count:
                held[f"set {set_id} {field}"] = count
    return held


def train(steps, rank, size):
    params = {name: np.zeros(shape, dtype) for name, (shape, dtype) in BLOCKS.items()}
    patterns = {name: np.cos(np.arange(np.prod(shape))).reshape(shape)
                for name, (shape, _) in BLOCKS.items()}
    order = random.Random(1000 + rank)
    samples_seen = np.zeros((), np.int64)
    label_counts = np.zeros(10, np.int32)
    memory = {}
    # Counting handles lists every object (CuPy, where installed, brings many):
    # once before the readings, so that the memory the list takes is in each.
    handles_alive()
    for step in range(steps):
        pull = (rank + 1) * np.cos(step / 50.0)
        gradients = {name: (params[name].astype(np.float32) - pull * patterns[name]
                            ).astype(params[name].dtype) for name in params}
        gradients["samples"] = np.array(16, np.int64)
        gradients["labels"] = np.bincount(np.arange(step, step + 16) % (rank + 3),
                                          minlength=10).astype(np.int32)
        names = list(gradients)
        order.shuffle(names)
        handles = {name: mt.allreduce_async(
            gradients[name], name=f"grad.{name}",
            op=mt.Sum if name in ("samples", "labels") else mt.Average)
            for name in names}
        order.shuffle(names)
        reduced = {name: mt.synchronize(handles[name]) for name in names}
        for name, value in params.items():
            value -= (LEARNING_RATE * reduced[name]).astype(value.dtype)
        samples_seen += reduced["samples"]
        label_counts += reduced["labels"]
        if step % 10 == 0:
            losses = mt.allgather(np.array([float(np.sum(gradients["small"] ** 2))]),
                                  name="losses")
            assert losses.shape == (size,)
            mt.broadcast(params["embedding"], step % size, name="resync.embedding")
        if step % 25 == 0:
            rows, _ = mt.alltoall(np.full((2 * size, 3), rank, np.float32), name="shuffle")
            assert sorted(set(rows[:, 0].tolist())) == list(range(size))
            part = mt.reducescatter(np.ones((size, 4), np.float16), op=mt.Sum,
                                    name="scatter")
            assert (part == size).all()
            mt.grouped_allreduce([params["bias"], params["small"]], name="check")
        if step % 100 == 0:
            assert mt.broadcast_object({"step": step}, root_rank=0)["step"] == step
        if step + 1 in (steps // 10, steps // 2, steps):
            gc.collect()
            memory[step + 1] = {"rss_kib": resident_kib(), "handles": handles_alive()}
    assert samples_seen == label_counts.sum() == 16 * size * steps
    return params, memory


def main():
    steps, out_dir = int(sys.argv[1]), sys.argv[2]
    mt.init()
    rank, size = mt.rank(), mt.size()
    params, memory = train(steps, rank, size)
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(params[name].tobytes())
    report = {"memory": memory, "leftovers": engine_leftovers(),
              "digest": digest.hexdigest(),
              "finite": all(np.isfinite(p.astype(np.float64)).all()
                            for p in params.values())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as stream:
        json.dump(report, stream)


if __name__ == "__main__":
    main()
