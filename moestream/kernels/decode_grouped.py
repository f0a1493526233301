"""The decode expert kernel for steps of several tokens: each routed expert read once, for every token that chose it.

    out = experts_by_address_grouped(x, addrs, weights, inter, landing)   # x (T, H), T >= 2; addrs, weights (T, k)

kernels/decode.py's contract (its `experts_by_address` hands steps of T >= 2 tokens here). Its one-token kernel
reads a token's experts per (token, choice), so an expert several tokens of a step chose would be read once per
token, and a miss would cross the link once per token that chose it (on the H200, 8-16 streams decoded together:
10-15% of the host reads). Here the step's T k choices are sorted by address before the launch (stable: each
expert's choices stay in token order), with torch ops that need no host sync (the whole step is one CUDA graph).
The first choice of each run of equal addresses leads its expert: its programs read each block of the expert's
rows once and apply it to every member of the run (at most T: a token's k addresses are distinct, as top-k ids
are), one member after the other, each with the arithmetic a run of one would do; the other choices' programs do
nothing. The down projection does the same into per-choice rows in float32, and a third launch sums each token's
k outputs, weighted, in choice order (j = 0 .. k-1), in float32, rounded once.

A token's bits depend only on the bytes read: not on where they were read from (a slot or host memory), not on
the order of the sort, nor on which other tokens chose its experts (each member's sums are its own). They are not
the one-token kernel's bits: its down projection and combine sum in another order. Block shapes are fixed.

Read-through (`landing`): the leader of an expert read from host memory (its address is the expert's host row)
also writes the rows it reads into a landing slot, at no cost on the link. The layer's distinct host-read experts,
in ascending expert id, take the R landing slots in order; the host replays the rule with
kernels.decode.landing_slots_grouped.
"""
from __future__ import annotations

import torch

from .decode_act import act_args
from .decode_tiles import DOWN, GATE_UP, fit

try:
    import triton
    import triton.language as tl
except ImportError:          # the CPU build of torch has no Triton: kernels/reference.py is the path there
    triton = None


if triton is not None:
    from .decode_act import down_bias, glu

    @triton.jit
    def _leads(saddr_ptr, p):
        """Sorted choice p's address, and whether p leads its run of equal addresses (its expert's choices)."""
        a = tl.load(saddr_ptr + p)
        return a, (p == 0) | (tl.load(saddr_ptr + p - 1, mask=p > 0, other=0) != a)

    @triton.jit
    def _members(saddr_ptr, p, a, N, MP: tl.constexpr):
        """The run that leader p (address a) leads: ms = 0 .. MP-1, which of p + ms are members (MP,), how many."""
        ms = tl.arange(0, MP)
        mine = (p + ms < N) & (tl.load(saddr_ptr + p + ms, mask=p + ms < N, other=0) == a)
        return ms, mine, tl.sum(mine.to(tl.int32), axis=0)

    @triton.jit
    def _gate_up(x_ptr, saddr_ptr, order_ptr, dest_ptr, h_ptr, N, H: tl.constexpr, I: tl.constexpr,
                 K: tl.constexpr, MP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                 LAND: tl.constexpr, eid_ptr, b13_ptr, OAI: tl.constexpr, LIMIT: tl.constexpr,
                 ALPHA: tl.constexpr):
        """Program (sorted position p, block of I): a leader's rows of its expert's gate and up, read once,
        against each member's x, then silu(g) * u (OAI: gpt-oss's, with the biases of each member's expert,
        eid at its choice) into the members' rows of h. LAND: a leader whose dest is not 0 also writes the rows it
        read there."""
        p = tl.program_id(0)
        a, lead = _leads(saddr_ptr, p)
        if lead:
            ms, mine, n = _members(saddr_ptr, p, a, N, MP)
            rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
            cols = tl.arange(0, BLOCK_H)
            rmask = rows < I
            base = a.to(tl.pointer_type(x_ptr.dtype.element_ty))
            if LAND:
                dest = tl.load(dest_ptr + p)
                to = dest.to(tl.pointer_type(x_ptr.dtype.element_ty))
            g = tl.zeros([MP, BLOCK_I], dtype=tl.float32)           # member m's sums in row m
            u = tl.zeros([MP, BLOCK_I], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                cmask = h0 + cols < H
                m = rmask[:, None] & cmask[None, :]
                off = rows[:, None] * H + h0 + cols[None, :]
                wg_raw = tl.load(base + off, mask=m, other=0.0)            # (BLOCK_I, BLOCK_H), read once
                wu_raw = tl.load(base + I * H + off, mask=m, other=0.0)
                if LAND:
                    if dest != 0:
                        tl.store(to + off, wg_raw, mask=m)
                        tl.store(to + I * H + off, wu_raw, mask=m)
                wg = wg_raw.to(tl.float32)
                wu = wu_raw.to(tl.float32)
                for i in range(0, n):
                    t = tl.load(order_ptr + p + i) // K
                    xv = tl.load(x_ptr + t * H + h0 + cols, mask=cmask, other=0.0).to(tl.float32)
                    sel = (ms == i)[:, None]
                    g = tl.where(sel, g + tl.sum(wg * xv[None, :], axis=1)[None, :], g)
                    u = tl.where(sel, u + tl.sum(wu * xv[None, :], axis=1)[None, :], u)
            pair = tl.load(order_ptr + p + ms, mask=mine, other=0)                            # (MP,)
            e = pair
            if OAI:
                e = tl.load(eid_ptr + pair, mask=mine, other=0)
            h = glu(g, u, b13_ptr + e[:, None] * (2 * I) + rows[None, :], mine[:, None] & rmask[None, :], I, OAI,
                    LIMIT, ALPHA)
            tl.store(h_ptr + pair[:, None] * I + rows[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=mine[:, None] & rmask[None, :])

    @triton.jit
    def _down(h_ptr, saddr_ptr, order_ptr, dest_ptr, y_ptr, N, H: tl.constexpr, I: tl.constexpr,
              MP: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, LAND: tl.constexpr):
        """Program (sorted position p, block of H): a leader's rows of its expert's down projection, read once,
        against each member's h, into the members' rows of y (T k, H), float32, unweighted."""
        p = tl.program_id(0)
        a, lead = _leads(saddr_ptr, p)
        if lead:
            ms, mine, n = _members(saddr_ptr, p, a, N, MP)
            rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
            cols = tl.arange(0, BLOCK_I)
            rmask = rows < H
            base = a.to(tl.pointer_type(h_ptr.dtype.element_ty)) + 2 * I * H
            if LAND:
                dest = tl.load(dest_ptr + p)
                to = dest.to(tl.pointer_type(h_ptr.dtype.element_ty)) + 2 * I * H
            acc = tl.zeros([MP, BLOCK_O], dtype=tl.float32)
            for i0 in range(0, I, BLOCK_I):
                cmask = i0 + cols < I
                m = rmask[:, None] & cmask[None, :]
                off = rows[:, None] * I + i0 + cols[None, :]
                wd_raw = tl.load(base + off, mask=m, other=0.0)             # (BLOCK_O, BLOCK_I), read once
                if LAND:
                    if dest != 0:
                        tl.store(to + off, wd_raw, mask=m)
                wd = wd_raw.to(tl.float32)
                for i in range(0, n):
                    pr = tl.load(order_ptr + p + i)
                    hv = tl.load(h_ptr + pr * I + i0 + cols, mask=cmask, other=0.0).to(tl.float32)
                    acc = tl.where((ms == i)[:, None], acc + tl.sum(wd * hv[None, :], axis=1)[None, :], acc)
            pair = tl.load(order_ptr + p + ms, mask=mine, other=0)
            tl.store(y_ptr + pair[:, None] * H + rows[None, :], acc, mask=mine[:, None] & rmask[None, :])

    @triton.jit
    def _combine(y_ptr, w_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, eid_ptr, b2_ptr,
                 OAI: tl.constexpr):
        """Program (t, block of H): sum over j = 0 .. K-1, in that order, of weights[t, j] y[t K + j], float32
        (OAI: y plus the down biases of its expert eid[t, j])."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            y = tl.load(y_ptr + (t * K + j) * H + cols, mask=cmask, other=0.0)
            if OAI:
                y = down_bias(y, b2_ptr + tl.load(eid_ptr + t * K + j) * H + cols, cmask, OAI)
            acc += w * y
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


# Block shapes, fixed: the gate/up and down tiles are the one-token kernel's (kernels/decode_tiles.py: GATE_UP,
# DOWN), not measured for this kernel yet; (BLOCK, warps) of the combine.
COMBINE = (512, 4)


def landing_dests(saddr: torch.Tensor, order: torch.Tensor, landing) -> torch.Tensor:
    """(T k,) int64: where each sorted choice's expert lands, 0 for nowhere (graph-safe torch, no host sync).
    `landing`: a kernels.stage.Landing (ids (T, k), host (E,), land (R,)). The distinct experts read from host
    memory (a choice's address is its expert's host row), in ascending expert id, take land[0 .. R-1]
    (kernels.decode.landing_slots_grouped)."""
    ids, host, land = landing.ids, landing.host, landing.land
    sid = ids.reshape(-1).long()[order]                                   # (T k,) expert of each sorted choice
    on_host = saddr == host[sid]                                          # (T k,)
    read = torch.zeros(host.numel(), dtype=torch.int32, device=saddr.device)
    read.scatter_add_(0, sid, on_host.to(torch.int32))                    # (E,): its choices read from host
    rank = torch.cumsum((read > 0).to(torch.int64), 0) - 1                # (E,) among the host-read experts
    R = land.numel()
    dest = torch.where((read > 0) & (rank < R), land[rank.clamp(0, R - 1)], 0)          # (E,)
    return torch.where(on_host, dest[sid], 0)


def experts_by_address_grouped(x: torch.Tensor, addrs: torch.Tensor, weights: torch.Tensor, inter: int,
                               landing=None, config: tuple = (GATE_UP, DOWN, COMBINE), act=None) -> torch.Tensor:
    """x (T, H), addrs (T, k) int64, weights (T, k) -> (T, H): sum_j weights[t, j] * expert_j(x[t]), each routed
    expert read once for all the tokens that chose it. `landing`: (ids (T, k), host (E,), land (R,)), see
    `landing_dests`. `act`: gpt-oss's activation and biases (kernels/reference.py's OaiSwiglu)."""
    T, H = x.shape
    k = addrs.shape[1]
    N = T * k
    (bi, bh, wa), (bo, bi2, wb), (bc, wc) = config
    x = x.contiguous()
    weights = weights.contiguous()
    saddr, order = torch.sort(addrs.reshape(-1), stable=True)           # (T k,): each expert's choices together
    land = landing is not None and landing[2].numel() > 0
    dest = landing_dests(saddr, order, landing) if land else saddr       # (T k,) (unread when not landing)
    mp = triton.next_power_of_2(T)                                      # a run has at most T members
    eid, b13, b2, oai, limit, alpha = act_args(act, x)
    h = torch.empty(N, inter, dtype=x.dtype, device=x.device)
    bi, bh = fit(inter, bi), fit(H, bh)
    _gate_up[(N, triton.cdiv(inter, bi))](x, saddr, order, dest, h, N, H, inter, k, mp, bi, bh, land, eid, b13, oai,
                                          limit, alpha, num_warps=wa)
    y = torch.empty(N, H, dtype=torch.float32, device=x.device)
    bo, bi2 = fit(H, bo), fit(inter, bi2)
    _down[(N, triton.cdiv(H, bo))](h, saddr, order, dest, y, N, H, inter, mp, bo, bi2, land, num_warps=wb)
    out = torch.empty_like(x)
    bc = fit(H, bc)
    _combine[(T, triton.cdiv(H, bc))](y, weights, out, H, k, bc, eid, b2, oai, num_warps=wc)
    return out
