"""The decode expert kernel: a few tokens' routed experts read where they lie, by address (Triton, CUDA).

    out = experts_by_address(x, addrs, weights, inter)     # x (T, H); addrs, weights (T, k) -> (T, H), combined

`addrs[t, j]` is the address of token t's j-th routed expert's row (gate (I, H) | up (I, H) | down (H, I),
contiguous): a slot of the GPU cache, or the expert's row in pinned host memory, which the GPU reads over the link
in place (unified addressing: a pinned host buffer has the same address on the device). A decode step then needs
no host decision and no upload on its critical path: a miss costs its bytes over the link once, as an upload would.

The kernel reads each choice's weights once and streams them (a decode token's experts are memory-bound GEMVs):
one launch computes every choice's silu(gate x) * (up x), a second its down projection, weighted and summed over
the k choices in a fixed order, in float32. The result depends only on the bytes read, never on where they were:
the same bits from a slot, from host memory or from the all-GPU layout. Block shapes are fixed (no autotuning: a
tuned choice could differ between runs, and with it the bits).

That is the one-token kernel. A step of several tokens goes to kernels/decode_grouped.py, which reads each routed
expert once for all the tokens that chose it (its bits are its own, not this kernel's).
"""
from __future__ import annotations

import torch

from .decode_act import act_args
from .decode_grouped import experts_by_address_grouped
from .decode_tiles import DOWN, GATE_UP, fit

try:
    import triton
    import triton.language as tl
except ImportError:          # the CPU build of torch has no Triton: the reference below is the path there
    triton = None

MAX_TOKENS = 16              # decode batches up to this many tokens use this kernel


def decode_available(device: torch.device, dtype: torch.dtype) -> bool:
    return triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


if triton is not None:
    from .decode_act import down_bias, glu_at

    @triton.jit
    def _landing(addr_ptr, ids_ptr, host_ptr, land_ptr, t, R, K: tl.constexpr, KP: tl.constexpr):
        """(KP,) int64: where token t's choices land (read-through), 0 for none. A choice read from host memory
        (its address is its expert's host row) takes the next of the layer's R landing slots, in choice order."""
        js = tl.arange(0, KP)
        jmask = js < K
        a = tl.load(addr_ptr + t * K + js, mask=jmask, other=0)
        e = tl.load(ids_ptr + t * K + js, mask=jmask, other=0)
        on_host = jmask & (a == tl.load(host_ptr + e, mask=jmask, other=1))
        rank = tl.cumsum(on_host.to(tl.int32), axis=0) - 1
        lands = on_host & (rank < R)
        return tl.load(land_ptr + rank, mask=lands, other=0)

    @triton.jit
    def _gate_up(x_ptr, addr_ptr, h_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
                 BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, LAND: tl.constexpr, ids_ptr, host_ptr, land_ptr, R,
                 KP: tl.constexpr, eid_ptr, b13_ptr, OAI: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
        """Program (t k + j, block of I): rows of choice j's gate and up against x[t], then silu(g) * u (OAI:
        gpt-oss's, kernels/decode_act.py, with the biases of expert eid[t, j]). LAND: a choice read from host
        memory also writes the rows it read to its landing slot."""
        pair = tl.program_id(0)
        t = pair // K
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        cols = tl.arange(0, BLOCK_H)
        base = tl.load(addr_ptr + pair).to(tl.pointer_type(x_ptr.dtype.element_ty))
        if LAND:
            js = tl.arange(0, KP)
            dests = _landing(addr_ptr, ids_ptr, host_ptr, land_ptr, t, R, K, KP)
            dest = tl.sum(tl.where(js == pair % K, dests, 0), axis=0)
            to = dest.to(tl.pointer_type(x_ptr.dtype.element_ty))
        g = tl.zeros([BLOCK_I], dtype=tl.float32)
        u = tl.zeros([BLOCK_I], dtype=tl.float32)
        rmask = rows < I
        for h0 in range(0, H, BLOCK_H):
            cmask = h0 + cols < H
            xv = tl.load(x_ptr + t * H + h0 + cols, mask=cmask, other=0.0).to(tl.float32)
            m = rmask[:, None] & cmask[None, :]
            off = rows[:, None] * H + h0 + cols[None, :]
            wg_raw = tl.load(base + off, mask=m, other=0.0)
            wu_raw = tl.load(base + I * H + off, mask=m, other=0.0)
            if LAND:
                if dest != 0:                             # only a landing choice's programs store
                    tl.store(to + off, wg_raw, mask=m)
                    tl.store(to + I * H + off, wu_raw, mask=m)
            wg = wg_raw.to(tl.float32)
            wu = wu_raw.to(tl.float32)
            g += tl.sum(wg * xv[None, :], axis=1)
            u += tl.sum(wu * xv[None, :], axis=1)
        h = glu_at(g, u, eid_ptr, pair, b13_ptr, rows, rmask, I, OAI, LIMIT, ALPHA)
        tl.store(h_ptr + pair * I + rows, h.to(h_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _down(h_ptr, addr_ptr, w_ptr, out_ptr, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
              KP: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, LAND: tl.constexpr, ids_ptr, host_ptr,
              land_ptr, R, eid_ptr, b2_ptr, OAI: tl.constexpr):
        """Program (t, block of H): rows of every choice's down projection at once (OAI: plus the down biases of
        each choice's expert eid[t, j]), weighted, summed over j. LAND: choices read from host memory also write
        the rows they read to their landing slots."""
        t = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        cols = tl.arange(0, BLOCK_I)
        js = tl.arange(0, KP)
        jmask = js < K
        rmask = rows < H
        base = tl.load(addr_ptr + t * K + js, mask=jmask, other=0).to(tl.pointer_type(out_ptr.dtype.element_ty))
        base += 2 * I * H
        if LAND:
            dests = _landing(addr_ptr, ids_ptr, host_ptr, land_ptr, t, R, K, KP)
            to = dests.to(tl.pointer_type(out_ptr.dtype.element_ty)) + 2 * I * H
        wj = tl.load(w_ptr + t * K + js, mask=jmask, other=0.0).to(tl.float32)
        acc = tl.zeros([KP, BLOCK_O], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            cmask = i0 + cols < I
            hv = tl.load(h_ptr + (t * K + js[:, None]) * I + i0 + cols[None, :],
                         mask=jmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)        # (KP, BLOCK_I)
            m = jmask[:, None, None] & rmask[None, :, None] & cmask[None, None, :]
            off = rows[None, :, None] * I + i0 + cols[None, None, :]
            wd_raw = tl.load(base[:, None, None] + off, mask=m, other=0.0)                     # (KP, BLOCK_O, BLOCK_I)
            if LAND:
                if tl.max(dests, axis=0) != 0:            # only a token with a landing choice stores
                    tl.store(to[:, None, None] + off, wd_raw, mask=m & (dests != 0)[:, None, None])
            acc += tl.sum(wd_raw.to(tl.float32) * hv[:, None, :], axis=2)
        if OAI:
            e = tl.load(eid_ptr + t * K + js, mask=jmask, other=0)
            acc = down_bias(acc, b2_ptr + e[:, None] * H + rows[None, :], jmask[:, None] & rmask[None, :], OAI)
        out = tl.sum(acc * wj[:, None], axis=0)
        tl.store(out_ptr + t * H + rows, out.to(out_ptr.dtype.element_ty), mask=rmask)


def experts_by_address(x: torch.Tensor, addrs: torch.Tensor, weights: torch.Tensor, inter: int,
                       landing=None, config: tuple = (GATE_UP, DOWN), grouped: bool = True,
                       act=None) -> torch.Tensor:
    """x (T, H), addrs (T, k) int64, weights (T, k) -> (T, H): sum_j weights[t, j] * expert_j(x[t]).
    `act`: gpt-oss's activation and biases (kernels/reference.py's OaiSwiglu, its ids the choices' experts).

    One token: each choice reads its expert. Several tokens (T >= 2, and `grouped`): kernels/decode_grouped.py,
    which reads each routed expert once for every token that chose it, so a miss crosses the link once a step.
    `grouped=False` keeps this kernel for them, one read per (token, choice) (to measure the difference).

    `landing` (read-through): kernels.stage.Landing (ids (T, k), host (E,), land (R,), ...): the layer's routed
    ids, each expert's host-row address and R free slots. One token: the choices read from host memory (address
    == host[id]), in choice order, write the bytes they read into the slots (see `landing_slots`), at no extra
    cost on the link. Several: the distinct host-read experts, in ascending id (see `landing_slots_grouped`)."""
    T, H = x.shape
    k = addrs.shape[1]
    if T > 1 and grouped:
        return experts_by_address_grouped(x, addrs, weights, inter, landing, act=act)
    (bi, bh, wa), (bo, bi2, wb) = config
    x = x.contiguous()
    addrs = addrs.contiguous()
    weights = weights.contiguous()
    kp = triton.next_power_of_2(k)
    land = landing is not None and T == 1
    ids, host, slots = (landing.ids, landing.host, landing.land) if land else (addrs, addrs, addrs)
    R = slots.numel() if land else 0
    eid, b13, b2, oai, limit, alpha = act_args(act, x)
    h = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    bi, bh = fit(inter, bi), fit(H, bh)
    _gate_up[(T * k, triton.cdiv(inter, bi))](x, addrs, h, H, inter, k, bi, bh, land, ids, host, slots, R, kp,
                                              eid, b13, oai, limit, alpha, num_warps=wa)
    out = torch.empty_like(x)
    bo, bi2 = fit(H, bo), fit(inter, bi2)
    _down[(T, triton.cdiv(H, bo))](h, addrs, weights, out, H, inter, k, kp, bo, bi2, land, ids, host, slots, R,
                                   eid, b2, oai, num_warps=wb)
    return out


def landing_slots(on_host, n_slots: int) -> list[tuple[int, int]]:
    """The kernel's read-through rule, on the host: [(choice j, landing slot i)] for one token's k choices
    (on_host[j]: choice j was read from host memory), in choice order, the first n_slots of them."""
    return [(j, i) for i, j in enumerate([j for j, h in enumerate(on_host) if h][:n_slots])]


def landing_slots_grouped(ids, on_host, n_slots: int) -> list[tuple[int, int]]:
    """The grouped kernel's read-through rule (several tokens, kernels/decode_grouped.py), on the host:
    [(expert, landing slot i)] for a step's T k choices (ids: their experts; on_host: read from host memory), the
    distinct host-read experts in ascending id, the first n_slots of them."""
    read = sorted({int(e) for e, h in zip(ids, on_host) if h})
    return [(e, i) for i, e in enumerate(read[:n_slots])]
