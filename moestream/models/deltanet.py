"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5-MoE, in plain torch: the CPU path and the
oracle of the fast kernels (fla-core on CUDA, later). Batched over sequences: B rows of equal length T.

    y, st = gated_deltanet(x, lw, cfg)                 # a prompt from an empty state: x (B, T, H)
    y, st = gated_deltanet(x1, lw, cfg, st)            # one more token each: x1 (B, 1, H), the recurrent form
    y, st = gated_deltanet(x, lw, cfg, st, kernels=k)  # k: a DeltaKernels (kernels/delta.py picks; the plain
                                                       # torch TORCH of kernels/delta_reference.py by default)

A layer keeps two tensors per sequence (DeltaState): the last kernel-1 inputs of its causal conv and one (dk, dv)
state per value head. Per token t and value head, with q, k L2-normed and q scaled by dk^-1/2:

    S = exp(g_t) S;   S += k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t       (S: (dk, dv))
    beta_t = sigmoid(b_t),  g_t = ssm_a * softplus(a_t + ssm_dt.bias)   (ssm_a = -exp(A_log) < 0: a decay)

Prompts run the chunked form (chunk_gated_delta_rule of kernels/delta_reference.py: the same recurrence, 64 tokens
at a time as matmuls), decode steps the recurrent one; they agree to float32 rounding. The output is RMS-normed
per head, gated by silu(z) and projected back. DeltaNet, at the end, is the layer as a decoder's mixer block.

Weights (`lw`: one layer's canonical names, arch/hybrid_names.py; V = nv*dv, K = nk*dk, C = 2K + V):
    ssm_in.weight (2K + 2V, H)   qwen3_next: q, k, v, z fused, grouped by key head ([q_h k_h v_h.. z_h..] per h)
    ssm_ba.weight (2nv, H)       qwen3_next: b, a fused, grouped by key head ([b_h.. a_h..] per h)
    attn_qkv.weight (C, H), attn_gate.weight (V, H), ssm_beta.weight / ssm_alpha.weight (nv, H)   qwen3_5_moe
    ssm_proj.weight (2K + 2V + 2nv, H)   the split layout's four as one (fuse_projections, at load): q|k|v, z, b, a
    ssm_conv1d.weight (C, K) or HF's (C, 1, K)    ssm_a (nv,) float32    ssm_dt.bias (nv,)
    ssm_norm.weight (dv,) (a plain RMSNorm weight, not zero-centred)     ssm_out.weight (H, V)
Value head j reads key head j // (nv/nk), as transformers' repeat_interleave does.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.delta_reference import TORCH, DeltaKernels


@dataclass
class DeltaState:
    """One DeltaNet layer's state of B sequences: conv (B, C, kernel-1) inputs, ssm (B, nv, dk, dv) float32."""
    conv: torch.Tensor
    ssm: torch.Tensor

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, dtype, device) -> "DeltaState":
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv = torch.zeros(batch, 2 * nk * dk + nv * dv, cfg.linear_conv_kernel - 1, dtype=dtype, device=device)
        return DeltaState(conv, torch.zeros(batch, nv, dk, dv, dtype=torch.float32, device=device))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, as fla and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}      # the output gate's activation (ModelConfig.deltanet_gate)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, gate: str = "silu") -> torch.Tensor:
    """RMSNorm of x over its last dim, times w, gated by silu(z) (Qwen3-Next, Qwen3.5-MoE) or sigmoid(z)
    (Qwen3.8-Flash-Next's output_gate_type, llama.cpp's qwen4exp): the DeltaNet's output norm, per value head.
    Statistics and gate in float32, as transformers' Qwen3NextRMSNormGated computes them."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w * normed * GATES[gate](z.float())).to(x.dtype)


def fuse_projections(lw: dict, cfg: ModelConfig) -> None:
    """The split layout's input projections (attn_qkv, attn_gate, and ssm_ba or ssm_beta and ssm_alpha) as one
    weight, ssm_proj (2K + 2V + 2nv, H): rows q|k|v, z, then b and a in value-head order; one GEMM (a decode
    step's one launch) instead of three or four. The HF qwen3_next layout's ssm_in and ssm_ba stay as they are."""
    if "attn_qkv.weight" not in lw:
        return
    nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    if "ssm_ba.weight" in lw:           # [b.. a..] per key head -> all b, then all a
        ba = lw.pop("ssm_ba.weight")
        b, a = ba.view(nk, 2, r, ba.shape[-1]).unbind(1)
        b, a = b.reshape(nk * r, -1), a.reshape(nk * r, -1)
    else:
        b, a = lw.pop("ssm_beta.weight"), lw.pop("ssm_alpha.weight")
    lw["ssm_proj.weight"] = torch.cat([lw.pop("attn_qkv.weight"), lw.pop("attn_gate.weight"), b, a])


def _projections(x: torch.Tensor, lw: dict, cfg: ModelConfig, proj: torch.Tensor | None = None):
    """The input projections in either family's layout, as views grouped by key head: q, k (B, T, nk, dk) and v,
    z (B, T, nk, r, dv) (v before the conv), b and a (B, T, nk, r); value head j of key head h is head h r + j, in
    transformers' order. proj (B, T, N): x's product with fuse_projections' one weight, where the caller made it."""
    B, T, _ = x.shape
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    if "ssm_proj.weight" in lw:         # fuse_projections' one weight
        if proj is None:
            proj = F.linear(x, lw["ssm_proj.weight"])
        q, k, v, z, b, a = proj.split([nk * dk, nk * dk, nv * dv, nv * dv, nv, nv], -1)
    else:
        if "ssm_in.weight" in lw:       # qwen3_next: [q k v.. z..] per key head
            qkvz = F.linear(x, lw["ssm_in.weight"]).view(B, T, nk, 2 * dk + 2 * r * dv)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        else:                           # qwen3_5_moe (and llama.cpp's qwen3next since it splits ssm_in)
            q, k, v = F.linear(x, lw["attn_qkv.weight"]).split([nk * dk, nk * dk, nv * dv], dim=-1)
            z = F.linear(x, lw["attn_gate.weight"])
        if "ssm_ba.weight" in lw:       # [b.. a..] per key head
            b, a = F.linear(x, lw["ssm_ba.weight"]).view(B, T, nk, 2 * r).split([r, r], dim=-1)
        else:
            b, a = F.linear(x, lw["ssm_beta.weight"]), F.linear(x, lw["ssm_alpha.weight"])
    return (q.view(B, T, nk, dk), k.view(B, T, nk, dk), v.view(B, T, nk, r, dv), z.view(B, T, nk, r, dv),
            b.view(B, T, nk, r), a.view(B, T, nk, r))


def _mixer(q, k, v, z, b, a, lw: dict, eps: float, state: DeltaState | None, recurrent: bool,
           kernels: "DeltaKernels", chunk_size: int = 64, gate: str = "silu",
           keep: list | None = None) -> tuple[torch.Tensor, DeltaState]:
    """The layer after its input projections (_projections' views, (B, T, ..) each) from `state` (None: empty):
    the conv, the gates, the q/k norms, the delta rule (recurrent or chunked) and the gated output norm -> (B, T,
    nv, dv), the state after. keep: a list that gets the state after each token, a DeltaState of conv (B, T, C,
    K-1) and ssm (B, T, nv, dk, dv) (a speculative verify step's, to take the accepted one: the recurrent rule a
    token at a time, as decode steps run it)."""
    B, T, nk, dk = q.shape
    r, dv = v.shape[-2:]
    nv = nk * r
    mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)   # (B, T, C)
    if keep is not None:                # each token's window: the last K-1 inputs up to it
        K1 = lw["ssm_conv1d.weight"].shape[-1] - 1
        before = mixed.new_zeros(B, mixed.shape[-1], K1) if state is None else state.conv.to(mixed.dtype)
        inputs = torch.cat([before, mixed.transpose(1, 2)], dim=-1)                  # (B, C, K-1+T)
        windows = inputs.unfold(-1, K1, 1)[:, :, 1:].transpose(1, 2)                 # (B, T, C, K-1)
    mixed, conv = kernels.conv(mixed, lw["ssm_conv1d.weight"], None if state is None else state.conv)
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v = q.reshape(B, T, nk, dk), k.reshape(B, T, nk, dk), v.reshape(B, T, nv, dv)
    ssm0 = None if state is None else state.ssm
    beta, g = _gates(a.reshape(B, T, nv), b.reshape(B, T, nv), lw["ssm_a"], lw["ssm_dt.bias"])   # g <= 0
    q, k = l2norm(q.float()), l2norm(k.float())
    if keep is not None:
        o, states = _token_by_token(q, k, v, g, beta, ssm0, kernels)
        ssm = states[:, -1]
        keep.append(DeltaState(windows.contiguous(), states))
    elif recurrent:
        o, ssm = kernels.recurrent(q, k, v, g, beta, ssm0)
    else:
        o, ssm = kernels.chunk(q, k, v, g, beta, ssm0, chunk_size)
    return gated_rms_norm(o, z.reshape(B, T, nv, dv), lw["ssm_norm.weight"], eps, gate), DeltaState(conv, ssm)


def _token_by_token(q, k, v, g, beta, ssm0, kernels):
    """The recurrent rule one token at a time, as T decode steps run it: o (B, T, nv, dv) and the state after
    each token (B, T, nv, dk, dv) float32."""
    outs, states, S = [], [], ssm0
    for t in range(q.shape[1]):
        o, S = kernels.recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], S)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, dim=1), torch.stack(states, dim=1)


def _gates(a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor):
    """beta = sigmoid(b) and the log-decay g = ssm_a * softplus(a + dt_bias) (float32, <= 0), from (B, T, nv) each."""
    return torch.sigmoid(b), ssm_a.float() * F.softplus(a.float() + dt_bias)


def step_in_place(q, k, v, z, b, a, conv, ssm, rows, lw: dict, eps: float, kernels=None,
                  gate: str = "silu") -> torch.Tensor:
    """A decode step of B sequences from their projections (_projections' views of one token each: q, k (B, nk,
    dk), v, z (B, nk, r, dv), b, a (B, nk, r)), whose states are rows `rows` (B,) of one layer's cache tensors, conv
    (n_seq, C, K-1) and ssm (n_seq, nv, dk, dv) float32, both updated in place -> the gated, normed output (B, nv
    dv), ready for ssm_out. The conv, gates, norms, recurrence and output norm of gated_deltanet at T = 1: the
    oracle of a DeltaKernels' `in_place` (kernels/delta.py's one-launch step). kernels: the conv and recurrence
    between the gather and the write-back (None: the references); gate: the output gate's activation."""
    o, st = _mixer(*(t[:, None] for t in (q, k, v, z, b, a)), lw, eps, DeltaState(conv[rows], ssm[rows]),
                   recurrent=True, kernels=kernels or TORCH, gate=gate)
    conv[rows], ssm[rows] = st.conv, st.ssm
    return o.reshape(q.shape[0], -1)


def gated_deltanet(x: torch.Tensor, lw: dict, cfg: ModelConfig, state: DeltaState | None = None,
                   mode: str = "auto", chunk_size: int = 64, kernels: DeltaKernels = TORCH,
                   keep: list | None = None) -> tuple[torch.Tensor, DeltaState]:
    """One Gated DeltaNet layer over B sequences of T tokens each: x (B, T, H) (the normed residual stream),
    `state` each sequence's state before x (None: empty) -> y (B, T, H), the state after x.

    mode: auto (recurrent for T = 1, chunked otherwise, as transformers chooses), chunk or recurrent.
    kernels: the conv and delta-rule implementations (plain torch by default). keep: a list that gets each token's
    state (_mixer's; then the recurrent rule, a token at a time)."""
    B, T, _ = x.shape
    recurrent = mode == "recurrent" or (mode == "auto" and T == 1)
    o, st = _mixer(*_projections(x, lw, cfg), lw, cfg.rms_norm_eps, state, recurrent, kernels, chunk_size,
                   cfg.deltanet_gate, keep)
    return F.linear(o.reshape(B, T, -1), lw["ssm_out.weight"]), st


def deltanet_step(x: torch.Tensor, lw: dict, cfg: ModelConfig, conv: torch.Tensor, ssm: torch.Tensor,
                  rows: torch.Tensor, in_place: Callable = step_in_place, proj: torch.Tensor | None = None,
                  linear: Callable = F.linear) -> torch.Tensor:
    """A decode step of B sequences, x (B, H) one token each, whose states are rows `rows` of the layer's cache
    tensors conv and ssm (updated in place) -> y (B, H). `in_place`: step_in_place or a kernel with its signature;
    proj (B, N): x's input projection where the caller made it; `linear`: the output projection's (F.linear's
    signature: kernels/gemv.py's on a fused step)."""
    p = None if proj is None else proj[:, None]
    q, k, v, z, b, a = (t[:, 0] for t in _projections(x[:, None], lw, cfg, p))
    o = in_place(q, k, v, z, b, a, conv, ssm, rows, lw, cfg.rms_norm_eps)       # (B, nv dv)
    return linear(o, lw["ssm_out.weight"])


class DeltaNet:
    """The Gated DeltaNet as a decoder's mixer block (arch/blocks.py's Blocks.mixer "deltanet"): a layer's
    mixer on the normed x (T, H) -> (T, H), each segment's sequence's state read from its row of the cache's
    conv[layer] (n_seq, C, kernel-1) and ssm[layer] (n_seq, nv, dk, dv) and written back. A prompt runs the
    chunked rule one segment at a time; a decode step (every segment one token) the recurrent one over all its
    sequences at once, on the cache's states in place (`kernels.in_place`, or step_in_place around the kernels'
    conv and recurrence). A speculative verify step (batch.keep_states) runs the recurrent rule a token at a time
    and leaves each token's state with the cache (HybridCache.keep_steps), which keeps the accepted one
    (HybridCache.rollback): rejected drafts are undone without running the prefix again."""

    def __init__(self, cfg: ModelConfig, kernels: DeltaKernels = TORCH):
        self.cfg, self.kernels = cfg, kernels
        # the one-launch decode kernel gates by silu: a sigmoid gate takes the step around the kernels' parts
        fast = kernels.in_place if cfg.deltanet_gate == "silu" else None
        self.in_place = fast or functools.partial(step_in_place, kernels=kernels, gate=cfg.deltanet_gate)

    def prepare(self, lw: dict) -> None:
        """At load: the split layout's four input projections as one (fuse_projections)."""
        fuse_projections(lw, self.cfg)

    def in_proj(self, lw) -> str | None:
        """The one projection of its input (the split layout's, one weight since fuse_projections), or None."""
        return "ssm_proj" if "ssm_proj.weight" in lw else None

    def __call__(self, x, lw, layer: int, batch, kv, cos=None, sin=None, mask=None, fused=None,
                 proj=None) -> torch.Tensor:
        conv, ssm = kv.conv[layer], kv.ssm[layer]                  # (n_seq, C, kernel-1), (n_seq, nv, dk, dv)
        if batch.is_decode:             # one token of each of B distinct sequences: one recurrent step, batched
            return deltanet_step(x, lw, self.cfg, conv, ssm, batch.seq_ids, self.in_place, proj,
                                 F.linear if fused is None else fused.linear)
        outs, r = [], 0
        for s in batch.segments:        # a prompt chunk: the chunked rule, from where the sequence's state is
            rows = slice(s.seq, s.seq + 1)
            keep = [] if batch.keep_states and s.n > 1 else None   # (a one-token segment: nothing to undo)
            y, st = gated_deltanet(x[None, r:r + s.n], lw, self.cfg, DeltaState(conv[rows], ssm[rows]),
                                   kernels=self.kernels, keep=keep)          # (1, n, H)
            conv[rows], ssm[rows] = st.conv, st.ssm
            if keep:
                kv.keep_steps(layer, s, keep[0])
            outs.append(y[0])
            r += s.n
        return torch.cat(outs) if len(outs) > 1 else outs[0]
