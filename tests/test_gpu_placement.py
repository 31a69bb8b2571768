"""The tensors mpitrain's torch adapter makes are on the device of those it was given.

A buffer made on the CPU that meets CUDA tensors fails only on a GPU: SyncBatchNorm's
count did, on an H100 (fixed in f188ecd). torch's FakeTensorMode makes tensors on cuda:0
even on a CPU build of torch, with a device, shape and dtype but no data, and an op that
mixes one with a CPU tensor raises FakeTensorDeviceMismatchError as a GPU would; so
these tests catch such a buffer on every CI run. They check placement only: the values
need a real GPU (tests/test_gpu.py).

On a CPU build, indexing a cuda tensor from Python (t[i], t[:n], t[i] = v) and its
copy_ fail even under FakeTensorMode, with "PyTorch is not linked with support for
cuda devices": those bindings take CUDA's device guard before dispatching, and only
CUDA builds have one. So the tests that need them skip on cuda there and run on torch's
meta device as well, which refuses most ops that mix it with a CPU tensor too. Meta
lets a CPU operand through matmul and index_put_, hence the tests also check the device
of every tensor produced.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

import mpitrain.torch as hvd
from mpitrain.backends import arrays
from mpitrain.torch import Compression
from mpitrain.torch.optimizers import buckets
from mpitrain.torch.optimizers.reducer import gradient_of
from tests.mpi_harness import mpi_test

CUDA = torch.device("cuda:0")       # "cuda" without an index fails on a CPU build
NO_CUDA_GUARD = "PyTorch is not linked with support for cuda devices"
# Words of torch's errors where an op mixes a fake cuda:0 or a meta tensor with a CPU
# one, or moves a meta tensor to the CPU.
DEVICES_MIXED = ("device", "Cannot copy out of meta tensor")


@contextlib.contextmanager
def on(device):
    """Make tensors on ``device``: fake ones for cuda:0, data-less ones for meta."""
    with FakeTensorMode() if device == CUDA else contextlib.nullcontext():
        try:
            yield
        except RuntimeError as error:
            if NO_CUDA_GUARD not in str(error):
                raise
            pytest.skip("this CPU build of torch cannot index or copy_ into a cuda "
                        "tensor, even a fake one; the meta variant of this test runs "
                        "instead")


def check_device(tensor, device, what):
    assert tensor.device == device, f"{what} is on {tensor.device}, not on {device}"


def no_device_mix(call, what):
    """call(), failing with ``what`` where it mixes devices."""
    try:
        return call()
    except FakeTensorDeviceMismatchError as error:
        pytest.fail(f"{what} mixed devices: {error}")
    except RuntimeError as error:
        if (not any(words in str(error) for words in DEVICES_MIXED)
                or NO_CUDA_GUARD in str(error)
                or isinstance(error, hvd.HorovodInternalError)):   # mpitrain refused it
            raise
        pytest.fail(f"{what} mixed devices: {error}")


# -- SyncBatchNorm --------------------------------------------------------------------

@mpi_test(np=(2,))
def test_sync_batch_norm_builds_its_statistics_on_the_inputs_cuda_device():
    # With a second rank, forward sends the count, sums and sums of squares per
    # channel, made into one tensor by torch.cat, through an allreduce. That cannot
    # move fake tensors: as_array refuses a cuda tensor where CuPy is missing, with a
    # TypeError naming its device, raised on each rank at once (ops._input calls
    # array_ops.fail, which enqueues the failure for the peers without waiting for
    # them), so no rank hangs. That TypeError naming cuda:0 means all three reached
    # the allreduce on cuda:0; torch.cat refuses a CPU one beside cuda ones.
    if arrays.cupy() is not None:
        pytest.skip("CuPy takes cuda tensors here: tests/test_gpu.py runs SyncBatchNorm "
                    "on this GPU")
    for shape, dtype in (((4, 3), torch.float32), ((4, 3, 5), torch.float16),
                         ((2, 3, 4, 4), torch.bfloat16)):
        what = (f"SyncBatchNorm(3).forward of a {dtype} {shape} input on cuda:0, "
                "building the count, sums and sums of squares it allreduces,")
        with FakeTensorMode():
            with CUDA:      # only for the module: a default device would hide a
                norm = hvd.SyncBatchNorm(3)     # tensor that forward makes without one
            inputs = torch.empty(shape, dtype=dtype, device=CUDA)
            with pytest.raises(TypeError) as refused:
                no_device_mix(lambda: norm(inputs), what)
        assert "on device 'cuda:0'" in str(refused.value), (
            f"{what} did not reach its allreduce with the statistics on cuda:0: "
            f"{refused.value}")


@mpi_test(np=(2,))
def test_error_feedback_adds_a_residual_loaded_on_the_cpu_on_the_gradients_device():
    # As a checkpoint read with torch.load(map_location="cpu") gives it back. On meta:
    # top-k indexes, which a fake cuda tensor cannot do here. Past the addition, the
    # exchange refuses the meta payload on every rank, as SyncBatchNorm's above.
    meta = torch.device("meta")
    compressor = Compression.topk(0.1)
    what = "error feedback's correction of a meta gradient by a residual from the CPU"
    compressor.load_state("w", {"residual": torch.zeros(40, 30)}, own=True)
    with pytest.raises(TypeError) as refused:
        no_device_mix(lambda: compressor.start(torch.empty(40, 30, device=meta), "w",
                                               hvd.global_process_set), what)
    assert "on device 'meta'" in str(refused.value), (
        f"{what} did not reach its exchange on meta: {refused.value}")


# -- compression ----------------------------------------------------------------------

COMPRESSORS = {
    "fp16": Compression.fp16,
    "bf16": Compression.bf16,
    "topk_fraction": Compression.topk(0.1),
    "topk_count": Compression.topk(7, error_feedback=False),
    "onebit": Compression.onebit(chunk_size=64),
    "onebit_per_tensor": Compression.onebit(chunk_size=None),
    "int8": Compression.int8(chunk_size=64),
    "int4": Compression.int4(chunk_size=64),
    "powersgd": Compression.powersgd(rank=2),
}


def gradients(device):
    """Gradients of several shapes, layouts and dtypes (counts that leave partial
    chunks, odd counts for int4's pairs and onebit's bytes, a transposed one)."""
    yield torch.empty(40, 30, device=device)
    yield torch.empty(7, 3, 5, dtype=torch.float16, device=device)
    yield torch.empty(8, 3, 4, 4, dtype=torch.bfloat16, device=device).to(
        memory_format=torch.channels_last)
    yield torch.empty(30, 40, dtype=torch.float64, device=device).t()
    yield torch.empty(1000, device=device)


@pytest.mark.parametrize("device", [CUDA, torch.device("meta")], ids=["cuda", "meta"])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_compressed_payloads_and_results_stay_on_the_gradients_device(name, device):
    # compress and decompress are what the optimizer runs around the collectives:
    # the reducer's _wire_form and _write_back for the casts, GradientCompressor.start
    # and its exchange's wait for the others (PowerSGD's start and wait do compress's
    # and decompress's math between its two allreduces).
    compressor = COMPRESSORS[name]
    cast = isinstance(compressor, type)     # a Horovod cast: compress(tensor), no name

    def compress(grad):
        return compressor.compress(grad) if cast else compressor.compress(grad, "w")

    with on(device):
        for grad in gradients(device):
            what = f"Compression.{name} of a {grad.dtype} {tuple(grad.shape)} gradient"
            payload, context = no_device_mix(lambda: compress(grad), f"{what}: compress")
            for index, tensor in enumerate([payload] if cast else payload):
                check_device(tensor, device, f"{what}: payload[{index}]")
            result = no_device_mix(lambda: compressor.decompress(payload, context),
                                   f"{what}: decompress")
            check_device(result, device, f"{what}: the decompressed gradient")


def test_powersgd_moves_a_q_loaded_on_the_cpu_to_the_gradients_device():
    # As a checkpoint read with torch.load(map_location="cpu") gives it back.
    compressor = Compression.powersgd(rank=2)
    with FakeTensorMode():
        compressor.load_state("w", {"powersgd_q": torch.empty(30, 2)}, own=True)
        grad = torch.empty(40, 30, device=CUDA)
        what = "PowerSGD with a Q from the CPU"
        payload, context = no_device_mix(lambda: compressor.compress(grad, "w"),
                                         f"{what}: compress")
        for factor, tensor in zip("PQ", payload):
            check_device(tensor, CUDA, f"{what}: factor {factor}")


# -- gradient buckets -----------------------------------------------------------------

def bucketed_parameters(device):
    """Parameters of three dtypes (so three buckets), one of them channels_last."""
    tensors = {"conv.weight": torch.empty(4, 3, 3, 3, device=device).to(
                   memory_format=torch.channels_last),
               "conv.bias": torch.empty(4, device=device),
               "fc.weight": torch.empty(10, 16, dtype=torch.float16, device=device),
               "fc.bias": torch.empty(10, dtype=torch.float16, device=device),
               "embedding": torch.empty(5, 8, dtype=torch.bfloat16, device=device)}
    return {name: nn.Parameter(t) for name, t in tensors.items()}


@pytest.mark.parametrize("device", [CUDA, torch.device("meta")], ids=["cuda", "meta"])
def test_gradient_buckets_and_their_views_are_on_the_parameters_device(device):
    # What DistributedOptimizer forms after its first step (Reducer._form_buckets,
    # less the broadcast of rank 0's plan of names) and what _submit_bucket does
    # around the bucket's allreduce. The copies come last: copy_ is what a CPU build
    # cannot do on a cuda tensor.
    with on(device):
        parameters = bucketed_parameters(device)
        names = {p: name for name, p in parameters.items()}
        plan = buckets.plan(list(parameters.values()), names, buckets.DEFAULT_CAP)
        formed = buckets.form(plan, parameters, rank=0)
        assert len(formed) == 3, plan
        for bucket in formed:
            check_device(bucket.flat, device, f"the flat gradient of {bucket.name}")
            bucket.gather()     # no gradients yet: each p.grad becomes its zeroed view
            for p in bucket.params:
                check_device(p.grad, device, f"the gradient view of '{names[p]}'")
            for compression in (Compression.none, Compression.fp16, Compression.bf16):
                what = f"{bucket.name} through {compression.__name__}"
                wire, context = no_device_mix(lambda: compression.compress(bucket.flat),
                                              f"{what}: compress")
                check_device(wire, device, f"{what}: what travels")
                result = no_device_mix(lambda: compression.decompress(wire, context),
                                       f"{what}: decompress")
                check_device(result, device, f"{what}: the result")
        for p in parameters.values():
            p.grad = torch.empty_like(p)        # as autograd leaves them before buckets
        for bucket in formed:
            no_device_mix(bucket.gather, f"{bucket.name}: gather")
            wire, context = Compression.fp16.compress(bucket.flat)
            result = Compression.fp16.decompress(wire, context)
            no_device_mix(lambda: bucket.flat.copy_(result), f"{bucket.name}: write back")
            bucket.point()
            for p in bucket.params:
                check_device(p.grad, device, f"the gradient view of '{names[p]}' after "
                                             "the write back")


def test_a_parameter_without_gradient_contributes_zeros_on_its_device():
    with FakeTensorMode():
        p = nn.Parameter(torch.empty(3, 4, dtype=torch.float16, device=CUDA))
        what = "the zeros sent for a parameter without gradient"
        check_device(no_device_mix(lambda: gradient_of(p), what), CUDA, what)
