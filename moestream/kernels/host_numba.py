"""The numba kernels behind host_experts.py: routed experts on the host's cores, each row a fused
dequantize-dot over its GGUF blocks. Imported only by host_experts._kernel (it imports numba).

    out = experts(x, u8, i8, u16, w32, ids, weights, n_experts, row, types, offsets, inter)

x (T, H) float32; u8/i8/u16/w32 the same host bytes (one layer's rows, flat) seen as each type the blocks hold;
ids (T, k) int64, < 0 skipped; weights (T, k) float32; types (3,) GGML type ids of gate, up, down; offsets (3,)
their byte offsets in a row of `row` bytes. Returns out (T, H) float32.

Why it is shaped so: at decode a layer's few experts are read once from memory, so each row is read once a call
and dotted with every token that chose its expert while it sits in L1. A block's innermost loops run over 16 to
256 contiguous values (slices, so that no index can wrap and LLVM vectorises them): integers unpacked from bytes
(kept 8-bit, else numba widens them to int64 and the conversions halve the speed), converted to float32 and
multiplied into x; the block's scales are applied once a sub-block, and Q4_K's and Q5_K's min term comes from
x's sums per 32 values, made once a call. f16 scales are converted with integer arithmetic: a 256 KB lookup
table was evicted by the streaming rows and halved the speed. A row's gate and up are read side by side (two
streams; Q4_K's in one loop, which loads x once and keeps four sums in flight: 25% faster on one core), and
every block prefetches the bytes PREFETCH ahead. The loops need reassociation (`reassoc`) to
vectorise their sums and `contract` for FMAs; nothing else of fastmath (a NaN in the weights stays a NaN).
"""
from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import cgutils, types

F32, F16, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 8, 12, 13, 14, 30       # GGML type ids
JIT = dict(nogil=True, cache=True, fastmath={"reassoc", "contract"}, error_model="numpy")
PREFETCH = 1024          # bytes ahead of the block being read: +20% on one core over the hardware prefetcher alone
f32 = np.float32


@nb.extending.intrinsic
def _prefetch(typingctx, arr, idx):
    """A hint to fetch arr[idx]'s cache line (llvm.prefetch; never faults, also past the end)."""
    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@nb.njit(**JIT)
def _f16(h):
    """An f16's bits (int) -> its float32 value, exactly (subnormals, inf and NaN too)."""
    o = (h & 0x7FFF) << 13
    e = h & 0x7C00
    f = np.uint32(o + (224 << 23) if e == 0x7C00 else o + (112 << 23)).view(np.float32)
    if e == 0:
        f = np.uint32(o + (113 << 23)).view(np.float32) - f32(6.103515625e-05)        # - 2^-14
    return -f if h & 0x8000 else f


@nb.njit(**JIT)
def _half(u8, k):
    return _f16(np.int64(u8[k]) | (np.int64(u8[k + 1]) << 8))


@nb.njit(**JIT)
def _scale_min(sc, j):
    """Q4_K/Q5_K sub-block j's 6-bit scale and min, from the block's 12 scale bytes sc."""
    if j < 4:
        return f32(sc[j] & 63), f32(sc[4 + j] & 63)
    return f32((sc[4 + j] & 15) | ((sc[j - 4] >> 6) << 4)), f32((sc[4 + j] >> 4) | ((sc[j] >> 6) << 4))


# --- one block each: its bytes at k, its values . x[v:v + m]; xs (n // 32,) x's sums per 32 values ---

@nb.njit(**JIT)
def _blk_q4_k(u8, i8, u16, w32, k, x, xs, v, m):
    blk = u8[k:k + 144]
    d, dmin, sc = _half(blk, 0), _half(blk, 2), blk[4:16]
    acc = f32(0)
    for p in range(4):                             # 32 bytes: sub-block 2p in the low nibbles, 2p+1 in the high
        q, xa, xb = blk[16 + p * 32:48 + p * 32], x[v + p * 64:v + p * 64 + 32], x[v + p * 64 + 32:v + p * 64 + 64]
        lo = f32(0)
        hi = f32(0)
        for l in range(32):
            lo += f32(np.uint8(q[l] & 15)) * xa[l]
            hi += f32(np.uint8(q[l] >> 4)) * xb[l]
        (s0, m0), (s1, m1), j = _scale_min(sc, 2 * p), _scale_min(sc, 2 * p + 1), v // 32 + 2 * p
        acc += (d * s0) * lo - (dmin * m0) * xs[j] + (d * s1) * hi - (dmin * m1) * xs[j + 1]
    return acc


@nb.njit(**JIT)
def _blk2_q4_k(u8, ka, kb, x, xs, v):
    """Two Q4_K blocks (gate's and up's) . the same x values, in one loop: x loaded once, four sums in flight."""
    ba, bb = u8[ka:ka + 144], u8[kb:kb + 144]
    da, dma, sa, db, dmb, sb = _half(ba, 0), _half(ba, 2), ba[4:16], _half(bb, 0), _half(bb, 2), bb[4:16]
    acc_a = f32(0)
    acc_b = f32(0)
    for p in range(4):
        qa, qb = ba[16 + p * 32:48 + p * 32], bb[16 + p * 32:48 + p * 32]
        xa, xb = x[v + p * 64:v + p * 64 + 32], x[v + p * 64 + 32:v + p * 64 + 64]
        la = f32(0)
        ha = f32(0)
        lb = f32(0)
        hb = f32(0)
        for l in range(32):
            la += f32(np.uint8(qa[l] & 15)) * xa[l]
            ha += f32(np.uint8(qa[l] >> 4)) * xb[l]
            lb += f32(np.uint8(qb[l] & 15)) * xa[l]
            hb += f32(np.uint8(qb[l] >> 4)) * xb[l]
        j = v // 32 + 2 * p
        (s0, m0), (s1, m1) = _scale_min(sa, 2 * p), _scale_min(sa, 2 * p + 1)
        acc_a += (da * s0) * la - (dma * m0) * xs[j] + (da * s1) * ha - (dma * m1) * xs[j + 1]
        (s0, m0), (s1, m1) = _scale_min(sb, 2 * p), _scale_min(sb, 2 * p + 1)
        acc_b += (db * s0) * lb - (dmb * m0) * xs[j] + (db * s1) * hb - (dmb * m1) * xs[j + 1]
    return acc_a, acc_b


@nb.njit(**JIT)
def _q4_k2(t, u8, i8, u16, w32, oa, ob, x, xs, n):
    a = f32(0)
    b = f32(0)
    for s in range(n // 256):
        _prefetch(u8, oa + s * 144 + PREFETCH)
        _prefetch(u8, ob + s * 144 + PREFETCH)
        ga, gb = _blk2_q4_k(u8, oa + s * 144, ob + s * 144, x, xs, s * 256)
        a += ga
        b += gb
    return a, b


@nb.njit(**JIT)
def _blk_q5_k(u8, i8, u16, w32, k, x, xs, v, m):
    """Q4_K's with a fifth bit a value: bit j of qh[l] for sub-block j's value l."""
    blk = u8[k:k + 176]
    d, dmin, sc, qh = _half(blk, 0), _half(blk, 2), blk[4:16], blk[16:48]
    acc = f32(0)
    for p in range(4):
        q, xa, xb = blk[48 + p * 32:80 + p * 32], x[v + p * 64:v + p * 64 + 32], x[v + p * 64 + 32:v + p * 64 + 64]
        lo = f32(0)
        hi = f32(0)
        for l in range(32):
            h = qh[l] >> (2 * p)
            lo += f32(np.uint8((q[l] & 15) | ((h & 1) << 4))) * xa[l]
            hi += f32(np.uint8((q[l] >> 4) | ((h & 2) << 3))) * xb[l]
        (s0, m0), (s1, m1), j = _scale_min(sc, 2 * p), _scale_min(sc, 2 * p + 1), v // 32 + 2 * p
        acc += (d * s0) * lo - (dmin * m0) * xs[j] + (d * s1) * hi - (dmin * m1) * xs[j + 1]
    return acc


@nb.njit(**JIT)
def _blk_q6_k(u8, i8, u16, w32, k, x, xs, v, m):
    """Q6_K: in each half of 128 values, bytes ql[l], ql[32 + l], qh[l] hold values l, 32+l, 64+l, 96+l (a
    nibble and two bits of qh each), in 16-value sub-blocks with int8 scales."""
    d = _half(u8, k + 208)
    acc = f32(0)
    for h in range(2):
        for half in range(2):
            q1 = u8[k + h * 64 + half * 16:k + h * 64 + half * 16 + 16]
            q2 = u8[k + h * 64 + half * 16 + 32:k + h * 64 + half * 16 + 48]
            qh = u8[k + 128 + h * 32 + half * 16:k + 128 + h * 32 + half * 16 + 16]
            xh = x[v + h * 128 + half * 16:v + h * 128 + half * 16 + 112]
            a0 = f32(0)
            a1 = f32(0)
            a2 = f32(0)
            a3 = f32(0)
            for l in range(16):
                a0 += f32(np.int8(((q1[l] & 15) | ((qh[l] & 3) << 4)) - 32)) * xh[l]
                a1 += f32(np.int8(((q2[l] & 15) | ((qh[l] & 12) << 2)) - 32)) * xh[32 + l]
                a2 += f32(np.int8(((q1[l] >> 4) | (qh[l] & 48)) - 32)) * xh[64 + l]
                a3 += f32(np.int8(((q2[l] >> 4) | ((qh[l] & 192) >> 2)) - 32)) * xh[96 + l]
            c = k + 192 + h * 8 + half                     # the int8 scales of sub-blocks c, c+2, c+4, c+6
            acc += d * (f32(i8[c]) * a0 + f32(i8[c + 2]) * a1 + f32(i8[c + 4]) * a2 + f32(i8[c + 6]) * a3)
    return acc


@nb.njit(**JIT)
def _blk_q8_0(u8, i8, u16, w32, k, x, xs, v, m):
    """m // 32 blocks of 34 bytes (8 where the row allows: a call a block cost more than its dot)."""
    acc = f32(0)
    for b in range(m // 32):
        q, xv = i8[k + b * 34 + 2:k + b * 34 + 34], x[v + b * 32:v + b * 32 + 32]
        a = f32(0)
        for l in range(32):
            a += f32(q[l]) * xv[l]
        acc += _half(u8, k + b * 34) * a
    return acc


@nb.njit(**JIT)
def _blk_bf16(u8, i8, u16, w32, k, x, xs, v, m):
    w, xv = u16[k // 2:k // 2 + m], x[v:v + m]
    a = f32(0)
    for l in range(m):
        a += np.uint32(np.uint32(w[l]) << 16).view(np.float32) * xv[l]           # bf16 is f32's top half
    return a


@nb.njit(**JIT)
def _blk_f16(u8, i8, u16, w32, k, x, xs, v, m):
    w, xv = u16[k // 2:k // 2 + m], x[v:v + m]
    a = f32(0)
    for l in range(m):
        a += _f16(np.int64(w[l])) * xv[l]
    return a


@nb.njit(**JIT)
def _blk_f32(u8, i8, u16, w32, k, x, xs, v, m):
    w, xv = w32[k // 4:k // 4 + m], x[v:v + m]
    a = f32(0)
    for l in range(m):
        a += w[l] * xv[l]
    return a


# --- rows: a type's blocks in turn, one row or two (gate and up) side by side ---

@nb.njit(**JIT)
def _step(t, n):
    """(bytes, values) of one block of type t in a row of n values (float rows: 256 or 32 values a block)."""
    if t == Q4_K:
        return 144, 256
    if t == Q5_K:
        return 176, 256
    if t == Q6_K:
        return 210, 256
    m = 256 if n % 256 == 0 else 32
    if t == Q8_0:
        return 34 * m // 32, m
    return (4 if t == F32 else 2) * m, m


@nb.njit(**JIT)
def _nbytes(t, n):
    size, m = _step(t, n)
    return size * (n // m)


def _rows_of(blk):
    """One type's row kernels from its block kernel: one row . x, and two rows (gate's and up's) . x read side
    by side. (Made per type, not given blk as an argument: numba cannot cache a function taking a function.)"""
    @nb.njit(**JIT)
    def one(t, u8, i8, u16, w32, o, x, xs, n):
        size, m = _step(t, n)
        acc = f32(0)
        for s in range(n // m):
            _prefetch(u8, o + s * size + PREFETCH)
            acc += blk(u8, i8, u16, w32, o + s * size, x, xs, s * m, m)
        return acc

    @nb.njit(**JIT)
    def two(t, u8, i8, u16, w32, oa, ob, x, xs, n):
        size, m = _step(t, n)
        a = f32(0)
        b = f32(0)
        for s in range(n // m):
            _prefetch(u8, oa + s * size + PREFETCH)
            _prefetch(u8, ob + s * size + PREFETCH)
            a += blk(u8, i8, u16, w32, oa + s * size, x, xs, s * m, m)
            b += blk(u8, i8, u16, w32, ob + s * size, x, xs, s * m, m)
        return a, b
    return one, two


_q4_k = _rows_of(_blk_q4_k)[0]
_q5_k, _q5_k2 = _rows_of(_blk_q5_k)
_q6_k, _q6_k2 = _rows_of(_blk_q6_k)
_q8_0, _q8_02 = _rows_of(_blk_q8_0)
_bf16, _bf162 = _rows_of(_blk_bf16)
_f16r, _f16r2 = _rows_of(_blk_f16)
_f32r, _f32r2 = _rows_of(_blk_f32)


@nb.njit(**JIT)
def _row(t, u8, i8, u16, w32, o, x, xs, n):
    """The row of type t at byte o, n values, . x (n,)."""
    if t == Q4_K:
        return _q4_k(t, u8, i8, u16, w32, o, x, xs, n)
    if t == Q6_K:
        return _q6_k(t, u8, i8, u16, w32, o, x, xs, n)
    if t == Q8_0:
        return _q8_0(t, u8, i8, u16, w32, o, x, xs, n)
    if t == Q5_K:
        return _q5_k(t, u8, i8, u16, w32, o, x, xs, n)
    if t == BF16:
        return _bf16(t, u8, i8, u16, w32, o, x, xs, n)
    if t == F16:
        return _f16r(t, u8, i8, u16, w32, o, x, xs, n)
    return _f32r(t, u8, i8, u16, w32, o, x, xs, n)


@nb.njit(**JIT)
def _rows2(t, u8, i8, u16, w32, oa, ob, x, xs, n):
    """Two rows of one type t (gate's and up's) . x."""
    if t == Q4_K:
        return _q4_k2(t, u8, i8, u16, w32, oa, ob, x, xs, n)
    if t == Q6_K:
        return _q6_k2(t, u8, i8, u16, w32, oa, ob, x, xs, n)
    if t == Q8_0:
        return _q8_02(t, u8, i8, u16, w32, oa, ob, x, xs, n)
    if t == Q5_K:
        return _q5_k2(t, u8, i8, u16, w32, oa, ob, x, xs, n)
    if t == BF16:
        return _bf162(t, u8, i8, u16, w32, oa, ob, x, xs, n)
    if t == F16:
        return _f16r2(t, u8, i8, u16, w32, oa, ob, x, xs, n)
    return _f32r2(t, u8, i8, u16, w32, oa, ob, x, xs, n)


@nb.njit(**JIT)
def _sums32(v):
    """v (P, n) -> (P, n // 32): sums of each 32 values (the K-quants' min term)."""
    P, n = v.shape
    s = np.zeros((P, n // 32), dtype=np.float32)
    for p in range(P):
        for j in range(n // 32):
            a = f32(0)
            for l in range(32):
                a += v[p, j * 32 + l]
            s[p, j] = a
    return s


@nb.njit(parallel=True, **JIT)
def experts(x, u8, i8, u16, w32, ids, weights, n_experts, row, types, offsets, inter):
    T, H = x.shape
    k = ids.shape[1]
    # Group the (token, choice) pairs by expert, experts in order of first choice: pair p of expert u is token
    # tok[p], p in start[u]:start[u + 1]; pair[t, j] is (t, j)'s pair (-1: skipped).
    slot = np.full(n_experts, -1, dtype=np.int64)
    uniq = np.empty(T * k, dtype=np.int64)
    count = np.zeros(T * k + 1, dtype=np.int64)
    U = 0
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            if e < 0:
                continue
            if e >= n_experts:
                raise ValueError("an expert id is not below the layer's expert count")
            if slot[e] < 0:
                slot[e] = U
                uniq[U] = e
                U += 1
            count[slot[e] + 1] += 1
    start = np.cumsum(count[:U + 1])
    fill = start[:U].copy()
    tok = np.empty(start[U], dtype=np.int64)
    pair = np.full((T, k), -1, dtype=np.int64)
    for t in range(T):
        for j in range(k):
            if ids[t, j] >= 0:
                u = slot[ids[t, j]]
                pair[t, j] = fill[u]
                tok[fill[u]] = t
                fill[u] += 1
    P = start[U]
    xs = _sums32(x)                                            # (T, H // 32)
    tg, tu, td = types[0], types[1], types[2]
    rg, ru, rd = _nbytes(tg, H), _nbytes(tu, H), _nbytes(td, inter)     # bytes of a gate, up, down row

    # gate and up: one task a row of one expert, for every token that chose it (the rows stay in L1). Static
    # scheduling gives each thread a contiguous run of rows: streams the prefetchers follow.
    h = np.empty((P, inter), dtype=np.float32)                 # silu(gate x) * (up x) per pair
    for task in prange(U * inter):
        u, i = task // inter, task % inter
        og, ou = uniq[u] * row + offsets[0] + i * rg, uniq[u] * row + offsets[1] + i * ru
        for p in range(start[u], start[u + 1]):
            t = tok[p]
            if tg == tu:
                g, v = _rows2(tg, u8, i8, u16, w32, og, ou, x[t], xs[t], H)
            else:
                g, v = _row(tg, u8, i8, u16, w32, og, x[t], xs[t], H), _row(tu, u8, i8, u16, w32, ou, x[t], xs[t], H)
            h[p, i] = g / (f32(1) + np.exp(-g)) * v
    hs = _sums32(h)                                            # (P, I // 32)

    # down: one task a row of one expert's (H, I) matrix.
    y = np.empty((P, H), dtype=np.float32)
    for task in prange(U * H):
        u, r = task // H, task % H
        o = uniq[u] * row + offsets[2] + r * rd
        for p in range(start[u], start[u + 1]):
            y[p, r] = _row(td, u8, i8, u16, w32, o, h[p], hs[p], inter)

    # each token's weighted sum, in choice order (the same order whatever the thread count).
    out = np.zeros((T, H), dtype=np.float32)
    for t in prange(T):
        for j in range(k):
            p = pair[t, j]
            if p >= 0:
                wt = f32(weights[t, j])
                for r in range(H):
                    out[t, r] += wt * y[p, r]
    return out
