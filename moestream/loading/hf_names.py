"""Hugging Face spellings of moestream's canonical (GGUF) tensor names, as hf.py reads them and hf_write.py writes
them: each family's spellings are its entry in arch/families.py (HF_LAYER, hf_renames, hf_router, the MTP heads'
hf_mtp prefix), the Qwen3.8-Flash-Next ones arch/hybrid_names.py's.

    hf_names("blk.0.attn_q.weight", "qwen3moe")      # ["model.layers.0.self_attn.q_proj.weight"]
    layers_prefix(cfg, 3)                            # "model.layers.3."; past the trunk, an MTP head's "mtp.layers.0."
                                                     # (DeepSeek-V3, GLM-4.5: "model.layers.{n_layers}.")
"""
from __future__ import annotations

from ..arch.families import AFTER_TRUNK, FAMILIES, HF_GLOBAL, HF_LAYER, HF_NEXTN, HF_NEXTN_LAYER, first_own
from ..arch.hybrid_names import QWEN4_GLOBAL, QWEN4_HF
from ..arch.names import EXPERT_STACKS
from ..config import ModelConfig

INDEX = "model.safetensors.index.json"


def hf_names(name: str, family: str, prefix: str = "model.", n_layers: int | None = None) -> list[str]:
    """HF spellings of a canonical name, the one transformers 5.24's save_pretrained writes first. `prefix`: where
    the language model's tensors are (`model.`; Qwen3.5-MoE's multimodal checkpoints: `model.language_model.`).
    n_layers: the trunk's layers; a layer past them is an MTP head, under the family's hf_mtp prefix."""
    if name in HF_GLOBAL:
        hf = HF_GLOBAL[name]
        return [prefix + hf[len("model."):] if hf.startswith("model.") else hf]
    if name in QWEN4_GLOBAL:
        return [prefix + QWEN4_GLOBAL[name]]
    if name == "per_layer_token_embd.weight":
        return []                       # in row shards of its layer's n-gram embedding: HFSource._ple_table
    _, layer, suffix = name.split(".", 2)
    head = n_layers is not None and int(layer) >= n_layers and FAMILIES[family].hf_mtp
    mtp = FAMILIES[family].hf_mtp[1] if head else None
    if mtp == AFTER_TRUNK and suffix.startswith("nextn."):    # `model.layers.{n}.eh_proj.weight`, ...
        return [f"{prefix}layers.{layer}.{HF_NEXTN_LAYER[suffix]}"]
    if mtp is not None and mtp != AFTER_TRUNK:                 # head k: `mtp.fc.weight`, `mtp.layers.k.*`
        if suffix.startswith("nextn."):
            return [mtp + HF_NEXTN[suffix]] if suffix in HF_NEXTN else []
        block = f"{prefix}layers.0."
        return [f"{mtp}layers.{int(layer) - n_layers}.{n[len(block):]}"
                for n in hf_names(f"blk.0.{suffix}", family, prefix)]
    if suffix == "ffn_gate_inp.weight":
        spellings = first_own(FAMILIES[family].hf_router, [f.hf_router for f in FAMILIES.values()])
    elif suffix in ("indexer.q_proj.weight", "indexer.k_proj.weight"):
        spellings = []                  # rows of index_qk_proj: HFSource._indexer
    else:
        spellings = [dict(FAMILIES[family].hf_renames).get(suffix) or HF_LAYER.get(suffix) or QWEN4_HF[suffix]]
    return [f"{prefix}layers.{layer}.{s}" for s in spellings]


def layers_prefix(cfg: ModelConfig, layer: int, prefix: str = "model.") -> str:
    """Where layer `layer`'s tensors are: `{prefix}layers.N.`, an MTP head's under the family's hf_mtp prefix (or,
    AFTER_TRUNK, as the trunk's)."""
    if layer >= cfg.n_layers and FAMILIES[cfg.family].hf_mtp[1] != AFTER_TRUNK:
        return f"{FAMILIES[cfg.family].hf_mtp[1]}layers.{layer - cfg.n_layers}."
    return f"{prefix}layers.{layer}."


def fused_bias(cfg: ModelConfig, name: str) -> bool:
    """Whether `name` is an expert bias that HF keeps fused beside its stacks (gpt-oss's gate_up_proj_bias,
    down_proj_bias), not a tensor of its own."""
    return FAMILIES[cfg.family].hf_interleaved and name.endswith(tuple(f"{s}.bias" for s in EXPERT_STACKS))


def layer_suffix(name: str) -> str:
    """A canonical name as hybrid_names' values take it: a layer's suffix (`attn_norm.weight`), or a global name."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name
