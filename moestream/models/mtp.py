"""A multi-token prediction (MTP, NextN) head: the draft model Qwen3-Next and Qwen3.5-MoE ship beside their trunk,
as vLLM's qwen3_next_mtp and llama.cpp's qwen35moe graph_mtp compute it. transformers does not model it (it drops
`mtp.*` at load).

    x = mtp_input(embed(token), hidden, lw, eps)       # (T, H): the head block's input
    # then the head's block, a full gated-attention layer with routed and shared experts (models/transformer.py,
    # layer cfg.n_layers: Batch.head), the norm nextn.shared_head_norm, and the trunk's lm_head

At position i the head reads the token at i + 1 (its embedding) and the trunk's hidden state at i (post-norm: what
the trunk's lm_head reads), each RMS-normed, concatenated [embedding | hidden] and projected (eh_proj, (H, 2H)); its
logits guess the token at i + 2. A second draft reads the head's own post-norm output instead of the trunk's hidden
state (the chain). The head's block has its own KV cache layer (after the trunk's attention layers) and its experts
are layer n_layers of the expert store: the same host store, cache and counters as the trunk's.

Its tensors (canonical; GGUF's `blk.{n_layers}.`, HF's `mtp.`): nextn.eh_proj.weight (H, 2H) `mtp.fc`,
nextn.enorm.weight `mtp.pre_fc_norm_embedding`, nextn.hnorm.weight `mtp.pre_fc_norm_hidden`,
nextn.shared_head_norm.weight `mtp.norm` (1 + w, as every norm of these families), and the block's own under
`mtp.layers.0.` as a trunk layer's.

DeepSeek-V3 and GLM-4.5 ship the same kind of head, as vLLM's deepseek_mtp / glm4_moe_mtp and llama.cpp's deepseek2
and glm4moe graph_mtp compute it: HF's `model.layers.{n_layers}.` (eh_proj, enorm, hnorm, shared_head.norm, plain
RMSNorm weights) with the block (latent or grouped-query attention, the sigmoid router, routed and shared experts)
beside them in the trunk's spellings, and its own embed_tokens and shared_head.head (nextn.embed_tokens,
nextn.shared_head_head; copies of the trunk's in the published checkpoints, which the loader then keeps once).
vLLM zeroes the embedding at position 0 where llama.cpp does not; this follows llama.cpp (drafts only: the target
verifies every token).

Qwen3.8-Flash-Next's head (GGUF only: transformers drops `mtp.*`; llama.cpp b11549's qwen4exp graph_mtp) works on
its hyper-connection streams (models/residual.py's Hyper). It reads the trunk's streams (T, hc*H) before the output
mixer, not a post-norm state; hnorm (hc*H,) norms each stream on its own, enorm(embedding) goes into every stream,
and eh_proj maps each stream's [e | h_s] to that stream of the head block's input (mtp_streams). Its block is a
full-attention QSA layer with its own stream mixers and experts (no PLE); its streams after the block are what the
next draft reads, and its logits come through its own output mixer (nextn.hc_head_{norm,down,up}, no inject) and
the trunk's output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import rms_norm
from .residual import group_rms_norm


def mtp_io(lw: dict, embed: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's embedding (V, H) and output head (V, H): its own (nextn.embed_tokens, nextn.shared_head_head)
    where its layer's weights `lw` have them, else the trunk's `embed` and `lm_head` (as llama.cpp's)."""
    return lw.get("nextn.embed_tokens.weight", embed), lw.get("nextn.shared_head_head.weight", lm_head)


def mtp_input(emb: torch.Tensor, hidden: torch.Tensor, lw: dict, eps: float) -> torch.Tensor:
    """The head block's input (T, H): eh_proj([enorm(emb) | hnorm(hidden)]); emb (T, H) the embeddings of the
    tokens after the hidden states' positions, hidden (T, H) post-norm hidden states (the trunk's or the head's)."""
    e = rms_norm(emb, lw["nextn.enorm.weight"], eps)
    h = rms_norm(hidden.to(emb.dtype), lw["nextn.hnorm.weight"], eps)
    return F.linear(torch.cat([e, h], dim=-1), lw["nextn.eh_proj.weight"])      # (T, 2H) -> (T, H)


def mtp_streams(emb: torch.Tensor, hidden: torch.Tensor, lw: dict, eps: float, hc: int) -> torch.Tensor:
    """A hyper-connection head's input streams (T, hc*H): stream s is eh_proj([enorm(emb) | hnorm_s(hidden_s)]); emb
    (T, H), hidden (T, hc*H) the streams before the output mixer (the trunk's or the head's)."""
    T, H = emb.shape
    e = rms_norm(emb, lw["nextn.enorm.weight"], eps)
    h = group_rms_norm(hidden.to(emb.dtype), lw["nextn.hnorm.weight"], hc, eps).view(T, hc, H)
    x = torch.cat([e[:, None, :].expand(T, hc, H), h], dim=-1)              # (T, hc, 2H)
    return F.linear(x, lw["nextn.eh_proj.weight"]).flatten(1)                # (T, hc*H)
