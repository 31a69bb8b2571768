"""Batch normalization with statistics over the whole batch of every rank.

Each rank sums its count, its values and its squared deviations per
channel, on the input's device; one autograd-aware Sum allreduce combines
them, so the backward pass sums the statistics' gradients across ranks as
the exact derivative requires.
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from mpitrain.api import array_ops
from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import OpType, Sum
from mpitrain.torch.autograd import allreduce


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the batch of every rank of ``process_set``, for inputs of
    shape (N, C, ...). Every rank must call forward (and backward) together.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        try:
            self._check_input_dim(input)
        except ValueError as error:
            if self._synchronizes():     # the others wait in the statistics' allreduce
                array_ops.fail(OpType.ALLREDUCE, None, self.process_set, "value",
                               f"SyncBatchNorm: {error}")
            raise
        average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:      # a cumulative moving average
                average_factor = 1.0 / float(self.num_batches_tracked)
        use_batch_statistics = self.training or self.running_mean is None
        if not self._synchronizes():
            with_running_stats = not self.training or self.track_running_stats
            return F.batch_norm(input, self.running_mean if with_running_stats else None,
                                self.running_var if with_running_stats else None,
                                self.weight, self.bias, use_batch_statistics,
                                average_factor, self.eps)
        shape = (1, -1) + (1,) * (input.dim() - 2)      # per channel, broadcastable
        mean, var, count = self._global_statistics(input, shape)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), average_factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype),
                                       average_factor)
        scale = torch.rsqrt(var + self.eps).to(input.dtype)
        if self.weight is not None:
            scale = scale * self.weight
        output = (input - mean.to(input.dtype).view(shape)) * scale.view(shape)
        if self.bias is not None:
            output = output + self.bias.view(shape)
        return output

    def _synchronizes(self):
        """Does forward combine statistics across ranks (one unnamed allreduce)?"""
        use_batch_statistics = self.training or self.running_mean is None
        return use_batch_statistics and self.process_set.size() > 1

    def _global_statistics(self, input, shape):
        """Mean and biased variance per channel over all ranks, and the count."""
        dims = [0] + list(range(2, input.dim()))
        local_count = input.numel() // input.shape[1]
        # In float64, and from deviations around the local mean, the sum of
        # squares keeps the precision that var = E[x^2] - mean^2 cancels.
        values = input.to(torch.float64)
        total = values.sum(dims)
        local_mean = total / max(local_count, 1)
        sum_of_squares = (((values - local_mean.view(shape)) ** 2).sum(dims)
                          + total * local_mean)
        count = torch.full((1,), float(local_count), dtype=torch.float64,
                           device=input.device)
        summed = allreduce(torch.cat([count, total, sum_of_squares]), op=Sum,
                           process_set=self.process_set)
        count = float(summed[0].detach())
        if count <= 1:
            raise ValueError("SyncBatchNorm needs more than 1 value per channel "
                             f"across all ranks in training, got {int(count)}")
        channels = input.shape[1]
        mean = summed[1:1 + channels] / count
        var = (summed[1 + channels:] / count - mean * mean).clamp(min=0)
        return mean, var, count
