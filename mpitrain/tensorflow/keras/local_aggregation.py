"""backward_passes_per_step: sum gradients locally, communicate every N steps."""

import tensorflow as tf


class LocalAggregation:
    """Sums each variable's gradients over ``passes`` steps, then applies once.

    The accumulators are plain tf.Variables (not optimizer state, so not
    saved). On the steps in between, only the optimizer's iteration count
    advances, as in Horovod, so learning-rate schedules see every step.
    """

    def __init__(self, passes, average):
        self.passes = passes
        self.average = average
        self.counter = None
        self.sums = None

    def _build(self, gradients):
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                       name="mpitrain_local_steps")
            self.sums = [None if g is None else
                         tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                     name="mpitrain_local_gradient_sum")
                         for g in gradients]

    def apply(self, optimizer, gradients, variables, reduce_and_apply):
        # Summed as dense tensors: a sum of IndexedSlices keeps growing.
        gradients = [None if g is None else tf.convert_to_tensor(g) for g in gradients]
        if self.sums is None:
            self._build(gradients)
        if len(self.sums) != len(gradients):
            raise ValueError(
                f"backward_passes_per_step: this step has {len(gradients)} gradients "
                f"where earlier steps had {len(self.sums)}")
        for total, gradient in zip(self.sums, gradients):
            if total is not None:
                total.assign_add(gradient)
        step = self.counter.assign_add(1)

        def communicate_and_apply():
            scale = 1.0 / self.passes if self.average else 1.0
            reduce_and_apply([None if t is None else t.read_value() * scale
                              for t in self.sums])
            for total in self.sums:
                if total is not None:
                    total.assign(tf.zeros_like(total))
            self.counter.assign(0)
            return tf.constant(True)

        def count_step():
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        # Inside tf.function, automatic control dependencies run each branch's
        # variable reads and writes in program order.
        return tf.cond(step >= self.passes, communicate_and_apply, count_step)
