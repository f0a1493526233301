"""Multi-head latent attention's key/value up-projection in its two forms: HF's kv_b_proj (canonical attn_kv_b,
(nh*(dn+dv), r): each head's dn key rows, then its dv value rows) and llama.cpp's deepseek2 split, attn_k_b
(nh, r, dn), each head's key rows transposed for the absorbed query, and attn_v_b (nh, dv, r).

    k_b, v_b = split_kv_b(cfg, kv_b)        # as llama.cpp's converter writes them
    kv_b = fuse_kv_b(cfg, k_b, v_b)         # the same bits back
"""
from __future__ import annotations

import torch

from ..config import ModelConfig


def split_kv_b(cfg: ModelConfig, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nh, dn, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv = kv_b.view(nh, dn + dv, cfg.kv_lora_rank)
    return kv[:, :dn].transpose(1, 2).contiguous(), kv[:, dn:].contiguous()


def fuse_kv_b(cfg: ModelConfig, k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, cfg.kv_lora_rank)
