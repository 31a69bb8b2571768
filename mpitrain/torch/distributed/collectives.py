"""all_reduce, broadcast, all_gather, reduce and barrier of the "mpitrain" backend.

Each is one call of mpitrain's torch adapter on the group's process set:
in place where mpitrain can write into the user's tensor (all_reduce,
broadcast), else into a result that ``finish`` copies where torch wants it.
"""

import torch

from mpitrain.ops import OpType, Sum
from mpitrain.torch import ops
from mpitrain.torch.distributed.reductions import mpitrain_op

ALLREDUCE, ALLGATHER, BROADCAST = OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST


def allreduce(group, tensors, opts, call="dist.all_reduce"):
    """Reduce ``tensors`` in place: one operation, or a group of them."""
    tensors = list(tensors)

    def submit(name):
        op, prescale = mpitrain_op(opts.reduceOp)
        if len(tensors) == 1:
            return ops.allreduce_async_(tensors[0], name=name, op=op,
                                        prescale_factor=prescale,
                                        process_set=group.process_set)
        return ops.grouped_allreduce_async_(tensors, name=name, op=op,
                                            prescale_factor=prescale,
                                            process_set=group.process_set)
    return group.start(call, ALLREDUCE, submit, results=tensors, count=_count(tensors))


def broadcast(group, tensors, opts, call="dist.broadcast"):
    """Overwrite ``tensors`` with those of group rank ``opts.rootRank``."""
    tensors = list(tensors)

    def submit(name):
        if len(tensors) != 1:
            raise ValueError(f"{call} takes one tensor per rank, got {len(tensors)}")
        return ops.broadcast_async_(tensors[0], group.global_rank(opts.rootRank),
                                    name=name, process_set=group.process_set)
    return group.start(call, BROADCAST, submit, results=tensors)


def _gather_rows(group, inputs, name):
    """Gather each of ``inputs`` as one row (mpitrain gathers along the first
    dimension): one operation, or a group of them."""
    if len(inputs) == 1:
        return ops.allgather_async(inputs[0].reshape(1, -1), name, group.process_set)
    return ops.grouped_allgather_async([t.reshape(1, -1) for t in inputs], name,
                                       group.process_set)


def _per_input(inputs, result):
    """The gathered rows of each input, whether one operation ran or a group."""
    return [result] if len(inputs) == 1 else result


def _count(inputs):
    return None if len(inputs) == 1 else len(inputs)


def allgather(group, output_lists, input_tensors, call="dist.all_gather"):
    """Fill ``output_lists[i][r]`` with group rank r's ``input_tensors[i]``."""
    inputs = list(input_tensors)

    def submit(name):
        _check_lists(call, group, output_lists, inputs)
        return _gather_rows(group, inputs, name)

    def finish(result):
        for outputs, rows in zip(output_lists, _per_input(inputs, result)):
            for output, row in zip(outputs, rows):
                output.copy_(row.view(output.shape))
    return group.start(call, ALLGATHER, submit, finish,
                       [t for outputs in output_lists for t in outputs], _count(inputs))


def _check_lists(call, group, output_lists, inputs):
    if len(output_lists) != len(inputs):
        raise ValueError(f"{call}: {len(inputs)} inputs but {len(output_lists)} "
                         "output lists")
    for outputs in output_lists:
        if len(outputs) != group.size():
            raise ValueError(f"{call}: an output list holds {len(outputs)} tensors, "
                             f"one per rank of the group ({group.size()}) is needed")


def allgather_into(group, outputs, inputs, call="dist.all_gather_into_tensor"):
    """Fill each of ``outputs`` with every group rank's input, in rank order."""
    outputs, inputs = list(outputs), list(inputs)

    def submit(name):
        for output, input in zip(outputs, inputs):
            if output.numel() != input.numel() * group.size():
                raise ValueError(f"{call}: the output has {output.numel()} elements; "
                                 f"{group.size()} ranks of {input.numel()} need "
                                 f"{input.numel() * group.size()}")
        return _gather_rows(group, inputs, name)

    def finish(result):
        for output, rows in zip(outputs, _per_input(inputs, result)):
            output.copy_(rows.view(output.shape))
    return group.start(call, ALLGATHER, submit, finish, outputs, _count(inputs))


def reduce(group, tensors, opts, call="dist.reduce"):
    """Reduce ``tensors[0]`` into group rank ``opts.rootRank``'s; the others keep theirs."""
    tensor, = tensors
    root = opts.rootRank == group.rank()

    def submit(name):
        op, prescale = mpitrain_op(opts.reduceOp)
        return ops.allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                   process_set=group.process_set)

    def finish(result):
        if root:
            tensor.copy_(result)
    return group.start(call, ALLREDUCE, submit, finish, [tensor])


def barrier(group, call="dist.barrier"):
    """Every rank of the group has come: a one-element sum, numbered like any call,
    so that a barrier one rank meets with another call fails as a mismatch."""
    token = torch.zeros(1, dtype=torch.int32)

    def submit(name):
        return ops.allreduce_async_(token, name=name, op=Sum,
                                    process_set=group.process_set)
    return group.start(call, ALLREDUCE, submit, results=[token])

