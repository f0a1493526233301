"""Writing Hugging Face directories: any WeightSource as config.json, generation_config.json, safetensors shards
(and an index) and the tokenizer's files, loadable by transformers and by hf.py's HFSource.

    write_hf(src, "out/")                            # shards written as they fill: one shard's tensors in memory
    hf_config(src.config, torch.bfloat16)            # the config.json dict alone

Qwen3.5-MoE is written in its text-only form (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text, tensors under
`model.`), which transformers and hf.py both load: the multimodal form's config.json needs a vision tower,
which this model has not.

The hybrid families' values go back to HF's (arch/hybrid_names.py's hf_value), gpt-oss's experts to its interleaved
stacks, Qwen3.8-Flash-Next's indexer q and k to one index_qk_proj and its n-gram table to one weight beside its
hash's buffers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..arch.families import FAMILIES
from ..arch.hybrid_names import hf_value
from ..arch.names import dense_names, optional_names
from ..config import ModelConfig
from ..errors import UserError
from .hf_names import INDEX, fused_bias, hf_names, layer_suffix, layers_prefix

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """A config.json dict that transformers loads and arch.config_from_hf reads back into `cfg`."""
    fam = FAMILIES[cfg.family]
    leading = cfg.dense_layers == tuple(range(len(cfg.dense_layers)))
    if cfg.dense_layers and not (fam.sparse_step or fam.first_dense_key and leading):
        raise UserError(f"a {cfg.family} config.json cannot express dense layers {cfg.dense_layers}")
    eos = list(cfg.eos_token_ids)
    arch, model_type = fam.hf_text_form or (fam.hf_architecture, fam.hf_model_type)
    d = {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "num_experts_per_tok": cfg.n_experts_used, "norm_topk_prob": cfg.norm_topk_prob,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        # transformers 5 reads rope_parameters; rope_theta and rope_scaling are for transformers 4.
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default", **cfg.rope},
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope or None,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "dtype": _DTYPE_NAMES[dtype],
        fam.experts_key: cfg.n_experts,
    }
    if fam.sparse_step:
        d.update(moe_intermediate_size=cfg.moe_intermediate_size,
                 intermediate_size=cfg.intermediate_size or cfg.moe_intermediate_size,
                 decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers))
    else:
        d[fam.moe_intermediate_key] = cfg.moe_intermediate_size
    d.update(fam.hf_extra)
    if fam.partial_rotary:
        d["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    if fam.blocks.attention.window:     # gpt-oss: its sliding and full layers
        d.update(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window or None)
    if fam.hybrid:          # Gated DeltaNet and gated attention, as Qwen3NextConfig and Qwen3_5MoeTextConfig read them
        d.update(layer_types=list(cfg.layer_types), linear_num_key_heads=cfg.linear_num_key_heads,
                 linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
                 linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel,
                 partial_rotary_factor=cfg.partial_rotary_factor)    # transformers 4's; 5 reads rope_parameters'
        d["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    if fam.shared_expert_key:
        d[fam.shared_expert_key] = cfg.shared_expert_intermediate_size
    if fam.shared_count_key:
        d.update(_sigmoid_config(cfg, fam))
    if cfg.hc_count:
        d.update(_qwen4_config(cfg))
    if fam.hf_mtp:
        d[fam.hf_mtp[0]] = cfg.nextn_layers
    if fam.clip_qkv_key:
        d[fam.clip_qkv_key] = cfg.clip_qkv
    if fam.hf_bias_key:      # a family without biases says so: its transformers module has none to load
        d[fam.hf_bias_key] = cfg.attn_bias and fam.attn_bias is not False
    return d


def _sigmoid_config(cfg: ModelConfig, fam) -> dict:
    """DeepSeek-V3's and GLM-4.5's keys (transformers' DeepseekV3Config and Glm4MoeConfig, and what
    arch/hf_config.py reads): the router's, the shared experts' count, the dense first layers, QK-norm and partial
    rotary; latent attention's."""
    inter = cfg.moe_intermediate_size
    if cfg.shared_expert_intermediate_size % inter:
        raise UserError(f"a {cfg.family} config.json holds shared experts of the routed experts' width {inter}, "
                        f"not {cfg.shared_expert_intermediate_size}")
    d = {fam.shared_count_key: cfg.shared_expert_intermediate_size // inter,
         fam.first_dense_key: len(cfg.dense_layers), "intermediate_size": cfg.intermediate_size or inter,
         "n_group": cfg.n_group, "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
         "scoring_func": cfg.gating, "topk_method": "noaux_tc" if cfg.gating == "sigmoid" else "greedy",
         "num_nextn_predict_layers": 0}
    if fam.qk_norm_key:
        d[fam.qk_norm_key] = cfg.qk_norm != "none"
    if fam.partial_rotary:
        d["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.kv_lora_rank:
        d.update(q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                 qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                 v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave, head_dim=cfg.qk_rope_head_dim)
    return d


def _qwen4_config(cfg: ModelConfig) -> dict:
    """Qwen3.8-Flash-Next's keys (transformers' Qwen4ExpTextConfig, and what arch/hf_config.py's _qwen4_options
    reads): hyper-connections, the PLE layer (1-based ids) and its hash, the QSA indexer (its layers spelled
    indexed_attention, as transformers 5 saves them), the DeltaNet's output gate."""
    return dict(layer_types=["linear_attention" if t == "linear_attention" else "indexed_attention"
                             for t in cfg.layer_types],
                hc_count=cfg.hc_count, hc_lowrank=cfg.hc_lowrank, ple_layer_ids=[i + 1 for i in cfg.ple_layers],
                ple_embed_dim=cfg.ple_embed_dim, ple_conv_kernel_size=cfg.ple_conv_kernel, ngram_size=cfg.ngram_size,
                heads_per_ngram=cfg.heads_per_ngram, ngram_vocab_size_base=cfg.ngram_vocab_base,
                make_ngram_vocab_size_divisible_by=cfg.ngram_vocab_divisor, seed=cfg.ngram_seed,
                indexer_n_heads=cfg.indexer_heads, indexer_kv_heads=1, indexer_head_dim=cfg.indexer_head_dim,
                indexer_budget=cfg.indexer_budget, indexer_compress_ratio=cfg.indexer_block, indexer_mode="qsa",
                output_gate_type=cfg.deltanet_gate)


def _layer_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _expert_names(cfg: ModelConfig, layer: int, e: int) -> list[str]:
    """Expert e's gate, up and down names, one tensor each, as the family's first hf_experts spelling has them."""
    mod, g, u, d = FAMILIES[cfg.family].hf_experts[0]
    return [f"{layers_prefix(cfg, layer)}{mod}.{e}.{p}.weight" for p in (g, u, d)]


def _tensors(source):
    """(HF name, tensor) for every tensor, made one at a time, layer by layer so that a shard holds whole layers."""
    cfg = source.config
    names = [n for n in dense_names(cfg) if not fused_bias(cfg, n)]
    names += [n for n in optional_names(cfg) if source.has(n)]     # an MTP head's own embedding and output head
    for layer in range(-1, cfg.n_stored_layers):
        for n in (n for n in names if _layer_of(n) == layer):
            if n == "per_layer_token_embd.weight":        # qwen4_exp: its PLE layer's n-gram embedding, whole,
                yield from _ngram_embedding(cfg, source.tensor(n))      # and its hash's buffers
            elif n.endswith("indexer.q_proj.weight"):      # qwen4_exp: q and k rows of index_qk_proj
                p = n[:-len("q_proj.weight")]
                yield (f"model.layers.{layer}.self_attn.indexer.index_qk_proj.weight",
                       torch.cat([source.tensor(n), source.tensor(p + "k_proj.weight")]))
            elif not n.endswith("indexer.k_proj.weight"):
                yield hf_names(n, cfg.family, n_layers=cfg.n_layers)[0], _hf_value(source, n)
        if layer in cfg.moe_layers and FAMILIES[cfg.family].hf_interleaved:
            yield from _interleaved_experts(source, layer)
        elif layer in cfg.expert_layers:
            for e in range(cfg.n_experts):
                yield from zip(_expert_names(cfg, layer, e), source.expert(layer, e))


def _interleaved_experts(source, layer: int):
    """A layer's experts as gpt-oss keeps them (Family.hf_interleaved): (HF name, tensor) of gate_up_proj
    (E, H, 2I), gate_up_proj_bias (E, 2I), down_proj (E, I, H) and down_proj_bias (E, H)."""
    cfg = source.config
    p = f"model.layers.{layer}.{FAMILIES[cfg.family].hf_fused[0]}."
    experts = [source.expert(layer, e) for e in range(cfg.n_experts)]
    gate = torch.stack([g for g, _, _ in experts]).transpose(1, 2)             # (E, H, I)
    up = torch.stack([u for _, u, _ in experts]).transpose(1, 2)
    yield p + "gate_up_proj", torch.stack([gate, up], dim=-1).flatten(2)    # (E, H, 2I): gate, up alternate
    b = f"blk.{layer}."
    yield p + "gate_up_proj_bias", torch.stack([source.tensor(b + "ffn_gate_exps.bias"),
                                                source.tensor(b + "ffn_up_exps.bias")], dim=-1).flatten(1)
    yield p + "down_proj", torch.stack([d for _, _, d in experts]).transpose(1, 2).contiguous()   # (E, I, H)
    yield p + "down_proj_bias", source.tensor(b + "ffn_down_exps.bias")


def _ngram_embedding(cfg: ModelConfig, table: torch.Tensor):
    """(HF name, tensor) of qwen4_exp's n-gram embedding: the table as one weight (transformers' nn.Embedding;
    its own saves split it in row shards, which HFSource reads too) and the hash's constants, which transformers
    keeps as buffers."""
    from ..arch.ngram import ngram_constants
    mult, sizes = ngram_constants(cfg)
    p = f"model.layers.{cfg.ple_layers[0]}.ple.ple_embedding."
    yield p + "ngram_embedding.weight", table
    yield p + "layer_multipliers", torch.tensor(mult, dtype=torch.long)
    yield p + "ngram_heads_offsets", torch.tensor([sum(sizes[:h]) for h in range(len(sizes))], dtype=torch.long)
    yield p + "ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long)


def _hf_value(source, name: str) -> torch.Tensor:
    """Canonical tensor `name` as HF holds it: as it is, but for the hybrid families' values (hybrid_names.hf_value),
    whose norms go back to the source's own dtype (their 1 + w is float32 whatever the file's was)."""
    t, cfg = source.tensor(name), source.config
    if not FAMILIES[cfg.family].hybrid:
        return t
    return hf_value(cfg, layer_suffix(name), t, source.dtype_of(name) if name.endswith("norm.weight") else None)


def write_hf(source, out_dir: str | os.PathLike, max_shard_bytes: int = 4 << 30, dtype: str = "auto",
             progress: bool = False) -> Path:
    """Write `source` as a Hugging Face directory (config, generation config, safetensors, tokenizer files).

    Shards are written as they fill, so at most one shard's tensors are in memory. dtype: auto keeps each
    tensor's own, else float32|bfloat16|float16.
    """
    out = Path(out_dir)
    if getattr(source, "path", None) is not None and Path(source.path).resolve() == out.resolve():
        raise UserError(f"cannot write a model over itself ({str(out)!r}); choose another output directory")
    hf_config(source.config, torch.float32)     # a config.json it cannot write is refused before anything is written
    fam = FAMILIES[source.config.family]
    if source.config.nextn_layers and not fam.hf_mtp:
        raise UserError(f"this {fam.title} model has an MTP head, which its HF form does not hold (transformers drops "
                        "mtp.*; moestream reads it from GGUF only); write it as GGUF instead")
    out.mkdir(parents=True, exist_ok=True)
    # A previous export's weights would be read together with these (a single file wins over an index).
    for stale in [out / "model.safetensors", out / INDEX, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    cfg = source.config
    cast = None if dtype == "auto" else getattr(torch, dtype)
    n_tensors = len(dense_names(cfg)) + 3 * cfg.n_experts * len(cfg.expert_layers)   # (a bar's total)
    shards: list[Path] = []                 # written so far, under temporary names
    weight_map: dict[str, int] = {}         # HF name -> shard number
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    first_dtype = None

    def flush():
        path = out / f"model-{len(shards) + 1:05d}.safetensors.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        shards.append(path)

    try:
        for hf, t in tqdm(_tensors(source), total=n_tensors, desc="writing", unit="tensor", disable=not progress):
            t = (t if cast is None or not t.is_floating_point() else t.to(cast)).contiguous()    # (hash buffers)
            first_dtype = first_dtype or t.dtype
            if shard and size + t.nbytes > max_shard_bytes:
                flush()
                shard, size = {}, 0
            shard[hf] = t
            weight_map[hf] = len(shards)
            size += t.nbytes
            total += t.nbytes
        flush()
    except BaseException:
        for path in shards:
            path.unlink(missing_ok=True)
        raise

    # Shard names say how many shards there are, which is known only now.
    if len(shards) == 1:
        shards[0].replace(out / "model.safetensors")
    else:
        final = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for path, name in zip(shards, final):
            path.replace(out / name)
        index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(cfg, first_dtype), indent=2) + "\n")
    eos = list(cfg.eos_token_ids)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if source.tokenizer is not None:
        source.tokenizer.save_hf(out)
    return out
