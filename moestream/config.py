"""A model's config: its shape and family options, from HF or GGUF, frozen and validated where it is made (what
the engine is told is engine_config.py).

    cfg = ModelConfig.from_hf(json.load(open("config.json")))

Tensor names inside moestream are GGUF's (`blk.3.attn_q.weight`, `blk.3.ffn_gate_exps.weight`, ...), whatever
the file they came from: the names are family-independent, and a GGUF file then needs no renaming at all.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import UserError
from .models.families import FAMILIES, family_named, option, titles

ROPE_TYPES = ("default", "linear", "yarn", "llama3", "dynamic")
LAYER_TYPES = ("full_attention", "linear_attention")
# ModelConfig's whole-number fields (checked for type before anything compares them) and the config.json key each
# is read from, where it differs from the field's name (the family's own keys come from its entry).
INT_FIELDS = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
              "n_experts_used", "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
              "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel")
HF_KEYS = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "n_experts_used": "num_experts_per_tok", "linear_conv_kernel": "linear_conv_kernel_dim"}


@dataclass(frozen=True)
class ModelConfig:
    family: str                      # a key of models/families.py's FAMILIES
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
    layer_types: tuple[str, ...] = ()          # per layer, full_attention | linear_attention; () = all attention
    linear_num_key_heads: int = 0              # DeltaNet q/k heads
    linear_num_value_heads: int = 0            # DeltaNet v heads (a multiple of the q/k heads), one state each
    linear_key_head_dim: int = 0               # dk: a state is (dk, dv) per value head
    linear_value_head_dim: int = 0             # dv
    linear_conv_kernel: int = 0                # the causal depthwise conv's width; a sequence keeps kernel-1 inputs
    partial_rotary_factor: float = 1.0         # rotary on the first head_dim * factor dims of q and k
    attn_output_gate: bool = False             # q_proj also gives a per-head sigmoid gate on the attention output
    zero_centred_norm: bool = False            # HF's norm weights are w in x_normed * (1 + w); the canonical
                                               # tensors hold 1 + w, as GGUF does (models/next_names.py)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UserError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        for name in INT_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise UserError(f"model config: {name} must be a whole number, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
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
        if self.linear_layers:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel"):
                if getattr(self, name) <= 0:
                    raise UserError(f"model config: {name} must be positive, got {getattr(self, name)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise UserError(f"model config: {self.linear_num_value_heads} linear value heads are not a multiple "
                                f"of {self.linear_num_key_heads} key heads")
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
    def attention_layers(self) -> list[int]:
        """Indices of the layers with a KV cache: every layer, but the DeltaNet layers of a hybrid family."""
        linear = set(self.linear_layers)
        return [i for i in range(self.n_layers) if i not in linear]

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q/k head that rotary embeddings turn (all of them but with partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers that have routed experts."""
        return [i for i in range(self.n_layers) if i not in self.dense_layers]

    @property
    def expert_numel(self) -> int:
        """Elements of one expert: gate (I, H), up (I, H) and down (H, I), contiguous in that order."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # --- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, c: dict, generation_config: dict | None = None) -> "ModelConfig":
        """From a Hugging Face config.json dict (transformers 4 and 5 spellings both), as its family's entry in
        models/families.py maps it."""
        c = _text_config(c)
        arch = (c.get("architectures") or [c.get("model_type", "?")])[0]
        fam = family_named(arch) or family_named(c.get("model_type", ""))
        if fam is None:
            raise UserError(f"unsupported architecture {arch!r} (model_type {c.get('model_type')!r}); "
                            f"moestream runs {titles()} checkpoints")
        _check_types(c, fam.name)
        try:
            n_layers = c["num_hidden_layers"]
            hidden = c["hidden_size"]
            n_heads = c["num_attention_heads"]
            n_experts = next((c[k] for k in ("num_experts", "num_local_experts") if c.get(k) is not None), None)
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
            hybrid = _hybrid_options(c, rope, arch) if fam.hybrid else {}
            for key in ("mrope_section", "mrope_interleaved"):    # text positions are alike on all three axes:
                rope.pop(key, None)                                 # multimodal RoPE is then plain RoPE
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = {}
            rope.pop("partial_rotary_factor", None)
            eos = c.get("eos_token_id")
            if generation_config and generation_config.get("eos_token_id") is not None:
                eos = generation_config["eos_token_id"]
            eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            return cls(
                family=fam.name, vocab_size=c["vocab_size"], hidden_size=hidden, n_layers=n_layers,
                n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                head_dim=c.get("head_dim") or hidden // n_heads,
                n_experts=n_experts, n_experts_used=c["num_experts_per_tok"], moe_intermediate_size=moe_inter,
                intermediate_size=c.get("intermediate_size", 0) if dense else 0,
                shared_expert_intermediate_size=c.get(fam.shared_expert_key, 0) if fam.shared_expert_key else 0,
                dense_layers=tuple(dense), norm_topk_prob=option(fam.norm_topk_prob, c), qk_norm=fam.qk_norm,
                attn_bias=option(fam.attn_bias, c), clip_qkv=c.get(fam.clip_qkv_key) if fam.clip_qkv_key else None,
                rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                rope_scaling=tuple(sorted(rope.items())),
                max_position_embeddings=c.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, **hybrid,
            )
        except KeyError as e:
            raise UserError(f"config.json lacks {e.args[0]!r}: is it a complete {arch} config?") from None


def hf_key(family: str, field: str) -> str:
    """The config.json key a ModelConfig field is read from (`n_experts`: num_experts, Mixtral's num_local_experts)."""
    fam = FAMILIES[family]
    own = {"n_experts": fam.experts_key, "moe_intermediate_size": fam.moe_intermediate_key,
           "shared_expert_intermediate_size": fam.shared_expert_key}
    return own.get(field) or HF_KEYS.get(field, field)


def _check_types(c: dict, family: str) -> None:
    """config.json's numbers checked for type before any is used, each refused in one line naming its key."""
    ints = {hf_key(family, f) for f in INT_FIELDS} | {"num_experts", "num_local_experts", "intermediate_size",
                                                       "decoder_sparse_step"}
    for key in sorted(ints):
        v = c.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise UserError(f"config.json: {key} must be a whole number, got {v!r}")
    for key in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
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


def _text_config(c: dict) -> dict:
    """config.json with its language model's keys at the top: a multimodal checkpoint (Qwen3.5-MoE's
    Qwen3_5MoeForConditionalGeneration) nests them under text_config, over top-level keys such as architectures."""
    if not isinstance(c.get("text_config"), dict):
        return c
    return {k: v for k, v in c.items() if k not in ("text_config", "vision_config")} | c["text_config"]


def _hybrid_options(c: dict, rope: dict, arch: str) -> dict:
    """A hybrid family's ModelConfig fields (Gated DeltaNet and gated attention) from config.json, as transformers'
    Qwen3NextConfig reads them; an option moestream does not run is a UserError naming it."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if not types:                    # what transformers derives from full_attention_interval (default 4)
        step = c.get("full_attention_interval") or 4
        types = ["linear_attention" if (i + 1) % step else "full_attention" for i in range(n)]
    unsupported = [(c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')!r} (only silu)"),
                   (bool(c.get("attention_bias")), "attention_bias=true"),
                   (c.get("attn_output_gate", True) is False, "attn_output_gate=false")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{arch}: {what} is not supported by moestream")
    factor = rope.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 0.25
    return dict(layer_types=tuple(types), linear_num_key_heads=c["linear_num_key_heads"],
                linear_num_value_heads=c["linear_num_value_heads"], linear_key_head_dim=c["linear_key_head_dim"],
                linear_value_head_dim=c["linear_value_head_dim"], linear_conv_kernel=c["linear_conv_kernel_dim"],
                partial_rotary_factor=float(factor), attn_output_gate=True, zero_centred_norm=True)

