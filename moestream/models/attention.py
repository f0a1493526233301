"""Attention kinds, the token mixer of a decoder's attention layers: a family's entry picks one
(arch/blocks.py's Attention.kind) and models/blocks.py builds it.

    attn = GQA(cfg)                    # or GatedAttention(cfg), MLA(cfg), models/qsa.py's QSA(cfg)
    y = attn(x, lw, slot, batch, kv, cos, sin, mask, fused, proj)     # x (T, H) normed -> (T, H)

A kind reads one layer's weights `lw` (canonical names; q, k and v as one attn_qkv since the decoder's load),
writes its keys and values to KV layer `slot`, and attends each token's own sequence up to its position: prompts
one segment at a time, decode steps batched over sequences with a mask of the keys each token attends (the same
shapes in eager and captured steps give the same bits). `fused` (kernels.fused, decode steps on CUDA): the norms,
rotary, cache writes and attention as fused kernels where the kind's options allow (`fuses`). `proj`: the qkv
projection of x, where the step computed it with the norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.fused import head_fits
from ..kernels.sink_attention import sink_attention, sink_fits
from .gated_attention import partial_rope
from .layers import attention, attention_sinks, decode_attention, rms_norm


class GQA:
    """Grouped-query attention with ModelConfig's options: q/k/v biases (Qwen2-MoE, GLM-4.5), QK-norm per head
    (Qwen3-MoE, GLM-4.5's use_qk_norm) or over the whole projection (OLMoE), q/k/v clamped (OLMoE's clip_qkv),
    rotary on the first rotary_dim dims of each head (GLM-4.5's partial_rotary_factor); with gpt-oss's options
    (arch/blocks.py's Attention): sliding_attention layers attend their last cfg.sliding_window positions, a sink logit per head
    joins the softmax (attn_sinks.weight), and o_proj has a bias; the fused decode kernels and CUDA prompts'
    kernels/sink_attention.py take both. A sliding layer's KV may be a ring (kv.ring[slot] = R > 0: R positions a
    sequence, position p at index p % R; runtime/sliding_kv.py says why R = window + the most tokens a forward
    writes is enough, and how prefix reuse treats it): every read goes by position modulo R, in the same order as
    from a linear cache, so the bits are the linear cache's."""
    def __init__(self, cfg: ModelConfig, window: bool = False, sinks: bool = False):
        self.cfg = cfg
        self.sinks = sinks
        # the KV layers (indices into the cache's attention layers) that attend the last sliding_window positions
        sliding = set(cfg.sliding_layers) if window else set()
        self.windowed = {j for j, i in enumerate(cfg.attention_layers) if i in sliding}

    def prepare(self, lw: dict) -> None:
        """At load: nothing (the decoder has put q, k and v in one attn_qkv)."""

    def in_proj(self, lw) -> str | None:
        """The one projection of its input, which a one-token fused step computes with the norm."""
        return "attn_qkv"

    def takes_fused(self) -> bool:
        """Whether a model of this attention runs the fused decode kernels at all (the engine's `fused`): heads the
        attention kernels take (kernels/fused.py's head_fits), whether or not this model's options fuse them."""
        return head_fits(self.cfg.head_dim)

    def fuses(self, fused) -> bool:
        """Whether a decode step's attention runs as the fused kernels: they take per-head QK-norm or none, no
        clipping, rotary on whole heads or on their first rotary_dim dims (GLM-4.5's), q/k/v biases (in the qkv
        projection before them), and gpt-oss's sinks and window (OLMoE's whole-projection norm and clip_qkv run as
        eager ops, with the mask)."""
        cfg = self.cfg
        return fused is not None and cfg.qk_norm in ("none", "head") and not cfg.clip_qkv

    def options(self, lw, slot: int) -> tuple[torch.Tensor | None, int]:
        """gpt-oss's options of KV layer `slot`: (its sink logits (nh,) or None, its window or 0)."""
        return (lw["attn_sinks.weight"] if self.sinks else None,
                self.cfg.sliding_window if slot in self.windowed else 0)

    def __call__(self, x, lw, slot: int, batch, kv, cos, sin, mask=None, fused=None, proj=None) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        qkv = proj if proj is not None else F.linear(x, lw["attn_qkv.weight"], lw.get("attn_qkv.bias"))
        if self.fuses(fused):                                                # qkv (T, (nh + 2 nkv) hd)
            ring = kv.ring[slot] > 0
            q = fused.qk_rope_kv(qkv, lw.get("attn_qk_norm.weight"), cfg.rms_norm_eps, cos, sin, kv.k[slot],
                                 kv.v[slot], batch.seq_ids, batch.positions, cfg.n_heads, cfg.n_kv_heads, ring=ring)
            n = batch.kv_len or kv.ctx
            sinks, window = self.options(lw, slot)
            o = fused.decode_attention(q, kv.k[slot], kv.v[slot], batch.seq_ids, batch.positions, n,
                                       sinks=sinks, window=window, ring=ring)
            return fused.linear(o.reshape(T, -1), lw["attn_output.weight"], lw.get("attn_output.bias"))
        q, k, v = qkv.split([cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim,
                             cfg.n_kv_heads * cfg.head_dim], dim=-1)
        if cfg.qk_norm == "full":
            q = rms_norm(q, lw["attn_q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, lw["attn_k_norm.weight"], cfg.rms_norm_eps)
        if cfg.clip_qkv:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(T, cfg.n_heads, cfg.head_dim)
        k = k.view(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q = rms_norm(q, lw["attn_q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, lw["attn_k_norm.weight"], cfg.rms_norm_eps)
        q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        kv.write(slot, batch.seq_ids, batch.positions, k, v)
        sinks, window = self.options(lw, slot)
        if window and mask is not None:      # a decode step: only the keys of the last `window` positions
            n = mask.shape[1]
            mask = mask & (torch.arange(n, device=mask.device)[None, :] > batch.positions[:, None] - window)
        o = attend(q, slot, batch, kv, mask, sinks, window)                  # (T, nh, hd)
        return F.linear(o.reshape(T, -1), lw["attn_output.weight"], lw.get("attn_output.bias"))


class GatedAttention(GQA):
    """Qwen3-Next's and Qwen3.5-MoE's attention (models/gated_attention.py's math): q's second half gates the
    output through a sigmoid, per-head QK-norm, rotary on the first rotary_dim dims; cos, sin (T, rotary_dim). A
    fused decode step runs norms, rotary, cache writes, attention and gate in three launches."""

    def fuses(self, fused) -> bool:
        """The fused kernels (kernels/fused.py's gated_qk_rope_kv and decode_attention with its gate) take the
        interleaved gates, the partial rotary and the per-head norms every gated family has."""
        return fused is not None

    def __call__(self, x, lw, slot: int, batch, kv, cos, sin, mask=None, fused=None, proj=None) -> torch.Tensor:
        cfg = self.cfg
        T, nh, nkv, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = proj if proj is not None else F.linear(x, lw["attn_qkv.weight"])    # (T, nh 2hd + 2 nkv hd)
        if self.fuses(fused):
            q, gate = fused.gated_qk_rope_kv(qkv, lw["attn_qk_norm.weight"], cfg.rms_norm_eps, cos, sin,
                                             kv.k[slot], kv.v[slot], batch.seq_ids, batch.positions, nh, nkv)
            o = fused.decode_attention(q, kv.k[slot], kv.v[slot], batch.seq_ids, batch.positions,
                                       batch.kv_len or kv.ctx, gate)        # (T, nh, hd), gated
            return fused.linear(o.reshape(T, nh * hd), lw["attn_output.weight"])
        qg, k, v = qkv.split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, gate = qg.view(T, nh, 2 * hd).chunk(2, dim=-1)                    # (T, nh, hd) each: [q_h | gate_h]
        q = rms_norm(q, lw["attn_q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k.view(T, nkv, hd), lw["attn_k_norm.weight"], cfg.rms_norm_eps)
        q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        kv.write(slot, batch.seq_ids, batch.positions, k, v.view(T, nkv, hd))
        o = self.attend(q, x, lw, slot, batch, kv, cos, sin, mask)          # (T, nh, hd)
        o = o.reshape(T, nh * hd) * torch.sigmoid(gate.reshape(T, nh * hd))
        return F.linear(o, lw["attn_output.weight"])

    def attend(self, q, x, lw, slot: int, batch, kv, cos, sin, mask=None) -> torch.Tensor:
        """q (T, nh, hd), normed and turned, against the keys each token attends (QSA's kind picks them from x)."""
        return attend(q, slot, batch, kv, mask)


def attend(q, slot: int, batch, kv, mask=None, sinks=None, window: int = 0) -> torch.Tensor:
    """q (T, nh, hd) against each token's own sequence's cache in KV layer `slot`, up to and including its
    position (decode: `mask` (B, n) says which of the first n keys each token attends). sinks (nh,): each head's
    sink logit in the softmax; window: a prompt's queries attend their last `window` positions only (decode: the
    mask says so). A prompt with sinks or a window runs kernels/sink_attention.py where it fits (CUDA, 16-bit),
    layers.py's attention_sinks (its oracle) elsewhere. A ring (kv.ring[slot] = R): decode reads key j of the n at
    index j % R, a prompt's chunk its keys by position (sink_attention's `start`)."""
    keys, values = kv.k[slot], kv.v[slot]                                    # (n_seq, nkv, ctx or R, hd)
    ring = kv.ring[slot]
    if batch.is_decode:
        # The whole context, masked, in eager and captured decodes alike: the same shapes give the same bits.
        n = batch.kv_len or kv.ctx
        if ring and n > ring:       # key j at j % R: the linear cache's keys in its order (masked past the window)
            if kv.n_seq > 1:
                keys, values = keys[batch.seq_ids], values[batch.seq_ids]    # (B, nkv, R, hd)
            at = torch.arange(n, device=q.device) % ring
            kk, vv = keys.index_select(2, at), values.index_select(2, at)    # (B, nkv, n, hd)
        elif kv.n_seq == 1:         # one sequence: its cache as it is, no gather
            kk, vv = keys[:, :, :n], values[:, :, :n]                        # (1, nkv, n, hd)
        else:
            kk, vv = keys[batch.seq_ids, :, :n], values[batch.seq_ids, :, :n]    # (B, nkv, n, hd)
        return decode_attention(q, kk, vv, mask, sinks)                      # (B, nh, hd)
    outs, r = [], 0
    sink_prompt = sink_attention if sink_fits(q) else attention_sinks       # CUDA, 16-bit: the Triton kernel
    for s in batch.segments:
        end = s.start + s.n
        qs = q[r:r + s.n].transpose(0, 1).unsqueeze(0)                       # (1, nh, n, hd)
        if ring:                    # the sequence's ring, read by position
            kk, vv = keys[s.seq:s.seq + 1], values[s.seq:s.seq + 1]          # (1, nkv, R, hd)
            outs.append(sink_prompt(qs, kk, vv, sinks, window, start=s.start)[0].transpose(0, 1))
            r += s.n
            continue
        kk, vv = keys[s.seq:s.seq + 1, :, :end], values[s.seq:s.seq + 1, :, :end]
        if sinks is None and not window:
            outs.append(attention(qs, kk, vv)[0].transpose(0, 1))           # (n, nh, hd)
        else:
            outs.append(sink_prompt(qs, kk, vv, sinks, window)[0].transpose(0, 1))
        r += s.n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


from .mla import MLA  # noqa: E402  (it builds on GQA)

KINDS = {"gqa": GQA, "gated": GatedAttention, "mla": MLA}     # each made as KINDS[kind](cfg); gqa's and gated's
                                                                # take window= and sinks= too; models/qsa.py's QSA
                                                                # joins them in models/blocks.py
