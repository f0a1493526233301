"""GGUF writing: a WeightSource to one GGUF file, tensor by tensor, with gguf.GGUFWriter.

    write_gguf(SynthSource.from_spec("tiny"), "tiny.gguf", dtype="bfloat16")
    mix = Mix.for_config(src.config, "Q4_K_M")                  # moestream.quant.mix: llama-quantize's types
    write_gguf(src, "q4.gguf", types=mix.type, file_type=mix.file_type, device="cuda")

The file is written next to OUT and renamed when complete (outputs.atomic_path): no half-written model at OUT, and
nothing left behind by a failure. Quantized tensors are encoded by moestream.quant.quantize on `device`, a layer's
expert stack at once.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Collection

import numpy as np
import torch
from tqdm import tqdm

import gguf
from gguf import GGMLQuantizationType as Q

from ..arch.families import FAMILIES
from ..arch.hybrid_names import reorder_v_heads, split_qkvz
from ..arch.mla_names import split_kv_b
from ..arch.names import EXPERT_STACKS, gguf_name, gguf_tensors, optional_names
from ..config import ModelConfig
from ..errors import UserError
from ..outputs import atomic_path
from .gguf_config import EOS_IDS_KEY, ROPE_KEYS

TypeOf = Callable[[str, tuple[int, ...]], Q]      # (tensor name, torch shape as stored) -> its GGML type

# dtype name -> the GGUF type its 2-D tensors are written in
GGUF_DTYPES = {"float32": Q.F32, "float16": Q.F16, "bfloat16": Q.BF16, "q8_0": Q.Q8_0}
FILE_TYPE = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
             Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
FLOAT_TORCH = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _add_kv(w: gguf.GGUFWriter, key: str, v) -> None:
    """One metadata value with the types llama.cpp expects: ids as uint32, floats as float32."""
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, (list, tuple)) and v:
        w.add_array(key, list(v))


def _add_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, file_type: gguf.LlamaFileType, quantized: bool,
                  tokenizer) -> None:
    w.add_block_count(cfg.n_stored_layers)          # the MTP heads' blocks after the trunk's, as llama.cpp's
    if cfg.nextn_layers:
        w.add_uint32(f"{w.arch}.nextn_predict_layers", cfg.nextn_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size or cfg.moe_intermediate_size)
    w.add_head_count(cfg.n_heads)
    if cfg.kv_lora_rank:            # deepseek2's MLA: one key head of latent + rotary key (the cache's layout)
        w.add_head_count_kv(1)
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
    else:
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_experts)
    w.add_expert_used_count(cfg.n_experts_used)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if cfg.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if FAMILIES[cfg.family].hybrid:
        _add_hybrid_metadata(w, cfg)
    if cfg.hc_count:
        _add_qwen4_metadata(w, cfg)
    if FAMILIES[cfg.family].shared_count_key:
        _add_sigmoid_metadata(w, cfg)
    if FAMILIES[cfg.family].blocks.attention.window:      # gpt-oss: the window, and the sliding layers where
        w.add_sliding_window(cfg.sliding_window)           # they are not llama.cpp's default (even layers)
        if cfg.layer_types != tuple("full_attention" if i % 2 else "sliding_attention" for i in range(cfg.n_layers)):
            w.add_array(f"{w.arch}.attention.sliding_window_pattern",
                        [t == "sliding_attention" for t in cfg.layer_types])
    if cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    if cfg.rope:
        if cfg.rope_type not in ("linear", "yarn"):
            raise UserError(f"GGUF has no rope scaling type {cfg.rope_type!r} (only linear and yarn); "
                            "export this model as a Hugging Face directory instead")
        w.add_string(f"{w.arch}.rope.scaling.type", cfg.rope_type)
        for k, v in cfg.rope.items():
            if k == "mscale_all_dim" and cfg.kv_lora_rank:      # deepseek2: as llama.cpp's converter writes it
                w.add_rope_scaling_yarn_log_mul(0.1 * v)
            # truncate: llama.cpp always rounds YaRN's correction range, and a GGUF has no key to say otherwise
            elif k not in ("type", "rope_type", "truncate"):
                _add_kv(w, f"{w.arch}.rope.scaling.{ROPE_KEYS.get(k, k)}", v)
    w.add_file_type(file_type)
    if quantized:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)     # as llama-quantize writes it
    w.add_vocab_size(cfg.vocab_size)
    fields = {"tokenizer.ggml.model": "none"} if tokenizer is None else dict(tokenizer.gguf_fields())
    # The config's ids win over the tokenizer's: they are what the model was configured to stop on.
    if cfg.bos_token_id is not None:
        fields["tokenizer.ggml.bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        fields["tokenizer.ggml.eos_token_id"] = cfg.eos_token_ids[0]
        fields[EOS_IDS_KEY] = list(cfg.eos_token_ids)
    for k, v in fields.items():
        _add_kv(w, k, v)


def _add_hybrid_metadata(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """qwen3next's and qwen35moe's keys: the DeltaNet's shape (ssm.*), the layer kinds, the rotary width;
    qwen35moe's multimodal RoPE sections too. The layer kinds are attention.recurrent_layers, a flag a layer, as
    llama.cpp's converter writes them (and its loader reads them first), and full_attention_interval as well where
    attention is every N-th layer, for readers that know only that. (llama.cpp's loaders take a value head's dv as
    dk, ssm.state_size: a model whose dv differs is read back by moestream only.)"""
    w.add_array(f"{w.arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in cfg.layer_types] + [False] * cfg.nextn_layers)
    step = cfg.attention_layers[0] + 1 if cfg.attention_layers else cfg.n_layers + 1
    if cfg.layer_types == tuple("linear_attention" if (i + 1) % step else "full_attention"
                                for i in range(cfg.n_layers)):
        w.add_full_attention_interval(step)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    w.add_rope_dimension_count(cfg.rotary_dim)
    if FAMILIES[cfg.family].gguf_rope_sections:
        w.add_rope_dimension_sections(list(FAMILIES[cfg.family].gguf_rope_sections))


def _add_qwen4_metadata(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """qwen4exp's keys, as make_reference_qwen4exp_gguf.py writes them (llama.cpp b11549's loader reads them):
    hyper-connections, the QSA indexer (attention.compress_ratios: its block on attention layers, 0 elsewhere),
    multimodal RoPE sections of the rotary half (11/11/10 at 64 dims), the PLE layer and its hash constants."""
    if cfg.deltanet_gate != "sigmoid":
        raise UserError("llama.cpp's qwen4exp gates the DeltaNet's output by sigmoid; this model's "
                        "output_gate_type is silu: export it as a Hugging Face directory")
    a = w.arch
    w.add_uint32(f"{a}.hyper_connection.count", cfg.hc_count)
    w.add_uint32(f"{a}.hyper_connection.low_rank", cfg.hc_lowrank)
    w.add_uint32(f"{a}.attention.indexer.head_count", cfg.indexer_heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", cfg.indexer_head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", cfg.indexer_budget)
    w.add_array(f"{a}.attention.compress_ratios", [0 if t == "linear_attention" else cfg.indexer_block
                                                   for t in cfg.layer_types])
    half = cfg.rotary_dim // 2
    third = -(-half // 3)
    w.add_rope_dimension_sections([third, third, half - 2 * third, 0])
    if not cfg.ple_layers:
        return
    from ..arch.ngram import ngram_constants
    mult, sizes = ngram_constants(cfg)
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    w.add_array(f"{a}.ple.layers", list(cfg.ple_layers))
    w.add_uint32(f"{a}.ple.ngram_size", cfg.ngram_size)
    w.add_uint32(f"{a}.ple.heads_per_ngram", cfg.heads_per_ngram)
    w.add_uint32(f"{a}.ple.conv_kernel", cfg.ple_conv_kernel)
    w.add_uint32(f"{a}.ple.eos_token_id", cfg.eos_token_ids[0])
    w.add_uint32(f"{a}.embedding_length_per_layer_input", cfg.ple_embed_dim // heads)
    for key, v in (("layer_multipliers", mult), ("head_offsets", [sum(sizes[:h]) for h in range(heads)]),
                   ("head_vocab_sizes", sizes)):
        w.add_key_value(f"{a}.ple.{key}", v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)


def _add_sigmoid_metadata(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """deepseek2's and glm4moe's keys, as llama.cpp b11549's converter writes them: the gating, scale and groups
    of the router, the shared experts' count, the leading dense layers; glm4moe's rotary width; deepseek2's latent
    attention (its cache as one key head of kv_lora_rank + rope dims, the MLA head sizes in the _mla keys)."""
    if cfg.dense_layers != tuple(range(len(cfg.dense_layers))):
        raise UserError(f"a {cfg.family} GGUF holds dense layers first only, not {cfg.dense_layers}")
    inter = cfg.moe_intermediate_size
    if cfg.shared_expert_intermediate_size % inter:
        raise UserError(f"a {cfg.family} GGUF holds shared experts of the routed experts' width {inter}, not "
                        f"{cfg.shared_expert_intermediate_size}")
    w.add_expert_shared_count(cfg.shared_expert_intermediate_size // inter)
    w.add_leading_dense_block_count(len(cfg.dense_layers))
    w.add_expert_gating_func({"softmax": gguf.ExpertGatingFuncType.SOFTMAX,
                              "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}[cfg.gating])
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.n_group > 1:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if not cfg.nextn_layers:                   # (with a head: written with block_count)
        w.add_nextn_predict_layers(0)
    if not cfg.kv_lora_rank:
        w.add_rope_dimension_count(cfg.rotary_dim)
        return
    if not cfg.rope_interleave:
        raise UserError("a deepseek2 GGUF rotates adjacent pairs (rope_interleave); this model rotates halves: "
                        "export it as a Hugging Face directory")
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def _add_tensor_info(w: gguf.GGUFWriter, name: str, shape: tuple[int, ...], qtype: Q) -> None:
    if qtype in (Q.F32, Q.F16):
        np_dtype = np.dtype(np.float32 if qtype == Q.F32 else np.float16)
        w.add_tensor_info(name, shape, np_dtype, int(np.prod(shape)) * np_dtype.itemsize)
        return
    # BF16 and the quantized types have no numpy type: their bytes go in as uint8 rows, as make_reference_gguf.py
    # writes BF16.
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise UserError(f"tensor {name} {shape}: rows of {shape[-1]} are not whole {qtype.name} blocks of {block}; "
                        "write this model as float16 or bfloat16")
    byte_shape = (*shape[:-1], shape[-1] // block * type_size)
    w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)


def _encode(t: torch.Tensor, qtype: Q, device: str, importance: torch.Tensor | None = None) -> np.ndarray:
    """A tensor as the bytes (or numpy floats) the file stores for qtype; quantized ones encoded on `device`, with
    the tensor's imatrix importance where the type's quantizer takes it."""
    if qtype in FLOAT_TORCH:
        t = t.to(FLOAT_TORCH[qtype]).contiguous()
        return t.view(torch.int16).numpy().view(np.uint8) if qtype == Q.BF16 else t.numpy()
    from ..quant.quantize import quantize
    return quantize(t.to(device), qtype, importance=importance).cpu().numpy()


def write_gguf(source, path: str | os.PathLike, dtype: str = "auto", progress: bool = False, *,
               types: TypeOf | None = None, file_type: gguf.LlamaFileType | None = None,
               device: str = "cpu", new: bool = False, importance: Callable | None = None,
               extra_kv: dict | None = None, head_only: bool = False, copied: Collection[str] = ()) -> Path:
    """Write `source` as one GGUF file, streaming tensor by tensor (a layer's expert stacks at a time).

    dtype: auto (the source's), float32, float16, bfloat16 or q8_0. 1-D tensors (norms, biases) are always F32, as
    llama.cpp's converters write them. types: the GGML type of each tensor instead (moestream.quant.mix.Mix.type),
    with file_type its general.file_type. device: where quantized tensors are encoded ("cpu", "cuda"). new: refuse
    to replace a file at `path` (outputs.atomic_path). importance: GGUF tensor name -> its imatrix importance
    ((n,) or (E, n)) or None (moestream.quant.imatrix); extra_kv: more metadata (llama-quantize's quantize.imatrix.*).
    head_only: the MTP head alone, as llama.cpp's MTP-only files (--model-draft): the whole metadata, token_embd,
    output_norm, output and the head's blocks, no trunk layer. copied: canonical names written as the source stores
    them (source.stored(name): its GGML type and bytes, as GGUFSource.stored gives them) instead of encoded from
    their values: an MTP head's copy of its target's token_embd and output, bit for bit whatever their type.
    """
    cfg = source.config
    arch = FAMILIES[cfg.family].gguf_arch
    if arch is None:
        raise UserError(f"GGUF export of {cfg.family} is not supported yet; export a Hugging Face directory")
    if types is None:
        if dtype == "auto":       # the dtype of a small 2-D tensor every family has (token_embd is big to make)
            probe = source.tensor(f"blk.{cfg.moe_layers[0]}.ffn_gate_inp.weight").dtype
            dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(probe, "float32")
        if dtype not in GGUF_DTYPES:
            raise UserError(f"GGUF dtype must be auto, float32, float16, bfloat16 or q8_0, got {dtype!r}")
        qtype = GGUF_DTYPES[dtype]
        # 1-D tensors and the DeltaNet's conv (rows of kernel-size values) in F32, as llama.cpp's converter does
        types, file_type = (lambda name, shape: Q.F32 if len(shape) == 1 or name.endswith("ssm_conv1d.weight")
                            else qtype), FILE_TYPE[qtype]
    elif file_type is None:
        raise ValueError("write_gguf: types= needs the file_type it makes")
    held = [n for n in optional_names(cfg) if source.has(n)]      # an MTP head's own embedding and output head
    plan = [(name, shape, source.stored(name)[0] if name in copied else types(name, shape))
            for name, shape in gguf_tensors(cfg, held)]
    if head_only:
        if not cfg.nextn_layers:
            raise UserError("this model has no MTP head to write (head_only)")
        heads = tuple(f"blk.{i}." for i in cfg.head_layers)
        plan = [p for p in plan if p[0].startswith(heads) or not p[0].startswith("blk.")]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, new=new) as tmp:              # renamed when complete: no half-written model at `path`
        w = gguf.GGUFWriter(tmp, arch)
        try:
            _write(w, source, cfg, plan, file_type, device, progress, importance or (lambda name: None),
                   extra_kv or {}, copied)
        finally:
            w.close()
    return path


def _write(w: gguf.GGUFWriter, source, cfg: ModelConfig, plan, file_type, device: str, progress: bool, importance,
           extra_kv: dict, copied: Collection[str]):
    _add_metadata(w, cfg, file_type, any(t not in FLOAT_TORCH for _, _, t in plan), source.tokenizer)
    for key, v in extra_kv.items():
        _add_kv(w, key, v)
    for name, shape, qtype in plan:
        _add_tensor_info(w, gguf_name(cfg, name), shape, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    types = {name: qtype for name, _, qtype in plan}
    stacks: dict[str, torch.Tensor] = {}
    bar = tqdm(plan, desc="writing", unit="tensor", disable=not progress)
    for name, shape, qtype in bar:
        bar.set_postfix_str(f"{name} {qtype.name}", refresh=False)
        if name in copied:
            w.write_tensor_data(source.stored(name)[1])
            continue
        layer_stack = name.split(".")[2] if name.startswith("blk.") and name.endswith(".weight") else ""
        if layer_stack == EXPERT_STACKS[0]:
            # float files build the stacks in their own dtype; quantized stacks keep the source's until encoded
            layer = int(name.split(".")[1])
            dtypes = [FLOAT_TORCH.get(types[f"blk.{layer}.{s}.weight"]) for s in EXPERT_STACKS]
            stacks = _expert_stacks(source, layer, shape, dtypes)
        if layer_stack in EXPERT_STACKS:
            t = stacks.pop(layer_stack)
        elif FAMILIES[cfg.family].gguf_split_kv_b and name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            t = split_kv_b(cfg, source.tensor(name.rsplit(".", 2)[0] + ".attn_kv_b.weight"))[
                name.endswith("attn_v_b.weight")]
        elif FAMILIES[cfg.family].gguf_split_qkvz and name.endswith(("attn_qkv.weight", "attn_gate.weight")):
            qkv_gate = split_qkvz(cfg, source.tensor(name.rsplit(".", 2)[0] + ".ssm_in.weight"))
            t = qkv_gate[name.endswith("attn_gate.weight")]
        else:
            t = source.tensor(name)
            if name.endswith("ffn_gate_inp_shexp.weight"):
                t = t.reshape(-1)
            if tuple(t.shape) != shape:
                raise UserError(f"tensor {name} has shape {tuple(t.shape)} but the config makes it {shape}: "
                                "the checkpoint does not match its config")
            if FAMILIES[cfg.family].gguf_tiled_v:       # llama.cpp's qwen35moe: the value heads tiled
                t = reorder_v_heads(cfg, name, t, tiled=True)
        w.write_tensor_data(_encode(t, qtype, device, importance(gguf_name(cfg, name))))


def _expert_stacks(source, layer: int, gate_shape, dtypes) -> dict[str, torch.Tensor]:
    """The layer's three (E, ., .) stacks, filled expert by expert (one layer of experts in memory); a dtype of
    None is the source's."""
    E, inter, H = gate_shape
    stacks = None
    for e in range(E):
        g, u, d = source.expert(layer, e)
        if g.shape != (inter, H) or u.shape != (inter, H) or d.shape != (H, inter):
            raise UserError(f"expert {e} of layer {layer} has shapes {tuple(g.shape)}, {tuple(u.shape)}, "
                            f"{tuple(d.shape)}; the config makes them ({inter}, {H}) and ({H}, {inter})")
        if stacks is None:
            stacks = [torch.empty((E, *x.shape), dtype=dt or x.dtype) for x, dt in zip((g, u, d), dtypes)]
        for stack, x in zip(stacks, (g, u, d)):
            stack[e] = x
    return dict(zip(EXPERT_STACKS, stacks))
