"""MPITRAIN_AUTOTUNE: tries values on the live job, agrees on them, logs them."""

import csv
import os
import tempfile

import numpy as np

import mpitrain as mt
from mpitrain.engine.negotiation import autotune
from mpitrain.runtime import config
from tests.mpi_harness import mpi_test

LOG = os.path.join(tempfile.gettempdir(), "mpitrain-autotune-test.csv")


@mpi_test(env={"MPITRAIN_AUTOTUNE": "1", "MPITRAIN_AUTOTUNE_LOG": LOG,
               "MPITRAIN_CYCLE_TIME": "0.5"}, timeout=120)
def test_autotune_tries_candidates_and_every_rank_ends_with_the_same_values():
    r, n = mt.rank(), mt.size()
    controller = mt.api.basics.engine().controllers[0]
    arrays = [np.full(size, float(r), np.float32)
              for size in (100, 5000, 70_000, 300_000) * 3]
    for step in range(400):
        handles = [mt.allreduce_async(a, name=f"tune.{i}", op=mt.Sum)
                   for i, a in enumerate(arrays)]
        for handle, a in zip(handles, arrays):
            assert mt.synchronize(handle)[0] == sum(range(n))
        if r == 0:
            finished = controller.tuner.done and controller.tuner.pending is None
        else:
            finished = None
        if mt.broadcast_object(finished, root_rank=0, name=f"done.{step}"):
            break
    assert finished or r != 0, "autotune did not finish in 400 steps"
    settings = (controller.fusion_threshold, controller.channel.chunk_size,
                controller.cycle_time)
    assert len(set(mt.allgather_object(settings))) == 1
    assert controller.cycle_time == 0.0005            # set by the user: never tuned
    if r == 0:
        rows = list(csv.DictReader(open(LOG)))
        assert rows[-1]["sample"] == "best"
        assert {row["cycle_time_ms"] for row in rows} == {"0.5"}
        assert len({row["chunk_size"] for row in rows}) >= 3
        assert len({row["fusion_threshold"] for row in rows}) >= 3
        scored = [row for row in rows if row["sample"] not in ("warm-up", "best")]
        assert all(float(row["bytes_per_second"]) > 0 for row in scored)


def test_the_cycle_times_autotune_tries_are_ones_init_accepts():
    for value in autotune.CANDIDATES["cycle_time_ms"]:
        assert config.from_environ({"MPITRAIN_CYCLE_TIME": str(value)}).cycle_time_ms == value
