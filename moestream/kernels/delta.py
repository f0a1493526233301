"""Which Gated DeltaNet kernels a forward runs (models/deltanet.py's DeltaKernels), decided once at load.

    k = pick_delta_kernels(device, dtype)       # DeltaKernels: conv, chunk (prompts), in_place (decode steps), ..
    y, st = gated_deltanet(x, lw, cfg, st, kernels=k)                  # a prompt
    y = deltanet_step(x, lw, cfg, conv, ssm, rows, k.in_place)         # a decode step on the cache's states

On the CPU, and where fla-core is not installed: the plain-torch references (models/deltanet.py, the oracle). On
CUDA with fla-core (flash-linear-attention's Triton kernels, `pip install fla-core`): its chunk_gated_delta_rule
for prompts, behind an adapter with the reference's signature (tests/test_cuda_delta.py holds it to the
reference), and for decode steps this module's one-launch step (step_in_place_triton): a program per token and key
head runs the conv of its channels, SiLU, the q/k L2 norms, beta's sigmoid, the decay gate, the recurrence of its
value heads and the gated output norm, reading and writing its sequence's conv window and state where the cache
keeps them (no gather, no write-back). It computes in float32 and rounds where torch's ops round.

MOESTREAM_DELTA=fla-recurrent keeps the step before it: fla's fused_recurrent_gated_delta_rule with the norms,
gates and conv as torch ops around it, on gathered states (bench/RESULTS.md measured the two: a Qwen3-Next decode
step of 2.87 ms against 1.69). torch keeps the references on CUDA too. No kernel here uses atomics, so a forward's
bits do not depend on the expert cache.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


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
    def _conv_silu(x, st_ptr, w_ptr, ch, m, KW: tl.constexpr, KP: tl.constexpr):
        """The causal conv of channels ch (masked by m) over [their conv state, x], then SiLU, each rounded to the
        state's dtype as torch's conv1d and silu round; the state shifted by x, in place. x: (BLOCK,) float32;
        st_ptr: the sequence's conv state (C, KW-1); w_ptr: the conv weight (C, KW)."""
        t = tl.arange(0, KP)
        mt = m[:, None] & (t[None, :] < KW - 1)
        s = tl.load(st_ptr + ch[:, None] * (KW - 1) + t[None, :], mask=mt, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ch[:, None] * KW + t[None, :], mask=mt, other=0.0).to(tl.float32)
        nxt = tl.load(st_ptr + ch[:, None] * (KW - 1) + t[None, :] + 1, mask=mt & (t[None, :] < KW - 2), other=0.0)
        y = tl.sum(s * w, axis=1) + tl.load(w_ptr + ch * KW + KW - 1, mask=m, other=0.0).to(tl.float32) * x
        dt = st_ptr.dtype.element_ty
        y = y.to(dt).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dt).to(tl.float32)
        tl.debug_barrier()              # every lane has read the state before any writes it
        new = tl.where(t[None, :] == KW - 2, x.to(dt)[:, None], nxt)
        tl.store(st_ptr + ch[:, None] * (KW - 1) + t[None, :], new, mask=mt)
        return y

    @triton.jit
    def _step_in_place(q_ptr, k_ptr, v_ptr, z_ptr, b_ptr, a_ptr, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sv_j,
                       sz_b, sz_h, sz_j, sb_b, sb_h, sb_j, sa_b, sa_h, sa_j,
                       conv_ptr, cw_ptr, ssm_ptr, rows_ptr, A_ptr, dtb_ptr, nw_ptr, o_ptr, eps, scale,
                       NK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, KP: tl.constexpr):
        """Program (b, h): token b's key head h and its R value heads, the state of sequence rows[b] in place."""
        bi = tl.program_id(0)
        kh = tl.program_id(1)
        row = tl.load(rows_ptr + bi).to(tl.int64)
        C: tl.constexpr = 2 * NK * DK + NK * R * DV
        st = conv_ptr + row * (C * (KW - 1))
        dt = v_ptr.dtype.element_ty
        ik = tl.arange(0, BK)
        mk = ik < DK
        iv = tl.arange(0, BV)
        mv = iv < DV
        q = tl.load(q_ptr + bi * sq_b + kh * sq_h + ik, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + bi * sk_b + kh * sk_h + ik, mask=mk, other=0.0).to(tl.float32)
        q = _conv_silu(q, st, cw_ptr, kh * DK + ik, mk, KW, KP)
        k = _conv_silu(k, st, cw_ptr, NK * DK + kh * DK + ik, mk, KW, KP)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale                 # l2norm, then dk^-1/2
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        for j in tl.static_range(R):
            h = kh * R + j
            v = tl.load(v_ptr + bi * sv_b + kh * sv_h + j * sv_j + iv, mask=mv, other=0.0).to(tl.float32)
            v = _conv_silu(v, st, cw_ptr, 2 * NK * DK + h * DV + iv, mv, KW, KP)
            beta = tl.sigmoid(tl.load(b_ptr + bi * sb_b + kh * sb_h + j * sb_j).to(tl.float32)).to(dt)
            x = tl.load(a_ptr + bi * sa_b + kh * sa_h + j * sa_j).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
            g = tl.load(A_ptr + h).to(tl.float32) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))   # softplus
            p = ssm_ptr + ((row * (NK * R) + h) * DK + ik[:, None]) * DV + iv[None, :]
            mS = mk[:, None] & mv[None, :]
            S = tl.load(p, mask=mS, other=0.0) * tl.exp(g)                             # (BK, BV) float32
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta.to(tl.float32)
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0).to(dt).to(tl.float32)                   # (BV,)
            tl.debug_barrier()          # every lane has read the state before any writes it
            tl.store(p, S, mask=mS)
            normed = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dt).to(tl.float32)
            wn = (tl.load(nw_ptr + iv, mask=mv, other=0.0).to(tl.float32) * normed).to(dt).to(tl.float32)
            z = tl.load(z_ptr + bi * sz_b + kh * sz_h + j * sz_j + iv, mask=mv, other=0.0).to(tl.float32)
            tl.store(o_ptr + (bi * (NK * R) + h) * DV + iv, (wn * (z * tl.sigmoid(z))).to(dt), mask=mv)


def step_in_place_triton(q, k, v, z, b, a, conv, ssm, rows, lw: dict, eps: float) -> torch.Tensor:
    """models/deltanet.py step_in_place's signature, in one launch: program (token, key head) runs the conv of
    its q, k and value heads' channels, the gates, norms, recurrence and output norm, and writes the conv window and
    state of its sequence's row in place. Reads each state once (64 KiB a value head at Qwen3-Next's 128 x 128)."""
    B, nk, dk = q.shape
    r, dv = v.shape[2], v.shape[3]
    for t in (q, k, v, z):
        assert t.stride(-1) == 1, "the projections' last dim must be contiguous"
    assert conv.is_contiguous() and ssm.is_contiguous() and ssm.dtype == torch.float32
    w = lw["ssm_conv1d.weight"]
    w = w.reshape(w.shape[0], -1).contiguous()
    KW = w.shape[1]
    o = torch.empty(B, nk * r * dv, dtype=v.dtype, device=v.device)
    _step_in_place[(B, nk)](q, k, v, z, b, a, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                            v.stride(1), v.stride(2), z.stride(0), z.stride(1), z.stride(2), b.stride(0),
                            b.stride(1), b.stride(2), a.stride(0), a.stride(1), a.stride(2), conv, w, ssm, rows,
                            lw["ssm_a"], lw["ssm_dt.bias"], lw["ssm_norm.weight"], o, eps, dk ** -0.5,
                            NK=nk, R=r, DK=dk, DV=dv, KW=KW, BK=triton.next_power_of_2(dk),
                            BV=triton.next_power_of_2(dv), KP=triton.next_power_of_2(max(KW - 1, 1)),
                            num_warps=8)
    return o


def pick_delta_kernels(device: torch.device, dtype: torch.dtype, want: str | None = None):
    """The DeltaNet kernels for this device and dtype: fla's on CUDA where it is installed, else the references.
    want: fla (the default), fla-recurrent or torch; None: MOESTREAM_DELTA's, or fla."""
    from ..models.deltanet import TORCH, DeltaKernels, causal_conv1d
    want = want or os.environ.get("MOESTREAM_DELTA", "fla")
    if torch.device(device).type != "cuda" or want == "torch" or not fla_available() or triton is None:
        return TORCH
    if want == "fla-recurrent":
        return DeltaKernels("fla-recurrent", causal_conv1d, _fla_chunk, _fla_recurrent)
    return DeltaKernels("fla", causal_conv1d, _fla_chunk, _fla_recurrent, in_place=step_in_place_triton)
