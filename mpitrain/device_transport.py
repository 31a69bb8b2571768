"""How one process set moves device buffers: NCCL, CUDA-aware MPI, or the host.

MPITRAIN_GPU_OPERATIONS=nccl sends device allreduces through NCCL (dtypes it
has); otherwise MPI carries them, directly when it is CUDA-aware
(MPITRAIN_CUDA_AWARE), else staged through page-locked host memory.
"""

from mpitrain.nccl import NcclAllreduce


class DeviceTransport:
    def __init__(self, cuda_aware, use_nccl):
        self.cuda_aware = cuda_aware
        self.use_nccl = use_nccl
        self._nccl = None

    def nccl_for(self, dtype, channel, backend):
        """The set's NCCL communicator for ``dtype``, or None to use MPI.

        Made at the first device allreduce, which every rank of the set runs
        in the same round: creating a communicator is collective.
        """
        if not self.use_nccl:
            return None
        if self._nccl is None:
            unique_id = None
            if channel.rank == 0:
                with backend.active():
                    unique_id = NcclAllreduce.unique_id()
            unique_id = yield from channel.bcast_object(unique_id)
            with backend.active():
                self._nccl = NcclAllreduce(unique_id, channel.rank,
                                           channel.size)
        return self._nccl if self._nccl.handles(dtype) else None
