"""Dot products of GGML rows with a float vector, value by value (Triton): the "values" decode kernel's inner loop.

    acc = value_dots(p, rmask, vec_ptr, kv_ptr, QT, NB, BS, TS, NSUB, SUB, BB)   # p (R,) row pointers -> (R,) float32

Each value is kernels/qblocks.py's `block_values` (gguf.quants' bits) times x, summed per row in float32. (A form
with the scales out of the inner product, by sub-block, was the "subblocks" variant: measured and removed at stop
47, bench/RESULTS.md, 2026-12-01 and issue 14.)
"""
from __future__ import annotations

from .qblocks import triton

if triton is not None:
    import triton.language as tl

    from .qblocks import block_values

    @triton.jit
    def value_dots(p, rmask, vec_ptr, kv_ptr, QT: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
                   TS: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr, BB: tl.constexpr):
        """(R,) float32: rows p (R,) (uint8 pointers to rows of NB blocks) against vec (NB BS), value by value."""
        j = tl.arange(0, NSUB)[None, None, :, None]
        l = tl.arange(0, SUB)[None, None, None, :]
        acc = tl.zeros(p.shape, dtype=tl.float32)
        for b0 in range(0, NB, BB):
            b = b0 + tl.arange(0, BB)[None, :, None, None]                                  # (1, BB, 1, 1)
            bmask = b < NB
            m = rmask[:, None, None, None] & bmask
            v = block_values(p[:, None, None, None] + b * TS, j, l, m, kv_ptr, QT)          # (R, BB, NSUB, SUB)
            xv = tl.load(vec_ptr + b * BS + j * SUB + l, mask=bmask & (j >= 0) & (l >= 0), other=0.0)
            acc += tl.sum(tl.sum(tl.sum(v * xv.to(tl.float32), axis=3), axis=2), axis=1)
        return acc
