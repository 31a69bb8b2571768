"""A 2000-step run on 3 ranks: memory stays flat, nothing leaks, ranks agree.

tests/scripts/soak.py trains a small model whose parameters have mixed sizes
and dtypes, submitting its allreduces in a different random order on each
rank, with the other collectives mixed in. About a minute on two cores; run
with -s to see the memory figures.
"""

import json
import os
import tempfile

from tests.mpi_harness import run_mpi

STEPS = 2000
RANKS = 3
GROWTH_LIMIT_KIB = 4096        # resident memory may grow this much after warm-up


def test_a_long_run_keeps_memory_flat_leaks_nothing_and_ends_bitwise_identical():
    with tempfile.TemporaryDirectory() as out_dir:
        job = run_mpi(RANKS, ["tests/scripts/soak.py", str(STEPS), out_dir], timeout=400)
        assert job.returncode == 0, job.stderr[-4000:]
        reports = []
        for rank in range(RANKS):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as stream:
                reports.append(json.load(stream))
    for rank, report in enumerate(reports):
        memory = {int(step): figures for step, figures in report["memory"].items()}
        warm, last = memory[STEPS // 10], memory[STEPS]
        growth = last["rss_kib"] - warm["rss_kib"]
        print(f"\nrank {rank}: resident {warm['rss_kib']} KiB at step {STEPS // 10}, "
              f"{memory[STEPS // 2]['rss_kib']} KiB at {STEPS // 2}, "
              f"{last['rss_kib']} KiB at {STEPS} ({growth:+d} KiB); "
              f"live handles {[m['handles'] for m in memory.values()]}")
        assert growth < GROWTH_LIMIT_KIB, (rank, memory)
        assert len({m["handles"] for m in memory.values()}) == 1, (rank, memory)
        assert report["leftovers"] == {}, (rank, report["leftovers"])
        assert report["finite"], rank
    assert len({report["digest"] for report in reports}) == 1, "parameters differ"
