"""Plain-torch dequantizers, one per GGML type: the CPU path and every test's oracle.

    w = dequantize(data, Q.Q4_K)       # data (..., nbytes) uint8 -> (..., n) float32, bit-identical to gguf.quants
    data = random_blocks(Q.Q4_K, 8)    # (8 * 144,) uint8: valid blocks with sane f16 scales, for tests

Each dequantizer takes blocks (n, type_size) uint8 and returns (n, block_size) float32, on the blocks' device, with
torch ops alone. Each one follows its gguf.quants counterpart's float32 operations in their order (`d * q - dm` is
not `(q - m) * d` in float32), so the bits match; the integer unpacking around them is free to differ. Large inputs
go through in chunks of CHUNK_VALUES values, which bound the intermediates and do not change the results (each
block is dequantized on its own). The IQ types are in dequant_iq.py.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ..errors import UserError
from .dequant_iq import IQ_DEQUANTIZERS
from .fields import fields, halves, planes, u16, view
from .mxfp4 import dequantize_mxfp4
from .types import FLOAT, LOADABLE, names

# Values dequantized at once: bounds the float32 intermediates (16 MiB each, a handful live at a time). On the CPU
# 4M values a chunk ran 1.3x faster than 16M.
CHUNK_VALUES = 1 << 22


def dequantize(data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """data (..., nbytes) uint8 of whole blocks -> (..., nbytes // type_size * block_size) float32, on data's
    device (a new tensor, also for F32). A UserError for a type with no dequantizer."""
    fn = _dequantizer(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    if data.dtype != torch.uint8 or data.dim() == 0 or data.shape[-1] % size:
        raise ValueError(f"{qtype.name} data must be uint8 (..., k * {size}), got {data.dtype} {tuple(data.shape)}")
    blocks = data.reshape(-1, size)                                              # (n, type_size)
    n = blocks.shape[0]
    out = torch.empty(n, block, dtype=torch.float32, device=data.device)        # (n, block_size)
    step = max(1, CHUNK_VALUES // block)
    for start in range(0, n, step):
        out[start:start + step] = fn(blocks[start:start + step])
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * block)


def random_blocks(qtype: Q, n_blocks: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n_blocks * type_size,) uint8 on the CPU: random valid blocks of qtype. Every f16 scale is finite with
    |d| in [1e-3, 1], so the values dequantize finite; the other bits (quants, sub-block scales, grid and sign
    indices) are uniform, all of them valid; MXFP4's e8m0 scale is 2**-10 to 2**1. Float types are normal random
    values."""
    _dequantizer(qtype)                                                         # a UserError for any other type
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOAT:
        dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        return torch.randn(n_blocks * block, generator=generator).to(dtype).view(torch.uint8)
    blocks = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, generator=generator)   # (n, type_size)
    if qtype == Q.IQ1_M:
        # IQ1_M's one f16 scale is spread over the top nibbles of its four u16 sub-block scales (bytes 48..56).
        d = u16(_sane_halves(n_blocks, generator))                             # (n, 1) the f16's bits
        s = u16(blocks[:, 48:56])                                              # (n, 4)
        s = (s & 0x0FFF) | (fields(d, 4, 4).squeeze(1) << 12)
        blocks[:, 48:56] = torch.stack([s & 0xFF, s >> 8], dim=-1).reshape(n_blocks, 8).to(torch.uint8)
    elif qtype == Q.MXFP4:
        # an e8m0 scale 2**(e - 128) in [2**-10, 2**1]: finite values of a weight's size
        blocks[:, 0] = torch.randint(118, 130, (n_blocks,), dtype=torch.uint8, generator=generator)
    else:
        for offset in _SCALE_OFFSETS.get(qtype, (0,)):
            blocks[:, offset:offset + 2] = _sane_halves(n_blocks, generator)
    return blocks.reshape(-1)


def _dequantizer(qtype: Q):
    fn = _DEQUANTIZERS.get(qtype) or IQ_DEQUANTIZERS.get(qtype)
    if fn is None or qtype not in LOADABLE:
        raise UserError(f"no dequantizer for GGML type {getattr(qtype, 'name', qtype)}; "
                        f"the types that work: {names()}")
    return fn


def _sane_halves(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """(n, 2) uint8: n f16 values of random sign with |d| in [1e-3, 1], log-uniform."""
    magnitude = 10 ** (-3 * torch.rand(n, generator=generator))
    sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    return (magnitude * sign).half().view(torch.uint8).reshape(n, 2)


# The byte offsets of each block's f16 scales (d, and dmin or m where the type has one), for random_blocks; a type
# not named has one f16 d first.
_SCALE_OFFSETS = {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2),
                  Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


# --- float types: their raw bytes, reinterpreted ---

def _f32(b):
    return view(b, torch.float32)                                              # (n, 1)


def _f16(b):
    return halves(b)                                                           # (n, 1)


def _bf16(b):
    return (view(b, torch.int16).int() << 16).view(torch.float32)             # (n, 1): bf16 is f32's top half


# --- 32-value blocks: an f16 d (and m), then the quants ---

def _q8_0(b):
    d, x = halves(b[:, :2]), b[:, 2:].view(torch.int8).float()                # (n, 1), (n, 32)
    return x * d


def _q4_0(b):
    d, q = halves(b[:, :2]), planes(b[:, 2:], 4, 2).flatten(1)               # (n, 1), (n, 32)
    return d * (q.float() - 8)


def _q4_1(b):
    d, m, q = halves(b[:, :2]), halves(b[:, 2:4]), planes(b[:, 4:], 4, 2).flatten(1)
    return (d * q.float()) + m


def _q5(qh, qs):
    """The 5-bit quants (n, 32): 4 bits from qs's nibbles, the fifth from bit i of the u32 qh."""
    return planes(qs, 4, 2).flatten(1) | (fields(qh, 1, 8).flatten(1) << 4)


def _q5_0(b):
    d, q = halves(b[:, :2]), _q5(b[:, 2:6], b[:, 6:])
    return d * (q.float() - 16)


def _q5_1(b):
    d, m, q = halves(b[:, :2]), halves(b[:, 2:4]), _q5(b[:, 4:8], b[:, 8:])
    return (d * q.float()) + m


# --- K-quants: 256-value super-blocks of 16 or 8 sub-blocks, each with its own scale ---

def _q2_k(b):
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], halves(b[:, 80:82]), halves(b[:, 82:84])
    dl = (d * (scales & 0xF).float())[..., None]                                # (n, 16, 1)
    ml = (dmin * (scales >> 4).float())[..., None]                              # (n, 16, 1)
    q = planes(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16).float()          # (n, 16, 16)
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], halves(b[:, 108:110])
    # 16 6-bit scales: low 4 bits from the nibbles of bytes 0..8, high 2 bits from the pairs of bytes 8..12.
    low = planes(scales[:, :8], 4, 2).reshape(n, 16)
    high = planes(scales[:, 8:], 2, 4).reshape(n, 16)
    dl = (d * ((low | (high << 4)).float() - 32))[..., None]                    # (n, 16, 1)
    ql = planes(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    qh = planes(hmask, 1, 8).reshape(n, 16, 16) ^ 1                            # a set hmask bit means no -4
    q = (ql.to(torch.int16) - (qh << 2)).float()                                # (n, 16, 16)
    return (dl * q).reshape(n, 256)


def _scale_min(scales):
    """(n, 12) uint8 -> the 8 6-bit scales and 8 6-bit mins (n, 8) of Q4_K and Q5_K."""
    d, m, md = scales.reshape(-1, 3, 4).unbind(1)                               # (n, 4) each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b):
    n = b.shape[0]
    d, dmin, (sc, mn), qs = halves(b[:, :2]), halves(b[:, 2:4]), _scale_min(b[:, 4:16]), b[:, 16:]
    d = (d * sc.float())[..., None]                                             # (n, 8, 1)
    dm = (dmin * mn.float())[..., None]                                         # (n, 8, 1)
    q = planes(qs.reshape(n, 4, 32), 4, 2).reshape(n, 8, 32).float()           # (n, 8, 32)
    return (d * q - dm).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    d, dmin, (sc, mn) = halves(b[:, :2]), halves(b[:, 2:4]), _scale_min(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    d = (d * sc.float())[..., None]                                             # (n, 8, 1)
    dm = (dmin * mn.float())[..., None]
    ql = planes(qs.reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
    q = (ql | (planes(qh, 1, 8) << 4)).float()                                 # (n, 8, 32)
    return (d * q - dm).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(torch.int8), halves(b[:, 208:])
    d = (d * scales.float())[..., None]                                         # (n, 16, 1)
    ql = planes(ql.reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
    qh = planes(qh.reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).float() - 32).reshape(n, 16, 16)
    return (d * q).reshape(n, 256)


_DEQUANTIZERS = {Q.F32: _f32, Q.F16: _f16, Q.BF16: _bf16, Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1,
                 Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k,
                 Q.Q6_K: _q6_k, Q.MXFP4: dequantize_mxfp4}
