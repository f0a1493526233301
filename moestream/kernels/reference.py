"""The plain-torch expert kernel: the CPU path, and the oracle every fast kernel is tested against."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quant.layout import ExpertLayout


def sort_by_slot(slots: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the T*k (token, choice) rows grouped by slot, token order kept inside a group; rows per slot.

    The stable sort keeps each expert's rows in the same order whatever slot it sits in, so its GEMM sees the
    same input wherever the cache put it.
    """
    flat = slots.reshape(-1)                                              # (T*k,)
    order = torch.sort(flat, stable=True).indices                         # (T*k,)
    counts = torch.zeros(n_slots, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # (S,): no host sync, graph-safe
    return order, counts


@dataclass(frozen=True)
class OaiSwiglu:
    """gpt-oss's expert MLP beyond SwiGLU's GEMMs (arch/blocks.py's swiglu_oai), for one kernel call: each choice's
    expert id, whose biases it adds wherever the expert sits (a slot never changes its result), and the clamp.
    The biases stay on the device with the dense weights, (E, .) a layer."""
    ids: torch.Tensor          # (T, k) int64: the expert of each routed choice (the kernel's slots' order)
    b13: torch.Tensor          # (E, 2I): gate biases, then up biases
    b2: torch.Tensor           # (E, H): down biases
    limit: float = 7.0
    alpha: float = 1.702

    def rows(self, ids: torch.Tensor) -> "OaiSwiglu":
        """The same for a subset of the choices, ids (T', k')."""
        return OaiSwiglu(ids, self.b13, self.b2, self.limit, self.alpha)


def glu(gu: torch.Tensor, inter: int, act: OaiSwiglu | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The activation between an expert's two GEMMs, gu (n, 2I) gate then up -> (n, I): silu(gate) * up, or with
    `act` (gpt-oss, as transformers computes it) the biases of experts `ids` (n,) added first, gate clamped above
    and up on both sides, (up + 1) * gate * sigmoid(alpha gate)."""
    if act is None:
        return F.silu(gu[:, :inter]) * gu[:, inter:]
    gu = gu + act.b13[ids].to(gu.dtype)
    gate, up = gu[:, :inter].clamp(max=act.limit), gu[:, inter:].clamp(-act.limit, act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def down_bias(y: torch.Tensor, act: OaiSwiglu | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """An expert's output y (n, H) with its down bias (experts `ids` (n,)), where `act` has one."""
    return y if act is None else y + act.b2[ids].to(y.dtype)


def experts_reference(x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      act: OaiSwiglu | None = None) -> torch.Tensor:
    """x (T, H), slots (T, k) -> (T, k, H): for each used slot, silu(x W_gate^T) * (x W_up^T) W_down^T; with `act`,
    gpt-oss's clamped SwiGLU and biases (glu, down_bias)."""
    T, k = slots.shape
    inter = w2.shape[-1]
    order, counts = sort_by_slot(slots, w13.shape[0])
    ids = act.ids.reshape(-1)[order] if act is not None else None        # (T*k,) each sorted row's expert
    xs = x[order // k]                                                    # (T*k, H), grouped by slot
    out = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for s, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = order[start:start + n]
        e = ids[start:start + n] if ids is not None else None
        gu = F.linear(xs[start:start + n], w13[s])                         # (n, 2I): gate then up
        out[rows] = down_bias(F.linear(glu(gu, inter, act, e), w2[s]), act, e)    # (n, H)
        start += n
    return out.view(T, k, -1)


class AddressBook:
    """Which registered tensor an expert's address falls in: the plain-torch path reads experts by address too.

    book.add(rows)                # rows (n, numel): one expert per row
    row = book.row(addr)          # (numel,) view of the expert at that address
    """

    def __init__(self):
        self.spans: list[tuple[int, int, torch.Tensor]] = []       # (start, end, rows)

    def add(self, rows: torch.Tensor) -> None:
        start = rows.data_ptr()
        self.spans.append((start, start + rows.numel() * rows.element_size(), rows))

    def discard(self, rows: torch.Tensor) -> None:
        """Forget a tensor (a cache pool being replaced), so the book does not keep its memory alive."""
        self.spans = [s for s in self.spans if s[2] is not rows]

    def row(self, addr: int) -> torch.Tensor:
        for start, end, rows in self.spans:
            if start <= addr < end:
                n, rem = divmod(addr - start, rows.stride(0) * rows.element_size())
                if rem:
                    raise ValueError(f"address {addr:#x} is not at an expert's start")
                return rows[n]
        raise ValueError(f"address {addr:#x} is in no registered expert store")


def experts_by_address_reference(x: torch.Tensor, addrs: torch.Tensor, weights: torch.Tensor,
                                 inter: int | ExpertLayout, landing=None, *, book: AddressBook,
                                 act: OaiSwiglu | None = None) -> torch.Tensor:
    """Plain torch, the oracle of kernels.decode.experts_by_address (`inter`: an int, float rows of I) and of
    kernels.decode_quant.experts_by_address_quant (`inter`: an ExpertLayout; a quantized one's rows are uint8,
    dequantized to float32 by layout.dequantize): x (T, H), addrs and weights (T, k) -> (T, H).

    Float32 throughout, the activation rounded to x's dtype between the two projections, the k outputs weighted
    and summed in float32 and rounded once, as the kernel does. `landing`: the read-through copies, as the kernels
    make them (kernels.decode.landing_slots for one token, landing_slots_grouped for several). `act`: gpt-oss's
    activation (glu) and biases, each choice's at its expert id act.ids[t, j], added to the float32 sums."""
    from .decode import landing_slots, landing_slots_grouped
    T, H = x.shape
    k = addrs.shape[1]
    if k > 1 and bool((addrs.sort(dim=1).values.diff(dim=1) == 0).any()):
        raise ValueError("a token's k addresses must be distinct (the grouped kernel's runs hold one choice a token)")
    layout = inter if isinstance(inter, ExpertLayout) else ExpertLayout(inter, H)
    inter = layout.inter
    if landing is not None:
        ids, host, slots = (v.reshape(-1).tolist() for v in (landing.ids, landing.host, landing.land))
        flat = addrs.reshape(-1).tolist()
        on_host = [a == host[e] for a, e in zip(flat, ids)]
        if T == 1:
            lands = [(flat[j], i) for j, i in landing_slots(on_host, len(slots))]
        else:
            lands = [(host[e], i) for e, i in landing_slots_grouped(ids, on_host, len(slots))]
        for a, i in lands:
            if slots[i]:                          # 0: no slot to land in
                book.row(slots[i]).copy_(book.row(a))
    n = layout.nbytes if layout.quantized else 3 * inter * H          # a slot may be wider than this layer's row
    rows = torch.stack([book.row(a)[:n] for a in addrs.reshape(-1).tolist()]).to(x.device)     # (T k, row)
    if layout.quantized:
        w13, w2 = layout.dequantize(rows, torch.float32)                                 # (T k, 2I, H), (T k, H, I)
    else:
        w13 = rows[:, :2 * inter * H].view(T * k, 2 * inter, H).float()
        w2 = rows[:, 2 * inter * H:3 * inter * H].view(T * k, H, inter).float()
    xs = x.float().repeat_interleave(k, dim=0).unsqueeze(-1)                               # (T k, H, 1)
    gu = torch.bmm(w13, xs).squeeze(-1)                                                    # (T k, 2I)
    e = act.ids.reshape(-1).to(gu.device) if act is not None else None                   # (T k,) experts
    h = glu(gu, inter, act, e).to(x.dtype)
    y = down_bias(torch.bmm(w2, h.float().unsqueeze(-1)).squeeze(-1), act, e).view(T, k, H)
    return (y * weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)
