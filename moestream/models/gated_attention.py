"""The full-attention layer of Qwen3-Next and Qwen3.5-MoE: grouped-query attention whose output is gated per
element by sigmoid of a second half of q_proj, with per-head QK-norm and rotary on the first rotary_dim dims.

    y = gated_attention(x, lw, cfg, cos, sin, kv, slot, seq, start)    # x (T, H): tokens start.. of one sequence

Weights (canonical names): attn_q.weight (nh * 2hd, H), each head's q then its gate ([q_h | gate_h] per head, as
HF's q_proj and llama.cpp's attn_q hold it); attn_k.weight / attn_v.weight (nkv*hd, H); attn_output.weight
(H, nh*hd); attn_q_norm.weight / attn_k_norm.weight (hd,), holding 1 + w of HF's zero-centred norms.
`kv` has KVCache's interface (runtime/kv_cache.py: k, v, write), one layer per attention layer: `slot` is this one's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .layers import apply_rope, attention, masked_attention, rms_norm


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first cos.shape[-1] dims of each head, the rest passed through: x (T, heads, hd)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


def gated_attention(x: torch.Tensor, lw: dict, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor, kv,
                    slot: int, seq: int, start: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, H): the normed residual stream of tokens start..start+T-1 of sequence `seq`; cos, sin (T, rotary_dim)
    at their positions, in x's dtype. Writes their k, v into `kv` and attends the sequence's keys up to each token
    -> (T, H). keep (T, start+T) bool: the keys each token attends (QSA's, models/qsa.py; None: causal)."""
    T = x.shape[0]
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, gate = F.linear(x, lw["attn_q.weight"]).view(T, nh, 2 * hd).chunk(2, dim=-1)    # (T, nh, hd) each
    k = F.linear(x, lw["attn_k.weight"]).view(T, nkv, hd)
    v = F.linear(x, lw["attn_v.weight"]).view(T, nkv, hd)
    q = rms_norm(q, lw["attn_q_norm.weight"], cfg.rms_norm_eps)
    k = rms_norm(k, lw["attn_k_norm.weight"], cfg.rms_norm_eps)
    q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
    pos = torch.arange(start, start + T, device=x.device)
    kv.write(slot, torch.full_like(pos, seq), pos, k, v)
    end = start + T
    keys, values = kv.k[slot][seq:seq + 1, :, :end], kv.v[slot][seq:seq + 1, :, :end]    # (1, nkv, end, hd)
    if keep is None:
        o = attention(q.transpose(0, 1).unsqueeze(0), keys, values)[0].transpose(0, 1)  # (T, nh, hd)
    else:
        o = masked_attention(q, keys[0], values[0], keep)
    o = o.reshape(T, nh * hd) * torch.sigmoid(gate.reshape(T, nh * hd))
    return F.linear(o, lw["attn_output.weight"])
