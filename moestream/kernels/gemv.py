"""A decode step's matrix-vector products (Triton, CUDA), with the residual add and RMSNorm before them fused in,
and the MoE router's softmax and top-k after its product.

    y = linear(x, w, bias)                                  # x (T, K) -> (T, N); one token: this module's GEMV
    h, normed, y = norm_linear(h, delta, nw, eps, w, bias)  # y = linear(RMSNorm(h + delta) * nw, w, bias)
    h, normed, weights, ids, addrs = norm_route(h, delta, nw, eps, router, k, renormalise, dtype, table)

A one-token decode layer is a few GEMVs between tiny kernels, and each launch costs a few microseconds of gaps and
ramp-up for a few megabytes: the Qwen3-30B-A3B reference's step had 14 launches a layer (bench/RESULTS.md, stop 17).
Here the add and norm before the mixer's input projection run in the projection's programs (each recomputes the
row's norm, a few KiB from L2, and program 0 writes the new residual stream and the normed row), and the MoE
block's add, norm, router product, softmax, top-k, renormalisation and address lookup are one launch: one-warp
programs of one or a few experts' logits each, the last of a token's programs to finish (an atomic count, reset by
it) runs the softmax and top-k on all of them. The count only elects which program does the top-k; every logit is
one program's fixed-order sum, so the bits do not depend on the order programs run in.

A program reads whole rows of the weight in one load (TILE weights at most), not a loop over K: a loop's loads
wait on each other, and the first version, 512 columns a step, took 12.8 us for a 5120 x 2048 projection where
cuBLAS takes 8 (bench/RESULTS.md, stop 17). Products are float32 sums of bf16 products in a fixed order per output
(the lanes' shares, then across lanes), the normed row rounded to its dtype first as the eager ops round it; the
bits differ from cuBLAS's (oracles: the torch ops, tests/test_gemv.py), and every expert placement runs the same
kernels, so the numerics contract holds. linear and norm_linear take this path for one token (a several-token step
reads cuBLAS's GEMMs, which read each weight once for all tokens); norm_route serves any number of tokens (a
router is a few hundred KiB).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TILE = 16384                 # weights a program reads at once: whole rows, one load each, no loop to wait on
MIN_PROGRAMS = 512           # a GEMV's rows a program halve until it has this many programs (or one row)
GEMV_WARPS = 8               # TILE and warps: the least time over five projections (bench/gemv.py, RESULTS.md)
ROUTE_WARPS = 1              # the router's programs: one warp each, so its norm and top-k reduce in shuffles


if triton is not None:
    @triton.jit
    def _normed_row(x_ptr, d_ptr, nw_ptr, hout_ptr, nout_ptr, eps, write, K: tl.constexpr, KP: tl.constexpr,
                    NORM: tl.constexpr, DELTA: tl.constexpr):
        """(KP,) float32: the whole row x (+ d), RMS-normed and times nw where NORM, rounded to x's dtype as the
        eager ops round it; where `write`, the new residual stream x + d and the normed row stored."""
        k = tl.arange(0, KP)
        km = k < K
        s = tl.load(x_ptr + k, mask=km, other=0.0)
        if DELTA:
            s = s + tl.load(d_ptr + k, mask=km, other=0.0)
        sf = s.to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(sf * sf, axis=0) / K + eps)
            y = (sf * r * tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if write:
                tl.store(hout_ptr + k, s, mask=km)
                tl.store(nout_ptr + k, y, mask=km)
            sf = y.to(tl.float32)
        return sf

    @triton.jit
    def _rows_dot(w_ptr, xv, n, nm, K: tl.constexpr, KP: tl.constexpr):
        """(BN,) float32: whole rows n of w (N, K) against xv (KP,), in one load."""
        k = tl.arange(0, KP)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0)
        return tl.sum(w.to(tl.float32) * xv[None, :], axis=1)

    @triton.jit
    def _gemv(x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, hout_ptr, nout_ptr, eps, N, K: tl.constexpr,
              KP: tl.constexpr, NORM: tl.constexpr, DELTA: tl.constexpr, BIAS: tl.constexpr, BN: tl.constexpr):
        """Program p: outputs [p BN, (p + 1) BN) of one token's y = w x (+ b), x normed first where NORM."""
        pid = tl.program_id(0)
        xv = _normed_row(x_ptr, d_ptr, nw_ptr, hout_ptr, nout_ptr, eps, pid == 0, K, KP, NORM, DELTA)
        n = pid * BN + tl.arange(0, BN)
        nm = n < N
        y = _rows_dot(w_ptr, xv, n, nm, K, KP)
        if BIAS:
            y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nm)

    @triton.jit
    def _group_limited_topk(x, ee, b_ptr, scale, E, EP: tl.constexpr, TOPK: tl.constexpr, TKP: tl.constexpr,
                            RENORM: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr, GROUPS: tl.constexpr,
                            GP: tl.constexpr, TOPK_GROUP: tl.constexpr):
        """models/router.py's route past plain softmax, on one token's float32 logits x (EP,): the scores (sigmoid,
        or softmax), the choice (scores + the correction bias b where BIAS), the best TOPK_GROUP of GROUPS groups of
        E / GROUPS experts by the sum of their two best choices, the TOPK best choices within them (ties to the
        lower id, groups as experts); -> (TKP,) weights (their scores, renormalised where RENORM, times scale) and
        ids."""
        valid = ee < E
        if SIGMOID:
            s = tl.sigmoid(x)
        else:
            s = tl.exp(x - tl.max(x, axis=0))
            s = s / tl.sum(s, axis=0)
        c = s
        if BIAS:
            c = c + tl.load(b_ptr + ee, mask=valid, other=0.0).to(tl.float32)
        c = tl.where(valid, c, float("-inf"))
        if GROUPS > 1:
            gi = tl.arange(0, GP)
            member = (ee[None, :] // (E // GROUPS)) == gi[:, None]                        # (GP, EP)
            v = tl.where(member, c[None, :], float("-inf"))
            top1 = tl.max(v, axis=1)
            first = tl.min(tl.where(v == top1[:, None], ee[None, :], EP), axis=1)
            top2 = tl.max(tl.where(ee[None, :] == first[:, None], float("-inf"), v), axis=1)
            gs = tl.where(gi < GROUPS, top1 + top2, float("-inf"))                      # (GP,) a group's score
            keep = gi < 0
            for n in tl.static_range(TOPK_GROUP):
                best = tl.max(gs, axis=0)
                g = tl.min(tl.where(gs == best, gi, GP), axis=0)
                keep = keep | (gi == g)
                gs = tl.where(gi == g, float("-inf"), gs)
            kept = tl.max((member & keep[:, None]).to(tl.int32), axis=0) > 0              # (EP,)
            c = tl.where(kept, c, float("-inf"))
        j = tl.arange(0, TKP)
        ws = tl.zeros([TKP], dtype=tl.float32)
        ids = tl.zeros([TKP], dtype=tl.int64)
        for n in tl.static_range(TOPK):
            best = tl.max(c, axis=0)
            idx = tl.min(tl.where(c == best, ee, EP), axis=0)
            ws = tl.where(j == n, tl.sum(tl.where(ee == idx, s, 0.0), axis=0), ws)
            ids = tl.where(j == n, idx.to(tl.int64), ids)
            c = tl.where(ee == idx, float("-inf"), c)
        if RENORM:
            ws = ws / (tl.sum(ws, axis=0) + 1e-20)
        return ws * scale, ids

    @triton.jit
    def _topk_softmax(x, ee, EP: tl.constexpr, TOPK: tl.constexpr, TKP: tl.constexpr):
        """gpt-oss's softmax_weight on one token's float32 logits x (EP,): the TOPK largest (ties to the lower id),
        then a softmax over those TOPK; -> (TKP,) weights and ids."""
        j = tl.arange(0, TKP)
        top = tl.full([TKP], float("-inf"), dtype=tl.float32)
        ids = tl.zeros([TKP], dtype=tl.int64)
        for n in tl.static_range(TOPK):
            best = tl.max(x, axis=0)
            idx = tl.min(tl.where(x == best, ee, EP), axis=0)
            top = tl.where(j == n, best, top)
            ids = tl.where(j == n, idx.to(tl.int64), ids)
            x = tl.where(ee == idx, float("-inf"), x)
        p = tl.where(j < TOPK, tl.exp(top - tl.max(top, axis=0)), 0.0)
        return p / tl.sum(p, axis=0), ids

    @triton.jit
    def _norm_route(x_ptr, d_ptr, nw_ptr, r_ptr, lg_ptr, cnt_ptr, w_ptr, id_ptr, hout_ptr, nout_ptr, tab_ptr,
                    addr_ptr, routed_ptr, b_ptr, lb_ptr, eps, scale, E, K: tl.constexpr, KP: tl.constexpr,
                    EB: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, TKP: tl.constexpr, RENORM: tl.constexpr,
                    NPROG: tl.constexpr, TABLE: tl.constexpr, ROUTED: tl.constexpr, PLAIN: tl.constexpr,
                    SIGMOID: tl.constexpr, BIAS: tl.constexpr, GROUPS: tl.constexpr, GP: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, TOPK_SOFTMAX: tl.constexpr, LINEAR_BIAS: tl.constexpr):
        """Program (t, p): token t's add and norm, the logits of experts [p EB, (p + 1) EB) in float32 (plus the
        router linear's bias lb where LINEAR_BIAS); the last of t's NPROG programs to finish: where PLAIN, softmax,
        the TOPK largest (ties to the lower id), renormalised; where TOPK_SOFTMAX, _topk_softmax; else
        _group_limited_topk; where TABLE, each choice's address from the table (and where ROUTED, the ids kept
        flat for the host too)."""
        t = tl.program_id(0)
        pid = tl.program_id(1)
        xv = _normed_row(x_ptr + t * K, d_ptr + t * K, nw_ptr, hout_ptr + t * K, nout_ptr + t * K, eps, pid == 0,
                         K, KP, True, True)
        e = pid * EB + tl.arange(0, EB)
        em = e < E
        lg = _rows_dot(r_ptr, xv, e, em, K, KP)
        if LINEAR_BIAS:
            lg += tl.load(lb_ptr + e, mask=em, other=0.0).to(tl.float32)
        tl.store(lg_ptr + t * E + e, lg, mask=em)
        tl.debug_barrier()              # every lane's logits stored before the count says so (release, gpu scope)
        if tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu") == NPROG - 1:
            ee = tl.arange(0, EP)
            j = tl.arange(0, TKP)
            x = tl.load(lg_ptr + t * E + ee, mask=ee < E, other=float("-inf"), volatile=True)
            if PLAIN:
                p = tl.exp(x - tl.max(x, axis=0))
                p = p / tl.sum(p, axis=0)
                p = tl.where(ee < E, p, -1.0)
                ws = tl.zeros([TKP], dtype=tl.float32)
                ids = tl.zeros([TKP], dtype=tl.int64)
                for n in tl.static_range(TOPK):
                    best = tl.max(p, axis=0)
                    idx = tl.min(tl.where(p == best, ee, EP), axis=0)
                    ws = tl.where(j == n, best, ws)
                    ids = tl.where(j == n, idx.to(tl.int64), ids)
                    p = tl.where(ee == idx, -1.0, p)
                if RENORM:
                    ws = ws / tl.sum(ws, axis=0)
            elif TOPK_SOFTMAX:
                ws, ids = _topk_softmax(x, ee, EP, TOPK, TKP)
            else:
                ws, ids = _group_limited_topk(x, ee, b_ptr, scale, E, EP, TOPK, TKP, RENORM, SIGMOID, BIAS, GROUPS,
                                              GP, TOPK_GROUP)
            tl.store(w_ptr + t * TOPK + j, ws.to(w_ptr.dtype.element_ty), mask=j < TOPK)
            tl.store(id_ptr + t * TOPK + j, ids, mask=j < TOPK)
            if TABLE:
                tl.store(addr_ptr + t * TOPK + j, tl.load(tab_ptr + ids, mask=j < TOPK), mask=j < TOPK)
            if ROUTED:
                tl.store(routed_ptr + t * TOPK + j, ids, mask=j < TOPK)
            tl.store(cnt_ptr + t, 0)    # ready for the next launch (a graph's replays reuse the count)


def _rows_a_program(n: int, kp: int) -> int:
    """Rows a GEMV program reads: TILE weights at most, halved until the GEMV has MIN_PROGRAMS programs."""
    bn = max(1, TILE // kp)
    while bn > 1 and triton.cdiv(n, bn) < MIN_PROGRAMS:
        bn //= 2
    return bn


def _launch_gemv(x, delta, nw, eps, w, bias, norm: bool):
    T, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or not w.is_contiguous():
        raise ValueError(f"gemv: weight {tuple(w.shape)} (contiguous) against x {tuple(x.shape)}")
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    h, normed = (torch.empty_like(x), torch.empty_like(x)) if norm else (x, x)
    kp = triton.next_power_of_2(K)
    bn = _rows_a_program(N, kp)
    _gemv[(triton.cdiv(N, bn),)](x, x if delta is None else delta.contiguous(), x if nw is None else nw, w,
                                 w if bias is None else bias, y, h, normed, eps, N, K, kp, norm, delta is not None,
                                 bias is not None, bn, num_warps=GEMV_WARPS)
    return h, normed, y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x (T, K): one token through this module's GEMV, several through cuBLAS."""
    if x.shape[0] != 1:
        return F.linear(x, w, bias)
    return _launch_gemv(x.contiguous(), None, None, 0.0, w, bias, norm=False)[2]


def norm_linear(h: torch.Tensor, delta: torch.Tensor, nw: torch.Tensor, eps: float, w: torch.Tensor,
                bias: torch.Tensor | None = None):
    """(h + delta, its RMSNorm * nw, linear(that, w, bias)) for one token h, delta (1, K): one launch."""
    if h.shape[0] != 1:
        raise ValueError(f"norm_linear takes one token, got {h.shape[0]}")
    return _launch_gemv(h.contiguous(), delta, nw, eps, w, bias, norm=True)


MAX_ROUTED = 4096            # tokens a norm_route launch takes (a decode step has at most kernels/decode.MAX_TOKENS)
_counts: dict[torch.device, torch.Tensor] = {}


def _election_counts(device: torch.device) -> torch.Tensor:
    """norm_route's counts on `device`: zeros, each reset by the program that finishes its token. Allocated once
    (a captured graph keeps the pointer; a graph's warm-up, eager, allocates it before any capture) and shared by
    the device's decode steps, which one engine runs one after another on one stream."""
    cnt = _counts.get(device)
    if cnt is None:
        cnt = _counts[device] = torch.zeros(MAX_ROUTED, dtype=torch.int32, device=device)
    return cnt


def norm_route(h: torch.Tensor, delta: torch.Tensor, nw: torch.Tensor, eps: float, router: torch.Tensor, k: int,
               renormalise: bool, dtype: torch.dtype, table: tuple | None = None, gating: str | None = None,
               bias: torch.Tensor | None = None, groups: int = 1, topk_group: int = 1, scale: float = 1.0,
               linear_bias: torch.Tensor | None = None):
    """h, delta (T, K), router (E, K) -> (h + delta, its RMSNorm * nw, (T, k) weights (dtype), (T, k) int64 ids,
    (T, k) int64 addresses or None): the MoE block's add, norm, router, softmax, top-k and renormalisation in one
    launch. table: a zero-copy step's (the expert rows' addresses (E,), a flat int64 row to keep the ids in, or
    None) from the provider's address_table; the addresses are table[ids].

    gating None: plain softmax top-k (models/router.py's SOFTMAX). "sigmoid" or "softmax": route's float32 form
    (DeepSeek-V3, GLM-4.5, DeepSeek-V2): the scores, `bias` (E,) added for the choice only, the best topk_group
    of `groups` expert groups, top-k within them, their scores renormalised (+ 1e-20) and times `scale`.
    "softmax_weight" (gpt-oss): top-k over the logits, a float32 softmax over those k (renormalise and scale not
    read). linear_bias (E,): the router linear's bias, added to the float32 logits (gpt-oss's router)."""
    T, K = h.shape
    E = router.shape[0]
    if T > MAX_ROUTED:
        raise ValueError(f"norm_route takes at most {MAX_ROUTED} tokens, got {T}")
    if gating not in (None, "sigmoid", "softmax", "softmax_weight") or E % groups or \
            (groups > 1 and (E // groups < 2 or gating == "softmax_weight")):
        raise ValueError(f"norm_route: no {gating} routing over {E} experts in {groups} groups")
    h_new, normed = torch.empty_like(h), torch.empty_like(h)
    logits = torch.empty(T, E, dtype=torch.float32, device=h.device)
    w = torch.empty(T, k, dtype=dtype, device=h.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=h.device)
    tab, routed = table if table is not None else (None, None)
    addrs = None if tab is None else torch.empty(T, k, dtype=torch.int64, device=h.device)
    kp = triton.next_power_of_2(K)
    eb = max(1, min(triton.next_power_of_2(E), 2048 // kp))       # experts a program: 2048 weights a warp
    nprog = triton.cdiv(E, eb)
    _norm_route[(T, nprog)](h.contiguous(), delta.contiguous(), nw, router, logits, _election_counts(h.device), w,
                            ids, h_new, normed, ids if tab is None else tab, ids if addrs is None else addrs,
                            ids if routed is None else routed, logits if bias is None else bias,
                            logits if linear_bias is None else linear_bias, eps, float(scale), E, K, kp, eb,
                            triton.next_power_of_2(E), k, triton.next_power_of_2(k), renormalise, nprog,
                            tab is not None, routed is not None, gating is None, gating == "sigmoid",
                            bias is not None, groups, triton.next_power_of_2(groups), topk_group,
                            gating == "softmax_weight", linear_bias is not None, num_warps=ROUTE_WARPS)
    return h_new, normed, w, ids, addrs
