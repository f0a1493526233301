"""What every loader produces: a WeightSource, read lazily by canonical (GGUF) tensor name.

    src = open_source("synth:tiny")            # or a Hugging Face directory, or a .gguf file
    src.config                                  # ModelConfig
    src.tensor("blk.0.attn_q.weight")           # torch.Tensor (out, in), on the CPU, the file's float dtype
    gate, up, down = src.expert(layer=0, e=3)   # (I, H), (I, H), (H, I)
    src.expert_types(0)                         # None, or the GGML types of a GGUF's quantized expert stacks
    src.expert_bytes(0, 3)                      # ... and then expert 3's raw blocks (uint8), gate | up | down
    src.rows("per_layer_token_embd.weight")     # a host table read by row (a GGUF's from its map)

Tensor names are the canonical ones listed in moestream/arch/names.py (GGUF's).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..config import ModelConfig
from ..errors import UserError


class WeightSource(Protocol):
    config: ModelConfig
    tokenizer: object | None        # moestream.text.tokenizer.Tokenizer, or None: prompts are token ids

    def has(self, name: str) -> bool: ...
    def tensor(self, name: str) -> torch.Tensor: ...
    def rows(self, name: str) -> object: ...     # a host table read by row: a tensor, or gguf.py's MappedRows
    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def expert_types(self, layer: int) -> tuple | None: ...
    def expert_bytes(self, layer: int, e: int) -> torch.Tensor: ...
    def dtype_of(self, name: str) -> torch.dtype | None: ...


HF_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json")


def open_source(model: str, progress: bool = True) -> WeightSource:
    """A model spec as users write it: `synth:NAME`, a Hugging Face directory, or a `.gguf` file."""
    if model.startswith("synth:"):
        from .synth import SynthSource
        return SynthSource.from_spec(model[len("synth:"):])
    path = Path(model)
    if not path.exists():
        raise UserError(f"model not found: {model!r}; give a Hugging Face directory, a .gguf file or synth:NAME "
                        "(moestream make-model writes one)")
    if path.is_dir():
        from .hf import HFSource
        return HFSource(path)
    if path.suffix == ".safetensors" or path.name in HF_FILES:        # transformers' -m is the directory
        raise UserError(f"{model!r} is one file of a Hugging Face model; give its directory: -m {str(path.parent)!r}")
    from .gguf import GGUFSource
    return GGUFSource(path)
