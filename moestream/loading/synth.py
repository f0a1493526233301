"""Synthetic models: deterministic random weights of real shapes, made in memory tensor by tensor.

    src = SynthSource.from_spec("tiny")                          # CPU-sized qwen3_moe with a synth tokenizer
    src = SynthSource.from_spec("qwen3-30b-a3b:layers=4:seed=1")  # Qwen3-30B-A3B shapes, 4 layers
    src = SynthSource.from_spec("tiny-next")                     # CPU-sized qwen3_next: DeltaNet and attention
    src = SynthSource.from_spec("qwen3-next-80b-a3b:layers=8")   # Qwen3-Next-80B-A3B shapes, 8 layers
    src = SynthSource.from_spec("deepseek-v3:layers=4")          # DeepSeek-V3 shapes: 1 dense, 3 MoE layers
    src = SynthSource.from_spec("glm-4.5-air:layers=4")          # GLM-4.5-Air shapes; tiny-deepseek, tiny-glm
    src = SynthSource.from_spec("gpt-oss-120b:layers=4")         # gpt-oss-120b shapes (MXFP4 experts), 4 layers
    src = SynthSource.from_spec("qwen3.8-flash-next:layers=8")   # Qwen3.8-Flash-Next shapes; tiny-flash-next
    src.tensor("blk.0.attn_q.weight")                            # (nh*hd, H), made on demand

Options after the preset name, each `:key=value`: layers=N, seed=N, dtype=float32|bfloat16|float16,
experts=float|mxfp4 (the experts' type; float but for gpt-oss-20b and gpt-oss-120b), mtp=1 (an MTP head after the
trunk, for --spec-type draft-mtp: the families that have one, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3, GLM-4.5,
Qwen3.8-Flash-Next). The seed is 0
but for tiny-next's, 6: with seed 0 its first greedy token after the README's prompt ("Once upon a time") ends the
text, so that the demo printed nothing; seed 6 writes 32 tokens there.

Every tensor comes from its own generator seeded with crc32 of (seed, its canonical name), and every expert with
crc32 of (seed, layer, expert), so a tensor does not depend on which others were made before it: a loader may read them
in any order, or only some of them, and still get the same model. Weights are normal(0, fan_in**-0.5) drawn in
float32 and then cast; norm weights are 1 + 0.1 * normal, so that a model
which ignored its norm weights would not pass a test by luck.

Hybrid presets (Qwen3-Next) place their attention layers every `full_attention_interval` layers (the last of each
group), for any layers=N, as the checkpoints' config.json does. Their canonical tensors are what the math takes:
norms hold 1 + w already, and the DeltaNet decay rate ssm_a = -exp(A_log) is drawn negative, A_log uniform in
[-2, 0.5] (float32, as the engine keeps it).

gpt-oss presets (tiny-gptoss, gpt-oss-20b, gpt-oss-120b) alternate sliding-window and full layers (even layers
slide, as the checkpoints' layer_types), with sinks, biases and YaRN as their config.json. gpt-oss-20b's and
-120b's experts are MXFP4, as the published checkpoints' are (tiny-gptoss's float; experts=mxfp4 makes them MXFP4).

MXFP4 experts (experts=mxfp4) are ggml's blocks drawn as bench/make_reference_gptoss_gguf.py draws them (uniform
codes, E[w**2] = 1 / fan_in: quant/mxfp4.py's random_mxfp4), from the expert's generator; `expert_bytes` hands
them out (the store keeps them MXFP4) and `expert` their values, float32.

Qwen3.8-Flash-Next's n-gram table (per_layer_token_embd: 320M rows of 160 at its real shapes, 102 GB in BF16) is
never made whole to be read: `rows` hands out a table whose rows are made when gathered, each value a hash of
(seed, row, column) turned into a uniform of the same scale as the other weights (SynthRows).
"""
from __future__ import annotations

import zlib

import torch
from gguf import GGMLQuantizationType as Q

from ..config import ModelConfig
from ..errors import UserError
from ..arch.names import HOST_TABLES, canonical_shape, dense_names, keeps_float32
from ..quant.mxfp4 import random_mxfp4

TINY_VOCAB = 1024          # text.tokenizer.synth_tokenizer()'s size (from_spec takes the tokenizer's own)

PRESETS: dict[str, dict] = {
    # The demo and test model: small enough for a laptop CPU, shaped like Qwen3-MoE (per-head q/k norms, GQA).
    "tiny": dict(
        family="qwen3_moe", vocab_size=TINY_VOCAB, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2,
        head_dim=32, n_experts=16, n_experts_used=4, moe_intermediate_size=128, norm_topk_prob=True,
        qk_norm="head", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
    ),
    # Qwen3-30B-A3B's real shapes; like bench/make_reference_gguf.py's model it has no tokenizer, bos or eos.
    "qwen3-30b-a3b": dict(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=32, n_kv_heads=4,
        head_dim=128, n_experts=128, n_experts_used=8, moe_intermediate_size=768, norm_topk_prob=True,
        qk_norm="head", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
    ),
    # A CPU-sized Qwen3-Next: Gated DeltaNet layers and gated attention every second layer, a shared expert.
    "tiny-next": dict(
        family="qwen3_next", vocab_size=TINY_VOCAB, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2,
        head_dim=32, n_experts=16, n_experts_used=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, norm_topk_prob=True, qk_norm="head", rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=4096, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel=4, partial_rotary_factor=0.25,
        attn_output_gate=True, zero_centred_norm=True,
    ),
    # Qwen3-Next-80B-A3B's real shapes (its config.json): 512 experts, 10 routed, attention every fourth layer.
    "qwen3-next-80b-a3b": dict(
        family="qwen3_next", vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=16, n_kv_heads=2,
        head_dim=256, n_experts=512, n_experts_used=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, norm_topk_prob=True, qk_norm="head", rms_norm_eps=1e-6,
        rope_theta=1e7, max_position_embeddings=262144, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4, partial_rotary_factor=0.25,
        attn_output_gate=True, zero_centred_norm=True,
    ),
    # DeepSeek-V3's real shapes (its config.json; Kimi K2's differ in 384 experts, 64 heads, one group): latent
    # attention, 256 experts in 8 groups, a shared expert, YaRN to 160k.
    "deepseek-v3": dict(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, n_layers=61, n_heads=128, n_kv_heads=128,
        head_dim=192, n_experts=256, n_experts_used=8, moe_intermediate_size=2048, intermediate_size=18432,
        shared_expert_intermediate_size=2048, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=163840, gating="sigmoid", router_bias=True, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_interleave=True,
        rope_scaling=(("beta_fast", 32), ("beta_slow", 1), ("factor", 40.0), ("mscale", 1.0), ("mscale_all_dim", 1.0),
                      ("original_max_position_embeddings", 4096), ("rope_type", "yarn")),
    ),
    # GLM-4.5-Air's real shapes: GQA with q/k/v biases and half rotary, 128 experts, a shared expert.
    "glm-4.5-air": dict(
        family="glm4_moe", vocab_size=151552, hidden_size=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
        n_experts=128, n_experts_used=8, moe_intermediate_size=1408, intermediate_size=10944,
        shared_expert_intermediate_size=1408, norm_topk_prob=True, attn_bias=True, partial_rotary_factor=0.5,
        rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072, gating="sigmoid", router_bias=True,
    ),
    # CPU-sized ones of each.
    "tiny-deepseek": dict(
        family="deepseek_v3", vocab_size=TINY_VOCAB, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=8,
        head_dim=48, n_experts=16, n_experts_used=4, moe_intermediate_size=128, intermediate_size=256,
        shared_expert_intermediate_size=128, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=4096, gating="sigmoid", router_bias=True, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, rope_interleave=True,
    ),
    "tiny-glm": dict(
        family="glm4_moe", vocab_size=TINY_VOCAB, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
        n_experts=16, n_experts_used=4, moe_intermediate_size=128, intermediate_size=256,
        shared_expert_intermediate_size=128, norm_topk_prob=True, attn_bias=True, qk_norm="head",
        partial_rotary_factor=0.5, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096,
        gating="sigmoid", router_bias=True,
    ),
    # Qwen3.8-Flash-Next's shapes (make_reference_qwen4exp_gguf.py's, its config.json's): Qwen3.5's DeltaNet with a
    # sigmoid output gate and QSA attention every fourth layer, 512 experts, 4 hyper-connection streams, the n-gram
    # table on layer 1 (320M rows of 160: 16 heads of consecutive primes from 20M, the first 20,000,003: a GGUF's
    # head sizes give that base back); no tokenizer, EOS Qwen3.5's.
    "qwen3.8-flash-next": dict(
        family="qwen4_exp", vocab_size=248320, hidden_size=2560, n_layers=48, n_heads=24, n_kv_heads=2,
        head_dim=256, n_experts=512, n_experts_used=10, moe_intermediate_size=640,
        shared_expert_intermediate_size=640, norm_topk_prob=True, qk_norm="head", rms_norm_eps=1e-6,
        rope_theta=1e7, max_position_embeddings=262144, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4, partial_rotary_factor=0.25,
        attn_output_gate=True, zero_centred_norm=True, deltanet_gate="sigmoid", eos_token_ids=(248046,),
        hc_count=4, hc_lowrank=320, ple_layers=(1,), ple_embed_dim=2560, ple_conv_kernel=4, ngram_size=3,
        heads_per_ngram=8, ngram_vocab_base=20_000_003, indexer_heads=4, indexer_head_dim=128, indexer_budget=2048,
        indexer_block=4,
    ),
    # A CPU-sized one: attention every second layer, a QSA budget of 16 tokens in blocks of 4 (longer prompts drop
    # blocks), the n-gram table on layer 0 with rows of 32 (8 heads; quantizable by row).
    "tiny-flash-next": dict(
        family="qwen4_exp", vocab_size=TINY_VOCAB, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2,
        head_dim=32, n_experts=16, n_experts_used=4, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, norm_topk_prob=True, qk_norm="head", rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=4096, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel=4, partial_rotary_factor=0.25,
        attn_output_gate=True, zero_centred_norm=True, deltanet_gate="sigmoid", hc_count=4, hc_lowrank=32,
        ple_layers=(0,), ple_embed_dim=256, ple_conv_kernel=4, ngram_size=3, heads_per_ngram=4,
        ngram_vocab_base=67, indexer_heads=2, indexer_head_dim=32, indexer_budget=16, indexer_block=4,
    ),
}
# gpt-oss's config.json (both sizes): YaRN with its correction range not rounded, a window of 128, q/k/v/o biases.
_GPT_OSS = dict(family="gpt_oss", vocab_size=201088, hidden_size=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                n_experts_used=4, moe_intermediate_size=2880, attn_bias=True, gating="softmax_weight",
                rms_norm_eps=1e-5, rope_theta=150000.0,
                rope_scaling=tuple(sorted(dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                               original_max_position_embeddings=4096, truncate=False).items())),
                max_position_embeddings=131072, sliding_window=128)
PRESETS.update({
    # A CPU-sized gpt-oss: sliding (window 16) and full layers, sinks, biases, clamped SwiGLU experts.
    "tiny-gptoss": _GPT_OSS | dict(vocab_size=TINY_VOCAB, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2,
                                   head_dim=32, n_experts=16, moe_intermediate_size=128, sliding_window=16,
                                   max_position_embeddings=4096),
    "gpt-oss-20b": _GPT_OSS | dict(n_layers=24, n_experts=32),
    "gpt-oss-120b": _GPT_OSS | dict(n_layers=36, n_experts=128),
})
DEFAULT_DTYPE = {"tiny": torch.float32, "qwen3-30b-a3b": torch.bfloat16, "tiny-next": torch.float32,
                 "qwen3-next-80b-a3b": torch.bfloat16, "deepseek-v3": torch.bfloat16, "glm-4.5-air": torch.bfloat16,
                 "tiny-deepseek": torch.float32, "tiny-glm": torch.float32, "tiny-gptoss": torch.float32,
                 "gpt-oss-20b": torch.bfloat16, "gpt-oss-120b": torch.bfloat16,
                 "qwen3.8-flash-next": torch.bfloat16, "tiny-flash-next": torch.float32}
HAS_TOKENIZER = {"tiny", "tiny-next", "tiny-deepseek", "tiny-glm", "tiny-gptoss", "tiny-flash-next"}
# Presets with dense first layers (first_k_dense_replace): that many, or one where layers=N leaves fewer than
# twice as many (bench/make_reference_deepseek_gguf.py's 4 layers: 1 dense, 3 MoE).
DENSE_FIRST = {"deepseek-v3": 3, "glm-4.5-air": 1, "tiny-deepseek": 1, "tiny-glm": 1}
SLIDING = {"tiny-gptoss", "gpt-oss-20b", "gpt-oss-120b"}        # even layers slide, odd ones attend everything
DEFAULT_SEED = {"tiny-next": 6}             # a demo preset whose greedy text after "Once upon a time" is not empty
FULL_ATTENTION_INTERVAL = {"tiny-next": 2, "qwen3-next-80b-a3b": 4,     # hybrid presets: attention every N layers
                           "qwen3.8-flash-next": 4, "tiny-flash-next": 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPERTS = ("float", "mxfp4")
MXFP4_EXPERTS = {"gpt-oss-20b", "gpt-oss-120b"}         # presets whose experts are MXFP4 unless experts=float
NORMS = ("norm.weight", "norm_key.weight", "norm_query.weight", "norm_conv.weight")     # (the PLE's norms too)

# The router's logits are x . w over H unit-scale features, so with std H**-0.5 they are ~N(0, 1) and top-k picks
# are soft. The tiny model scales them up so its routing is decisive, as a trained model's is; the big preset
# keeps the reference file's plain init.
TINY_ROUTER_SCALE = 3.0
SCALED_ROUTERS = {"tiny", "tiny-next", "tiny-deepseek", "tiny-glm", "tiny-gptoss", "tiny-flash-next"}


def _usage() -> str:
    return (f"presets: {', '.join(PRESETS)}; options: :layers=N, :seed=N, :dtype={'|'.join(DTYPES)}, "
            f":experts={'|'.join(EXPERTS)}, :mtp=1 (e.g. synth:qwen3-30b-a3b:layers=4)")


class SynthSource:
    """A WeightSource whose tensors are made on demand (see the module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                 tokenizer: object | None = None, router_scale: float = 1.0, experts: str = "float"):
        if experts == "mxfp4" and (config.hidden_size % 32 or config.moe_intermediate_size % 32):
            raise UserError(f"synth experts=mxfp4 needs a hidden size and expert width that are whole blocks of 32, "
                            f"not {config.hidden_size} and {config.moe_intermediate_size}")
        self.config = config
        self.experts = experts
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.seed = seed
        self.router_scale = router_scale
        self._names = set(dense_names(config))

    @classmethod
    def from_spec(cls, spec: str) -> "SynthSource":
        """`NAME[:key=value...]`, the part of `synth:NAME...` after `synth:`."""
        name, *opts = spec.split(":")
        if name not in PRESETS:
            raise UserError(f"unknown synth preset {name!r}; {_usage()}")
        kw = dict(PRESETS[name])
        dtype, seed = DEFAULT_DTYPE[name], DEFAULT_SEED.get(name, 0)
        experts = "mxfp4" if name in MXFP4_EXPERTS else "float"
        for opt in opts:
            key, sep, value = opt.partition("=")
            try:
                if key == "layers" and sep:
                    kw["n_layers"] = int(value)
                    if kw["n_layers"] <= 0:
                        raise ValueError
                elif key == "seed" and sep:
                    seed = int(value)
                elif key == "dtype" and sep and value in DTYPES:
                    dtype = DTYPES[value]
                elif key == "experts" and sep and value in EXPERTS:
                    experts = value
                elif key == "mtp" and value in ("0", "1"):      # an MTP head after the trunk (its family's)
                    kw["nextn_layers"] = int(value)
                else:
                    raise ValueError
            except ValueError:
                raise UserError(f"bad synth option {opt!r} in 'synth:{spec}'; {_usage()}") from None
        if name in DENSE_FIRST:
            k = DENSE_FIRST[name]
            kw["dense_layers"] = tuple(range(k if kw["n_layers"] >= 2 * k else 1))
        if name in FULL_ATTENTION_INTERVAL:     # the layer types of however many layers, as transformers derives them
            step = FULL_ATTENTION_INTERVAL[name]
            kw["layer_types"] = tuple("linear_attention" if (i + 1) % step else "full_attention"
                                      for i in range(kw["n_layers"]))
        if name in SLIDING:
            kw["layer_types"] = tuple("full_attention" if i % 2 else "sliding_attention" for i in range(kw["n_layers"]))
        tok = None
        if name in HAS_TOKENIZER:
            from ..text.tokenizer import synth_tokenizer      # lazily: it trains a small BPE in memory
            tok = synth_tokenizer()
            # The model stops where its tokenizer says a text ends (tokenizer.save_hf writes these ids too).
            kw.update(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_ids=tuple(tok.eos_ids))
        return cls(ModelConfig(**kw), dtype=dtype, seed=seed, tokenizer=tok,
                   router_scale=TINY_ROUTER_SCALE if name in SCALED_ROUTERS else 1.0, experts=experts)

    # --- WeightSource ----------------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._names

    def rows(self, name: str) -> "SynthRows":
        """A host table (arch/names.py's HOST_TABLES) read by row: its rows made when gathered."""
        if name not in self._names:
            raise UserError(f"the synth model has no tensor {name!r}")
        return SynthRows(canonical_shape(self.config, name), self.dtype, zlib.crc32(f"{self.seed}/{name}".encode()))

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise UserError(f"the synth model has no tensor {name!r}")
        shape = canonical_shape(self.config, name)
        if name in HOST_TABLES:             # the rows rows() makes, all of them
            return self.rows(name).take(torch.arange(shape[0]))
        g = self._generator(name)
        if keeps_float32(name):             # ssm_a, the DeltaNet's decay rate: -exp(A_log), negative
            return -torch.empty(shape).uniform_(-2.0, 0.5, generator=g).exp()
        if name.endswith(NORMS):
            return (1.0 + 0.1 * torch.randn(shape, generator=g)).to(self.dtype)
        if name.endswith(".bias"):
            return (0.02 * torch.randn(shape, generator=g)).to(self.dtype)
        std = shape[-1] ** -0.5
        if name.endswith("ffn_gate_inp.weight"):
            std *= self.router_scale
        return (torch.randn(shape, generator=g) * std).to(self.dtype)

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        if layer not in c.expert_layers or not 0 <= e < c.n_experts:
            raise UserError(f"the synth model has no expert {e} in layer {layer}")
        if self.experts == "mxfp4":
            from ..quant.dequant import dequantize
            return tuple(dequantize(m, Q.MXFP4) for m in self._mxfp4_expert(layer, e))
        g = self._generator(f"blk.{layer}.expert.{e}")
        H, inter = c.hidden_size, c.moe_intermediate_size
        gate = torch.randn((inter, H), generator=g) * H ** -0.5        # (I, H)
        up = torch.randn((inter, H), generator=g) * H ** -0.5          # (I, H)
        down = torch.randn((H, inter), generator=g) * inter ** -0.5    # (H, I)
        return gate.to(self.dtype), up.to(self.dtype), down.to(self.dtype)

    def expert_types(self, layer: int) -> tuple[Q, Q, Q] | None:
        """(MXFP4,) * 3 for experts=mxfp4; None for float experts (the engine converts them to the model's dtype)."""
        return (Q.MXFP4,) * 3 if self.experts == "mxfp4" else None

    def expert_bytes(self, layer: int, e: int) -> torch.Tensor:
        """experts=mxfp4: expert e of `layer` as ggml's MXFP4 blocks, gate | up | down, flat uint8."""
        if self.experts != "mxfp4":
            raise UserError("this synth model's experts are float: it has no quantized expert blocks "
                            "(experts=mxfp4 makes MXFP4 ones)")
        return torch.cat([m.reshape(-1) for m in self._mxfp4_expert(layer, e)])

    def dtype_of(self, name: str) -> torch.dtype:
        return self.dtype

    # --- helpers ---------------------------------------------------------------------------------------------
    def _mxfp4_expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's gate (I, H / 32 * 17), up and down (H, I / 32 * 17) as ggml's MXFP4 rows."""
        c = self.config
        if layer not in c.expert_layers or not 0 <= e < c.n_experts:
            raise UserError(f"the synth model has no expert {e} in layer {layer}")
        g = self._generator(f"blk.{layer}.expert.{e}")
        H, inter = c.hidden_size, c.moe_intermediate_size
        return random_mxfp4(inter, H, g), random_mxfp4(inter, H, g), random_mxfp4(H, inter, g)

    def _generator(self, key: str) -> torch.Generator:
        # torch's CPU generator keeps only 32 bits of its seed, so seed and key are hashed together into 32 bits.
        return torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{key}".encode()))


class SynthRows:
    """A synth host table (rows, d) whose rows are made when taken: value (r, c) is a 64-bit mix of (key, r, c)
    (splitmix64's constants, in wrapping int64 arithmetic) turned into a uniform of std d**-0.5, the same whichever
    rows are taken together."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, key: int):
        self.shape, self.dtype, self.key = shape, dtype, key

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) int64 row ids -> (n, d) rows."""
        d = self.shape[1]
        x = rows.long()[:, None] * d + torch.arange(d) + self.key * 0x9E3779B9     # (n, d) int64, wrapping
        for mul, shift in ((-4658895280553007687, 30), (-7723592293110705685, 27)):    # splitmix64's, signed
            x = (x ^ (x >> shift)) * mul
        x = x ^ (x >> 31)
        u = (x & 0xFFFFFF).double() / (1 << 24) - 0.5                                # uniform in [-0.5, 0.5)
        return (u * (12 / d) ** 0.5).to(self.dtype)
