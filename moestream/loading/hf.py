"""Hugging Face directories: config.json + safetensors (one file, or shards with an index), read lazily.

    src = HFSource("Qwen3-30B-A3B/")                 # opens every shard's header; reads no weights
    src.tensor("blk.0.attn_q.weight")                # model.layers.0.self_attn.q_proj.weight
    gate, up, down = src.expert(0, 3)                # model.layers.0.mlp.experts.3.{gate,up,down}_proj.weight
    write_hf(src, "out/")                            # the reverse, loadable by transformers

Experts are hf_experts.py's (HFExperts, a base class of HFSource): one tensor per expert and projection, fused
stacks, gpt-oss's interleaved ones, OpenAI's packed MXFP4, FP8 block-scaled; the HF spellings of canonical names are
hf_names.py's, the writer (write_hf, hf_config) hf_write.py's. Each family's spellings and config.json keys are its
entry in arch/families.py.

The hybrid families (Qwen3-Next, Qwen3.5-MoE) hold other values than HF's (1 + w norms, -exp(A_log), the conv as
(C, K)): arch/hybrid_names.py's canonical_value turns HF's into them, and hf_value back, so that they read back as
the same bits. (A float32 checkpoint written again gets its norms' w back as fl(1 + w) - 1, within 2**-24, and may
get another float32 A_log of the same -exp: what transformers and this reader compute from them is unchanged.)
An FP8 checkpoint (quant/fp8.py: e4m3 weights, each with its 128 x 128 blocks' `weight_scale_inv`) hands out its
dense tensors and `expert()` widened to float32 (the loader rounds them once to the model's dtype), and its experts
as their FP8 bytes (`expert_types`, `expert_bytes`), which the engine keeps as they are from the file to the slot.
"""
from __future__ import annotations

import json
import math
import os
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from ..arch.families import FAMILIES
from ..arch.hf_config import config_from_hf, hf_key
from ..arch.hybrid_names import canonical_value
from ..arch.names import check_shape, dense_names, optional_names
from ..errors import UserError
from ..quant import fp8
from .hf_experts import HFExperts
from .hf_names import INDEX, fused_bias, hf_names, layer_suffix
from .hf_write import hf_config, write_hf  # noqa: F401  (callers import the writer from here)


class HFSource(HFExperts):
    """A WeightSource over a Hugging Face model directory (its experts' methods: hf_experts.py's HFExperts)."""

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
        if self.config.nextn_layers and not self.has(f"blk.{self.config.n_layers}.nextn.eh_proj.weight"):
            self.config = self.config.replace(nextn_layers=0)   # announced, not shipped (transformers drops mtp.*)
        self._check_shapes()

    def _check_shapes(self) -> None:
        """Every tensor's shape (from the safetensors headers, no data read) against the one config.json makes, as
        tensor() and expert() would hand it out; one line naming the keys and the tensor where they disagree."""
        cfg = self.config
        for name in dense_names(cfg) + optional_names(cfg):
            if fused_bias(cfg, name):
                continue                      # checked with its stack: _check_experts
            hf = next((n for n in hf_names(name, cfg.family, self.prefix, cfg.n_layers) if n in self._where), None)
            if hf is not None:                # a missing one is named when it is read
                self._check(name, hf, _canonical_shape_of(name, self._shape(hf)))
        self._check_experts()

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
        if fused_bias(self.config, name):      # gpt-oss: gate_up_proj_bias (E, 2I) alternates gate and up
            return self._expert_bias(name)
        if name == "per_layer_token_embd.weight" or name.endswith(("indexer.q_proj.weight", "indexer.k_proj.weight")):
            t = self._ple_table() if name.startswith("per_layer") else self._indexer(name)
            self._check(name, name, tuple(t.shape))
            return t
        t = self._read_first(hf_names(name, self.config.family, self.prefix, self.config.n_layers), name)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(1, -1)                 # some exports keep the shared expert's gate as (H,)
        # hybrid families: zero-centred norms as 1 + w, -exp(A_log), the conv as (C, K) (arch/hybrid_names.py)
        return canonical_value(self.config, layer_suffix(name), t)

    def rows(self, name: str) -> torch.Tensor:
        """A host table (arch/names.py's HOST_TABLES) read by row: the tensor itself."""
        return self.tensor(name)

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

    def _scale_inv(self, name: str) -> torch.Tensor:
        """The block scales of FP8 tensor `name`, float32 (quant/fp8.py's scales_of: one line where absent)."""
        scale = fp8.scale_name(name)
        shape = tuple(self._where[name].get_slice(name).get_shape())
        return fp8.scales_of(name, shape, self._where[scale].get_tensor(scale) if scale in self._where else None)


def _check_quantization(qc) -> None:
    """config.json's quantization_config: none, OpenAI's MXFP4 (quant_method mxfp4: its experts are the packed
    *_blocks / *_scales, read as they are, and modules_to_not_convert the float rest), or FP8 blocks (quant/fp8.py
    checks those, and names anything else in one line)."""
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        return
    fp8.check_quantization_config(qc)


def _canonical_shape_of(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape tensor() gives an HF tensor of this shape: the conv as (C, K), the shared expert's gate as (1, H)."""
    if name.endswith(("ssm_conv1d.weight", "ple_conv1d.weight")) and shape:
        return (shape[0], math.prod(shape[1:]))
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return (1, math.prod(shape))
    return shape


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

