"""Reading GGML blocks: little-endian fields, as ggml writes them and gguf.quants' numpy views read them. Shared
by the dequantizers of dequant.py and dequant_iq.py.

    d = halves(blocks[:, :2])            # (n, 2) uint8 -> (n, 1) float32: each block's f16 scale
    q = planes(blocks[:, 2:], 4, 2)      # (n, 16) uint8 -> (n, 2, 16): low nibbles, then high nibbles
"""
from __future__ import annotations

import functools

import torch


def view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., k * itemsize) uint8 -> (..., k) of dtype: the same bytes, copied where they are not contiguous or start
    off dtype's alignment (a field inside a block does)."""
    flat = b.reshape(-1)
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype).reshape(*b.shape[:-1], b.shape[-1] // dtype.itemsize)


def halves(b: torch.Tensor) -> torch.Tensor:
    """(n, 2k) uint8 -> (n, k) float32: f16 fields, converted exactly."""
    return view(b, torch.float16).float()


def u16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2k) uint8 -> (..., k) int32: u16 fields (torch has no full uint16, so int32 holds them)."""
    return view(b, torch.int16).int() & 0xFFFF


def u32(b: torch.Tensor) -> torch.Tensor:
    """(..., 4k) uint8 -> (..., k) int64: u32 fields."""
    return view(b, torch.int32).long() & 0xFFFFFFFF


def fields(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """x (..., m) integers -> (..., m, count): each one's `count` fields of `width` bits, lowest first."""
    return (x.unsqueeze(-1) >> shifts(width, count, x.dtype, x.device)) & ((1 << width) - 1)


def planes(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """x (..., m) integers -> (..., count, m): plane j holds field j of every one (ggml's layout of quants: the
    low nibbles of 32 bytes are 32 values, the high nibbles the next 32)."""
    return (x.unsqueeze(-2) >> shifts(width, count, x.dtype, x.device)[:, None]) & ((1 << width) - 1)


@functools.cache
def shifts(width: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(0, width * count, width).to(dtype=dtype, device=device)       # (count,)
