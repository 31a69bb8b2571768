"""One process set's negotiation: rounds, the response cache, execution.

A round starts when this rank has work (or, idle, once per heartbeat, so the
coordinator hears from every rank). All members contribute a control vector
to one bitwise AND; cached requests that every rank has ready run at once.
Only when some rank has a request the cache cannot serve do the requests
travel to the coordinator (rank 0 of the set) and responses come back.
"""

import time
from dataclasses import dataclass
from typing import Callable

from mpi4py import MPI

from mpitrain.engine import naming
from mpitrain.engine.execution import fusion
from mpitrain.engine.execution.claims import MemoryClaims
from mpitrain.engine.execution.executor import Executor
from mpitrain.engine.handles import CACHED, QUEUED, SENT, notify_waiters
from mpitrain.engine.negotiation import control_vector
from mpitrain.engine.negotiation.autotune import Autotuner
from mpitrain.engine.negotiation.cache import CACHEABLE, HIT, INVALID, ResponseCache
from mpitrain.engine.negotiation.coordinator import Coordinator
from mpitrain.engine.negotiation.messages import Response
from mpitrain.engine.negotiation.stall import StallInspector
from mpitrain.errors import ERROR_CLASSES, GpuError, MpitrainInternalError, RankNames
from mpitrain.ops import OpType
from mpitrain.transport.channel import ROUND, Channel
from mpitrain.transport.device import DeviceTransport

ALLREDUCE, JOIN = OpType.ALLREDUCE, OpType.JOIN
_MOVES_DATA = frozenset({OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST,
                         OpType.ALLTOALL, OpType.REDUCESCATTER})
HEARTBEAT = 1.0          # seconds between rounds of an idle rank
MAX_PAUSE = 0.01         # longest pause between rounds of a rank with work
SPIN = 50e-6             # seconds to test a fresh request before sleeping on it
# Each publication wakes the threads waiting on handles, which on a shared
# core costs a context switch away from the MPI calls: a round's results are
# published together, and a long round's every this many seconds.
PUBLISH_EVERY = 5e-3
STALL_RECHECK = 0.5      # seconds before asking again about ranks busy moving data


def _slots_like(cache, entry):
    """The cached responses of ``entry``'s kind and data type: one of them may
    be the call that ``entry``, whose name its rank refused, stands for."""
    mask = 0
    if entry.dtype is None:
        return mask                 # it fits no call (mpitrain.engine.negotiation.refused)
    for slot in cache.occupied():
        response = cache.response(slot)
        if response.kind == entry.kind and response.dtype == entry.dtype.code:
            mask |= 1 << slot
    return mask


def _stall_times(config):
    """The stall inspector's warning and shutdown times, where it runs."""
    if config.stall_check_disable:
        return []
    return [seconds for seconds in (config.stall_check_time, config.stall_shutdown_time)
            if seconds]


class EngineStopped(Exception):
    """Raised inside a round when the job-wide engine must stop."""


@dataclass(frozen=True)
class EngineLinks:
    """What every set's controller takes from the engine, given when it is
    built: the state they share and the engine's decisions it may ask for."""

    lock: object                   # the engine's Condition; user threads queue under it
    timeline: object               # .current: the timeline in use, or None
    watch: object                  # watches blocking calls (call), blames ranks (blame)
    config: object                 # mpitrain.runtime.config.Config
    host_route: object             # the job-wide set's host route
    device_plan: object            # mpitrain.transport.selection.Plan, job-wide
    node: object                   # this rank's node (mpitrain.runtime.topology)
    job_rank: int
    stop_requested: Callable       # () -> has this rank asked the job to stop?
    agree_to_stop: Callable        # generator(channel) -> the reason every rank agrees on
    request_stop: Callable         # (reason): ask the job to stop
    change_process_sets: Callable  # (response) -> the result of adding or removing a set


class SetController:
    def __init__(self, links, set_id, ranks, comm, blocking):
        self.links = links
        self.set_id = set_id
        self.ranks = ranks
        self.rank_names = RankNames(set_id, ranks)      # for errors, in job ranks
        self.channel = Channel(comm, blocking, links.config.chunk_size,
                               links.watch.call if blocking else None,
                               links.host_route if set_id == 0 else None)
        self.rank = comm.rank
        self.size = comm.size
        config = links.config
        self.cycle_time = config.cycle_time_ms / 1000.0
        self.fusion_threshold = config.fusion_threshold
        # fused host groups of this many bytes or more stream through shared
        # memory (None: none do)
        route = self.channel.host_route
        self.streams_from = (route.stream_min_bytes if route is not None
                             and route.reducer is not None else None)
        self.stall_after = (None if config.stall_check_disable
                            else config.stall_check_time)
        # Rounds are where the coordinator looks for stalls: no pause between
        # them, idle or not, outlasts the stall check's times.
        self.longest_pause = min([HEARTBEAT] + _stall_times(config))
        self.cache = ResponseCache(config.cache_capacity)
        self.coordinator = (Coordinator(self.size, self.rank_names)
                            if self.rank == 0 else None)
        self.stall = StallInspector(config, set_id, ranks) if self.rank == 0 else None
        self.stall_recheck = 0.0      # no stall shutdown before (busy ranks)
        self.tuner = (Autotuner(config, time.monotonic())
                      if config.autotune and blocking and self.rank == 0 else None)
        self.buffers = fusion.FusionBuffers()
        self.executor = Executor(
            self.channel, self.buffers, self._finish, self._fail, links.timeline,
            DeviceTransport(links.device_plan, links.node, set_id,
                            config.test_one_rank_pipeline), self.rank_names)
        self.in_flight = {}           # name -> Handle; user threads add under engine.lock
        self.claims = MemoryClaims()  # the arrays of in_flight, under engine.lock
        self.incoming = []            # entries not yet seen by the engine
        self.pending = {}             # name -> Handle the engine is negotiating
        self._done = []               # finished entries not yet published
        self._plans = {}              # (ready slots, cache generation) -> fusion plan
        self.joined = False
        self.any_joined = False
        self.removed = False          # by remove_process_set: the next round is the last
        self.retired = False          # that round has ended: MPI is done with the set
        self.numbering = naming.Numbering(set_id)   # of unnamed calls, under engine.lock
        self.coroutine = None
        self.waiting_on = ()
        self.unfinished = 0           # of waiting_on
        self.wait_started = 0.0
        self.moved = time.monotonic() # when a request of the round last completed
        self.last_round_start = float("-inf")
        self.last_round_end = float("-inf")
        self.progressed = False
        self.last_progress = time.monotonic()
        self.rounds = 0               # counters for tests and benchmarks
        self.negotiations = 0

    # -- called by the engine thread ---------------------------------------

    def has_work(self):
        return bool(self.incoming or self.pending or self.removed
                    or (self.channel.blocking and self.links.stop_requested()))

    def next_start(self):
        """When the next round should start, if none is running.

        After a round that ran something, at once: more may be ready. After
        a round that found nothing ready, the cycle time, stretched to a
        tenth of the time since the last progress, so ranks that wait on
        each other for long do not keep each other busy. Never later than
        longest_pause.
        """
        if not self.has_work():
            return self.last_round_end + self.longest_pause
        if self.progressed:
            return 0.0
        idle = self.last_round_start - self.last_progress
        pause = max(self.cycle_time, min(0.1 * idle, MAX_PAUSE))
        return self.last_round_start + min(pause, self.longest_pause)

    def advance(self, now):
        """Run this set's round as far as it can go without waiting.

        A request just started is tested for a few microseconds before the
        engine sleeps on it: peers that are in step answer within that time.
        """
        if self.coroutine is None:
            if now < self.next_start():
                return
            self.coroutine = self._round()
            self._resume()
        while self.coroutine is not None:
            done = self._test()
            while not done and time.monotonic() - self.wait_started < SPIN:
                done = self._test()
            if not done:
                return
            self._resume()

    def _test(self):
        """Has every request of the round's wait completed? Any that did is
        progress: a long transfer in many pieces is not a stalled peer."""
        waiting = self.waiting_on
        if len(waiting) == 1:
            return waiting[0].Test()
        finished = MPI.Request.Testsome(waiting)
        if finished is None:          # none active: all completed before
            return True
        if finished:
            self.unfinished -= len(finished)
            self.moved = time.monotonic()
        return self.unfinished == 0

    def _resume(self):
        try:
            waiting = self.coroutine.send(None)
        except StopIteration:
            self.coroutine = None
            self.waiting_on = ()
            self.last_round_end = time.monotonic()
            return
        self.waiting_on = waiting if isinstance(waiting, list) else [waiting]
        self.unfinished = len(self.waiting_on)
        self.wait_started = self.moved = time.monotonic()

    def fail_all(self, error_of):
        """Fail every entry this rank holds with error_of(entry)."""
        while True:
            with self.links.lock:
                entries = list(self.pending.values()) + self.incoming
                self.incoming = []
            self.pending.clear()
            if not entries:
                return
            for entry in entries:
                self._fail(entry, error_of(entry))
            self._complete()      # promotes successors, failed on the next pass

    # -- one round -----------------------------------------------------------

    def _round(self):
        """One round of this set, as a coroutine: it yields the MPI requests it
        waits on, so that advance() can serve other sets meanwhile.

        1. Take what user threads queued since the last round; a join marks
           this rank joined.
        2. Sort the pending entries against the response cache (_classify)
           and contribute a control vector to one bitwise AND across the set
           (control_vector.py): the status flags any rank raised (joined, uncached,
           shutting down), the slots every rank has ready, those some rank
           found invalid, those some rank really submitted. In steady state
           this one small allreduce is the whole negotiation.
        3. A shutdown flag ends the round on every rank together
           (EngineStopped); a removal flag ends a removed set's last round,
           failing what is in flight on every member (_retire). Otherwise the groups to run are the cached ones
           ready everywhere and submitted somewhere (a joined rank is ready
           for every allreduce but submits none), their fusion plan kept
           (_cached_plan); invalid slots leave every rank's cache.
        4. Only when some rank has a request the cache cannot serve do the
           requests go to the coordinator and its responses come back
           (_negotiate); fresh responses enter the cache (unless some rank
           has joined) and are fused after the cached groups. The coordinator
           then looks for stalled names.
        5. Run the groups in the same order on every rank (_execute). First
           the ranks meet: where there are device groups, by setting them up
           and agreeing which can run (Executor.prepare_devices); else, before
           data moves, in a non-blocking barrier (Channel.arrive), so that an
           early rank sleeps instead of spinning in a blocking MPI call.
           Autotune, where on, hears how many bytes the allreduces moved.
        """
        links = self.links
        now = time.monotonic()
        self.last_round_start = now
        self.rounds += 1
        timeline = links.timeline.current
        with links.lock:
            new, self.incoming = self.incoming, []
        if new:
            self.last_progress = now
        pending = self.pending
        for entry in new:
            pending[entry.name] = entry
            if entry.kind == JOIN:
                self.joined = True
            if timeline is not None and not entry.failed_locally:
                timeline.begin([entry.name], "NEGOTIATE_" + entry.kind.name,
                               entry.enqueued)
        if timeline is not None:
            timeline.cycle_start()

        status = 0
        ready, invalid, uncached = self._classify(now)
        submitted = ready
        if self.joined:
            status |= control_vector.JOINED
            ready |= self._allreduce_slots()
        if uncached or (self.tuner and self.tuner.pending):
            status |= control_vector.UNCACHED
        if self.channel.blocking and links.stop_requested():
            status |= control_vector.SHUTDOWN
        if self.removed:
            status |= control_vector.REMOVED
        nbits = self.cache.nbits
        vector = control_vector.encode(status, ready, invalid, submitted, nbits)
        self.channel.activity = ROUND
        yield from self.channel.round(vector)
        status, ready, invalid, submitted = control_vector.decode(vector, nbits)

        if status & control_vector.SHUTDOWN:
            reason = yield from links.agree_to_stop(self.channel)
            raise EngineStopped(reason)
        if status & control_vector.REMOVED:
            self._retire()
            return
        self.any_joined = bool(status & control_vector.JOINED)
        groups = self._cached_plan(ready & submitted)
        for slot in control_vector.bits(invalid):
            self.cache.erase(slot)
        if status & control_vector.UNCACHED:
            fresh = self._apply_parameters((yield from self._negotiate(uncached, now)))
            if not status & control_vector.JOINED:
                for response in fresh:
                    entry = self.pending.get(response.name)
                    if response.kind in CACHEABLE and entry is not None:
                        self.cache.put(response, entry.signature)
            groups += fusion.plan(fresh, self.fusion_threshold, self.streams_from)
        if self.coordinator is not None and time.monotonic() >= self.stall_recheck:
            self._check_stall()
        self.progressed = bool(groups)
        if groups:
            self.last_progress = time.monotonic()
            on_device = [group for group in groups if group.responses[0].device >= 0
                         and group.responses[0].kind in _MOVES_DATA]
            failed = {}
            if on_device:
                failed = yield from self.executor.prepare_devices(on_device, self.pending)
            elif any(group.responses[0].kind in _MOVES_DATA for group in groups):
                yield from self.channel.arrive()
            yield from self._execute(groups, failed)
            if self.tuner:
                reduced = [g for g in groups if g.nbytes]      # allreduces only
                self.tuner.observe([n for g in reduced for n in g.names],
                                   sum(g.nbytes for g in reduced), time.monotonic())

    def _retire(self):
        """End the removed set's last round. Rounds before it ran the same
        groups on every member, and none runs in it: what is still in flight
        fails alike on every member."""
        members = self.rank_names.members
        self.fail_all(lambda entry: MpitrainInternalError(
            f"{entry.kind.label} of '{entry.name}' failed: {members} was removed while "
            "it was in flight: synchronize the operations of a process set before "
            "remove_process_set"))
        self.retired = True

    def _apply_parameters(self, responses):
        """Switch to autotune's settings, on every rank in the same round."""
        rest = []
        for response in responses:
            if response.kind != OpType.PARAMETERS:
                rest.append(response)
                continue
            values = dict(response.extra)
            self.fusion_threshold = values["fusion_threshold"]
            self.channel.chunk_size = values["chunk_size"]
            self.cycle_time = values["cycle_time_ms"] / 1000.0
            self._plans.clear()
            if self.tuner:
                self.tuner.shipped(time.monotonic())
        return rest

    def _cached_plan(self, slots):
        """The fusion plan of the cached responses in ``slots``.

        In steady state the same slots are ready step after step, so the plan
        is computed once per set of slots and cache generation.
        """
        if not slots:
            return []
        key = (slots, self.cache.generation)
        known = self._plans.get(key)
        if known is None:
            ordered = list(control_vector.bits(slots))
            known = (ordered, fusion.plan([self.cache.response(s) for s in ordered],
                                          self.fusion_threshold, self.streams_from))
            if len(self._plans) >= 64:
                self._plans.clear()
            self._plans[key] = known
        self.cache.touch(known[0])
        return list(known[1])

    def _classify(self, now):
        """Sort pending entries into cache hits, invalid slots and uncached.

        An entry found in the cache stays a hit without another lookup until
        the cache changes (its generation moves on).
        """
        ready = invalid = 0
        uncached = []
        cache = self.cache
        generation = cache.generation
        only_allreduce = self.any_joined      # joined ranks serve allreduces alone
        stalled_before = (float("-inf") if self.stall_after is None
                          else now - self.stall_after)
        for entry in self.pending.values():
            state = entry.state
            if state == SENT:
                continue
            if state == CACHED and entry.generation == generation and not (
                    only_allreduce and entry.kind != ALLREDUCE):
                slot = entry.slot
            elif (entry.kind in CACHEABLE and not entry.error
                  and not (only_allreduce and entry.kind != ALLREDUCE)):
                result, slot = cache.lookup(entry.name, entry.signature)
                entry.generation = generation
                if result == INVALID:
                    entry.state = QUEUED
                    invalid |= 1 << slot
                    continue
                if result != HIT:
                    entry.state = QUEUED
                    uncached.append(entry)
                    continue
                entry.state = CACHED
                entry.slot = slot
            else:
                if entry.error:
                    # The other ranks may hold the name as a cache hit and wait
                    # for this rank's bit: send them to the coordinator too.
                    invalid |= cache.slot_bit(entry.name)
                    if entry.name_refused:      # their name for it is unknown here
                        invalid |= _slots_like(cache, entry)
                entry.state = QUEUED
                uncached.append(entry)
                continue
            if entry.enqueued < stalled_before:
                # Route a long-stalled cached tensor through the coordinator,
                # whose stall inspector can name the ranks that are missing.
                invalid |= 1 << slot
            else:
                ready |= 1 << slot
        return ready, invalid, uncached

    def _allreduce_slots(self):
        """A joined rank is ready for every cached allreduce: it sends zeros."""
        mask = 0
        for slot in self.cache.occupied():
            if self.cache.kind(slot) == OpType.ALLREDUCE:
                mask |= 1 << slot
        return mask

    def _negotiate(self, uncached, now):
        """Send uncached requests to the coordinator; get responses back."""
        self.negotiations += 1
        requests = []
        for entry in uncached:
            entry.state = SENT
            requests.append(entry.request(now))
        gathered = yield from self.channel.gather_objects(requests)
        responses = None
        if self.coordinator is not None:
            timeline = self.links.timeline.current
            if timeline is not None:
                for requests_of_rank in gathered:
                    for request in requests_of_rank:
                        timeline.mark(request.name,
                                      f"rank {self.ranks[request.rank]} ready")
            responses = self.coordinator.receive(gathered, time.monotonic())
            if self.tuner and self.tuner.pending:
                responses.append(Response(OpType.PARAMETERS, "autotune",
                                          extra=tuple(self.tuner.pending.items())))
        responses = yield from self.channel.bcast_object(responses)
        return responses

    def _execute(self, groups, failed):
        """Run the round's groups in order; ``failed`` maps id(group) to why it
        fails on every rank without running."""
        timeline = self.links.timeline.current
        entries = self.pending
        if timeline is not None:
            timeline.end([name for group in groups for name in group.names
                          if name in entries and not entries[name].failed_locally])
        published = time.monotonic()
        for group in groups:
            response = group.responses[0]
            kind = response.kind
            if id(group) in failed:
                for name in group.names:
                    if name in entries:
                        self._fail(entries[name], GpuError(failed[id(group)]))
            elif kind == OpType.ERROR:
                if response.numbering_stopped:
                    with self.links.lock:   # before the caller hears of the error
                        self.numbering.stop(naming.numbered_kind(response.name),
                                            response.error)
                entry = entries.get(response.name)
                if entry is not None:    # a joined rank submitted nothing
                    error_class = ERROR_CLASSES.get(response.error_kind,
                                                    MpitrainInternalError)
                    self._fail(entry, error_class(response.error))
            elif kind == OpType.BARRIER:
                self._finish(entries[response.name], None)
            elif kind == OpType.JOIN:
                self.joined = False
                self._finish(entries[response.name], response.last_joined_rank)
            elif kind in (OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET):
                result = self.links.change_process_sets(response)
                self._finish(entries[response.name], result)
            else:
                yield from self.executor.run(group, entries)
            if time.monotonic() - published > PUBLISH_EVERY:
                self._complete()
                published = time.monotonic()
        self._complete()

    def _check_stall(self):
        """Stop the job when a name has waited past the shutdown time, unless
        the ranks it waits for are busy moving data (in another process set's
        long transfer): those will come. One that only negotiates or idles will not."""
        now = time.monotonic()
        waiting, joined = self.coordinator.waiting(), self.coordinator.joined
        report = self.stall.check(now, waiting, joined)
        if not report:
            return
        absent = [rank for rank in self.stall.missing_ranks(now, waiting, joined)
                  if rank != self.links.job_rank]
        if absent and not self.links.watch.blame(absent, transfers_only=True):
            self.stall_recheck = time.monotonic() + STALL_RECHECK
            return
        self.links.request_stop(report)

    # -- completing entries ---------------------------------------------------

    def _finish(self, entry, value):
        entry.result = value
        self._done.append(entry)

    def _fail(self, entry, error):
        entry.error_raised = error
        self._done.append(entry)

    def _complete(self):
        """Retire finished entries under one lock, then publish their results.

        A name leaves in_flight before its handle completes, so a caller may
        reuse the name as soon as synchronize() returns.
        """
        done, self._done = self._done, []
        if not done:
            return
        in_flight, claims = self.in_flight, self.claims
        with self.links.lock:
            for entry in done:
                if entry.claimed is not None:
                    claims.release(entry)
                successor = entry.successor
                if successor is None:
                    in_flight.pop(entry.name, None)
                else:
                    in_flight[entry.name] = successor
                    self.incoming.append(successor)
        pending = self.pending
        for entry in done:
            pending.pop(entry.name, None)
            entry.publish()
        notify_waiters()
