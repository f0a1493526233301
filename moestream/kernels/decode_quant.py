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

Two variants (`variant=`, default "runs"). "runs" (kernels/decode_runs.py, kernels/qruns.py) gives each lane whole
16-byte runs of one block's quants, loaded as words (128-bit loads where the row is 16-aligned), unpacks them with
shifts and masks and applies each sub-block's scales once, in the lane, for Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, IQ4_NL, IQ4_XS and MXFP4 (qruns.RUN_TYPES; gate and up of one type); a layout with any other type runs
"values", the fallback. Its bits differ from "values" by float rounding, still fixed by the bytes alone. "values",
the first kernel, dequantizes every value to gguf.quants' bits (enable_fp_fusion=False) and differs from the float32
oracle only in summation order. Measured on the H200 (bench/quant_kernels.py, 2026-12-01; T=1, k=8, I=768, H=2048),
Q4_K_M rows on the GPU: "values" 122 us, bf16 69 us; from pinned host memory 1068 / 1715 us. "values" is bound by
instructions, not bytes (byte loads, one value a thread, the sub-block sums as cross-thread shuffles); "runs" is the
answer to that: 33 us from device memory and 719 us from pinned host (bench/RESULTS.md, issue 14, stop 15). (A third,
"subblocks", the scales out of the dot products, 135 / 842 us, was removed at stop 47.)

The kernel itself lands nothing (`landing`, which kernels/decode.py takes, is refused): read-through for quantized
rows comes with staged host reads (kernels/stage.py, the default for them), which copy a step's host reads into
landing slots and scratch rows before this kernel runs, so that it reads every row from device memory.
"""
from __future__ import annotations

import torch

from ..quant.layout import ExpertLayout
from ..quant.types import row_bytes
from .decode_act import act_args
from .qblocks import SHAPES, has_path, kvalues, triton

TILE = 4096              # values a program decodes per step (rows x blocks x block); fixed, so are the bits
WARPS = 4
# The default kernel. Measured on the H200 (bench/RESULTS.md, 2026-12-01), the reference's Q4_K_M at ubatch 2048,
# tg64 tok/s: "runs" 489 all on the GPU, 329 at --cpu-moe --moe-cache-mib 4000, 57 with no cache, against "values"'
# 381 / 259 / 40, with the same greedy tokens. One kernel for every placement keeps one file's greedy tokens the same
# whatever the placement; a layout of a type "runs" does not cover takes "values" on every placement alike.
VARIANTS = ("values", "runs")     # bench/quant_kernels.py and the tests ask for each


def decode_quant_available(layout: ExpertLayout) -> bool:
    """Whether all three of the layout's matrices have a Triton path."""
    if triton is None or not layout.quantized:
        return False
    if layout.fp8:
        return True                 # kernels/fp8.py
    I, H = layout.inter, layout.hidden
    return all(has_path(t, n) for t, n in zip(layout.types, (H, H, I)))


if triton is not None:
    import triton.language as tl

    from .decode_act import down_bias, glu_at
    from .qdots import value_dots

    @triton.jit
    def _gate_up(x_ptr, addr_ptr, h_ptr, kv_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
                 R: tl.constexpr, OG: tl.constexpr, OU: tl.constexpr,
                 QG: tl.constexpr, RBG: tl.constexpr, NBG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr,
                 NSG: tl.constexpr, SBG: tl.constexpr, BBG: tl.constexpr,
                 QU: tl.constexpr, RBU: tl.constexpr, NBU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr,
                 NSU: tl.constexpr, SBU: tl.constexpr, BBU: tl.constexpr,
                 eid_ptr, b13_ptr, OAI: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
        """Program (t k + j, block of R rows of I): choice j's gate and up rows against x[t], then silu(g) * u
        (OAI: gpt-oss's, kernels/decode_act.py, with the biases of expert eid[t, j])."""
        pair = tl.program_id(0)
        t = pair // K
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rmask = rows < I
        base = tl.load(addr_ptr + pair).to(tl.pointer_type(tl.uint8))
        g = value_dots(base + OG + rows * RBG, rmask, x_ptr + t * H, kv_ptr, QG, NBG, BSG, TSG, NSG, SBG, BBG)
        u = value_dots(base + OU + rows * RBU, rmask, x_ptr + t * H, kv_ptr, QU, NBU, BSU, TSU, NSU, SBU, BBU)
        h = glu_at(g, u, eid_ptr, pair, b13_ptr, rows, rmask, I, OAI, LIMIT, ALPHA)
        tl.store(h_ptr + pair * I + rows, h.to(h_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _down(h_ptr, addr_ptr, w_ptr, out_ptr, kv_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
              R: tl.constexpr, OD: tl.constexpr,
              QD: tl.constexpr, RBD: tl.constexpr, NBD: tl.constexpr, BSD: tl.constexpr, TSD: tl.constexpr,
              NSD: tl.constexpr, SBD: tl.constexpr, BBD: tl.constexpr, eid_ptr, b2_ptr, OAI: tl.constexpr):
        """Program (t, block of R rows of H): every choice's down rows against its activation (OAI: plus the
        down biases of its expert eid[t, j]), weighted, summed over the k choices in choice order."""
        t = tl.program_id(0)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rmask = rows < H
        acc = tl.zeros([R], dtype=tl.float32)
        for c in range(K):
            base = tl.load(addr_ptr + t * K + c).to(tl.pointer_type(tl.uint8))
            wc = tl.load(w_ptr + t * K + c).to(tl.float32)
            d = value_dots(base + OD + rows * RBD, rmask, h_ptr + (t * K + c) * I, kv_ptr,
                           QD, NBD, BSD, TSD, NSD, SBD, BBD)
            if OAI:
                d = down_bias(d, b2_ptr + tl.load(eid_ptr + t * K + c) * H + rows, rmask, OAI)
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
                             landing=None, variant: str = "runs", act=None) -> torch.Tensor:
    """x (T, H), addrs (T, k) int64, weights (T, k) -> (T, H): sum_j weights[t, j] * expert_j(x[t]). `act`:
    gpt-oss's activation and biases (kernels/reference.py's OaiSwiglu, its ids the choices' experts).

    variant: "runs" (kernels/decode_runs.py: a 16-byte run of quants a lane, for the layouts it covers, "values"
    for the others) or "values" (the first kernel: every value dequantized, gguf.quants' bits, then multiplied)."""
    if landing is not None:
        raise NotImplementedError("experts_by_address_quant lands nothing: stage the host reads (kernels/stage.py)")
    assert decode_quant_available(layout), layout
    if layout.fp8:                  # FP8 block-scaled rows: one kernel, whatever the variant
        from .fp8 import experts_by_address_fp8
        return experts_by_address_fp8(x, addrs, weights, layout, act)
    assert variant in VARIANTS, variant
    if variant == "runs":
        from .decode_runs import experts_by_address_runs, runs_layout
        if runs_layout(layout):
            return experts_by_address_runs(x, addrs, weights, layout, act)
    T, H = x.shape
    I, k = layout.inter, addrs.shape[1]
    og, ou, od = layout.offsets
    x, addrs, weights = x.contiguous(), addrs.contiguous(), weights.contiguous()
    kv = kvalues(x.device)
    rg, g = _matrix(layout.types[0], I, H)
    ru, u = _matrix(layout.types[1], I, H)
    rd, d = _matrix(layout.types[2], H, I)
    eid, b13, b2, oai, limit, alpha = act_args(act, x)
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)                                  # (T k, I)
    out = torch.empty_like(x)                                                                   # (T, H)
    r = min(rg, ru)
    _gate_up[(T * k, triton.cdiv(I, r))](x, addrs, h, kv, H, I, k, r, og, ou, *g, *u, eid, b13, oai, limit, alpha,
                                         num_warps=WARPS, enable_fp_fusion=False)
    _down[(T, triton.cdiv(H, rd))](h, addrs, weights, out, kv, H, I, k, rd, od, *d, eid, b2, oai, num_warps=WARPS,
                                   enable_fp_fusion=False)
    return out
