"""Out-of-place collectives that autograd can differentiate, as Horovod defines them.

Backward passes (names of the backward collectives are the forward name
plus ``.grad``; an unnamed forward gets its automatic name before it runs,
so that a backward pass on autograd's own thread needs no name of its own):
- allreduce: the same allreduce (op and scale factors) of the gradient;
- allgather: the gradient averaged over the set, sliced at this rank's rows;
- broadcast: the gradient averaged over the set on the root, zeros elsewhere;
- alltoall: an alltoall of the gradient that sends every row back;
- reducescatter: the gradients gathered, times the scale factors (and 1/size
  for Average).
Averaging in allgather and broadcast follows Horovod; the exact derivative
would sum.
"""

import torch

from mpitrain.api import array_ops, names
from mpitrain.api.handles import synchronize
from mpitrain.api.process_sets import global_process_set, is_root
from mpitrain.errors import not_a_cast_compressor
from mpitrain.ops import Average, OpType, resolve_op
from mpitrain.torch import ops
from mpitrain.torch.compression import Compression, GradientCompressor


def _grad_name(name):
    return names.derived(name, ".grad")


def _named(name, kind, process_set):
    return array_ops.automatic_name(kind, process_set) if name is None else name


def _row_offsets(rows, name, process_set):
    """Where this rank's rows start in allgather results of tensors with ``rows`` rows."""
    counts = synchronize(ops.allgather_async(torch.tensor([rows], dtype=torch.int64),
                                             names.derived(name, ".grad.rows"),
                                             process_set))
    return counts[:process_set.rank()].sum(dim=0).tolist()


def _cast_only(compression, call):
    if isinstance(compression, GradientCompressor):
        raise not_a_cast_compressor(call, compression)


def _compress_all(compression, tensors):
    pairs = [compression.compress(t) for t in tensors]
    return [t for t, _ in pairs], [c for _, c in pairs]


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (name, op, prescale_factor, postscale_factor, process_set)
        return synchronize(ops.allreduce_async(tensor, None, name, op, prescale_factor,
                                               postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(ops.allreduce_async(grad, None, _grad_name(name), op,
                                                  prescale, postscale, process_set))
        return reduced, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (name, op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(ops.grouped_allreduce_async(
            tensors, None, name, op, prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(ops.grouped_allreduce_async(
            grads, None, _grad_name(name), op, prescale, postscale, process_set))
        return (None,) * 5 + tuple(reduced)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        handle = ops.allgather_async(tensor, name, process_set)    # checks the input
        ctx.args = (tensor.shape[0], name, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad):
        rows, name, process_set = ctx.args
        averaged = synchronize(ops.allreduce_async(grad, None, _grad_name(name), Average,
                                                   process_set=process_set))
        offset, = _row_offsets([rows], name, process_set)
        return averaged.narrow(0, offset, rows), None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        handle = ops.grouped_allgather_async(tensors, name, process_set)  # checks them
        ctx.args = ([t.shape[0] for t in tensors], name, process_set)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        rows, name, process_set = ctx.args
        averaged = synchronize(ops.grouped_allreduce_async(
            grads, None, _grad_name(name), Average, process_set=process_set))
        offsets = _row_offsets(rows, name, process_set)
        return (None, None) + tuple(g.narrow(0, o, r)
                                    for g, o, r in zip(averaged, offsets, rows))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, name, process_set)
        return synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        root_rank, name, process_set = ctx.args
        averaged = synchronize(ops.allreduce_async(grad, None, _grad_name(name), Average,
                                                   process_set=process_set))
        if not is_root(root_rank, process_set):
            averaged.zero_()
        return averaged, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(ops.alltoall_async(tensor, splits, name,
                                                          process_set))
        ctx.args = (received, name, process_set)
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _):
        received, name, process_set = ctx.args
        returned, _ = synchronize(ops.alltoall_async(grad, received, _grad_name(name),
                                                     process_set))
        return returned, None, None, None


def _scatter_grad_factor(op, prescale, postscale, process_set):
    return prescale * postscale / (process_set.size() if op == Average else 1)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (name, _scatter_grad_factor(op, prescale_factor, postscale_factor,
                                               process_set), process_set)
        return synchronize(ops.reducescatter_async(tensor, name, op, process_set,
                                                   prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        name, factor, process_set = ctx.args
        gathered = synchronize(ops.allgather_async(grad, _grad_name(name), process_set))
        return gathered.mul_(factor), None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (name, _scatter_grad_factor(op, prescale_factor, postscale_factor,
                                               process_set), process_set)
        return tuple(synchronize(ops.grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        name, factor, process_set = ctx.args
        gathered = synchronize(ops.grouped_allgather_async(grads, _grad_name(name),
                                                           process_set))
        return (None,) * 5 + tuple(g.mul_(factor) for g in gathered)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across the set (Average by default) into a new tensor."""
    _cast_only(compression, "allreduce")
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, _named(name, OpType.ALLREDUCE, process_set),
                               resolve_op(op, average),
                               prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    _cast_only(compression, "grouped_allreduce")
    compressed, contexts = _compress_all(compression, tensors)
    reduced = _GroupedAllreduce.apply(_named(name, OpType.ALLREDUCE, process_set),
                                      resolve_op(op, average), prescale_factor,
                                      postscale_factor, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension."""
    return _Allgather.apply(tensor, _named(name, OpType.ALLGATHER, process_set),
                            process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return list(_GroupedAllgather.apply(_named(name, OpType.ALLGATHER, process_set),
                                        process_set, *tensors))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return root_rank's ``tensor`` on every rank, as a new tensor."""
    return _Broadcast.apply(tensor, root_rank, _named(name, OpType.BROADCAST, process_set),
                            process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows to rank i (equal parts without splits).

    Returns the received rows; with ``splits``, returns (rows, received splits).
    """
    output, received = _Alltoall.apply(tensor, splits,
                                       _named(name, OpType.ALLTOALL, process_set),
                                       process_set)
    return output if splits is None else (output, received)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` across the set and keep this rank's rows of the result."""
    _cast_only(compression, "reducescatter")
    compressed, ctx = compression.compress(tensor)
    scattered = _Reducescatter.apply(compressed,
                                     _named(name, OpType.REDUCESCATTER, process_set),
                                     resolve_op(op, None), process_set,
                                     prescale_factor, postscale_factor)
    return compression.decompress(scattered, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    _cast_only(compression, "grouped_reducescatter")
    compressed, contexts = _compress_all(compression, tensors)
    scattered = _GroupedReducescatter.apply(_named(name, OpType.REDUCESCATTER, process_set),
                                            resolve_op(op, None), process_set,
                                            prescale_factor, postscale_factor,
                                            *compressed)
    return [compression.decompress(t, c) for t, c in zip(scattered, contexts)]
