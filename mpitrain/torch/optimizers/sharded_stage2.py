"""ShardedOptimizer's stage 2 (ZeRO-2): gradients reduce-scattered during backward.

The trained parameters are cut into buckets in backward's order, one
dtype and device each, of ``bucket_bytes`` (the last of a dtype less); a
parameter that does not fit in the room left is cut across buckets, so no
exchange, and no buffer of the engine, is larger than a bucket. A bucket is
one flat vector, padded to N equal slices; rank r owns slice r of every
bucket, so each rank owns 1/N of every bucket's elements whatever the
parameters' sizes. As backward produces a gradient, a hook adds it into its
bucket's flat gradient and drops ``p.grad``; once the bucket is complete it
is reduce-scattered (op=Average) while backward goes on, and the slice that
comes back is the only gradient this rank keeps. At most ``IN_FLIGHT``
buckets wait for their exchange at once: the gradient memory of a rank is
its slices (1/N) and a few buckets.

The local optimizer steps "pieces": for each parameter, the 1-D view of
the part of its memory that lies in this rank's slices, so the update
writes into the parameter itself and no copy of the parameters is kept;
its state (Adam's moments) has the pieces' shapes, 1/N of the whole. An
elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad...) computes
exactly what it would on whole tensors; one that looks at a whole tensor
(LAMB, LARS, Adafactor) does not: for those, stage 1. After the step,
each bucket's slices are allgathered, a few buckets at a time, into the
parameters of every rank.
"""

import math
import weakref

import torch

from mpitrain.api.handles import synchronize, synchronize_all
from mpitrain.ops import Average, OpType
from mpitrain.torch.ops import allgather_async, reducescatter_async
from mpitrain.torch.optimizers.sharded_checks import fail_everywhere, for_every_rank

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024     # DDP's bucket_cap_mb
IN_FLIGHT = 2                                # buckets exchanged at once, per direction


class SlicedParameters:
    """Every rank's slice of every bucket, the hooks and the exchanges of a step.

    ``index``: every parameter's position in the optimizer's param_groups.
    """

    def __init__(self, trained, index, size, rank, bucket_bytes):
        for p in trained:
            if not p.is_contiguous():
                raise ValueError(
                    f"ShardedOptimizer(stage=2): parameter {index[p]} (shape "
                    f"{tuple(p.shape)}) is not contiguous in memory (channels_last?), and "
                    "stage 2 updates slices of each parameter's memory in place: make "
                    "the model contiguous (model.to(memory_format=torch.contiguous_format)) "
                    "or use stage=1")
        self._index, self._size = index, size
        self._buckets = [_Bucket(number, parts, index, size, rank)
                         for number, parts in enumerate(_plan(trained, bucket_bytes))]
        self._buckets_of = {p: [] for p in trained}
        for bucket in self._buckets:
            for p, _, _, _ in bucket.parts:
                self._buckets_of[p].append(bucket)
        self._in_flight = []        # buckets whose reduce-scatter is under way, oldest first
        self.sending = True         # False inside no_sync()
        this = weakref.ref(self)

        def on_gradient(p):
            sliced = this()
            if sliced is not None:
                sliced._gradient_ready(p)

        handles = [p.register_post_accumulate_grad_hook(on_gradient) for p in trained]
        weakref.finalize(self, _remove_all, handles)

    def local_groups(self, groups):
        """The groups of the local optimizer: this rank's pieces of each group's parameters."""
        return [{**group, "params": [piece.tensor for p in group["params"]
                                     for bucket in self._buckets_of.get(p, ())
                                     for piece in bucket.pieces if piece.param is p]}
                for group in groups]

    def exchanged(self):
        """(bytes this rank gives the reduce-scatters, bytes it gives the
        allgathers) in a step."""
        slices = sum(bucket.length * bucket.dtype.itemsize for bucket in self._buckets)
        return self._size * slices, slices

    # -- backward -------------------------------------------------------------

    def _gradient_ready(self, p):
        if not self.sending:
            return                      # no_sync(): p.grad accumulates, sent later
        for bucket in self._collect(p):
            if bucket.complete():
                self._send(bucket)

    def _collect(self, p):
        """Add ``p.grad`` into its buckets and drop it; returns those buckets."""
        grad = (p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1)
        for bucket in self._buckets_of[p]:
            bucket.add(p, grad)
        p.grad = None
        return self._buckets_of[p]

    def _send(self, bucket):
        if bucket.handle is not None:   # an earlier backward pass's, still under way
            self._fold(bucket)
        flat = bucket.outgoing()
        bucket.handle = reducescatter_async(flat, name=bucket.gradients_name, op=Average)
        self._in_flight.append(bucket)
        while self._in_flight and (len(self._in_flight) > IN_FLIGHT
                                   or self._in_flight[0].handle.done()):
            self._fold(self._in_flight[0])

    def _fold(self, bucket):
        """Wait for the bucket's reduce-scatter; its slice joins this rank's gradients."""
        self._in_flight.remove(bucket)
        handle, bucket.handle = bucket.handle, None
        bucket.take(synchronize(handle))

    # -- a step ---------------------------------------------------------------

    def reduce(self, closure):
        """The closure's loss, after which every piece's ``.grad`` is this rank's
        slice of the average of every rank's gradients (summed over the
        backward passes since the last step)."""
        if not self.sending:
            raise RuntimeError(
                "optimizer.step() inside optimizer.no_sync(): the gradients "
                "accumulated there have not been sent to the other ranks; run one "
                "more backward pass after the block, or step() after it")
        try:
            loss = closure()
            for p in self._buckets_of:              # left in p.grad: no_sync(), or
                if p.grad is not None:              # set by hand
                    self._collect(p)
        except Exception as error:
            unsent = [bucket.gradients_name for bucket in self._buckets if not bucket.sent]
            self.forget()
            fail_everywhere(OpType.REDUCESCATTER, unsent, error)
        for bucket in self._buckets:
            if bucket.pending() or not bucket.sent:   # zeros where no gradient came
                self._send(bucket)
        flying, self._in_flight = self._in_flight, []
        results, errors = synchronize_all([bucket.handle for bucket in flying])
        for bucket, result in zip(flying, results):
            bucket.handle = None
            if result is not None:
                bucket.take(result)
        if errors:
            self.forget()
            raise errors[0]
        return loss

    def update(self, local_step):
        """Run ``local_step`` (the local optimizer's step) on the pieces, drop
        the gradient slices, then allgather every bucket into the parameters."""
        names = [bucket.parameters_name for bucket in self._buckets]
        for_every_rank(OpType.ALLGATHER, names, local_step)
        for bucket in self._buckets:
            bucket.release()
        pending, errors = [], []
        for position, bucket in enumerate(self._buckets):
            pending.append((bucket, allgather_async(bucket.slice(),
                                                    name=bucket.parameters_name)))
            last = position == len(self._buckets) - 1
            while pending and (len(pending) > IN_FLIGHT or last):
                waited, handle = pending.pop(0)
                try:
                    waited.put(synchronize(handle))
                except Exception as error:          # wait for the rest all the same
                    errors.append(error)
        if errors:
            raise errors[0]

    def forget(self):
        """Wait for the exchanges under way, and drop every gradient of this step."""
        flying, self._in_flight = self._in_flight, []
        synchronize_all([bucket.handle for bucket in flying])
        for bucket in self._buckets:
            bucket.handle = None
            bucket.release()

    # -- state ----------------------------------------------------------------

    def shard_state(self, local):
        """This rank's share of the state: {(parameter index, offset, length): state}."""
        ids = [piece for group in local.param_groups for piece in group["params"]]
        where = {piece.tensor: (self._index[piece.param], piece.start, piece.tensor.numel())
                 for bucket in self._buckets for piece in bucket.pieces}
        return {where[ids[i]]: state for i, state in local.state_dict()["state"].items()}

    def merge(self, shares):
        """The full state by parameter index: each parameter's pieces put together."""
        parts = {}
        for share in shares:
            for (index, start, _), state in share.items():
                parts.setdefault(index, []).append((start, state))
        shapes = {self._index[p]: p.shape for p in self._buckets_of}
        merged = {}
        for index, pieces in parts.items():
            pieces.sort(key=lambda piece: piece[0])
            first = pieces[0][1]
            merged[index] = {
                key: torch.cat([state[key] for _, state in pieces]).view(shapes[index])
                if _elementwise(key, value) and value.dim() == 1 else value
                for key, value in first.items()}
        return merged

    def local_state(self, state, local):
        """The local optimizer's "state" entries (by its positions) cut from
        ``state`` (by parameter index)."""
        ids = [piece for group in local.param_groups for piece in group["params"]]
        piece_of = {piece.tensor: piece for bucket in self._buckets for piece in bucket.pieces}
        cut = {}
        for position, tensor in enumerate(ids):
            piece = piece_of[tensor]
            values = state.get(self._index[piece.param])
            if values is None:
                continue
            end = piece.start + tensor.numel()
            # Each piece its own copy: the step updates "step" in place.
            cut[position] = {
                key: value.reshape(-1)[piece.start:end].clone()
                if _elementwise(key, value) and value.shape == piece.param.shape else
                value.clone() if torch.is_tensor(value) else value
                for key, value in values.items()}
        return cut


class _Piece:
    """The part of ``param``'s memory, from element ``start``, in this rank's
    slice of its bucket, at ``at`` in that slice; ``tensor`` is its view."""

    __slots__ = ("param", "start", "at", "tensor")

    def __init__(self, param, start, at, length):
        self.param, self.start, self.at = param, start, at
        self.tensor = param.detach().view(-1)[start:start + length]


class _Bucket:
    """Parts of parameters whose gradients travel as one flat vector of N equal slices.

    parts: (parameter, its first element here, elements, where they start in the bucket).
    """

    __slots__ = ("parts", "size", "length", "dtype", "device", "pieces",
                 "gradients_name", "parameters_name", "flat", "arrived", "sent",
                 "handle", "travelling", "received")

    def __init__(self, number, parts, index, size, rank):
        self.parts, total = [], 0
        for p, first, count in parts:
            self.parts.append((p, first, count, total))
            total += count
        self.size, self.length = size, math.ceil(total / size)   # length: of one slice
        self.dtype, self.device = parts[0][0].dtype, parts[0][0].device
        mine = (rank * self.length, (rank + 1) * self.length)
        self.pieces = []
        for p, first, count, at in self.parts:
            begin, end = max(at, mine[0]), min(at + count, mine[1])
            if begin < end:
                self.pieces.append(_Piece(p, first + begin - at, begin - mine[0],
                                          end - begin))
        indices = sorted({index[p] for p, _, _, _ in self.parts})
        members = f"parameter {indices[0]}" if len(indices) == 1 else \
            f"parameters {indices[0]}..{indices[-1]}, {len(indices)} tensors"
        self.gradients_name = f"ShardedOptimizer.gradients.{number} ({members})"
        self.parameters_name = f"ShardedOptimizer.parameters.{number} ({members})"
        self.flat, self.arrived, self.sent = None, set(), False
        self.handle, self.travelling, self.received = None, None, None

    def add(self, p, grad):
        """Add p's part of ``grad`` (p's whole gradient, flat) into the flat gradient."""
        for param, first, count, at in self.parts:
            if param is not p:
                continue
            if self.flat is None and len(self.parts) == 1 and count == self.size * self.length:
                # A bucket that is a slice of one gradient, unpadded, travels as a
                # view of it: the gradient is alive anyway, a copy would double it.
                self.flat = grad[first:first + count]
            else:
                if self.flat is None:
                    self.flat = self._zeros()
                self.flat[at:at + count].add_(grad[first:first + count])
        self.arrived.add(p)

    def _zeros(self):
        return torch.zeros(self.size * self.length, dtype=self.dtype, device=self.device)

    def complete(self):
        return len(self.arrived) == len(self.parts)

    def pending(self):
        """Has a gradient arrived since the bucket was last sent?"""
        return self.flat is not None

    def outgoing(self):
        """The flat gradient to send (zeros where none arrived); the bucket starts empty."""
        self.travelling = self.flat if self.flat is not None else self._zeros()
        self.flat, self.arrived, self.sent = None, set(), True
        return self.travelling

    def take(self, averaged):
        """The slice of the averaged gradient that came back: the pieces' gradients
        are views of it; a later backward pass's slice adds to it."""
        self.travelling = None
        if self.received is None:
            self.received = averaged
            for piece in self.pieces:
                piece.tensor.grad = averaged[piece.at:piece.at + piece.tensor.numel()]
        else:
            self.received.add_(averaged)

    def release(self):
        """Forget every gradient: the step has used them, or drops them."""
        self.flat, self.arrived, self.sent, self.received = None, set(), False, None
        self.travelling = None
        for piece in self.pieces:
            piece.tensor.grad = None

    def slice(self):
        """This rank's slice of the parameters, for the allgather."""
        values = torch.zeros(self.length, dtype=self.dtype, device=self.device)
        for piece in self.pieces:
            values[piece.at:piece.at + piece.tensor.numel()].copy_(piece.tensor)
        return values

    @torch.no_grad()
    def put(self, gathered):
        """Every rank's slices, into the parameters."""
        for p, first, count, at in self.parts:
            p.view(-1)[first:first + count].copy_(gathered[at:at + count])


def _plan(parameters, bucket_bytes):
    """Buckets as lists of (parameter, first element, elements): the
    parameters in backward's order (the reverse of theirs), one dtype and
    device a bucket, each filled to ``bucket_bytes`` before the next of its
    dtype and device opens."""
    plan, filling = [], {}
    for p in reversed(parameters):
        key, room = (p.dtype, p.device), max(1, bucket_bytes // p.element_size())
        first = 0
        while first < p.numel():
            current = filling.get(key)
            if current is None or current[1] == room:
                current = filling[key] = [[], 0]
                plan.append(current[0])
            count = min(p.numel() - first, room - current[1])
            current[0].append((p, first, count))
            current[1] += count
            first += count
    return plan


def _elementwise(key, value):
    """Is this state value one number per element of the parameter (a moment),
    rather than one per tensor (Adam's step)?"""
    return key != "step" and torch.is_tensor(value)


def _remove_all(handles):
    for handle in handles:
        handle.remove()
