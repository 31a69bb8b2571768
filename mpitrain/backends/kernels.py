"""The CUDA kernels of the GPU path: one launch packs, one launch unpacks a fused buffer.

A segment table on the device lists, for each tensor of a fusion buffer, its
address, where it starts in the tensors' joint index space, where it starts
in the buffer, and its element type. Every thread finds its tensor by a
binary search over the starts, so 64 small tensors cost one launch, not 64.

A float32 buffer carries float32, float16 and bfloat16 tensors: 16-bit floats
are widened on the way in and rounded to nearest even on the way out, by
their bits, so the sources include no CUDA header and NVRTC compiles them
wherever CuPy runs. An int64 buffer carries the narrower integers that are
averaged or scaled (mpitrain.backends.dtypes.wire). Scaling follows numpy's rules for
the host path: in float32 for a float32 buffer, in float64 for the others.
"""

import math

import ml_dtypes
import numpy as np

# Element codes in the segment table: a float32 buffer holds 16-bit floats, an
# int64 buffer narrower integers; any other buffer holds only its own type.
SAME, HALF, BFLOAT16 = 0, 1, 2
_CODES = {np.dtype(np.float16): HALF, np.dtype(ml_dtypes.bfloat16): BFLOAT16,
          np.dtype(np.uint8): 3, np.dtype(np.int8): 4, np.dtype(np.uint16): 5,
          np.dtype(np.int16): 6, np.dtype(np.int32): 7}

_C_TYPES = {np.dtype(t): c for t, c in [
    (np.uint8, "unsigned char"), (np.int8, "signed char"), (np.uint16, "unsigned short"),
    (np.int16, "short"), (np.int32, "int"), (np.int64, "long long"),
    (np.float32, "float"), (np.float64, "double")]}

THREADS = 256
MAX_BLOCKS = 4096        # the loops stride over the rest

_COMMON = r"""
typedef unsigned short mpitrain_bits16;

__device__ __forceinline__ int mpitrain_segment(const long long* starts, int count,
                                                long long i) {
    int low = 0, high = count - 1;
    while (low < high) {
        int middle = (low + high + 1) >> 1;
        if (starts[middle] <= i) low = middle; else high = middle - 1;
    }
    return low;
}
"""

_FLOAT_ELEMENTS = r"""
__device__ __forceinline__ float mpitrain_half_to_float(mpitrain_bits16 bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

__device__ __forceinline__ mpitrain_bits16 mpitrain_float_to_half(float value) {
    mpitrain_bits16 bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
}

__device__ __forceinline__ float mpitrain_bfloat16_to_float(mpitrain_bits16 bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}

__device__ __forceinline__ mpitrain_bits16 mpitrain_float_to_bfloat16(float value) {
    unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {          // NaN: keep the sign, make it quiet
        return (mpitrain_bits16)(((bits >> 16) & 0x8000u) | 0x7fc0u);
    }
    return (mpitrain_bits16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float mpitrain_load(long long address, long long code,
                                               long long j) {
    if (code == 1) return mpitrain_half_to_float(((const mpitrain_bits16*)address)[j]);
    if (code == 2) return mpitrain_bfloat16_to_float(((const mpitrain_bits16*)address)[j]);
    return ((const float*)address)[j];
}

__device__ __forceinline__ void mpitrain_store(long long address, long long code,
                                               long long j, float value) {
    if (code == 1) ((mpitrain_bits16*)address)[j] = mpitrain_float_to_half(value);
    else if (code == 2) ((mpitrain_bits16*)address)[j] = mpitrain_float_to_bfloat16(value);
    else ((float*)address)[j] = value;
}
"""

_WIDE_INTEGER_ELEMENTS = r"""
__device__ __forceinline__ long long mpitrain_load(long long address, long long code,
                                                   long long j) {
    switch (code) {
        case 3: return ((const unsigned char*)address)[j];
        case 4: return ((const signed char*)address)[j];
        case 5: return ((const unsigned short*)address)[j];
        case 6: return ((const short*)address)[j];
        case 7: return ((const int*)address)[j];
        default: return ((const long long*)address)[j];
    }
}

__device__ __forceinline__ void mpitrain_store(long long address, long long code,
                                               long long j, long long value) {
    switch (code) {
        case 3: ((unsigned char*)address)[j] = (unsigned char)value; break;
        case 4: ((signed char*)address)[j] = (signed char)value; break;
        case 5: ((unsigned short*)address)[j] = (unsigned short)value; break;
        case 6: ((short*)address)[j] = (short)value; break;
        case 7: ((int*)address)[j] = (int)value; break;
        default: ((long long*)address)[j] = value;
    }
}
"""

_SAME_ELEMENTS = r"""
__device__ __forceinline__ WIRE mpitrain_load(long long address, long long code,
                                              long long j) {
    return ((const WIRE*)address)[j];
}

__device__ __forceinline__ void mpitrain_store(long long address, long long code,
                                               long long j, WIRE value) {
    ((WIRE*)address)[j] = value;
}
"""

# table: addresses[count], starts[count], offsets[count], codes[count]
_KERNELS = r"""
#define MPITRAIN_SEGMENTS                                                          \
    const long long* addresses = table;                                            \
    const long long* starts = table + count;                                       \
    const long long* offsets = table + 2 * (long long)count;                       \
    const long long* codes = table + 3 * (long long)count;                         \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;  \
         i += (long long)gridDim.x * blockDim.x) {                                 \
        int k = mpitrain_segment(starts, count, i);                                \
        long long j = i - starts[k];

extern "C" __global__ void mpitrain_pack(WIRE* buffer, const long long* table,
                                         int count, long long total, double factor,
                                         int scaled) {
    MPITRAIN_SEGMENTS
        WIRE value = addresses[k] ? mpitrain_load(addresses[k], codes[k], j) : (WIRE)0;
        if (scaled) value = (WIRE)((COMPUTE)value * (COMPUTE)factor);
        buffer[offsets[k] + j] = value;
    }
}

extern "C" __global__ void mpitrain_unpack(const WIRE* buffer, const long long* table,
                                           int count, long long total, double factor,
                                           int scaled) {
    MPITRAIN_SEGMENTS
        WIRE value = buffer[offsets[k] + j];
        if (scaled) value = (WIRE)((COMPUTE)value * (COMPUTE)factor);
        mpitrain_store(addresses[k], codes[k], j, value);
    }
}
"""


def code(dtype):
    """The segment-table code of a tensor of ``dtype`` in a buffer of its wire type."""
    return _CODES.get(np.dtype(dtype), SAME)


def source(wire):
    """The CUDA source of the pack and unpack kernels for buffers of ``wire``."""
    wire = np.dtype(wire)
    c_type = _C_TYPES[wire]
    compute = "float" if wire == np.float32 else "double"
    elements = (_FLOAT_ELEMENTS if wire == np.float32 else
                _WIDE_INTEGER_ELEMENTS if wire == np.int64 else _SAME_ELEMENTS)
    return (f"#define WIRE {c_type}\n#define COMPUTE {compute}\n"
            + _COMMON + elements + _KERNELS)


def table(segments):
    """The segment table of (address, start, offset, code) rows, as int64."""
    rows = np.asarray(segments, dtype=np.int64).reshape(-1, 4)
    return np.ascontiguousarray(rows.T).reshape(-1)


def launch_shape(total):
    blocks = max(1, min(MAX_BLOCKS, math.ceil(total / THREADS)))
    return (blocks,), (THREADS,)
