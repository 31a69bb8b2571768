"""Horovod's ``hvd.elastic`` for PyTorch.

``TorchState(model, optimizer, sampler=..., epoch=0, ...)`` commits and
restores models, optimizers and ElasticSamplers given as arguments along
with plain values; ``run`` is mpitrain.api.elastic.run (see there, and
docs/fault-tolerance.md for what survives and what does not).
"""

import copy
import math

import numpy as np
import torch

from mpitrain.api import basics
from mpitrain.api.elastic import HostsUpdatedInterrupt, State, run
from mpitrain.api.objects import broadcast_object
from mpitrain.torch.functions import broadcast_optimizer_state, broadcast_parameters
from mpitrain.torch.optimizers.distributed import _DistributedOptimizer
from mpitrain.torch.optimizers.sharded import state_everywhere
from mpitrain.torch.tensors import as_array, as_tensor

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "State", "TorchState", "run"]


class TorchState(State):
    """Models, optimizers, ElasticSamplers and plain values, committed together.

    Every argument becomes an attribute (``state.model``, ``state.epoch``).
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        self._handled = {}
        for name, value in list(kwargs.items()):
            handler = _handler_for(value)
            if handler is not None:
                self._handled[name] = handler
                setattr(self, name, kwargs.pop(name))
        super().__init__(**kwargs)

    def save(self):
        for handler in self._handled.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handled.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handled.values():
            handler.sync()
        super().sync()

    def _snapshot(self):
        return {**super()._snapshot(), "handled": {
            name: _arrays_of(handler.saved) for name, handler in self._handled.items()}}

    def _load_snapshot(self, snapshot):
        for name, handler in self._handled.items():
            handler.saved = _tensors_of(snapshot["handled"][name])
        super()._load_snapshot(snapshot)


def _arrays_of(value):
    """``value`` (a state_dict) with its CPU tensors as numpy arrays over the
    same memory: pickle writes those to the hosts' files without a copy, and
    mostly without holding the interpreter's lock, where tensors pickle
    through a copy of each (measured: 2.7 s against 3.9 s for 1.1 GiB, and
    5.3 s against 8.7 s to read it back). _tensors_of turns them back."""
    return _leaves_mapped(value, _array_of)


def _tensors_of(value):
    return _leaves_mapped(value, lambda leaf: as_tensor(leaf)
                          if isinstance(leaf, np.ndarray) else leaf)


def _array_of(leaf):
    if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
        try:
            return as_array(leaf)
        except TypeError:               # a dtype numpy has no type for (bool)
            pass
    return leaf


def _leaves_mapped(value, convert):
    """``value`` with each leaf of its dicts, lists and tuples passed through convert."""
    if isinstance(value, dict):
        return {key: _leaves_mapped(item, convert) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_leaves_mapped(item, convert) for item in value)
    return convert(value)


def _handler_for(value):
    if isinstance(value, torch.nn.Module):
        return _ModuleHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class _ModuleHandler:
    def __init__(self, module):
        self.module = module

    def save(self):
        self.saved = {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def restore(self):
        self.module.load_state_dict(self.saved)

    def sync(self):
        broadcast_parameters(self.module.state_dict(), root_rank=0)


class _OptimizerHandler:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def save(self):
        self.saved = copy.deepcopy(state_everywhere(self.optimizer))

    def restore(self):
        self.optimizer.load_state_dict(copy.deepcopy(self.saved))
        if isinstance(self.optimizer, _DistributedOptimizer):
            # A step that failed between backward and step() left gradients in
            # flight; the engine is stopped next, which fails their handles.
            self.optimizer._start_over()

    def sync(self):
        broadcast_optimizer_state(self.optimizer, root_rank=0)


class _SamplerHandler:
    def __init__(self, sampler):
        self.sampler = sampler

    def save(self):
        self.saved = self.sampler.state_dict()

    def restore(self):
        self.sampler.load_state_dict(self.saved)

    def sync(self):
        self.sampler.load_state_dict(broadcast_object(self.sampler.state_dict(), 0,
                                                      "mpitrain.elastic.sampler"))


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the ranks and counts what was processed, as Horovod's.

    Call ``record_batch(batch_idx, batch_size)`` after each batch and
    ``set_epoch(epoch)`` at the end of each epoch (at the end, so that an
    epoch cut short is not started over). The sampler counts the samples
    every rank together has processed this epoch (``processed_num``), which
    is the same on every rank: a commit holds the same sampler everywhere,
    so one rank's copy of it is enough to resume. After a reset or a restart
    the epoch's first ``processed_num`` samples are skipped and the rest are
    dealt out to the ranks there are now. The order depends on seed and
    epoch only (with shuffle=True), so it is the same everywhere.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.indices = []
        self.reset()

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Count a batch of ``batch_size`` as done on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def get_indices(self, batch_idx, batch_size):
        """This rank's indices of batch ``batch_idx`` in the current pass."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self):
        self.rank, self.num_replicas = basics.rank(), basics.size()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = [order[i] for i in torch.randperm(len(order), generator=generator)]
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        order = list(self.remaining_indices)
        if order:                           # repeat some so every rank gets as many
            order = (order * math.ceil(self.total_size / len(order)))[:self.total_size]
        self.indices = order[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
