"""The shared expert of a decode step in two launches (Triton, CUDA): Qwen2-MoE's and Qwen3-Next's sigmoid-gated
dense MLP that every token runs besides its routed experts, or DeepSeek-V3's and GLM-4.5's ungated one.

    y = shared_expert(x, gate, up, down, gate_inp, out)   # x, out (T, H); gate, up (I, H); down (H, I); gate_inp (1, H)
    # y = out + sigmoid(x gate_inp^T) * down(silu(gate x) * up x), (T, H) in out's dtype

models/moe.py's `_shared` is the torch form and the oracle; decode steps on CUDA (the batch's `fused`) take this.
Torch's form is nine launches: three cuBLAS GEMVs on a handful of CTAs each (a 512 x 2048 bf16 GEMV at about
370 GB/s on the H200), the gate's GEMV and five elementwise ops. Here:

- launch (a), grid (cdiv(I, BLOCK_I) + 1,): program p < cdiv(I, BLOCK_I) reads rows [p BLOCK_I, + BLOCK_I) of gate
  and up once, a tile of (BLOCK_I, BLOCK_H) at a time, and applies each tile to every token in turn (the tokens'
  sums are kept apart, one row each of a (TP, BLOCK_I) accumulator), then h = silu(g) * u, float32, into h (T, I).
  The last program computes each token's gate sigmoid(x . gate_inp) into s (T,), float32, beside the others.
- launch (b), grid (cdiv(H, BLOCK_O),): program p reads rows [p BLOCK_O, + BLOCK_O) of down once, applies them to
  every token's h, and writes out + s * (down h), summed in float32 and rounded once to out's dtype.

At Qwen3-Next's shapes (H = 2048, I = 512, bf16) with the blocks below: (a) has 128 + 1 programs, (b) 128. Bytes
read per call: the weights once, 3 I H + H elements (6 MiB + 4 KiB in bf16), whatever T is; then x and out (T H
each), h written and read back (T I float32: 16 KiB at T = 8), s, and the result written (T H): about 6.1 MiB at
T = 8. Two launches (plus the three torch.empty of h, s and the result, which launch nothing).
bench/shared_expert.py times it against the torch form, and other block shapes (--configs).

The numerics contract: no atomics, fixed block shapes (no autotuning), every sum in an order set by the shapes, so
a call's bits depend only on its inputs' values and shapes (not on where the tensors lie). They are not torch's
bits: torch rounds g, u, silu(g) * u, the gate and the product to the activations' dtype; this rounds once.
"""
from __future__ import annotations

import torch

from .decode_tiles import fit

try:
    import triton
    import triton.language as tl
except ImportError:          # the CPU build of torch has no Triton: models/moe.py's torch form is the path there
    triton = None


if triton is not None:
    @triton.jit
    def _gate_up(x_ptr, gate_ptr, up_ptr, gi_ptr, h_ptr, s_ptr, T, H: tl.constexpr, I: tl.constexpr,
                 TP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, GATED: tl.constexpr):
        """Program p: rows of gate and up, read once, against each token's x, then silu(g) * u into h (T, I);
        where GATED, the last program: each token's sigmoid(x . gate_inp) into s (T,)."""
        p = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        ts = tl.arange(0, TP)
        if GATED and p == tl.num_programs(0) - 1:       # the gate: one row of H, for each token
            acc = tl.zeros([TP], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                cmask = h0 + cols < H
                w = tl.load(gi_ptr + h0 + cols, mask=cmask, other=0.0).to(tl.float32)           # (BLOCK_H,)
                for t in range(0, T):
                    xv = tl.load(x_ptr + t * H + h0 + cols, mask=cmask, other=0.0).to(tl.float32)
                    acc = tl.where(ts == t, acc + tl.sum(w * xv, axis=0), acc)
            tl.store(s_ptr + ts, tl.sigmoid(acc), mask=ts < T)
        else:
            rows = p * BLOCK_I + tl.arange(0, BLOCK_I)
            rmask = rows < I
            g = tl.zeros([TP, BLOCK_I], dtype=tl.float32)               # token t's sums in row t
            u = tl.zeros([TP, BLOCK_I], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                cmask = h0 + cols < H
                m = rmask[:, None] & cmask[None, :]
                off = rows[:, None] * H + h0 + cols[None, :]
                wg = tl.load(gate_ptr + off, mask=m, other=0.0).to(tl.float32)     # (BLOCK_I, BLOCK_H), read once
                wu = tl.load(up_ptr + off, mask=m, other=0.0).to(tl.float32)
                for t in range(0, T):
                    xv = tl.load(x_ptr + t * H + h0 + cols, mask=cmask, other=0.0).to(tl.float32)  # (BLOCK_H,)
                    sel = (ts == t)[:, None]
                    g = tl.where(sel, g + tl.sum(wg * xv[None, :], axis=1)[None, :], g)
                    u = tl.where(sel, u + tl.sum(wu * xv[None, :], axis=1)[None, :], u)
            h = g * tl.sigmoid(g) * u                                       # (TP, BLOCK_I) silu(g) * u
            tl.store(h_ptr + ts[:, None] * I + rows[None, :], h, mask=(ts < T)[:, None] & rmask[None, :])

    @triton.jit
    def _down(h_ptr, down_ptr, s_ptr, out_ptr, y_ptr, T, H: tl.constexpr, I: tl.constexpr, TP: tl.constexpr,
              BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, GATED: tl.constexpr):
        """Program p: rows of down, read once, against each token's h; y = out + s * (down h) (GATED) or
        out + down h, rounded once."""
        p = tl.program_id(0)
        rows = p * BLOCK_O + tl.arange(0, BLOCK_O)
        rmask = rows < H
        cols = tl.arange(0, BLOCK_I)
        ts = tl.arange(0, TP)
        acc = tl.zeros([TP, BLOCK_O], dtype=tl.float32)                    # token t's sums in row t
        for i0 in range(0, I, BLOCK_I):
            cmask = i0 + cols < I
            wd = tl.load(down_ptr + rows[:, None] * I + i0 + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                         other=0.0).to(tl.float32)                          # (BLOCK_O, BLOCK_I), read once
            for t in range(0, T):
                hv = tl.load(h_ptr + t * I + i0 + cols, mask=cmask, other=0.0)                  # (BLOCK_I,) f32
                acc = tl.where((ts == t)[:, None], acc + tl.sum(wd * hv[None, :], axis=1)[None, :], acc)
        tmask = ts < T
        m = tmask[:, None] & rmask[None, :]
        o = tl.load(out_ptr + ts[:, None] * H + rows[None, :], mask=m, other=0.0).to(tl.float32)  # (TP, BLOCK_O)
        if GATED:
            s = tl.load(s_ptr + ts, mask=tmask, other=0.0)                                      # (TP,)
            acc = s[:, None] * acc
        tl.store(y_ptr + ts[:, None] * H + rows[None, :], (o + acc).to(y_ptr.dtype.element_ty), mask=m)


# Block shapes, fixed (not measured yet: the lead's H200 run picks them): (BLOCK_I, BLOCK_H, warps) of launch (a),
# (BLOCK_O, BLOCK_I, warps) of launch (b). A whole row of H = 2048 (a) or I = 512 (b) is one tile, so each
# program issues all its loads at once; 4 and 16 rows give 128 programs each at H = 2048, I = 512.
GATE_UP = (4, 2048, 8)
DOWN = (16, 512, 4)


def shared_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  gate_inp: torch.Tensor | None, out: torch.Tensor, config: tuple = (GATE_UP, DOWN)) -> torch.Tensor:
    """x, out (T, H); gate, up (I, H); down (H, I); gate_inp (1, H) -> (T, H) in out's dtype:
    out + sigmoid(x gate_inp^T) * down(silu(gate x) * up x); gate_inp None (DeepSeek-V3's and GLM-4.5's shared
    experts, always on): out + down(silu(gate x) * up x). A decode step's T (1 .. 16): the tokens share
    each program, whose accumulators are (next_power_of_2(T), rows). `config`: the block shapes (the tests take
    small ones, so the loops over H and I run more than once)."""
    T, H = x.shape
    inter = gate.shape[0]
    (bi, bh, wa), (bo, bi2, wb) = config
    x, out = x.contiguous(), out.contiguous()
    tp = triton.next_power_of_2(T)
    h = torch.empty(T, inter, dtype=torch.float32, device=x.device)           # (T, I) silu(g) * u
    s = torch.empty(T, dtype=torch.float32, device=x.device)                  # (T,) the gate
    bi, bh = fit(inter, bi), fit(H, bh)
    gated = gate_inp is not None
    _gate_up[(triton.cdiv(inter, bi) + gated,)](x, gate.contiguous(), up.contiguous(),
                                                gate_inp.contiguous() if gated else x, h, s, T, H, inter, tp, bi, bh,
                                                gated, num_warps=wa)
    y = torch.empty_like(out)                                                 # (T, H)
    bo, bi2 = fit(H, bo), fit(inter, bi2)
    _down[(triton.cdiv(H, bo),)](h, down.contiguous(), s, out, y, T, H, inter, tp, bo, bi2, gated, num_warps=wb)
    return y
