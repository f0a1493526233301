"""FP8 block-scaled expert rows (quant/fp8.py) in Triton: the prompt path's dequantizer and the decode GEMVs.

    w13, w2 = dequantize_rows_fp8(rows, index, layout, torch.bfloat16)   # as kernels/dequant.py's dequantize_rows
    out = experts_by_address_fp8(x, addrs, weights, layout)              # as kernels/decode_quant.py's kernel

A value is `e4m3(byte) * scale[r // 128, c // 128]`: the byte decoded to float32 in integers (`e4m3`, exactly
torch's float8_e4m3fn.float()), one float32 product, so the dequantizer gives the plain-torch oracle's bits
(`layout.dequantize(rows[index]).to(out_dtype)`), bf16 rounded to nearest even as kernels/qblocks.py's to_bf16.
The decode kernel multiplies each dequantized value by x (no fused multiply-add: enable_fp_fusion=False) and sums a
row in a fixed order (128 columns a step, a block of scales a step): it differs from the float32 oracle only in its
summation order, and its result depends only on the bytes read, never on where they lie (a slot or a pinned host
row, read in place). One launch computes every choice's silu(gate x) * (up x), rounded to x's dtype, a second the
down rows, weighted and summed over the k choices in choice order in float32, rounded once.
"""
from __future__ import annotations

import os

import torch

from ..quant import fp8
from ..quant.layout import ExpertLayout
from .decode_act import act_args
from .qblocks import triton

ROWS = 32                # rows a program (a tile of 32 x 128 values); fixed, so are the bits
WARPS = 4


def fp8_available(layout: ExpertLayout) -> bool:
    return triton is not None and layout.fp8


if triton is not None:
    import triton.language as tl

    from .decode_act import down_bias, glu_at
    from .qblocks import to_bf16

    @triton.jit
    def e4m3(b):
        """uint8 float8 e4m3fn bits (any shape) -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits;
        exponent 0 is subnormal (m 2^-9); 0x7F and 0xFF are NaN."""
        b = b.to(tl.uint32)
        sign = (b >> 7) << 31
        e = (b >> 3) & 15
        m = b & 7
        normal = sign | ((e + 120) << 23) | (m << 20)
        sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True) | sign
        bits = tl.where(e == 0, sub, normal)
        bits = tl.where((b & 127) == 127, sign | 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _dequant(rows_ptr, index_ptr, stride, out_ptr, out_stride, in_off, out_off, R: tl.constexpr,
                 C: tl.constexpr, NBC: tl.constexpr, SOFF: tl.constexpr, BR: tl.constexpr, BF16: tl.constexpr):
        """Program (expert i, rows block, column block of 128): values of the packed (R, C) matrix at byte in_off of
        slot index[i]'s row, written at value out_off + r C + c of output row i."""
        i = tl.program_id(0)
        r = tl.program_id(1) * BR + tl.arange(0, BR)[:, None]                    # (BR, 1)
        c = tl.program_id(2) * 128 + tl.arange(0, 128)[None, :]                  # (1, 128)
        m = (r < R) & (c < C)
        base = rows_ptr + tl.load(index_ptr + i) * stride + in_off
        s = tl.load((base + SOFF).to(tl.pointer_type(tl.float32)) + (r // 128) * NBC + tl.program_id(2),
                    mask=r < R, other=0.0)                                       # (BR, 1)
        v = e4m3(tl.load(base + r * C + c, mask=m, other=0)) * s
        v = to_bf16(v) if BF16 else v.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + i.to(tl.int64) * out_stride + out_off + r * C + c, v, mask=m)

    @triton.jit
    def _dots(p, rows, rmask, x_ptr, C: tl.constexpr, NBC: tl.constexpr, SOFF: tl.constexpr, R: tl.constexpr):
        """(R,) float32: rows `rows` of the packed (., C) matrix at p against x (C,), 128 columns a step."""
        sp = (p + SOFF).to(tl.pointer_type(tl.float32))
        acc = tl.zeros([R, 128], dtype=tl.float32)
        for kb in range(NBC):
            c = kb * 128 + tl.arange(0, 128)
            cm = c < C
            q = tl.load(p + rows[:, None] * C + c[None, :], mask=rmask[:, None] & cm[None, :], other=0)
            s = tl.load(sp + (rows // 128) * NBC + kb, mask=rmask, other=0.0)
            xv = tl.load(x_ptr + c, mask=cm, other=0.0).to(tl.float32)
            acc += (e4m3(q) * s[:, None]) * xv[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _gate_up(x_ptr, addr_ptr, h_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
                 OG: tl.constexpr, OU: tl.constexpr, NBH: tl.constexpr, SOFF: tl.constexpr, eid_ptr, b13_ptr,
                 OAI: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
        """Program (t k + j, block of R rows of I): choice j's gate and up rows against x[t], then silu(g) * u
        (OAI: gpt-oss's, kernels/decode_act.py, with the biases of expert eid[t, j])."""
        pair = tl.program_id(0)
        t = pair // K
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rmask = rows < I
        base = tl.load(addr_ptr + pair).to(tl.pointer_type(tl.uint8))
        g = _dots(base + OG, rows, rmask, x_ptr + t * H, H, NBH, SOFF, R)
        u = _dots(base + OU, rows, rmask, x_ptr + t * H, H, NBH, SOFF, R)
        h = glu_at(g, u, eid_ptr, pair, b13_ptr, rows, rmask, I, OAI, LIMIT, ALPHA)
        tl.store(h_ptr + pair * I + rows, h.to(h_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _down(h_ptr, addr_ptr, w_ptr, out_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
              OD: tl.constexpr, NBI: tl.constexpr, SOFF: tl.constexpr, eid_ptr, b2_ptr, OAI: tl.constexpr):
        """Program (t, block of R rows of H): every choice's down rows against its activation (OAI: plus the
        down biases of its expert eid[t, j]), weighted, summed over the k choices in choice order."""
        t = tl.program_id(0)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rmask = rows < H
        acc = tl.zeros([R], dtype=tl.float32)
        for c in range(K):
            base = tl.load(addr_ptr + t * K + c).to(tl.pointer_type(tl.uint8))
            wc = tl.load(w_ptr + t * K + c).to(tl.float32)
            d = _dots(base + OD, rows, rmask, h_ptr + (t * K + c) * I, I, NBI, SOFF, R)
            if OAI:
                d = down_bias(d, b2_ptr + tl.load(eid_ptr + t * K + c) * H + rows, rmask, OAI)
            acc += wc * d
        tl.store(out_ptr + t * H + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dequantize_rows_fp8(rows: torch.Tensor, index: torch.Tensor, layout: ExpertLayout,
                        out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (S, >= nbytes) uint8, index (n,) int64 -> w13 (n, 2I, H), w2 (n, H, I) of out_dtype: Triton on CUDA
    (and in the interpreter), the plain-torch dequantizer elsewhere; the same bits."""
    assert layout.fp8 and rows.dtype == torch.uint8 and rows.stride(1) == 1
    I, H = layout.inter, layout.hidden
    index = index.reshape(-1).to(device=rows.device, dtype=torch.int64).contiguous()
    n = index.numel()
    if not (triton is not None and n and (rows.is_cuda or _interpreting())):
        return layout.dequantize(rows[index], out_dtype)                # float32, then one rounding
    out = torch.empty(n, 3 * I * H, dtype=out_dtype, device=rows.device)                   # (n, 3 I H)
    voffs = (0, I * H, 2 * I * H)
    for off, voff, (R, C) in zip(layout.offsets, voffs, ((I, H), (I, H), (H, I))):
        nbc = fp8.scale_shape(R, C)[1]
        _dequant[(n, triton.cdiv(R, ROWS), nbc)](rows, index, rows.stride(0), out, out.stride(0), off, voff, R, C,
                                                 nbc, fp8.scale_offset(R, C), ROWS, out_dtype == torch.bfloat16,
                                                 num_warps=WARPS, enable_fp_fusion=False)
    return ExpertLayout(I, H).views(out)


def experts_by_address_fp8(x: torch.Tensor, addrs: torch.Tensor, weights: torch.Tensor,
                           layout: ExpertLayout, act=None) -> torch.Tensor:
    """x (T, H), addrs (T, k) int64, weights (T, k) -> (T, H): sum_j weights[t, j] * expert_j(x[t]). `act`:
    gpt-oss's activation and biases (kernels/reference.py's OaiSwiglu)."""
    assert fp8_available(layout), layout
    T, H = x.shape
    I, k = layout.inter, addrs.shape[1]
    og, ou, od = layout.offsets
    x, addrs, weights = x.contiguous(), addrs.contiguous(), weights.contiguous()
    eid, b13, b2, oai, limit, alpha = act_args(act, x)
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)                                  # (T k, I)
    out = torch.empty_like(x)                                                                   # (T, H)
    _gate_up[(T * k, triton.cdiv(I, ROWS))](x, addrs, h, H, I, k, ROWS, og, ou, fp8.scale_shape(I, H)[1],
                                            fp8.scale_offset(I, H), eid, b13, oai, limit, alpha, num_warps=WARPS,
                                            enable_fp_fusion=False)
    _down[(T, triton.cdiv(H, ROWS))](h, addrs, weights, out, H, I, k, ROWS, od, fp8.scale_shape(H, I)[1],
                                     fp8.scale_offset(H, I), eid, b2, oai, num_warps=WARPS, enable_fp_fusion=False)
    return out
