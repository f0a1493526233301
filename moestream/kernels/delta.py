"""Which Gated DeltaNet kernels a forward runs (models/deltanet.py's DeltaKernels), decided once at load.

    k = pick_delta_kernels(device, dtype)       # DeltaKernels: conv, chunk (prompts), in_place (decode steps), ..
    y, st = gated_deltanet(x, lw, cfg, st, kernels=k)                  # a prompt
    y = deltanet_step(x, lw, cfg, conv, ssm, rows, k.in_place)         # a decode step on the cache's states

On the CPU, and where fla-core is not installed: the plain-torch references (models/deltanet.py, the oracle). On
CUDA with fla-core (flash-linear-attention's Triton kernels, `pip install fla-core`): its chunk_gated_delta_rule
for prompts, behind an adapter with the reference's signature (tests/test_cuda_delta.py holds it to the
reference), and for decode steps this module's step (step_in_place_triton), which reads and writes each sequence's
conv window and state where the cache keeps them (no gather, no write-back), in float32, rounding where torch's
ops round:

    _step_in_place   grid (B, nv, dv / BLOCK_V): token, value head, 32 columns of dv. The conv, SiLU and L2 norm
                     of its key head's q and k (recomputed by each of the r x dv/32 programs that need them: 2 dk
                     channels), of its 32 v channels, beta's sigmoid, the decay gate, and the delta rule on its
                     (dk, 32) columns of the state -> those columns of o, before the norm.
    _norm_and_shift  grid (B, nv): the gated RMSNorm of each value head's whole row of o, in place, and the shift
                     of the q/k conv windows.

Two launches, because programs run in any order: every program of a key head reads that head's q/k conv window,
so no program of the first launch may shift it (the second does: q's by the key head's first value head, k's by its
last); a program's v channels and state columns are its own, read before it writes them. And the output norm needs
a value head's whole row of o, which no program of the first launch holds: summing the blocks' squares across
programs would take atomics, and their order would change the bits. Per element, the arithmetic is that of the
one-launch kernel this replaced (grid (B, nk): 16 programs at B = 1, each reading and writing r = 2 states of 64 KiB,
latency-bound at 13.9 us a layer on an H200's 132 SMs for 2 MiB of state). At Qwen3-Next's shapes (nv = 32, dv =
128) a step now runs 128 programs at B = 1 and 1024 at B = 8, each on a 16 KiB slice of a state, then 32 (256) small
ones: expected a few us a layer, the second launch included (to be measured). BLOCK_V = 32 rather than 16: 128
programs already fill the SMs at B = 1, a state row's 32 float32 columns are one 128-byte line, and a program's
fixed work (the conv and norms of q and k, some 1800 loads) stays well under its state slice's 4096 floats; at 16
the two would be even: twice the recomputation, for a program not much shorter.

MOESTREAM_DELTA=torch keeps the references on CUDA too (where fla-core is installed but does not run there). (The
step from before the in-place one, fla's fused_recurrent_gated_delta_rule with the norms, gates and conv as torch
ops around it on gathered states, =fla-recurrent, was measured against the one-launch in-place step, a Qwen3-Next
decode step of 2.87 ms against 1.69, and removed at stop 47: bench/RESULTS.md.) No kernel here uses atomics, so a
forward's bits do not depend on the expert cache.
"""
from __future__ import annotations

import torch

from .. import knobs

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

DELTA_KERNELS = ("fla", "torch")     # MOESTREAM_DELTA's choices (pick_delta_kernels)


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:                    # not installed, or no Triton (the CPU build of torch)
        return False
    return True


def _fla_chunk(q, k, v, g, beta, state=None, chunk_size: int = 64, scale=None):
    """chunk_gated_delta_rule's signature (models/deltanet.py) over fla's chunked kernel: q, k (B, T, nk, dk)
    L2-normed, v (B, T, nv, dv), g and beta (B, T, nv), state (B, nv, dk, dv) float32 or None -> out in v's dtype,
    the final state float32. fla runs 64-token chunks (chunk_size is the reference's)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    dt = v.dtype
    o, S = chunk_gated_delta_rule(q.to(dt).contiguous(), k.to(dt).contiguous(), v.contiguous(),
                                  g.float().contiguous(), beta.to(dt).contiguous(), scale=scale,
                                  initial_state=None if state is None else state.float().contiguous(),
                                  output_final_state=True)
    return o.to(dt), S.float()


def _fla_recurrent(q, k, v, g, beta, state=None, scale=None):
    """recurrent_gated_delta_rule's signature over fla's fused recurrent kernel (decode steps, T = 1 each)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    dt = v.dtype
    o, S = fused_recurrent_gated_delta_rule(q.to(dt).contiguous(), k.to(dt).contiguous(), v.contiguous(),
                                            g=g.float().contiguous(), beta=beta.to(dt).contiguous(), scale=scale,
                                            initial_state=None if state is None else state.float().contiguous(),
                                            output_final_state=True)
    return o.to(dt), S.float()


if triton is not None:
    @triton.jit
    def _shift(x, st_ptr, ch, m, KW: tl.constexpr, KP: tl.constexpr):
        """The conv state of channels ch (masked by m) shifted by their new inputs x, in place: (C, KW-1) rows
        [s0 s1 .. s_{KW-2}] -> [s1 .. s_{KW-2} x]. Only the program calling it may touch these channels."""
        t = tl.arange(0, KP)
        mt = m[:, None] & (t[None, :] < KW - 1)
        nxt = tl.load(st_ptr + ch[:, None] * (KW - 1) + t[None, :] + 1, mask=mt & (t[None, :] < KW - 2), other=0.0)
        tl.debug_barrier()              # every lane has read the state before any writes it
        new = tl.where(t[None, :] == KW - 2, x.to(st_ptr.dtype.element_ty)[:, None], nxt)
        tl.store(st_ptr + ch[:, None] * (KW - 1) + t[None, :], new, mask=mt)

    @triton.jit
    def _conv_silu(x, st_ptr, w_ptr, ch, m, KW: tl.constexpr, KP: tl.constexpr, WRITE: tl.constexpr):
        """The causal conv of channels ch (masked by m) over [their conv state, x], then SiLU, each rounded to the
        state's dtype as torch's conv1d and silu round; WRITE: the state shifted by x, in place, after every lane
        has read it. x: (BLOCK,) float32; st_ptr: the sequence's conv state (C, KW-1); w_ptr: the weight (C, KW)."""
        t = tl.arange(0, KP)
        mt = m[:, None] & (t[None, :] < KW - 1)
        s = tl.load(st_ptr + ch[:, None] * (KW - 1) + t[None, :], mask=mt, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ch[:, None] * KW + t[None, :], mask=mt, other=0.0).to(tl.float32)
        y = tl.sum(s * w, axis=1) + tl.load(w_ptr + ch * KW + KW - 1, mask=m, other=0.0).to(tl.float32) * x
        dt = st_ptr.dtype.element_ty
        y = y.to(dt).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dt).to(tl.float32)
        if WRITE:
            _shift(x, st_ptr, ch, m, KW, KP)
        return y

    @triton.jit
    def _program_head(rows_ptr, conv_ptr, NK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      KW: tl.constexpr):
        """Program (b, h, ..): token b, value head h, its key head, its place j among the key head's R value heads,
        the row of b's sequence in the cache, and that row's conv state (C, KW-1)."""
        bi = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(rows_ptr + bi).to(tl.int64)
        C: tl.constexpr = 2 * NK * DK + NK * R * DV
        return bi, h, h // R, h % R, row, conv_ptr + row * (C * (KW - 1))

    @triton.jit
    def _step_in_place(q_ptr, k_ptr, v_ptr, b_ptr, a_ptr, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sv_j,
                       sb_b, sb_h, sb_j, sa_b, sa_h, sa_j, conv_ptr, cw_ptr, ssm_ptr, rows_ptr, A_ptr, dtb_ptr,
                       o_ptr, scale, NK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       KW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KP: tl.constexpr):
        """Program (b, h, c): token b's value head h, columns [c BV, c BV + BV) of its state (row rows[b] of the
        cache) in place, and those columns of its output before the norm (o_ptr (B, nv dv), in v's dtype). Its key
        head's q and k come from their conv state, read and not written (every program of the key head reads it;
        _norm_and_shift shifts it, in the next launch); the conv state of its own v channels it reads and shifts."""
        bi, h, kh, j, row, st = _program_head(rows_ptr, conv_ptr, NK, R, DK, DV, KW)
        c = tl.program_id(2)
        dt = v_ptr.dtype.element_ty
        ik = tl.arange(0, BK)
        mk = ik < DK
        iv = c * BV + tl.arange(0, BV)                                          # this program's columns of dv
        mv = iv < DV
        q = tl.load(q_ptr + bi * sq_b + kh * sq_h + ik, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + bi * sk_b + kh * sk_h + ik, mask=mk, other=0.0).to(tl.float32)
        q = _conv_silu(q, st, cw_ptr, kh * DK + ik, mk, KW, KP, False)
        k = _conv_silu(k, st, cw_ptr, NK * DK + kh * DK + ik, mk, KW, KP, False)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale                 # l2norm, then dk^-1/2
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + bi * sv_b + kh * sv_h + j * sv_j + iv, mask=mv, other=0.0).to(tl.float32)
        v = _conv_silu(v, st, cw_ptr, 2 * NK * DK + h * DV + iv, mv, KW, KP, True)
        beta = tl.sigmoid(tl.load(b_ptr + bi * sb_b + kh * sb_h + j * sb_j).to(tl.float32)).to(dt)
        x = tl.load(a_ptr + bi * sa_b + kh * sa_h + j * sa_j).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        g = tl.load(A_ptr + h).to(tl.float32) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))   # softplus
        p = ssm_ptr + ((row * (NK * R) + h) * DK + ik[:, None]) * DV + iv[None, :]
        mS = mk[:, None] & mv[None, :]
        S = tl.load(p, mask=mS, other=0.0) * tl.exp(g)                                 # (BK, BV) float32
        delta = (v - tl.sum(S * k[:, None], axis=0)) * beta.to(tl.float32)
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)                                             # (BV,)
        tl.debug_barrier()              # every lane has read the state before any writes it
        tl.store(p, S, mask=mS)
        tl.store(o_ptr + (bi * (NK * R) + h) * DV + iv, o.to(dt), mask=mv)

    @triton.jit
    def _norm_and_shift(q_ptr, k_ptr, z_ptr, sq_b, sq_h, sk_b, sk_h, sz_b, sz_h, sz_j, conv_ptr, rows_ptr, nw_ptr,
                        o_ptr, eps, NK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        KW: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr):
        """Program (b, h): value head h's gated RMSNorm over its whole row of o_ptr (_step_in_place's output, in
        place); and the q/k conv states of its key head shifted, q's by its first value head (j = 0), k's by its
        last (j = R - 1), now that every program of the launch before has read them."""
        bi, h, kh, j, _, st = _program_head(rows_ptr, conv_ptr, NK, R, DK, DV, KW)
        ik = tl.arange(0, BK)
        mq = (ik < DK) & (ik * 0 + j == 0)          # (BK,): j as a block, the interpreter refuses block & scalar
        mk = (ik < DK) & (ik * 0 + j == R - 1)
        _shift(tl.load(q_ptr + bi * sq_b + kh * sq_h + ik, mask=mq, other=0.0), st, kh * DK + ik, mq, KW, KP)
        _shift(tl.load(k_ptr + bi * sk_b + kh * sk_h + ik, mask=mk, other=0.0), st, NK * DK + kh * DK + ik, mk,
               KW, KP)
        dt = o_ptr.dtype.element_ty
        iv = tl.arange(0, BD)
        mv = iv < DV
        po = o_ptr + (bi * (NK * R) + h) * DV + iv
        o = tl.load(po, mask=mv, other=0.0).to(tl.float32)                             # (BD,) the whole row
        normed = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dt).to(tl.float32)
        wn = (tl.load(nw_ptr + iv, mask=mv, other=0.0).to(tl.float32) * normed).to(dt).to(tl.float32)
        z = tl.load(z_ptr + bi * sz_b + kh * sz_h + j * sz_j + iv, mask=mv, other=0.0).to(tl.float32)
        tl.debug_barrier()              # every lane has read the row before any overwrites it
        tl.store(po, (wn * (z * tl.sigmoid(z))).to(dt), mask=mv)


BLOCK_V = 32        # columns of dv a program of _step_in_place updates: Qwen3-Next's 128 in 4 (the docstring: why)


def step_in_place_triton(q, k, v, z, b, a, conv, ssm, rows, lw: dict, eps: float) -> torch.Tensor:
    """models/deltanet.py step_in_place's signature, in two launches. _step_in_place, grid (token, value head,
    block of BLOCK_V columns of dv): the conv of its key head's q and k (recomputed by each of its programs, the
    conv state read only) and of its v columns, the gates, norms and recurrence of its columns of the state, in
    place, and their output before the norm. _norm_and_shift, grid (token, value head): the gated output norm over
    each whole row, and the q/k conv states shifted. Reads and writes each state once (16 KiB a program at
    Qwen3-Next's dk = 128)."""
    B, nk, dk = q.shape
    r, dv = v.shape[2], v.shape[3]
    for t in (q, k, v, z):
        assert t.stride(-1) == 1, "the projections' last dim must be contiguous"
    assert conv.is_contiguous() and ssm.is_contiguous() and ssm.dtype == torch.float32
    w = lw["ssm_conv1d.weight"]
    w = w.reshape(w.shape[0], -1).contiguous()
    KW = w.shape[1]
    BK, BD, KP = triton.next_power_of_2(dk), triton.next_power_of_2(dv), triton.next_power_of_2(max(KW - 1, 1))
    BV = min(BLOCK_V, BD)
    o = torch.empty(B, nk * r * dv, dtype=v.dtype, device=v.device)        # (B, nv dv): o, then normed in place
    _step_in_place[(B, nk * r, triton.cdiv(dv, BV))](
        q, k, v, b, a, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), v.stride(2),
        b.stride(0), b.stride(1), b.stride(2), a.stride(0), a.stride(1), a.stride(2), conv, w, ssm, rows,
        lw["ssm_a"], lw["ssm_dt.bias"], o, dk ** -0.5,
        NK=nk, R=r, DK=dk, DV=dv, KW=KW, BK=BK, BV=BV, KP=KP, num_warps=4)
    _norm_and_shift[(B, nk * r)](
        q, k, z, q.stride(0), q.stride(1), k.stride(0), k.stride(1), z.stride(0), z.stride(1), z.stride(2), conv,
        rows, lw["ssm_norm.weight"], o, eps, NK=nk, R=r, DK=dk, DV=dv, KW=KW, BK=BK, BD=BD, KP=KP, num_warps=1)
    return o


def pick_delta_kernels(device: torch.device, dtype: torch.dtype, want: str | None = None):
    """The DeltaNet kernels for this device and dtype: fla's on CUDA where it is installed, else the references.
    want: fla (the default) or torch; None: MOESTREAM_DELTA's, or fla."""
    from .delta_reference import TORCH, DeltaKernels, causal_conv1d
    want = want or knobs.choice("MOESTREAM_DELTA", DELTA_KERNELS, "fla")
    if torch.device(device).type != "cuda" or want == "torch" or not fla_available() or triton is None:
        return TORCH
    return DeltaKernels("fla", causal_conv1d, _fla_chunk, _fla_recurrent, in_place=step_in_place_triton)
