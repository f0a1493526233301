"""The canonical tensor names, GGUF's, which every loader reads by and the model is built from.

    dense_names(cfg)                        # ["token_embd.weight", "output_norm.weight", "output.weight", ...]
    canonical_shape(cfg, "blk.0.attn_q.weight")   # (nh*hd, H)

Names (prefix `blk.{i}.` for layer i), shapes in torch order (out_features, in_features):
    token_embd.weight (V, H)   output_norm.weight (H,)   output.weight (V, H)  [absent when tied]
    attn_norm.weight (H,)      attn_q.weight (nh*hd, H)  attn_k.weight / attn_v.weight (nkv*hd, H)
    attn_output.weight (H, nh*hd)
    attn_q.bias / attn_k.bias / attn_v.bias             [qwen2_moe, gpt-oss]
    attn_output.bias (H,)   attn_sinks.weight (nh,)     [gpt-oss: the o bias (with the q/k/v ones), sinks]
    attn_q_norm.weight / attn_k_norm.weight (hd,)       [qwen3_moe: per head]  (nh*hd,) / (nkv*hd,) [olmoe]
    ffn_norm.weight (H,)
    MoE layers:   ffn_gate_inp.weight (E, H)   experts through a source's expert(), stacked in GGUF as
                  ffn_gate_exps / ffn_up_exps (E, I, H) and ffn_down_exps (E, H, I)
                  ffn_gate_shexp.weight / ffn_up_shexp.weight (Is, H), ffn_down_shexp.weight (H, Is),
                  ffn_gate_inp_shexp.weight (1, H)     [qwen2_moe shared expert and its sigmoid gate]
                  ffn_gate_inp.bias (E,), ffn_gate_exps.bias / ffn_up_exps.bias (E, I), ffn_down_exps.bias (E, H)
                                                       [gpt-oss: the router's and the experts' biases, kept with
                                                        the dense tensors on the device, indexed by expert id]
    dense layers: ffn_gate.weight / ffn_up.weight (I, H), ffn_down.weight (H, I)
    hybrid families (qwen3_next, qwen3_5_moe): the names and values of arch/hybrid_names.py; attention layers'
                  attn_q.weight is (nh*2hd, H) (q and its output gate), and DeltaNet layers have ssm_* instead
    qwen4_exp:    no attn_norm / ffn_norm / output_norm; hc_{attn,ffn}_{norm,down,up,inject} and output_hc_* (the
                  stream mixers), ple_* on its PLE layer and per_layer_token_embd (the n-gram table), indexer.* on
                  its attention layers

The names are family-independent: a family's options (moestream.arch.families) say which of them it has.
`gguf_tensors(cfg)` lists a GGUF file's tensors in the order moestream writes them, with the shapes the file holds.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

from ..config import INT_FIELDS, ModelConfig
from ..errors import UserError
from .families import FAMILIES, NEXTN
from .ngram import table_rows

# A MoE layer's experts stacked (E, ., .): gate, up, down, in the order an expert's buffer holds them.
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
EXPERT_SUFFIXES = tuple(f"{s}.weight" for s in EXPERT_STACKS)
# Tensors kept in float32 whatever the model's dtype: the DeltaNet's decay rate -exp(A_log), which transformers
# computes in float32 from A_log at every forward (a bfloat16 copy would move every decay).
FLOAT32 = ("ssm_a",)


# An MTP head's own embedding and output head (DeepSeek-V3's and GLM-4.5's checkpoints ship them, copies of the
# trunk's): read where a file has them (optional_names), else the head uses the trunk's (models/mtp.py).
NEXTN_OWN = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")

# Tables read by row, which stay in host memory whatever the placement (models/ple.py's PLETable, the n-gram
# embeddings): the loader never puts them on the device and they count in no device budget.
HOST_TABLES = ("per_layer_token_embd.weight",)


def keeps_float32(name: str) -> bool:
    """Whether the engine keeps this canonical tensor in float32 (FLOAT32) rather than the model's dtype; and the
    router's correction bias (exp_probs_b), which transformers keeps in float32 and adds to float32 scores."""
    return name.rsplit(".", 1)[-1] in FLOAT32 or name.endswith("exp_probs_b.bias")


def attention_names(cfg: ModelConfig) -> list[str]:
    """A GQA or latent-attention layer's attention tensors (suffixes after `blk.N.`), its norm first."""
    if cfg.kv_lora_rank:          # multi-head latent attention (models/mla.py)
        q = ["attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"] if cfg.q_lora_rank else ["attn_q.weight"]
        return ["attn_norm.weight", *q, "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_kv_b.weight",
                "attn_output.weight"]
    attention = FAMILIES[cfg.family].blocks.attention
    names = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"]
    if cfg.attn_bias:
        names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if attention.out_bias:
            names.append("attn_output.bias")
    if attention.sinks:
        names.append("attn_sinks.weight")
    if cfg.qk_norm != "none":
        names += ["attn_q_norm.weight", "attn_k_norm.weight"]
    return names


def dense_names(cfg: ModelConfig) -> list[str]:
    """Every non-expert tensor a model of this config has, in canonical names."""
    if FAMILIES[cfg.family].hybrid:     # DeltaNet and gated attention layers: arch/hybrid_names.py names them
        from .hybrid_names import hybrid_names
        return [n for n in hybrid_names(cfg) if not n.endswith(EXPERT_SUFFIXES)]
    blocks = FAMILIES[cfg.family].blocks
    names = ["token_embd.weight", "output_norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("output.weight")
    for i in range(cfg.n_stored_layers):       # the trunk's layers, then the MTP heads' (cfg.head_layers)
        p = f"blk.{i}."
        names += [p + n for n in NEXTN] if i >= cfg.n_layers else []
        names += [p + n for n in (*attention_names(cfg), "ffn_norm.weight")]
        if i in cfg.dense_layers:
            names += [p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight"]
        else:
            names.append(p + "ffn_gate_inp.weight")
            if cfg.router_bias:
                names.append(p + "exp_probs_b.bias")
            if blocks.router.linear_bias:
                names.append(p + "ffn_gate_inp.bias")
            if blocks.experts.bias:
                names += [p + f"{s}.bias" for s in EXPERT_STACKS]
            if cfg.shared_expert_intermediate_size:
                names += [p + n for n in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")]
                if FAMILIES[cfg.family].blocks.shared_gate:
                    names.append(p + "ffn_gate_inp_shexp.weight")
    return names


def optional_names(cfg: ModelConfig) -> list[str]:
    """Tensors a model of this config may have, read and written where a file holds them: the MTP heads' own
    embedding and output head (NEXTN_OWN)."""
    return [f"blk.{i}.{n}" for i in cfg.head_layers for n in NEXTN_OWN]


def canonical_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The torch shape of a canonical tensor (a non-expert one, or a layer's expert stack), from the config alone."""
    H, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    inter, shexp = cfg.intermediate_size, cfg.shared_expert_intermediate_size
    nv, lk = cfg.linear_num_value_heads, cfg.linear_num_key_heads * cfg.linear_key_head_dim     # DeltaNet
    lv = nv * cfg.linear_value_head_dim
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    r, qr, dn, dr, dv = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    shapes = {
        "token_embd.weight": (V, H), "output.weight": (V, H), "output_norm.weight": (H,),
        "attn_norm.weight": (H,), "ffn_norm.weight": (H,),
        # with an output gate, q_proj holds each head's q then its gate
        "attn_q.weight": (2 * q if cfg.attn_output_gate else q, H), "attn_k.weight": (kv, H),
        "attn_v.weight": (kv, H), "attn_output.weight": (H, cfg.n_heads * cfg.v_head_dim if r else q),
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
        "attn_output.bias": (H,), "attn_sinks.weight": (cfg.n_heads,), "ffn_gate_inp.bias": (cfg.n_experts,),
        "ffn_gate_exps.bias": (cfg.n_experts, cfg.moe_intermediate_size),
        "ffn_up_exps.bias": (cfg.n_experts, cfg.moe_intermediate_size), "ffn_down_exps.bias": (cfg.n_experts, H),
        "attn_q_norm.weight": (hd,) if cfg.qk_norm == "head" else (q,),
        "attn_k_norm.weight": (hd,) if cfg.qk_norm == "head" else (kv,),
        "ffn_gate_inp.weight": (cfg.n_experts, H),
        "ffn_gate_exps.weight": (cfg.n_experts, cfg.moe_intermediate_size, H),
        "ffn_up_exps.weight": (cfg.n_experts, cfg.moe_intermediate_size, H),
        "ffn_down_exps.weight": (cfg.n_experts, H, cfg.moe_intermediate_size),
        "ffn_gate_shexp.weight": (shexp, H), "ffn_up_shexp.weight": (shexp, H), "ffn_down_shexp.weight": (H, shexp),
        "ffn_gate_inp_shexp.weight": (1, H),
        "ffn_gate.weight": (inter, H), "ffn_up.weight": (inter, H), "ffn_down.weight": (H, inter),
        # Gated DeltaNet (models/deltanet.py): q, k (lk each), v (lv) and z (lv); the conv runs over q|k|v
        "ssm_in.weight": (2 * lk + 2 * lv, H), "ssm_ba.weight": (2 * nv, H),
        "attn_qkv.weight": (2 * lk + lv, H), "attn_gate.weight": (lv, H),
        "ssm_beta.weight": (nv, H), "ssm_alpha.weight": (nv, H),
        "ssm_conv1d.weight": (2 * lk + lv, cfg.linear_conv_kernel), "ssm_dt.bias": (nv,), "ssm_a": (nv,),
        "ssm_norm.weight": (cfg.linear_value_head_dim,), "ssm_out.weight": (H, lv),
        "exp_probs_b.bias": (cfg.n_experts,),
        # multi-head latent attention: q (nh*(dn+dr), .) through a rank-qr bottleneck or not; the latent r and
        # the shared rotary key dr; kv_b (nh*(dn+dv), r), or in GGUF attn_k_b (nh, r, dn) and attn_v_b (nh, dv, r)
        "attn_q_a.weight": (qr, H), "attn_q_a_norm.weight": (qr,), "attn_q_b.weight": (q, qr),
        "attn_kv_a_mqa.weight": (r + dr, H), "attn_kv_a_norm.weight": (r,),
        "attn_kv_b.weight": (cfg.n_heads * (dn + dv), r),
        "attn_k_b.weight": (cfg.n_heads, r, dn), "attn_v_b.weight": (cfg.n_heads, dv, r),
        # an MTP head (models/mtp.py): [enorm(embedding) | hnorm(hidden)] -> H, and its norms
        "nextn.eh_proj.weight": (H, 2 * H), "nextn.enorm.weight": (H,), "nextn.hnorm.weight": (H,),
        "nextn.shared_head_norm.weight": (H,), "nextn.embed_tokens.weight": (V, H),
        "nextn.shared_head_head.weight": (V, H),
    }
    if cfg.hc_count:                    # qwen4_exp (arch/hybrid_names.py): hyper-connections, PLE, the indexer
        hc, r, ple = cfg.hc_count * H, cfg.hc_lowrank, cfg.ple_embed_dim
        ihd = cfg.indexer_head_dim
        heads = max(1, (cfg.ngram_size - 1) * cfg.heads_per_ngram)
        for p in ("hc_attn", "hc_ffn", "output_hc"):
            shapes |= {f"{p}_norm.weight": (hc,), f"{p}_down.weight": (r, hc), f"{p}_up.weight": (hc, r),
                       f"{p}_inject.weight": (cfg.hc_count, hc)}
        shapes |= {"ple_key.weight": (hc, ple), "ple_value.weight": (H, ple), "ple_norm_key.weight": (hc,),
                   "ple_norm_query.weight": (hc,), "ple_norm_conv.weight": (hc,),
                   "ple_conv1d.weight": (hc, cfg.ple_conv_kernel),
                   "indexer.q_proj.weight": (cfg.indexer_heads * ihd, H), "indexer.k_proj.weight": (ihd, H),
                   "indexer.q_norm.weight": (ihd,), "indexer.k_norm.weight": (ihd,),
                   # the MTP head's (models/mtp.py): hnorm per stream, and its output mixer
                   "nextn.hnorm.weight": (hc,), "nextn.hc_head_norm.weight": (hc,),
                   "nextn.hc_head_down.weight": (r, hc), "nextn.hc_head_up.weight": (hc, r)}
        if cfg.ple_layers:              # rows: the hash's (models/ple.py NGramHash), padded
            shapes["per_layer_token_embd.weight"] = (table_rows(cfg), ple // heads)
    return shapes[base]


def check_shape(cfg: ModelConfig, name: str, shape, *, tensor: str, key: Callable[[str], str], hint: str,
                want: tuple[int, ...] | None = None) -> None:
    """One line (UserError) where a file's tensor is not the shape its config makes: `name` canonical, `shape` the
    file's (torch order; read from a header, no data), `tensor` its name in the file, key(field) a config field's
    key in the file's own words, `want` the shape when it is not canonical_shape's (a fused stack). The line names
    the keys that make the first dimension that differs: what a user edits, or finds wrong in a download."""
    want = tuple(canonical_shape(cfg, name) if want is None else want)
    shape = tuple(int(d) for d in shape)
    if shape == want:
        return
    dim = next((i for i, (a, b) in enumerate(zip(shape, want)) if a != b), None)
    fields = _fields_of_dim(cfg, name, dim) if dim is not None else []
    made = [f"{key(f)} {getattr(cfg, f)}" for f in fields]
    made = ", ".join(made[:-1]) + " and " + made[-1] if len(made) > 1 else made[0] if made else "the config"
    raise UserError(f"tensor {tensor} has shape {shape} but {made} make{'s' if len(fields) < 2 else ''} it "
                    f"{want}: {hint}")


def _fields_of_dim(cfg: ModelConfig, name: str, dim: int) -> list[str]:
    """The config's whole-number fields that dimension `dim` of canonical_shape(cfg, name) depends on, found by
    moving each by one (on a copy that skips validation) rather than by a second table of the shapes' formulas."""
    base, out = canonical_shape(cfg, name), []
    for f in INT_FIELDS:
        moved = copy.copy(cfg)
        object.__setattr__(moved, f, getattr(cfg, f) + 1)
        if canonical_shape(moved, name)[dim] != base[dim]:
            out.append(f)
    return out


def dense_numel(cfg: ModelConfig) -> int:
    """Elements of every non-expert tensor on the device (whatever --cpu-moe says): all but the host tables."""
    return sum(math.prod(canonical_shape(cfg, n)) for n in dense_names(cfg) if n not in HOST_TABLES)


def gguf_name(cfg: ModelConfig, name: str) -> str:
    """A canonical name as the family's GGUF architecture spells it (the same but for its gguf_renames)."""
    if name.startswith("blk."):
        _, layer, suffix = name.split(".", 2)
        for canonical, spelled in FAMILIES[cfg.family].gguf_renames:
            if suffix == canonical:
                return f"blk.{layer}.{spelled}"
    return name


def gguf_tensors(cfg: ModelConfig, optional: list[str] = ()) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch shape) of every tensor of the model's GGUF file in file order: the globals, then each layer
    with its expert stacks; `optional`: the optional_names the file holds too, in their layers. The shared expert's gate is (H,), as llama.cpp stores it. Names are canonical (the file
    spells them gguf_name(cfg, name)), but for qwen3next's ssm_in, written as the attn_qkv and attn_gate it holds, and
    deepseek2's attn_kv_b, written as attn_k_b and attn_v_b (arch/mla_names.py)."""
    E, inter, H = cfg.n_experts, cfg.moe_intermediate_size, cfg.hidden_size
    names = dense_names(cfg) + list(optional)
    if FAMILIES[cfg.family].gguf_split_qkvz:     # llama.cpp's qwen3next: ssm_in as attn_qkv + attn_gate
        names = [m for n in names for m in ((n.replace("ssm_in", "attn_qkv"), n.replace("ssm_in", "attn_gate"))
                                             if n.endswith(".ssm_in.weight") else (n,))]
    if FAMILIES[cfg.family].gguf_split_kv_b:     # llama.cpp's deepseek2: attn_kv_b as attn_k_b + attn_v_b
        names = [m for n in names for m in ((n.replace("attn_kv_b", "attn_k_b"), n.replace("attn_kv_b", "attn_v_b"))
                                             if n.endswith(".attn_kv_b.weight") else (n,))]

    def shape(name):
        s = canonical_shape(cfg, name)
        return s[1:] if name.endswith("ffn_gate_inp_shexp.weight") else s

    plan = [(n, shape(n)) for n in names if not n.startswith("blk.")]
    for i in range(cfg.n_stored_layers):
        plan += [(n, shape(n)) for n in names if n.startswith(f"blk.{i}.")]
        if i in cfg.expert_layers:
            plan += [(f"blk.{i}.ffn_gate_exps.weight", (E, inter, H)), (f"blk.{i}.ffn_up_exps.weight", (E, inter, H)),
                     (f"blk.{i}.ffn_down_exps.weight", (E, H, inter))]
    return plan
