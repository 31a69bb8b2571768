"""The GPU path: the CuPy backend, its kernels, and the transports of device buffers.

CuPy is imported lazily: importing this package needs neither CuPy nor a GPU.
"""
