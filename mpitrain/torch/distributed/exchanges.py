"""reduce_scatter, all_to_all, gather and scatter of the "mpitrain" backend.

reduce_scatter is mpitrain's reducescatter where the op is SUM or AVG (its
ops), and an allreduce of which each rank keeps its part for MIN, MAX and
PRODUCT. gather and scatter are mpitrain alltoalls in which only the root
receives (gather) or only the root sends (scatter): no rank moves more than
torch's own backends would.
"""

import torch

from mpitrain.ops import Average, OpType, Sum
from mpitrain.torch import ops
from mpitrain.torch.distributed.reductions import mpitrain_op

ALLREDUCE, ALLTOALL, REDUCESCATTER = OpType.ALLREDUCE, OpType.ALLTOALL, OpType.REDUCESCATTER


def _matrix(group, input, call):
    """An input of reduce_scatter (a list of one tensor per rank, or one tensor
    of all of them) as a matrix with a row per rank."""
    if isinstance(input, (list, tuple)):
        if len(input) != group.size():
            raise ValueError(f"{call}: the input list holds {len(input)} tensors, one "
                             f"per rank of the group ({group.size()}) is needed")
        return torch.stack([t.reshape(-1) for t in input])
    if input.numel() % group.size():
        raise ValueError(f"{call}: the input's {input.numel()} elements do not split "
                         f"among {group.size()} ranks")
    return input.reshape(group.size(), -1)


def reduce_scatter(group, outputs, inputs, opts, call="dist.reduce_scatter"):
    """Reduce every rank's ``inputs`` and leave group rank r's part in ``outputs``."""
    outputs, inputs = list(outputs), list(inputs)
    count = None if len(inputs) == 1 else len(inputs)
    try:
        op, prescale, problem = *mpitrain_op(opts.reduceOp), None
    except ValueError as error:          # raised in submit: every rank hears of it
        op, prescale, problem = Sum, 1.0, error
    scatters = op in (Sum, Average)

    def submit(name):
        if problem is not None:
            raise problem
        matrices = [_matrix(group, input, call) for input in inputs]
        for output, matrix in zip(outputs, matrices):
            if output.numel() != matrix.shape[1]:
                raise ValueError(f"{call}: the output has {output.numel()} elements, "
                                 f"a rank's part has {matrix.shape[1]}")
        ps = group.process_set
        if scatters and count is None:
            return ops.reducescatter_async(matrices[0], name, op, ps, prescale)
        if scatters:
            return ops.grouped_reducescatter_async(matrices, name, op, ps, prescale)
        if count is None:
            return ops.allreduce_async(matrices[0], name=name, op=op,
                                       prescale_factor=prescale, process_set=ps)
        return ops.grouped_allreduce_async(matrices, name=name, op=op,
                                           prescale_factor=prescale, process_set=ps)

    def finish(result):
        parts = [result] if count is None else result
        for output, part in zip(outputs, parts):
            row = part[0] if scatters else part[group.rank()]
            output.copy_(row.view(output.shape))
    return group.start(call, REDUCESCATTER if scatters else ALLREDUCE, submit, finish,
                       outputs, count)


def _received(call, result, expected):
    """The rows received, after checking their counts against ``expected``."""
    rows, splits = result
    splits = splits.tolist()
    if expected is not None and splits != list(expected):
        raise ValueError(f"{call}: expected {list(expected)} from the group's ranks, "
                         f"they sent {splits}")
    return rows


def alltoall(group, outputs, inputs, call="dist.all_to_all"):
    """Send ``inputs[r]`` to group rank r; ``outputs[r]`` receives rank r's."""
    outputs, inputs = list(outputs), list(inputs)

    def submit(name):
        flat = torch.cat([t.reshape(-1) for t in inputs])
        return ops.alltoall_async(flat, [t.numel() for t in inputs], name,
                                  group.process_set)

    def finish(result):
        rows = _received(call, result, [t.numel() for t in outputs])
        for output, part in zip(outputs, rows.split([t.numel() for t in outputs])):
            output.copy_(part.view(output.shape))
    return group.start(call, ALLTOALL, submit, finish, outputs)


def alltoall_single(group, output, input, output_splits, input_splits,
                    call="dist.all_to_all_single"):
    """all_to_all of one tensor's rows: ``input_splits[r]`` rows go to rank r
    (equal parts where no splits are given)."""

    def submit(name):
        return ops.alltoall_async(input, list(input_splits) or None, name,
                                  group.process_set)

    def finish(result):
        expected = list(output_splits) or None
        output.copy_(_received(call, result, expected).view(output.shape))
    return group.start(call, ALLTOALL, submit, finish, [output])


def gather(group, output_lists, inputs, root, call="dist.gather"):
    """Group rank ``root`` receives every rank's ``inputs[0]`` in ``output_lists[0]``."""
    input, = inputs
    is_root = group.rank() == root

    def submit(name):
        splits = [0] * group.size()
        splits[root] = 1
        return ops.alltoall_async(input.reshape(1, -1), splits, name, group.process_set)

    def finish(result):
        if is_root:
            for output, row in zip(output_lists[0], result[0]):
                output.copy_(row.view(output.shape))
    results = output_lists[0] if is_root else []
    return group.start(call, ALLTOALL, submit, finish, list(results))


def scatter(group, outputs, input_lists, root, call="dist.scatter"):
    """Group rank r's ``outputs[0]`` receives rank ``root``'s ``input_lists[0][r]``."""
    output, = outputs

    def submit(name):
        if group.rank() == root:
            rows = torch.stack([t.reshape(-1) for t in input_lists[0]])
            splits = [1] * group.size()
        else:
            rows = output.new_empty((0, output.numel()))
            splits = [0] * group.size()
        return ops.alltoall_async(rows, splits, name, group.process_set)

    def finish(result):
        output.copy_(result[0].view(output.shape))
    return group.start(call, ALLTOALL, submit, finish, [output])
