"""Latent attention's decode step (Triton, CUDA): the norm, rotary and cache writes between its projections in one
launch, then the absorbed form of models/mla.py as one attention over the latent cache, split over chunks of keys
(flash-decoding), and a merge.

    q_rot = mla_rope_kv(q, kv, norm, eps, cos, sin, latents, rot_keys, seq_ids, positions, interleaved)
    o_lat = mla_decode_attention(q_lat, q_rot, latents, rot_keys, seq_ids, positions, n, scale)
    # q (T, nh, dn + dr), kv (T, r + dr) = [c | k_rot] as projected: c normed and k_rot rotated into the cache,
    # q's rotary dims rotated (q_rot); q_lat (B, nh, r): q_nope times each head's key rows of attn_kv_b;
    # latents (n_seq, 1, ctx, r), rot_keys (n_seq, 1, ctx, dr): runtime/kv_cache.py's latent layout
    # -> (B, nh, r): softmax(scale (q_lat . c + q_rot . k_rot)) over the first n keys up to each token's position,
    #    times the latents c; models/mla.py takes it to each head's dv dims by the value rows after

mla_rope_kv, grid (T, nh + 2), replaces the torch form's RMSNorm of c, two rotary embeddings (seven elementwise ops
each) and two cache writes (models/mla.py's MLA, their oracle). models/mla.py's latent_attention is the attention's
torch form and oracle: it gathers each token's cache, widens it to float32 and runs eight ops over it (two matmuls
for the scores, their sum, the scale, the mask, the softmax, the product with the latents, the rounding). Here:

- launch (a), grid (B, cdiv(nh, HEADS), splits): program (b, head block, split) reads keys [split CHUNK, + CHUNK)
  of b's sequence (CHUNK latents of r and rotary keys of dr, once for HEADS heads: every head shares them) and
  computes for each head the chunk's max score, sum of exponentials and unnormalised sum of latents (HEADS, r),
  float32; keys past b's position are masked.
- launch (b), grid (B, nh): the splits merged in split order, divided once, rounded to q_lat's dtype.

Scores and sums in float32, the probabilities rounded to the cache's dtype for the product with the latents (as
flash attention and kernels/fused.py's decode_attention do). No atomics and fixed block shapes: a token's bits
depend only on its own query, its sequence's cache and n, never on the other tokens of the step. At DeepSeek-V3's
shapes (nh 128, r 512, dr 64, bf16) launch (a) has 8 head blocks and n / 64 splits a token; each reads 72 KiB of
cache a chunk (from L2 after its first head block). The block shapes are not measured yet (a GPU run picks them).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # the CPU build of torch has no Triton: models/mla.py's torch form is the path there
    triton = None

CHUNK = 64                   # keys a program of launch (a)
HEADS = 16                   # query heads a program of launch (a) (tl.dot's least rows)


if triton is not None:
    @triton.jit
    def _mla_split(ql_ptr, qr_ptr, c_ptr, kr_ptr, seq_ptr, pos_ptr, po_ptr, pm_ptr, pl_ptr, scale, ql_b, ql_h,
                   qr_b, qr_h, NH: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, CTX: tl.constexpr,
                   HB: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr):
        """Program (b, head block, split): heads [hb HB, + HB) of token b against its sequence's keys
        [split CHUNK, + CHUNK) up to its position: each head's max score, sum of exponentials and unnormalised
        sum of latents over the chunk."""
        b = tl.program_id(0)
        hb = tl.program_id(1)
        s = tl.program_id(2)
        seq = tl.load(seq_ptr + b)
        pos = tl.load(pos_ptr + b)
        h = hb * HB + tl.arange(0, HB)
        hm = h < NH
        r = tl.arange(0, R)
        d = tl.arange(0, DR)
        keys = s * CHUNK + tl.arange(0, CHUNK)
        km = keys <= pos
        ql = tl.load(ql_ptr + b * ql_b + h[:, None] * ql_h + r[None, :], mask=hm[:, None], other=0.0)   # (HB, R)
        qr = tl.load(qr_ptr + b * qr_b + h[:, None] * qr_h + d[None, :], mask=hm[:, None], other=0.0)   # (HB, DR)
        rows = (seq * CTX + keys).to(tl.int64)
        c = tl.load(c_ptr + rows[:, None] * R + r[None, :], mask=km[:, None], other=0.0)              # (CHUNK, R)
        kr = tl.load(kr_ptr + rows[:, None] * DR + d[None, :], mask=km[:, None], other=0.0)           # (CHUNK, DR)
        scores = (tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr))) * scale                      # (HB, CHUNK)
        scores = tl.where(km[None, :], scores, float("-inf"))
        m = tl.max(scores, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp(scores - m_safe[:, None])
        o = tl.dot(p.to(c.dtype), c)                                                                # (HB, R)
        part = (b * NH + h) * SPLITS + s
        tl.store(pm_ptr + part, m, mask=hm)
        tl.store(pl_ptr + part, tl.sum(p, axis=1), mask=hm)
        tl.store(po_ptr + part.to(tl.int64)[:, None] * R + r[None, :], o, mask=hm[:, None])

    @triton.jit
    def _mla_combine(po_ptr, pm_ptr, pl_ptr, out_ptr, out_b, out_h, NH: tl.constexpr, R: tl.constexpr,
                     SPLITS: tl.constexpr, SP: tl.constexpr):
        """Program (b, head): the splits' partial softmaxes merged in split order, divided once, rounded."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        part = (b * NH + h) * SPLITS
        sp = tl.arange(0, SP)
        ok = sp < SPLITS
        m = tl.load(pm_ptr + part + sp, mask=ok, other=float("-inf"))
        l = tl.load(pl_ptr + part + sp, mask=ok, other=0.0)
        big = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
        den = tl.sum(w * l, axis=0)
        r = tl.arange(0, R)
        acc = tl.zeros([R], dtype=tl.float32)
        for s in range(SPLITS):          # one split's (R,) at a time: the registers of one row, whatever n is
            ms = tl.load(pm_ptr + part + s)
            ws = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - big))
            acc += ws * tl.load(po_ptr + (part + s).to(tl.int64) * R + r)
        tl.store(out_ptr + b * out_b + h * out_h + r, (acc / den).to(out_ptr.dtype.element_ty))


if triton is not None:
    @triton.jit
    def _mla_rope_kv(q_ptr, kv_ptr, nw_ptr, cos_ptr, sin_ptr, qr_ptr, c_ptr, kr_ptr, seq_ptr, pos_ptr, eps,
                     NH: tl.constexpr, DN: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, CTX: tl.constexpr,
                     INTERLEAVED: tl.constexpr):
        """Program (t, j): j < NH: head j's rotary query dims of token t rotated into qr (T, NH, DR); j == NH: the
        latent c RMS-normed into the latent cache at (seq, pos); j == NH + 1: the rotary key rotated into the key
        cache there. Rotary on adjacent pairs (INTERLEAVED, written [evens | odds]) or on halves; float32, one
        rounding."""
        t = tl.program_id(0)
        j = tl.program_id(1)
        seq = tl.load(seq_ptr + t)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        row = (seq * CTX + pos).to(tl.int64)
        if j == NH:
            r = tl.arange(0, R)
            c = tl.load(kv_ptr + t * (R + DR) + r).to(tl.float32)
            c = c * tl.rsqrt(tl.sum(c * c, axis=0) / R + eps) * tl.load(nw_ptr + r).to(tl.float32)
            tl.store(c_ptr + row * R + r, c.to(c_ptr.dtype.element_ty))
        else:
            i = tl.arange(0, DR // 2)
            if j < NH:
                src = q_ptr + (t * NH + j) * (DN + DR) + DN
                dst = qr_ptr + (t * NH + j) * DR
            else:
                src = kv_ptr + t * (R + DR) + R
                dst = kr_ptr + row * DR
            if INTERLEAVED:
                x1 = tl.load(src + 2 * i).to(tl.float32)
                x2 = tl.load(src + 2 * i + 1).to(tl.float32)
            else:
                x1 = tl.load(src + i).to(tl.float32)
                x2 = tl.load(src + DR // 2 + i).to(tl.float32)
            co = tl.load(cos_ptr + t * DR + i).to(tl.float32)
            si = tl.load(sin_ptr + t * DR + i).to(tl.float32)
            tl.store(dst + i, (x1 * co - x2 * si).to(dst.dtype.element_ty))
            tl.store(dst + DR // 2 + i, (x2 * co + x1 * si).to(dst.dtype.element_ty))


def mla_rope_kv(q: torch.Tensor, kv: torch.Tensor, norm: torch.Tensor, eps: float, cos: torch.Tensor,
                sin: torch.Tensor, latents: torch.Tensor, rot_keys: torch.Tensor, seq_ids: torch.Tensor,
                positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """What latent attention does between its projections and the attention in one launch: q (T, nh, dn + dr) and
    kv (T, r + dr) = [c | k_rot] as projected; c RMS-normed (norm (r,)) and k_rot rotated (cos, sin (T, dr), halves
    repeated) written to the latent cache (latents (n_seq, 1, ctx, r), rot_keys (n_seq, 1, ctx, dr)) at each
    token's (sequence, position) -> q's rotary dims rotated, (T, nh, dr)."""
    T, nh, hd = q.shape
    r, dr = latents.shape[-1], rot_keys.shape[-1]
    if not (q.is_contiguous() and kv.is_contiguous() and kv.shape[1] == r + dr):
        raise ValueError(f"mla_rope_kv: contiguous q {tuple(q.shape)} and kv {tuple(kv.shape)} of r + dr")
    q_rot = torch.empty(T, nh, dr, dtype=q.dtype, device=q.device)
    _mla_rope_kv[(T, nh + 2)](q, kv, norm, cos.contiguous(), sin.contiguous(), q_rot, latents, rot_keys, seq_ids,
                              positions, eps, nh, hd - dr, r, dr, latents.shape[2], interleaved, num_warps=1)
    return q_rot


def mla_fits(r: int, dr: int) -> bool:
    """Whether the kernel takes a latent of r and a rotary key of dr: powers of two of at least 16 (tl.dot)."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (r, dr))


def mla_decode_attention(q_lat: torch.Tensor, q_rot: torch.Tensor, latents: torch.Tensor, rot_keys: torch.Tensor,
                         seq_ids: torch.Tensor, positions: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """q_lat (B, nh, r), q_rot (B, nh, dr) (any strides but a unit last one) against the first n keys of each
    token's sequence in the latent cache (latents (n_seq, 1, ctx, r), rot_keys (n_seq, 1, ctx, dr)), up to and
    including its position -> (B, nh, r) in q_lat's dtype, a view of a (nh, B, r) tensor (the layout the value
    rows' batched matmul after reads)."""
    B, nh, r = q_lat.shape
    dr, ctx = rot_keys.shape[-1], latents.shape[2]
    if q_lat.stride(-1) != 1 or q_rot.stride(-1) != 1 or not (latents.is_contiguous() and rot_keys.is_contiguous()):
        raise ValueError("mla_decode_attention: unit last strides and contiguous caches")
    splits = triton.cdiv(n, CHUNK)
    po = torch.empty(B * nh * splits, r, dtype=torch.float32, device=q_lat.device)
    pm = torch.empty(B * nh * splits, dtype=torch.float32, device=q_lat.device)
    pl = torch.empty_like(pm)
    _mla_split[(B, triton.cdiv(nh, HEADS), splits)](q_lat, q_rot, latents, rot_keys, seq_ids, positions, po, pm, pl,
                                                    scale, q_lat.stride(0), q_lat.stride(1), q_rot.stride(0),
                                                    q_rot.stride(1), nh, r, dr, ctx, HEADS, CHUNK, splits,
                                                    num_warps=4)
    out = torch.empty(nh, B, r, dtype=q_lat.dtype, device=q_lat.device)
    _mla_combine[(B, nh)](po, pm, pl, out, out.stride(1), out.stride(0), nh, r, splits,
                          triton.next_power_of_2(splits), num_warps=4)
    return out.transpose(0, 1)
