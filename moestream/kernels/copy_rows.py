"""Many expert rows copied from pinned host memory into scattered slots in one launch (Triton, CUDA).

    copy_rows(src, dst, nbytes)      # src, dst (n,) int64 device addresses: dst[i] gets src[i]'s nbytes

Why: a prompt that sweeps a layer's experts misses hundreds of them, each into its own slot of the pool. As one
copy call an expert (cudaMemcpyAsync behind torch's copy_, an event, two slices) the host spent ~30 µs an expert:
on Qwen3-Next's Q4_K_M at 4000 MiB, 5000 copies a 4096-token prompt, half its time, while the link idled and the
next layer's compute waited to be launched (bench/RESULTS.md, stop 25). One launch moves a batch for the host
cost of one call. The programs read host memory over the link in place (unified addressing, as the decode kernels
do); a few persistent programs keep enough loads in flight to fill the link and leave the other SMs to compute.

The copy is bytes for bytes: the copy calls it replaces (experts/slots.py `run_copies`, the CPU path) are its
oracle, and nothing downstream can tell which made a slot.
"""
from __future__ import annotations

import torch

from .decode import triton


PROGRAMS = 16                # persistent programs: each keeps BLOCK bytes of loads in flight (16 x 64 KB in all)
BLOCK_BYTES = 65536
WARPS = 8


def copy_rows_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["first", "n_rows", "n_words", "chunks"])
    def _copy_rows(src_ptr, dst_ptr, first, n_rows, n_words, chunks, BLOCK: tl.constexpr, A16: tl.constexpr):
        """Program p copies chunks p, p + P, ... of the n_rows x chunks work items (row first + i, chunk c: BLOCK
        words). (The sizes are not specialized on: a new batch size compiles nothing.)"""
        p = tl.program_id(0)
        P = tl.num_programs(0)
        for w in range(p, n_rows * chunks, P):
            i = first + w // chunks
            c = w % chunks
            src = tl.load(src_ptr + i)
            dst = tl.load(dst_ptr + i)
            if A16:                     # (the shifts tell the compiler both are 16-aligned: 128-bit loads)
                src, dst = (src >> 4) << 4, (dst >> 4) << 4
            offs = c * BLOCK + tl.arange(0, BLOCK)
            m = offs < n_words
            v = tl.load(src.to(tl.pointer_type(tl.int32)) + offs, mask=m)
            tl.store(dst.to(tl.pointer_type(tl.int32)) + offs, v, mask=m)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, nbytes: int, aligned: bool, first: int = 0,
              count: int | None = None) -> None:
    """Copy nbytes (a multiple of 4) from each address of src (n,) int64 to the address at the same index of dst
    (n,), on the current stream: the `count` pairs from index `first` (default: all). aligned: every address and
    nbytes 16-byte aligned (128-bit loads)."""
    assert nbytes % 4 == 0 and src.shape == dst.shape and src.is_contiguous() and dst.is_contiguous(), \
        (nbytes, src.shape, dst.shape)
    n = src.numel() - first if count is None else count
    assert 0 <= first and first + n <= src.numel(), (first, n, src.numel())
    if n == 0:
        return
    words = nbytes // 4
    block = BLOCK_BYTES // 4
    chunks = triton.cdiv(words, block)
    _copy_rows[(min(PROGRAMS, n * chunks),)](src, dst, first, n, words, chunks, BLOCK=block,
                                             A16=aligned and nbytes % 16 == 0, num_warps=WARPS)
