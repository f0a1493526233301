"""The "runs" variant of the quantized decode kernel: kernels/decode_quant.py's contract, one 16-byte run a lane.

    out = experts_by_address_runs(x, addrs, weights, layout)    # x (T, H); addrs, weights (T, k) -> (T, H)

A program's lanes each own a unit of one block (kernels/qruns.py: 16-byte runs of quants, 16 to 64 values of
one to four sub-blocks; kernels/qruns_units.py reads them) and keep its sums in registers; a step is UNITS_A_STEP
units, one a lane, so every load is a lane's own run and the lanes of a warp read neighbouring runs. Two launches,
as "values" has:

- gate and up: program (t k + j, R rows of I): the R rows' units of choice j's gate and the same units of its up,
  in the same lanes (one x load serves both), R * BB * NU units a step, NB / BB steps; then silu(g) * u, rounded
  to x's dtype (kept as float32 for the down launch, which then reads x without converting).
- down: program (t, RL R rows of H): the units of all k choices' rows at once (the choices are a tile axis, so a
  token's 8 experts load in parallel), each lane a unit of one row (RL = 1, one token) or of rows r and r + R
  against one x (RL = 2, several tokens); weighted and summed over the k choices in a fixed tree order, in float32.

A Q4_K_M token (k=8, I=768, H=2048) is 1536 gate/up programs of 4 rows (a row of 8 blocks in one step) and 512
down programs of 4 rows (a row of 3 blocks in 3 unrolled steps).

x and h are read in the lanes' order (qruns.lane_order): the gate/up launch gathers x into it first (one small
launch), and writes h in the down launch's. In the rows' order every lane of a warp read its x from a 128-byte line
of its own (its unit's 32-64 values), and those L1 wavefronts, not the bytes, bound both launches; in the lanes'
order the lanes of a warp read neighbouring x. Measured on the H200 (bench/quant_kernels.py, 2026-12-04): a
Q4_K_M token's experts 35.1 -> 25.2 us from device memory, 8 tokens' 231.5 -> 127.9 (bench/RESULTS.md, stop 23).
The arithmetic is the same, so are the bits.

Every byte is read once, by one lane, from wherever it lies; where the compiler can be told that a run is 16-aligned
(Q4_K and Q5_K in a 16-aligned row) it is one 128-bit load, else aligned words shifted into place. The bits depend
on the bytes alone: the placement changes the loads, never the arithmetic (the tests read the same bytes at other
addresses, odd ones too). Shapes follow from the types and the shape alone; no autotuning.
"""
from __future__ import annotations

import torch

from ..quant.layout import ExpertLayout
from ..quant.types import row_bytes
from .decode_act import act_args
from .qblocks import SHAPES, triton
from .qruns import UNITS, aligned16, lane_order, runs_available

UNITS_A_STEP = 128           # units (one a lane) a program reads a step
WARPS = 4
ONE = 0x3F800000             # 1.0's bits, passed at run time (kernels/qruns_units.py's _f)
UNROLL = 4                   # a row of at most this many steps is read unrolled
LANE_ORDER = True            # x and h in the lanes' order (qruns.lane_order); False: the rows' order
DOWN_ROWS_A_LANE = None      # rows a down lane reads (2: the same unit of rows r and r + R against one x load);
                             # None: 1 for one token (25.2 against 26.9 us), 2 for several (T=8: 120.5 against 127.9)


def runs_layout(layout: ExpertLayout) -> bool:
    """Whether the layout has a runs path: gate and up of one type, each of its types with runs."""
    if triton is None or not layout.quantized:
        return False
    (g, u, d), I, H = layout.types, layout.inter, layout.hidden
    return g == u and runs_available(g, H) and runs_available(d, I)


def _tile(qtype, n_cols: int, per_row: int) -> tuple[int, int, tuple]:
    """(rows a program, blocks a step, the matrix's block constexprs (NB, BS, TS, NU)): R rows x per_row
    (choices) x BB blocks x NU units = UNITS_A_STEP, BB the largest power of two dividing the row's blocks."""
    bs, ts = SHAPES[qtype][:2]
    nu = UNITS[qtype][0]
    nb = n_cols // bs
    bb = 1
    while nb % (2 * bb) == 0 and per_row * 2 * bb * nu <= UNITS_A_STEP:
        bb *= 2
    rows = max(1, UNITS_A_STEP // (per_row * bb * nu))
    return rows, bb, (nb, bs, ts, nu)


if triton is not None:
    import triton.language as tl

    from .decode_act import down_bias, glu_at
    from .qruns_units import _scalar, unit_dots, unit_words

    @triton.jit
    def _dots(blk, blk2, c, m, m2, xp, al, one, QT: tl.constexpr, A16: tl.constexpr, TWO: tl.constexpr,
              XS: tl.constexpr):
        """A step: the units' words (kernels/qruns_units.py), then their dot products with x."""
        ws, ws2 = unit_words(blk, blk2, c, m, m2, al, QT, A16, TWO)
        return unit_dots(ws, ws2, c, m | m2, xp, one, QT, TWO, XS)

    @triton.jit
    def _gate_up_runs(x_ptr, addr_ptr, h_ptr, pos_ptr, one, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
                      R: tl.constexpr, OG: tl.constexpr, OU: tl.constexpr, QT: tl.constexpr, RB: tl.constexpr,
                      NB: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NU: tl.constexpr, BB: tl.constexpr,
                      A16: tl.constexpr, UNR: tl.constexpr, XS: tl.constexpr, HJ: tl.constexpr, eid_ptr, b13_ptr,
                      OAI: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
        """Program (t k + j, R rows of I): choice j's gate and up rows against x[t], then silu(g) * u (OAI:
        gpt-oss's, kernels/decode_act.py, with the biases of expert eid[t, j]), rounded
        to x's dtype (stored as float32, which the down launch then reads without converting). XS > 0: x[t] is
        in the lanes' order (qruns.lane_order), and h[t] too, for the down launch: the value of row r at
        pos[r] + j HJ of token t's k I."""
        pair = tl.program_id(0)
        t = pair // K
        L: tl.constexpr = R * BB * NU
        u = tl.arange(0, L)
        row = tl.program_id(1) * R + u // (BB * NU)                                  # (L,) the unit's row
        bi = (u // NU) % BB
        c = u % NU
        m = row < I
        a = tl.load(addr_ptr + pair)
        al = (a & 15) == 0
        blk = a + row * RB + bi * TS                                                 # (L,) int64
        if XS == 0:
            xp = x_ptr + t * H + bi * BS
        else:
            xp = x_ptr + t * H + (u % (BB * NU)) * 4
        if UNR:                        # a few steps: unrolled, every step's loads issued at once
            ga, ua = _dots(blk + OG, blk + OU, c, m, m, xp, al, one, QT, A16, True, XS)
            for b0 in tl.static_range(BB, NB, BB):
                g1, u1 = _dots(blk + OG + b0 * TS, blk + OU + b0 * TS, c, m, m, xp + b0 * BS, al, one, QT, A16,
                               True, XS)
                ga += g1
                ua += u1
        else:
            ga = tl.zeros([L], dtype=tl.float32)
            ua = tl.zeros([L], dtype=tl.float32)
            for b0 in range(0, NB, BB):
                g1, u1 = _dots(blk + OG + b0 * TS, blk + OU + b0 * TS, c, m, m, xp + b0 * BS, al, one, QT, A16,
                               True, XS)
                ga += g1
                ua += u1
        g = tl.sum(tl.reshape(ga, (R, BB * NU)), axis=1)                             # (R,)
        up = tl.sum(tl.reshape(ua, (R, BB * NU)), axis=1)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        h = glu_at(g, up, eid_ptr, pair, b13_ptr, rows, rows < I, I, OAI, LIMIT, ALPHA)
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        if XS == 0:
            tl.store(h_ptr + pair * I + rows, h, mask=rows < I)
        else:
            at = tl.load(pos_ptr + rows, mask=rows < I, other=0)
            tl.store(h_ptr + t * K * I + at + (pair % K) * HJ, h, mask=rows < I)

    @triton.jit
    def _down_runs(h_ptr, addr_ptr, w_ptr, out_ptr, one, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
                   KP: tl.constexpr, R: tl.constexpr, OD: tl.constexpr, QT: tl.constexpr, RB: tl.constexpr,
                   NB: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NU: tl.constexpr, BB: tl.constexpr,
                   A16: tl.constexpr, UNR: tl.constexpr, XS: tl.constexpr, RL: tl.constexpr, eid_ptr, b2_ptr,
                   OAI: tl.constexpr):
        """Program (t, RL R rows of H): every choice's down rows against its activation (OAI: plus the down
        biases of its expert eid[t, j]), weighted, summed. A lane
        reads a unit of row r (RL = 2: and the same unit of row r + R, against one load of x). XS > 0: h[t] holds
        the k choices' activations in the lanes' order (qruns.lane_order with k copies)."""
        t = tl.program_id(0)
        L: tl.constexpr = R * KP * BB * NU
        TWO: tl.constexpr = RL == 2
        u = tl.arange(0, L)
        row = tl.program_id(1) * RL * R + u // (KP * BB * NU)
        e = (u // (BB * NU)) % KP                                                    # (L,) the unit's choice
        bi = (u // NU) % BB
        c = u % NU
        em = e < K
        m = (row < H) & em
        m2 = (row + R < H) & em
        a = _scalar(addr_ptr + t * K + e, em)                                        # (L,) int64
        js = tl.arange(0, KP)
        al = tl.max(tl.load(addr_ptr + t * K + js, mask=js < K, other=0) & 15, axis=0) == 0
        blk = a + (OD + row * RB + bi * TS)
        XB: tl.constexpr = BS if XS == 0 else K * BS                                 # x's step a block
        if XS == 0:
            xp = h_ptr + (t * K + e) * I + bi * BS
        else:
            xp = h_ptr + t * K * I + (e * (BB * NU) + u % (BB * NU)) * 4
        if UNR:
            acc, acc2 = _dots(blk, blk + R * RB, c, m, m2, xp, al, one, QT, A16, TWO, XS)
            for b0 in tl.static_range(BB, NB, BB):
                d1, d2 = _dots(blk + b0 * TS, blk + R * RB + b0 * TS, c, m, m2, xp + b0 * XB, al, one, QT, A16,
                               TWO, XS)
                acc += d1
                acc2 += d2
        else:
            acc = tl.zeros([L], dtype=tl.float32)
            acc2 = tl.zeros([L], dtype=tl.float32)
            for b0 in range(0, NB, BB):
                d1, d2 = _dots(blk + b0 * TS, blk + R * RB + b0 * TS, c, m, m2, xp + b0 * XB, al, one, QT, A16,
                               TWO, XS)
                acc += d1
                acc2 += d2
        wj = tl.load(w_ptr + t * K + js, mask=js < K, other=0.0).to(tl.float32)
        rows = tl.program_id(1) * RL * R + tl.arange(0, R)
        y = tl.sum(tl.reshape(acc, (R, KP, BB * NU)), axis=2)                        # (R, KP)
        eb = b2_ptr
        if OAI:
            eb = b2_ptr + tl.load(eid_ptr + t * K + js, mask=js < K, other=0)[None, :] * H    # (1, KP)
        y = down_bias(y, eb + rows[:, None], (rows < H)[:, None] & (js < K)[None, :], OAI)
        tl.store(out_ptr + t * H + rows, tl.sum(y * wj[None, :], axis=1).to(out_ptr.dtype.element_ty),
                 mask=rows < H)
        if TWO:
            y = tl.sum(tl.reshape(acc2, (R, KP, BB * NU)), axis=2)
            y = down_bias(y, eb + R + rows[:, None], (rows + R < H)[:, None] & (js < K)[None, :], OAI)
            tl.store(out_ptr + t * H + R + rows, tl.sum(y * wj[None, :], axis=1).to(out_ptr.dtype.element_ty),
                     mask=rows + R < H)


def experts_by_address_runs(x: torch.Tensor, addrs: torch.Tensor, weights: torch.Tensor,
                            layout: ExpertLayout, act=None) -> torch.Tensor:
    """x (T, H), addrs (T, k) int64, weights (T, k) -> (T, H): sum_j weights[t, j] * expert_j(x[t]). `act`:
    gpt-oss's activation and biases (kernels/reference.py's OaiSwiglu)."""
    assert runs_layout(layout), layout
    T, H = x.shape
    I, k = layout.inter, addrs.shape[1]
    og, ou, od = layout.offsets
    qg, _, qd = layout.types
    x, addrs, weights = x.contiguous(), addrs.contiguous(), weights.contiguous()
    eid, b13, b2, oai, limit, alpha = act_args(act, x)
    h = torch.empty(T * k, I, dtype=torch.float32, device=x.device)                            # (T k, I)
    out = torch.empty_like(x)                                                                   # (T, H)
    rbg, rbd = row_bytes(qg, H), row_bytes(qd, I)
    r, bb, g = _tile(qg, H, 1)
    kp = triton.next_power_of_2(k)
    rd, bbd, d = _tile(qd, I, kp)
    xs = xsd = hj = 0
    pos = h
    if LANE_ORDER:                           # x and h in the lanes' order (qruns.lane_order)
        x = x.index_select(1, _gather(qg, H, bb, x.device))                                   # (T, H) permuted
        pos = _lanes(qd, I, bbd, k, x.device)
        xs, hj = 4 * bb * g[3], 4 * bbd * d[3]
        xsd = k * hj
    a16 = aligned16(qg, og, rbg) and aligned16(qg, ou, rbg)
    _gate_up_runs[(T * k, triton.cdiv(I, r))](x, addrs, h, pos, ONE, H, I, k, r, og, ou, int(qg), rbg, *g, bb, a16,
                                              g[0] // bb <= UNROLL, xs, hj, eid, b13, oai, limit, alpha,
                                              num_warps=WARPS, enable_fp_fusion=True)
    rl = DOWN_ROWS_A_LANE or (1 if T == 1 else 2)             # (the same bits either way: the same sums a row)
    _down_runs[(T, triton.cdiv(H, rl * rd))](h, addrs, weights, out, ONE, H, I, k, kp, rd, od, int(qd), rbd, *d,
                                         bbd, aligned16(qd, od, rbd), d[0] // bbd <= UNROLL, xsd, rl, eid, b2, oai,
                                         num_warps=WARPS, enable_fp_fusion=True)
    return out


_ORDERS: dict = {}


def _lanes(qtype, n: int, bb: int, copies: int, device) -> torch.Tensor:
    """qruns.lane_order's positions (n,), int64 on device, made once (before any graph captures a step: the
    warm-up runs first)."""
    key = (int(qtype), n, bb, copies, str(device))
    if key not in _ORDERS:
        _ORDERS[key] = torch.from_numpy(lane_order(qtype, n, bb, copies)).to(device)
    return _ORDERS[key]


def _gather(qtype, n: int, bb: int, device) -> torch.Tensor:
    """(n,) int64: the gather that puts a row in the lanes' order (x_lanes = x[:, gather]), made once."""
    key = ("gather", int(qtype), n, bb, str(device))
    if key not in _ORDERS:
        _ORDERS[key] = torch.argsort(_lanes(qtype, n, bb, 1, device))
    return _ORDERS[key]
