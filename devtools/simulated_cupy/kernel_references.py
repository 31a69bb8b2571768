"""numpy references of mpitrain's pack and unpack kernels (mpitrain/backends/kernels.py).

Each reference does what its CUDA source does, element for element: the
segment table's layout and binary search, the element codes, float16 and
bfloat16 widened exactly and rounded to nearest even (bfloat16 by the same
bit formula, NaN kept quiet with its sign), and the scaling in the wire
type's COMPUTE type. They are pinned to the SHA-256 of each wire type's
source as reviewed: a change to the CUDA code makes RawModule refuse to run
it until the reference here says what the new code does and its hash is
updated (print them with ``python -m devtools.simulated_cupy.kernel_references``).

Where the CUDA code would read or write out of bounds (a table whose starts
do not begin at 0 or go down, a segment past the end of the buffer) the
reference raises: a GPU would corrupt memory or fault there.
"""

import numpy as np

from devtools.simulated_cupy import kernels
from devtools.simulated_cupy.errors import SimulatedCudaError

PINNED = {
    "uint8": "0f6d91d5f8168d23f75a840d4f4480cfa3b0a45a7f6d54692784de13ab13d1cc",
    "int8": "ee7fcc5354a3bd7f5d520e42d0a7d190bbde338342727d40e813e13a51c8254e",
    "uint16": "fa34bef2d117dc769c690fff293aa55d228bd1d8247d55a9d9d1d18ae6275de4",
    "int16": "4e41ba1eabc9c2652d2e291695fc3e4c3476c71e0e0fcfb81f8a54a006b6c00e",
    "int32": "7e0af87cfd2ed7c7b22578090551c8a9fe833f28a70dd04232f19e8d4d224879",
    "int64": "7d4f48e07438a1117b6dd485c756e8dc637d1a9850418975cc7135d97246364a",
    "float32": "ebe65655f1aa8668d6ba1a5bfd5da360c9fa3ec28a1f3400bf13fe29bc5d69ed",
    "float64": "f1411cdc2337fbe8e2bf97b7a20692deba7b46f53185921bd3576f1ffea6efc6",
}

# (buffer, table, count, total, factor, scaled)
SIGNATURE = (kernels.ARRAY, kernels.ARRAY, np.int32, np.int64, np.float64, np.int32)

_FLOAT32, _INT64 = np.dtype(np.float32), np.dtype(np.int64)
_HALF_CODE, _BFLOAT16_CODE = 1, 2
_NARROW_INTEGERS = {3: np.uint8, 4: np.int8, 5: np.uint16, 6: np.int16, 7: np.int32}


def _element_type(wire, code):
    """The type a segment's memory holds (mpitrain_load's and mpitrain_store's switch)."""
    if wire == _FLOAT32:
        return {_HALF_CODE: np.float16, _BFLOAT16_CODE: np.uint16}.get(code, np.float32)
    if wire == _INT64:
        return _NARROW_INTEGERS.get(code, np.int64)
    return wire


def _widen(values, wire, code):
    if wire == _FLOAT32 and code == _BFLOAT16_CODE:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(wire)


def _narrow(values, wire, code):
    if wire == _FLOAT32 and code == _BFLOAT16_CODE:
        return bfloat16_bits(values)
    return values.astype(_element_type(wire, code))


def bfloat16_bits(values):
    """float32 to bfloat16 bits as mpitrain_float_to_bfloat16 rounds them."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded[nan] = (((bits[nan] >> 16) & 0x8000) | 0x7FC0).astype(np.uint16)
    return rounded


def _scale(values, wire, factor):
    """(WIRE)((COMPUTE)value * (COMPUTE)factor): float for a float32 wire, else
    double; into an integer type truncated toward zero and clamped to its
    range, NaN to 0, as PTX's cvt.rzi does."""
    if wire == _FLOAT32:
        return values * np.float32(factor)
    product = values.astype(np.float64) * factor
    if wire.kind == "f":
        return product.astype(wire)
    info = np.iinfo(wire)
    product = np.trunc(np.nan_to_num(product, nan=0.0, posinf=np.inf, neginf=-np.inf))
    result = np.clip(product, info.min, info.max).astype(wire)
    result[product >= float(info.max)] = info.max     # 2**63 - 1 rounds up in float64
    result[product <= float(info.min)] = info.min
    return result


def _segments(launch):
    """(address, start in the joint index space, length, offset, code) per segment."""
    count, total = int(launch.scalar(2)), int(launch.scalar(3))
    if total == 0:
        return []
    table = launch.array(1)
    if table.dtype != _INT64 or table.size < 4 * count or count < 1:
        raise SimulatedCudaError(f"kernel {launch.name}: a table of {count} segments "
                                 f"needs {4 * count} int64, got {table.size} {table.dtype}")
    addresses, starts, offsets, codes = (table[i * count:(i + 1) * count].copy()
                                         for i in range(4))
    if starts[0] != 0 or np.any(np.diff(starts) < 0) or starts[-1] > total:
        raise SimulatedCudaError(f"kernel {launch.name}: the segment starts {starts[:8]} "
                                 f"are not sorted from 0 within {total}: its binary "
                                 "search would read out of bounds")
    ends = np.append(starts[1:], total)
    return [(int(a), int(s), int(e - s), int(o), int(c))
            for a, s, e, o, c in zip(addresses, starts, ends, offsets, codes) if e > s]


def _buffer_part(launch, buffer, offset, length):
    if offset < 0 or offset + length > buffer.size:
        raise SimulatedCudaError(f"kernel {launch.name}: elements {offset}:"
                                 f"{offset + length} lie outside the buffer of "
                                 f"{buffer.size}")
    return buffer[offset:offset + length]


def pack(wire):
    def reference(launch):
        buffer = launch.array(0)
        factor, scaled = float(launch.scalar(4)), bool(launch.scalar(5))
        for address, start, length, offset, code in _segments(launch):
            if address == 0:                 # a joined rank's share: zeros
                values = np.zeros(length, wire)
            else:
                source = launch.memory(address, length, _element_type(wire, code),
                                       f"source of elements {start}:{start + length}")
                values = _widen(source, wire, code)
            if scaled:
                values = _scale(values, wire, factor)
            _buffer_part(launch, buffer, offset, length)[...] = values
    return reference


def unpack(wire):
    def reference(launch):
        buffer = launch.array(0)
        factor, scaled = float(launch.scalar(4)), bool(launch.scalar(5))
        for address, start, length, offset, code in _segments(launch):
            values = _buffer_part(launch, buffer, offset, length).copy()
            if scaled:
                values = _scale(values, wire, factor)
            target = launch.memory(address, length, _element_type(wire, code),
                                   f"output of elements {start}:{start + length}")
            target[...] = _narrow(values, wire, code)
    return reference


def register_all(source):
    """Register the references for mpitrain's kernels, pinned to their hashes;
    ``source(wire)`` is mpitrain.backends.kernels.source, whose text is hashed."""
    for name, pinned in PINNED.items():
        wire = np.dtype(name)
        code = source(wire)
        if kernels.digest(code) != pinned:
            continue                    # edited: RawModule will refuse it, saying why
        kernels.register(code, "mpitrain_pack", SIGNATURE, pack(wire))
        kernels.register(code, "mpitrain_unpack", SIGNATURE, unpack(wire))


if __name__ == "__main__":
    from mpitrain.backends.kernels import source as _source
    for _name in PINNED:
        print(f'    "{_name}": "{kernels.digest(_source(np.dtype(_name)))}",')
