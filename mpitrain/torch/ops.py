"""Horovod's asynchronous and in-place collectives on torch tensors.

Each ``*_async`` call returns a handle for ``poll`` and ``synchronize``.
In-place forms (trailing underscore) write the result into the tensor they
were given and return it; out-of-place forms return new tensors that share
memory with the core's result arrays. The autograd-aware synchronous forms
live in ``mpitrain.torch.autograd``.
"""

import numpy as np
import torch

from mpitrain.api import array_ops
from mpitrain.api.handles import synchronize
from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Average, OpType, Sum, resolve_op
from mpitrain.torch.tensors import TensorHandle, as_array, as_tensor


def _returns(tensor):
    return lambda _: tensor


def _as_tensors(arrays):
    return [as_tensor(a) for a in arrays]


def _input(tensor, what, kind, name, process_set, writes=False):
    """``tensor`` as an array; one that cannot be fails the operation on every
    rank, so that the other ranks do not wait for this one's submission."""
    try:
        return as_array(tensor, what, writes)
    except Exception as error:
        array_ops.fail(kind, name, process_set, *_problem(error))


def _arrays(tensors, what, kind, name, process_set, writes=False):
    """The tensors of a grouped call as arrays; one that cannot be fails every
    member of the group on every rank."""
    tensors = list(tensors)
    try:
        return [as_array(t, f"{what}[{i}]", writes) for i, t in enumerate(tensors)]
    except Exception as error:
        array_ops.fail(kind, name, process_set, *_problem(error), count=len(tensors))


def _problem(error):
    """(error kind, message) of a tensor that could not be converted."""
    if isinstance(error, TypeError):
        return "type", str(error)
    return "value", f"{type(error).__name__}: {error}"


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Start reducing ``tensor`` across the set into a new tensor."""
    array = _input(tensor, "allreduce input", OpType.ALLREDUCE, name, process_set)
    handle = array_ops.allreduce_async(array, average, name, op, prescale_factor,
                                       postscale_factor, process_set)
    return TensorHandle(handle, as_tensor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Start reducing ``tensor`` across the set, in place."""
    array = _input(tensor, "allreduce input", OpType.ALLREDUCE, name, process_set,
                   writes=True)
    handle = array_ops.allreduce_async(array, average, name, op, prescale_factor,
                                       postscale_factor, process_set, output=array)
    return TensorHandle(handle, _returns(tensor))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None,
                            prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    handle = array_ops.grouped_allreduce_async(
        _arrays(tensors, "grouped_allreduce input", OpType.ALLREDUCE, name, process_set),
        average, name, op,
        prescale_factor, postscale_factor, process_set)
    return TensorHandle(handle, _as_tensors)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None,
                             prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    tensors = list(tensors)
    arrays = _arrays(tensors, "grouped_allreduce input", OpType.ALLREDUCE, name,
                     process_set, writes=True)
    handle = array_ops.grouped_allreduce_async(arrays, average, name, op,
                                               prescale_factor, postscale_factor,
                                               process_set, outputs=arrays)
    return TensorHandle(handle, _returns(tensors))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op,
                                                prescale_factor, postscale_factor,
                                                process_set))


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` along the first dimension."""
    array = _input(tensor, "allgather input", OpType.ALLGATHER, name, process_set)
    handle = array_ops.allgather_async(array, name, process_set)
    return TensorHandle(handle, as_tensor)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    handle = array_ops.grouped_allgather_async(
        _arrays(tensors, "grouped_allgather input", OpType.ALLGATHER, name, process_set),
        name, process_set)
    return TensorHandle(handle, _as_tensors)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start sending root_rank's ``tensor`` to every rank, into a new tensor."""
    array = _input(tensor, "broadcast input", OpType.BROADCAST, name, process_set)
    handle = array_ops.broadcast_async(array, root_rank, name, process_set)
    return TensorHandle(handle, as_tensor)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` with root_rank's, in place."""
    array = _input(tensor, "broadcast input", OpType.BROADCAST, name, process_set,
                   writes=True)
    handle = array_ops.broadcast_async(array, root_rank, name, process_set,
                                       output=array)
    return TensorHandle(handle, _returns(tensor))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def _received(result):
    output, received_splits = result
    return as_tensor(output), torch.from_numpy(received_splits.astype(np.int32))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[i]`` rows to rank i; the result is (output, received splits)."""
    if isinstance(splits, torch.Tensor):
        splits = np.asarray(splits.detach().cpu().tolist())   # numbers, read on the host
    array = _input(tensor, "alltoall input", OpType.ALLTOALL, name, process_set)
    handle = array_ops.alltoall_async(array, splits, name, process_set)
    return TensorHandle(handle, _received)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Start reducing ``tensor`` and scattering its rows; low ranks get any extra row."""
    array = _input(tensor, "reducescatter input", OpType.REDUCESCATTER, name, process_set)
    handle = array_ops.reducescatter_async(array, op, name, process_set, prescale_factor,
                                           postscale_factor)
    return TensorHandle(handle, as_tensor)


def grouped_reducescatter_async(tensors, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    handle = array_ops.grouped_reducescatter_async(
        _arrays(tensors, "grouped_reducescatter input", OpType.REDUCESCATTER, name,
                process_set), op, name, process_set,
        prescale_factor, postscale_factor)
    return TensorHandle(handle, _as_tensors)


def join(device=-1):
    """Declare this rank out of data; returns the rank that joined last.

    Until every rank has joined, this rank contributes zeros to the others'
    allreduces. ``device`` is accepted for Horovod compatibility.
    """
    return array_ops.join()


class SparseHandle:
    """The pending sum of sparse COO tensors; calling it waits, like Horovod's."""

    __slots__ = ("_handle", "_like", "_divisor")

    def __init__(self, handle, like, divisor):
        self._handle = handle
        self._like = like
        self._divisor = divisor

    def done(self):
        return self._handle.done()

    def wait(self):
        indices, values = self._handle.wait()
        if self._divisor != 1:
            values = values / self._divisor
        return torch.sparse_coo_tensor(indices.t(), values, self._like.shape,
                                       dtype=self._like.dtype)

    __call__ = wait


def sparse_allreduce_async(tensor, name=None, op=Average,
                           process_set=global_process_set):
    """Start summing (or averaging) a sparse COO tensor across the set.

    Every rank's indices and values are gathered, so the result holds all of
    them, uncoalesced: entries at the same index add up. The handle is
    callable, as in Horovod, and works with ``synchronize``.
    """
    op = resolve_op(op, None)
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async supports op=Average and op=Sum, "
                         f"got {op.name.capitalize()}")
    if not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async takes a sparse COO tensor; use "
                        "allreduce_async for dense tensors")
    # allgather concatenates along the first dimension: one row per entry
    indices = tensor._indices().t().contiguous()
    handle = grouped_allgather_async([indices, tensor._values()], name, process_set)
    return SparseHandle(handle, tensor, process_set.size() if op == Average else 1)
