"""What every loader produces: a WeightSource, read lazily by canonical (GGUF) tensor name.

    src = open_source("synth:tiny")            # or a Hugging Face directory, or a .gguf file
    src.config                                  # ModelConfig
    src.tensor("blk.0.attn_q.weight")           # torch.Tensor (out, in), on the CPU, the file's float dtype
    gate, up, down = src.expert(layer=0, e=3)   # (I, H), (I, H), (H, I)

Canonical names (prefix `blk.{i}.` for layer i), shapes in torch order (out_features, in_features):
    token_embd.weight (V, H)   output_norm.weight (H,)   output.weight (V, H)  [absent when tied]
    attn_norm.weight (H,)      attn_q.weight (nh*hd, H)  attn_k.weight / attn_v.weight (nkv*hd, H)
    attn_output.weight (H, nh*hd)
    attn_q.bias / attn_k.bias / attn_v.bias             [qwen2_moe]
    attn_q_norm.weight / attn_k_norm.weight (hd,)       [qwen3_moe: per head]  (nh*hd,) / (nkv*hd,) [olmoe]
    ffn_norm.weight (H,)
    MoE layers:   ffn_gate_inp.weight (E, H)   experts through expert()
                  ffn_gate_shexp.weight / ffn_up_shexp.weight (Is, H), ffn_down_shexp.weight (H, Is),
                  ffn_gate_inp_shexp.weight (1, H)     [qwen2_moe shared expert and its sigmoid gate]
    dense layers: ffn_gate.weight / ffn_up.weight (I, H), ffn_down.weight (H, I)
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..config import ModelConfig
from ..errors import UserError


class WeightSource(Protocol):
    config: ModelConfig
    tokenizer: object | None        # moestream.text.tokenizer.Tokenizer, or None: prompts are token ids

    def has(self, name: str) -> bool: ...
    def tensor(self, name: str) -> torch.Tensor: ...
    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def dense_names(cfg: ModelConfig) -> list[str]:
    """Every non-expert tensor a model of this config has, in canonical names."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("output.weight")
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        names += [p + n for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                  "attn_output.weight", "ffn_norm.weight")]
        if cfg.attn_bias:
            names += [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
        if cfg.qk_norm != "none":
            names += [p + "attn_q_norm.weight", p + "attn_k_norm.weight"]
        if i in cfg.dense_layers:
            names += [p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight"]
        else:
            names.append(p + "ffn_gate_inp.weight")
            if cfg.shared_expert_intermediate_size:
                names += [p + n for n in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
                                          "ffn_gate_inp_shexp.weight")]
    return names


def open_source(model: str, progress: bool = True) -> WeightSource:
    """A model spec as users write it: `synth:NAME`, a Hugging Face directory, or a `.gguf` file."""
    if model.startswith("synth:"):
        from .synth import SynthSource
        return SynthSource.from_spec(model[len("synth:"):])
    path = Path(model)
    if not path.exists():
        raise UserError(f"model not found: {model!r}; give a Hugging Face directory, a .gguf file or synth:NAME "
                        "(moestream make-model writes one)")
    if path.is_dir():
        from .hf import HFSource
        return HFSource(path)
    from .gguf import GGUFSource
    return GGUFSource(path)
