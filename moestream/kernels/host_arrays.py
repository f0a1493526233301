"""Small host arrays (a layer's slot table, the slots it reads, a forward's token ids) onto the device by a kernel
that reads pinned host memory in place, not by a copy call.

    t = upload(np.array([3, 1, 2]), device)     # a device tensor of those values, in order on the current stream

Why: a cached prompt's compute stream waits for a layer's missed experts on the copy stream, then copies the
layer's 4 KB slot table (and the slots it reads) from pinned memory, and the copy stream goes on with the next
layer's experts. A copy call queued so, behind a wait for another stream, ran only after every copy that stream
got after it: on Qwen3-Next's Q4_K_M at 4000 MiB the next layer's 8.5 ms of experts, so that compute and copies
took turns instead of overlapping (ubatch 4096: 19.2-20.2k tok/s; by kernel 22.8-24.2k, H100). Alone on an H100,
a 4 KB copy call behind such a wait ran 35 ms late, after 1.9 GB of later copies; the kernel at once (bench/
RESULTS.md, stop 38). A kernel reads the bytes over the link in place (unified addressing, as the decode kernels
do) and waits for nothing but the compute stream's own work.

The bytes go through a pinned arena of two halves: an upload takes the next bytes of the current half; when one
half is full the other is taken again, once the work queued before it was left (an event on each stream that
read it) has run. The arena's address is baked into the launch, so no upload may be captured in a CUDA graph;
those, arrays over half the arena, and all arrays without CUDA and Triton go by copy call. (MOESTREAM_HOST_ARRAYS=copy,
every array by copy call for an A/B, was removed at stop 47: bench/RESULTS.md, stop 38.)
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .decode import triton

HALF_BYTES = 2 << 20          # each half of the pinned arena
ALIGN = 16                    # every upload starts 16-byte aligned in the arena (and pads to it)
BLOCK = 1024                  # words (4 bytes) a program copies

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["src_addr", "n_words"])
    def _from_host(src_addr, dst_ptr, n_words, BLOCK: tl.constexpr):
        """Program p copies words [p BLOCK, (p + 1) BLOCK) of n_words from the host address src_addr to dst."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n_words
        src = src_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        tl.store(dst_ptr + offs, tl.load(src + offs, mask=m), mask=m)


def copy_from_host(dst: torch.Tensor, src_addr: int, nbytes: int) -> None:
    """dst's first nbytes (a multiple of 4; dst contiguous) <- the host bytes at src_addr, by a kernel on the
    current stream. The host bytes must stay as they are until it has run."""
    assert nbytes % 4 == 0 and dst.is_contiguous() and dst.numel() * dst.element_size() >= nbytes, (nbytes, dst.shape)
    words = nbytes // 4
    if words:
        _from_host[(triton.cdiv(words, BLOCK),)](src_addr, dst.view(torch.int32), words, BLOCK=BLOCK, num_warps=4)


class SmallUploads:
    """One device's arena and its uploads (upload() keeps one for each CUDA device)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.arena = torch.empty(2 * HALF_BYTES, dtype=torch.uint8, pin_memory=True)
        self.view = self.arena.numpy()
        self.half, self.offset = 0, 0
        self.readers: list[dict] = [{}, {}]      # per half: stream -> an event after the last upload it read there
        self.lock = threading.Lock()

    def upload(self, a: np.ndarray) -> torch.Tensor:
        a = np.ascontiguousarray(a)
        n = a.nbytes
        padded = -(-max(n, 1) // ALIGN) * ALIGN
        if padded > HALF_BYTES or torch.cuda.is_current_stream_capturing():
            return _by_copy_call(a, self.device)
        stream = torch.cuda.current_stream(self.device)
        with self.lock:
            if self.offset + padded > HALF_BYTES:
                self._next_half()
            at = self.half * HALF_BYTES + self.offset
            self.view[at:at + n] = a.view(np.uint8).reshape(-1)
            out = torch.empty(padded, dtype=torch.uint8, device=self.device)
            copy_from_host(out, self.arena.data_ptr() + at, padded)
            self.offset += padded
            self.readers[self.half][stream] = None        # an event is recorded when this half is left
        return out[:n].view(_torch_dtype(a.dtype)).view(a.shape)

    def _next_half(self) -> None:
        """Record where each stream that read the current half has got to; take the other half once its readers'
        work has run."""
        for s in self.readers[self.half]:
            ev = torch.cuda.Event()
            ev.record(s)
            self.readers[self.half][s] = ev
        self.half = 1 - self.half
        for ev in self.readers[self.half].values():
            ev.synchronize()
        self.readers[self.half] = {}
        self.offset = 0


_uploads: dict[torch.device, SmallUploads] = {}


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """a (a numpy array) on `device`, without waiting for it: on CUDA by the kernel above (through pinned memory by
    a copy call where Triton is missing, or in a graph's capture), elsewhere a plain copy."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)
    if triton is None:
        return _by_copy_call(a, device)
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device not in _uploads:
        _uploads[device] = SmallUploads(device)
    return _uploads[device].upload(a)


def _by_copy_call(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).pin_memory().to(device, non_blocking=True)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
