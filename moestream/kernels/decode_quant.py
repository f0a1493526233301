"""The decode expert kernel for quantized rows: kernels/decode.py's contract, the blocks dequantized as they are read.

    out = experts_by_address_quant(x, addrs, weights, layout)   # x (T, H); addrs, weights (T, k) -> (T, H)

`addrs[t, j]` is the address of token t's j-th routed expert's row in `layout` (gate | up | down, each in its
GGML type's blocks, kernels/qblocks.py): a GPU slot or the expert's pinned host row, read in place. A decode
token's experts are memory-bound GEMVs, so each byte is read once and its values made in registers: one launch
computes every choice's silu(gate x) * (up x) (rounded to x's dtype), a second the down projections, weighted
and summed over the k choices in choice order, in float32, rounded once.

The dequantized values are gguf.quants' bits (no fused multiply-add, enable_fp_fusion=False), so the kernel
differs from the float32 oracle only in its summation order; and its result depends only on the bytes read,
never on where they were. Block shapes follow from the types and the shape alone (no autotuning).

Measured on the H200 (bench/quant_kernels.py, 2026-12-01, two runs): slower per call than the bf16 kernel from
device memory (Q4_K 106 us against bf16's 70 us, T=1, k=8): the kernel is bound by instructions, not bytes (a byte
load and its 64-bit address per value; neither the tile size, the warps nor an alignment hint moved it). From
pinned host memory it is faster (1.2 ms against 1.9 ms), the link counting. Loading words and factoring the
scales out of the dot products (sum(q x) per sub-block) is the next step.

Not yet: read-through landing (`landing`, which kernels/decode.py has): a host-read choice is not written to a
free slot; the caller uploads misses itself.
"""
from __future__ import annotations

import torch

from ..quant.layout import ExpertLayout
from ..quant.types import row_bytes
from .qblocks import SHAPES, has_path, kvalues, triton

TILE = 4096              # values a program decodes per step (rows x blocks x block); fixed, so are the bits
WARPS = 4


def decode_quant_available(layout: ExpertLayout) -> bool:
    """Whether all three of the layout's matrices have a Triton path."""
    if triton is None or not layout.quantized:
        return False
    I, H = layout.inter, layout.hidden
    return all(has_path(t, n) for t, n in zip(layout.types, (H, H, I)))


if triton is not None:
    import triton.language as tl

    from .qblocks import block_values

    @triton.jit
    def _dots(p, rmask, vec_ptr, kv_ptr, QT: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
              TS: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr, BB: tl.constexpr):
        """(R,) float32: rows p (R,) (uint8 pointers to rows of NB blocks, RB bytes apart) against vec (NB BS)."""
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

    @triton.jit
    def _gate_up(x_ptr, addr_ptr, h_ptr, kv_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
                 R: tl.constexpr, OG: tl.constexpr, OU: tl.constexpr,
                 QG: tl.constexpr, RBG: tl.constexpr, NBG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr,
                 NSG: tl.constexpr, SBG: tl.constexpr, BBG: tl.constexpr,
                 QU: tl.constexpr, RBU: tl.constexpr, NBU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr,
                 NSU: tl.constexpr, SBU: tl.constexpr, BBU: tl.constexpr):
        """Program (t k + j, block of R rows of I): choice j's gate and up rows against x[t], then silu(g) * u."""
        pair = tl.program_id(0)
        t = pair // K
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rmask = rows < I
        base = tl.load(addr_ptr + pair).to(tl.pointer_type(tl.uint8))
        g = _dots(base + OG + rows * RBG, rmask, x_ptr + t * H, kv_ptr, QG, RBG, NBG, BSG, TSG, NSG, SBG, BBG)
        u = _dots(base + OU + rows * RBU, rmask, x_ptr + t * H, kv_ptr, QU, RBU, NBU, BSU, TSU, NSU, SBU, BBU)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + pair * I + rows, h.to(h_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _down(h_ptr, addr_ptr, w_ptr, out_ptr, kv_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
              R: tl.constexpr, OD: tl.constexpr,
              QD: tl.constexpr, RBD: tl.constexpr, NBD: tl.constexpr, BSD: tl.constexpr, TSD: tl.constexpr,
              NSD: tl.constexpr, SBD: tl.constexpr, BBD: tl.constexpr):
        """Program (t, block of R rows of H): every choice's down rows against its activation, weighted, summed
        over the k choices in choice order."""
        t = tl.program_id(0)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rmask = rows < H
        acc = tl.zeros([R], dtype=tl.float32)
        for c in range(K):
            base = tl.load(addr_ptr + t * K + c).to(tl.pointer_type(tl.uint8))
            wc = tl.load(w_ptr + t * K + c).to(tl.float32)
            d = _dots(base + OD + rows * RBD, rmask, h_ptr + (t * K + c) * I, kv_ptr,
                      QD, RBD, NBD, BSD, TSD, NSD, SBD, BBD)
            acc += wc * d
        tl.store(out_ptr + t * H + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)


def _matrix(qtype, n_rows: int, n_cols: int) -> tuple[int, tuple]:
    """(rows per program, the constexprs of one matrix: type, row bytes, blocks a row, block shape, blocks a step)."""
    bs, ts, nsub, sub = SHAPES[qtype]
    nb = n_cols // bs
    bb = min(triton.next_power_of_2(nb), max(1, TILE // 2 // bs))
    r = min(triton.next_power_of_2(n_rows), max(1, TILE // (bb * bs)))
    return r, (int(qtype), row_bytes(qtype, n_cols), nb, bs, ts, nsub, sub, bb)


def experts_by_address_quant(x: torch.Tensor, addrs: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout,
                             landing=None) -> torch.Tensor:
    """x (T, H), addrs (T, k) int64, weights (T, k) -> (T, H): sum_j weights[t, j] * expert_j(x[t])."""
    if landing is not None:
        raise NotImplementedError("experts_by_address_quant: read-through landing is not implemented yet")
    assert decode_quant_available(layout), layout
    T, H = x.shape
    I, k = layout.inter, addrs.shape[1]
    og, ou, od = layout.offsets
    x, addrs, weights = x.contiguous(), addrs.contiguous(), weights.contiguous()
    kv = kvalues(x.device)
    rg, g = _matrix(layout.types[0], I, H)
    ru, u = _matrix(layout.types[1], I, H)
    r = min(rg, ru)
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)                                  # (T k, I)
    _gate_up[(T * k, triton.cdiv(I, r))](x, addrs, h, kv, H, I, k, r, og, ou, *g, *u, num_warps=WARPS,
                                         enable_fp_fusion=False)
    rd, d = _matrix(layout.types[2], H, I)
    out = torch.empty_like(x)                                                                   # (T, H)
    _down[(T, triton.cdiv(H, rd))](h, addrs, weights, out, kv, H, I, k, rd, od, *d, num_warps=WARPS,
                                   enable_fp_fusion=False)
    return out
