"""Hugging Face directories: config.json + safetensors (one file, or shards with an index), read lazily.

    src = HFSource("Qwen3-30B-A3B/")                 # opens every shard's header; reads no weights
    src.tensor("blk.0.attn_q.weight")                # model.layers.0.self_attn.q_proj.weight
    gate, up, down = src.expert(0, 3)                # model.layers.0.mlp.experts.3.{gate,up,down}_proj.weight
    write_hf(src, "out/")                            # the reverse, loadable by transformers

Experts may be stored one tensor per expert and projection (qwen*_moe/olmoe `mlp.experts.E.gate_proj`, mixtral
`block_sparse_moe.experts.E.w1/w3/w2`) or fused per layer as transformers 5 holds them in memory
(`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)); a fused expert is sliced out of its
stack without reading the rest. Each family's spellings and config.json keys are its entry in arch/families.py.
gpt-oss's float stacks (Family.hf_interleaved) are transposed, gate_up_proj (E, H, 2I) with gate and up in
alternate columns and down_proj (E, I, H), their biases beside them. Fused experts may also be MXFP4 in OpenAI's
packed form (gpt-oss's checkpoints as published, quantization_config quant_method mxfp4: `gate_up_proj_blocks`
(E, 2I, H / 32, 16) with `gate_up_proj_scales` (E, 2I, H / 32), gate and up in alternate rows, `down_proj_blocks`
/ `down_proj_scales`): they are repacked to ggml's MXFP4 blocks (quant/mxfp4.py) and handed out as such
(`expert_types`, `expert_bytes`), so they stay MXFP4 from the file to the slot as a GGUF's do; `expert` gives their
values as float32.

The hybrid families (Qwen3-Next, Qwen3.5-MoE) hold other values than HF's (1 + w norms, -exp(A_log), the conv as
(C, K)): arch/hybrid_names.py's canonical_value turns HF's into them, and hf_value back, so that they read back as
the same bits. (A float32 checkpoint written again gets its norms' w back as fl(1 + w) - 1, within 2**-24, and may
get another float32 A_log of the same -exp: what transformers and this reader compute from them is unchanged.)
An FP8 checkpoint (quant/fp8.py: e4m3 weights, each with its 128 x 128 blocks' `weight_scale_inv`) hands out its
dense tensors and `expert()` widened to float32 (the loader rounds them once to the model's dtype), and its experts
as their FP8 bytes (`expert_types`, `expert_bytes`), which the engine keeps as they are from the file to the slot.

Qwen3.5-MoE is written in its text-only form (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text, tensors under
`model.`), which transformers and this reader both load: the multimodal form's config.json needs a vision tower,
which this model has not.
"""
from __future__ import annotations

import json
import math
import os
from functools import cached_property
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..arch.families import FAMILIES, HF_GLOBAL, HF_LAYER, HF_NEXTN, first_own
from ..arch.hf_config import config_from_hf, hf_key
from ..arch.hybrid_names import QWEN4_GLOBAL, QWEN4_HF, canonical_value, hf_value
from ..arch.names import EXPERT_STACKS, canonical_shape, check_shape, dense_names
from ..config import ModelConfig
from ..errors import UserError
from ..quant import fp8
from ..quant.mxfp4 import check_openai, from_openai

INDEX = "model.safetensors.index.json"
PACKED = ("gate_up_proj", "down_proj")      # OpenAI's packed MXFP4 experts: {module}.{p}_blocks and {p}_scales


def hf_names(name: str, family: str, prefix: str = "model.", n_layers: int | None = None) -> list[str]:
    """HF spellings of a canonical name, the one transformers 5.24's save_pretrained writes first. `prefix`: where
    the language model's tensors are (`model.`; Qwen3.5-MoE's multimodal checkpoints: `model.language_model.`).
    n_layers: the trunk's layers; a layer past them is an MTP head, under the family's hf_mtp prefix."""
    if name in HF_GLOBAL:
        hf = HF_GLOBAL[name]
        return [prefix + hf[len("model."):] if hf.startswith("model.") else hf]
    if name in QWEN4_GLOBAL:
        return [prefix + QWEN4_GLOBAL[name]]
    if name == "per_layer_token_embd.weight":
        return []                       # in row shards of its layer's n-gram embedding: HFSource._ple_table
    _, layer, suffix = name.split(".", 2)
    if n_layers is not None and int(layer) >= n_layers:        # head k: `mtp.fc.weight`, `mtp.layers.k.*`
        mtp = FAMILIES[family].hf_mtp[1]
        if suffix in HF_NEXTN:
            return [mtp + HF_NEXTN[suffix]]
        block = f"{prefix}layers.0."
        return [f"{mtp}layers.{int(layer) - n_layers}.{n[len(block):]}"
                for n in hf_names(f"blk.0.{suffix}", family, prefix)]
    if suffix == "ffn_gate_inp.weight":
        spellings = first_own(FAMILIES[family].hf_router, [f.hf_router for f in FAMILIES.values()])
    elif suffix in ("indexer.q_proj.weight", "indexer.k_proj.weight"):
        spellings = []                  # rows of index_qk_proj: HFSource._indexer
    else:
        spellings = [dict(FAMILIES[family].hf_renames).get(suffix) or HF_LAYER.get(suffix) or QWEN4_HF[suffix]]
    return [f"{prefix}layers.{layer}.{s}" for s in spellings]


def _layers_prefix(cfg: ModelConfig, layer: int, prefix: str = "model.") -> str:
    """Where layer `layer`'s tensors are: `{prefix}layers.N.`, an MTP head's under the family's hf_mtp prefix."""
    if layer >= cfg.n_layers:
        return f"{FAMILIES[cfg.family].hf_mtp[1]}layers.{layer - cfg.n_layers}."
    return f"{prefix}layers.{layer}."


def _expert_names(cfg: ModelConfig, layer: int, e: int) -> list[str]:
    mod, g, u, d = FAMILIES[cfg.family].hf_experts[0]
    return [f"{_layers_prefix(cfg, layer)}{mod}.{e}.{p}.weight" for p in (g, u, d)]


class HFSource:
    """A WeightSource over a Hugging Face model directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise UserError(f"{str(self.path)!r} is not a directory; give a Hugging Face model directory")
        raw = _read_json(self.path / "config.json", "config.json")
        _check_quantization(raw.get("quantization_config"))
        self.config = config_from_hf(raw, _read_json(self.path / "generation_config.json", None))
        self._where: dict[str, object] = {}     # HF tensor name -> the safe_open handle of its file
        for file in self._shard_files():
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as e:              # safetensors has one error type for truncation and garbage
                raise UserError(f"cannot read {file.name}: {e}; the file is truncated or not safetensors: "
                                "download it again") from None
            self._where.update(dict.fromkeys(handle.keys(), handle))
        fam = FAMILIES[self.config.family]
        self.prefix = next((p for p in fam.hf_text_prefixes if p + "embed_tokens.weight" in self._where),
                           fam.hf_text_prefixes[0])
        if self.config.nextn_layers and fam.hf_mtp[1] + HF_NEXTN["nextn.eh_proj.weight"] not in self._where:
            self.config = self.config.replace(nextn_layers=0)   # announced, not shipped (transformers drops mtp.*)
        self._check_shapes()

    def _check_shapes(self) -> None:
        """Every tensor's shape (from the safetensors headers, no data read) against the one config.json makes, as
        tensor() and expert() would hand it out; one line naming the keys and the tensor where they disagree."""
        cfg = self.config
        for name in dense_names(cfg):
            if _fused_bias(cfg, name):
                continue                      # checked with its stack below
            hf = next((n for n in hf_names(name, cfg.family, self.prefix, cfg.n_layers) if n in self._where), None)
            if hf is not None:                # a missing one is named when it is read
                self._check(name, hf, _canonical_shape_of(name, self._shape(hf)))
        fam, every = FAMILIES[cfg.family], FAMILIES.values()
        packed = [layer for layer in cfg.moe_layers if self._packed(layer)]
        if packed and len(packed) < len(cfg.moe_layers):
            raise UserError(f"MoE layers {sorted(set(cfg.moe_layers) - set(packed))} have no packed MXFP4 experts "
                            f"where layer {packed[0]}'s are: every layer's experts must be MXFP4 or none")
        for layer in packed:
            self._check_packed(layer)
        for layer in (l for l in cfg.expert_layers if l not in packed):
            p = _layers_prefix(cfg, layer, self.prefix)
            for mod in first_own(fam.hf_fused, [f.hf_fused for f in every]):
                gate_up, down = f"{p}{mod}.gate_up_proj", f"{p}{mod}.down_proj"
                if gate_up in self._where and down in self._where:
                    E, inter, H = canonical_shape(cfg, "ffn_gate_exps.weight")    # gate_up: gate rows, then up
                    inter_t = fam.hf_interleaved            # gpt-oss: (E, H, 2I) and (E, I, H)
                    self._check(f"blk.{layer}.ffn_gate_exps.weight", gate_up, self._shape(gate_up),
                                want=(E, H, 2 * inter) if inter_t else (E, 2 * inter, H))
                    self._check(f"blk.{layer}.ffn_down_exps.weight", down, self._shape(down),
                                want=(E, inter, H) if inter_t else None)
                    break
            else:
                for mod, g, u, d in first_own(fam.hf_experts, [f.hf_experts for f in every]):
                    first = f"{p}{mod}.0.{g}.weight"
                    if first in self._where:  # experts one tensor each: as many as there are, stacked
                        n = 1
                        while f"{p}{mod}.{n}.{g}.weight" in self._where:
                            n += 1
                        for proj, stack in zip((g, u, d), EXPERT_STACKS):
                            name = f"{p}{mod}.0.{proj}.weight"
                            if name in self._where:
                                self._check(f"blk.{layer}.{stack}.weight", f"{p}{mod}.{{0..{n - 1}}}.{proj}.weight",
                                            (n, *self._shape(name)))
                        break

    def _packed(self, layer: int) -> str | None:
        """The layer's experts module prefix (`model.layers.N.mlp.experts.`) where its experts are OpenAI's packed
        MXFP4 (a `gate_up_proj_blocks` tensor), else None."""
        fam, every = FAMILIES[self.config.family], FAMILIES.values()
        for mod in first_own(fam.hf_fused, [f.hf_fused for f in every]):
            p = f"{self.prefix}layers.{layer}.{mod}."
            if f"{p}gate_up_proj_blocks" in self._where:
                return p
        return None

    def _check_packed(self, layer: int) -> None:
        """Both pairs present, each blocks' shape its scales' + [16], and the matrices they hold the config's."""
        p = self._packed(layer)
        E, inter, H = canonical_shape(self.config, "ffn_gate_exps.weight")
        for proj, stack, want in zip(PACKED, ("ffn_gate_exps", "ffn_down_exps"), ((E, 2 * inter, H), None)):
            blocks, scales = f"{p}{proj}_blocks", f"{p}{proj}_scales"
            for n in (blocks, scales):
                if n not in self._where:
                    raise UserError(f"checkpoint lacks tensor {n} (MXFP4 experts of layer {layer}): is the download "
                                    "complete?")
            shape = self._shape(blocks)
            check_openai(shape, self._shape(scales), blocks)
            self._check(f"blk.{layer}.{stack}.weight", blocks, (*shape[:-2], shape[-2] * 32), want=want)

    def _check(self, name: str, tensor: str, shape, want=None) -> None:
        check_shape(self.config, name, shape, tensor=tensor, want=want,
                    key=lambda f: hf_key(self.config.family, f),
                    hint="config.json does not match the weights")

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def _shard_files(self) -> list[Path]:
        if (self.path / "model.safetensors").exists():
            return [self.path / "model.safetensors"]
        if (self.path / INDEX).exists():
            files = _read_json(self.path / INDEX, INDEX).get("weight_map", {})
            if not isinstance(files, dict) or not all(isinstance(f, str) for f in files.values()):
                raise UserError(f"{str(self.path / INDEX)!r} has no weight_map of tensor names to files: download "
                                "it again")
            files = sorted(set(files.values()))
            for f in files:
                if not (self.path / f).exists():
                    raise UserError(f"{INDEX} names shard {f!r}, which is not in {str(self.path)!r}: "
                                    "is the download complete?")
            return [self.path / f for f in files]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UserError(f"no safetensors weights in {str(self.path)!r} (model.safetensors or {INDEX}); "
                            "is the download complete? (.bin checkpoints must be converted to safetensors)")
        return files

    @cached_property
    def tokenizer(self):
        if not (self.path / "tokenizer.json").exists():
            return None
        try:
            from ..text.tokenizer import Tokenizer
        except ModuleNotFoundError as e:
            raise UserError(f"{str(self.path)!r} has a tokenizer.json but this moestream has no tokenizer module "
                            f"({e}); pass token ids or reinstall moestream") from None
        return Tokenizer.from_hf_dir(self.path)

    # --- WeightSource ----------------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return any(n in self._where for n in hf_names(name, self.config.family, self.prefix, self.config.n_layers))

    def tensor(self, name: str) -> torch.Tensor:
        if _fused_bias(self.config, name):      # gpt-oss: gate_up_proj_bias (E, 2I) alternates gate and up
            _, layer, suffix = name.split(".", 2)
            p = f"{self.prefix}layers.{layer}.{FAMILIES[self.config.family].hf_fused[0]}."
            if suffix == "ffn_down_exps.bias":
                return self._read(p + "down_proj_bias")
            both = self._read(p + "gate_up_proj_bias")
            return both[:, suffix == "ffn_up_exps.bias"::2].contiguous()
        if name == "per_layer_token_embd.weight" or name.endswith(("indexer.q_proj.weight", "indexer.k_proj.weight")):
            t = self._ple_table() if name.startswith("per_layer") else self._indexer(name)
            self._check(name, name, tuple(t.shape))
            return t
        t = self._read_first(hf_names(name, self.config.family, self.prefix, self.config.n_layers), name)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(1, -1)                 # some exports keep the shared expert's gate as (H,)
        # hybrid families: zero-centred norms as 1 + w, -exp(A_log), the conv as (C, K) (arch/hybrid_names.py)
        return canonical_value(self.config, _suffix(name), t)

    def rows(self, name: str) -> torch.Tensor:
        """A host table (arch/names.py's HOST_TABLES) read by row: the tensor itself."""
        return self.tensor(name)

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._packed(layer):
            from ..quant.dequant import dequantize
            return tuple(dequantize(m, Q.MXFP4) for m in self._packed_expert(layer, e))
        names = self._expert_names(layer, e)
        if names is not None:
            gate, up, down = (self._read(n) for n in names)
            return gate, up, down
        p = _layers_prefix(self.config, layer, self.prefix)
        fam, every = FAMILIES[self.config.family], FAMILIES.values()
        for mod in first_own(fam.hf_fused, [f.hf_fused for f in every]):
            gate_up, down = f"{p}{mod}.gate_up_proj", f"{p}{mod}.down_proj"
            if gate_up in self._where and down in self._where:
                return self._fused_expert(gate_up, down, e)
        raise UserError(f"checkpoint lacks tensor {p}mlp.experts.{e}.gate_proj.weight (expert {e} of layer "
                        f"{layer}): is the download complete?")

    def expert_types(self, layer: int) -> tuple | None:
        """(MXFP4,) * 3 for OpenAI's packed experts, (FP8,) * 3 where the layer's experts are FP8 (both kept as their
        bytes); None for float experts, which the engine converts to the model's dtype."""
        if self._packed(layer):
            return (Q.MXFP4,) * 3
        names = self._expert_names(layer, 0)
        return (fp8.FP8,) * 3 if names is not None and self._is_fp8(names[0]) else None

    def expert_bytes(self, layer: int, e: int) -> torch.Tensor:
        """Expert e of a quantized layer as its row (quant/layout.py): gate | up | down, each ggml's MXFP4 blocks
        (packed experts) or its e4m3 bytes and scales (FP8)."""
        if self._packed(layer):
            return torch.cat([m.reshape(-1) for m in self._packed_expert(layer, e)])
        names = self._expert_names(layer, e)
        if names is None:
            raise UserError(f"layer {layer}'s experts are float: this checkpoint has no quantized expert blocks "
                            "there")
        parts = []
        for n in names:
            if not self._is_fp8(n):
                raise UserError(f"tensor {n} is {self._where[n].get_slice(n).get_dtype()} while its expert's gate "
                                "is FP8; moestream reads experts whose three matrices are all FP8 or all float")
            parts.append(fp8.pack(self._where[n].get_tensor(n), self._scale_inv(n)))
        return torch.cat(parts)

    def dtype_of(self, name: str) -> torch.dtype:
        return self._read_first(hf_names(name, self.config.family, self.prefix, self.config.n_layers), name).dtype

    def _ple_table(self) -> torch.Tensor:
        """qwen4_exp's n-gram table: its PLE layer's row shards (ngram_embedding.shard_N.weight), in order."""
        p = f"{self.prefix}layers.{self.config.ple_layers[0]}.ple.ple_embedding.ngram_embedding."
        if p + "weight" in self._where:
            return self._read(p + "weight")
        shards = sorted((int(n[len(p) + 6:-7]), n) for n in self._where if n.startswith(p + "shard_"))
        if not shards:
            raise UserError(f"checkpoint lacks tensor {p}shard_0.weight (the PLE n-gram table): is the download "
                            "complete?")
        return torch.cat([self._read(n) for _, n in shards])

    def _indexer(self, name: str) -> torch.Tensor:
        """qwen4_exp's indexer.q_proj / k_proj: the query heads' rows of index_qk_proj, then the key head's."""
        cfg = self.config
        layer = name.split(".")[1]
        qk = self._read(f"{self.prefix}layers.{layer}.self_attn.indexer.index_qk_proj.weight")
        q = cfg.indexer_heads * cfg.indexer_head_dim
        return qk[:q] if name.endswith("q_proj.weight") else qk[q:]

    # --- reading ---------------------------------------------------------------------------------------------
    def _read_first(self, names: list[str], canonical: str) -> torch.Tensor:
        for n in names:
            if n in self._where:
                return self._read(n)
        raise UserError(f"checkpoint lacks tensor {names[0]} ({canonical}): is the download complete?")

    def _read(self, name: str) -> torch.Tensor:
        """A tensor as the file holds it; an FP8 one widened to float32 by its block scales."""
        if name not in self._where:
            raise UserError(f"checkpoint lacks tensor {name}: is the download complete?")
        t = self._where[name].get_tensor(name)
        return fp8.dequantize(t, self._scale_inv(name)) if t.dtype == fp8.E4M3 else t

    def _is_fp8(self, name: str) -> bool:
        return self._where[name].get_slice(name).get_dtype() == "F8_E4M3"

    def _scale_inv(self, name: str) -> torch.Tensor:
        """The block scales of FP8 tensor `name`, float32 (quant/fp8.py's scales_of: one line where absent)."""
        scale = fp8.scale_name(name)
        shape = tuple(self._where[name].get_slice(name).get_shape())
        return fp8.scales_of(name, shape, self._where[scale].get_tensor(scale) if scale in self._where else None)

    def _expert_names(self, layer: int, e: int) -> list[str] | None:
        """Expert e's gate, up and down tensor names where the layer's experts are tensors of their own; None for
        fused stacks."""
        p = _layers_prefix(self.config, layer, self.prefix)
        fam, every = FAMILIES[self.config.family], FAMILIES.values()
        for mod, g, u, d in first_own(fam.hf_experts, [f.hf_experts for f in every]):
            names = [f"{p}{mod}.{e}.{proj}.weight" for proj in (g, u, d)]
            if names[0] in self._where:
                return names
        return None

    def _packed_expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's gate (I, H / 32 * 17), up and down (H, I / 32 * 17) as ggml's MXFP4 rows, read from its slice
        of the packed stacks alone."""
        p = self._packed(layer)
        gate_up, down = (from_openai(self._slice(f"{p}{proj}_blocks", e), self._slice(f"{p}{proj}_scales", e),
                                     f"{p}{proj}_blocks") for proj in PACKED)
        if FAMILIES[self.config.family].hf_interleaved:
            return gate_up[0::2], gate_up[1::2], down
        inter = self.config.moe_intermediate_size
        return gate_up[:inter], gate_up[inter:], down

    def _slice(self, name: str, e: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[e]

    def _fused_expert(self, gate_up: str, down: str, e: int):
        if self._is_fp8(gate_up) or self._is_fp8(down):
            raise UserError(f"{gate_up} is an FP8 stack of every expert; moestream reads FP8 experts stored one "
                            "tensor each (as the published FP8 checkpoints are)")
        inter = self.config.moe_intermediate_size          # the stacks' shapes were checked at open
        gu, dn = self._where[gate_up].get_slice(gate_up), self._where[down].get_slice(down)
        pair = gu[e]
        if FAMILIES[self.config.family].hf_interleaved:    # (H, 2I): gate and up in alternate columns; down (I, H)
            return pair[:, ::2].t().contiguous(), pair[:, 1::2].t().contiguous(), dn[e].t().contiguous()
        return pair[:inter], pair[inter:], dn[e]                   # (2I, H): gate rows, then up rows


def _check_quantization(qc) -> None:
    """config.json's quantization_config: none, OpenAI's MXFP4 (quant_method mxfp4: its experts are the packed
    *_blocks / *_scales, read as they are, and modules_to_not_convert the float rest), or FP8 blocks (quant/fp8.py
    checks those, and names anything else in one line)."""
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        return
    fp8.check_quantization_config(qc)


def _fused_bias(cfg: ModelConfig, name: str) -> bool:
    """Whether `name` is an expert bias that HF keeps fused beside its stacks (gpt-oss's gate_up_proj_bias,
    down_proj_bias), not a tensor of its own."""
    return FAMILIES[cfg.family].hf_interleaved and name.endswith(tuple(f"{s}.bias" for s in EXPERT_STACKS))


def _canonical_shape_of(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape tensor() gives an HF tensor of this shape: the conv as (C, K), the shared expert's gate as (1, H)."""
    if name.endswith(("ssm_conv1d.weight", "ple_conv1d.weight")) and shape:
        return (shape[0], math.prod(shape[1:]))
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return (1, math.prod(shape))
    return shape


def _suffix(name: str) -> str:
    """A canonical name as hybrid_names' values take it: a layer's suffix (`attn_norm.weight`), or a global name."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def _read_json(path: Path, required_as: str | None) -> dict | None:
    """A JSON object as a dict; None when the file is absent and optional (`required_as` None)."""
    if not path.exists():
        if required_as is None:
            return None
        raise UserError(f"{str(path.parent)!r} has no {required_as}: is it a Hugging Face model directory?")
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{str(path)!r} is not valid JSON ({e}): download it again") from None
    if not isinstance(d, dict):
        raise UserError(f"{str(path)!r} holds a JSON {type(d).__name__}, not an object: download it again")
    return d


# --- writing -------------------------------------------------------------------------------------------------
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


def _tensors(source):
    """(HF name, tensor) for every tensor, made one at a time, layer by layer so that a shard holds whole layers."""
    cfg = source.config
    names = [n for n in dense_names(cfg) if not _fused_bias(cfg, n)]
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
    return hf_value(cfg, _suffix(name), t, source.dtype_of(name) if name.endswith("norm.weight") else None)


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
