"""Plain-torch dequantizers of the IQ types (dequant.py's other half; call them through dequant.dequantize).

    IQ_DEQUANTIZERS[Q.IQ2_XS](blocks)   # blocks (n, 74) uint8 -> (n, 256) float32

The IQ types index tables instead of storing quants: IQ4_NL and IQ4_XS a 16-entry non-linear codebook, the others
a grid of 4 or 8 values per index and, for IQ2_XXS, IQ2_XS and IQ3_XXS, a 128-entry table of 8 sign bits with even
parity (ksigns). The tables are gguf.quants' own, made torch tensors once per device.
"""
from __future__ import annotations

import functools

import gguf.quants
import torch
from gguf import GGMLQuantizationType as Q

from .fields import fields, halves, planes, shifts, u16, u32


@functools.cache
def _grid(qtype: Q, device: torch.device) -> torch.Tensor:
    """qtype's grid (entries, 4 or 8) float32 on device, as gguf.quants decodes it from its hex string."""
    cls = getattr(gguf.quants, qtype.name)
    cls.init_grid()
    return torch.tensor(cls.grid.reshape(cls.grid_shape), dtype=torch.float32, device=device)


@functools.cache
def _ksigns(device: torch.device) -> torch.Tensor:
    """(128,) uint8: 7 sign bits -> 8 (the eighth makes the parity even)."""
    return torch.tensor(list(gguf.quants.IQ2_XXS.ksigns), dtype=torch.uint8, device=device)


@functools.cache
def _kvalues(device: torch.device) -> torch.Tensor:
    """(16,) float32: IQ4_NL's and IQ4_XS's codebook."""
    return torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.float32, device=device)


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """(..., m) bytes of sign bits -> (..., m, 8) float32 of +1 (bit clear) and -1 (bit set)."""
    return 1 - 2 * fields(bits, 1, 8).float()


def _signs7(aux: torch.Tensor) -> torch.Tensor:
    """(n, g) u32 -> (n, g, 4, 8): signs from the four 7-bit ksigns indices in each one's low 28 bits."""
    return _signs(_ksigns(aux.device)[fields(aux, 7, 4)])


def _sub_scales(scales: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 2k) uint8: the 4-bit sub-block scales, low nibble first."""
    return fields(scales, 4, 2).flatten(1)


def _iq4_nl(b):
    n = b.shape[0]
    d, qs = halves(b[:, :2]), b[:, 2:]
    q = planes(qs, 4, 2).reshape(n, 32)                                        # (n, 32)
    return d * _kvalues(b.device)[q.long()]


def _iq4_xs(b):
    n = b.shape[0]
    d, scales_h, scales_l, qs = halves(b[:, :2]), u16(b[:, 2:4]), b[:, 4:8], b[:, 8:]
    low = _sub_scales(scales_l)                                                 # (n, 8)
    high = fields(scales_h, 2, 8).reshape(n, 8)
    dl = (d * ((low | (high << 4)).float() - 32))[..., None]                   # (n, 8, 1)
    q = planes(qs.reshape(n, 8, 16), 4, 2).reshape(n, 8, 32)                   # (n, 8, 32)
    return (dl * _kvalues(b.device)[q.long()]).reshape(n, 256)


def _iq2_xxs(b):
    n = b.shape[0]
    d, groups = halves(b[:, :2]), b[:, 2:].reshape(n, 8, 8)                   # 8 groups of 32 values
    aux = u32(groups[..., 4:])[..., 0]                                         # (n, 8): sign indices, scale
    db = (d * (0.5 + (aux >> 28).float()) * 0.25)[..., None, None]             # (n, 8, 1, 1)
    grid = _grid(Q.IQ2_XXS, b.device)[groups[..., :4].long()]                   # (n, 8, 4, 8)
    return (db * grid * _signs7(aux)).reshape(n, 256)


def _iq2_xs(b):
    n = b.shape[0]
    d, qs, scales = halves(b[:, :2]), u16(b[:, 2:66]), b[:, 66:]              # qs (n, 32)
    db = (d * (0.5 + _sub_scales(scales).float()) * 0.25)[..., None, None]     # (n, 16, 1, 1)
    signs = _signs(_ksigns(b.device)[(qs >> 9).long()]).reshape(n, 16, 2, 8)
    grid = _grid(Q.IQ2_XS, b.device)[(qs & 511).long()].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _iq2_s(b):
    n = b.shape[0]
    d, qs, sign_bits, qh, scales = halves(b[:, :2]), b[:, 2:34], b[:, 34:66], b[:, 66:74], b[:, 74:]
    db = (d * (0.5 + _sub_scales(scales).float()) * 0.25)[..., None, None]     # (n, 16, 1, 1)
    signs = _signs(sign_bits).reshape(n, 16, 2, 8)
    index = qs.long() | (fields(qh, 2, 4).reshape(n, 32).long() << 8)          # (n, 32) 10-bit
    grid = _grid(Q.IQ2_S, b.device)[index].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _iq3_xxs(b):
    n = b.shape[0]
    d, qs, aux = halves(b[:, :2]), b[:, 2:66], u32(b[:, 66:])                 # aux (n, 8)
    db = (d * (0.5 + (aux >> 28).float()) * 0.5)[..., None, None]              # (n, 8, 1, 1)
    grid = _grid(Q.IQ3_XXS, b.device)[qs.long()].reshape(n, 8, 4, 8)
    return (db * grid * _signs7(aux)).reshape(n, 256)


def _iq3_s(b):
    n = b.shape[0]
    d, qs, qh, sign_bits, scales = halves(b[:, :2]), b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:]
    db = (d * (1 + 2 * _sub_scales(scales)).float())[..., None, None]          # (n, 8, 1, 1)
    signs = _signs(sign_bits).reshape(n, 8, 4, 8)
    index = qs.long() | (fields(qh, 1, 8).reshape(n, 64).long() << 8)          # (n, 64) 9-bit
    grid = _grid(Q.IQ3_S, b.device)[index].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _iq1_s(b):
    n = b.shape[0]
    d, qs, qh = halves(b[:, :2]), b[:, 2:34], u16(b[:, 34:])                  # qh (n, 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float())[..., None, None]             # (n, 8, 1, 1)
    delta = (0.125 - 0.25 * (qh >> 15).float())[..., None, None]               # +-1/8, by the top bit
    index = qs.long() | (fields(qh, 3, 4).reshape(n, 32).long() << 8)          # (n, 32) 11-bit
    grid = _grid(Q.IQ1_S, b.device)[index].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, 256)


def _iq1_m(b):
    n = b.shape[0]
    qs, qh, scales = b[:, :32], b[:, 32:48], u16(b[:, 48:])                    # scales (n, 4)
    # The one f16 d is the top nibbles of the four u16 scales, lowest first.
    bits = ((scales >> 12) << shifts(4, 4, torch.int32, b.device)).sum(-1, keepdim=True)         # (n, 1)
    d = halves(torch.cat([bits & 0xFF, bits >> 8], dim=-1).to(torch.uint8))    # (n, 1)
    dl = (d * (2 * fields(scales, 3, 4).reshape(n, 16) + 1).float()).reshape(n, 8, 2, 1, 1)
    nibbles = fields(qh, 4, 2)                                                 # (n, 16, 2)
    index = qs.long() | ((nibbles & 7).reshape(n, 32).long() << 8)              # (n, 32) 11-bit
    delta = (0.125 - 0.25 * (nibbles >> 3).float()).reshape(n, 8, 2, 2, 1)     # +-1/8, by each nibble's top bit
    grid = _grid(Q.IQ1_M, b.device)[index].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, 256)


IQ_DEQUANTIZERS = {Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s,
                   Q.IQ3_XXS: _iq3_xxs, Q.IQ3_S: _iq3_s, Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m}
