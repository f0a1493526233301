"""Many expert rows copied from pinned host memory into scattered slots by one driver call, on the copy engines
(cuMemcpyBatchAsync, CUDA 12.8 and later drivers).

    if batch_copy_available(pool.device):
        batch_copy(dst_addrs, src_addrs, nbytes, stream)     # (n,) uint64 numpy arrays of addresses, on `stream`

Why: a prompt that sweeps a layer's experts misses hundreds of them, each into a slot of its own. One copy call an
expert cost the host ~30 µs (bench/RESULTS.md, stop 25); the row-copy kernel (copy_rows.py) takes that cost away
but its programs hold SMs the GEMMs beside it would use (4 GB of copies beside 20 bf16 matmuls: 104.6 ms as the
kernel, 84.7 ms as copy calls). One batch call hands the driver every (from, to, bytes) at once: the host's cost of
one call, and the copy engines' bandwidth with no SM taken from compute.

torch does not expose the call, so it is reached through the driver library with ctypes, as vLLM's KV offload
does. The first use in a process copies a few rows and checks their bytes: a driver without the call, or one
whose call misbehaves, leaves the copies to the kernel or to copy calls (`batch_copy_available` says False).
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

log = logging.getLogger("moestream")

SRC_ORDER_STREAM = 1                    # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the sources are read in stream order
CUDA_VERSION = 12080                    # the version of the call's signature asked for (with its failIdx)
NOT_CURRENT = 201                       # CUDA_ERROR_INVALID_CONTEXT: this thread has no current context yet


class _Location(ctypes.Structure):      # CUmemLocation
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):    # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int,                      # CUresult cuMemcpyBatchAsync(
                              ctypes.c_void_p, ctypes.c_void_p,  # dsts, srcs (CUdeviceptr *)
                              ctypes.c_void_p, ctypes.c_size_t,  # sizes (size_t *), count
                              ctypes.c_void_p, ctypes.c_void_p,  # attrs, attrsIdxs (size_t *)
                              ctypes.c_size_t, ctypes.c_void_p,  # numAttrs, failIdx (size_t *)
                              ctypes.c_void_p)                   # hStream)
_ATTRS = _Attributes(srcAccessOrder=SRC_ORDER_STREAM)           # one set of attributes for every copy
_ATTRS_AT = np.zeros(1, dtype=np.uint64)                        # ... which applies from copy 0 on
_state: dict = {}                                               # "fn": the entry point; device -> checked


def _entry_point():
    """The driver's cuMemcpyBatchAsync, or None where the driver has no such call."""
    if "fn" not in _state:
        _state["fn"] = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            get = lib.cuGetProcAddress_v2
        except (OSError, AttributeError):
            return None
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                        ctypes.c_void_p]
        get.restype = ctypes.c_int
        ptr = ctypes.c_void_p()
        if get(b"cuMemcpyBatchAsync", ctypes.byref(ptr), CUDA_VERSION, 0, None) == 0 and ptr.value:
            _state["fn"] = _SIGNATURE(ptr.value)
    return _state["fn"]


def batch_copy(dst: np.ndarray, src: np.ndarray, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Copy nbytes from each address of src (n,) to the address at the same index of dst (n,) on `stream`, by one
    call; the copies complete in stream order. The address arrays are read during the call."""
    n = len(dst)
    if n == 0:
        return
    dst = np.ascontiguousarray(dst, dtype=np.uint64)
    src = np.ascontiguousarray(src, dtype=np.uint64)
    sizes = np.full(n, nbytes, dtype=np.uint64)
    fail = ctypes.c_size_t(0)
    args = (dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n, ctypes.addressof(_ATTRS), _ATTRS_AT.ctypes.data,
            1, ctypes.addressof(fail), stream.cuda_stream)
    err = _entry_point()(*args)
    if err == NOT_CURRENT:                      # a thread the CUDA runtime has not bound yet: bind it, once more
        torch.cuda.set_device(stream.device)
        err = _entry_point()(*args)
    if err != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {err} at copy {fail.value} of {n}")


def batch_copy_available(device: torch.device) -> bool:
    """Whether batch_copy works on this CUDA device: the driver has the call, and a first batch of scattered rows
    lands byte for byte (checked once a process and device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    key = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _state:
        _state[key] = _entry_point() is not None and _check(key)
    return _state[key]


def _check(device: torch.device) -> bool:
    """A few rows of odd sizes into scattered rows of a wider buffer: their bytes, and the bytes around them."""
    try:
        g = torch.Generator().manual_seed(0)
        host = torch.randint(0, 256, (5, 1000), dtype=torch.uint8, generator=g).pin_memory()
        dev = torch.zeros(8, 1024, dtype=torch.uint8, device=device)
        slots = np.array([6, 1, 3, 0, 5])
        stream = torch.cuda.Stream(device)
        batch_copy(dev.data_ptr() + slots * 1024, host.data_ptr() + np.arange(5) * 1000, 1000, stream)
        stream.synchronize()
        want = torch.zeros(8, 1024, dtype=torch.uint8)
        want[torch.from_numpy(slots), :1000] = host
        if torch.equal(dev.cpu(), want):
            return True
        log.warning("cuMemcpyBatchAsync copied wrong bytes in its check; expert copies use the row-copy kernel")
    except RuntimeError as e:
        log.warning("cuMemcpyBatchAsync is not usable here (%s); expert copies use the row-copy kernel", e)
    return False
