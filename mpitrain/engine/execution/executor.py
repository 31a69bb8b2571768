"""Executing responses: packing, the MPI call, scaling and unpacking.

Every rank runs the same responses in the same order. ``entries`` maps a
name to this rank's submission; a joined rank has none for an allreduce and
contributes zeros. Allreduces run where their arrays live (host or CUDA
device, through mpitrain.backends.arrays), by the route that the route table
(mpitrain.transport.routes) picks for the group from what every rank knows;
this rank's own arrays decide only how they enter and leave it. The other
collectives move device arrays through host memory and share the host code.
A round's device groups are prepared, and the ranks agree that they can run,
before any data moves.
"""

import logging
import math
import types

import numpy as np

from mpitrain.backends import arrays, dtypes, host
from mpitrain.backends.recycled import RecycledBuffers
from mpitrain.engine.execution import scaling
from mpitrain.engine.execution.streaming import Stream, flat, streams
from mpitrain.errors import GpuError
from mpitrain.ops import OpType, ReduceOp
from mpitrain.transport import adasum, routes
from mpitrain.transport.channel import as_bytes, even_split
from mpitrain.transport.chunk_io import PLAIN, ChunkIO

log = logging.getLogger("mpitrain")

_CHOICES_KEPT = 4096         # routes remembered per set, by what decides them


class Executor:
    def __init__(self, channel, buffers, finish, fail, timeline, devices, rank_names):
        self.channel = channel
        self.buffers = buffers
        self.results = RecycledBuffers()   # out-of-place results in host memory
        self.finish = finish          # finish(entry, value)
        self.fail = fail              # fail(entry, error), this rank only
        self.timeline = timeline      # holder with .current: Timeline or None
        self.devices = devices        # how device buffers travel: transport.device.DeviceTransport
        self.rank_names = rank_names  # errors.RankNames: errors name ranks of the job
        self._choices = {}            # what decides a group's route -> routes.Choice
        self._logged = set()          # kinds of group whose route was logged

    def run(self, group, entries):
        response = group.responses[0]
        kind = response.kind
        self.channel.activity = f"{kind.label} of {listed(group.names)}"
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
            self.finish(entry, result)
        else:
            yield from self._traced(group.names, kind.name,
                                    self._through_host(body, response, entry))

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

    # -- device groups: set up on every rank, agree, then move data ----------------

    def prepare_devices(self, groups, entries):
        """Set up what this round's device groups need, and agree on what failed.

        Allocation, kernels, staging buffers and NCCL's communicator are made
        here, before any rank starts moving data, so that a failure on one
        rank fails the group on every rank instead of leaving the others in
        MPI. Returns {id(group): message} for the groups that failed.
        """
        if self.devices.needs_setup(self.channel):
            reducing = [g for g in groups if g.responses[0].kind == OpType.ALLREDUCE]
            if reducing:
                members = [entries.get(name) for name in reducing[0].names]
                yield from self.devices.set_up(
                    self.channel, self._backend(reducing[0].responses[0], members))
        problems = {}
        for index, group in enumerate(groups):
            try:
                self._prepare(group, entries)
            except GpuError as error:          # already says what it is
                problems[index] = str(error)
            except Exception as error:
                problems[index] = f"{type(error).__name__}: {error}"
        if not (yield from self.channel.agree(bool(problems))):
            return {}
        reports = yield from self.channel.allgather_objects(problems)
        failed = {}
        for index, group in enumerate(groups):
            ranks_of = {}
            for rank, report in enumerate(reports):
                if index in report:
                    ranks_of.setdefault(report[index], []).append(rank)
            if ranks_of:
                failed[id(group)] = (
                    f"{group.responses[0].kind.label} of {listed(group.names)} "
                    "failed: the GPU "
                    "path could not be set up (" + "; ".join(
                        f"{self.rank_names(ranks)}: {cause}"
                        for cause, ranks in ranks_of.items()) + ")")
        return failed

    def _prepare(self, group, entries):
        response = group.responses[0]
        members = [entries.get(name) for name in group.names]
        if response.kind != OpType.ALLREDUCE:
            entry = members[0]        # these travel through host memory: take it there now
            backend = arrays.device(entry.device)
            backend.wait_for_inputs([entry])
            entry.input = backend.to_numpy(entry.input)
            return
        backend = self._backend(response, members)
        self.devices.check(backend)
        backend.wait_for_inputs(members)
        wire = dtypes.wire(dtypes.BY_CODE[response.dtype], response.op, response.prescale,
                           response.postscale)
        backend.kernels(wire)
        self.buffers.get(wire, group.total, backend)
        if self._route(group, wire).route is routes.STAGED:
            backend.pinned(wire, group.total)
        for response, member in zip(group.responses, members):
            if member is not None and member.output is None:
                member.output = backend.empty(response.shape, member.dtype.numpy)

    # -- allreduce, on the host or on a device -----------------------------------

    def _route(self, group, wire):
        """The group's routes.Choice, from what every rank knows of the group and
        the set; remembered, since steady-state steps repeat their groups."""
        first = group.responses[0]
        key = (first.device, first.dtype, wire, first.op, group.total,
               len(group.responses) == 1, self.devices.nccl is not None)
        choice = self._choices.get(key)
        if choice is None:
            if len(self._choices) == _CHOICES_KEPT:
                self._choices.clear()
            # A lone tensor reduced as it is skips fusion; the rest may stream
            # through the host reducer (a joined rank still fuses its zeros).
            alone = len(group.responses) == 1 and dtypes.BY_CODE[first.dtype].numpy == wire
            channel, devices = self.channel, self.devices
            choice = self._choices[key] = routes.choose(
                routes.Group(first.device >= 0, wire, first.op,
                             group.total * wire.itemsize,
                             streamed=streams(first, wire) and not alone),
                routes.Offer(channel.size, channel.blocking, channel.host_route,
                             devices.nccl_types(), devices.cuda_aware,
                             devices.one_rank_pipeline))
            self._log_route(group, wire, choice)
        return choice

    def _log_route(self, group, wire, choice):
        """Say, at debug level, the first time a kind of group takes a route."""
        first = group.responses[0]
        kind = (choice, first.device >= 0, wire, first.op)
        if kind not in self._logged:
            self._logged.add(kind)
            log.debug("mpitrain: process set %d reduces %s (%s %s %s) by %s",
                      self.devices.set_id, listed(group.names),
                      "GPU" if first.device >= 0 else "host", wire.name,
                      first.op.name.lower(), choice)

    def _backend(self, response, members):
        """Where the group's arrays live; a joined rank has none and uses its GPU."""
        for member in members:
            if member is not None:
                return arrays.of(member.input)
        return arrays.HOST if response.device < 0 else arrays.current_device()

    def _result(self, backend, shape, dtype):
        """A new array for an out-of-place result (in recycled host memory)."""
        if backend is arrays.HOST:
            return self.results.empty(shape, dtype.numpy)
        return backend.empty(shape, dtype.numpy)

    def _integer_scaling(self, response, wire):
        """(scale, divisor) for a sum of integers, applied once to the whole sum,
        or None where the factors multiply floats before and after the sum."""
        if not dtypes.exact(wire, response.op):
            return None
        divisor = self.channel.size if response.op == ReduceOp.AVERAGE else 1
        return response.prescale * response.postscale, divisor

    def _allreduce(self, group, entries):
        """Reduce a group of allreduces, fused or alone, and finish its members.

        The route (``choice``) is taken from what every rank knows of the
        group, so the ranks make matching MPI calls; this rank's own arrays
        decide only which of four ways they take into and out of it:
        - one rank, in place and unscaled: nothing moves, each output is its
          input as it is;
        - alone: a lone member already of its wire type (and not an int64
          average split in two) is reduced in its own output, with no copy
          into the fusion buffer (_allreduce_alone);
        - streamed: where the route streams through shared memory and every
          input and output is contiguous, each chunk goes from the inputs
          straight into shared memory and back out into the outputs, with no
          fusion buffer between (_allreduce_streamed);
        - fused: the members are packed into the set's persistent fusion
          buffer (times the prescale factor), reduced in place, and unpacked
          into their outputs times the post-scale factor (Average's 1/size
          included); an output the caller did not give is made for it (in
          recycled memory on the host).
        A joined rank has no member (None) and contributes zeros. Integer
        sums (dtypes.exact) take no factor before the sum: they are scaled
        and divided once, exactly, afterwards, and an int64 average travels
        as quotients and remainders, so that its sum cannot overflow
        (engine.scaling).
        """
        first = group.responses[0]
        dtype = dtypes.BY_CODE[first.dtype]
        wire = dtypes.wire(dtype, first.op, first.prescale, first.postscale)
        factor = self._scale_after(first)
        members = [entries.get(name) for name in group.names]
        choice = self._route(group, wire)
        if choice.route is routes.ONE_RANK and _in_place_and_unscaled(first, factor,
                                                                      members):
            for member in members:           # one rank, nothing to add or scale
                if member is not None:
                    self.finish(member, member.output)
            return
        entry = members[0]
        backend = self._backend(first, members)
        integer = self._integer_scaling(first, wire)
        # int64 averages travel as quotients and remainders, twice the elements.
        parts = 2 if scaling.splits(dtype, first.op, integer, self.channel.size) else 1
        if (len(members) == 1 and entry is not None and entry.dtype is dtype
                and dtype.numpy == wire and parts == 1):
            yield from self._allreduce_alone(choice, first, entry, factor, integer,
                                             backend)
            return
        whole = self.buffers.get(wire, parts * group.total, backend)
        buffer = whole[:group.total]
        names = group.names
        sources = [None if member is None else member.input for member in members]
        prescale = first.prescale if integer is None else 1.0
        if choice.streams:
            outputs = self._outputs(group, members, backend)
            if all(_contiguous(array) for array in sources + outputs):
                yield from self._allreduce_streamed(choice, group, members, buffer,
                                                    sources, outputs, prescale, factor)
                return
        yield from self._traced(names, "MEMCPY_IN_FUSION_BUFFER",
                                _now(backend.pack, sources, group.counts, buffer,
                                     prescale))
        reduced = whole[:parts * group.total]
        if parts == 2:
            scaling.split(buffer, self.channel.size, reduced[group.total:])
        yield from self._traced(names, "MPI_ALLREDUCE",
                                self._reduce(choice, reduced, first.op, backend,
                                             PLAIN, group.counts))
        if integer is not None:
            factor = 1.0
            if parts == 2:
                scaling.combine(buffer, reduced[group.total:], self.channel.size,
                                integer[0])
            elif integer != (1.0, 1):
                backend.scale_integers(buffer, *integer)
        done, views, outputs, offsets = [], [], [], []
        for response, member, view, start in zip(group.responses, members,
                                                 group.views(whole), group.starts):
            if member is None:
                continue
            output = member.output
            if output is None:
                output = self._result(backend, response.shape, member.dtype)
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

    def _outputs(self, group, members, backend):
        """Each member's output (made where the caller gave none); None for a
        joined rank's share."""
        for response, member in zip(group.responses, members):
            if member is not None and member.output is None:
                member.output = self._result(backend, response.shape, member.dtype)
        return [None if member is None else member.output for member in members]

    def _allreduce_streamed(self, choice, group, members, buffer, sources, outputs,
                            prescale, factor):
        """Through the host reducer, each chunk's inputs go straight into shared
        memory and its results straight into the outputs
        (mpitrain.engine.execution.streaming)."""
        stream = Stream(group.starts, group.counts, [flat(s) for s in sources],
                        [flat(o) for o in outputs], prescale, factor, buffer.dtype,
                        buffer)
        yield from self._traced(group.names, "MPI_ALLREDUCE", routes.host_allreduce(
            choice.route, self.channel, buffer, group.responses[0].op, stream))
        for member in members:
            if member is not None:
                self.finish(member, member.output)

    def _allreduce_alone(self, choice, response, entry, factor, integer, backend):
        """One tensor: reduce in its output directly, without the fusion buffer."""
        output = entry.output
        if output is not None and not output.flags.c_contiguous:
            output = None
        if output is None:
            output = self._result(backend, response.shape, entry.dtype)
        prescale = response.prescale
        if integer is not None:
            prescale, factor = 1.0, 1.0
        source = None
        if output is not entry.input or prescale != 1.0:
            if entry.input.flags.c_contiguous:
                source = entry.input.reshape(-1)
            else:
                backend.scale_into(entry.input, prescale, output)
        flat_output = output.reshape(-1)
        yield from self._traced([response.name], "MPI_ALLREDUCE", self._reduce(
            choice, flat_output, response.op, backend,
            _Scaled(flat_output, backend, source, prescale, factor)))
        if integer is not None and integer != (1.0, 1):
            backend.scale_integers(output.reshape(-1), *integer)
        if entry.output is not None and output is not entry.output:
            backend.scale_into(output, 1.0, entry.output)
            output = entry.output
        backend.settle()
        self.finish(entry, output)

    def _reduce(self, choice, buffer, op, backend, io, counts=None):
        """Allreduce a 1-D buffer in place across the set by choice's route,
        its input filled and its result handed on through io (a ChunkIO, not
        one that drains). counts: the elements of each tensor in the buffer
        (Adasum treats each alone; None: the buffer is one tensor).
        """
        route = choice.route
        if route.buffers == routes.HOST and route is not routes.ADASUM:
            # Fill each chunk right before it travels and scale it right
            # after, while it is in cache: a pass over cold memory costs more.
            yield from routes.host_allreduce(route, self.channel, buffer, op, io)
            return
        if io.fills:
            io.fill(0, buffer.size, buffer)
        if route is routes.ADASUM:
            yield from self._adasum(buffer, backend, counts or [buffer.size])
        elif route.buffers == routes.DEVICE:
            yield from self.devices.allreduce(choice, buffer, op, self.channel, backend)
        io.reduced(0, buffer.size)

    def _adasum(self, buffer, backend, counts):
        """Adasum in host memory: a device buffer is copied there and back."""
        if self.channel.size > 1:
            in_host = buffer if backend is arrays.HOST else backend.to_numpy(buffer)
            yield from adasum.allreduce(self.channel, in_host, counts)
            if in_host is not buffer:
                backend.from_numpy(in_host, buffer)

    # -- the other collectives, in host memory -----------------------------------

    def _through_host(self, body, response, entry):
        """Run a host collective on a device entry, whose input prepare_devices
        took to host memory, and bring the result back to the device."""
        backend = arrays.device(entry.device)
        host = types.SimpleNamespace(input=entry.input, output=None, dtype=entry.dtype,
                                     splits=entry.splits)
        result = yield from body(response, host)
        try:
            if isinstance(result, tuple):             # alltoall: (rows, received splits)
                result = (backend.from_numpy(result[0]),) + result[1:]
            else:
                result = backend.from_numpy(result, entry.output)
        except Exception as error:    # the others have their results: fail only here
            self.fail(entry, GpuError(
                f"{response.kind.label} of '{response.name}' failed on "
                f"{self.rank_names([self.channel.rank])}: its result could not be "
                f"copied back to GPU {entry.device}: {type(error).__name__}: {error}"))
            return
        self.finish(entry, result)

    def _allgather(self, response, entry):
        row = math.prod(response.shape) * entry.dtype.numpy.itemsize
        output = host.empty((sum(response.first_dims),) + response.shape,
                            entry.dtype.numpy)
        send = np.ascontiguousarray(entry.input)
        yield from self.channel.allgatherv(
            as_bytes(send), as_bytes(output), [d * row for d in response.first_dims])
        return output

    def _broadcast(self, response, entry):
        root = response.root == self.channel.rank
        target = entry.output
        if target is None:
            target = host.empty(response.shape, entry.dtype.numpy)
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
        trailing = entry.input.shape[1:]
        row = math.prod(trailing) * entry.dtype.numpy.itemsize
        send_rows = entry.splits
        # Each rank tells each other the rows it sends it and the bytes it
        # sends in all: their sum, known alike everywhere, chooses the route.
        counts = np.stack([send_rows, np.full_like(send_rows, send_rows.sum() * row)], 1)
        received = np.empty_like(counts)
        yield from self.channel.alltoall(counts, received)
        receive_rows = received[:, 0].copy()
        output = host.empty((int(receive_rows.sum()),) + trailing, entry.dtype.numpy)
        send = np.ascontiguousarray(entry.input)
        yield from self.channel.alltoallv(
            as_bytes(send), (send_rows * row).tolist(),
            as_bytes(output), (receive_rows * row).tolist(), int(received[:, 1].sum()))
        return output, receive_rows

    def _reducescatter(self, response, entry):
        dtype = entry.dtype
        wire = dtypes.wire(dtype, response.op, response.prescale, response.postscale)
        integer = self._integer_scaling(response, wire)
        rows = even_split(response.shape[0], self.channel.size)
        row = math.prod(response.shape[1:])
        counts = [n * row for n in rows]
        size = self.channel.size
        split = scaling.splits(dtype, response.op, integer, size)
        prescale = response.prescale if integer is None else 1.0
        if (prescale == 1.0 and not split and entry.input.dtype == wire
                and entry.input.flags.c_contiguous):
            send = entry.input.reshape(-1)          # only read: no copy needed
        else:
            send = self.buffers.get(wire, sum(counts), arrays.HOST)[:sum(counts)]
            host.scale_into(entry.input, prescale, send.reshape(response.shape))
        received = host.empty((counts[self.channel.rank],), wire)
        if split:
            remainders, remainders_received = np.empty_like(send), np.empty_like(received)
            scaling.split(send, size, remainders)
            yield from self.channel.reduce_scatter(remainders, remainders_received, counts,
                                                   response.op)
        yield from self.channel.reduce_scatter(send, received, counts, response.op)
        shape = (rows[self.channel.rank],) + response.shape[1:]
        factor = self._scale_after(response)
        if split:
            scaling.combine(received, remainders_received, size, integer[0])
            factor = 1.0
        elif integer is not None:
            host.scale_integers(received, *integer)
            factor = 1.0
        if received.dtype == dtype.numpy:
            if factor != 1.0:
                host.scale_into(received, factor, received)
            return received.reshape(shape)
        output = host.empty(shape, dtype.numpy)
        host.scale_into(received.reshape(shape), factor, output)
        return output


def listed(names, most=3):
    """Names for a message: the first few, quoted, and how many more."""
    shown = ", ".join(repr(name) for name in names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


def _in_place_and_unscaled(response, factor, members):
    """Would the allreduce of one rank leave every tensor as it is?"""
    return (response.prescale == 1.0 and factor == 1.0
            and all(member is None or member.output is member.input for member in members))


class _Scaled(ChunkIO):
    """A buffer's input from a flat source times prescale (source None: the
    buffer holds it), and its result times factor, in place."""

    def __init__(self, buffer, backend, source, prescale, factor):
        self.buffer = buffer
        self.backend = backend
        self.source = source
        self.fills = source is not None
        self.prescale = prescale
        self.factor = factor

    def fill(self, start, stop, destination):
        self.backend.scale_into(self.source[start:stop], self.prescale, destination)

    def reduced(self, start, stop):
        if self.factor != 1.0:
            piece = self.buffer[start:stop]
            self.backend.scale_into(piece, self.factor, piece)


def _contiguous(array):
    return array is None or array.flags.c_contiguous


def _now(function, *args):
    """A generator that calls function(*args) at once and waits for nothing."""
    function(*args)
    return
    yield

