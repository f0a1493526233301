"""The model families moestream runs, one entry each, in the spirit of llama.cpp's llama-arch.cpp.

    fam = family_named("MixtralForCausalLM")      # FAMILIES["mixtral"]; None for an architecture we do not run
    fam.gguf_arch                                 # None: mixtral has no GGUF form here yet
    fam.hf_router                                 # HF spellings of blk.N.ffn_gate_inp.weight, the written one first

An entry holds everything that differs by family: the names Hugging Face and GGUF give it, how its config.json
maps onto ModelConfig (read by arch/hf_config.py, written by loading/hf_write.py), its HF tensor spellings, its
layer options and the blocks its decoder is built from (arch/blocks.py: attention kind, mixer, router, expert MLP,
residual, each with options). The readers and writers of each format are generic over this table, and the
canonical tensor names (arch/names.py) are the same for every family; a new family is an entry here, plus the
blocks (models/) or block options whose math is new. GGUF's metadata keys (`{arch}.block_count`,
`{arch}.expert_count`, ...) are llama.cpp's generic ones, the same under every architecture, so an entry names only
its architecture.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from .blocks import GPT_OSS, GQA_SIGMOID, HYBRID, MLA, MOE, QWEN4, Blocks

# (module, gate, up, down): one expert's three projections stored one tensor each, at
# `model.layers.N.{module}.{e}.{proj}.weight`.
ExpertSpelling = tuple[str, str, str, str]


@dataclass(frozen=True)
class Family:
    name: str                        # moestream's, ModelConfig.family
    title: str                       # as people write it, in messages
    # --- Hugging Face names ----------------------------------------------------------------------------------
    hf_architecture: str             # config.json `architectures[0]`
    hf_model_type: str               # config.json `model_type`
    hf_aliases: tuple[str, ...]      # other names either key may hold
    # --- config.json <-> ModelConfig -------------------------------------------------------------------------
    experts_key: str                 # the key the expert count is written under (num_experts or num_local_experts
                                     # are both read)
    moe_intermediate_key: str        # one routed expert's width; reading falls back to intermediate_size
    sparse_step: bool                # dense-MLP layers through decoder_sparse_step and mlp_only_layers
    norm_topk_prob: bool | str       # True: always normalized; a key: read from it (default False)
    attn_bias: bool | str            # True / False: q/k/v biases always / never; a key: read from it (default False)
    hf_bias_key: str | None          # the key attn_bias is written under (None: not written)
    shared_expert_key: str | None    # the shared expert's width (None: no shared expert)
    clip_qkv_key: str | None         # the q/k/v clamp (None: never clamped)
    hf_extra: tuple[tuple[str, object], ...]   # constants config.json carries for transformers
    # --- layer options -----------------------------------------------------------------------------------
    qk_norm: str                     # none | head (RMSNorm per head) | full (over the whole projection)
    # --- GGUF --------------------------------------------------------------------------------------------
    gguf_arch: str | None            # general.architecture; None: no GGUF form (export is refused)
    gguf_norm_topk: bool             # expert_weights_norm where the file lacks the key (llama.cpp's default)
    # --- HF tensor spellings, after `model.layers.N.`; the first of each is the one write_hf uses ------------
    hf_router: tuple[str, ...]                   # blk.N.ffn_gate_inp.weight
    hf_experts: tuple[ExpertSpelling, ...]       # experts one tensor per expert and projection
    hf_fused: tuple[str, ...]                    # modules holding gate_up_proj (E, 2I, H) and down_proj (E, H, I),
                                                 # as transformers 5 holds experts in memory
    # --- the blocks its decoder is built from, with their options (arch/blocks.py) ---------------------------
    blocks: Blocks = field(default_factory=Blocks)
    # --- hybrid families ------------------------------------------------------------------------------------
    hf_text_prefixes: tuple[str, ...] = ("model.",)   # where the language model's tensors are (Qwen3.5-MoE's
                                     # multimodal checkpoints: model.language_model.), the written one first
    hf_text_form: tuple[str, str] = ()   # (architecture, model_type) write_hf writes instead of hf_architecture's:
                                     # Qwen3.5-MoE's text-only form (its multimodal one needs a vision tower)
    gguf_renames: tuple[tuple[str, str], ...] = ()    # (canonical, GGUF) layer suffixes where llama.cpp's
                                     # architecture spells a tensor otherwise (qwen3next: post_attention_norm)
    gguf_split_qkvz: bool = False    # GGUF holds ssm_in as attn_qkv + attn_gate (arch/hybrid_names.py split_qkvz)
    gguf_tiled_v: bool = False       # GGUF holds the DeltaNet's value heads tiled, not grouped by key head
                                     # (llama.cpp's qwen35moe: arch/hybrid_names.py reorder_v_heads)
    gguf_rope_sections: tuple[int, ...] = ()   # rope.dimension_sections to write (qwen35moe's loader requires them)
    # --- DeepSeek-V3 and GLM-4.5 -----------------------------------------------------------------------------
    hf_renames: tuple[tuple[str, str], ...] = ()      # (canonical, HF) layer suffixes this family spells otherwise
    shared_count_key: str | None = None   # the shared experts' count (n_shared_experts), each moe_intermediate wide
    first_dense_key: str | None = None    # the leading dense layers' count (first_k_dense_replace)
    qk_norm_key: str | None = None        # a config key that turns qk_norm on (GLM-4.5's use_qk_norm; None: fixed)
    partial_rotary: float | None = None   # the rotary fraction of a head where config.json does not say (None: 1)
    gguf_split_kv_b: bool = False         # GGUF holds MLA's attn_kv_b as attn_k_b + attn_v_b (llama.cpp's deepseek2)
    # --- gpt-oss -------------------------------------------------------------------------------------------------
    hf_interleaved: bool = False     # hf_fused experts as gpt-oss keeps them: gate_up_proj (E, H, 2I) with gate and
                                     # up in alternate columns, down_proj (E, I, H), and gate_up_proj_bias (E, 2I)
                                     # (alternate too) and down_proj_bias (E, H) beside them; OpenAI's packed MXFP4
                                     # gate_up_proj_blocks (E, 2I, H / 32, 16) has gate and up in alternate rows
    # --- multi-token prediction heads (models/mtp.py) ---------------------------------------------------------
    hf_mtp: tuple[str, str] = ()     # (config.json key of the head count, HF prefix of the heads' tensors: head k's
                                     # block at `{prefix}layers.{k}.`, its own tensors HF_NEXTN; or AFTER_TRUNK: head
                                     # k is the trunk's layer n_layers + k, its own tensors HF_NEXTN_LAYER beside its
                                     # block's); (): none read
    gguf_mtp: bool = False           # an MTP head read from GGUF only (transformers drops its `mtp.*`): Qwen3.8-
                                     # Flash-Next's, applied per hyper-connection stream (models/mtp.py)

    @property
    def hybrid(self) -> bool:
        """Gated DeltaNet layers between gated attention layers (layer_types, linear_* keys): a HybridCache, and
        hybrid_names' tensors."""
        return self.blocks.hybrid


# Canonical name -> HF name of the tensors outside the layers, spelled alike by every family.
HF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# Canonical per-layer suffix -> HF suffix after `model.layers.N.`, spelled alike by every family; the router's and
# the experts' spellings differ by family and are in its entry.
HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # gpt-oss: the o_proj bias, each head's sink logit, the router's bias (its experts' biases: HFSource)
    "attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.router.bias",
    # Gated DeltaNet (qwen3_next: ssm_in and ssm_ba, fused and grouped by key head; qwen3_5_moe: the split ones).
    # Canonical values differ from HF's in ssm_a (-exp(A_log)) and the norms (1 + w): see arch/hybrid_names.py.
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight", "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    # DeepSeek-V3's and GLM-4.5's router bias; multi-head latent attention (models/mla.py)
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
}

# A multi-token prediction head's own tensors (canonical, GGUF's `blk.{n_layers}.nextn.*`) -> HF's after the
# family's hf_mtp prefix (Qwen3-Next's and Qwen3.5-MoE's `mtp.`, as vLLM and llama.cpp's converter read them).
# An MTP head's own tensors beside its decoder layer (models/mtp.py), in every family that ships one: canonical names
# (after `blk.{n}.`), and their HF spellings below.
NEXTN = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")
# Qwen3.8-Flash-Next's head (GGUF only, llama.cpp b11549's qwen4exp): hnorm per stream (hc*H,), and an output mixer
# (nextn.hc_head_*, no inject) in place of shared_head_norm
NEXTN_HYPER = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.hc_head_norm.weight",
               "nextn.hc_head_down.weight", "nextn.hc_head_up.weight")
HF_NEXTN = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
            "nextn.hnorm.weight": "pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight"}

# Family.hf_mtp's place of DeepSeek-V3's and GLM-4.5's heads: `model.layers.{n_layers + k}.` (as vLLM's deepseek_mtp
# and glm4_moe_mtp and llama.cpp's converter read them), the head's own tensors beside its block's: eh_proj, enorm,
# hnorm, shared_head.norm, and where a checkpoint ships them its own embedding and output head (copies of the
# trunk's in the published ones; llama.cpp takes the trunk's where they are absent).
AFTER_TRUNK = "after the trunk"
HF_NEXTN_LAYER = {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
                  "nextn.hnorm.weight": "hnorm.weight", "nextn.shared_head_norm.weight": "shared_head.norm.weight",
                  "nextn.embed_tokens.weight": "embed_tokens.weight",
                  "nextn.shared_head_head.weight": "shared_head.head.weight"}

_QWEN_EXPERTS: tuple[ExpertSpelling, ...] = (("mlp.experts", "gate_proj", "up_proj", "down_proj"),)
# DeepSeek's and GLM-4.5's shared experts (one MLP n_shared_experts x moe_intermediate_size wide) and the router's
# correction bias.
_SHARED_EXPERTS = (("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"),
                   ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"),
                   ("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"))
# llama.cpp's hybrid architectures (qwen3next, qwen35moe) call the FFN's norm post_attention_norm.
_POST_ATTENTION_NORM = (("ffn_norm.weight", "post_attention_norm.weight"),)

class FamilyTable(dict):
    """name -> Family; a name not in the table is a UserError listing the table (a ModelConfig made by hand with
    another family fails at its first lookup: loading, naming its tensors, building its decoder)."""

    def __missing__(self, name):
        raise UserError(f"unsupported model family {name!r}; supported: {', '.join(self)}")


FAMILIES: dict[str, Family] = FamilyTable({f.name: f for f in (
    # Per-head QK-norm; dense layers where mlp_only_layers / decoder_sparse_step say.
    Family("qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3_moe", ("qwen3moe",),
           experts_key="num_experts", moe_intermediate_key="moe_intermediate_size", sparse_step=True,
           norm_topk_prob="norm_topk_prob", attn_bias="attention_bias", hf_bias_key="attention_bias",
           shared_expert_key=None, clip_qkv_key=None, hf_extra=(("use_sliding_window", False),),
           qk_norm="head",
           # llama.cpp normalizes qwen3moe's top-k weights (Qwen3-30B-A3B ships norm_topk_prob=true).
           gguf_arch="qwen3moe", gguf_norm_topk=True,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=MOE),
    # q/k/v biases always, and a shared expert behind a sigmoid gate.
    Family("qwen2_moe", "Qwen2-MoE", "Qwen2MoeForCausalLM", "qwen2_moe", ("qwen2moe",),
           experts_key="num_experts", moe_intermediate_key="moe_intermediate_size", sparse_step=True,
           norm_topk_prob="norm_topk_prob", attn_bias=True, hf_bias_key="qkv_bias",
           shared_expert_key="shared_expert_intermediate_size", clip_qkv_key=None,
           hf_extra=(("use_sliding_window", False),),
           qk_norm="none",
           gguf_arch="qwen2moe", gguf_norm_topk=False,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=MOE),
    # None of the options: top-k weights always normalized. Checkpoints keep the original block_sparse_moe names.
    Family("mixtral", "Mixtral", "MixtralForCausalLM", "mixtral", (),
           experts_key="num_local_experts", moe_intermediate_key="intermediate_size", sparse_step=False,
           norm_topk_prob=True, attn_bias="attention_bias", hf_bias_key=None,
           shared_expert_key=None, clip_qkv_key=None, hf_extra=(("sliding_window", None),),
           qk_norm="none",
           gguf_arch=None, gguf_norm_topk=False,
           hf_router=("block_sparse_moe.gate.weight", "mlp.gate.weight"),
           hf_experts=(("block_sparse_moe.experts", "w1", "w3", "w2"), ("mlp.experts", "w1", "w3", "w2")),
           hf_fused=("mlp.experts", "block_sparse_moe.experts"), blocks=MOE),
    # QK-norm over the whole projection, and optional clipping of q/k/v.
    Family("olmoe", "OLMoE", "OlmoeForCausalLM", "olmoe", (),
           experts_key="num_experts", moe_intermediate_key="intermediate_size", sparse_step=False,
           norm_topk_prob="norm_topk_prob", attn_bias=False, hf_bias_key="attention_bias",
           shared_expert_key=None, clip_qkv_key="clip_qkv", hf_extra=(),
           qk_norm="full",
           gguf_arch="olmoe", gguf_norm_topk=False,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=MOE),
    # Hybrid: Gated DeltaNet layers (fused in_proj_qkvz / in_proj_ba) and gated attention (q with a sigmoid gate,
    # per-head zero-centred QK-norm, partial rotary); 512 experts, softmax top-10, a sigmoid-gated shared expert.
    # llama.cpp's architecture qwen3next (the ssm.* keys, full_attention_interval, rope.dimension_count: rotary_dim)
    # calls ffn_norm post_attention_norm and splits ssm_in into attn_qkv and attn_gate.
    Family("qwen3_next", "Qwen3-Next", "Qwen3NextForCausalLM", "qwen3_next", ("qwen3next",),
           experts_key="num_experts", moe_intermediate_key="moe_intermediate_size", sparse_step=True,
           norm_topk_prob="norm_topk_prob", attn_bias=False, hf_bias_key="attention_bias",
           shared_expert_key="shared_expert_intermediate_size", clip_qkv_key=None, hf_extra=(),
           qk_norm="head",
           gguf_arch="qwen3next", gguf_norm_topk=True,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=HYBRID,
           gguf_renames=_POST_ATTENTION_NORM, gguf_split_qkvz=True, hf_mtp=("mtp_num_hidden_layers", "mtp.")),
    # Qwen3-Next's math with split DeltaNet projections, top-k always renormalised, every layer MoE; config.json
    # nests the text model's keys under text_config (the text-only form transformers saves is qwen3_5_moe_text).
    # llama.cpp's architecture qwen35moe has qwen3next's keys and names, the split projections as they are, the
    # value heads tiled (arch/hybrid_names.py), and rope.dimension_sections: multimodal RoPE's, which text's
    # positions (alike on every axis) make plain RoPE; its converter's default, as every checkpoint ships them.
    Family("qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
           ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "qwen35moe"),
           experts_key="num_experts", moe_intermediate_key="moe_intermediate_size", sparse_step=False,
           norm_topk_prob=True, attn_bias=False, hf_bias_key="attention_bias",
           shared_expert_key="shared_expert_intermediate_size", clip_qkv_key=None, hf_extra=(),
           qk_norm="head",
           gguf_arch="qwen35moe", gguf_norm_topk=True,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=HYBRID,
           hf_text_prefixes=("model.language_model.", "model."),
           hf_text_form=("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
           gguf_renames=_POST_ATTENTION_NORM, gguf_tiled_v=True,
           gguf_rope_sections=(11, 11, 10, 0), hf_mtp=("mtp_num_hidden_layers", "mtp.")),
    # GQA with q/k/v biases (attention_bias), optional per-head QK-norm (use_qk_norm), rotary on the first half of
    # each head (NEOX), the sigmoid router with a correction bias (one group), shared experts always on, dense
    # first layers (first_k_dense_replace). llama.cpp's glm4moe spells ffn_norm post_attention_norm. Its MTP head
    # (num_nextn_predict_layers) is the layer after the trunk's (AFTER_TRUNK).
    Family("glm4_moe", "GLM-4.5", "Glm4MoeForCausalLM", "glm4_moe", ("glm4moe",),
           experts_key="n_routed_experts", moe_intermediate_key="moe_intermediate_size", sparse_step=False,
           norm_topk_prob="norm_topk_prob", attn_bias="attention_bias", hf_bias_key="attention_bias",
           shared_expert_key=None, clip_qkv_key=None, hf_extra=(),
           qk_norm="head",
           gguf_arch="glm4moe", gguf_norm_topk=False,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=GQA_SIGMOID,
           gguf_renames=_POST_ATTENTION_NORM, hf_renames=_SHARED_EXPERTS, shared_count_key="n_shared_experts",
           first_dense_key="first_k_dense_replace", qk_norm_key="use_qk_norm", partial_rotary=0.5,
           hf_mtp=("num_nextn_predict_layers", AFTER_TRUNK)),
    # Multi-head latent attention (models/mla.py: q_lora_rank, kv_lora_rank, a latent KV cache), rotary on adjacent
    # pairs (rope_interleave), the sigmoid router with a correction bias in n_group groups (scoring_func,
    # topk_method noaux_tc), shared experts always on, dense first layers. Kimi K2 is this architecture with 384
    # experts. llama.cpp's deepseek2 holds kv_b as attn_k_b and attn_v_b (older files: one attn_kv_b). Its MTP head
    # (num_nextn_predict_layers; Kimi K2 ships none) is the layer after the trunk's (AFTER_TRUNK).
    Family("deepseek_v3", "DeepSeek-V3", "DeepseekV3ForCausalLM", "deepseek_v3", ("kimi_k2",),
           experts_key="n_routed_experts", moe_intermediate_key="moe_intermediate_size", sparse_step=False,
           norm_topk_prob="norm_topk_prob", attn_bias=False, hf_bias_key="attention_bias",
           shared_expert_key=None, clip_qkv_key=None, hf_extra=(),
           qk_norm="none",
           gguf_arch="deepseek2", gguf_norm_topk=False,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=MLA,
           hf_renames=_SHARED_EXPERTS, shared_count_key="n_shared_experts", first_dense_key="first_k_dense_replace",
           gguf_split_kv_b=True, hf_mtp=("num_nextn_predict_layers", AFTER_TRUNK)),
    # Sliding-window (layer_types, sliding_window) and full attention layers, a sink logit per head, q/k/v/o biases,
    # YaRN; a biased router whose softmax is over the chosen k; experts of clamped SwiGLU with biases, fused in HF
    # with gate and up interleaved (arch/blocks.py's GPT_OSS). llama.cpp's gpt-oss calls ffn_norm
    # post_attention_norm. config.json's intermediate_size is the experts' width.
    Family("gpt_oss", "gpt-oss", "GptOssForCausalLM", "gpt_oss", ("gpt-oss",),
           experts_key="num_local_experts", moe_intermediate_key="intermediate_size", sparse_step=False,
           norm_topk_prob=False, attn_bias="attention_bias", hf_bias_key="attention_bias",
           shared_expert_key=None, clip_qkv_key=None, hf_extra=(("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)),
           qk_norm="none",
           gguf_arch="gpt-oss", gguf_norm_topk=False,
           hf_router=("mlp.router.weight",), hf_experts=(), hf_fused=("mlp.experts",), blocks=GPT_OSS,
           gguf_renames=_POST_ATTENTION_NORM, hf_interleaved=True),
    # Qwen3.8-Flash-Next: Qwen3.5-MoE's DeltaNet and experts, QSA attention (an indexer over pooled key blocks),
    # hyper-connections (hc residual streams, no layer norms, an output mixer for the output norm) and a PLE
    # n-gram table. config.json says indexed_attention (transformers 5) or full_attention (the checkpoints) for
    # its QSA layers; arch/hf_config.py's _qwen4_options reads its keys. llama.cpp's qwen4exp holds the value heads
    # tiled, as qwen35moe does (loading/gguf.py).
    Family("qwen4_exp", "Qwen3.8-Flash-Next", "Qwen4ExpForConditionalGeneration", "qwen4_exp",
           ("Qwen4ExpForCausalLM", "qwen4_exp_text", "qwen4exp"),
           experts_key="num_experts", moe_intermediate_key="moe_intermediate_size", sparse_step=False,
           norm_topk_prob="norm_topk_prob", attn_bias=False, hf_bias_key="attention_bias",
           shared_expert_key="shared_expert_intermediate_size", clip_qkv_key=None, hf_extra=(),
           qk_norm="head",
           gguf_arch="qwen4exp", gguf_norm_topk=True, gguf_tiled_v=True,
           hf_router=("mlp.gate.weight",), hf_experts=_QWEN_EXPERTS, hf_fused=("mlp.experts",), blocks=QWEN4,
           hf_text_prefixes=("model.language_model.", "model."),
           hf_text_form=("Qwen4ExpForCausalLM", "qwen4_exp_text"), gguf_mtp=True),
)})

# config.json's `architectures[0]` or `model_type` -> family.
_BY_HF_NAME = {n: f for f in FAMILIES.values() for n in (f.hf_architecture, f.hf_model_type, *f.hf_aliases)}
# GGUF general.architecture -> family, for the families that have a GGUF form.
BY_GGUF_ARCH = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch}


def family_named(hf_name: str) -> Family | None:
    """The family an HF architecture or model_type names; None for one moestream does not run."""
    return _BY_HF_NAME.get(hf_name)


def titles() -> str:
    """The families as people write them, for messages: "Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE"."""
    t = [f.title for f in FAMILIES.values()]
    return ", ".join(t[:-1]) + " and " + t[-1] if len(t) > 1 else t[0]


def option(spec: bool | str, hf: dict) -> bool:
    """A yes/no option of a family: fixed (a bool), or read from config.json's key `spec` (default no)."""
    return spec if isinstance(spec, bool) else bool(hf.get(spec, False))


def first_own(own: tuple, every: list[tuple]) -> list:
    """A family's spellings first, then every other family's, each once: a checkpoint may spell a tensor as
    another family does, and its own spelling wins where both are present."""
    return list(dict.fromkeys([*own, *(s for spellings in every for s in spellings)]))
