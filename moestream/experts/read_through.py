"""Read-through: the free cache slots zero-copy decode steps write the experts they read from host memory into.

    rt = ReadThrough(slots, residency, stats, layers, top_k, enabled=True, staged=False)
    rt.count(n_tokens)                      # the landing slots a step of n_tokens is handed a layer (0: off)
    land = rt.hand_out(shape, writing)      # (L, R): the next step's free slots, -1 for none
    ls, es, ss = rt.absorb(routed, from_host, land, n_tokens)   # a completed step's landed experts, now resident
    rt.note_one_token(layers, reads)        # a one-token step's host reads of its layers ...
    rt.after_one_token()                    # ... set how many slots each layer is handed; the pool keeps them empty
    rt.room()                               # free slots a layer the hot set keeps for several-token steps

A step is handed empty slots per layer (none a copy is still writing), and its kernel writes the first experts it
reads from host memory into them as it reads them (a one-token step its first host-read choices, a several-token
step its distinct host-read experts in ascending id: kernels/decode.py's landing_slots and landing_slots_grouped;
staged, kernels/stage.py's landed_experts). Once the step has completed, the host replays the kernel's rule on the
step's routing (absorb) and takes those experts in, so the next step reads them from their slots: a miss crosses
the link once, and a one-token step uploads nothing. zero_copy.py hands the slots out and absorbs them while the
next step runs; the slots a step writes are pinned while it runs, so no copy targets them. DeviceLandings is the
same rule in device ops, inside the steps' graphs: a step notes what it landed where, and the next step's table
takes them in on the device, before the host has absorbed them.
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.stage import MAX_CHOICES, landed_experts
from .residency import Residency
from .slots import SlotPool
from .stats import CacheStats

RESERVE = 16               # without read-through: empty slots kept in the pool for the misses of the step in flight
LAND_PER_LAYER = 2         # the fewest free slots a layer hands a one-token step to write its misses into (it hands
                           # more where its misses are more: MISS_DECAY, LAND_MARGIN; at most top_k)
LAND_SEVERAL = 4           # ... and a several-token step (the free slots past a layer's land_count serve one-token
                           # steps too)
ROOM_SEVERAL = 1           # of which the hot set keeps this many a layer free, evicting for them: a free slot is one
                           # it cannot use (replayed fresh streams crossed the link least at 1; RESULTS.md, stop 28)
MISS_DECAY = 0.9           # per step, of a layer's decayed count of one-token steps' host reads
LAND_MARGIN = 1.3          # landing slots a layer: its decayed host reads x this + 1 (a replay of near-uniform and
                           # skewed routings, bench/host_learning.py: nearly every miss lands)
RESERVE_SHARE = 4          # the empty slots kept (two steps' landing slots, or RESERVE) are at most a quarter of the
                           # pool (an eighth read more from host in every replayed routing)


class ReadThrough:
    def __init__(self, slots: SlotPool, residency: Residency, stats: CacheStats, layers: list[int], top_k: int,
                 enabled: bool, staged: bool):
        self.slots, self.residency, self.stats, self.layers, self.top_k = slots, residency, stats, layers, top_k
        self.staged = staged                # the host reads are staged (kernels/stage.py): its rule, its limit
        L = residency.slot_of.shape[0]
        # A one-token step may land up to n_land experts a layer (a token's top_k; land_count[l] are handed out, as
        # many as the layer's recent misses ask for), a several-token step n_land_several.
        self.n_land = top_k if enabled else 0
        self.n_land_several = LAND_SEVERAL if enabled else 0
        self.land_count = np.full(L, LAND_PER_LAYER, dtype=np.int64)
        self.miss_avg = np.zeros(L)                         # one-token steps' host reads a layer, decayed

    def count(self, n_tokens: int) -> int:
        """The landing slots a step of n_tokens tokens is handed a layer (at most)."""
        return self.n_land if n_tokens == 1 else self.n_land_several

    def holds_a_step(self, n_choices: int) -> bool:
        """Whether the pool holds a step's routed experts (n_choices per host layer): else it keeps its hottest."""
        return self.residency.n_slots >= len(self.layers) * n_choices

    def hand_out(self, shape: tuple[int, int], writing) -> np.ndarray:
        """(L, R) slots for each host layer to land up to R experts in during the next step, -1 for none: empty,
        unread, not written by the step in flight (`writing`), and no copy still writing them (a slot emptied
        while its upload is in flight would get that upload's bytes after the step landed its own). Only where the
        pool holds a whole step's experts: a smaller one keeps its hottest experts. Every layer's first n_land (a
        one-token step's) are handed out first, then the several-token steps' rest."""
        res = self.residency
        out = np.full(shape, -1, dtype=np.int64)
        if self.n_land and self.holds_a_step(self.top_k):
            self.slots.refresh_pins()
            free = (res.owner[:, 0] < 0) & ~res.pinned & self.slots.landed()
            if writing is not None:
                free[writing[writing >= 0]] = False
            count = self.land_count.astype(np.int64)
            spare, taken = np.flatnonzero(free), 0       # the pool's free slots, ascending, and how many are taken
            for lo, his in ((np.zeros_like(count), count), (count, np.full_like(count, self.n_land_several))):
                for l in self.layers:
                    got = spare[taken:taken + max(int(his[l]) - int(lo[l]), 0)]
                    taken += len(got)
                    out[l, lo[l]:lo[l] + len(got)] = got
        return out

    def absorb(self, routed: np.ndarray, from_host: np.ndarray, land_slots: np.ndarray | None,
               n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The experts a completed step wrote into its landing slots as it read them become resident there: their
        bytes are in place. The host replays the kernel's rule on the step's routing (L, T k) and what its table
        read from host (L, E): one token's first host-read choices in choice order (kernels.decode.landing_slots and
        stage.landed_experts agree there), several tokens' by landing_slots_grouped or, staged, landed_experts.
        Returns the (layers, experts, slots) placed. (This runs between steps: one token's rule is vectorised.)"""
        none = (np.zeros(0, dtype=np.int64),) * 3
        if land_slots is None:
            return none
        n = n_tokens * self.top_k
        if self.reads_in_place(n):
            return none
        res = self.residency
        layers = np.asarray(self.layers)
        ids = routed[layers, :n]
        on_host = from_host[layers[:, None], ids]                    # (host layers, T k): read from host memory
        n_land = self.count(n_tokens)
        if n_tokens == 1:
            rank = np.cumsum(on_host, axis=1) - 1
            i, j = np.nonzero(on_host & (rank < n_land))
            ls, es, rs = layers[i], ids[i, j], rank[i, j]
        else:
            from ..kernels.decode import landing_slots_grouped
            rule = landed_experts if self.staged else landing_slots_grouped
            lands = [(layers[i], e, r) for i in np.flatnonzero(on_host.any(axis=1))
                     for e, r in rule(ids[i], on_host[i], n_land)]
            ls, es, rs = (np.array(c, dtype=np.int64) for c in zip(*lands)) if lands else none
        ss = land_slots[ls, rs]
        ok = ss >= 0
        ok[ok] = res.slot_of[ls[ok], es[ok]] < 0              # (one being uploaded already keeps that slot)
        ls, es, ss = ls[ok], es[ok], ss[ok]
        res.place(ls, es, ss)
        self.slots.written(ss)
        self.stats.count(ls, "landed")
        return ls, es, ss

    def reads_in_place(self, n_choices: int) -> bool:
        """Whether a step of n_choices routed choices a layer lands nothing: staged, with more choices than one
        copy launch plans (kernels/stage.py: MAX_CHOICES), it reads its host rows in place."""
        return self.staged and n_choices > MAX_CHOICES

    def note_one_token(self, layers: np.ndarray, reads: np.ndarray) -> None:
        """A one-token step read reads[i] experts of layers[i] from host memory."""
        self.miss_avg[layers] = self.miss_avg[layers] * MISS_DECAY + reads * (1 - MISS_DECAY)

    def after_one_token(self) -> None:
        """After a one-token step is learned: each layer is handed as many landing slots as its recent misses ask
        for, and the pool keeps two steps' worth of them empty (keep_reserve)."""
        if self.n_land:
            self.land_count[:] = np.clip(np.ceil(self.miss_avg * LAND_MARGIN) + 1, LAND_PER_LAYER, self.n_land)
        self.keep_reserve()

    def keep_reserve(self) -> None:
        """Empty the pool's least valued slots until RESERVE and two steps' landing slots (the step in flight's and
        the next's) are empty, at most a quarter of the pool. The next step's table will not point at them, so the
        misses learned while that step runs can be copied into them at once, and land before the step after it,
        instead of queuing behind the step in flight; and the next step lands its misses in them."""
        res = self.residency
        n = res.n_slots
        lands = 2 * int(sum(self.land_count[l] for l in self.layers))
        keep = min(lands if self.n_land else RESERVE, n // RESERVE_SHARE)
        owned = np.flatnonzero((res.owner[:, 0] >= 0) & ~res.pinned)
        need = keep - (n - int((res.owner[:, 0] >= 0).sum()))
        if need > 0 and len(owned) > need:
            gone = res.evict(res.policy.lowest(owned, need))
            self.stats.count(np.array([l for l, _ in gone]), "evictions")

    def room(self) -> int:
        """Free slots a layer keeps for several-token steps to land their misses in (0 without read-through or in
        a pool smaller than a token's experts, where nothing lands)."""
        return ROOM_SEVERAL if self.n_land_several and self.holds_a_step(self.top_k) else 0


class DeviceLandings:
    """ReadThrough.absorb's rule on the device (experts/zero_copy.py): per (layer, expert) the landing slot's address
    a step wrote the expert into (noted_addr) and whether it did (noted_ok), and which experts the next table may
    take in so (absorbable: none resident; absorb keeps the slot of one whose upload is in flight)."""

    def __init__(self, rt: ReadThrough, top_k: int, shape: tuple[int, int], device):
        self.rt, self.top_k = rt, top_k
        self.noted_addr = torch.zeros(shape, dtype=torch.int64, device=device)
        self.noted_ok = torch.zeros(shape, dtype=torch.bool, device=device)
        self.absorbable = torch.zeros(shape, dtype=torch.bool, device=device)

    def state(self) -> tuple[torch.Tensor, ...]:
        """The tensors a step rewrites (a capture's warm-up keeps them)."""
        return self.noted_addr, self.noted_ok

    def apply(self, table: torch.Tensor) -> None:
        """table (L, E) addresses: the noted experts read from their landing slots."""
        table.copy_(torch.where(self.noted_ok & self.absorbable, self.noted_addr, table))

    def note(self, table, host_tab, routed, land, n_tokens: int) -> None:
        """What a step of n_tokens, which read table (L, E) with routed (L, T k) ids, landed in its landing slots
        (land: (L, R) addresses, 0 for none): a layer's distinct host-read experts (table == host_tab), in order
        of first choice (one token, and any staged step) or of id (the grouped kernel's), into its first slots."""
        L, N, R = table.shape[0], n_tokens * self.top_k, self.rt.count(n_tokens)
        if R == 0 or self.rt.reads_in_place(N):
            self.noted_ok.zero_()                # no landing slots, or nothing lands
            return
        ids = routed[:, :N]
        on_host = table.gather(1, ids) == host_tab.gather(1, ids)
        if n_tokens == 1:                        # a token's choices are distinct: per choice, a dozen small ops
            addr, lands = self._slot(land, on_host.long().cumsum(1) - 1, R)
            self.noted_ok.zero_().scatter_(1, ids, on_host & lands)
            self.noted_addr.scatter_(1, ids, addr)
            return
        read = torch.zeros_like(self.noted_ok).scatter_(1, ids, on_host)          # (L, E): read from host
        if self.rt.staged:                       # (no sort: a capture may not take one)
            choice = torch.arange(N, device=ids.device).repeat(L, 1)
            first = torch.full_like(self.noted_addr, N).scatter_reduce(1, ids, choice, "amin")   # (L, E)
            firsts = on_host & (first.gather(1, ids) == choice)                  # (L, N): a host read's first choice
            rank = (firsts.long().cumsum(1) - 1).gather(1, first.clamp(max=N - 1))
        else:
            rank = read.long().cumsum(1) - 1
        addr, lands = self._slot(land, rank, R)
        self.noted_addr.copy_(addr)
        self.noted_ok.copy_(read & lands)

    @staticmethod
    def _slot(land, rank, R: int):
        """The kernels' rule for where a host read lands: the rank-th of its layer's first R landing slots (land:
        (L, R') addresses, 0 for none). Each entry's address, and whether it lands (a slot of that rank exists)."""
        addr = land[:, :R].gather(1, rank.clamp(0, R - 1))
        return addr, (rank < R) & (addr != 0)
