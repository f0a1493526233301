"""An oracle for moestream/quant/quantize_k23.py: ggml's reference Q2_K and Q3_K quantizers (quantize_row_q2_K_ref,
quantize_row_q3_K_ref in ggml-quants.c) as plain scalar loops, one super-block at a time, in float32 arithmetic
operation by operation as C evaluates it (sums in order, one rounding per operation, round half to even).

    q2_k_block(x) -> bytes    # x: 256 float32 values -> ggml's 84-byte block_q2_K
    q3_k_block(x) -> bytes    # -> ggml's 110-byte block_q3_K

Slow (milliseconds a block) and obvious: what the vectorised quantizers are checked against.
"""
from __future__ import annotations

import numpy as np

f32 = np.float32


def _round(v) -> int:
    """ggml's nearest_int: round half to even."""
    return int(np.rint(f32(v)))


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def _two_bits(L: list[int]) -> bytes:
    """256 codes in 0..3 -> 64 bytes: in each 128 values, byte l holds values l, 32 + l, 64 + l, 96 + l."""
    return bytes(sum(L[128 * h + 32 * k + l] << (2 * k) for k in range(4)) for h in range(2) for l in range(32))


def make_qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """make_qkx2_quants: -> (scale, min subtracted, codes)."""
    n = len(x)
    lo, hi, sum_w, sum_x = x[0], x[0], w[0], f32(w[0] * x[0])
    for i in range(1, n):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w, sum_x = f32(sum_w + w[i]), f32(sum_x + f32(w[i] * x[i]))
    lo = min(lo, f32(0))
    if hi == lo:
        return f32(0), f32(-lo), [0] * n

    def error(scale, L, m):
        e = f32(0)
        for i in range(n):
            d = f32(f32(f32(scale * L[i]) + m) - x[i])
            e = f32(e + f32(w[i] * (abs(d) if use_mad else f32(d * d))))
        return e

    iscale = f32(f32(nmax) / f32(hi - lo))
    scale = f32(f32(1) / iscale)
    L = [_clamp(_round(f32(iscale * f32(x[i] - lo))), 0, nmax) for i in range(n)]
    best = error(scale, L, lo)
    for step in range(nstep + 1):
        iscale = f32(f32(f32(f32(rmin) + f32(f32(rdelta) * step)) + nmax) / f32(hi - lo))   # lo: the best so far
        La = [_clamp(_round(f32(iscale * f32(x[i] - lo))), 0, nmax) for i in range(n)]
        sl = sl2 = sxl = f32(0)
        for i in range(n):
            wl = f32(w[i] * La[i])
            sl, sl2, sxl = f32(sl + wl), f32(sl2 + f32(wl * La[i])), f32(sxl + f32(wl * x[i]))
        D = f32(f32(sum_w * sl2) - f32(sl * sl))
        if D > 0:
            this_scale = f32(f32(f32(sum_w * sxl) - f32(sum_x * sl)) / D)
            this_min = f32(f32(f32(sl2 * sum_x) - f32(sl * sxl)) / D)
            if this_min > 0:
                this_scale, this_min = f32(sxl / sl2), f32(0)
            e = error(this_scale, La, this_min)
            if e < best:
                L, best, scale, lo = La, e, this_scale, this_min
    return scale, f32(-lo), L


def q2_k_block(x: np.ndarray) -> bytes:
    x = x.astype(np.float32)
    scales, mins, L = [], [], []
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        s, m, l = make_qkx2(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
        scales.append(s)
        mins.append(m)
        L += l
    max_scale, max_min = max([f32(0)] + scales), max([f32(0)] + mins)
    sc = [0] * 16
    d = dmin = np.float16(0)
    if max_scale > 0:
        inv = f32(f32(15) / max_scale)
        sc = [_round(f32(inv * s)) & 255 for s in scales]
        d = np.float16(f32(max_scale / f32(15)))
    if max_min > 0:
        inv = f32(f32(15) / max_min)
        sc = [(sc[j] | (_round(f32(inv * mins[j])) << 4)) & 255 for j in range(16)]
        dmin = np.float16(f32(max_min / f32(15)))
    for j in range(16):
        step = f32(f32(d) * (sc[j] & 15))
        if step:
            m = f32(f32(dmin) * (sc[j] >> 4))
            for i in range(16 * j, 16 * j + 16):
                L[i] = _clamp(_round(f32(f32(x[i] + m) / step)), 0, 3)
    return bytes(sc) + _two_bits(L) + d.tobytes() + dmin.tobytes()


def make_q3(x, nmax: int = 4):
    """make_q3_quants with do_rmse: -> (scale, codes + nmax), or (0, zeros) for an all-zero group."""
    n = len(x)
    amax, top = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, top = abs(v), v
    if amax < 1e-15:
        return f32(0), [0] * n
    iscale = f32(f32(-nmax) / top)
    L = [_clamp(_round(f32(iscale * x[i])), -nmax, nmax - 1) for i in range(n)]
    w = [f32(v * v) for v in x]
    sumlx = suml2 = f32(0)
    for i in range(n):
        sumlx, suml2 = f32(sumlx + f32(f32(w[i] * x[i]) * L[i])), f32(suml2 + f32(f32(w[i] * L[i]) * L[i]))
    for _ in range(5):
        changed = False
        for i in range(n):
            slx = f32(sumlx - f32(f32(w[i] * x[i]) * L[i]))
            if slx > 0:
                sl2 = f32(suml2 - f32(f32(w[i] * L[i]) * L[i]))
                new = _clamp(_round(f32(f32(x[i] * sl2) / slx)), -nmax, nmax - 1)
                if new != L[i]:
                    slx, sl2 = f32(slx + f32(f32(w[i] * x[i]) * new)), f32(sl2 + f32(f32(w[i] * new) * new))
                    with np.errstate(over="ignore"):
                        better = sl2 > 0 and f32(f32(slx * slx) * suml2) > f32(f32(sumlx * sumlx) * sl2)
                    if better:
                        L[i], sumlx, suml2, changed = new, slx, sl2, True
        if not changed:
            break
    return (f32(sumlx / suml2) if suml2 > 0 else f32(0)), [l + nmax for l in L]


def q3_k_block(x: np.ndarray) -> bytes:
    x = x.astype(np.float32)
    scales, L = [], []
    amax, max_scale = f32(0), f32(0)
    for j in range(16):
        s, l = make_q3(x[16 * j:16 * j + 16])
        scales.append(s)
        L += l
        if abs(s) > amax:
            amax, max_scale = abs(s), s
    ls, packed, d = [0] * 16, [0] * 12, np.float16(0)
    if max_scale:
        iscale = f32(f32(-32) / max_scale)
        ls = [_clamp(_round(f32(iscale * s)), -32, 31) + 32 for s in scales]
        for j in range(16):
            packed[j % 8] |= (ls[j] & 15) << (0 if j < 8 else 4)
            packed[8 + j % 4] |= (ls[j] >> 4) << (2 * (j // 4))
        d = np.float16(f32(f32(1) / iscale))
    for j in range(16):
        step = f32(f32(d) * (ls[j] - 32))
        if step:
            for i in range(16 * j, 16 * j + 16):
                L[i] = _clamp(_round(f32(x[i] / step)), -4, 3) + 4
    hmask = [0] * 32
    for j in range(256):
        if L[j] > 3:
            hmask[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    return bytes(hmask) + _two_bits(L) + bytes(packed) + d.tobytes()
