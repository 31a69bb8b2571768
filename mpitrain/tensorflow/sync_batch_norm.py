"""SyncBatchNormalization: Keras batch normalization over the batch of every rank.

As mpitrain.torch.SyncBatchNorm: each rank sums its count, its values and
its squared deviations per channel (in float64), and one Sum allreduce,
whose gradient is registered, combines them, so batches may differ in size
between ranks and the backward pass is exact.
"""

import keras
import tensorflow as tf

from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Sum
from mpitrain.tensorflow.allreduce import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization (Keras 3) whose training statistics
    cover the batch of every rank of ``process_set``. Every rank must call
    the layer in training together, as a step of data-parallel training does.
    """

    def __init__(self, fused=False, process_set=global_process_set, **kwargs):
        if fused in (True, None):
            raise ValueError(f"SyncBatchNormalization does not support fused={fused}: "
                             "the statistics are combined across ranks in between")
        super().__init__(**kwargs)
        self.process_set = process_set

    def _moments(self, inputs, mask):
        if self.process_set.size() == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        values = tf.cast(inputs, tf.float64)
        if mask is None:
            weights = None
            count = tf.cast(tf.size(values) // tf.shape(values)[self.axis], tf.float64)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float64),
                                      tf.shape(values))
            values = values * weights
            count = tf.reduce_sum(weights[..., :1])
        total = tf.reduce_sum(values, axes, keepdims=True)
        local_mean = total / tf.maximum(count, 1.0)
        # Deviations around the local mean keep the precision that
        # E[x^2] - mean^2 would cancel away.
        deviations = tf.square(values - local_mean)
        if weights is not None:
            deviations = deviations * weights
        sum_of_squares = tf.reduce_sum(deviations, axes) + tf.reshape(total * local_mean, [-1])
        summed = allreduce(tf.concat([[count], tf.reshape(total, [-1]), sum_of_squares], 0),
                           op=Sum, process_set=self.process_set)
        channels = tf.shape(sum_of_squares)[0]
        everyone = summed[0]
        mean = summed[1:1 + channels] / everyone
        variance = tf.maximum(summed[1 + channels:] / everyone - mean * mean, 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
