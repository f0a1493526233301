"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), the attention kind "mla" (arch/blocks.py), as
transformers' DeepseekV3Attention and llama.cpp's deepseek2 compute it.

    attn = MLA(cfg)
    y = attn(x, lw, slot, batch, kv, cos, sin, mask)       # x (T, H) normed -> (T, H)

Queries: attn_q_b(norm(attn_q_a x)) (q_lora_rank), or attn_q x; each head dn dims without rotary and dr with.
Keys and values come from one latent per token: attn_kv_a_mqa x = [c (r) | k_rot (dr)], c normed
(attn_kv_a_norm), k_rot rotated and shared by every head. The cache (runtime/kv_cache.py's latent layout) holds
only c and the rotated k_rot per token and layer, as one "key head" of r and one "value head" of dr: 576 values a
token and layer at DeepSeek-V3's r = 512, dr = 64, where its 128 heads' keys and values would be 128 x 2 x 192.
attn_kv_b (nh*(dn+dv), r) turns c into each head's dn key dims and dv value dims.

Prompt segments run the expanded form: every cached c of the sequence up to the segment's end through attn_kv_b,
the keys [k_nope | k_rot], causal attention (flash or memory-efficient on CUDA: the value head dv is narrower than
the q/k head). Decode steps run the absorbed form, which never expands the cache: q_nope times each head's key rows
of attn_kv_b gives a query in latent space (B, nh, r); scores are q_lat . c + q_rot . k_rot over the sequence's
cache (float32, masked, as models/layers.py's decode_attention), the weighted sum of c is taken to each head's dv
dims by its value rows of attn_kv_b after. So do short segments that continue a sequence (ABSORBED_MAX tokens: a
speculative verify step, whose few queries would otherwise expand the whole cache, and whose tokens then follow
the decode step's math). The softmax scale is (dn + dr) ** -0.5, times mscale(factor,
mscale_all_dim) squared under YaRN (transformers' yarn_apply_mscale, llama.cpp's kq_scale). Rotary on adjacent
pairs where rope_interleave (DeepSeek's checkpoints, llama.cpp's NORM rope), else on halves.

A fused decode step (kernels.fused, CUDA) runs the attention over the latent cache as kernels/mla.py's
mla_decode_attention (`fuses`: latent and rotary widths it takes), between the two batched matmuls of attn_kv_b's
rows; the torch form here is the CPU's path and its oracle. Decode steps attend the cache's span (KVCache.span),
so eager and captured steps (runtime/graphs.py) have the same shapes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.mla import mla_fits
from .layers import apply_rope, attention, interleaved_rope, rms_norm


ABSORBED_MAX = 32          # a segment continuing its sequence with at most this many tokens runs the absorbed form


def softmax_scale(cfg: ModelConfig) -> float:
    """(dn + dr) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 where the rope is scaled."""
    scale = cfg.head_dim ** -0.5
    r = cfg.rope
    m_all = r.get("mscale_all_dim")
    if cfg.rope_type != "default" and m_all and float(r.get("factor", 1.0)) > 1:
        m = 0.1 * m_all * math.log(float(r["factor"])) + 1.0
        scale *= m * m
    return scale


class MLA:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.scale = softmax_scale(cfg)
        self.rope = interleaved_rope if cfg.rope_interleave else apply_rope

    def prepare(self, lw: dict) -> None:
        """At load: nothing (the absorbed form reads attn_kv_b's rows as views)."""

    def in_proj(self, lw) -> str | None:
        return None                     # no one projection for a fused norm to take

    def takes_fused(self) -> bool:
        """The fused decode kernels' norms, router and shared expert take any latent attention (its own attention
        kernel, `fuses`, wants more)."""
        return True

    def fuses(self, fused) -> bool:
        """Whether a decode step's attention over the cache runs as the fused kernel (else the torch form, masked)."""
        cfg = self.cfg
        return fused is not None and mla_fits(cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def __call__(self, x, lw, slot: int, batch, kv, cos, sin, mask=None, fused=None, proj=None) -> torch.Tensor:
        cfg = self.cfg
        T, nh, dn, dr, r = x.shape[0], cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q = F.linear(rms_norm(F.linear(x, lw["attn_q_a.weight"]), lw["attn_q_a_norm.weight"], cfg.rms_norm_eps),
                         lw["attn_q_b.weight"])
        else:
            q = F.linear(x, lw["attn_q.weight"])
        q = q.view(T, nh, dn + dr)
        q_nope = q[..., :dn]                                                     # (T, nh, dn)
        kv_a = F.linear(x, lw["attn_kv_a_mqa.weight"])                           # (T, r + dr): [c | k_rot]
        if batch.is_decode and self.fuses(fused):      # the norm, both rotary embeddings, the cache writes: one launch
            q_rot = fused.mla_rope_kv(q, kv_a, lw["attn_kv_a_norm.weight"], cfg.rms_norm_eps, cos, sin, kv.k[slot],
                                      kv.v[slot], batch.seq_ids, batch.positions, cfg.rope_interleave)
        else:
            c, k_rot = kv_a.split([r, dr], dim=-1)                               # (T, r), (T, dr)
            c = rms_norm(c, lw["attn_kv_a_norm.weight"], cfg.rms_norm_eps)
            q_rot, k_rot = self.rope(q[..., dn:], cos, sin), self.rope(k_rot.reshape(T, 1, dr), cos, sin)
            kv.write(slot, batch.seq_ids, batch.positions, c.view(T, 1, r), k_rot)
        kv_b = lw["attn_kv_b.weight"]
        if batch.is_decode or all(s.start and s.n <= ABSORBED_MAX for s in batch.segments):
            o = self._absorbed(q_nope, q_rot, kv_b, kv.k[slot], kv.v[slot], batch, kv.ctx, mask, fused)
        else:
            o = self._expanded(q_nope, q_rot, kv_b, kv.k[slot], kv.v[slot], batch)
        return F.linear(o.reshape(T, nh * cfg.v_head_dim), lw["attn_output.weight"])

    def _expanded(self, q_nope, q_rot, kv_b, latents, rot_keys, batch) -> torch.Tensor:
        """Each segment's queries against its sequence's cache expanded into heads: (T, nh, dv)."""
        cfg = self.cfg
        nh, dn, dr, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        outs, row = [], 0
        for s in batch.segments:
            end = s.start + s.n
            c, k_rot = latents[s.seq, 0, :end], rot_keys[s.seq, 0, :end]         # (end, r), (end, dr)
            k_nope, v = F.linear(c, kv_b).view(end, nh, dn + dv).split([dn, dv], dim=-1)
            k = torch.cat([k_nope, k_rot[:, None, :].expand(end, nh, dr)], dim=-1)          # (end, nh, dn+dr)
            q = torch.cat([q_nope[row:row + s.n], q_rot[row:row + s.n]], dim=-1)         # (n, nh, dn+dr)
            o = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], self.scale)
            outs.append(o[0].transpose(0, 1))                                     # (n, nh, dv)
            row += s.n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _absorbed(self, q_nope, q_rot, kv_b, latents, rot_keys, batch, ctx: int, mask, fused=None) -> torch.Tensor:
        """One query per token against its sequence's latent cache, never expanded: (B, nh, dv). The attention
        over the cache: the fused kernel where it `fuses`, else latent_attention. Decode steps, and segments of at
        most ABSORBED_MAX tokens that continue a sequence (a speculative verify step: the decode step's math, not
        the whole cache expanded again for a few queries)."""
        cfg = self.cfg
        nh, dn, dv, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        n = batch.kv_len or (ctx if batch.is_decode else max(s.start + s.n for s in batch.segments))
        if mask is None:                # a short segment's tokens (a verify step): each attends up to its position
            mask = torch.arange(n, device=q_nope.device)[None, :] <= batch.positions[:, None]
        w = kv_b.view(nh, dn + dv, r)
        w_uk, w_uv = w[:, :dn], w[:, dn:]                                        # (nh, dn, r), (nh, dv, r)
        q_lat = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)       # (B, nh, r)
        if self.fuses(fused):
            o_lat = fused.mla_decode_attention(q_lat, q_rot, latents, rot_keys, batch.seq_ids, batch.positions, n,
                                               self.scale)
        else:
            o_lat = latent_attention(q_lat, q_rot, latents, rot_keys, batch.seq_ids, mask, self.scale)
        return torch.matmul(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)    # (B, nh, dv)


def latent_attention(q_lat, q_rot, latents, rot_keys, seq_ids, mask, scale: float) -> torch.Tensor:
    """q_lat (B, nh, r), q_rot (B, nh, dr) against the first n keys of each token's sequence in the latent cache
    (latents (n_seq, 1, ctx, r), rot_keys (n_seq, 1, ctx, dr)), mask (B, n) the keys each attends -> (B, nh, r) in
    q_lat's dtype: scores, softmax and the weighted sum of latents in float32 (kernels/mla.py's oracle)."""
    n = mask.shape[1]
    c = latents[seq_ids, 0, :n].float()                                          # (B, n, r)
    k_rot = rot_keys[seq_ids, 0, :n].float()                                     # (B, n, dr)
    scores = (torch.matmul(q_lat.float(), c.transpose(1, 2))
              + torch.matmul(q_rot.float(), k_rot.transpose(1, 2))) * scale      # (B, nh, n)
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), c).to(q_lat.dtype)      # (B, nh, r)
