"""Torch quantizers, one per GGML type, vectorised over blocks (CPU or CUDA): what the quantize tool encodes with.

    q = quantize(w, Q.Q4_K)                    # w (..., n) float -> (..., n // 256 * 144) uint8, ggml's blocks
    q, v = quantize(w, Q.Q4_K, values=True)    # v (..., n) float32: what the blocks decode to

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 (quant/mxfp4.py) are bit-identical to gguf.quants.quantize (itself ggml's
quantize_row_*_ref; MXFP4's scale is floor(log2 max |x|), where torch's and C's float32 log2 could round apart).
Q4_K, Q5_K and Q6_K follow ggml's reference (non-imatrix) quantizers, quantize_row_q{4,5,6}_K_ref with
make_qkx2_quants / make_qx_quants (Q2_K and Q3_K likewise, in quantize_k23.py), and IQ4_NL / IQ4_XS follow
quantize_row_iq4_nl_impl, with an imatrix's weights when one is given (as the IQ1/IQ2 types of quantize_iq.py):
each search ggml runs one block at a time runs here for all blocks at once, one candidate scale per step. The float
results may differ from ggml's in the last bits (the order of sums), never the layout: gguf.quants.dequantize of the
bytes gives `values`.

Rows are encoded a chunk at a time (`CHUNK` values on the CPU, IQ_CHUNK for the IQ1/IQ2 types, `CUDA_CHUNK` on a
GPU), so the temporaries of the searches stay bounded whatever the tensor: a layer's whole expert stack can be
passed at once.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ..errors import UserError
from .encoding import (GROUP_MAX_EPS, abs_max, as_bytes, bit_planes, f16_bytes, f16_value, inverse, make_qkx2,
                       nibbles, pack_bits, roundf, two_bits)
from .mxfp4 import encode_mxfp4
from .quantize_iq import NEED_IMPORTANCE, TYPES as IQ_TYPES, encode as iq_encode
from .quantize_k23 import q2_k, q3_k

CHUNK = 1 << 20
IQ_CHUNK = 1 << 16      # the IQ1/IQ2 searches' temporaries are wider: smaller chunks stay in cache (3x faster)
CUDA_CHUNK = 1 << 24
# IQ4_NL's 16 non-uniform levels (ggml's kvalues_iq4nl), and the midpoints between them: a value's nearest level is
# the number of midpoints at or below it (a tie goes to the upper level, as ggml's best_index_int8 picks it).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def quantize(x: torch.Tensor, qtype: Q, values: bool = False, importance: torch.Tensor | None = None):
    """x (..., n) float -> (..., n / block * type_size) uint8 blocks of qtype on x's device (and, with values,
    the float32 (..., n) they decode to).

    importance: llama-quantize's per-column imatrix, (n,) for every row or x.shape[:-2] + (n,) (one per expert of a
    stack); the types whose ggml quantizers moestream follows with quant_weights use it (WEIGHTED: the IQ types),
    the others ignore it.
    """
    encode = ENCODERS.get(qtype)
    if encode is None and qtype not in WEIGHTED:
        raise UserError(f"moestream cannot quantize to {qtype.name}; it can to "
                        f"{', '.join(t.name for t in (*ENCODERS, *IQ_TYPES))}")
    if importance is None and qtype in NEED_IMPORTANCE:
        raise UserError(f"{qtype.name} needs an importance matrix (llama.cpp's quantizer asserts one): make one with "
                        "`moestream imatrix` and pass --imatrix FILE")
    block, size = GGML_QUANT_SIZES[qtype]
    n = x.shape[-1]
    if n % block:
        raise UserError(f"a row of {n} values is not whole {qtype.name} blocks of {block}")
    rows = x.reshape(-1, n)
    imp = None
    if qtype in WEIGHTED and importance is not None:
        lead = x.shape[:-2] if importance.dim() > 1 else ()
        imp = importance.to(x.device, torch.float32).reshape(*lead, *([1] * (x.dim() - 1 - len(lead))), n)
        imp = imp.expand(x.shape).reshape(-1, n)
    out = torch.empty((rows.shape[0], n // block * size), dtype=torch.uint8, device=x.device)
    vals = torch.empty(rows.shape, dtype=torch.float32, device=x.device) if values else None
    step = max(1, (CUDA_CHUNK if x.is_cuda else IQ_CHUNK if qtype in IQ_TYPES else CHUNK) // n)
    for i in range(0, rows.shape[0], step):
        chunk = rows[i:i + step]
        blocks = chunk.reshape(-1, block).float()
        if imp is not None or encode is None:
            qw = None if imp is None else imp[i:i + step].reshape(-1, block)
            q, v = WEIGHTED[qtype](blocks, qw)
        else:
            q, v = encode(blocks)                                   # (B, type_size), (B, block)
        out[i:i + step] = q.reshape(chunk.shape[0], -1)
        if values:
            vals[i:i + step] = v.reshape(chunk.shape)
    out = out.reshape(*x.shape[:-1], -1)
    return (out, vals.reshape(x.shape)) if values else out


# --- 32-value blocks: bit-identical to gguf.quants -----------------------------------------------------------
def _q8_0(x):
    d = x.abs().amax(-1, keepdim=True) / 127
    q = roundf(x * inverse(d))
    return torch.cat([f16_bytes(d), q.to(torch.int8).view(torch.uint8)], -1), f16_value(d) * q


def _symmetric(x, levels: int):
    """Q4_0 / Q5_0: d = the signed largest value / -levels/2, codes trunc(x/d + levels/2 + 0.5) in [0, levels)."""
    _, mx = abs_max(x)
    d = mx / -(levels // 2)
    q = (x * inverse(d) + (levels // 2 + 0.5)).trunc().clamp(0, levels - 1)
    return d, q


def _affine(x, levels: int):
    """Q4_1 / Q5_1: min and step (max - min) / (levels - 1), codes trunc((x - min)/d + 0.5) in [0, levels)."""
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (mx - mn) / (levels - 1)
    q = ((x - mn) * inverse(d) + 0.5).trunc().clamp(0, levels - 1)
    return d, mn, q


def _q4_0(x):
    d, q = _symmetric(x, 16)
    return torch.cat([f16_bytes(d), nibbles(q[:, :16], q[:, 16:])], -1), f16_value(d) * (q - 8)


def _q5_0(x):
    d, q = _symmetric(x, 32)
    qs = nibbles(q[:, :16], q[:, 16:])
    return torch.cat([f16_bytes(d), pack_bits(q.int() >> 4), qs], -1), f16_value(d) * (q - 16)


def _q4_1(x):
    d, m, q = _affine(x, 16)
    return (torch.cat([f16_bytes(d), f16_bytes(m), nibbles(q[:, :16], q[:, 16:])], -1),
            f16_value(d) * q + f16_value(m))


def _q5_1(x):
    d, m, q = _affine(x, 32)
    qs = nibbles(q[:, :16], q[:, 16:])
    return (torch.cat([f16_bytes(d), f16_bytes(m), pack_bits(q.int() >> 4), qs], -1),
            f16_value(d) * q + f16_value(m))


# --- k-quants ------------------------------------------------------------------------------------------------
def _make_qx(x, nmax: int):
    """ggml's make_qx_quants with rmse_type 1 and no imatrix (weights x^2): a signed scale for rows of x (G, n),
    x ~ scale * (L - nmax), L in [0, 2 nmax), the best of 19 steps around -nmax / (signed largest x)."""
    amax, mx = abs_max(x)
    zero = amax < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x

    def fit(iscale):
        l = (iscale * x).round().clamp(-nmax, nmax - 1)
        return l, (w * x * l).sum(-1, keepdim=True), (w * l * l).sum(-1, keepdim=True)

    l, sumlx, suml2 = fit(-nmax / mx)
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        la, slx, sl2 = fit(-(nmax + 0.1 * step) / mx)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        l = torch.where(better, la, l)
        scale = torch.where(better, slx / sl2, scale)
        best = torch.where(better, scale * slx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale.squeeze(-1), torch.where(zero, torch.zeros_like(l), l + nmax)


def _k_scales(x, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Q4_K / Q5_K's codes for super-blocks x (B, 256): 8 sub-blocks of 32, each a 6-bit step and min times the
    super-block's float16 d and dmin. Returns d, dmin (B, 1), ls, lm (B, 8), L (B, 256), values (B, 256)."""
    B = x.shape[0]
    xs = x.reshape(B * 8, 32)
    w = (xs * xs).mean(-1, keepdim=True).sqrt() + xs.abs()
    scales, mins, L = make_qkx2(xs, w, nmax, rmin, rdelta, nstep)
    scales, mins, L = scales.reshape(B, 8), mins.reshape(B, 8), L.reshape(B, 8, 32)
    max_scale = scales.amax(-1, keepdim=True).clamp(min=0)
    max_min = mins.amax(-1, keepdim=True).clamp(min=0)
    ls = (torch.where(max_scale > 0, 63 / max_scale, torch.zeros_like(max_scale)) * scales).round().clamp(0, 63)
    lm = (torch.where(max_min > 0, 63 / max_min, torch.zeros_like(max_min)) * mins).round().clamp(0, 63)
    d, dmin = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    dl = (d.float() * ls).unsqueeze(-1)             # (B, 8, 1): each sub-block's step and min as decoded
    ml = (dmin.float() * lm).unsqueeze(-1)
    xs = x.reshape(B, 8, 32)
    requant = ((xs + ml) / torch.where(dl == 0, torch.ones_like(dl), dl)).round().clamp(0, nmax)
    L = torch.where(dl == 0, L, requant)
    return d, dmin, ls.int(), lm.int(), L.int().reshape(B, 256), (dl * L - ml).reshape(B, 256)


def _k_scale_bytes(ls, lm):
    """ggml's 12 bytes of eight 6-bit (step, min) pairs: low 6 bits of pairs 0-3, their top 2 bits carrying
    the high bits of pairs 4-7, whose low 4 bits fill the last 4 bytes."""
    return as_bytes(torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)], -1))


def _k_low_nibbles(L):
    """(B, 256) codes -> (B, 128): for each 64 values, byte l holds value l (low nibble) and value 32 + l (high)."""
    L = L.reshape(L.shape[0], 4, 2, 32)
    return nibbles(L[:, :, 0], L[:, :, 1]).reshape(L.shape[0], 128)


def _q4_k(x):
    d, dmin, ls, lm, L, v = _k_scales(x, 15, -1.0, 0.1, 20)
    head = torch.cat([d.view(torch.uint8), dmin.view(torch.uint8), _k_scale_bytes(ls, lm)], -1)
    return torch.cat([head, _k_low_nibbles(L)], -1), v


def _q5_k(x):
    d, dmin, ls, lm, L, v = _k_scales(x, 31, -0.5, 0.1, 15)
    head = torch.cat([d.view(torch.uint8), dmin.view(torch.uint8), _k_scale_bytes(ls, lm)], -1)
    # qh: bit 2c (2c + 1) of byte j is the 5th bit of value 64c + j (64c + 32 + j)
    return torch.cat([head, bit_planes(L >> 4), _k_low_nibbles(L)], -1), v


def _q6_k(x):
    B = x.shape[0]
    scales, L = _make_qx(x.reshape(B * 16, 16), 32)
    scales, L = scales.reshape(B, 16), L.reshape(B, 16, 16)
    _, max_scale = abs_max(scales)
    zero = max_scale.abs() < GROUP_MAX_EPS         # the whole super-block is zeros: all its bytes are 0
    iscale = -128 / torch.where(zero, torch.ones_like(max_scale), max_scale)
    d = torch.where(zero, torch.zeros_like(iscale), 1 / iscale).to(torch.float16)
    sc = torch.where(zero, torch.zeros_like(scales), (iscale * scales).round().clamp(max=127))
    dl = (d.float() * sc).unsqueeze(-1)              # (B, 16, 1)
    xs = x.reshape(B, 16, 16)
    requant = (xs / torch.where(dl == 0, torch.ones_like(dl), dl)).round().clamp(-32, 31) + 32
    L = torch.where(dl == 0, torch.where(zero.unsqueeze(-1), torch.zeros_like(L), L), requant).int()
    v = (dl * (L - 32)).reshape(B, 256)
    # each 128 values: ql byte l = value l | value 64 + l << 4, byte 32 + l = value 32 + l | value 96 + l << 4;
    # qh byte l = the top 2 bits of values l, 32 + l, 64 + l, 96 + l
    L = L.reshape(B, 2, 4, 32)
    ql = torch.cat([nibbles(L[:, :, 0], L[:, :, 2]), nibbles(L[:, :, 1], L[:, :, 3])], -1).reshape(B, 128)
    qh = two_bits(L >> 4)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), d.view(torch.uint8)], -1), v


# --- IQ4_NL / IQ4_XS -------------------------------------------------------------------------------------------
def _levels(device) -> tuple[torch.Tensor, torch.Tensor]:
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=device)
    return levels, (levels[:-1] + levels[1:]) / 2


def _iq4_weights(x, qw):
    """quantize_row_iq4_nl_impl's weights: x^2 without an imatrix, else qw sqrt(sigma2 + x^2), sigma2 twice the
    mean square of the super-block x (B, n)."""
    if qw is None:
        return x * x
    sigma2 = (x * x).sum(-1, keepdim=True) * (2 / x.shape[-1])
    return qw * (sigma2 + x * x).sqrt()


def _iq4_scales(x, levels, mids, ntry: int = 7, w=None):
    """quantize_row_iq4_nl_impl's per-32 search, weights w (x^2 without an imatrix): the scale d (G, 1) for which
    d * level[nearest] fits x (G, 32) best, trying the 2 ntry + 1 steps around (level 0 + t) / signed max."""
    amax, mx = abs_max(x)
    zero = amax < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x if w is None else w

    def fit(id_):
        q = levels[torch.bucketize(id_ * x, mids, right=True)]
        return (w * q * x).sum(-1, keepdim=True), (w * q * q).sum(-1, keepdim=True)

    sumqx, sumq2 = fit(1 / (mx / -levels[0]))
    d = sumqx / sumq2
    best = d * sumqx
    for t in range(-ntry, ntry + 1):
        sqx, sq2 = fit((t + levels[0]) / mx)
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = torch.where(better, sqx / sq2, d)
        best = torch.where(better, d * sqx, best)
    return torch.where(zero, torch.zeros_like(d), d)


def _iq4_nibbles(L):
    """(B, n) level indices -> (B, n / 2): in each 32 values, byte j holds value j (low) and 16 + j (high)."""
    L = L.reshape(L.shape[0], -1, 2, 16)
    return nibbles(L[:, :, 0], L[:, :, 1]).reshape(L.shape[0], -1)


def _iq4_nl(x, qw=None):
    levels, mids = _levels(x.device)
    d = _iq4_scales(x, levels, mids, w=_iq4_weights(x, qw))
    L = torch.bucketize(inverse(d) * x, mids, right=True)
    dh = d.to(torch.float16)
    return torch.cat([dh.view(torch.uint8), _iq4_nibbles(L)], -1), dh.float() * levels[L]


def _iq4_xs(x, qw=None):
    B = x.shape[0]
    levels, mids = _levels(x.device)
    scales = _iq4_scales(x.reshape(B * 8, 32), levels, mids, w=_iq4_weights(x, qw).reshape(B * 8, 32)).reshape(B, 8)
    _, max_scale = abs_max(scales)
    d = -max_scale / 32                            # (B, 1); the sub-blocks' 6-bit scales in [-32, 32) times d
    l = (inverse(d) * scales).round().clamp(-32, 31)
    dl = (d * l).unsqueeze(-1)                     # (B, 8, 1), float32 as ggml picks the levels with it
    L = torch.bucketize(inverse(dl) * x.reshape(B, 8, 32), mids, right=True).reshape(B, 256)
    dh = d.to(torch.float16)
    v = ((dh.float() * l).unsqueeze(-1) * levels[L].reshape(B, 8, 32)).reshape(B, 256)
    u = l.int() + 32
    scales_l = nibbles(u[:, 0::2], u[:, 1::2])                               # (B, 4)
    scales_h = ((u >> 4) << torch.arange(0, 16, 2, device=x.device, dtype=torch.int32)).sum(-1, keepdim=True)
    scales_h = as_bytes(torch.cat([scales_h & 255, scales_h >> 8], -1))          # a little-endian uint16
    return torch.cat([dh.view(torch.uint8), scales_h, scales_l, _iq4_nibbles(L)], -1), v


ENCODERS: dict[Q, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q2_K: q2_k, Q.Q3_K: q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.MXFP4: encode_mxfp4,
}
# the types whose quantizers take the imatrix: (blocks, importance or None) -> (bytes, values)
WEIGHTED = {**{t: functools.partial(iq_encode, qtype=t) for t in IQ_TYPES}, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}
