"""FP8 block-scaled weights, as DeepSeek-V3/R1, Kimi K2, GLM-4.5 and Qwen3's FP8 checkpoints ship them
(transformers' FineGrainedFP8: `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`): a matrix
(R, C) in float8 e4m3 with a float32 `weight_scale_inv` of (ceil(R / 128), ceil(C / 128)), one a block, the edge
blocks partial; a value is `fp8.float() * scale_inv[r // 128, c // 128]`, one float32 product.

    w = dequantize(weight, scale_inv)          # (R, C) float8_e4m3fn, (ceil R/128, ceil C/128) -> (R, C) float32
    data = pack(weight, scale_inv)             # (matrix_bytes(R, C),) uint8: one matrix in an expert row
    w = dequantize_packed(rows, R, C)          # (n, >= matrix_bytes) uint8 -> (n, R, C) float32
    check_quantization_config(config_json.get("quantization_config"))   # a UserError for anything but FP8 blocks

In an expert row (quant/layout.py) `FP8` stands where a GGML type does: a matrix is its R C bytes of e4m3, then its
scales, row-major, each part padded to 16 bytes (the scales' float32 loads and a staged copy's 128-bit words stay
aligned; at real shapes, multiples of 128, there is no padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UserError

BLOCK = 128                      # the block's rows and columns (weight_block_size)
E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True, repr=False)
class BlockFP8:
    """The expert-row type of FP8 block-scaled matrices (a GGML type's peer in ExpertLayout.types); every instance
    is equal (copies and pickles of a layout compare equal)."""
    name: ClassVar[str] = "FP8"

    def __repr__(self) -> str:
        return "FP8"


FP8 = BlockFP8()


def is_fp8(t) -> bool:
    return isinstance(t, BlockFP8)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // BLOCK), -(-cols // BLOCK)


def scale_offset(rows: int, cols: int) -> int:
    """Byte offset of a packed matrix's scales: its values' bytes, padded to 16."""
    return _pad16(rows * cols)


def matrix_bytes(rows: int, cols: int) -> int:
    """Bytes of one packed (rows, cols) matrix: e4m3 values then float32 scales, each padded to 16."""
    sr, sc = scale_shape(rows, cols)
    return scale_offset(rows, cols) + _pad16(4 * sr * sc)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """(..., R, C) e4m3 and (..., ceil R/128, ceil C/128) scales -> (..., R, C) float32: the oracle."""
    R, C = weight.shape[-2:]
    if tuple(scale_inv.shape[-2:]) != scale_shape(R, C):
        raise ValueError(f"scales {tuple(scale_inv.shape)} do not fit a ({R}, {C}) weight in blocks of {BLOCK}")
    s = scale_inv.float().repeat_interleave(BLOCK, -2)[..., :R, :].repeat_interleave(BLOCK, -1)[..., :C]
    return weight.float() * s


def pack(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """One matrix as an expert row holds it: (matrix_bytes(R, C),) uint8."""
    R, C = weight.shape
    if weight.dtype != E4M3 or tuple(scale_inv.shape) != scale_shape(R, C):
        raise ValueError(f"pack takes an e4m3 ({R}, {C}) weight and its {scale_shape(R, C)} scales, got "
                         f"{weight.dtype} and {tuple(scale_inv.shape)}")
    out = torch.zeros(matrix_bytes(R, C), dtype=torch.uint8)
    out[:R * C] = weight.reshape(-1).view(torch.uint8)
    off = scale_offset(R, C)
    out[off:off + 4 * scale_inv.numel()] = scale_inv.float().reshape(-1).view(torch.uint8)
    return out


def unpack(data: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, >= matrix_bytes) uint8 -> (n, R, C) e4m3 and (n, ceil R/128, ceil C/128) float32 scales (copies)."""
    n = data.shape[0]
    sr, sc = scale_shape(rows, cols)
    off = scale_offset(rows, cols)
    weight = data[:, :rows * cols].contiguous().view(E4M3).view(n, rows, cols)
    scales = data[:, off:off + 4 * sr * sc].contiguous().view(torch.float32).view(n, sr, sc)
    return weight, scales


def dequantize_packed(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(n, >= matrix_bytes) uint8 of packed matrices -> (n, R, C) float32."""
    return dequantize(*unpack(data, rows, cols))


def scale_name(name: str) -> str:
    """The scales' tensor name of FP8 tensor `name` (x.weight: x.weight_scale_inv)."""
    return name[:-len("weight")] + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def scales_of(name: str, shape: tuple[int, ...], scale: torch.Tensor | None) -> torch.Tensor:
    """FP8 tensor `name`'s scales as float32, checked against its shape; one line naming it where they are absent
    or are not its 128 x 128 blocks'."""
    if scale is None:
        raise UserError(f"FP8 tensor {name} has no {scale_name(name)} (its block scales); the checkpoint is "
                        "incomplete or not a block-scaled FP8 one")
    if len(shape) != 2 or tuple(scale.shape) != scale_shape(*shape):
        raise UserError(f"{scale_name(name)} is {tuple(scale.shape)}, not the {BLOCK} x {BLOCK} blocks of {name} "
                        f"{shape}; moestream reads FP8 matrices in blocks of [{BLOCK}, {BLOCK}]")
    return scale.float()


def check_quantization_config(qc) -> None:
    """A config.json's quantization_config: none, or FP8 e4m3 in 128 x 128 blocks (what moestream reads); one
    line naming anything else."""
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise UserError(f"config.json's quantization_config is {method or qc!r}; moestream reads float, FP8 "
                        "block-scaled (quant_method fp8, weight_block_size [128, 128]) and OpenAI's MXFP4 "
                        "(quant_method mxfp4) checkpoints: use one of those, or a GGUF")
    block, fmt = qc.get("weight_block_size"), qc.get("fmt", "e4m3")
    if block is None or list(block) != [BLOCK, BLOCK] or fmt != "e4m3":
        raise UserError(f"config.json's FP8 quantization_config has weight_block_size {block} and fmt {fmt!r}; "
                        f"moestream reads e4m3 in blocks of [{BLOCK}, {BLOCK}]")
