"""A GGUF file's metadata -> ModelConfig: GGUFMetadata, a base class of GGUFSource (gguf.py), holds its metadata
methods; they read through GGUFSource's `_reader` (gguf's), `_fields` (the non-tokenizer keys, as plain values),
`arch`, `path`, `_tensors` (name -> the tensor table's entry), `_shape` and `has`.

    src = GGUFSource("Qwen3-30B-A3B-BF16.gguf")
    src.config                                      # GGUFMetadata._config: {arch}.* keys and the tensor table
    GGUF_KEYS["n_experts"]                          # "expert_count": where a field comes from, for messages

The keys are llama.cpp's, under `{arch}.` (its loader, src/llama-model.cpp, reads the same ones), but for
moestream's own EOS_IDS_KEY: HF's stop ids, which llama.cpp's one tokenizer eos cannot hold (gguf_write.py writes
it). The vocabulary is token_embd's rows, the dense layers those without ffn_gate_inp, the expert width the stacks'.
A hybrid file's DeltaNet shape is in its ssm.* keys (conv_kernel, state_size: dk, group_count: key heads,
time_step_rank: value heads, inner_size: value heads x dv), its layer types in attention.recurrent_layers (a flag
a block, as llama.cpp's converter writes config.json's layer_types) or else full_attention_interval (every N-th
layer is attention, llama.cpp's default 4) and its rotary width in rope.dimension_count; qwen35moe's
rope.dimension_sections (multimodal RoPE) do not matter to text. The first block past block_count -
nextn_predict_layers (a multi-token prediction head, blk.{n}.nextn.*) is the config's head layer (nextn_layers).
deepseek2 and glm4moe (_sigmoid_options): the router's gating, correction bias and groups, expert_weights_scale;
glm4moe's QK-norm and rotary width, deepseek2's latent attention (kv_lora_rank, q_lora_rank, key_length_mla /
value_length_mla) and YaRN's mscale_all_dim from rope.scaling.yarn_log_multiplier. gpt-oss (_window_options): its
sliding layers from attention.sliding_window and sliding_window_pattern.
qwen4exp (Qwen3.8-Flash-Next, llama.cpp b11549's loader): qwen35moe's DeltaNet (tiled value heads, a sigmoid output
gate always) and gated attention, plus hyper_connection.{count,low_rank}, the QSA indexer's attention.indexer.*
and attention.compress_ratios (its block, 0 on DeltaNet layers), and the PLE's ple.* keys: one layer, the n-gram
size, heads, conv kernel, EOS and the hash constants, which must be those transformers derives from the config
(seed 1234, consecutive primes from the first head's row count).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ..arch.families import BY_GGUF_ARCH
from ..config import ModelConfig
from ..errors import UserError

# HF rope_scaling keys whose llama.cpp spelling differs (under `{arch}.rope.scaling.`); others keep their name.
ROPE_KEYS = {"rope_type": "type", "original_max_position_embeddings": "original_context_length",
             "attention_factor": "yarn_attn_factor", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
# Our own key: HF models may stop on several ids; llama.cpp's tokenizer keys hold only one eos.
EOS_IDS_KEY = "moestream.eos_token_ids"
# ModelConfig field -> the metadata key (after `{arch}.`) it is read from, for messages; the vocabulary is
# token_embd's rows.
GGUF_KEYS = {"hidden_size": "embedding_length", "n_heads": "attention.head_count",
             "n_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length", "n_experts": "expert_count",
             "moe_intermediate_size": "expert_feed_forward_length", "intermediate_size": "feed_forward_length",
             "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
             "linear_num_key_heads": "ssm.group_count", "linear_num_value_heads": "ssm.time_step_rank",
             "linear_key_head_dim": "ssm.state_size", "linear_value_head_dim": "ssm.inner_size/ssm.time_step_rank",
             "linear_conv_kernel": "ssm.conv_kernel"}
_REQUIRED = object()


def _value(field):
    """A metadata field as a plain Python value; float32 scalars as the short decimal they were written from."""
    v = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        v = float(str(np.float32(v)))   # 1e-6 written as float32 reads back as 1e-06, not 9.99999997e-07
    return v


def damaged(path: Path, e: Exception) -> UserError:
    return UserError(f"cannot read GGUF {str(path)!r} ({e}): the file is truncated or damaged; download or convert "
                     "it again")


class GGUFMetadata:
    """GGUFSource's metadata: {arch}.* keys read and checked, and the ModelConfig they make with the tensor table."""

    def _key_name(self, field: str) -> str:
        if field == "vocab_size":
            return "token_embd.weight's rows"
        return f"{self.arch}.{GGUF_KEYS.get(field, field)}"

    def _key(self, key: str, default=_REQUIRED, kind: type = int):
        """{arch}.{key} of kind int (a count or size, >= 0), float or bool; `default` where the file has none."""
        v = self._fields.get(f"{self.arch}.{key}", default)
        if v is _REQUIRED:
            raise UserError(f"GGUF {str(self.path)!r} lacks metadata key {self.arch}.{key}; convert it again "
                            "with a current llama.cpp")
        if v is default:
            return v
        if isinstance(v, list):        # per-layer arrays (head counts): moestream needs them uniform
            if not v or any(x != v[0] for x in v):
                raise UserError(f"GGUF key {self.arch}.{key} varies by layer ({v}); moestream needs one value")
            v = v[0]
        ok = {int: lambda: type(v) is int and v >= 0, float: lambda: type(v) in (int, float),
              bool: lambda: type(v) in (bool, int)}[kind]
        if not ok():
            raise UserError(f"GGUF {str(self.path)!r} has {self.arch}.{key} = {v!r}, not a {kind.__name__} that "
                            "makes a model: the file is damaged; download or convert it again")
        return v
    def _config(self) -> ModelConfig:
        fam = BY_GGUF_ARCH[self.arch]
        nextn = self._key("nextn_predict_layers", 0)
        n_layers = self._key("block_count") - nextn                 # less the MTP blocks
        if n_layers > len(self._tensors):           # every layer has tensors: a damaged count, not a model
            raise UserError(f"GGUF {str(self.path)!r} has {self.arch}.block_count {n_layers} for "
                            f"{len(self._tensors)} tensors: the file is damaged; download or convert it again")
        if "token_embd.weight" not in self._tensors:
            raise UserError(f"GGUF {str(self.path)!r} lacks tensor token_embd.weight: is the file complete?")
        dense = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors)
        moe = next((i for i in range(n_layers) if i not in dense), None)
        if moe is None:
            raise UserError(f"GGUF {str(self.path)!r} has no expert layers (blk.N.ffn_gate_inp.weight)")
        if f"blk.{moe}.ffn_gate_exps.weight" not in self._tensors:
            raise UserError(f"GGUF {str(self.path)!r} lacks tensor blk.{moe}.ffn_gate_exps.weight: is the file "
                            "complete? (experts stored one tensor each are not supported)")
        E, inter, _ = self._shape(f"blk.{moe}.ffn_gate_exps.weight")
        shexp = self._key("expert_shared_feed_forward_length", 0)
        if not shexp and self.has(f"blk.{moe}.ffn_gate_shexp.weight"):
            shexp = self._shape(f"blk.{moe}.ffn_gate_shexp.weight")[0]
        rope = {}
        prefix = f"{self.arch}.rope.scaling."
        if self._fields.get(prefix + "type", "none") != "none":
            back = {v: k for k, v in ROPE_KEYS.items()}
            rope = {back.get(k[len(prefix):], k[len(prefix):]): v for k, v in self._fields.items()
                    if k.startswith(prefix)}
            rope.pop("truncate", None)     # llama.cpp always rounds YaRN's correction range (gpt-oss: docs)
        bos = self._token_id("tokenizer.ggml.bos_token_id")
        eos = self._fields.get(EOS_IDS_KEY)
        if eos is None:
            ids = [self._token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
            eos = list(dict.fromkeys(i for i in ids if i is not None))
        elif not isinstance(eos, list) or any(type(i) is not int or i < 0 for i in eos):
            raise UserError(f"GGUF {str(self.path)!r} has {EOS_IDS_KEY} = {eos!r}, not token ids: the file is "
                            "damaged; download or convert it again")
        hidden, n_heads = self._key("embedding_length"), self._key("attention.head_count")
        head_dim = self._key("attention.key_length", hidden // max(n_heads, 1))   # (0 heads: ModelConfig says so)
        hybrid = self._hybrid_options(n_layers, head_dim) if fam.hybrid else {}
        if fam.blocks.residual == "hyper":      # qwen4exp
            hybrid |= self._qwen4_options(n_layers, hidden)
            ple_eos = hybrid.pop("ple_eos", None)
            if ple_eos is not None:     # the n-gram hash's EOS first: ModelConfig's first EOS is the hash's
                eos = [ple_eos] + [i for i in eos if i != ple_eos]
        if fam.shared_count_key:        # deepseek2, glm4moe
            hybrid |= self._sigmoid_options(fam, moe, head_dim, rope)
        if fam.blocks.attention.window:
            hybrid |= self._window_options(n_layers)
        kw = dict(
            family=fam.name, vocab_size=self._shape("token_embd.weight")[0], hidden_size=hidden, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=self._key("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            n_experts=self._key("expert_count", E), n_experts_used=self._key("expert_used_count"),
            moe_intermediate_size=self._key("expert_feed_forward_length", inter) or self._key("feed_forward_length"),
            intermediate_size=self._key("feed_forward_length") if dense else 0,
            shared_expert_intermediate_size=shexp, dense_layers=dense,
            norm_topk_prob=bool(self._key("expert_weights_norm", fam.gguf_norm_topk, bool)), qk_norm=fam.qk_norm,
            attn_bias=self.has(f"blk.{moe}.attn_q.bias"),
            clip_qkv=self._key("attention.clamp_kqv", None, float),
            rms_norm_eps=self._key("attention.layer_norm_rms_epsilon", 1e-6, float),
            rope_theta=float(self._key("rope.freq_base", 10000.0, float)), rope_scaling=tuple(sorted(rope.items())),
            max_position_embeddings=self._key("context_length", 4096),
            tie_word_embeddings="output.weight" not in self._tensors,
            bos_token_id=bos, eos_token_ids=tuple(eos), gating=fam.blocks.router.gating,
            nextn_layers=self._heads(fam, n_layers, nextn),
        )
        return ModelConfig(**(kw | hybrid))

    def _sigmoid_options(self, fam, moe: int, head_dim: int, rope: dict) -> dict:
        """deepseek2's and glm4moe's ModelConfig fields, as llama.cpp b11549 reads them: expert_gating_func
        (1 softmax, 2 sigmoid; absent: deepseek2's softmax, V2's files, and glm4moe's sigmoid), the correction bias
        where exp_probs_b is, expert_group_count / _used_count, expert_weights_scale (0: none); glm4moe's QK-norm
        where its tensors are and its rotary width (rope.dimension_count); deepseek2's latent attention
        (kv_lora_rank, q_lora_rank, key_length_mla and value_length_mla, or in files without them key_length and
        value_length), rotary on adjacent pairs (llama.cpp's NORM rope), and YaRN's mscale_all_dim from
        rope.scaling.yarn_log_multiplier (0.1 x mscale_all_dim, as the converter writes it; mscale taken alike)."""
        func = self._key("expert_gating_func", None)
        absent = "softmax" if self.arch == "deepseek2" else fam.blocks.router.gating      # llama.cpp's defaults
        gating = {None: absent, 1: "softmax", 2: "sigmoid"}.get(func)
        if gating is None:
            raise UserError(f"GGUF {str(self.path)!r} has {self.arch}.expert_gating_func = {func!r}, a gating "
                            "moestream does not run (1 softmax, 2 sigmoid)")
        scale = self._key("expert_weights_scale", 0.0, float)
        out = dict(gating=gating, router_bias=self.has(f"blk.{moe}.exp_probs_b.bias"),
                   n_group=self._key("expert_group_count", 0) or 1,
                   topk_group=self._key("expert_group_used_count", 0) or 1,
                   routed_scaling_factor=float(scale) if scale else 1.0)
        if not self._key("attention.kv_lora_rank", 0):
            out["qk_norm"] = "head" if self.has(f"blk.{moe}.attn_q_norm.weight") else "none"
            out["partial_rotary_factor"] = self._key("rope.dimension_count", head_dim) / max(head_dim, 1)
            return out
        rot = self._key("rope.dimension_count")
        k_len = self._key("attention.key_length_mla", None)
        v_len = self._key("attention.value_length_mla", None)
        if k_len is None:                               # a file of llama.cpp's converter before MLA (no split kv_b)
            k_len, v_len = self._key("attention.key_length"), self._key("attention.value_length")
        if "yarn_log_multiplier" in rope:
            rope["mscale_all_dim"] = round(float(rope.pop("yarn_log_multiplier")) / 0.1, 6)
            rope.setdefault("mscale", rope["mscale_all_dim"])
        n_heads = self._key("attention.head_count")
        return out | dict(q_lora_rank=self._key("attention.q_lora_rank", 0),
                          kv_lora_rank=self._key("attention.kv_lora_rank"),
                          qk_nope_head_dim=k_len - rot, qk_rope_head_dim=rot, v_head_dim=v_len, head_dim=k_len,
                          n_kv_heads=n_heads, rope_interleave=True, rope_scaling=tuple(sorted(rope.items())))

    def _heads(self, fam, n_layers: int, nextn: int) -> int:
        """The MTP heads read (models/mtp.py): the first of the file's nextn blocks, where the family runs one and
        its tensors are there (llama.cpp reads one too)."""
        return int(bool((fam.hf_mtp or fam.gguf_mtp) and nextn
                        and f"blk.{n_layers}.nextn.eh_proj.weight" in self._tensors))

    def _hybrid_options(self, n_layers: int, head_dim: int) -> dict:
        """A hybrid file's (qwen3next, qwen35moe) ModelConfig fields of the DeltaNet and gated attention layers."""
        nv, inner = self._key("ssm.time_step_rank"), self._key("ssm.inner_size")
        if not isinstance(nv, int) or nv < 1 or not isinstance(inner, int) or inner % nv:
            self._no_model(f"ssm.inner_size {inner!r} for ssm.time_step_rank {nv!r} value heads")
        return dict(layer_types=self._layer_types(n_layers),
                    linear_num_key_heads=self._key("ssm.group_count"), linear_num_value_heads=nv,
                    linear_key_head_dim=self._key("ssm.state_size"),
                    linear_value_head_dim=inner // nv,
                    linear_conv_kernel=self._key("ssm.conv_kernel"),
                    partial_rotary_factor=self._key("rope.dimension_count", head_dim // 4) / max(head_dim, 1),
                    attn_output_gate=True, zero_centred_norm=True)

    def _window_options(self, n_layers: int) -> dict:
        """gpt-oss's sliding layers, as llama.cpp's loader reads them: attention.sliding_window, and
        attention.sliding_window_pattern (a flag a layer, or every N-th layer full; default 2: even layers slide)."""
        window = self._key("attention.sliding_window")
        pattern = self._fields.get(f"{self.arch}.attention.sliding_window_pattern", 2)
        if isinstance(pattern, list):
            if len(pattern) < n_layers or not all(isinstance(f, (bool, int)) for f in pattern):
                self._no_model(f"attention.sliding_window_pattern {pattern!r} for {n_layers} layers")
            sliding = [bool(f) for f in pattern[:n_layers]]
        elif isinstance(pattern, int) and pattern >= 0:
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
        else:
            self._no_model(f"attention.sliding_window_pattern {pattern!r}")
        return dict(layer_types=tuple("sliding_attention" if f else "full_attention" for f in sliding),
                    sliding_window=window)

    def _qwen4_options(self, n_layers: int, hidden: int) -> dict:
        """qwen4exp's ModelConfig fields, as llama.cpp b11549's loader reads them: hyper-connections, the QSA
        indexer (its block from attention.compress_ratios, one for every attention layer), the PLE layer and its
        n-gram hash (the file's constants checked against those the config derives), the sigmoid DeltaNet gate."""
        ratios = self._fields.get(f"{self.arch}.attention.compress_ratios", 0)
        ratios = ratios if isinstance(ratios, list) else [ratios] * n_layers
        blocks = {r for r in ratios[:n_layers] if r}
        if len(blocks) != 1 or not all(isinstance(r, int) for r in blocks):
            self._no_model(f"attention.compress_ratios {ratios!r} (one QSA block size)")
        out = dict(hc_count=self._key("hyper_connection.count"), hc_lowrank=self._key("hyper_connection.low_rank"),
                   indexer_heads=self._key("attention.indexer.head_count"),
                   indexer_head_dim=self._key("attention.indexer.key_length"),
                   indexer_budget=self._key("attention.indexer.top_k"), indexer_block=blocks.pop(),
                   deltanet_gate="sigmoid")
        layers = self._fields.get(f"{self.arch}.ple.layers") or []
        if not layers:
            return out
        if len(layers) != 1 or not isinstance(layers[0], int) or not 0 <= layers[0] < n_layers:
            self._no_model(f"ple.layers {layers!r} (one layer, as llama.cpp)")
        n, per = self._key("ple.ngram_size"), self._key("ple.heads_per_ngram")
        sizes = self._fields.get(f"{self.arch}.ple.head_vocab_sizes") or [0]
        out |= dict(ple_layers=(layers[0],), ngram_size=n, heads_per_ngram=per,
                    ple_embed_dim=self._key("embedding_length_per_layer_input") * (n - 1) * per,
                    ple_conv_kernel=self._key("ple.conv_kernel"), ngram_vocab_base=sizes[0],
                    ple_eos=self._key("ple.eos_token_id"))
        return out

    def _check_ngram_hash(self, cfg: ModelConfig) -> None:
        """The file's n-gram hash constants are those transformers derives from cfg (moestream hashes by them)."""
        from ..arch.ngram import ngram_constants
        mult, sizes = ngram_constants(cfg)
        offsets = [sum(sizes[:h]) for h in range(len(sizes))]
        for key, want in (("layer_multipliers", mult), ("head_vocab_sizes", sizes), ("head_offsets", offsets)):
            got = self._fields.get(f"{self.arch}.ple.{key}")
            if got != want:
                raise UserError(f"GGUF {str(self.path)!r} has {self.arch}.ple.{key} {got!r}, not the n-gram hash "
                                f"of seed {cfg.ngram_seed} from {cfg.ngram_vocab_base} rows a head that moestream "
                                "computes: convert it again with llama.cpp b11549's converter")

    def _values(self, wanted) -> dict:
        """The metadata fields whose keys `wanted` takes, as plain values."""
        try:
            return {k: _value(f) for k, f in self._reader.fields.items() if wanted(k)}
        except ValueError as e:             # a string that is not UTF-8
            raise damaged(self.path, e) from None

    def _layer_types(self, n_layers: int) -> tuple[str, ...]:
        """Which layers are DeltaNet (recurrent) and which attention: attention.recurrent_layers, one flag a block
        (or one for all), as llama.cpp's converter writes it from config.json's layer_types and its loader reads it
        first; else every full_attention_interval-th layer is attention (llama.cpp's default 4)."""
        flags = self._fields.get(f"{self.arch}.attention.recurrent_layers")
        if flags is not None:
            blocks = self._key("block_count")
            flags = flags if isinstance(flags, list) else [flags] * blocks
            if len(flags) not in (blocks, n_layers) or not all(isinstance(f, (bool, int)) for f in flags):
                self._no_model(f"attention.recurrent_layers {flags!r} for block_count {blocks}")
            return tuple("linear_attention" if f else "full_attention" for f in flags[:n_layers])
        step = self._key("full_attention_interval", 4)
        if not isinstance(step, int) or step < 1:
            self._no_model(f"full_attention_interval {step!r}")
        return tuple("linear_attention" if (i + 1) % step else "full_attention" for i in range(n_layers))

    def _no_model(self, what: str):
        raise UserError(f"GGUF {str(self.path)!r} has {self.arch}.{what}, which makes no model; convert it again "
                        "with a current llama.cpp")

    def _token_field(self, key: str):
        return self._values(lambda k: k == key).get(key)

    def _token_id(self, key: str) -> int | None:
        v = self._token_field(key)
        if v is not None and (type(v) is not int or v < 0):
            raise UserError(f"GGUF {str(self.path)!r} has {key} = {v!r}, not a token id: the file is damaged; "
                            "download or convert it again")
        return v

