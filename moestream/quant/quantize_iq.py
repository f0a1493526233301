"""IQ2_XXS, IQ2_XS, IQ1_S and IQ1_M: ggml's importance-weighted lattice quantizers, vectorised over blocks.

    from moestream.quant.quantize import quantize
    q = quantize(w, Q.IQ1_M, importance=imp)   # w (..., n), imp (n,) or w.shape[:-2] + (n,): llama-quantize's imatrix

Each follows ggml-quants.c (llama.cpp b11549): quantize_row_iq2_xxs_impl, quantize_row_iq2_xs_impl,
quantize_row_iq1_s_impl and quantize_row_iq1_m_impl, with the weights w = importance * sqrt(sigma2 + x^2) they
build from the imatrix (IQ1_M alone also runs without one: w = x^2). ggml runs its searches one group at a time;
here each step runs for every group of the chunk at once:
- IQ2: per 8 values, signs taken out (an even count: the least important one flipped), then a scale search over
  13 (IQ2_XXS) or 19 (IQ2_XS) candidates, each value rounded to 3 levels and the 8 snapped to the grid through
  the lattice's neighbour lists (iq_grids.py), the scale of the best weighted fit kept.
- IQ1: per 32 (IQ1_S) or 16 (IQ1_M) values, the exact search over the two boundaries splitting the sorted values
  into the levels -1, 0, 1 (shifted by +-1/8), then the 8-groups snapped to the grid.
The float sums run in another order than ggml's, so a near tie may go the other way now and then; the layout is
ggml's: gguf.quants.dequantize of the bytes gives what dequant_iq.py gives.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from .dequant_iq import IQ_DEQUANTIZERS
from .encoding import GROUP_MAX_EPS, as_bytes, div, f32
from .iq_grids import Lattice, lattice, nearest_neighbour, pack

DELTA = 0.125           # IQ1S_DELTA, IQ1M_DELTA
EPS_IQ1 = {Q.IQ1_S: 1e-12, Q.IQ1_M: 1e-7}
NEAR = 1e-5             # IQ1 search candidates this close to the best are compared again in ggml's order


def _u32_bytes(v: torch.Tensor) -> torch.Tensor:
    """(..., k) int64 words -> (..., 4k) little-endian bytes."""
    return as_bytes(torch.stack([(v >> s) & 255 for s in (0, 8, 16, 24)], -1).flatten(-2))


def _u16_bytes(v: torch.Tensor) -> torch.Tensor:
    return as_bytes(torch.stack([v & 255, (v >> 8) & 255], -1).flatten(-2))


def _f16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.int16).long() & 0xFFFF


def _seqsum(t: torch.Tensor, start: int) -> torch.Tensor:
    """The sum over dims start.. in float32 as ggml's loops add, one value after the other, (G, 1) (torch's sum
    adds in another order, its cumsum in double)."""
    t = t.flatten(start)
    acc = t[:, :1].clone()
    for i in range(1, t.shape[1]):
        acc += t[:, i:i + 1]
    return acc


def _prefix(t: torch.Tensor) -> torch.Tensor:
    """(G, n) -> (G, n + 1): 0 and the running float32 sums, added in order as ggml does."""
    out = torch.zeros((t.shape[0], t.shape[1] + 1), dtype=t.dtype, device=t.device)
    for i in range(t.shape[1]):
        out[:, i + 1] = out[:, i] + t[:, i]
    return out


def _weights(x: torch.Tensor, qw: torch.Tensor, sigma_scale: float) -> torch.Tensor:
    """ggml's qw * sqrt(sigma2 + x^2), sigma2 the super-block's mean square (times sigma_scale)."""
    sigma2 = sigma_scale * _seqsum(x * x, 1) / x.shape[-1]
    return qw * (sigma2 + x * x).sqrt()


# --- IQ2_XXS, IQ2_XS ------------------------------------------------------------------------------------------
def _signs(xb: torch.Tensor, w: torch.Tensor):
    """xb, w (G, k, 8) -> |xb| with the least important value negated when the count of negatives is odd (so the
    signs have even parity, 7 bits enough), and the 7 sign bits (G, k)."""
    neg = xb < 0
    xval = xb.abs()
    odd = neg.sum(-1) % 2 == 1
    flip = torch.nn.functional.one_hot((w * xb * xb).argmin(-1), 8).bool() & odd.unsqueeze(-1)
    xval = torch.where(flip, -xval, xval)
    bits = (neg ^ flip).long() << torch.arange(8, device=xb.device)
    return xval, bits.sum(-1) & 127


def _make_qp(x: torch.Tensor, w: torch.Tensor, nmax: int = 4) -> torch.Tensor:
    """ggml's make_qp_quants for rows x (G, n), weights w: the scale of x ~ scale * l, l in [0, nmax]. As ggml,
    the levels are kept in uint8 (a negative one wraps)."""
    mx = x.amax(-1, keepdim=True).clamp(min=0)
    safe = torch.where(mx < GROUP_MAX_EPS, torch.ones_like(mx), mx)
    iscale = div(nmax, safe)
    stored = (iscale * x).round() % 256
    scale = 1 / iscale
    diff = x - scale * stored
    best = _seqsum(w * diff * diff, 1)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_s = div(f32(f32(f32(0.1) * step) + nmax), safe)
        l = (iscale_s * x).round().clamp(max=nmax)
        diff = x - div(1, iscale_s) * l
        mse = _seqsum(w * diff * diff, 1)
        better = mse < best
        best, iscale = torch.where(better, mse, best), torch.where(better, iscale_s, iscale)
    l = (iscale * x).round().clamp(max=nmax)
    L = l % 256
    sumlx, suml2 = _seqsum(w * x * l, 1).squeeze(-1), _seqsum(w * l * l, 1).squeeze(-1)
    for _ in range(5):
        changed = torch.zeros_like(sumlx, dtype=torch.bool)
        for i in range(x.shape[-1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = (xi * sl2 / torch.where(ok, slx, torch.ones_like(slx))).round().clamp(max=nmax)
            slx_n, sl2_n = slx + wi * xi * new, sl2 + wi * new * new
            better = ok & (new != li) & (slx_n * slx_n * suml2 > sumlx * sumlx * sl2_n)
            L[:, i] = torch.where(better, new % 256, li)
            sumlx, suml2 = torch.where(better, slx_n, sumlx), torch.where(better, sl2_n, suml2)
            changed |= better
        if not changed.any():
            break
    zero = (mx < GROUP_MAX_EPS).squeeze(-1)
    return torch.where((suml2 > 0) & ~zero, sumlx / suml2, torch.zeros_like(sumlx))


def _snap(lat: Lattice, L: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
          values: torch.Tensor, only: torch.Tensor | None = None):
    """Groups of levels L (G, k, 8) onto the grid: (grid points (G, k), levels (G, k, 8), on-grid (G, k)). An
    off-grid group (among `only`) takes its best neighbour for x, w at scale (G, 1) and level values (3,)."""
    u = pack(L)
    gi = lat.index[u]
    on = gi >= 0
    off = ~on if only is None else ~on & only
    if off.any():
        rows = off.nonzero(as_tuple=True)
        s = scale.expand(-1, L.shape[1])[rows].unsqueeze(-1)
        nb = nearest_neighbour(lat, u[rows], x[rows], w[rows], s, values.expand(len(rows[0]), 3))
        gi = gi.index_put(rows, nb)
        L = L.index_put(rows, lat.levels[nb].to(L.dtype))
    return gi, L, on


def _iq2(x: torch.Tensor, qw: torch.Tensor, qtype: Q):
    """Super-blocks x, importance qw (B, 256) -> IQ2_XXS (B, 66) or IQ2_XS (B, 74) blocks."""
    xxs = qtype == Q.IQ2_XXS
    lat = lattice(qtype, x.device)
    B, size = x.shape[0], 32 if xxs else 16
    k = size // 8
    weight = _weights(x, qw, 1.0).reshape(-1, k, 8)                                     # (G, k, 8)
    waux = weight.sqrt()
    xval, signs = _signs(x.reshape(-1, k, 8), weight)
    G = xval.shape[0]
    values = torch.tensor([1.0, 3.0, 5.0], device=x.device)                          # the levels as 2l + 1
    mx = xval.flatten(1).amax(-1, keepdim=True)                                       # (G, 1)
    zero = mx < GROUP_MAX_EPS
    if xxs:
        scale = _make_qp(xval.flatten(1), weight.flatten(1)).unsqueeze(-1)
        eff_max = scale * 3
        zero |= eff_max <= 0
        top, steps = eff_max, range(-6, 7)
    else:
        top, steps, scale = mx, range(-9, 10), mx / torch.tensor(5.0)
    top = torch.where(zero, torch.ones_like(top), top)
    best = torch.zeros_like(scale)
    L = torch.zeros_like(xval)
    on_grid = torch.ones((G, k), dtype=torch.bool, device=x.device)

    def fit(Lc):
        q = 2 * Lc + 1
        return _seqsum(weight * xval * q, 1), _seqsum(weight * q * q, 1)

    for step in steps:
        id_ = div(f32(5 + f32(step * f32(0.1))), top)
        Laux = (0.5 * (id_.unsqueeze(-1) * xval - 1)).round().clamp(0, 2)
        _, Laux, on = _snap(lat, Laux, xval, waux, div(1, id_), values)
        sumqx, sumq2 = fit(Laux)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = torch.where(better, sumqx / torch.where(better, sumq2, torch.ones_like(sumq2)), scale)
        best = torch.where(better, scale * sumqx, best)
        L = torch.where(better.unsqueeze(-1), Laux, L)
        on_grid = torch.where(better, on, on_grid)
    redo = scale > 0 if xxs else (scale > 0) & ~on_grid.all(-1, keepdim=True)           # (G, 1)
    if redo.any():
        id_ = div(1, torch.where(redo, scale, torch.ones_like(scale)))
        Lr = (0.5 * (id_.unsqueeze(-1) * xval - 1)).round().clamp(0, 2)
        if not xxs:     # IQ2_XS rounds again only the groups that were off the grid
            Lr = torch.where(on_grid.unsqueeze(-1), L, Lr)
        _, Lr, _ = _snap(lat, Lr, xval, waux, scale, values, only=redo.expand(-1, k))
        L = torch.where(redo.unsqueeze(-1), Lr, L)
        sumqx, sumq2 = fit(L)
        scale = torch.where(redo & (sumq2 > 0), sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), scale)
    negative = scale < 0
    signs = torch.where(negative, ~signs & 127, signs)
    scale = torch.where(zero, torch.zeros_like(scale), scale.abs())
    gi = lat.index[pack(L)]
    gi, signs = torch.where(zero, 0, gi), torch.where(zero, 0, signs)
    scales = scale.reshape(B, -1)                                                     # (B, 8 or 16)
    max_scale = scales.amax(-1, keepdim=True)
    d = max_scale / torch.tensor(31.0)        # a true division, as C (torch divides by a number as a product)
    ls = (0.5 * (div(1, torch.where(d > 0, d, torch.ones_like(d))) * scales - 1)).round().clamp(0, 15).long()
    dh = torch.where(max_scale > 0, d, torch.zeros_like(d)).to(torch.float16)
    if xxs:
        gi, signs, ls = gi.reshape(B, 8, 4), signs.reshape(B, 8, 4), ls.reshape(B, 8)
        idx_word = (gi << torch.arange(0, 32, 8, device=x.device)).sum(-1)
        sign_word = (signs << torch.arange(0, 28, 7, device=x.device)).sum(-1) | (ls << 28)
        words = torch.stack([idx_word, sign_word], -1).reshape(B, 16)
        words = torch.where(max_scale > 0, words, torch.zeros_like(words))
        return torch.cat([dh.view(torch.uint8), _u32_bytes(words)], -1)
    qs = (gi | (signs << 9)).reshape(B, 32)
    qs = torch.where(max_scale > 0, qs, torch.zeros_like(qs))
    sc = ls[:, 0::2] | (ls[:, 1::2] << 4)
    return torch.cat([dh.view(torch.uint8), _u16_bytes(qs), as_bytes(sc)], -1)


# --- IQ1_S, IQ1_M ---------------------------------------------------------------------------------------------
def _pairs(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (i1, i2) boundary pairs 0 <= i1 <= i2 <= n in ggml's loop order."""
    i1, i2 = torch.triu_indices(n + 1, n + 1, device=device)
    return i1, i2


def _iq1_search(xb: torch.Tensor, weight: torch.Tensor, m: bool):
    """ggml's exhaustive split of each group's sorted values into levels 0, 1, 2 (-1, 0, 1 plus a shift).
    xb, weight (G, n) -> scale (G, 1), levels L (G, n), shift (G,) (IQ1_S: 0 for +1/8, 1 for -1/8; IQ1_M: k in
    0..3, bit 1 the first half's sign, bit 0 the second's), found (G, 1)."""
    G, n = xb.shape
    dev = xb.device
    xp = [f32(-1 + DELTA), f32(DELTA), f32(1 + DELTA)]
    xm = [f32(-1 - DELTA), f32(-DELTA), f32(1 - DELTA)]
    order = xb.argsort(dim=-1, stable=True)
    xs, ws = xb.gather(1, order), weight.gather(1, order)
    i1, i2 = _pairs(n, dev)
    if not m:
        sx, sw = _prefix(ws * xs), _prefix(ws)                                      # (G, n + 1)
        a, b, c = sx[:, i1], sx[:, i2] - sx[:, i1], sx[:, n:] - sx[:, i2]
        aw, bw, cw = sw[:, i1], sw[:, i2] - sw[:, i1], sw[:, n:] - sw[:, i2]
        cands = [(a * v[0] + b * v[1] + c * v[2], aw * v[0] * v[0] + bw * v[1] * v[1] + cw * v[2] * v[2])
                 for v in (xp, xm)]
    else:
        half = (order >= n // 2).long()                                               # (G, n): 0 first half
        qx, q2 = {}, {}
        for h in (0, 1):
            mask = (half == h).float()
            px, pw = _prefix(ws * xs * mask), _prefix(ws * mask)
            s = px[:, i1] + px[:, i2]
            for name, v in (("p", xp), ("m", xm)):
                c1, c2 = f32(v[0] * v[0] - v[1] * v[1]), f32(v[1] * v[1] - v[2] * v[2])
                qx[h, name] = px[:, n:] * v[2] - s
                q2[h, name] = pw[:, n:] * v[2] * v[2] + pw[:, i1] * c1 + pw[:, i2] * c2
        cands = [(qx[0, a] + qx[1, b], q2[0, a] + q2[1, b]) for a, b in (("p", "p"), ("p", "m"), ("m", "p"), ("m", "m"))]
    sumqx = torch.stack([c[0] for c in cands], -1).flatten(1)                          # (G, P * kinds): ggml's order
    sumq2 = torch.stack([c[1] for c in cands], -1).flatten(1)
    valid = sumq2 > 0
    score = torch.where(valid, sumqx * sumqx / torch.where(valid, sumq2, torch.ones_like(sumq2)),
                        torch.full_like(sumq2, -float("inf")))
    # ggml keeps a candidate when sumqx^2 > best * sumq2, best = (sumqx / sumq2) * sumqx of the one kept before: the
    # last word among near ties goes by that rounding, so the near best are compared again that way, in ggml's order
    near = score >= score.amax(-1, keepdim=True) * (1 - NEAR)
    pos = torch.arange(score.shape[1], device=dev)
    width = int(near.sum(-1).max())
    top = torch.where(near, pos, pos + score.shape[1]).topk(width, -1, largest=False).values % score.shape[1]
    best = top[:, :1].clone()
    kept = torch.full_like(sumqx[:, :1], -torch.finfo(torch.float32).max)
    for j in range(top.shape[1]):
        c = top[:, j:j + 1]
        qx, q2 = sumqx.gather(1, c), sumq2.gather(1, c)
        take = (q2 > 0) & (qx * qx > kept * q2)
        kept = torch.where(take, qx / torch.where(take, q2, torch.ones_like(q2)) * qx, kept)
        best = torch.where(take, c, best)
    found = valid.gather(1, best)
    kinds = len(cands)
    pair, kind = best.squeeze(-1) // kinds, best.squeeze(-1) % kinds
    scale = sumqx.gather(1, best) / torch.where(found, sumq2.gather(1, best), torch.ones_like(found, dtype=xb.dtype))
    rank = order.argsort(-1)                                                          # each value's sorted position
    L = (rank >= i1[pair].unsqueeze(-1)).float() + (rank >= i2[pair].unsqueeze(-1)).float()
    negative = scale < 0
    L = torch.where(negative, 2 - L, L)
    scale = scale.abs()
    kind = torch.where(negative.squeeze(-1), kinds - 1 - kind, kind)                  # + <-> - (IQ1_M: 0<->3, 1<->2)
    return scale, L, kind, found


def _iq1_values(kind: torch.Tensor, k: int, m: bool) -> torch.Tensor:
    """(G,) search kinds -> (G, k, 3): the float of each level in each 8-group (-1, 0, 1 shifted +-1/8)."""
    levels = torch.tensor([-1.0, 0.0, 1.0], device=kind.device)
    if m:
        minus = torch.stack([kind >= 2, kind % 2 == 1], -1)                          # (G, 2)
    else:
        minus = (kind == 1).unsqueeze(-1).expand(-1, k)
    shift = torch.where(minus, -DELTA, DELTA).unsqueeze(-1)
    return levels + shift


def _iq1(x: torch.Tensor, qw: torch.Tensor | None, qtype: Q):
    """Super-blocks x, importance qw (B, 256) or None (IQ1_M) -> IQ1_S (B, 50) or IQ1_M (B, 56) blocks."""
    m = qtype == Q.IQ1_M
    lat = lattice(qtype, x.device)
    B, n = x.shape[0], 16 if m else 32
    k = n // 8
    weight = x * x if qw is None else _weights(x, qw, 2.0)
    xb, wb = x.reshape(-1, n), weight.reshape(-1, n)
    zero = xb.abs().amax(-1, keepdim=True) < EPS_IQ1[qtype]
    scale, L, kind, found = _iq1_search(xb, wb, m)
    zero |= ~found
    values = _iq1_values(kind, k, m)                                                  # (G, k, 3)
    xg, wg, Lg = xb.reshape(-1, k, 8), wb.reshape(-1, k, 8), L.reshape(-1, k, 8)
    gi = lat.index[pack(Lg)]
    off = (gi < 0) & ~zero
    if off.any():
        rows = off.nonzero(as_tuple=True)
        nb = nearest_neighbour(lat, pack(Lg)[rows], xg[rows], wg[rows], scale.expand(-1, k)[rows].unsqueeze(-1),
                               values[rows])
        gi = gi.index_put(rows, nb)
    gi = torch.where(zero, 0, gi)
    q = values.gather(2, lat.levels[gi])                                              # (G, k, 8)
    sumqx, sumq2 = _seqsum(wg * q * xg, 1), _seqsum(wg * q * q, 1)
    refit = off.any(-1, keepdim=True) & (sumqx > 0) & (sumq2 > 0)
    scale = torch.where(refit, sumqx / torch.where(refit, sumq2, torch.ones_like(sumq2)), scale)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    kind = torch.where(zero.squeeze(-1), 0, kind)                    # a zero group: levels shifted +1/8
    scales = scale.reshape(B, -1)
    max_scale = scales.amax(-1, keepdim=True)
    some = max_scale > 0
    d = max_scale / torch.tensor(15.0)
    ls = (0.5 * (div(1, torch.where(some, d, torch.ones_like(d))) * scales - 1)).round().clamp(0, 7).long()
    ls = torch.where(some, ls, torch.zeros_like(ls))
    gi = gi.reshape(B, -1, k)                                                         # (B, blocks, k)
    qs = as_bytes(gi.reshape(B, -1) & 255)
    high = gi >> 8
    kind = kind.reshape(B, -1)
    if not m:
        qh = (high << torch.arange(0, 3 * k, 3, device=x.device)).sum(-1)
        qh = qh | torch.where(some, (ls | ((kind == 1).long() << 3)) << 12, 0)
        dh = torch.where(some, d * f32(1.125), torch.zeros_like(d)).to(torch.float16)
        return torch.cat([dh.view(torch.uint8), qs, _u16_bytes(qh)], -1)
    masks = torch.tensor([0x00, 0x80, 0x08, 0x88], device=x.device)
    qh = high[..., 0] | (high[..., 1] << 4) | torch.where(some, masks[kind], 0)       # (B, 16)
    # the super-block scale refitted to the 3-bit block scales, as ggml does
    values = _iq1_values(kind.reshape(-1), k, m).reshape(B, -1, k, 3)
    q = values.gather(3, lat.levels[gi]) * (2 * ls + 1).unsqueeze(-1).unsqueeze(-1)       # (B, 16, 2, 8)
    xq, wq = x.reshape(B, -1, k, 8), weight.reshape(B, -1, k, 8)
    sqx, sq2 = _seqsum(wq * q * xq, 1), _seqsum(wq * q * q, 1)
    d = torch.where(sq2 > 0, sqx / torch.where(sq2 > 0, sq2, torch.ones_like(sq2)), d)
    bits = torch.where(some, _f16_bits(d * f32(1.1125)), 0)                           # (B, 1)
    sc = (ls.reshape(B, 4, 4) << torch.arange(0, 12, 3, device=x.device)).sum(-1)
    sc = sc | (((bits >> torch.arange(0, 16, 4, device=x.device)) & 15) << 12)
    return torch.cat([qs, as_bytes(qh), _u16_bytes(sc)], -1)


def encode(x: torch.Tensor, qw: torch.Tensor | None, *, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """Super-blocks x (B, 256) with importance qw (B, 256) -> qtype's blocks and the float32 values they decode to."""
    q = _iq1(x, qw, qtype) if qtype in (Q.IQ1_S, Q.IQ1_M) else _iq2(x, qw, qtype)
    return q, IQ_DEQUANTIZERS[qtype](q)


TYPES = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S, Q.IQ1_M)
NEED_IMPORTANCE = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S)     # ggml asserts their quant_weights; IQ1_M runs without
