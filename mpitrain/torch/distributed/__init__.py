"""torch.distributed's backend "mpitrain": PyTorch's own tools (DDP, FSDP2, DTensor,
distributed checkpoints) on mpitrain's collectives.

Importing this package (``import mpitrain.torch`` does) registers the
backend; then ``dist.init_process_group("mpitrain")`` under mpirun needs no
MASTER_ADDR, MASTER_PORT, rank or world size. docs/torch-distributed.md.
"""

import torch.distributed as dist

from mpitrain.torch.distributed import groups, rendezvous
from mpitrain.torch.distributed.process_group import BACKEND_NAME, MpitrainProcessGroup

__all__ = ["BACKEND_NAME", "MpitrainProcessGroup"]

if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, groups.create, extended_api=True,
                                  devices=["cpu", "cuda"])
rendezvous.install()
