"""QSA's attention on CUDA (Triton): the indexer's block keys kept in the cache, each token's top-budget blocks
picked on the device, and the attention over those blocks plus the recent tail, with no host read, for prompts
and decode steps alike (every token is its own program: it reads only its sequence's cache and position).

    block_keys(raw, norm_w, eps, cos, sin, keys, seq_ids, positions)          # the blocks the tokens complete
    picks = select(iq, keys, seq_ids, positions, block, top, n)              # (T, top) int32 block indices
    o = attend(q, k, v, picks, seq_ids, positions, block, top)                 # (T, nh, hd)
    # raw (n_seq, ctx, d): the indexer's raw keys, the tokens' already written; keys (n_seq, ctx // B, d): block
    # keys (runtime/kv_cache.py's Qwen4Cache); iq (T, ih, d), q (T, nh, hd) normed and turned; k, v the KV layer

models/qsa.py is the oracle and the CPU path: its block_keys, select (the same tie rule) and the masked attention.

- _block_keys, grid (T,): a token at position p completes block p // B when (p + 1) % B == 0: that block's key is
  the float32 mean of its B raw keys rounded to the cache's dtype, RMS-normed and turned by rotary at the block's
  first position (rotate-half on the first RD dims), one rounding after each step torch rounds at; other tokens
  write nothing. A block's key is written once, when its last token lands: what the torch path pools.
- _select, grid (T,): the scores of the nb = (p + 1) // B complete blocks (sum over the indexer heads of
  relu(q_h . k) / sqrt(d), float32: one tl.dot a chunk of blocks, the heads padded to 16 rows, IEEE on float32
  inputs) into a scratch row (long prompts' tokens in parts: SCRATCH bytes a launch), then the top min(top, nb)
  of them: the threshold found by bisection on the scores' bits (non-negative floats order as their bits), every
  block above it, and the blocks equal to it by lower index first, written in ascending block order. Rule
  (models/qsa.py's select): higher score first, equal scores by lower block index.
- _attend, grid (T, nkv): the token's query heads of one KV head against its picked blocks' keys, then the tail
  (positions nb * B .. p), in ascending key order, in chunks of CB blocks: an online softmax in float32, the
  probabilities rounded to V's dtype for the product (as kernels/fused.py's decode_attention), divided once.

Scores, means and norms in float32 with sums in another order than torch's: within float32 rounding of the oracle;
a pick differs only where two scores within that rounding straddle the cut (exact ties, such as the zeros of
all-negative products, break alike). No atomics, fixed shapes per call: a token's bits do not depend on the other
tokens of its forward. The block shapes and the bisection (31 passes over a token's scores) are not measured yet.

A decode step runs these with no host read, so it can be captured in a CUDA graph (models/transformer.py's
capturable_for): where the PLE table is read in place too (models/ple.py's on_device path).
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # the CPU build of torch has no Triton: models/qsa.py's torch form is the path there
    triton = None

CH = 64                      # blocks a chunk of _select
CB = 16                      # blocks a chunk of _attend
SCRATCH = 64 << 20           # bytes of scores a _select launch keeps at most (long prompts run in parts)


if triton is not None:
    @triton.jit
    def _block_keys(raw_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, seq_ptr, pos_ptr, eps, CTX: tl.constexpr,
                    NBC: tl.constexpr, B: tl.constexpr, D: tl.constexpr, RD: tl.constexpr):
        """Program t: the key of the block token t completes (none where it completes none)."""
        t = tl.program_id(0)
        seq = tl.load(seq_ptr + t).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        blk = pos // B
        d = tl.arange(0, D)
        half = RD // 2
        partner = tl.where(d < half, d + half, tl.where(d < RD, d - half, d))     # rotate-half's other dim
        inside = (blk * B + tl.arange(0, B) < CTX)[:, None]
        rows = seq * CTX + blk * B + tl.arange(0, B)
        x = tl.load(raw_ptr + rows[:, None] * D + d[None, :], mask=inside, other=0.0).to(tl.float32)  # (B, D)
        xp = tl.load(raw_ptr + rows[:, None] * D + partner[None, :], mask=inside, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        m = (tl.sum(x, axis=0) / B).to(dt).to(tl.float32)                                       # (D,)
        mp = (tl.sum(xp, axis=0) / B).to(dt).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(m * m, axis=0) / D + eps)
        n = (m * inv * tl.load(w_ptr + d).to(tl.float32)).to(dt).to(tl.float32)
        npart = (mp * inv * tl.load(w_ptr + partner).to(tl.float32)).to(dt).to(tl.float32)
        at = blk * B
        c = tl.load(cos_ptr + at * RD + d, mask=d < RD, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + at * RD + d, mask=d < RD, other=0.0).to(tl.float32)
        rot = tl.where(d < half, -npart, tl.where(d < RD, npart, 0.0))
        y = tl.where(d < RD, n * c + rot * s, n)
        done = d * 0 + (pos + 1) % B == 0                       # (D,): the token completes its block
        tl.store(out_ptr + (seq * NBC + blk) * D + d, y.to(dt), mask=done)

    @triton.jit
    def _select(iq_ptr, keys_ptr, seq_ptr, pos_ptr, sc_ptr, picks_ptr, width, inv_scale, NBC: tl.constexpr,
                B: tl.constexpr, IH: tl.constexpr, IHP: tl.constexpr, D: tl.constexpr, TOP: tl.constexpr,
                CH: tl.constexpr, PREC: tl.constexpr):
        """Program t: token t's picked blocks, ascending, in picks[t, :min(TOP, nb)]."""
        t = tl.program_id(0)
        seq = tl.load(seq_ptr + t).to(tl.int64)
        pos = tl.load(pos_ptr + t)
        nb = (pos + 1) // B
        need = tl.minimum(nb, TOP)
        h = tl.arange(0, IHP)
        d = tl.arange(0, D)
        q = tl.load(iq_ptr + (t * IH + h[:, None]) * D + d[None, :], mask=(h < IH)[:, None], other=0.0)  # (IHP, D)
        row = sc_ptr + t.to(tl.int64) * width
        chunks = tl.cdiv(nb, CH)
        for c in range(0, chunks):                # the scores, into the scratch row
            blk = c * CH + tl.arange(0, CH)
            ok = blk < nb
            k = tl.load(keys_ptr + (seq * NBC + blk[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0)
            dots = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32)                 # (IHP, CH)
            s = tl.sum(tl.maximum(dots, 0.0), axis=0) * inv_scale                               # padded rows: 0
            tl.store(row + blk, s, mask=ok)
        # the largest lo whose count of scores >= lo reaches `need` (bits of non-negative floats; -0.0 as 0)
        lo = tl.full([], 0, dtype=tl.int32)
        hi = tl.full([], 0x7F800001, dtype=tl.int32)
        steps = tl.where(nb > TOP, 31, 0)         # dense: every block, no search
        for _ in range(0, steps):
            mid = lo + (hi - lo) // 2
            count = tl.full([], 0, dtype=tl.int32)
            for c in range(0, chunks):
                blk = c * CH + tl.arange(0, CH)
                ok = blk < nb
                bits = tl.maximum(tl.load(row + blk, mask=ok, other=0.0).to(tl.int32, bitcast=True), 0)
                count += tl.sum((ok & (bits >= mid)).to(tl.int32), axis=0)
            big = count >= need
            lo = tl.where(big, mid, lo)
            hi = tl.where(big, hi, mid)
        above = tl.full([], 0, dtype=tl.int32)
        for c in range(0, chunks):
            blk = c * CH + tl.arange(0, CH)
            ok = blk < nb
            bits = tl.maximum(tl.load(row + blk, mask=ok, other=0.0).to(tl.int32, bitcast=True), 0)
            above += tl.sum((ok & (bits > lo)).to(tl.int32), axis=0)
        quota = need - above                      # the blocks equal to the threshold taken, lower index first
        taken = tl.full([], 0, dtype=tl.int32)
        equal = tl.full([], 0, dtype=tl.int32)
        for c in range(0, chunks):
            blk = c * CH + tl.arange(0, CH)
            ok = blk < nb
            bits = tl.maximum(tl.load(row + blk, mask=ok, other=0.0).to(tl.int32, bitcast=True), 0)
            eq = (ok & (bits == lo)).to(tl.int32)
            sel = (ok & (bits > lo)) | ((eq != 0) & (equal + tl.cumsum(eq, axis=0) - eq < quota))
            si = sel.to(tl.int32)
            at = taken + tl.cumsum(si, axis=0) - si
            tl.store(picks_ptr + t * TOP + at, blk, mask=sel)
            taken += tl.sum(si, axis=0)
            equal += tl.sum(eq, axis=0)

    @triton.jit
    def _attend(q_ptr, k_ptr, v_ptr, picks_ptr, seq_ptr, pos_ptr, out_ptr, scale, NH: tl.constexpr,
                NKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, CTX: tl.constexpr,
                B: tl.constexpr, TOP: tl.constexpr, CB: tl.constexpr, PREC: tl.constexpr):
        """Program (t, kv head): its G query heads of token t over the picked blocks, then the tail."""
        t = tl.program_id(0)
        kh = tl.program_id(1)
        seq = tl.load(seq_ptr + t).to(tl.int64)
        pos = tl.load(pos_ptr + t)
        nb = (pos + 1) // B
        need = tl.minimum(nb, TOP)
        g = tl.arange(0, GP)
        hm = g < G
        h = kh * G + g
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + (t * NH + h[:, None]) * HD + d[None, :], mask=hm[:, None], other=0.0)   # (GP, HD)
        lane = tl.arange(0, CB * B)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, HD], dtype=tl.float32)
        base = (seq * NKV + kh) * CTX
        for c in range(0, tl.cdiv(need + 1, CB)):     # list entry `need` is the tail: block nb, up to pos
            j = c * CB + lane // B
            blk = tl.where(j < need, tl.load(picks_ptr + t * TOP + j, mask=j < need, other=0), nb)
            key = blk * B + lane % B
            ok = (j <= need) & (key <= pos)
            rows = (base + key).to(tl.int64)
            k = tl.load(k_ptr + rows[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)   # (CB*B, HD)
            v = tl.load(v_ptr + rows[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale            # (GP, CB*B)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out_ptr + (t * NH + h[:, None]) * HD + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hm[:, None])


def _precision(t: torch.Tensor) -> str:
    """tl.dot's on float32 inputs: IEEE, as torch's matmul without TF32 (the picks follow the scores' bits); the
    default elsewhere (bfloat16 and float16 products are exact in the float32 sum)."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fits(cfg) -> bool:
    """Whether these kernels take the model's shapes (power-of-two sizes of what a program holds whole)."""
    g = cfg.n_heads // cfg.n_kv_heads
    return (triton is not None and all(_pow2(x) for x in (cfg.indexer_block, cfg.indexer_head_dim,
                                                            cfg.indexer_heads, cfg.head_dim))
            and min(cfg.indexer_head_dim, cfg.head_dim) >= 16 and cfg.rotary_dim % 2 == 0 and g <= 16)


def block_keys(raw: torch.Tensor, norm_w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Write into keys (n_seq, ctx // B, d) the key of each block a token completes (its position p with
    (p + 1) % B == 0), from raw (n_seq, ctx, d), whose keys up to p are written; cos, sin (ctx, rd) by position."""
    n_seq, ctx, d = raw.shape
    B = ctx // keys.shape[1]
    _block_keys[(seq_ids.shape[0],)](raw, norm_w, cos, sin, keys, seq_ids, positions, eps, CTX=ctx,
                                     NBC=keys.shape[1], B=B, D=d, RD=cos.shape[-1])


def select(iq: torch.Tensor, keys: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor, block: int,
           top: int, n: int) -> torch.Tensor:
    """iq (T, ih, d): the indexer's queries of tokens at (seq_ids, positions), each below n -> (T, top) int32: each
    token's picked blocks in ascending order, its first min(top, (p + 1) // block) entries (the rest unwritten)."""
    T, ih, d = iq.shape
    iq = iq.contiguous()
    width = max(1, n // block)
    picks = torch.empty(T, top, dtype=torch.int32, device=iq.device)
    part = max(1, SCRATCH // (4 * width))      # tokens a launch: its scratch of scores at most SCRATCH bytes
    scores = torch.empty(min(T, part), width, dtype=torch.float32, device=iq.device)
    ihp = max(16, triton.next_power_of_2(ih))     # tl.dot's least rows (the padded heads score 0)
    for a in range(0, T, part):
        b = min(T, a + part)
        _select[(b - a,)](iq[a:b], keys, seq_ids[a:b], positions[a:b], scores, picks[a:b], width,
                          1.0 / math.sqrt(d), NBC=keys.shape[1], B=block, IH=ih, IHP=ihp, D=d, TOP=top, CH=CH,
                          PREC=_precision(keys))
    return picks


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, picks: torch.Tensor, seq_ids: torch.Tensor,
           positions: torch.Tensor, block: int, top: int) -> torch.Tensor:
    """q (T, nh, hd) against k, v (n_seq, nkv, ctx, hd) at each token's picked blocks (select's) and its tail
    -> (T, nh, hd) in q's dtype."""
    T, nh, hd = q.shape
    nkv, ctx = k.shape[1], k.shape[2]
    g = nh // nkv
    q = q.contiguous()
    out = torch.empty_like(q)
    _attend[(T, nkv)](q, k, v, picks, seq_ids, positions, out, hd ** -0.5, NH=nh, NKV=nkv, G=g,
                      GP=max(16, triton.next_power_of_2(g)), HD=hd, CTX=ctx, B=block, TOP=top, CB=CB,
                      PREC=_precision(k))
    return out


def pick_qsa_kernels(device, cfg):
    """This module on CUDA where Triton is installed and the shapes fit; None (models/qsa.py's torch form)
    elsewhere."""
    import sys
    if torch.device(device).type != "cuda" or not cfg.indexer_heads or not fits(cfg):
        return None
    return sys.modules[__name__]
