"""Q2_K and Q3_K, the 2- and 3-bit k-quants, as torch quantizers vectorised over super-blocks of 256 values.

    from moestream.quant.quantize import quantize
    q, v = quantize(w, Q.Q3_K, values=True)    # w (..., n) -> (..., n // 256 * 110) uint8 and what they decode to

Both follow ggml's reference (non-imatrix) quantizers in ggml-quants.c, 16 sub-blocks of 16 values a super-block:
- Q2_K (quantize_row_q2_K_ref): make_qkx2_quants per sub-block (levels 0..3, weights |x|, the weighted absolute
  error, 16 steps from -0.5 by 0.1), each sub-block's step and min as 4-bit multiples of float16 d and dmin.
- Q3_K (quantize_row_q3_K_ref): make_q3_quants per sub-block (levels -4..3, weights x^2, then up to 5 passes that
  move one level at a time while the weighted fit improves), the signed steps as 6-bit multiples of float16 d,
  taken against the step of largest magnitude; the levels' third bit in hmask, their low 2 bits in qs.
ggml's loops run one sub-block at a time; here every step runs for all sub-blocks at once. The float sums may
differ from ggml's in the last bits (their order), never the layout: gguf.quants.dequantize of the bytes gives
`values`. quantize.ENCODERS holds them; the helpers they share with quantize.py are in encoding.py.
"""
from __future__ import annotations

import torch

from .encoding import GROUP_MAX_EPS, abs_max, as_bytes, bit_planes, div, make_qkx2, two_bits


def q2_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Super-blocks x (B, 256) -> Q2_K blocks (B, 84): scales (16), qs (64), d, dmin; and their values (B, 256)."""
    B = x.shape[0]
    xs = x.reshape(B * 16, 16)
    scales, mins, L = make_qkx2(xs, xs.abs(), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins, L = scales.reshape(B, 16), mins.reshape(B, 16), L.reshape(B, 16, 16)
    max_scale = scales.amax(-1, keepdim=True).clamp(min=0)         # (B, 1): the steps are positive, as the mins
    max_min = mins.amax(-1, keepdim=True).clamp(min=0)
    zero = torch.zeros_like(max_scale)
    # ggml rounds the 4-bit codes without a clamp and stores them in one byte, the min's shifted over the step's
    ls = (torch.where(max_scale > 0, div(15, max_scale), zero) * scales).round().int()
    lm = (torch.where(max_min > 0, div(15, max_min), zero) * mins).round().int()
    sc = (ls & 255) | ((lm << 4) & 255)                               # (B, 16)
    d = torch.where(max_scale > 0, max_scale / 15, zero).to(torch.float16)
    dmin = torch.where(max_min > 0, max_min / 15, zero).to(torch.float16)
    dl = (d.float() * (sc & 15)).unsqueeze(-1)                       # (B, 16, 1): each sub-block's step and min
    ml = (dmin.float() * (sc >> 4)).unsqueeze(-1)
    requant = ((x.reshape(B, 16, 16) + ml) / torch.where(dl == 0, torch.ones_like(dl), dl)).round().clamp(0, 3)
    L = torch.where(dl == 0, L, requant)                              # a zero step keeps the search's codes
    v = (dl * L - ml).reshape(B, 256)
    L = L.int().reshape(B, 256)
    return torch.cat([as_bytes(sc), two_bits(L), d.view(torch.uint8), dmin.view(torch.uint8)], -1), v


def _make_q3(x: torch.Tensor, nmax: int = 4, passes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_q3_quants with do_rmse for rows of x (G, n): levels l in [-nmax, nmax) from the scale -nmax /
    (signed largest x), then passes over the values, each moving l[i] to x[i] / (the fit's scale without it) when
    the weighted (x^2) fit sum(w x l)^2 / sum(w l^2) improves. Returns the fit's scale (G,) and L = l + nmax (G, n),
    both 0 for a row whose largest |x| is below GROUP_MAX_EPS (ggml leaves its L at 0, not nmax)."""
    amax, mx = abs_max(x)
    zero = (amax < GROUP_MAX_EPS).squeeze(-1)
    mx = torch.where(amax < GROUP_MAX_EPS, torch.ones_like(mx), mx)
    l = (div(-nmax, mx) * x).round().clamp(-nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx, suml2 = (wx * l).sum(-1), (w * l * l).sum(-1)              # (G,)
    for _ in range(passes):
        # ggml stops a row after a pass that changed nothing; such a pass changes nothing again, so running every
        # row to the last pass (or until no row changes) gives ggml's codes
        changed = torch.zeros_like(zero)
        for i in range(x.shape[-1]):
            li = l[:, i]
            slx = sumlx - wx[:, i] * li
            sl2 = suml2 - w[:, i] * li * li
            new = (x[:, i] * sl2 / slx).round().clamp(-nmax, nmax - 1)
            slx_new = slx + wx[:, i] * new
            sl2_new = sl2 + w[:, i] * new * new
            better = ((slx > 0) & (new != li) & (sl2_new > 0)
                      & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            l[:, i] = torch.where(better, new, li)
            sumlx = torch.where(better, slx_new, sumlx)
            suml2 = torch.where(better, sl2_new, suml2)
            changed |= better
        if not changed.any():
            break
    scale = torch.where((suml2 > 0) & ~zero, sumlx / suml2, torch.zeros_like(suml2))
    return scale, torch.where(zero.unsqueeze(-1), torch.zeros_like(l), l + nmax)


def q3_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Super-blocks x (B, 256) -> Q3_K blocks (B, 110): hmask (32), qs (64), scales (12), d; and their values."""
    B = x.shape[0]
    scales, L = _make_q3(x.reshape(B * 16, 16))
    scales, L = scales.reshape(B, 16), L.reshape(B, 16, 16)
    _, max_scale = abs_max(scales)                                    # (B, 1), signed
    some = max_scale != 0
    iscale = torch.where(some, div(-32, max_scale), torch.zeros_like(max_scale))
    # 6-bit codes ls - 32 in [-32, 32); all 0 (a step of -32 d, d = 0) when every step is 0
    ls = torch.where(some, (iscale * scales).round().clamp(-32, 31) + 32, torch.zeros_like(scales)).int()
    d = torch.where(some, div(1, iscale), torch.zeros_like(iscale)).to(torch.float16)
    dl = (d.float() * (ls - 32)).unsqueeze(-1)                        # (B, 16, 1): each sub-block's signed step
    requant = (x.reshape(B, 16, 16) / torch.where(dl == 0, torch.ones_like(dl), dl)).round().clamp(-4, 3) + 4
    L = torch.where(dl == 0, L, requant)                              # a zero step keeps the search's codes
    v = (dl * (L - 4)).reshape(B, 256)
    L = L.int().reshape(B, 256)
    hmask = bit_planes(L >> 2)                                       # bit b of byte m: value 32 b + m's third bit
    # scales: bytes 0-7 the low 4 bits of codes 0-7 (low nibble) and 8-15 (high nibble); byte 8 + m the top 2 bits
    # of codes m, 4 + m, 8 + m, 12 + m from its lowest bits up
    low = as_bytes((ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4))
    top = (ls >> 4).reshape(B, 4, 4) << torch.arange(0, 8, 2, device=x.device, dtype=torch.int32).view(1, 4, 1)
    return torch.cat([hmask, two_bits(L & 3), low, as_bytes(top.sum(1)), d.view(torch.uint8)], -1), v
