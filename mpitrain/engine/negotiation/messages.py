"""Requests a rank sends to its coordinator and the responses it gets back.

Both travel pickled; they are small records of plain Python values.
"""

import dataclasses

from mpitrain.ops import OpType


@dataclasses.dataclass(slots=True)
class Request:
    name: str
    kind: OpType
    rank: int                  # submitting rank, within the process set
    dtype: int = -1            # mpitrain.backends.dtypes code
    shape: tuple = ()
    op: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    error: str = ""            # a local argument error on the submitting rank
    error_kind: str = ""
    age: float = 0.0           # seconds between enqueue and sending
    device: int = -1           # -1: host memory; else the CUDA device
    site: str = ""             # an unnamed call's place in the program
    name_refused: bool = False  # the name given was no string: stands for the others'


@dataclasses.dataclass(slots=True)
class Response:
    kind: OpType
    name: str
    dtype: int = -1
    shape: tuple = ()          # the common shape; allgather: rank 0's shape
    op: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    first_dims: tuple = ()     # allgather: every rank's first dimension
    error: str = ""
    error_kind: str = ""
    last_joined_rank: int = -1
    extra: tuple = ()          # process-set changes: the ranks involved
    device: int = -1           # -1: host memory; 0: CUDA devices
    fusion: tuple = ()         # (fusion key, bytes), filled in once by fusion.plan
    numbering_stopped: bool = False  # an error that ends its kind's unnamed calls
