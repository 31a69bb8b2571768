"""Executing responses: packing, the MPI call, scaling and unpacking.

Every rank runs the same responses in the same order. ``entries`` maps a
name to this rank's submission; a joined rank has none for an allreduce and
contributes zeros.
"""

import math

import numpy as np

from mpitrain import arrays, dtypes
from mpitrain.channel import as_bytes
from mpitrain.ops import OpType, ReduceOp


class Executor:
    def __init__(self, channel, buffers, finish, timeline):
        self.channel = channel
        self.buffers = buffers
        self.finish = finish          # finish(entry, value)
        self.timeline = timeline      # holder with .current: Timeline or None

    def run(self, group, entries):
        response = group.responses[0]
        kind = response.kind
        if kind == OpType.ALLREDUCE:
            yield from self._traced(group.names, "ALLREDUCE",
                                    self._allreduce(group, entries))
            return
        entry = entries[response.name]
        body = {OpType.ALLGATHER: self._allgather,
                OpType.BROADCAST: self._broadcast,
                OpType.ALLTOALL: self._alltoall,
                OpType.REDUCESCATTER: self._reducescatter}[kind]
        yield from self._traced(group.names, kind.name, body(response, entry))

    def _traced(self, names, label, body):
        timeline = self.timeline.current
        if timeline is None:
            yield from body
            return
        timeline.begin(names, label)
        yield from body
        timeline.end(names)

    def _activity(self, names, label, body):
        timeline = self.timeline.current
        if timeline is not None:
            timeline.begin(names, label)
        yield from body
        if timeline is not None:
            timeline.end(names)

    def _scale_after(self, response):
        """The factor applied after the reduction; Average divides by size."""
        factor = response.postscale
        if response.op == ReduceOp.AVERAGE:
            factor /= self.channel.size
        return factor

    def _allreduce(self, group, entries):
        first = group.responses[0]
        dtype = dtypes.BY_CODE[first.dtype]
        wire = dtype.reduce_as
        factor = self._scale_after(first)
        members = [entries.get(name) for name in group.names]
        entry = members[0]
        if (len(members) == 1 and entry is not None and entry.dtype is dtype
                and dtype.numpy == wire):
            yield from self._allreduce_alone(first, entry, factor)
            return
        whole = self.buffers.get(wire, group.total)
        buffer = whole[:group.total]
        names = group.names
        timeline = self.timeline.current
        if timeline is not None:
            timeline.begin(names, "MEMCPY_IN_FUSION_BUFFER")
        sources = [np.zeros(count, wire) if member is None
                   else member.input if member.input.ndim == 1
                   else member.input.reshape(-1)
                   for member, count in zip(members, group.counts)]
        np.concatenate(sources, out=buffer, casting="unsafe")
        if first.prescale != 1.0:
            scale_into(buffer, first.prescale, buffer)
        if timeline is not None:
            timeline.end(names)
        yield from self._activity(names, "MPI_ALLREDUCE",
                                  self.channel.allreduce(buffer, first.op))
        if timeline is not None:
            timeline.begin(names, "MEMCPY_OUT_FUSION_BUFFER")
        for response, member, view in zip(group.responses, members, group.views(whole)):
            if member is None:
                continue
            output = member.output
            if output is None:
                output = arrays.empty(response.shape, member.dtype.numpy)
            scale_into(view, factor, output)
            self.finish(member, output)
        if timeline is not None:
            timeline.end(names)

    def _allreduce_alone(self, response, entry, factor):
        """One tensor: reduce in its output directly, without the fusion buffer."""
        output = entry.output
        if output is not None and not output.flags.c_contiguous:
            output = None
        if output is None:
            output = arrays.empty(response.shape, entry.dtype.numpy)
        prescale = response.prescale
        if output is not entry.input and _scales_early(response, entry.dtype):
            # Scale in the copy that happens anyway, not in a pass of its own.
            prescale, factor = prescale * factor, 1.0
        if output is not entry.input or prescale != 1.0:
            scale_into(entry.input, prescale, output)
        scale = None if factor == 1.0 else (lambda chunk: scale_into(chunk, factor, chunk))
        yield from self.channel.allreduce(output.reshape(-1), response.op, scale)
        if entry.output is not None and output is not entry.output:
            np.copyto(entry.output, output)
            output = entry.output
        self.finish(entry, output)

    def _allgather(self, response, entry):
        row = math.prod(response.shape) * entry.dtype.numpy.itemsize
        output = arrays.empty((sum(response.first_dims),) + response.shape,
                              entry.dtype.numpy)
        send = np.ascontiguousarray(entry.input)
        yield from self.channel.allgatherv(
            as_bytes(send), as_bytes(output), [d * row for d in response.first_dims])
        self.finish(entry, output)

    def _broadcast(self, response, entry):
        root = response.root == self.channel.rank
        target = entry.output
        if target is None:
            target = arrays.empty(response.shape, entry.dtype.numpy)
            if root:
                np.copyto(target, entry.input)
        elif root and target is not entry.input:
            np.copyto(target, entry.input)
        staging = target if target.flags.c_contiguous else np.ascontiguousarray(target)
        yield from self.channel.bcast(as_bytes(staging), response.root)
        if staging is not target:
            np.copyto(target, staging)
        self.finish(entry, target)

    def _alltoall(self, response, entry):
        send_rows = entry.splits
        receive_rows = np.empty_like(send_rows)
        yield from self.channel.alltoall(send_rows, receive_rows)
        trailing = entry.input.shape[1:]
        row = math.prod(trailing) * entry.dtype.numpy.itemsize
        output = arrays.empty((int(receive_rows.sum()),) + trailing, entry.dtype.numpy)
        send = np.ascontiguousarray(entry.input)
        yield from self.channel.alltoallv(
            as_bytes(send), (send_rows * row).tolist(),
            as_bytes(output), (receive_rows * row).tolist())
        self.finish(entry, (output, receive_rows))

    def _reducescatter(self, response, entry):
        dtype = entry.dtype
        wire = dtype.reduce_as
        rows = scatter_rows(response.shape[0], self.channel.size)
        row = math.prod(response.shape[1:])
        counts = [n * row for n in rows]
        send = self.buffers.get(wire, sum(counts))[:sum(counts)].reshape(response.shape)
        scale_into(entry.input, response.prescale, send)
        received = np.empty(counts[self.channel.rank], dtype=wire)
        yield from self.channel.reduce_scatter(send.reshape(-1), received, counts,
                                               response.op)
        output = arrays.empty((rows[self.channel.rank],) + response.shape[1:],
                              dtype.numpy)
        scale_into(received.reshape(output.shape), self._scale_after(response), output)
        self.finish(entry, output)


def _scales_early(response, dtype):
    """May the factor applied after a sum move before it? Floats only: integer
    averages truncate the sum, and Min/Max/Product do not commute with it."""
    return (response.op in (ReduceOp.SUM, ReduceOp.AVERAGE)
            and dtype.numpy.kind == "f" and dtype.numpy == dtype.reduce_as)


def scale_into(source, factor, out):
    """out = source * factor, computed in the wider float type, cast to out."""
    if factor == 1.0:
        np.copyto(out, source, casting="unsafe")
    elif out.dtype.kind == "f" and out.dtype.itemsize > source.dtype.itemsize:
        np.multiply(source, factor, out=out, dtype=out.dtype, casting="unsafe")
    else:
        np.multiply(source, factor, out=out, casting="unsafe")


def scatter_rows(first_dim, size):
    """Rows each rank receives from reducescatter: even, extras to low ranks."""
    base, extra = divmod(first_dim, size)
    return [base + (1 if rank < extra else 0) for rank in range(size)]
