"""The simulated device's state in this process: its settings, the scheduler
of its streams, the registry of its memory, one pool per GPU."""

import atexit

from devtools.simulated_cupy import settings as settings_module
from devtools.simulated_cupy.errors import SimulatedCudaError, runtime_error
from devtools.simulated_cupy.memory import Pool, Registry
from devtools.simulated_cupy.scheduler import Scheduler

_state = None


class Simulation:
    def __init__(self, settings):
        self.settings = settings
        self.rank = settings_module.world_rank()
        self.local_rank = settings_module.local_rank()
        self.scheduler = Scheduler(settings.seed, self.rank)
        self.registry = Registry()
        self.device_count = 1         # this rank's own GPU, or the host's shared one
        self._pools = {}

    def check_device(self, device):
        if not 0 <= device < self.device_count:
            raise runtime_error(101, f"device {device}; the simulated host has "
                                     f"{self.device_count} GPU")

    def pool(self, device):
        self.check_device(device)
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = Pool(device, self.settings, self.registry,
                                              self.scheduler)
        return pool

    def bus_id(self, device):
        """The PCI bus id of ``device``: one per rank, or one for the host (shared)."""
        self.check_device(device)
        return "0000:01:00.0" if self.settings.shared else \
            f"0000:{self.local_rank + 1:02x}:00.0"


def start(settings):
    global _state
    _state = Simulation(settings)
    atexit.register(_stop)
    return _state


def _stop():
    _state.scheduler.closed = True      # frees at exit queue nothing


def state():
    if _state is None:
        raise SimulatedCudaError("the simulated CUDA device is not installed "
                                 "(devtools.simulated_cupy.install)")
    return _state
