"""Runs inside each rank of a test job: executes the named tests in order."""

import faulthandler
import importlib.util
import json
import os
import sys
import threading
import time
import traceback

import pytest

from devtools import simulated_cupy
from tests.mpi_harness import run_labelled


def _load(path):
    spec = importlib.util.spec_from_file_location("mpi_test_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Watchdog:
    """Ends the job when one test runs longer than its timeout."""

    def __init__(self, timeout, report):
        self.timeout = timeout
        self.report = report
        self.armed = threading.Event()
        self.disarmed = threading.Event()
        self.name = None
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, name):
        self.name = name
        self.disarmed.clear()
        self.armed.set()

    def disarm(self):
        self.armed.clear()
        self.disarmed.set()

    def _watch(self):
        while True:
            self.armed.wait()
            if not self.disarmed.wait(self.timeout):
                self.report(self.name, "failed",
                            f"timed out after {self.timeout} s (a hang?)")
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(124)


def main():
    path, outdir, timeout, init = sys.argv[1:5]
    names = sys.argv[5:]
    simulated_cupy.install()      # where MPITRAIN_TEST_SIMULATED_GPU asks for it
    module = _load(path)
    import mpitrain
    if init == "1":
        mpitrain.init()
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
    results = {}
    output = os.path.join(outdir, f"rank{rank}.json")

    def report(name, status, message):
        earlier = results.get(name, {})
        if earlier.get("status") == "failed":   # keep why, when it then waits for the others
            message = f"{earlier['message']}\nthen {message}"
        results[name] = {"status": status, "message": message}
        with open(output + ".tmp", "w") as stream:
            json.dump(results, stream)
        os.replace(output + ".tmp", output)

    watchdog = Watchdog(float(timeout), report)
    for name in names:
        watchdog.arm(name)
        started = time.monotonic()
        try:
            run_labelled(module, name)
            status, message = "passed", ""
        except pytest.skip.Exception as skip:
            status, message = "skipped", str(skip)
        except BaseException:
            status, message = "failed", traceback.format_exc()
        if status != "skipped":
            message += f"\n({time.monotonic() - started:.2f} s)"
        report(name, status, message)
        from mpi4py import MPI     # initialized by now, by mpitrain.init()
        MPI.COMM_WORLD.Barrier()
        watchdog.disarm()


if __name__ == "__main__":
    main()
