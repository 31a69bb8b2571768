"""The "mpitrain" process group: torch.distributed's calls on an mpitrain process set.

A Python subclass of ``torch.distributed.ProcessGroup``, as torch allows.
Each torch call becomes a call of mpitrain's torch adapter (mpitrain.torch.ops)
on the group's process set, under the name naming.py gives it, and a Work
(work.py) that completes when the operation has. The collectives themselves
are in collectives.py, exchanges.py and point_to_point.py; this module holds
what every call shares: the numbering, the failure of a call on every rank,
and the group's identity (rank, size, name) that DDP, FSDP2 and DeviceMesh read.
"""

import torch.distributed as dist

from mpitrain.api import array_ops
from mpitrain.api.argument_checks import kind_of
from mpitrain.api.handles import synchronize
from mpitrain.errors import MpitrainInternalError
from mpitrain.torch.distributed import collectives, exchanges, point_to_point
from mpitrain.torch.distributed.naming import CallNames
from mpitrain.torch.distributed.work import pending_work

BACKEND_NAME = "mpitrain"


class MpitrainProcessGroup(dist.ProcessGroup):
    """torch.distributed's collectives on mpitrain's process set ``process_set``.

    ``timeout`` is kept (``options.timeout``) but does not end a call: a call
    that cannot complete fails on every rank once mpitrain's stall shutdown
    time has passed (MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS), as every mpitrain
    collective does.
    """

    def __init__(self, rank, size, process_set, label, timeout, store=None):
        super().__init__(rank, size)
        self.process_set = process_set
        self.timeout = timeout
        self.store = store                 # for send/recv: see point_to_point.py
        self._names = CallNames(f"group {label}")
        self._group_name = None
        self._p2p = point_to_point.Channels()

    # -- identity: what torch's tools read

    def getBackendName(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        if self._group_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def global_rank(self, group_rank):
        """The job rank of this group's rank ``group_rank`` (mpitrain's roots count so)."""
        return self.process_set.ranks[group_rank]

    # -- what every call shares

    def start(self, call, kind, submit, finish=None, results=(), count=None):
        """Submit one torch call as ``submit(name)`` and return its Work.

        ``finish(result)`` then writes the result where torch wants it;
        ``results`` are the tensors the Work's future holds. A problem found
        here before submitting (``count`` operations, where a call makes a
        group of them) fails the call on every rank, as mpitrain's own
        argument errors do.
        """
        name = self._names.next(call)
        try:
            handle = submit(name)
        except MpitrainInternalError as error:   # submitted: every rank fails it
            self._names.failed(error)
            raise
        except Exception as error:
            self._names.failed(error)
            array_ops.fail(kind, name, self.process_set, kind_of(error),
                           f"{call}: {type(error).__name__}: {error}", count)
            raise
        return pending_work(name, lambda: self._complete(handle, finish), list(results))

    def _complete(self, handle, finish):
        """Wait for ``handle`` and ``finish`` its result (on the completer's thread)."""
        try:
            result = synchronize(handle)
            if finish is not None:
                finish(result)
        except BaseException as error:
            self._names.failed(error)
            raise

    def __repr__(self):
        return f"<MpitrainProcessGroup ranks={self.process_set.ranks} rank={self.rank()}>"

    # -- torch's calls (torch.distributed's functions call these methods)

    def allreduce(self, tensors, opts=None):
        return collectives.allreduce(self, tensors, opts or dist.AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return collectives.allreduce(self, tensors, opts or dist.AllreduceCoalescedOptions(),
                                     "dist.all_reduce_coalesced")

    def broadcast(self, tensors, opts=None):
        return collectives.broadcast(self, tensors, opts or dist.BroadcastOptions())

    def allgather(self, output_tensors, input_tensors, opts=None):
        return collectives.allgather(self, output_tensors, input_tensors)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        # here output_lists[r][i] receives rank r's input i: one list per rank
        per_input = [list(outputs) for outputs in zip(*output_lists)]
        return collectives.allgather(self, per_input, input_tensors,
                                     "dist.all_gather_coalesced")

    def all_gather_single(self, output, input, opts=None):
        return collectives.allgather_into(self, [output], [input])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return collectives.allgather_into(self, outputs, inputs,
                                          "dist.all_gather_into_tensor_coalesced")

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce(self, tensors, opts=None):
        return collectives.reduce(self, tensors, opts or dist.ReduceOptions())

    def barrier(self, opts=None):
        return collectives.barrier(self)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier (torch's dist.monitored_barrier takes gloo groups only: call
        ``group.monitored_barrier()``); a rank that never comes is named by
        mpitrain's stall report on every rank."""
        collectives.barrier(self, "monitored_barrier").wait()

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        return exchanges.reduce_scatter(self, output_tensors, input_lists,
                                        opts or dist.ReduceScatterOptions())

    def reduce_scatter_single(self, output, input, opts=None):
        return exchanges.reduce_scatter(self, [output], [input],
                                        opts or dist.ReduceScatterOptions(),
                                        "dist.reduce_scatter_tensor")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return exchanges.reduce_scatter(self, outputs, inputs,
                                        opts or dist.ReduceScatterOptions(),
                                        "dist.reduce_scatter_tensor_coalesced")

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return exchanges.alltoall(self, output_tensors, input_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return exchanges.alltoall_single(self, output, input, output_split_sizes,
                                         input_split_sizes)

    alltoall_base = all_to_all_single

    def gather(self, output_lists, input_tensors, opts=None):
        return exchanges.gather(self, output_lists, input_tensors,
                                (opts or dist.GatherOptions()).rootRank)

    def scatter(self, output_tensors, input_lists, opts=None):
        return exchanges.scatter(self, output_tensors, input_lists,
                                 (opts or dist.ScatterOptions()).rootRank)

    def send(self, tensors, dst, tag=0):
        return self._p2p.send(self, tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._p2p.recv(self, tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("the 'mpitrain' backend receives from a named rank "
                                  "only: pass src= to dist.recv")
