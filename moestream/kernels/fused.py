"""Fused decode-step kernels (Triton, CUDA): what a decode token runs between its GEMMs, in one launch each.

    q = qk_rope_kv(qkv, qk_norm, eps, cos, sin, k_cache, v_cache, seq_ids, positions, nh, nkv)
    o = decode_attention(q, k_cache, v_cache, seq_ids, positions, n)
    o = decode_attention(q, k_cache, v_cache, seq_ids, positions, n, sinks=sinks, window=128)     # gpt-oss
    o = decode_attention(q, k_ring, v_ring, seq_ids, positions, n, sinks=sinks, window=128, ring=True)
    q, gate = gated_qk_rope_kv(qkv, qk_norm, eps, cos, sin, k_cache, v_cache, seq_ids, positions, nh, nkv)
    o = decode_attention(q, k_cache, v_cache, seq_ids, positions, n, gate)     # o * sigmoid(gate), one rounding
    h, normed = add_rms_norm(h, delta, w, eps)
    y = linear(x, w, bias)                                      # kernels/gemv.py, carried here with the others:
    h, normed, y = norm_linear(h, delta, nw, eps, w, bias)      # one token's GEMV, the add and norm before it,
    h, normed, weights, ids, addrs = norm_route(h, delta, nw, eps, router, k, renormalise, dtype, table)  # router
    o_lat = mla_decode_attention(q_lat, q_rot, latents, rot_keys, seq_ids, positions, n, scale)   # kernels/mla.py

A decode token's layer is a few GEMVs and a few dozen tiny kernels (norms, rotary embedding, cache writes, the
attention's matmuls, masks and softmax, top-k), each a few microseconds for almost no bytes; these kernels replace
about thirty of them per layer. They compute in float32 and round once, so their bits differ from the eager ops
they replace (models/layers.py, models/moe.py: their oracles in tests/test_cuda.py); every placement of the
experts uses them alike for decode steps, so a cached decode still gives the all-GPU bits. gated_qk_rope_kv and a
gate given to decode_attention are the gated attention of Qwen3-Next and Qwen3.5-MoE (models/attention.py): q heads
interleaved with their output gates, rotary on the first rotary_dim dims of each head.
"""
from __future__ import annotations

import torch

from .gemv import linear, norm_linear, norm_route  # noqa: F401  (a decode step's GEMVs, carried with the others)
from .mla import mla_decode_attention, mla_fits, mla_rope_kv  # noqa: F401  (latent attention's decode step)
from .shared_expert import shared_expert  # noqa: F401  (a decode step's shared expert, carried with the others)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:
    from .gemv import _normed_row       # the add and norm of add_rms_norm (defined where Triton is)

    @triton.jit
    def _partial_rope_head(row, w, cos_row, sin_row, eps, HD: tl.constexpr, RD: tl.constexpr, NORM: tl.constexpr):
        """The head at row (HD wide) RMS-normalised by the weights at w (NORM) and rotated on its first RD dims by
        the cos, sin rows (RD wide; NEOX halves of RD, the other dims passed through: models/gated_attention.py's
        partial_rope) -> (HD,) float32."""
        d = tl.arange(0, HD)
        rot = d < RD
        first = d < RD // 2
        pair = tl.where(first, d + RD // 2, d - RD // 2)     # the other element of d's rotated pair
        x = tl.load(row + d).to(tl.float32)
        xp = tl.load(row + pair, mask=rot, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
            x = x * r * tl.load(w + d).to(tl.float32)
            xp = xp * r * tl.load(w + pair, mask=rot, other=0.0).to(tl.float32)
        c = tl.load(cos_row + d, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_row + d, mask=rot, other=0.0).to(tl.float32)
        return tl.where(rot, x * c + tl.where(first, -xp, xp) * s, x)

    @triton.jit
    def _qk_rope_kv(qkv_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, seq_ptr, pos_ptr, eps,
                    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, CTX: tl.constexpr,
                    NORM: tl.constexpr, RD: tl.constexpr, RING: tl.constexpr):
        """Program (t, head): a query or key head normalised (NORM; w: the q then the k norm weights) and rotated
        (NEOX halves; RD < HD: of its first RD dims only, the rest passed through, as GLM-4.5's), the key into the
        cache at (seq, head, pos) (RING: at pos % CTX, a sliding layer's ring); a value head copied into the
        cache."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        half = HD // 2
        i = tl.arange(0, HD // 2)
        row = qkv_ptr + t * (NH + 2 * NKV) * HD + h * HD
        seq = tl.load(seq_ptr + t)
        pos = tl.load(pos_ptr + t)
        if RING:
            pos = pos % CTX
        if h >= NH + NKV:                                   # a value head: into the cache as it is
            dst = vc_ptr + ((seq * NKV + (h - NH - NKV)) * CTX + pos) * HD
            tl.store(dst + i, tl.load(row + i))
            tl.store(dst + half + i, tl.load(row + half + i))
        elif RD < HD:                                       # partial rotary: _gated_qk_rope_kv's head
            d = tl.arange(0, HD)
            o = _partial_rope_head(row, w_ptr + (h >= NH).to(tl.int32) * HD, cos_ptr + t * RD, sin_ptr + t * RD,
                                   eps, HD, RD, NORM)
            if h < NH:
                dst = q_ptr + (t * NH + h) * HD
            else:
                dst = kc_ptr + ((seq * NKV + (h - NH)) * CTX + pos) * HD
            tl.store(dst + d, o.to(q_ptr.dtype.element_ty))
        else:
            x1 = tl.load(row + i).to(tl.float32)
            x2 = tl.load(row + half + i).to(tl.float32)
            if NORM:
                w = w_ptr + (h >= NH).to(tl.int32) * HD
                r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD + eps)
                x1 = x1 * r * tl.load(w + i).to(tl.float32)
                x2 = x2 * r * tl.load(w + half + i).to(tl.float32)
            c1 = tl.load(cos_ptr + t * HD + i).to(tl.float32)
            c2 = tl.load(cos_ptr + t * HD + half + i).to(tl.float32)
            s1 = tl.load(sin_ptr + t * HD + i).to(tl.float32)
            s2 = tl.load(sin_ptr + t * HD + half + i).to(tl.float32)
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
            if h < NH:
                dst = q_ptr + (t * NH + h) * HD
            else:
                dst = kc_ptr + ((seq * NKV + (h - NH)) * CTX + pos) * HD
            tl.store(dst + i, o1.to(q_ptr.dtype.element_ty))
            tl.store(dst + half + i, o2.to(q_ptr.dtype.element_ty))

    @triton.jit
    def _gated_qk_rope_kv(qkv_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, seq_ptr, pos_ptr, eps,
                          NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr,
                          CTX: tl.constexpr):
        """_qk_rope_kv for a gated-attention row [q_0 | gate_0 | ... | q_NH-1 | gate_NH-1 | k heads | v heads],
        each part HD wide: a query or key head normalised (w: the q then the k norm weights) and rotated on its
        first RD dims (NEOX halves of RD, the other dims passed through: models/gated_attention.py's partial_rope),
        the key into the cache; a value head copied into the cache. The gates are left where they are."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HD)
        # head h's place in its row: a query head after h (q, gate) pairs, a key or value head after all NH pairs
        start = tl.where(h < NH, 2 * h * HD, (NH + h) * HD)
        row = qkv_ptr + t * (2 * NH + 2 * NKV) * HD + start
        seq = tl.load(seq_ptr + t)
        pos = tl.load(pos_ptr + t)
        if h >= NH + NKV:                                   # a value head: into the cache as it is
            tl.store(vc_ptr + ((seq * NKV + (h - NH - NKV)) * CTX + pos) * HD + d, tl.load(row + d))
        else:
            o = _partial_rope_head(row, w_ptr + (h >= NH).to(tl.int32) * HD, cos_ptr + t * RD, sin_ptr + t * RD,
                                   eps, HD, RD, True)
            if h < NH:
                dst = q_ptr + (t * NH + h) * HD
            else:
                dst = kc_ptr + ((seq * NKV + (h - NH)) * CTX + pos) * HD
            tl.store(dst + d, o.to(q_ptr.dtype.element_ty))

    @triton.jit
    def _attn_split(q_ptr, k_ptr, v_ptr, seq_ptr, pos_ptr, po_ptr, pm_ptr, pl_ptr, scale,
                    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, CTX: tl.constexpr, G: tl.constexpr,
                    GP: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr,
                    RING: tl.constexpr):
        """Program (b, kv head, split): the G query heads sharing the kv head against keys [split * CHUNK, + CHUNK)
        up to the token's position (WINDOW > 0: and after pos - WINDOW): the chunk's max score, sum of exponentials
        and unnormalised output (a chunk of no such key: -inf, 0 and 0; its loads are masked off). RING: key p is
        at row p % CTX of the caches (a sliding layer's ring); the chunks are still of positions."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        seq = tl.load(seq_ptr + b)
        pos = tl.load(pos_ptr + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        keys = s * CHUNK + tl.arange(0, CHUNK)
        kmask = keys <= pos
        if WINDOW > 0:                  # a sliding layer: the token's last WINDOW positions, itself included
            kmask = kmask & (keys > pos - WINDOW)
        q = tl.load(q_ptr + (b * NH + kvh * G + g[:, None]) * HD + d[None, :], mask=(g < G)[:, None], other=0.0)
        rows = ((seq * NKV + kvh) * CTX + (keys % CTX if RING else keys)) * HD
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kmask[:, None], other=0.0)          # (CHUNK, HD)
        scores = tl.dot(q, tl.trans(k)) * scale                                                   # (GP, CHUNK)
        scores = tl.where(kmask[None, :], scores, float("-inf"))
        m = tl.max(scores, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp(scores - m_safe[:, None])
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kmask[:, None], other=0.0)          # (CHUNK, HD)
        o = tl.dot(p.to(v.dtype), v)                                                             # (GP, HD)
        part = (b * NKV + kvh) * SPLITS + s
        tl.store(pm_ptr + part * GP + g, m)
        tl.store(pl_ptr + part * GP + g, tl.sum(p, axis=1))
        tl.store(po_ptr + (part * GP + g[:, None]) * HD + d[None, :], o)

    @triton.jit
    def _attn_combine(po_ptr, pm_ptr, pl_ptr, out_ptr, gate_ptr, gate_b, gate_h, sink_ptr, NH: tl.constexpr,
                      NKV: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, SPLITS: tl.constexpr,
                      SP: tl.constexpr, GATE: tl.constexpr, SINK: tl.constexpr):
        """Program (b, query head): the splits' partial softmaxes merged, in split order; with SINK, the head's
        sink logit (at sink_ptr + h) joins the denominator as exp(sink - max), the max over it too, and adds no
        value; with GATE, times sigmoid of the head's gate (at gate_ptr + b gate_b + h gate_h) before the one
        rounding."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        g = h % G
        sp = tl.arange(0, SP)
        d = tl.arange(0, HD)
        part = (b * NKV + kvh) * SPLITS + sp
        ok = sp < SPLITS
        m = tl.load(pm_ptr + part * GP + g, mask=ok, other=float("-inf"))
        l = tl.load(pl_ptr + part * GP + g, mask=ok, other=0.0)
        o = tl.load(po_ptr + (part * GP + g)[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
        big = tl.max(m, axis=0)
        if SINK:
            sink = tl.load(sink_ptr + h).to(tl.float32)
            big = tl.maximum(big, sink)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
        den = tl.sum(w * l, axis=0)
        if SINK:
            den = den + tl.exp(sink - big)
        out = tl.sum(w[:, None] * o, axis=0) / den
        if GATE:
            out = out * tl.sigmoid(tl.load(gate_ptr + b * gate_b + h * gate_h + d).to(tl.float32))
        tl.store(out_ptr + (b * NH + h) * HD + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _add_rms_norm(h_ptr, d_ptr, w_ptr, hout_ptr, nout_ptr, eps, H: tl.constexpr, HP: tl.constexpr):
        """Program t: s = h + d rounded to h's dtype (the new residual stream), and RMSNorm(s) * w."""
        t = tl.program_id(0)
        _normed_row(h_ptr + t * H, d_ptr + t * H, w_ptr, hout_ptr + t * H, nout_ptr + t * H, eps, True, H, HP,
                    True, True)


def fused_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the decode kernels run (Triton, CUDA, 16-bit weights). Which of them a model's attention takes is its
    kind's to say (models/attention.py's `fuses`: these attention kernels want `head_fits`)."""
    from .decode import decode_available
    return decode_available(device, dtype)


def head_fits(head_dim: int) -> bool:
    """Whether qk_rope_kv, gated_qk_rope_kv and decode_attention take heads of head_dim: a power of two >= 32."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def qk_rope_kv(qkv: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
               nh: int, nkv: int, ring: bool = False) -> torch.Tensor:
    """qkv (T, (nh + 2 nkv) hd) -> q (T, nh, hd), each head RMS-normalised (qk_norm: the q then the k weights,
    (2 hd,); None: no norm) and rotated by cos, sin (T, rd), rd <= hd, on its first rd dims (GLM-4.5's partial
    rotary where rd < hd); k and v written to the caches (n_seq, nkv, ctx, hd) at each token's (sequence,
    position); ring: the caches are a sliding layer's ring (n_seq, nkv, R, hd), position p at p % R."""
    T = qkv.shape[0]
    hd = k_cache.shape[-1]
    q = torch.empty(T, nh, hd, dtype=qkv.dtype, device=qkv.device)
    norm = qk_norm is not None
    _qk_rope_kv[(T, nh + 2 * nkv)](qkv, qk_norm if norm else qkv, cos, sin, q, k_cache, v_cache, seq_ids,
                                   positions, eps, nh, nkv, hd, k_cache.shape[2], norm, cos.shape[-1], ring,
                                   num_warps=1)
    return q


def gated_qk_rope_kv(qkv: torch.Tensor, qk_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
                     nh: int, nkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_rope_kv for gated attention: qkv (T, nh 2hd + 2 nkv hd), each q head followed by its gate ([q_h | gate_h],
    then the k and the v heads), rotated by cos, sin (T, rd), rd <= hd, on each head's first rd dims; qk_norm (2 hd,)
    the q then the k weights as loaded (1 + w of a zero-centred norm). -> q (T, nh, hd) and the gates (T, nh, hd), a
    view into qkv, for decode_attention's `gate`."""
    T = qkv.shape[0]
    hd = k_cache.shape[-1]
    q = torch.empty(T, nh, hd, dtype=qkv.dtype, device=qkv.device)
    _gated_qk_rope_kv[(T, nh + 2 * nkv)](qkv, qk_norm, cos.contiguous(), sin.contiguous(), q, k_cache, v_cache,
                                         seq_ids, positions, eps, nh, nkv, hd, cos.shape[-1], k_cache.shape[2],
                                         num_warps=1)
    gate = qkv[:, :2 * nh * hd].view(T, nh, 2 * hd)[..., hd:]                # (T, nh, hd), rows 2 hd apart
    return q, gate


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float):
    """(h + delta, RMSNorm(h + delta) * w) for h, delta (T, H): one launch."""
    T, H = h.shape
    h_new, normed = torch.empty_like(h), torch.empty_like(h)
    _add_rms_norm[(T,)](h, delta.contiguous(), w, h_new, normed, eps, H, triton.next_power_of_2(H), num_warps=4)
    return h_new, normed


ATTN_CHUNK = 64               # keys per program of a decode step's attention (the span is a power of two >= 256)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_ids: torch.Tensor,
                     positions: torch.Tensor, n: int, gate: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, window: int = 0, ring: bool = False) -> torch.Tensor:
    """q (B, nh, hd) against the first n keys of each token's sequence in the caches (n_seq, nkv, ctx, hd), up to
    and including its position -> (B, nh, hd). Split over chunks of keys (flash-decoding): one launch computes
    every chunk's partial softmax, a second merges them; float32 scores and sums, the probabilities rounded to the
    cache's dtype for the product with the values (as flash attention does). gate (B, nh, hd), any strides but a
    unit last one (gated_qk_rope_kv's view): the merge multiplies each output by sigmoid(gate) in float32.
    gpt-oss's options: sinks (nh,), each head's sink logit, joins the merge's softmax (mass, no value); window > 0:
    each token attends its last `window` positions only (the chunks before them are masked off whole). ring: the
    caches are a sliding layer's ring (n_seq, nkv, R, hd), key p at row p % R (the keys and chunks are the linear
    cache's: the same bits). All are constants of the kernels: without them the kernels, and their bits, are those
    of the other families."""
    B, nh, hd = q.shape
    nkv, ctx = k_cache.shape[1], k_cache.shape[2]
    G = nh // nkv
    GP = max(16, triton.next_power_of_2(G))
    splits = triton.cdiv(n, ATTN_CHUNK)
    po = torch.empty(B * nkv * splits * GP, hd, dtype=torch.float32, device=q.device)
    pm = torch.empty(B * nkv * splits * GP, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    _attn_split[(B, nkv, splits)](q.contiguous(), k_cache, v_cache, seq_ids, positions, po, pm, pl, hd ** -0.5,
                                  nh, nkv, hd, ctx, G, GP, ATTN_CHUNK, splits, window, ring, num_warps=4)
    out = torch.empty_like(q)
    gated = gate is not None
    if gated and gate.stride(-1) != 1:
        raise ValueError(f"decode_attention: the gate's last dim must be contiguous, strides {gate.stride()}")
    sink = sinks is not None
    _attn_combine[(B, nh)](po, pm, pl, out, gate if gated else out, gate.stride(0) if gated else 0,
                           gate.stride(1) if gated else 0, sinks if sink else out, nh, nkv, hd, G, GP, splits,
                           triton.next_power_of_2(splits), gated, sink, num_warps=4)
    return out
