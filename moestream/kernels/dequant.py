"""Quantized expert rows dequantized for the prompt path's grouped GEMM (Triton, CUDA).

    w13, w2 = dequantize_rows(rows, index, layout, torch.bfloat16)   # rows (S, >= nbytes) uint8; index (n,) int64
    # w13 (n, 2I, H), w2 (n, H, I): experts index[0..n) of the slot pool, as the grouped GEMM reads float slots

Each kernel program reads a run of one matrix's blocks straight from its slot (no gather copy of the rows first)
and writes their values, which are a contiguous run of the output too: a matrix of R rows of C values is R C / bs
consecutive blocks in ggml's layout. The float32 values are gguf.quants' bits (kernels/qblocks.py, no fused
multiply-add), rounded once to out_dtype: the result equals `layout.dequantize(rows[index]).to(out_dtype)`.
Matrices of a type without a Triton path take the plain-torch dequantizer.

The two outputs are views of one (n, 3 I H) buffer, as a float layout's slot pool presents its rows
(`ExpertLayout.views`), so consecutive matrices of one type (gate and up of Q4_K_M, all three of Q8_0) are one
launch.
"""
from __future__ import annotations

import os

import torch

from ..quant.layout import ExpertLayout
from .qblocks import SHAPES, has_path, kvalues, triton

VALUES = 4096            # values per program: 16 blocks of 256 or 128 of 32; fixed (the bits never depend on it,
WARPS = 4                # but a fixed shape keeps runs alike)


if triton is not None:
    import triton.language as tl

    from .qblocks import block_values, to_bf16

    @triton.jit
    def _dequant(rows_ptr, index_ptr, stride, out_ptr, out_stride, kv_ptr, in_off, out_off, nblocks,
                 QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr,
                 BB: tl.constexpr, BF16: tl.constexpr):
        """Program (expert i, run of BB blocks): blocks [b0, b0 + BB) of the segment at byte in_off of slot
        index[i]'s row, written to values [out_off + b0 BS, ...) of output row i."""
        i = tl.program_id(0)
        b = tl.program_id(1) * BB + tl.arange(0, BB)[:, None, None]                        # (BB, 1, 1)
        j = tl.arange(0, NSUB)[None, :, None]
        l = tl.arange(0, SUB)[None, None, :]
        slot = tl.load(index_ptr + i)
        m = b < nblocks
        p = rows_ptr + slot * stride + in_off + b * TS
        v = block_values(p, j, l, m, kv_ptr, QT)                                           # (BB, NSUB, SUB)
        dst = out_ptr + i.to(tl.int64) * out_stride + out_off + b * BS + j * SUB + l
        v = to_bf16(v) if BF16 else v.to(out_ptr.dtype.element_ty)
        tl.store(dst, v, mask=m & (j >= 0) & (l >= 0))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _segments(layout: ExpertLayout) -> list[list]:
    """[[type, byte offset, bytes, value offset, values]]: consecutive matrices of one type merged (one launch)."""
    I, H = layout.inter, layout.hidden
    segs, voff = [], 0
    for t, off, size, count in zip(layout.types, layout.offsets, layout.sizes, (I * H, I * H, H * I)):
        if segs and segs[-1][0] == t:
            segs[-1][2] += size
            segs[-1][4] += count
        else:
            segs.append([t, off, size, voff, count])
        voff += count
    return segs


def dequantize_rows(rows: torch.Tensor, index: torch.Tensor, layout: ExpertLayout,
                    out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (S, >= nbytes) uint8, index (n,) int64 -> w13 (n, 2I, H), w2 (n, H, I) of out_dtype."""
    if layout.fp8:                  # FP8 block-scaled matrices: kernels/fp8.py
        from .fp8 import dequantize_rows_fp8
        return dequantize_rows_fp8(rows, index, layout, out_dtype)
    assert layout.quantized and rows.dtype == torch.uint8 and rows.stride(1) == 1
    I, H = layout.inter, layout.hidden
    index = index.reshape(-1).to(device=rows.device, dtype=torch.int64).contiguous()
    n = index.numel()
    out = torch.empty(n, 3 * I * H, dtype=out_dtype, device=rows.device)                   # (n, 3 I H)
    fast = triton is not None and (rows.is_cuda or _interpreting())
    kv = kvalues(rows.device) if fast else None
    for t, off, size, voff, count in _segments(layout):
        if n and fast and has_path(t, count):
            bs, ts, nsub, sub = SHAPES[t]
            bb = VALUES // bs
            nb = count // bs
            _dequant[(n, triton.cdiv(nb, bb))](rows, index, rows.stride(0), out, out.stride(0), kv, off, voff, nb,
                                               int(t), bs, ts, nsub, sub, bb, out_dtype == torch.bfloat16,
                                               num_warps=WARPS, enable_fp_fusion=False)
        elif n:
            from ..quant.dequant import dequantize
            out[:, voff:voff + count] = dequantize(rows[index, off:off + size], t).to(out_dtype)   # (n, count)
    return ExpertLayout(I, H).views(out)
