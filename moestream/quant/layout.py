"""One layer's expert row: gate (I, H) | up (I, H) | down (H, I), in the file's types, contiguous.

    lay = ExpertLayout(inter=768, hidden=2048, types=(Q.Q4_K, Q.Q4_K, Q.Q6_K))
    lay.nbytes                          # 3_060_... bytes of one expert: what a slot holds and an upload moves
    w13, w2 = lay.dequantize(rows)      # rows (n, >= nbytes) uint8 -> (n, 2I, H), (n, H, I) float32
    layouts = expert_layouts(source, cfg)   # {moe layer: ExpertLayout}: a checkpoint's, float or its GGUF blocks

A float layout (`types=None`) is the typed rows the engine has always had: rows (n, 3*I*H) of the model's dtype,
read as views (`views`). A quantized layout holds each matrix's GGUF blocks as they are in the file, row after row
(ggml's layout: a row of H values is H / block_size blocks); F16, BF16 and F32 matrices inside a quantized layout
are their raw bytes. An FP8 checkpoint's layout has `FP8` (quant/fp8.py) for each matrix: its e4m3 bytes, then its
128 x 128 blocks' float32 scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

from . import fp8
from .types import FLOAT, row_bytes


def matrix_bytes(t, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) matrix of type t (a GGML type or FP8) in an expert row."""
    return fp8.matrix_bytes(rows, cols) if fp8.is_fp8(t) else rows * row_bytes(t, cols)


def dequantize_matrix(data: torch.Tensor, t, rows: int, cols: int) -> torch.Tensor:
    """data (n, >= bytes) uint8 of matrices of type t -> (n, rows, cols) float32, by the plain-torch dequantizers."""
    if fp8.is_fp8(t):
        return fp8.dequantize_packed(data, rows, cols)
    from .dequant import dequantize
    return dequantize(data[:, :matrix_bytes(t, rows, cols)].reshape(data.shape[0], rows, -1), t)


@dataclass(frozen=True)
class ExpertLayout:
    inter: int
    hidden: int
    types: tuple[Q, Q, Q] | None = None      # (gate, up, down) GGML types or FP8; None: rows of the model's dtype

    @property
    def quantized(self) -> bool:
        return self.types is not None

    @property
    def fp8(self) -> bool:
        """Whether the matrices are FP8 block-scaled (all three: an FP8 checkpoint's experts)."""
        return self.quantized and all(fp8.is_fp8(t) for t in self.types)

    @property
    def numel(self) -> int:
        return 3 * self.inter * self.hidden

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Bytes of gate, up and down (quantized layouts)."""
        (g, u, d), I, H = self.types, self.inter, self.hidden
        return matrix_bytes(g, I, H), matrix_bytes(u, I, H), matrix_bytes(d, H, I)

    @property
    def offsets(self) -> tuple[int, int, int]:
        """Byte offset of gate, up and down within a row (quantized layouts)."""
        g, u, _ = self.sizes
        return 0, g, g + u

    @property
    def nbytes(self) -> int:
        """Bytes of one quantized expert row (for a float layout: elements; use element_size)."""
        return sum(self.sizes) if self.quantized else self.numel

    def row_bytes_for(self, dtype: torch.dtype) -> int:
        return self.nbytes if self.quantized else self.numel * torch.empty((), dtype=dtype).element_size()

    def views(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float layouts: stacked gate|up (n, 2I, H) and down (n, H, I), views into rows (n, 3*I*H)."""
        assert not self.quantized, "a quantized layout has no float views: dequantize"
        n, split = rows.shape[0], 2 * self.inter * self.hidden
        return rows[:, :split].view(n, 2 * self.inter, self.hidden), rows[:, split:].view(n, self.hidden, self.inter)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (n, >= nbytes) uint8 -> w13 (n, 2I, H), w2 (n, H, I) of dtype, by the plain-torch dequantizers
        (float32, then one rounding to dtype)."""
        I, H = self.inter, self.hidden
        (og, ou, od), (sg, su, sd) = self.offsets, self.sizes
        g, u, d = self.types
        gate = dequantize_matrix(rows[:, og:og + sg], g, I, H).to(dtype)
        up = dequantize_matrix(rows[:, ou:ou + su], u, I, H).to(dtype)
        w2 = dequantize_matrix(rows[:, od:od + sd], d, H, I).to(dtype)
        return torch.cat([gate, up], dim=1), w2


def describe(layouts: dict[int, ExpertLayout], row_bytes: dict[int, int], file_types: dict[str, int] | None = None) -> str:
    """One line for a user: the file's tensor types, each expert stack's types by layer count, bytes per expert.

    describe(store.layouts, {l: store.layer_bytes(l) ...}) ->
        "file: Q4_K 217, F32 121, Q6_K 37; experts: Q4_K/Q4_K/Q6_K in 9 layers, Q4_K/Q4_K/Q4_K in 15; 2.65-3.06 MB each"
    """
    from collections import Counter
    mix = Counter("/".join(t.name for t in lay.types) if lay.quantized else "float" for lay in layouts.values())
    sizes = sorted(set(row_bytes.values()))
    per = f"{sizes[0] / 1e6:.2f} MB" if len(sizes) == 1 else f"{sizes[0] / 1e6:.2f}-{sizes[-1] / 1e6:.2f} MB"
    experts = ", ".join(f"{k} in {n} layer{'s' * (n > 1)}" for k, n in mix.most_common())
    head = ""
    if file_types:
        head = "file: " + ", ".join(f"{t} {n}" for t, n in sorted(file_types.items(), key=lambda kv: -kv[1])) + "; "
    return f"{head}experts (gate/up/down): {experts}; {per} per expert"


def expert_layouts(source, cfg) -> dict[int, ExpertLayout]:
    """Each MoE layer's expert row (an ExpertLayout): float rows of the model's dtype, or, where any layer of a GGUF
    has quantized expert stacks, every layer's GGUF blocks as they are in the file (an FP8 checkpoint: every
    layer's FP8 matrices)."""
    types = {l: source.expert_types(l) for l in cfg.expert_layers}
    quantized = any(t is not None and any(q not in FLOAT for q in t) for t in types.values())
    if quantized and any(t is None for t in types.values()):
        from ..errors import UserError
        mixed = [l for l, t in types.items() if t is None]
        raise UserError(f"the experts of layers {mixed} are float while other layers' are quantized; moestream reads "
                        "a checkpoint whose experts are all quantized or all float")
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    return {l: ExpertLayout(I, H, types[l] if quantized else None) for l in cfg.expert_layers}
