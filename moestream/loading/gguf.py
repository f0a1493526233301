"""GGUF files: read memory-mapped with gguf.GGUFReader, written by gguf_write.py.

    src = GGUFSource("Qwen3-30B-A3B-BF16.gguf")    # maps the file; reads metadata, no weights
    gate, up, down = src.expert(0, 3)               # slices expert 3 out of blk.0.ffn_{gate,up,down}_exps

GGUF names are moestream's canonical names already. Experts are stored stacked per layer, (E, I, H) in torch
order; expert() converts only its own slice of the mapped stack, so loading never holds a layer's stack twice.
Tensor types: every type of quant/types.py. Dense tensors (attention, norms, embeddings, output) are returned as
float (F32, F16 and BF16 as they are, quantized types dequantized to float32); expert stacks are also handed out
as their raw blocks (`expert_types`, `expert_bytes`), which the engine keeps quantized from the file to the slot.
Architectures: the families' `gguf_arch` in arch/families.py (qwen3moe, qwen2moe and olmoe, which llama.cpp
stores without permuting Q and K; the hybrid qwen3next and qwen35moe, whose tensors hold the values the math takes,
1 + w norms and ssm_a = -exp(A_log), as llama.cpp's converter writes them, and whose ffn_norm is spelled
post_attention_norm; qwen3next's ssm_in is split into attn_qkv and attn_gate, fused back here, its ssm_ba is HF's,
grouped by key head; qwen35moe's value heads are tiled, grouped back here: arch/hybrid_names.py; deepseek2's
attn_kv_b is split into attn_k_b and attn_v_b, fused back here: arch/mla_names.py).
The metadata's keys, and the ModelConfig they make, are gguf_config.py's (GGUFMetadata, a base class of GGUFSource).
qwen4exp's n-gram table, per_layer_token_embd, is read by row from the map (`rows`): it is never read whole, and
stays in the page cache or on disk (a row gathered from disk costs a page read; the first ubatches of a cold file
pay them).
"""
from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from ..arch.families import BY_GGUF_ARCH
from ..arch.hybrid_names import fuse_qkvz, reorder_v_heads
from ..arch.mla_names import fuse_kv_b
from ..arch.names import EXPERT_STACKS, check_shape, dense_names, optional_names
from ..errors import UserError
from ..quant.types import FLOAT, LOADABLE, names, type_size, block_size
from .gguf_config import GGUFMetadata, damaged


def _to_torch(data: np.ndarray, qtype: Q) -> torch.Tensor:
    """A mapped tensor (or slice of one) as a CPU torch tensor: float types as they are, quantized ones dequantized
    to float32; copies only this slice."""
    if qtype == Q.BF16:      # the reader maps BF16 as uint8 with the last dim doubled
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    if qtype in FLOAT:
        return torch.from_numpy(np.array(data))   # F32, F16: a writable copy (the map is read-only)
    from ..quant.dequant import dequantize
    return dequantize(torch.from_numpy(np.array(data)), qtype)


def _raw(data: np.ndarray) -> torch.Tensor:
    """A mapped tensor slice's bytes, flat uint8 (a copy: the map is read-only)."""
    return torch.from_numpy(np.array(data).reshape(-1).view(np.uint8))


class _Reader(gguf.GGUFReader):
    """gguf's reader, refusing a read past the end of the file: gguf's own hands back an empty array there, so that
    a damaged array length looped (and allocated) once per missing item, for as long as the length said; and an
    array whose items cannot fit in the rest of the file, before its loop reads the tensors' gigabytes as items."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if int(offset) + np.dtype(dtype).itemsize * int(count) > len(self.data):
            raise ValueError(f"a field at byte {int(offset)} runs past the end of the file")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            item = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            least = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}.get(item)      # a length, a type and a length
            least = least or np.dtype(self.gguf_scalar_to_np.get(item, np.uint8)).itemsize
            if orig_offs + 12 + count * least > len(self.data):
                raise ValueError(f"an array of {count} items at byte {orig_offs} runs past the end of the file")
        return super()._get_field_parts(orig_offs, raw_type)


def read_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """A GGUF file's reader (header, metadata and tensor table; the data stays mapped), or one line on what is
    wrong with the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read {str(path)!r}: {e.strerror}") from None
    if magic != b"GGUF":
        raise UserError(f"{str(path)!r} is not a GGUF file (no GGUF magic); give a .gguf file, "
                        "a Hugging Face directory or synth:NAME")
    try:
        return _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise damaged(path, e) from None


class GGUFSource(GGUFMetadata):
    """A WeightSource over one GGUF file (its metadata's methods: gguf_config.py's GGUFMetadata)."""

    def __init__(self, path: str | os.PathLike, target: ModelConfig | None = None):
        """target: the config of the model this file is an MTP head of (--model-draft: a file of the head's block
        blk.{n_layers} and, as llama.cpp's MTP-only files, its own token_embd and output; no trunk layer), which
        the file's metadata must match; its config is then the target's with the file's head."""
        self.path = Path(path)
        self._reader = read_gguf(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._fields = self._values(lambda k: not k.startswith("tokenizer."))
        arch = self._fields.get("general.architecture", "?")
        if arch not in BY_GGUF_ARCH:
            raise UserError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(BY_GGUF_ARCH)}")
        self.arch = arch
        self._spelled = dict(BY_GGUF_ARCH[arch].gguf_renames)      # canonical -> file suffix, where they differ
        for t in self._reader.tensors:
            self._check_tensor(t)
        self.config = self._config() if target is None else self._head_config(target)
        if self.config.ple_layers and target is None:
            self._check_ngram_hash(self.config)
        self._check_shapes()

    def _check_tensor(self, t) -> None:
        """One line for a tensor moestream cannot read: its type, a row that is not whole blocks, short data."""
        if t.tensor_type not in LOADABLE:
            raise UserError(f"tensor {t.name} has type {t.tensor_type.name}, which moestream cannot load; the types "
                            f"that work: {names()} (requantize with llama-quantize --allow-requantize or "
                            "moestream quantize --allow-requantize)")
        shape = [int(d) for d in t.shape]                       # innermost first
        block = block_size(t.tensor_type)
        if shape and shape[0] % block:
            raise UserError(f"tensor {t.name} has rows of {shape[0]} values, not whole {t.tensor_type.name} blocks "
                            f"of {block}: the file is damaged")
        need = int(np.prod(shape)) // block * type_size(t.tensor_type)
        if int(t.n_bytes) < need or t.data.nbytes < need:
            raise UserError(f"tensor {t.name} has {t.data.nbytes} bytes of data but its type and shape need {need}: "
                            "the file is truncated or damaged; download or convert it again")

    def _check_shapes(self) -> None:
        """Every tensor's shape against the one the metadata make, from the tensor table alone (no data read)."""
        names = [*dense_names(self.config), *optional_names(self.config),
                 *(f"blk.{i}.{s}.weight" for i in self.config.expert_layers for s in EXPERT_STACKS)]
        for name in names:
            for part in self._split(name) or (name,):
                file_name = self._file_name(part)
                if file_name not in self._tensors:
                    continue                  # tensor() says which one is missing, when it is read
                shape = self._shape(file_name)
                if name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1:
                    shape = (1, *shape)       # llama.cpp stores the shared expert's gate as (H,) (or (1, H))
                check_shape(self.config, part, shape, tensor=file_name, key=self._key_name,
                            hint="the file is damaged or its keys are wrong")

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._tensors[name].shape.tolist()))   # GGUF lists dims innermost first

    def _head_config(self, target: ModelConfig) -> ModelConfig:
        """`target` with this file's MTP head, or one line on why the file is not a head of that model."""
        nextn, blocks = self._key("nextn_predict_layers", 0), self._key("block_count")
        if BY_GGUF_ARCH[self.arch].name != target.family or blocks != target.n_layers + nextn or not nextn or \
                self._file_name(f"blk.{target.n_layers}.nextn.eh_proj.weight") not in self._tensors:
            raise UserError(f"--model-draft {str(self.path)!r} is not an MTP head of this model (it needs "
                            f"{self.arch}.nextn_predict_layers, block_count = the target's {target.n_layers} layers + "
                            f"its heads, blk.{target.n_layers}.nextn.* and the target's architecture); give the "
                            "head's GGUF or drop --model-draft")
        return target.replace(nextn_layers=nextn)

    @cached_property
    def tokenizer(self):
        model = self._token_field("tokenizer.ggml.model")
        if model in (None, "none"):
            return None                    # llama.cpp's 'none' vocabulary: prompts are token ids
        try:
            from ..text.tokenizer import Tokenizer
        except ModuleNotFoundError as e:
            raise UserError(f"{str(self.path)!r} has a tokenizer but this moestream has no tokenizer module "
                            f"({e}); pass token ids or reinstall moestream") from None
        try:
            return Tokenizer.from_gguf_fields(self._values(lambda k: k.startswith("tokenizer.")))
        except (KeyError, TypeError, ValueError, IndexError) as e:      # fields of the wrong kind, or missing
            raise UserError(f"GGUF {str(self.path)!r} has damaged tokenizer metadata ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}): download or convert it again") from None

    # --- WeightSource ----------------------------------------------------------------------------------------
    def _file_name(self, name: str) -> str:
        """A canonical name as the file spells it (the architecture's renames: arch/families.py)."""
        if name.startswith("blk.") and self._spelled:
            _, layer, suffix = name.split(".", 2)
            return f"blk.{layer}.{self._spelled.get(suffix, suffix)}"
        return name

    def _split(self, name: str) -> tuple[str, str] | None:
        """The attn_qkv and attn_gate that hold ssm_in `name` in a qwen3next file (llama.cpp's converter splits it);
        the attn_k_b and attn_v_b that hold attn_kv_b in a deepseek2 file (older files hold attn_kv_b itself)."""
        if name in self._tensors:
            return None
        layer = name.rsplit(".", 2)[0]
        if name.endswith(".ssm_in.weight") and BY_GGUF_ARCH[self.arch].gguf_split_qkvz:
            return f"{layer}.attn_qkv.weight", f"{layer}.attn_gate.weight"
        if name.endswith(".attn_kv_b.weight") and BY_GGUF_ARCH[self.arch].gguf_split_kv_b:
            return f"{layer}.attn_k_b.weight", f"{layer}.attn_v_b.weight"
        return None

    def has(self, name: str) -> bool:
        split = self._split(name)
        return all(n in self._tensors for n in split) if split else self._file_name(name) in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        split = self._split(name)
        if split:
            fuse = fuse_kv_b if name.endswith(".attn_kv_b.weight") else fuse_qkvz
            return fuse(self.config, *(self.tensor(n) for n in split))
        t = self._tensors.get(self._file_name(name))
        if t is None:
            raise UserError(f"GGUF {str(self.path)!r} lacks tensor {self._file_name(name)}: is the file complete?")
        out = _to_torch(t.data, t.tensor_type)       # its shape checked against the metadata's at open
        if name.endswith("ffn_gate_inp_shexp.weight"):
            out = out.reshape(1, -1)       # llama.cpp stores the shared expert's gate as (H,)
        if BY_GGUF_ARCH[self.arch].gguf_tiled_v:       # qwen35moe: value heads tiled in the file, grouped here
            out = reorder_v_heads(self.config, name, out, tiled=False)
        return out

    def rows(self, name: str) -> "MappedRows":
        """A host table (arch/names.py's HOST_TABLES: the PLE's n-gram rows) read by row from the map."""
        t = self._tensors.get(name)
        if t is None:
            raise UserError(f"GGUF {str(self.path)!r} lacks tensor {name}: is the file complete?")
        return MappedRows(t.data, t.tensor_type, self._shape(name))

    def _stack(self, layer: int, stack: str):
        t = self._tensors.get(f"blk.{layer}.{stack}.weight")
        if t is None:
            raise UserError(f"GGUF {str(self.path)!r} lacks tensor blk.{layer}.{stack}.weight: is the file complete?")
        return t

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e of `layer` as float tensors (I, H), (I, H), (H, I) of the (E, ., .) maps."""
        out = [_to_torch(t.data[e], t.tensor_type) for t in (self._stack(layer, s) for s in EXPERT_STACKS)]
        return out[0], out[1], out[2]

    def expert_types(self, layer: int) -> tuple[Q, Q, Q]:
        """The GGML types of the layer's gate, up and down stacks (where all are float, the engine converts them
        to the model's dtype, as for any float checkpoint; else it keeps the blocks)."""
        return tuple(self._stack(layer, s).tensor_type for s in EXPERT_STACKS)

    def expert_bytes(self, layer: int, e: int) -> torch.Tensor:
        """Expert e of `layer` as its raw blocks: gate | up | down, flat uint8 (quant/layout.py's row)."""
        return torch.cat([_raw(self._stack(layer, s).data[e]) for s in EXPERT_STACKS])

    def stored(self, name: str) -> tuple[Q, np.ndarray]:
        """A tensor as the file stores it, unconverted: its GGML type and its mapped bytes (flat uint8, read where
        used), for a copy bit for bit in another file (write_gguf's `copied`)."""
        t = self._tensors.get(self._file_name(name))
        if t is None:
            raise UserError(f"GGUF {str(self.path)!r} lacks tensor {self._file_name(name)}: is the file complete?")
        return t.tensor_type, t.data.reshape(-1).view(np.uint8)

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds (its type mix)."""
        from collections import Counter
        return dict(Counter(t.tensor_type.name for t in self._reader.tensors))

    def dtype_of(self, name: str) -> torch.dtype | None:
        """The torch dtype of a float tensor; None for a quantized one."""
        t = self._tensors[(self._split(name) or [self._file_name(name)])[0]].tensor_type
        return {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(t)


class MappedRows:
    """A GGUF table read by row (models/ple.py's PLETable takes it as a table): take(rows) copies the mapped blocks
    of those rows only and dequantizes them (float types as they are; quantized ones to float32)."""

    def __init__(self, data: np.ndarray, qtype: Q, shape: tuple[int, int]):
        self.data, self.qtype, self.shape = data, qtype, shape
        self.dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) int64 row ids -> (n, d) rows, on the host."""
        return _to_torch(self.data[rows.numpy()], self.qtype).reshape(len(rows), self.shape[1])
    @property
    def row_bytes(self) -> int:
        """Bytes of one row's blocks in the file."""
        return self.shape[1] // block_size(self.qtype) * type_size(self.qtype)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def copy_into(self, dst: torch.Tensor, chunk: int = 64 << 20) -> None:
        """dst (rows, row_bytes) uint8 <- the rows' blocks as the file holds them, a chunk of bytes at a time (a
        table of tens of GB is never copied whole through a temporary)."""
        step = max(1, chunk // self.row_bytes)
        raw = self.data.reshape(self.shape[0], -1).view(np.uint8)
        for r in range(0, self.shape[0], step):
            dst[r:r + step].copy_(torch.from_numpy(np.array(raw[r:r + step])))
