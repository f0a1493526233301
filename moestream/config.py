"""A model's config: its shape and family options, frozen and validated where it is made (what the engine is told
is engine_config.py). The family table (arch/) builds it from a file's config: arch.config_from_hf for HF's
config.json, loading/gguf_config.py for GGUF's metadata.

    cfg = config_from_hf(json.load(open("config.json")))       # moestream.arch

Tensor names inside moestream are GGUF's (`blk.3.attn_q.weight`, `blk.3.ffn_gate_exps.weight`, ...), whatever
the file they came from: the names are family-independent, and a GGUF file then needs no renaming at all.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import UserError

GATINGS = ("softmax", "sigmoid", "softmax_weight")
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "dynamic")
LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention")
# ModelConfig's whole-number fields (checked for type before anything compares them) and the config.json key each
# is read from, where it differs from the field's name (the family's own keys come from its entry).
INT_FIELDS = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
              "n_experts_used", "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
              "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window", "hc_count", "hc_lowrank",
              "ple_embed_dim", "ple_conv_kernel", "ngram_size", "heads_per_ngram", "ngram_vocab_base",
              "ngram_vocab_divisor", "ngram_seed", "indexer_heads", "indexer_head_dim", "indexer_budget",
              "indexer_block")
HF_KEYS = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "n_experts_used": "num_experts_per_tok", "linear_conv_kernel": "linear_conv_kernel_dim",
           "ple_conv_kernel": "ple_conv_kernel_size", "ngram_vocab_base": "ngram_vocab_size_base",
           "ngram_vocab_divisor": "make_ngram_vocab_size_divisible_by", "ngram_seed": "seed",
           "indexer_heads": "indexer_n_heads", "indexer_block": "indexer_compress_ratio"}


@dataclass(frozen=True)
class ModelConfig:
    family: str                      # a key of arch/families.py's FAMILIES (FAMILIES refuses another at its first lookup)
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int              # top-k
    moe_intermediate_size: int       # one routed expert's FFN width
    intermediate_size: int = 0       # dense FFN width (layers listed in dense_layers)
    shared_expert_intermediate_size: int = 0   # qwen2_moe: shared expert with a sigmoid gate
    dense_layers: tuple[int, ...] = ()         # layers with a dense MLP instead of experts
    norm_topk_prob: bool = False
    qk_norm: str = "none"            # none | head (qwen3: per head) | full (olmoe: over all heads)
    attn_bias: bool = False          # q/k/v biases (qwen2_moe)
    clip_qkv: float | None = None    # olmoe
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] = ()   # the HF dict as sorted items (hashable)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # --- hybrid families (qwen3_next, qwen3_5_moe): Gated DeltaNet layers between gated attention layers ---------
    layer_types: tuple[str, ...] = ()          # per layer, full_attention | linear_attention | sliding_attention;
                                               # () = all full attention
    linear_num_key_heads: int = 0              # DeltaNet q/k heads
    linear_num_value_heads: int = 0            # DeltaNet v heads (a multiple of the q/k heads), one state each
    linear_key_head_dim: int = 0               # dk: a state is (dk, dv) per value head
    linear_value_head_dim: int = 0             # dv
    linear_conv_kernel: int = 0                # the causal depthwise conv's width; a sequence keeps kernel-1 inputs
    partial_rotary_factor: float = 1.0         # rotary on the first head_dim * factor dims of q and k
    attn_output_gate: bool = False             # q_proj also gives a per-head sigmoid gate on the attention output
    zero_centred_norm: bool = False            # HF's norm weights are w in x_normed * (1 + w); the canonical
                                               # tensors hold 1 + w, as GGUF does (arch/hybrid_names.py)
    deltanet_gate: str = "silu"                 # the DeltaNet output norm's gate: silu, or sigmoid (qwen4_exp's)
    # --- the router's options (models/router.py; DeepSeek-V3, GLM-4.5, gpt-oss) -----------------------------------
    gating: str = "softmax"                    # softmax | sigmoid: the scores of every expert; softmax_weight: a
                                               # softmax over the chosen k logits (gpt-oss)
    router_bias: bool = False                  # a per-expert correction bias (exp_probs_b) added for the choice only
    n_group: int = 1                           # experts in n_group groups; top-k within the best topk_group of them
    topk_group: int = 1                        # (a group's score: the sum of its two best biased scores)
    routed_scaling_factor: float = 1.0         # a factor on the routed experts' weights
    # --- multi-head latent attention (models/mla.py; DeepSeek-V2/V3, Kimi K2): kv_lora_rank 0 = none -------------
    q_lora_rank: int = 0                       # q through a low-rank q_a -> norm -> q_b (0: one attn_q)
    kv_lora_rank: int = 0                      # the latent each token caches (and its rotary key)
    qk_nope_head_dim: int = 0                  # a q/k head's dims without rotary (head_dim = nope + rope)
    qk_rope_head_dim: int = 0                  # its rotary dims, the key's shared by every head
    v_head_dim: int = 0                        # a value head's dims
    rope_interleave: bool = False              # rotary on adjacent pairs (DeepSeek's, llama.cpp's NORM), not halves
    # --- sliding-window attention (gpt-oss) ---------------------------------------------------------------------
    sliding_window: int = 0                    # sliding_attention layers attend their last this many positions
    # --- qwen4_exp: hyper-connections, the PLE n-gram table, QSA attention (models/residual.py, ple.py, qsa.py) ---
    hc_count: int = 0                          # residual streams (0: one plain stream)
    hc_lowrank: int = 0                        # rank of each stream mixer's down/up projections
    ple_layers: tuple[int, ...] = ()           # layers (0-based) that add the n-gram embedding (HF: 1-based ids)
    ple_embed_dim: int = 0                     # an n-gram embedding, all heads' rows concatenated
    ple_conv_kernel: int = 0                   # the PLE's dilated depthwise conv (dilation ngram_size)
    ngram_size: int = 3                        # 2- .. ngram_size-grams
    heads_per_ngram: int = 0                   # hashed heads per n-gram order, one table row each
    ngram_vocab_base: int = 0                  # each head's row count is a prime above this
    ngram_vocab_divisor: int = 128             # the table's rows padded to a multiple of this
    ngram_seed: int = 1234                     # the hash multipliers' seed
    indexer_heads: int = 0                     # QSA indexer query heads (one key head); 0: dense attention
    indexer_head_dim: int = 0
    indexer_budget: int = 0                    # tokens of complete blocks a query attends at most
    indexer_block: int = 0                     # consecutive keys pooled into one indexer block
    # --- multi-token prediction (models/mtp.py): heads the checkpoint ships, loaded as blocks after the trunk ------
    nextn_layers: int = 0                      # MTP heads: layer n_layers + k is head k (GGUF nextn_predict_layers)

    def __post_init__(self):
        for name in INT_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise UserError(f"model config: {name} must be a whole number, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "routed_scaling_factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise UserError(f"model config: {name} must be a number, got {v!r}")
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
                     "n_experts_used", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise UserError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"model config: {self.n_heads} heads are not a multiple of {self.n_kv_heads} KV heads")
        if self.n_experts_used > self.n_experts:
            raise UserError(f"model config: top-k {self.n_experts_used} > {self.n_experts} experts")
        if self.qk_norm not in ("none", "head", "full"):
            raise UserError(f"model config: qk_norm must be none, head or full, got {self.qk_norm!r}")
        if self.rope_type not in ROPE_TYPES:
            raise UserError(f"unsupported rope_scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if any(not 0 <= i < self.n_layers for i in self.dense_layers):
            raise UserError(f"model config: dense layer index out of range: {self.dense_layers}")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise UserError(f"model config: {len(self.layer_types)} layer_types for {self.n_layers} layers")
            odd = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if odd:
                raise UserError(f"unsupported layer type {odd[0]!r}; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
                raise UserError("unsupported layer type 'sliding_attention' without a positive sliding_window "
                                f"(got {self.sliding_window}); set the config's sliding_window")
        if self.linear_layers:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel"):
                if getattr(self, name) <= 0:
                    raise UserError(f"model config: {name} must be positive, got {getattr(self, name)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise UserError(f"model config: {self.linear_num_value_heads} linear value heads are not a multiple "
                                f"of {self.linear_num_key_heads} key heads")
        if self.gating not in GATINGS:
            raise UserError(f"unsupported expert gating {self.gating!r}; supported: {', '.join(GATINGS)}")
        if self.n_group < 1 or self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise UserError(f"model config: {self.n_experts} experts in n_group {self.n_group} groups with "
                            f"topk_group {self.topk_group} make no router")
        if self.n_group > 1 and (self.n_experts // self.n_group < 2
                                 or self.topk_group * (self.n_experts // self.n_group) < self.n_experts_used):
            raise UserError(f"model config: topk_group {self.topk_group} of n_group {self.n_group} groups hold fewer "
                            f"than top-k {self.n_experts_used} experts (or groups of one expert)")
        if self.kv_lora_rank and (self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim
                                  or min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) <= 0
                                  or self.n_kv_heads != self.n_heads):
            raise UserError(f"model config: latent attention needs positive qk_nope_head_dim, qk_rope_head_dim and "
                            f"v_head_dim with head_dim their q/k sum and as many KV heads as heads, got "
                            f"{self.qk_nope_head_dim}, {self.qk_rope_head_dim}, {self.v_head_dim}, {self.head_dim}")
        if self.deltanet_gate not in ("silu", "sigmoid"):
            raise UserError(f"model config: DeltaNet output gate {self.deltanet_gate!r} is not silu or sigmoid")
        if self.indexer_heads and (self.indexer_block <= 0 or self.indexer_budget % self.indexer_block
                                   or self.rotary_dim > self.indexer_head_dim):
            raise UserError(f"model config: indexer budget {self.indexer_budget} is not a multiple of its block "
                            f"{self.indexer_block}, or rotary width {self.rotary_dim} > indexer head "
                            f"{self.indexer_head_dim}")
        if self.ple_layers and (self.hc_count <= 1 or self.heads_per_ngram <= 0 or self.ple_embed_dim
                                % ((self.ngram_size - 1) * self.heads_per_ngram)):
            raise UserError(f"model config: ple_embed_dim {self.ple_embed_dim} is not a multiple of the "
                            f"{(self.ngram_size - 1) * self.heads_per_ngram} n-gram heads (or no hyper-connections)")
        if not isinstance(self.nextn_layers, int) or self.nextn_layers < 0:
            raise UserError(f"model config: nextn_layers must be a whole number >= 0, got {self.nextn_layers!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise UserError(f"model config: partial_rotary_factor {self.partial_rotary_factor} gives an odd or empty "
                            f"rotary width of head_dim {self.head_dim}")

    # --- derived -------------------------------------------------------------------------------------------
    @property
    def rope(self) -> dict:
        return dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        r = self.rope
        return r.get("rope_type", r.get("type", "default")) if r else "default"

    @property
    def linear_layers(self) -> list[int]:
        """Indices of the Gated DeltaNet layers (a conv window and a recurrent state per sequence, no KV)."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def sliding_layers(self) -> list[int]:
        """Indices of the attention layers that attend only their last sliding_window positions."""
        return [i for i, t in enumerate(self.layer_types) if t == "sliding_attention"]

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the layers with a KV cache: every layer, but the DeltaNet layers of a hybrid family."""
        linear = set(self.linear_layers)
        return [i for i in range(self.n_layers) if i not in linear]

    @property
    def rotary_dim(self) -> int:
        """The dims of each q/k head that rotary embeddings turn: the leading ones (all of them but with partial
        rotary), or latent attention's qk_rope_head_dim (its last)."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers that have routed experts."""
        return [i for i in range(self.n_layers) if i not in self.dense_layers]

    @property
    def head_layers(self) -> list[int]:
        """Indices of the MTP heads' blocks, after the trunk's: a head is layer n_layers + k of the expert store
        and the KV cache (a full attention layer with routed experts), never run by the trunk's forward."""
        return list(range(self.n_layers, self.n_layers + self.nextn_layers))

    @property
    def expert_layers(self) -> list[int]:
        """Every layer with routed experts in the store: the trunk's MoE layers, then the heads'."""
        return self.moe_layers + self.head_layers

    @property
    def n_stored_layers(self) -> int:
        """Layers of the per-layer tables (expert store, residency, routing counts): the trunk's and the heads'."""
        return self.n_layers + self.nextn_layers

    @property
    def expert_numel(self) -> int:
        """Elements of one expert: gate (I, H), up (I, H) and down (H, I), contiguous in that order."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)
