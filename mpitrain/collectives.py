"""Executing responses: packing, the MPI call, scaling and unpacking.

Every rank runs the same responses in the same order. ``entries`` maps a
name to this rank's submission; a joined rank has none for an allreduce and
contributes zeros. Allreduces run where their arrays live (host or CUDA
device, through mpitrain.arrays); the other collectives move device arrays
through host memory and share the host code.
"""

import math
import types

import numpy as np

from mpitrain import arrays, dtypes
from mpitrain.channel import as_bytes
from mpitrain.ops import OpType, ReduceOp


class Executor:
    def __init__(self, channel, buffers, finish, timeline, devices):
        self.channel = channel
        self.buffers = buffers
        self.finish = finish          # finish(entry, value)
        self.timeline = timeline      # holder with .current: Timeline or None
        self.devices = devices        # how device buffers reach MPI: DeviceTransport

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
        if entry.device < 0:
            result = yield from self._traced(group.names, kind.name, body(response, entry))
        else:
            result = yield from self._traced(group.names, kind.name,
                                             self._through_host(body, response, entry))
        self.finish(entry, result)

    def _traced(self, names, label, body):
        timeline = self.timeline.current
        if timeline is not None:
            timeline.begin(names, label)
        result = yield from body
        if timeline is not None:
            timeline.end(names)
        return result

    def _scale_after(self, response):
        """The factor applied after the reduction; Average divides by size."""
        factor = response.postscale
        if response.op == ReduceOp.AVERAGE:
            factor /= self.channel.size
        return factor

    # -- allreduce, on the host or on a device -----------------------------------

    def _allreduce(self, group, entries):
        first = group.responses[0]
        dtype = dtypes.BY_CODE[first.dtype]
        wire = dtype.reduce_as
        factor = self._scale_after(first)
        members = [entries.get(name) for name in group.names]
        entry = members[0]
        backend = (arrays.of(entry.input) if entry is not None
                   else arrays.HOST if first.device < 0 else arrays.current_device())
        backend.wait_for_inputs(members)
        if (len(members) == 1 and entry is not None and entry.dtype is dtype
                and dtype.numpy == wire):
            yield from self._allreduce_alone(first, entry, factor, backend)
            return
        whole = self.buffers.get(wire, group.total, backend)
        buffer = whole[:group.total]
        names = group.names
        sources = [backend.zeros(count, wire) if member is None else member.input
                   for member, count in zip(members, group.counts)]
        yield from self._traced(names, "MEMCPY_IN_FUSION_BUFFER",
                                _now(backend.pack, sources, buffer, first.prescale))
        yield from self._traced(names, "MPI_ALLREDUCE",
                                self._reduce(buffer, first.op, None, backend))
        done, views, outputs, offsets = [], [], [], []
        for response, member, view, start in zip(group.responses, members,
                                                 group.views(whole), group.starts):
            if member is None:
                continue
            output = member.output
            if output is None:
                output = backend.empty(response.shape, member.dtype.numpy)
            done.append((member, output))
            views.append(view)
            outputs.append(output)
            offsets.append(start)
        yield from self._traced(names, "MEMCPY_OUT_FUSION_BUFFER",
                                _now(backend.unpack, buffer, offsets, views, outputs,
                                     factor))
        backend.settle()
        for member, output in done:
            self.finish(member, output)

    def _allreduce_alone(self, response, entry, factor, backend):
        """One tensor: reduce in its output directly, without the fusion buffer."""
        output = entry.output
        if output is not None and not output.flags.c_contiguous:
            output = None
        if output is None:
            output = backend.empty(response.shape, entry.dtype.numpy)
        prescale = response.prescale
        if output is not entry.input and _scales_early(response, entry.dtype):
            # Scale in the copy that happens anyway, not in a pass of its own.
            prescale, factor = prescale * factor, 1.0
        if output is not entry.input or prescale != 1.0:
            backend.scale_into(entry.input, prescale, output)
        scale = (None if factor == 1.0 else
                 (lambda chunk: backend.scale_into(chunk, factor, chunk)))
        yield from self._traced([response.name], "MPI_ALLREDUCE",
                                self._reduce(output.reshape(-1), response.op, scale,
                                             backend))
        if entry.output is not None and output is not entry.output:
            backend.scale_into(output, 1.0, entry.output)
            output = entry.output
        backend.settle()
        self.finish(entry, output)

    def _reduce(self, buffer, op, each, backend):
        """Allreduce a 1-D buffer in place, then run each(chunk) on the result."""
        if backend is arrays.HOST:
            yield from self.channel.allreduce(buffer, op, each)
            return
        nccl = yield from self.devices.nccl_for(buffer.dtype, self.channel, backend)
        if nccl is not None:
            with backend.active():
                nccl.allreduce(buffer, op, backend.stream)
        elif self.devices.cuda_aware:
            backend.settle()          # MPI reads device memory: it must be ready
            yield from self.channel.allreduce(buffer, op)
        else:
            host = backend.pinned(buffer.dtype, buffer.size)
            backend.to_host(buffer, host)
            yield from self.channel.allreduce(host, op)
            backend.from_host(host, buffer)
        if each is not None:
            each(buffer)

    # -- the other collectives, in host memory -----------------------------------

    def _through_host(self, body, response, entry):
        """Run a host collective on a device entry: in through, and back to, the device."""
        backend = arrays.of(entry.input)
        backend.wait_for_inputs([entry])
        host = types.SimpleNamespace(input=backend.to_numpy(entry.input), output=None,
                                     dtype=entry.dtype, splits=entry.splits)
        result = yield from body(response, host)
        if isinstance(result, tuple):                 # alltoall: (rows, received splits)
            return (backend.from_numpy(result[0]),) + result[1:]
        return backend.from_numpy(result, entry.output)

    def _allgather(self, response, entry):
        row = math.prod(response.shape) * entry.dtype.numpy.itemsize
        output = arrays.empty((sum(response.first_dims),) + response.shape,
                              entry.dtype.numpy)
        send = np.ascontiguousarray(entry.input)
        yield from self.channel.allgatherv(
            as_bytes(send), as_bytes(output), [d * row for d in response.first_dims])
        return output

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
        return target

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
        return output, receive_rows

    def _reducescatter(self, response, entry):
        dtype = entry.dtype
        wire = dtype.reduce_as
        rows = scatter_rows(response.shape[0], self.channel.size)
        row = math.prod(response.shape[1:])
        counts = [n * row for n in rows]
        send = self.buffers.get(wire, sum(counts), arrays.HOST)[:sum(counts)]
        arrays.scale_into(entry.input, response.prescale, send.reshape(response.shape))
        received = np.empty(counts[self.channel.rank], dtype=wire)
        yield from self.channel.reduce_scatter(send, received, counts, response.op)
        output = arrays.empty((rows[self.channel.rank],) + response.shape[1:],
                              dtype.numpy)
        arrays.scale_into(received.reshape(output.shape), self._scale_after(response),
                          output)
        return output


def _now(function, *args):
    """A generator that calls function(*args) at once and waits for nothing."""
    function(*args)
    return
    yield


def _scales_early(response, dtype):
    """May the factor applied after a sum move before it? Floats only: integer
    averages truncate the sum, and Min/Max/Product do not commute with it."""
    return (response.op in (ReduceOp.SUM, ReduceOp.AVERAGE)
            and dtype.numpy.kind == "f" and dtype.numpy == dtype.reduce_as)


def scatter_rows(first_dim, size):
    """Rows each rank receives from reducescatter: even, extras to low ranks."""
    base, extra = divmod(first_dim, size)
    return [base + (1 if rank < extra else 0) for rank in range(size)]
