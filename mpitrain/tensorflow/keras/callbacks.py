"""Keras callbacks for data-parallel training: broadcast, metric averaging, LR schedules."""

import warnings

import numpy as np
import tensorflow as tf

from mpitrain import horovod_names
from mpitrain.api import array_ops, basics
from mpitrain.api.agreement import require_same
from mpitrain.ops import Average
from mpitrain.tensorflow.broadcast import broadcast_variables
from mpitrain.tensorflow.keras.variables import (broadcast_compression_state,
                                                 optimizer_variables)


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Start every rank from root_rank's model and optimizer state.

    Broadcasts when training begins (Keras has built the model and optimizer
    by then), so the first step already starts from identical weights; an
    optimizer still unbuilt then is broadcast after the first batch. A
    DistributedOptimizer's compression state comes too: root_rank's PowerSGD
    Q on every rank; residuals stay each rank's own (see docs/compression.md).
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = set()
        if hasattr(local_variables, "assign"):
            local_variables = [local_variables]
        for variable in local_variables or []:
            self.register_local_var(variable)
        self.optimizer_done = False

    def register_local_var(self, var):
        """Leave ``var`` out of the broadcast: every rank keeps its own value."""
        if not hasattr(var, "assign"):
            raise ValueError("BroadcastGlobalVariablesCallback: a local variable must "
                             f"be a variable, got {type(var).__name__}")
        self.local_variables.add(id(var))

    def _broadcast(self, variables):
        broadcast_variables([v for v in variables if id(v) not in self.local_variables],
                            self.root_rank)

    def on_train_begin(self, logs=None):
        optimizer = optimizer_variables(getattr(self.model, "optimizer", None))
        self._broadcast(list(self.model.variables) + optimizer)
        self.optimizer_done = bool(optimizer)
        broadcast_compression_state(getattr(self.model, "optimizer", None), self.root_rank)

    def on_train_batch_end(self, batch, logs=None):
        if not self.optimizer_done:
            self._broadcast(optimizer_variables(self.model.optimizer))
            self.optimizer_done = True


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """Average the epoch's logged metrics over all ranks, in place.

    Put it before callbacks that read the metrics (ReduceLROnPlateau,
    TensorBoard, ModelCheckpoint) so that they see the averages.
    """

    def __init__(self, device=""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0
                       and np.issubdtype(np.asarray(v).dtype, np.number))
        values = np.array([float(logs[k]) for k in names], dtype=np.float64)
        # One vector, in sorted-name order: ranks logging different metrics
        # get a shape mismatch error instead of a hang.
        averaged = array_ops.allreduce(values, name=f"MetricAverageCallback.{epoch}",
                                       op=Average)
        logs.update(zip(names, averaged.tolist()))


class LearningRateScheduleCallback(tf.keras.callbacks.Callback):
    """Set lr = initial_lr * multiplier(epoch) from start_epoch until end_epoch.

    multiplier is a number (applied at the start of each epoch) or a function
    of the epoch; with staircase=False it is called every batch with a
    fractional epoch. momentum_correction scales the momentum by new/old lr
    for the batch where the lr changes (Goyal et al., 2017), where the
    optimizer keeps its momentum in a variable; Keras 3 optimizers compile
    momentum into the step as a constant, so there it is skipped with a warning.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None,
                 staircase=True, momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase if callable(multiplier) else True
        self.multiplier = multiplier if callable(multiplier) else (lambda _: multiplier)
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.epoch = 0
        self.momentum_to_restore = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._detect_steps_per_epoch()

    def _detect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"{type(self).__name__} cannot tell the number of steps "
                         "per epoch: pass steps_per_epoch=")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def _in_range(self):
        return self.epoch >= self.start_epoch and (
            self.end_epoch is None or self.epoch < self.end_epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_range():
            return
        if not self.staircase:
            self._set_lr(self.epoch + batch / self.steps_per_epoch)
        elif batch == 0:
            self._set_lr(self.epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self.momentum_to_restore is not None:
            self.model.optimizer.momentum.assign(self.momentum_to_restore)
            self.momentum_to_restore = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(_lr_variable(self.model.optimizer).numpy())

    def _set_lr(self, epoch):
        variable = _lr_variable(self.model.optimizer)
        old = float(variable.numpy())
        new = self.initial_lr * self.multiplier(epoch)
        variable.assign(new)
        if self.momentum_correction and old > 0:
            self._correct_momentum(new / old)

    def _correct_momentum(self, ratio):
        momentum = getattr(self.model.optimizer, "momentum", None)
        if hasattr(momentum, "assign"):
            self.momentum_to_restore = float(momentum.numpy())
            momentum.assign(self.momentum_to_restore * ratio)
        elif momentum and ratio != 1.0:
            if basics.rank() == 0:          # the same on every rank: say it once
                warnings.warn(
                    f"{type(self).__name__}: momentum_correction is skipped, because "
                    f"{type(self.model.optimizer).__name__} keeps momentum as a "
                    "constant in its compiled step; pass momentum_correction=False "
                    "to silence this", stacklevel=2)
            self.momentum_correction = False


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the lr from initial_lr / size to initial_lr over warmup_epochs (Goyal et al.).

    lr(e) = initial_lr / size * (e * (size - 1) / warmup_epochs + 1) at the
    fractional epoch e counted at the end of each batch, so the last batch of
    the warmup trains at initial_lr. With verbose=1, rank 0 says when the
    warmup has finished, as Horovod's does.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return (epoch * (basics.size() - 1) / warmup_epochs + 1) / basics.size()
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.end_epoch - 1 and basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_lr_variable(self.model.optimizer).numpy():g}.")


def _lr_variable(optimizer):
    lr = optimizer.learning_rate
    if not hasattr(lr, "assign"):
        raise ValueError(
            "the learning-rate callbacks set the optimizer's learning_rate "
            f"variable, but {type(optimizer).__name__} uses {lr!r}; pass a number "
            "as learning_rate")
    return lr


class LocalSGDCallback(tf.keras.callbacks.Callback):
    """Local SGD for model.fit: each rank steps on its own gradients and the
    ranks' weights are averaged every ``period`` batches.

    Compile with the plain optimizer, not DistributedOptimizer (which would
    average the gradients of every batch). For the first ``warmup_batches``
    batches the weights are averaged after every batch: with
    average_optimizer_state and SGD (with or without momentum) that equals
    averaging the gradients. average_optimizer_state also averages the
    optimizer's slots (its floating-point variables of one dimension or
    more: momentum, Adam's moments). The average is taken at the end of the
    batch, blocking, in one grouped allreduce; and once more when training
    ends, so that every rank holds the same model. Start from the same
    weights: BroadcastGlobalVariablesCallback(0) before this one.
    """

    def __init__(self, period, warmup_batches=0, average_optimizer_state=False):
        super().__init__()
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be a whole number >= 1, got {period!r}")
        if isinstance(warmup_batches, bool) or not isinstance(warmup_batches, int) \
                or warmup_batches < 0:
            raise ValueError("warmup_batches must be a whole number >= 0, got "
                             f"{warmup_batches!r}")
        self.period = period
        self.warmup_batches = warmup_batches
        self.average_optimizer_state = average_optimizer_state
        self.batches = 0

    def on_train_begin(self, logs=None):
        problem = None
        if getattr(self.model.optimizer, "_mpitrain_distributed", False):
            problem = ValueError(
                "LocalSGDCallback averages the weights every period batches, but "
                "the model's optimizer is a DistributedOptimizer, which averages "
                "the gradients of every batch: compile with the plain optimizer")
        # Ranks that average after different batches pair the averages of
        # different batches, and the last one waits forever.
        require_same("LocalSGDCallback", {
            "period": self.period, "warmup_batches": self.warmup_batches,
            "average_optimizer_state": self.average_optimizer_state},
            "LocalSGDCallback.settings", problem=problem)

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        local = self.batches - self.warmup_batches
        if local <= 0 or local % self.period == 0:
            self.average()

    def on_train_end(self, logs=None):
        self.average()

    def average(self):
        """Average the weights (and slots) across ranks now; every rank calls it."""
        variables = [v for v in self.model.weights if tf.as_dtype(v.dtype).is_floating]
        if self.average_optimizer_state:
            variables += [v for v in optimizer_variables(self.model.optimizer)
                          if tf.as_dtype(v.dtype).is_floating and len(v.shape) > 0]
        averaged = array_ops.grouped_allreduce([np.asarray(v.numpy()) for v in variables],
                                               name="LocalSGDCallback.average")
        for variable, value in zip(variables, averaged):
            variable.assign(value)


__getattr__ = horovod_names.module_getattr(
        __name__, "horovod.tensorflow.keras.callbacks", missing={
    "BestModelCheckpoint": (
        "is for Horovod's Spark estimator, which sets its file path: use "
        "keras.callbacks.ModelCheckpoint(path, save_best_only=True) on rank 0"),
    "is_version_greater_equal_than": horovod_names.INTERNAL_HELPER,
})
