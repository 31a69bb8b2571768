"""What a failing GPU test prints: the transport, the routes taken, the arrays' layouts
and the first wrong values, so that a log from a GPU machine needs no rerun.

GPU tests run on a borrowed machine and their logs are read elsewhere, later.
expect() compares a result (CuPy, torch or numpy, any layout, 16-bit floats
too) with what it should be and, where they differ, raises an AssertionError
that says everything a reader needs. watch_routes() makes the engine's route
records (logged at debug level, once per kind of group) available to it.
"""

import logging

import ml_dtypes
import numpy as np

import mpitrain as mt
from devtools import simulated_cupy

ROUTES = []                  # the engine's "reduces ... by ..." records in this process
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class _RouteRecords(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if " reduces " in message:
            ROUTES.append(message.removeprefix("mpitrain: "))


def watch_routes():
    """Collect the routes the engine takes from now on (call after init())."""
    logger = logging.getLogger("mpitrain")
    if not any(isinstance(handler, _RouteRecords) for handler in logger.handlers):
        logger.addHandler(_RouteRecords(logging.DEBUG))
    logger.setLevel(logging.DEBUG)


def transport():
    """How this job moves device buffers, and the routes its groups took so far."""
    from mpitrain.transport import selection
    engine = mt.api.basics.engine()
    taken = "".join(f"\n    {line}" for line in ROUTES) or " none recorded"
    return (f"{simulated_cupy.describe()}: "
            f"{selection.describe(engine.device_plan, engine.cuda_aware)}\n"
            f"  routes taken:{taken}")


def host_copy(array):
    """``array`` (CuPy, torch or numpy, any strides) as a numpy array on the host."""
    if isinstance(array, np.ndarray):
        return array
    if type(array).__module__.startswith("torch"):
        import torch
        tensor = array.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    # by its bits: CuPy need not do arithmetic on bfloat16 to copy it
    return array.view(_UNSIGNED[array.dtype.itemsize]).get().view(array.dtype)


def layout(array):
    """Shape, dtype, strides and offset of a CuPy, torch or numpy array."""
    kind = _kind(array)
    if kind == "torch":
        return (f"torch {array.device} shape {tuple(array.shape)} {array.dtype}, strides "
                f"{array.stride()} elements, storage offset {array.storage_offset()}, "
                f"C-contiguous {array.is_contiguous()}")
    if kind == "cupy":
        offset = array.data.ptr - array.data.mem.ptr
        return (f"cupy on GPU {array.device.id} shape {array.shape} {array.dtype}, strides "
                f"{array.strides} bytes, {offset} bytes into its allocation, "
                f"C-contiguous {array.flags.c_contiguous}")
    return (f"{kind} shape {np.shape(array)} {np.asarray(array).dtype}, strides "
            f"{np.asarray(array).strides} bytes")


def expect(got, want, what, inputs=(), rtol=0.0, atol=0.0):
    """Assert that ``got`` holds ``want`` (a value or an array: exactly, or
    within rtol and atol); else fail with everything a reader needs."""
    values = host_copy(got)
    wanted = (host_copy(want) if _kind(want) in ("torch", "cupy") else np.asarray(want))
    if wanted.ndim == 0:
        wanted = np.broadcast_to(wanted, values.shape)
    if np.shape(values) == np.shape(wanted):
        wide, wide_want = _wide(values), _wide(wanted)
        right = np.isclose(wide, wide_want, rtol=rtol, atol=atol, equal_nan=True)
        if right.all():
            return
        wrong = np.flatnonzero(~right)
        shown = "; ".join(
            f"{list(map(int, np.unravel_index(i, values.shape)))} got {wide.flat[i].item()!r},"
            f" want {wide_want.flat[i].item()!r}" for i in wrong[:8])
        verdict = f"{wrong.size} of {values.size} values wrong, first: {shown}"
    else:
        verdict = f"shape {np.shape(values)}, want {np.shape(wanted)}"
    lines = [f"{what}: wrong on rank {mt.rank()} of {mt.size()}: {verdict}",
             f"  result: {layout(got)}"]
    lines += [f"  input: {layout(array)}" for array in inputs]
    lines.append(f"  transport: {transport()}")
    raise AssertionError("\n".join(lines))


def device_route():
    """The route of device float32 sums on the job-wide set, as docs/gpu.md says."""
    engine = mt.api.basics.engine()
    plan = engine.device_plan
    if mt.size() == 1 and not engine.config.test_one_rank_pipeline:
        return "one rank"
    return "NCCL" if plan.nccl else "CUDA-aware MPI" if plan.cuda_aware else "staged"


def expect_route(kind, route, set_id=0):
    """Assert that the engine reduced groups of ``kind`` (e.g. "GPU float32
    sum") on process set ``set_id`` by ``route`` (e.g. "CUDA-aware MPI"), and
    by no other route."""
    said = [line for line in ROUTES
            if line.startswith(f"process set {set_id} reduces ") and f"({kind}) by " in line]
    assert said and all(f"({kind}) by {route} (" in line for line in said), (
        f"{kind} groups of process set {set_id} on rank {mt.rank()} of {mt.size()} "
        f"should go by {route}; transport: {transport()}")


def _kind(array):
    """torch, cupy (the simulated device's arrays too), numpy or another module."""
    module = type(array).__module__
    return "cupy" if "cupy" in module else module.split(".")[0]


def _wide(values):
    """Values comparable across types: 16-bit floats exactly as float32."""
    if values.dtype in (np.float16, ml_dtypes.bfloat16):
        return values.astype(np.float32)
    if values.dtype.kind == "f":
        return values
    return values.astype(np.float64) if values.dtype.kind in "iub" else values
