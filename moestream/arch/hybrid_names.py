"""Canonical tensors of the hybrid families (Qwen3-Next, Qwen3.5-MoE): their names, a Hugging Face state dict
turned into them, and back.

    w = canonical_from_hf(cfg, model.state_dict())     # {"blk.0.ssm_in.weight": ..., "blk.3.attn_q.weight": ...}
    hybrid_names(cfg)                                  # every name a model of cfg has (experts as GGUF stacks)
    hf_value(cfg, "ssm_a", w["blk.0.ssm_a"])           # linear_attn.A_log: canonical_value's inverse (write_hf's)

Names are llama.cpp's (gguf.constants, MODEL_ARCH.QWEN3NEXT / QWEN35MOE), values are what the math takes. After
`model.layers.N.` (Qwen3.5-MoE's multimodal checkpoints: `model.language_model.layers.N.`):

    HF                                   canonical             value
    input_layernorm.weight               attn_norm.weight      1 + w (HF's norms are zero-centred: x_n * (1 + w))
    post_attention_layernorm.weight      ffn_norm.weight       1 + w (llama.cpp: post_attention_norm)
    linear_attn.in_proj_qkvz.weight      ssm_in.weight         as HF: q, k, v, z grouped by key head (qwen3_next)
    linear_attn.in_proj_ba.weight        ssm_ba.weight         as HF: b, a grouped by key head (qwen3_next)
    linear_attn.in_proj_qkv.weight       attn_qkv.weight       as HF (qwen3_5_moe)
    linear_attn.in_proj_z.weight         attn_gate.weight      as HF (qwen3_5_moe)
    linear_attn.in_proj_b / in_proj_a    ssm_beta / ssm_alpha  as HF (qwen3_5_moe)
    linear_attn.conv1d.weight (C,1,K)    ssm_conv1d.weight     (C, K)
    linear_attn.dt_bias                  ssm_dt.bias           as HF
    linear_attn.A_log                    ssm_a                 -exp(A_log), float32 (the decay rate g's factor)
    linear_attn.norm.weight              ssm_norm.weight       as HF (a plain RMSNorm weight)
    linear_attn.out_proj.weight          ssm_out.weight        as HF
    self_attn.q_proj.weight              attn_q.weight         as HF: [q_h | gate_h] per head, (nh * 2hd, H)
    self_attn.{k,v,o}_proj.weight        attn_{k,v,output}.weight
    self_attn.{q,k}_norm.weight          attn_{q,k}_norm.weight  1 + w
    mlp.gate.weight, mlp.shared_expert.*, mlp.shared_expert_gate.weight: as the other Qwen families
    mlp.experts (fused gate_up_proj / down_proj, or per expert) -> ffn_{gate,up,down}_exps.weight stacks (E, ., .)
    model.norm.weight -> output_norm.weight (1 + w); embed_tokens, lm_head as every family.

1 + w and -exp(A_log) are what transformers computes from HF's values in float32 at every forward, and what
llama.cpp's converter stores, so both sources give the same numbers (norms and ssm_a stay float32). GGUF differs
from this in two places: llama.cpp's qwen3next converter writes ssm_in as attn_qkv + attn_gate with the heads
ungrouped (split_qkvz / fuse_qkvz below: loading/gguf.py fuses them back, gguf_write.py splits), and its qwen35moe
converter reorders the value heads from grouped by key head (v head h*r + j is key head h's j-th of r) to tiled
(j*nk + h), in attn_qkv's v rows, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, the conv's v channels and
ssm_out's columns (reorder_v_heads below: loading/gguf.py groups them back, gguf_write.py tiles). An MTP head
(HF's mtp.*: mtp.fc, mtp.pre_fc_norm_embedding / _hidden, mtp.layers.0.*, mtp.norm; in a GGUF the block past
block_count - nextn_predict_layers, blk.{n_layers}.nextn.eh_proj / enorm / hnorm / shared_head_norm beside the
block's own) is layer n_layers (models/mtp.py), its norms 1 + w too. The vision tower is not read.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .families import FAMILIES, HF_LAYER, NEXTN, NEXTN_HYPER

_ZERO_CENTRED = ("attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                 "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")
_ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
              "attn_k_norm.weight")
_DELTANET = {"qwen3_next": ("ssm_in.weight", "ssm_ba.weight"),
             "qwen3_5_moe": ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight"),
             "qwen4_exp": ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")}
# Qwen3.8-Flash-Next (qwen4_exp), llama.cpp's qwen4exp names: a mixer of the streams before each block in place of
# its norm, the PLE layer's tensors, the QSA indexer's; index_qk_proj split into q_proj (heads) and k_proj.
_HYPER = tuple(f"hc_{b}_{t}.weight" for b in ("attn", "ffn") for t in ("norm", "down", "up", "inject"))
_PLE = ("ple_key.weight", "ple_value.weight", "ple_norm_key.weight", "ple_norm_query.weight",
        "ple_norm_conv.weight", "ple_conv1d.weight")
_INDEXER = ("indexer.q_proj.weight", "indexer.k_proj.weight", "indexer.q_norm.weight", "indexer.k_norm.weight")
QWEN4_HF = {**{f"hc_{b}_{t}.weight": f"{m}_hyper_connection.{h}.weight" for b, m in (("attn", "attn"), ("ffn", "mlp"))
               for t, h in (("norm", "hc_norm"), ("down", "input_mix_weight_down"), ("up", "input_mix_weight_up"),
                            ("inject", "block_inject_weight"))},
            "ple_key.weight": "ple.key_proj.weight", "ple_value.weight": "ple.value_proj.weight",
            "ple_norm_key.weight": "ple.norm_key.weight", "ple_norm_query.weight": "ple.norm_query.weight",
            "ple_norm_conv.weight": "ple.norm_conv.weight", "ple_conv1d.weight": "ple.conv1d.weight",
            "indexer.q_norm.weight": "self_attn.indexer.q_layernorm.weight",
            "indexer.k_norm.weight": "self_attn.indexer.k_layernorm.weight"}
QWEN4_GLOBAL = {"output_hc_norm.weight": "hyper_connection_mixer.hc_norm.weight",
                "output_hc_down.weight": "hyper_connection_mixer.input_mix_weight_down.weight",
                "output_hc_up.weight": "hyper_connection_mixer.input_mix_weight_up.weight"}
_ZERO_CENTRED_QWEN4 = ("hc_attn_norm.weight", "hc_ffn_norm.weight", "output_hc_norm.weight", "ple_norm_key.weight",
                       "ple_norm_query.weight", "ple_norm_conv.weight", "indexer.q_norm.weight",
                       "indexer.k_norm.weight")
_DELTANET_COMMON = ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight", "ssm_out.weight")
_SHARED = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")


def layer_names(cfg: ModelConfig, i: int) -> list[str]:
    """Layer i's canonical tensor suffixes (after `blk.i.`); i >= n_layers: an MTP head's (cfg.head_layers)."""
    names = list(_HYPER) if cfg.hc_count else ["attn_norm.weight", "ffn_norm.weight"]
    names += list(NEXTN_HYPER if cfg.hc_count else NEXTN) if i >= cfg.n_layers else []
    if i in cfg.ple_layers:
        names += list(_PLE)
    if i in cfg.linear_layers:
        names += [*_DELTANET[cfg.family], *_DELTANET_COMMON]
    else:
        names += list(_ATTENTION) + (list(_INDEXER) if cfg.indexer_heads else [])
    if i in cfg.dense_layers:
        names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    else:
        names += ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
        if cfg.shared_expert_intermediate_size:
            names += list(_SHARED)
    return names


def hybrid_names(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor of a hybrid model, the experts as GGUF's (E, ., .) stacks."""
    names = ["token_embd.weight"] + (list(QWEN4_GLOBAL) if cfg.hc_count else ["output_norm.weight"])
    names += ([] if cfg.tie_word_embeddings else ["output.weight"])
    names += ["per_layer_token_embd.weight"] if cfg.ple_layers else []
    return names + [f"blk.{i}.{n}" for i in range(cfg.n_stored_layers) for n in layer_names(cfg, i)]


def canonical_value(cfg: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """An HF tensor's value as the canonical tensor `name` (a layer's suffix, or a global name) holds it; other
    families' tensors, and the rest of these, as they are."""
    if cfg.zero_centred_norm and (name in _ZERO_CENTRED or name in _ZERO_CENTRED_QWEN4
                                  or name == "output_norm.weight"):
        return 1.0 + t.float()
    if name == "ssm_a":
        return -t.float().exp()
    if name in ("ssm_conv1d.weight", "ple_conv1d.weight"):
        return t.reshape(t.shape[0], -1)
    return t


def hf_value(cfg: ModelConfig, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """canonical_value's inverse: the HF tensor whose canonical value (`name`: a layer's suffix or a global name) is
    `t`, so that reading it back gives t's bits. dtype: the norms' (1 + w is float32 whatever w was; None: t's).

    A norm's w = c - 1 is exact for every c >= 0.5 (Sterbenz; w >= -0.5), and so is 1 + w read back; below 0.5,
    c - 1 rounds and c comes back within 2**-25. A_log is log(-a) moved by up to two float32 steps to one whose -exp
    gives a back as canonical_value computes it (torch's float32 exp, on this machine's CPU): exact for every a that
    came from a float32 A_log; an a that none gives (none seen in tests) stays log(-a), whose -exp is within a few
    ulp of a."""
    if cfg.zero_centred_norm and (name in _ZERO_CENTRED or name in _ZERO_CENTRED_QWEN4
                                  or name == "output_norm.weight"):
        return (t.float() - 1.0).to(dtype or t.dtype)
    if name == "ssm_a":
        return _a_log(t.float())
    if name in ("ssm_conv1d.weight", "ple_conv1d.weight"):
        return t.unsqueeze(1)                    # (C, 1, K): nn.Conv1d's depthwise weight
    return t


def _a_log(a: torch.Tensor) -> torch.Tensor:
    """A float32 x with -exp(x) == a, searched from log(-a) outwards (closest first); log(-a) where none is found."""
    x = (-a.double()).log().float()
    best, found = x, (-x.exp()).eq(a)
    down = up = x
    for _ in range(2):
        down, up = torch.nextafter(down, down - 1), torch.nextafter(up, up + 1)
        for c in (down, up):
            hit = (-c.exp()).eq(a) & ~found
            best, found = torch.where(hit, c, best), found | hit
    return best


def canonical_from_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF state dict (either config.json form's spelling, experts fused or per expert) -> canonical tensors."""
    fam = FAMILIES[cfg.family]
    prefix = next((p for p in fam.hf_text_prefixes if p + "embed_tokens.weight" in sd), None)
    if prefix is None:
        raise KeyError(f"no embed_tokens.weight under {fam.hf_text_prefixes}")
    out = {"token_embd.weight": sd[prefix + "embed_tokens.weight"]}
    if cfg.hc_count:
        out |= {n: canonical_value(cfg, n, sd[prefix + hf]) for n, hf in QWEN4_GLOBAL.items()}
    else:
        out["output_norm.weight"] = canonical_value(cfg, "output_norm.weight", sd[prefix + "norm.weight"])
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    hf_of = dict(HF_LAYER, **QWEN4_HF, **{"ffn_gate_inp.weight": fam.hf_router[0]})
    for i in range(cfg.n_layers):
        p = f"{prefix}layers.{i}."
        if i in cfg.ple_layers:
            out["per_layer_token_embd.weight"] = _ple_table(sd, p + "ple.ple_embedding.ngram_embedding.")
        if cfg.indexer_heads and i not in cfg.linear_layers:
            q, k = sd[p + "self_attn.indexer.index_qk_proj.weight"].split(
                [cfg.indexer_heads * cfg.indexer_head_dim, cfg.indexer_head_dim])
            out[f"blk.{i}.indexer.q_proj.weight"], out[f"blk.{i}.indexer.k_proj.weight"] = q, k
        for name in layer_names(cfg, i):
            if name in hf_of:
                out[f"blk.{i}.{name}"] = canonical_value(cfg, name, sd[p + hf_of[name]])
        if i in cfg.dense_layers:
            continue
        mod, g, u, d = fam.hf_experts[0]
        fused = sd.get(f"{p}{fam.hf_fused[0]}.gate_up_proj")
        if fused is not None:                   # transformers 5: (E, 2I, H) gate then up, and (E, H, I)
            gate, up = fused.chunk(2, dim=1)
            down = sd[f"{p}{fam.hf_fused[0]}.down_proj"]
        else:
            gate, up, down = (torch.stack([sd[f"{p}{mod}.{e}.{proj}.weight"] for e in range(cfg.n_experts)])
                              for proj in (g, u, d))
        out[f"blk.{i}.ffn_gate_exps.weight"] = gate.contiguous()
        out[f"blk.{i}.ffn_up_exps.weight"] = up.contiguous()
        out[f"blk.{i}.ffn_down_exps.weight"] = down
    return out


def _ple_table(sd: dict, prefix: str) -> torch.Tensor:
    """The PLE n-gram table: `{prefix}weight`, or its row shards `{prefix}shard_0.weight` .. in order, concatenated
    (transformers saves it split_ngram_parts ways)."""
    if prefix + "weight" in sd:
        return sd[prefix + "weight"]
    shards = sorted((int(k[len(prefix) + 6:-7]), k) for k in sd if k.startswith(prefix + "shard_"))
    return torch.cat([sd[k] for _, k in shards])


# --- llama.cpp's qwen3next form of ssm_in: its converter writes in_proj_qkvz as attn_qkv (q of every key head, then
# k, then v: the conv's channel order) and attn_gate (z), and keeps ssm_ba as HF has it. Rows only move.
def _qkvz_parts(cfg: ModelConfig) -> tuple[int, int, list[int]]:
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    rv = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim      # one key head's v (and z) rows
    return nk, dk, [dk, dk, rv, rv]


def split_qkvz(cfg: ModelConfig, ssm_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ssm_in (2K + 2V, H), [q_h k_h v_h z_h] per key head h -> attn_qkv (2K + V, H), attn_gate (V, H)."""
    nk, _, parts = _qkvz_parts(cfg)
    q, k, v, z = ssm_in.reshape(nk, sum(parts), -1).split(parts, dim=1)         # (nk, part, H) each
    flat = [t.reshape(-1, ssm_in.shape[-1]) for t in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def fuse_qkvz(cfg: ModelConfig, qkv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """split_qkvz's inverse: attn_qkv (2K + V, H) and attn_gate (V, H) -> ssm_in (2K + 2V, H)."""
    nk, dk, parts = _qkvz_parts(cfg)
    H = qkv.shape[-1]
    q, k, v = qkv.split([nk * dk, nk * dk, nk * parts[2]])
    heads = [t.reshape(nk, -1, H) for t in (q, k, v, gate)]                     # (nk, part, H) each
    return torch.cat(heads, dim=1).reshape(-1, H)


# --- llama.cpp's qwen35moe order of the DeltaNet's value heads: tiled, so that ggml broadcasts the q/k heads over
# them (key head h serves value heads h, h + nk, h + 2nk, ...) where HF groups them (h*r .. h*r + r-1).
# Canonical suffix -> (dim, index of the first value head's first row or column, one head's width).
def _v_heads(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    qk, dv = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {"attn_qkv.weight": (0, qk, dv), "ssm_conv1d.weight": (0, qk, dv), "attn_gate.weight": (0, 0, dv),
            "ssm_out.weight": (1, 0, dv), "ssm_beta.weight": (0, 0, 1), "ssm_alpha.weight": (0, 0, 1),
            "ssm_a": (0, 0, 1), "ssm_dt.bias": (0, 0, 1)}


def reorder_v_heads(cfg: ModelConfig, name: str, t: torch.Tensor, tiled: bool) -> torch.Tensor:
    """Canonical tensor `name` (a layer's suffix or `blk.N.` name) with its value heads turned from grouped by key
    head to tiled (tiled=True: what a qwen35moe file holds) or back (tiled=False); other tensors as they are.
    Only rows or columns move, so the values are the same bits."""
    spec = _v_heads(cfg).get(name.split(".", 2)[2] if name.startswith("blk.") else name)
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if spec is None or nk == nv:
        return t
    dim, start, width = spec
    heads = t.narrow(dim, start, t.shape[dim] - start)
    now = (nk, nv // nk) if tiled else (nv // nk, nk)           # the two head axes in the order they are now
    moved = heads.reshape(*t.shape[:dim], *now, width, *t.shape[dim + 1:]).transpose(dim, dim + 1)
    return torch.cat([t.narrow(dim, 0, start), moved.reshape(heads.shape)], dim=dim)
