"""The pieces ggml's quantizers share, for quantize.py and quantize_k23.py: byte packings in ggml's layouts,
rounding and division as C computes them (so the codes match ggml's bit for bit), and make_qkx2_quants.

    q = two_bits(L)                            # (B, 256) 2-bit codes -> (B, 64) bytes, Q2_K's and Q3_K's qs
    scale, mn, L = make_qkx2(x, w, 15, -1.0, 0.1, 20)    # x (G, n): a step and a min per row, codes in [0, 15]
"""
from __future__ import annotations

import struct

import torch

GROUP_MAX_EPS = 1e-15       # ggml's: a group whose largest |x| is below this is all zero


def f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 (B, k) -> its float16 rounding's bytes (B, 2k), little-endian as ggml stores a ggml_fp16_t."""
    return t.to(torch.float16).contiguous().view(torch.uint8)


def f16_value(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).float()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(B, 8k) 0/1 integers -> (B, k) bytes, bit i of byte j being bits[8j + i] (ggml's little-endian masks)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    return as_bytes((bits.reshape(bits.shape[0], -1, 8).int() << shifts).sum(-1))


def bit_planes(bits: torch.Tensor) -> torch.Tensor:
    """(B, 256) 0/1 integers -> (B, 32) bytes, bit b of byte m being value 32 b + m (Q5_K's qh, Q3_K's hmask)."""
    planes = bits.reshape(bits.shape[0], 8, 32) << torch.arange(8, device=bits.device, dtype=torch.int32).view(1, 8, 1)
    return as_bytes(planes.sum(1))


def two_bits(L: torch.Tensor) -> torch.Tensor:
    """(B, 256) 2-bit codes -> (B, 64) bytes: in each 128 values, byte l holds values l, 32 + l, 64 + l, 96 + l from
    its lowest bits up (Q2_K's and Q3_K's qs, Q6_K's qh)."""
    L = L.reshape(L.shape[0], 2, 4, 32)
    shifts = torch.arange(0, 8, 2, device=L.device, dtype=torch.int32).view(1, 1, 4, 1)
    return as_bytes((L << shifts).sum(2)).reshape(L.shape[0], 64)


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), computed the way gguf's np_roundf does, for Q8_0's bit-exactness."""
    a = v.abs()
    f = a.floor()
    return v.sign() * (f + (2 * (a - f)).floor())


def abs_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest |x| of each row and the signed value that has it (the first, as ggml's strict `>` scan)."""
    amax, i = x.abs().max(-1, keepdim=True)
    return amax, x.gather(-1, i)


def div(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t rounded once, as C divides (torch's `c / t` is c * (1 / t), which rounds twice: a code that ggml
    rounds from an exact half would then round the other way now and then)."""
    return torch.full_like(t, c) / t


def f32(v: float) -> float:
    """v rounded to float32, for constants that ggml computes in float (0.1f * step)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return as_bytes((lo.int() & 15) | ((hi.int() & 15) << 4))


def make_qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False):
    """ggml's make_qkx2_quants for rows of x (G, n) with weights w: a step and a min (x ~ scale * L - min, L in
    [0, nmax]) that minimise the weighted squared error (absolute error with use_mad, as Q2_K asks), trying
    nstep + 1 steps around nmax / (max - min). Returns scale (G,), min (G,) (>= 0, subtracted) and L (G, n)."""
    def error(scale, L, mn):
        diff = scale * L + mn - x
        return (w * (diff.abs() if use_mad else diff * diff)).sum(-1, keepdim=True)

    mn = x.amin(-1, keepdim=True).clamp(max=0)
    mx = x.amax(-1, keepdim=True)
    flat = mx == mn
    mx = torch.where(flat, mn + 1, mx)
    sum_w, sum_x = w.sum(-1, keepdim=True), (w * x).sum(-1, keepdim=True)
    iscale = div(nmax, mx - mn)
    L = (iscale * (x - mn)).round().clamp(0, nmax)
    scale = 1 / iscale
    best = error(scale, L, mn)
    for step in range(nstep + 1):
        # ggml's loop reads the min it has kept so far, so each step starts from the best fit before it
        top = f32(f32(rmin + f32(f32(rdelta) * step)) + nmax)     # rmin + rdelta * step + nmax, in float
        La = (div(top, mx - mn) * (x - mn)).round().clamp(0, nmax)
        wl = w * La
        sl, sl2, sxl = wl.sum(-1, keepdim=True), (wl * La).sum(-1, keepdim=True), (wl * x).sum(-1, keepdim=True)
        D = sum_w * sl2 - sl * sl
        this_scale = (sum_w * sxl - sum_x * sl) / D
        this_min = (sl2 * sum_x - sl * sxl) / D
        positive = this_min > 0         # a positive min is clamped to 0 and the step refitted alone
        this_scale = torch.where(positive, sxl / sl2, this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        err = error(this_scale, La, this_min)
        better = (D > 0) & (err < best)
        L, best = torch.where(better, La, L), torch.where(better, err, best)
        scale, mn = torch.where(better, this_scale, scale), torch.where(better, this_min, mn)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    L = torch.where(flat, torch.zeros_like(L), L)
    return scale.squeeze(-1), -mn.squeeze(-1), L
