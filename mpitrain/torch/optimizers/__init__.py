"""The torch optimizers that train across ranks, one topic a module.

As PyTorch keeps DDP's facade apart from its Reducer: distributed.py is
DistributedOptimizer, the object users call, and adasum.py, local_sgd.py,
sharded.py and diloco.py (with diloco_outer.py and diloco_fragments.py) are
its variants; buckets.py holds the flat gradient buckets
DistributedOptimizer reduces.
"""

from mpitrain.torch.optimizers.diloco import DiLoCoOptimizer
from mpitrain.torch.optimizers.distributed import DistributedOptimizer
from mpitrain.torch.optimizers.local_sgd import LocalSGDOptimizer
from mpitrain.torch.optimizers.sharded import ShardedOptimizer

__all__ = ["DiLoCoOptimizer", "DistributedOptimizer", "LocalSGDOptimizer", "ShardedOptimizer"]
