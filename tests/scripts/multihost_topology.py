"""Each rank prints one line, TOPOLOGY {json}: its hostname, what mpitrain
says of the job's layout, a sum over all ranks and the fusion threshold it
was given; tests/test_multihost.py checks them against the hosts."""

import json
import os
import socket

import numpy as np

import mpitrain as mt

mt.init()
report = {
    "hostname": socket.gethostname(),
    "rank": mt.rank(), "size": mt.size(),
    "local_rank": mt.local_rank(), "local_size": mt.local_size(),
    "cross_rank": mt.cross_rank(), "cross_size": mt.cross_size(),
    "is_homogeneous": mt.is_homogeneous(),
    "sum_of_ranks": int(mt.allreduce(np.array([mt.rank()]), op=mt.Sum)[0]),
    "fusion_threshold": os.environ.get("MPITRAIN_FUSION_THRESHOLD"),
}
print("TOPOLOGY " + json.dumps(report), flush=True)
