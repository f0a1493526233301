"""config.json -> ModelConfig, as each family's entry (arch/families.py) maps its keys; loading/hf_write.py's
hf_config writes them back.

    cfg = config_from_hf(json.load(open("config.json")), generation_config)
"""
from __future__ import annotations

from ..config import HF_KEYS, INT_FIELDS, LAYER_TYPES, ModelConfig
from ..errors import UserError
from .families import FAMILIES, family_named, option, titles


def config_from_hf(c: dict, generation_config: dict | None = None) -> ModelConfig:
    """From a Hugging Face config.json dict (transformers 4 and 5 spellings both), as its family's entry in
    arch/families.py maps it."""
    c = _text_config(c)
    arch = (c.get("architectures") or [c.get("model_type", "?")])[0]
    for name in (arch, c.get("model_type")):
        if name in REFUSED:
            raise UserError(f"{name}: {REFUSED[name]} is not supported by moestream")
    fam = family_named(arch) or family_named(c.get("model_type", ""))
    if fam is None:
        raise UserError(f"unsupported architecture {arch!r} (model_type {c.get('model_type')!r}); "
                        f"moestream runs {titles()} checkpoints")
    _check_types(c, fam.name)
    try:
        n_layers = c["num_hidden_layers"]
        hidden = c["hidden_size"]
        n_heads = c["num_attention_heads"]
        n_experts = next((c[k] for k in ("num_experts", "num_local_experts", fam.experts_key)
                         if c.get(k) is not None), None)
        if n_experts is None:
            raise KeyError(fam.experts_key)
        moe_inter = c.get(fam.moe_intermediate_key) or c["intermediate_size"]
        dense: list[int] = []
        if fam.sparse_step:
            step = c.get("decoder_sparse_step", 1) or 1
            mlp_only = set(c.get("mlp_only_layers") or [])
            dense = [i for i in range(n_layers) if i in mlp_only or not (n_experts and (i + 1) % step == 0)]
        rope = dict(c.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or c.get("rope_theta") or 10000.0
        if c.get("rope_scaling"):
            rope.update(c["rope_scaling"])
        hybrid = _hybrid_options(c, rope, arch, fam.name) if fam.hybrid else {}
        hybrid |= _sigmoid_options(c, fam, arch, moe_inter) if fam.shared_count_key else {}
        if fam.blocks.residual == "hyper":
            hybrid |= _qwen4_options(c, arch)
        if fam.partial_rotary:
            hybrid["partial_rotary_factor"] = float(rope.get("partial_rotary_factor")
                                                    or c.get("partial_rotary_factor") or fam.partial_rotary)
        if fam.first_dense_key:
            dense = list(range(min(c.get(fam.first_dense_key) or 0, n_layers)))
        if fam.blocks.attention.window:
            hybrid |= _window_options(c, arch)
        for key in ("mrope_section", "mrope_interleaved"):    # text positions are alike on all three axes:
            rope.pop(key, None)                                 # multimodal RoPE is then plain RoPE
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        rope.pop("partial_rotary_factor", None)
        eos = c.get("eos_token_id")
        if generation_config and generation_config.get("eos_token_id") is not None:
            eos = generation_config["eos_token_id"]
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        kw = dict(
            family=fam.name, vocab_size=c["vocab_size"], hidden_size=hidden, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or hidden // n_heads,
            qk_norm=fam.qk_norm if not fam.qk_norm_key or c.get(fam.qk_norm_key) else "none",
            n_experts=n_experts, n_experts_used=c["num_experts_per_tok"], moe_intermediate_size=moe_inter,
            intermediate_size=c.get("intermediate_size", 0) if dense else 0,
            shared_expert_intermediate_size=c.get(fam.shared_expert_key, 0) if fam.shared_expert_key else 0,
            dense_layers=tuple(dense), norm_topk_prob=option(fam.norm_topk_prob, c),
            attn_bias=option(fam.attn_bias, c), clip_qkv=c.get(fam.clip_qkv_key) if fam.clip_qkv_key else None,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=tuple(sorted(rope.items())),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, gating=fam.blocks.router.gating,
            nextn_layers=_nextn(c, fam),
        )
        return ModelConfig(**(kw | hybrid))
    except KeyError as e:
        raise UserError(f"config.json lacks {e.args[0]!r}: is it a complete {arch} config?") from None


# Checkpoints of a family moestream runs, but with an option it does not: architecture or model_type -> what.
REFUSED = {"DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (an indexer picks the keys)",
           "deepseek_v32": "DeepSeek-V3.2's sparse attention (an indexer picks the keys)"}
TOPK_METHODS = {"noaux_tc": "sigmoid", "greedy": "softmax"}     # DeepSeek's topk_method -> the gating it goes with


def _sigmoid_options(c: dict, fam, arch: str, moe_inter: int) -> dict:
    """DeepSeek-V3's and GLM-4.5's ModelConfig fields: the router's (scoring_func, topk_method, n_group,
    topk_group, routed_scaling_factor, the correction bias), the shared experts' width, and latent attention's
    where the config has kv_lora_rank. An option moestream does not run is a UserError naming it."""
    index = sorted(k for k in c if k.startswith("index_") and c[k] is not None)
    if index:
        raise UserError(f"{arch}: DeepSeek-V3.2's sparse attention ({index[0]}) is not supported by moestream")
    gating = c.get("scoring_func") or fam.blocks.router.gating
    method = c.get("topk_method")
    if gating not in ("softmax", "sigmoid"):
        raise UserError(f"{arch}: scoring_func {gating!r} is not supported by moestream (softmax or sigmoid)")
    if method is not None and TOPK_METHODS.get(method) != gating:
        raise UserError(f"{arch}: topk_method {method!r} with scoring_func {gating!r} is not supported by moestream "
                        f"(noaux_tc with sigmoid, greedy with softmax)")
    grouped = method != "greedy"            # greedy: plain top-k, the groups unused (transformers' DeepseekV2)
    out = dict(gating=gating, router_bias=gating == "sigmoid",
               n_group=(c.get("n_group") or 1) if grouped else 1,
               topk_group=(c.get("topk_group") or 1) if grouped else 1,
               routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
               shared_expert_intermediate_size=(c.get(fam.shared_count_key) or 0) * moe_inter)
    if c.get("kv_lora_rank"):
        if c.get("attention_bias"):
            raise UserError(f"{arch}: attention_bias=true is not supported by moestream's latent attention")
        nope, rot = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        out |= dict(q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=nope,
                    qk_rope_head_dim=rot, v_head_dim=c["v_head_dim"], head_dim=nope + rot,
                    n_kv_heads=c["num_attention_heads"], rope_interleave=bool(c.get("rope_interleave", True)))
    return out


def hf_key(family: str, field: str) -> str:
    """The config.json key a ModelConfig field is read from (`n_experts`: num_experts, Mixtral's num_local_experts)."""
    fam = FAMILIES[family]
    own = {"n_experts": fam.experts_key, "moe_intermediate_size": fam.moe_intermediate_key,
           "shared_expert_intermediate_size": fam.shared_expert_key}
    return own.get(field) or HF_KEYS.get(field, field)


def _check_types(c: dict, family: str) -> None:
    """config.json's numbers checked for type before any is used, each refused in one line naming its key."""
    fam = FAMILIES[family]
    ints = {hf_key(family, f) for f in INT_FIELDS} | {"num_experts", "num_local_experts", "intermediate_size",
                                                       "decoder_sparse_step"} | (
        {fam.shared_count_key, fam.first_dense_key} - {None})
    for key in sorted(ints):
        v = c.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise UserError(f"config.json: {key} must be a whole number, got {v!r}")
    for key in ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "routed_scaling_factor"):
        v = c.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise UserError(f"config.json: {key} must be a number, got {v!r}")
    types = c.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise UserError(f"config.json: layer_types must be a list of layer kinds ({', '.join(LAYER_TYPES)}), got "
                        f"{types!r}")
    layers = c.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(type(i) is int for i in layers)):
        raise UserError(f"config.json: mlp_only_layers must be a list of layer numbers, got {layers!r}")


def _nextn(c: dict, fam) -> int:
    """The MTP heads config.json announces (loading/hf.py keeps them only where their tensors are in the files)."""
    if not fam.hf_mtp:
        return 0
    n = c.get(fam.hf_mtp[0]) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise UserError(f"config.json: {fam.hf_mtp[0]} must be a whole number, got {n!r}")
    if n > 1:
        raise UserError(f"config.json: {fam.hf_mtp[0]} = {n}: moestream reads one MTP head of a {fam.title} model "
                        f"(as llama.cpp does); set it to 1 to use the first")
    return n


def _text_config(c: dict) -> dict:
    """config.json with its language model's keys at the top: a multimodal checkpoint (Qwen3.5-MoE's
    Qwen3_5MoeForConditionalGeneration) nests them under text_config, over top-level keys such as architectures."""
    if not isinstance(c.get("text_config"), dict):
        return c
    return {k: v for k, v in c.items() if k not in ("text_config", "vision_config")} | c["text_config"]


def _window_options(c: dict, arch: str) -> dict:
    """gpt-oss's ModelConfig fields: layer_types (sliding_attention and full_attention; transformers' default when
    absent: even layers sliding) and sliding_window; an option moestream does not run is a UserError naming it."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    window = c.get("sliding_window")
    unsupported = [(c.get("swiglu_limit", 7.0) != 7.0, f"swiglu_limit {c.get('swiglu_limit')!r} (only 7.0)"),
                   (c.get("swiglu_alpha", 1.702) != 1.702, f"swiglu_alpha {c.get('swiglu_alpha')!r} (only 1.702)"),
                   ("linear_attention" in types, "layer type 'linear_attention'"),
                   (window is not None and (type(window) is not int or window <= 0),
                    f"sliding_window {window!r} (a positive whole number)")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{arch}: {what} is not supported by moestream")
    return dict(layer_types=tuple(types), sliding_window=window or 0)


def _hybrid_options(c: dict, rope: dict, arch: str, family: str) -> dict:
    """A hybrid family's ModelConfig fields (Gated DeltaNet and gated attention) from config.json, as transformers'
    Qwen3NextConfig reads them; an option moestream does not run is a UserError naming it. Qwen3.8-Flash-Next's
    QSA layers (indexed_attention in transformers 5) are its attention layers (full_attention)."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types and family == "qwen4_exp":
        types = ["full_attention" if t == "indexed_attention" else t for t in types]
    if not types:                    # what transformers derives from full_attention_interval (default 4)
        step = c.get("full_attention_interval") or 4
        types = ["linear_attention" if (i + 1) % step else "full_attention" for i in range(n)]
    unsupported = [(c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')!r} (only silu)"),
                   (bool(c.get("attention_bias")), "attention_bias=true"),
                   (c.get("attn_output_gate", True) is False, "attn_output_gate=false")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{arch}: {what} is not supported by moestream")
    # transformers' default when a config omits it: Qwen3NextConfig 0.25; Qwen4ExpTextConfig none, so 1.0
    factor = rope.get("partial_rotary_factor") or c.get("partial_rotary_factor") or (
        1.0 if family == "qwen4_exp" else 0.25)
    return dict(layer_types=tuple(types), linear_num_key_heads=c["linear_num_key_heads"],
                linear_num_value_heads=c["linear_num_value_heads"], linear_key_head_dim=c["linear_key_head_dim"],
                linear_value_head_dim=c["linear_value_head_dim"], linear_conv_kernel=c["linear_conv_kernel_dim"],
                partial_rotary_factor=float(factor), attn_output_gate=True, zero_centred_norm=True)


def _qwen4_options(c: dict, arch: str) -> dict:
    """Qwen3.8-Flash-Next's ModelConfig fields (hyper-connections, PLE, the QSA indexer) from config.json, with
    Qwen4ExpTextConfig's defaults; an option moestream does not run is a UserError naming it."""
    qsa = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    ple = sorted(set(c.get("ple_layer_ids") or []))
    eos = c.get("eos_token_id")
    gate = c.get("output_gate_type") or c.get("hidden_act", "silu")        # transformers' default: hidden_act
    unsupported = [
        (any(c.get(k) is None for k in qsa), f"dense attention layers (no {', '.join(qsa)})"),
        (c.get("indexer_kv_heads", 1) != 1, f"indexer_kv_heads={c.get('indexer_kv_heads')} (only 1)"),
        (c.get("indexer_mode", "qsa") != "qsa", f"indexer_mode {c.get('indexer_mode')!r}"),
        (gate not in ("silu", "sigmoid"), f"output_gate_type {gate!r} (silu or sigmoid)"),
        (len(ple) > 1, f"{len(ple)} PLE layers (one, as llama.cpp)"),
        (bool(ple) and eos is None, "PLE without eos_token_id")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{arch}: {what} is not supported by moestream")
    return dict(hc_count=c.get("hc_count", 4), hc_lowrank=c.get("hc_lowrank", 320), deltanet_gate=gate,
                ple_layers=tuple(i - 1 for i in ple), ple_embed_dim=c.get("ple_embed_dim") or c["hidden_size"],
                ple_conv_kernel=c.get("ple_conv_kernel_size", 4), ngram_size=c.get("ngram_size", 3),
                heads_per_ngram=c.get("heads_per_ngram", 8),
                ngram_vocab_base=c.get("ngram_vocab_size_base", 20_000_000),
                ngram_vocab_divisor=c.get("make_ngram_vocab_size_divisible_by", 128), ngram_seed=c.get("seed", 1234),
                indexer_heads=c["indexer_n_heads"], indexer_head_dim=c["indexer_head_dim"],
                indexer_budget=c["indexer_budget"], indexer_block=c["indexer_compress_ratio"])
