"""The small Keras model the Keras tests train (import it after importorskip)."""

import keras

import mpitrain.tensorflow.keras as hvd


def make_model(seed):
    """5 inputs -> Dense 8 (tanh) -> Dense 2, its weights drawn from ``seed``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)])


def compiled_model(seed):
    """make_model(seed), compiled for mse with a distributed Adam."""
    model = make_model(seed)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse", jit_compile=False)
    return model
