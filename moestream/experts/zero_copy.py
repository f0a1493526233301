"""Zero-copy decode: a decode step reads each routed expert where it lies, a cache slot or pinned host memory.

    zc = ZeroCopyDecode(slots, planner, store, layers, max_tokens=16, top_k=8)      # over the cache's pool
    zc.begin_step()                      # the address table (layer, expert) -> slot or host row, onto the device
    table, routed = zc.address_table(layer)   # inside the (captured) step: the addresses table[ids]; ids kept in routed
    zc.end_step(n_tokens)                # after the step is queued: learn from the previous step's routing

A decode step then needs no host decision: the whole step is one CUDA graph, and a miss costs its bytes over the
link once, read in place by the kernel (kernels/decode.py). The cache still learns: after each step is queued, the
host reads the previous step's routing back and runs the policy on it (_learn says what each kind of step keeps).
It works through the slot pool (slots.py) and the planner, as the prompt path (prompt.py) does: they are peers.

Read-through (on by default; --no-read-through): a step is also handed empty slots per layer (none a copy is
still writing), and its kernel writes the first experts it reads from host memory into them as it reads them (a
one-token step its first host-read choices, a several-token step its distinct host-read experts in ascending id:
kernels/decode.py's landing_slots and landing_slots_grouped). Before the next step's table goes to the device the
host replays the kernel's rule on the step's routing and takes those experts in, so the next step reads them from
their slots: a miss crosses the link once, and a one-token step uploads nothing. The slots a step writes are
pinned while it runs, so no copy targets them. Staged host reads (`staged`, the default for quantized experts:
kernels/stage.py): a step's first launch a layer copies the experts it reads from host memory into device memory,
its landing slots first (the same read-through, for every kernel and any number of tokens: distinct experts in
order of first choice, stage.landed_experts) and then scratch rows, and the expert kernel reads them all there.

Without read-through a one-token step's misses are uploaded on the copy stream behind the step in flight. Why
that is safe without pins: a table is written on the compute stream before its step and points only at slots
whose copy has completed. The misses of step t are learned while step t+1 runs (step t has completed: its routing
was read back). A copy into a slot that step t+1's table may point at waits for step t+1; a copy into one of the
empty slots kept in reserve starts at once and lands, normally, before step t+2, whose table then points at it.

The table leaves the critical path between steps: it is prepared from the residency map while the step before
it runs (after learning), and begin_step only patches in the copies that have landed since and the last step's
landed experts, then copies it over (one small copy).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..kernels.stage import MAX_CHOICES, Landing, landed_experts, staging_rows
from .hot_set import HotSet
from .planner import CachePlanner
from .provider import row_addresses
from .residency import CacheTooSmall
from .routing import report_route
from .slots import SlotPool
from .store import ExpertStore

RESERVE = 16               # without read-through: empty slots kept per region for the misses of the step in flight
LAND_PER_LAYER = 2         # read-through: the fewest free slots a layer hands a one-token step to write its misses
                           # into (it hands more where its misses are more: MISS_DECAY, LAND_MARGIN; at most top_k)
LAND_SEVERAL = 4           # ... and a several-token step (the free slots past a layer's land_count serve one-token
                           # steps too)
ROOM_SEVERAL = 1           # of which the hot set keeps this many a layer free, evicting for them: a free slot is one
                           # it cannot use (replayed fresh streams crossed the link least at 1; RESULTS.md, stop 28)
MISS_DECAY = 0.9           # per step, of a layer's decayed count of one-token steps' host reads
LAND_MARGIN = 1.3          # landing slots a layer: its decayed host reads x this + 1 (a replay of near-uniform and
                           # skewed routings, bench/host_learning.py: nearly every miss lands)
RESERVE_SHARE = 4          # the empty slots kept (two steps' landing slots, or RESERVE) are at most a quarter of a
                           # region (an eighth read more from host in every replayed routing)


class ZeroCopyDecode:
    def __init__(self, slots: SlotPool, planner: CachePlanner, store: ExpertStore, layers: list[int],
                 max_tokens: int, top_k: int, read_through: bool = False, reads_once: bool = True,
                 staged: bool = False, routing=None):
        dev, (L, E) = slots.device, planner.residency.slot_of.shape
        self.slots, self.planner, self.store, self.layers = slots, planner, store, layers
        self.residency, self.stats, self.device, self.n_experts = planner.residency, planner.stats, dev, E
        self.max_tokens, self.top_k = max_tokens, top_k
        # Whether a several-token step's kernel reads each routed expert once (kernels/decode_grouped.py) or once
        # per token that chose it (the quantized kernel): what the host-read counters count.
        self.reads_once = reads_once
        self.row_bytes = store.expert_bytes                # the pool's row stride: a slot's address step
        self.host_addr = np.zeros((L, E), dtype=np.int64)
        for l, rows in store.rows.items():
            self.host_addr[l] = row_addresses(rows, "cpu").numpy()
        self.pool_addr = slots.pool.data_ptr()
        self.table = torch.zeros(L, E, dtype=torch.int64, device=dev.torch)      # read by the captured steps
        self.routed = torch.zeros(L, max_tokens * top_k, dtype=torch.int64, device=dev.torch)   # written by a step
        self.routed_host = dev.pinned_empty((L, max_tokens * top_k), torch.int64)
        self.from_host = np.zeros((L, E), dtype=bool)       # the queued step's experts read from host memory
        self.pending = None                                 # Pending: a step not learned from yet
        self.seqs = None                                    # each token's sequence in the queued step, if told
        self.step_lands = True                              # whether the queued step lands (not a host-shared one)
        self.step_bytes = 0.0                               # bytes the last learned step read from host memory
        self.hot = HotSet(self.residency, self.stats, store, layers, routing)     # what several-token steps keep
        # Read-through: the layer's free slots a step writes the experts it reads from host into: a one-token step
        # up to n_land of them (a token's top_k; land_count[l] are handed out, as many as the layer's recent misses
        # ask for), a several-token step n_land_several.
        self.n_land = top_k if read_through else 0
        self.n_land_several = LAND_SEVERAL if read_through else 0
        self.land_count = np.full(L, LAND_PER_LAYER, dtype=np.int64)
        self.miss_avg = np.zeros(L)                         # one-token steps' host reads a layer, decayed
        self.host_tab = torch.from_numpy(self.host_addr).to(dev.torch)              # (L, E) host-row addresses
        self.scratch = staging_rows(slots.pool, top_k) if staged else None          # (S, row)
        self.aligned = store.aligned16(slots.pool, self.scratch)
        shape = (L, max(self.n_land, self.n_land_several, 1))                               # (L, R)
        self.land = torch.zeros(shape, dtype=torch.int64, device=dev.torch)                # addresses
        self.land_slots = np.full(shape, -1, dtype=np.int64)                      # the queued step's, as slots
        # The next step's table is prepared while the step before it runs (end_step), in the staging buffer that
        # step's own table copy does not read; begin_step patches in what landed since, and copies it over.
        self.stagings = [(dev.pinned_empty((L, E), torch.int64), dev.pinned_empty(shape, torch.int64)) for _ in (0, 1)]
        self.current = 0                                    # the staging buffer of the queued step's table
        self.next = None                                    # Prepared: the next step's table, or None

    def address_table(self, layer: int):
        """The layer's row of the step's table, and its row of routed, where the step keeps its ids for the host
        (graph-safe: the step writes them on the device)."""
        return self.table[layer], self.routed[layer]

    def replay_route(self, layer: int, ids: np.ndarray) -> None:
        """ids (T, k): the layer's routing of the current step, kept as a step keeps it in routed (a trace replay,
        where no kernel runs)."""
        self.routed[layer, :ids.size] = torch.from_numpy(ids.astype(np.int64).reshape(-1))

    def landing(self, layer: int, ids: torch.Tensor):
        """Read-through and staging: the layer's kernels.stage.Landing (ids, host-row addresses, landing slots'
        addresses: a one-token step gets the first n_land slots, a several-token step n_land_several; the
        scratch rows when staged); None when neither is on."""
        if not self.step_lands or (not self.n_land and self.scratch is None):
            return None
        return Landing(ids, self.host_tab[layer], self.land[layer, :self._n_land(ids.shape[0])], self.scratch,
                       self.aligned)

    def _n_land(self, n_tokens: int) -> int:
        return self.n_land if n_tokens == 1 else self.n_land_several

    def begin_prompt(self, seq: int) -> None:
        """Sequence `seq` begins a new request: the hot set forgets its earlier steps."""
        self.hot.forget(seq)

    def begin_step(self, seqs: list[int] | None = None, lands: bool = True) -> None:
        """Put the step's address table on the device: an expert resident in a slot whose copy has landed reads
        from the slot, every other one from its host row. The table was prepared while the last step ran (or is
        prepared now, after a prompt); here it only takes in what changed since: with read-through, the experts the
        last step wrote into its landing slots (the next step reads them there), and copies that have landed.
        seqs: each token's sequence (the hot set keeps each sequence's counts; None: not told). lands=False: the
        step lands nothing (the host computes some of its experts: host_share.py)."""
        self.seqs, self.step_lands = seqs, lands
        p = self.pending
        if p is not None and p.event is not None:
            p.event.synchronize()                # that step has run: its table copy is done, its landings are in
        nxt, self.next = self.next, None
        absorbed = self._absorb(p) if p is not None and not p.absorbed else None
        fresh = nxt is None
        if fresh:                                # (after a prompt: it takes in what was just absorbed)
            nxt = self._prepare(1 - self.current, writing=None)
        staging, land_staging = self.stagings[nxt.buffer]
        if not fresh:
            self._patch(nxt, staging.numpy(), absorbed)
        self.from_host[:] = nxt.from_host
        self.land_slots[:] = nxt.land_slots
        self.current = nxt.buffer
        self.table.copy_(staging, non_blocking=True)
        if self.n_land:
            self.land.copy_(land_staging, non_blocking=True)

    def _patch(self, nxt: "Prepared", table: np.ndarray, absorbed) -> None:
        """What changed since `nxt` was prepared: the experts just absorbed (read-through: (layers, experts,
        slots), or None), and the copies in flight then that have landed now, read from their slots."""
        if absorbed is not None:
            ls, es, ss = absorbed
            table[ls, es] = self.pool_addr + ss * self.row_bytes
            nxt.from_host[ls, es] = False
        if len(nxt.waiting):
            slot_of = self.residency.slot_of.ravel()
            flat = nxt.waiting[self.slots.landed(nxt.waiting_slots) & (slot_of[nxt.waiting] == nxt.waiting_slots)]
            table.ravel()[flat] = self.pool_addr + slot_of[flat] * self.row_bytes
            nxt.from_host.ravel()[flat] = False

    def _prepare(self, buffer: int, writing) -> "Prepared":
        """The next step's table (and, with read-through, its landing slots) from the residency map now, into
        staging buffer `buffer`, which no queued copy reads. `writing`: the landing slots of the step in flight."""
        slot = self.residency.slot_of
        held = slot >= 0
        landed = held.copy()
        landed[held] = self.slots.landed(slot[held])
        staging, land_staging = self.stagings[buffer]
        staging.numpy()[:] = np.where(landed, self.pool_addr + slot * self.row_bytes, self.host_addr)
        waiting = np.flatnonzero((held & ~landed).ravel())
        land_slots = self._landing_slots(writing)
        if self.n_land:
            land_staging.numpy()[:] = np.where(land_slots >= 0, self.pool_addr + land_slots * self.row_bytes, 0)
        return Prepared(buffer, ~landed, land_slots, waiting, slot.ravel()[waiting])

    def end_step(self, n_tokens: int, observer=None) -> None:
        """The step is queued: report its routing (device views, in stream order) to `observer` (a RouteObserver),
        then learn from the previous step's while this one runs."""
        n = n_tokens * self.top_k
        for l in self.layers:
            report_route(observer, l, self.routed[l, :n].view(n_tokens, self.top_k))
        previous = self._take_pending()
        event = None
        if self.device.is_cuda:          # the whole buffer: contiguous, so the copy stays asynchronous
            self.routed_host.copy_(self.routed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            self.routed_host.copy_(self.routed)
        writes = None                            # the landing slots this step's kernel may write
        if self.n_land and self.step_lands:
            writes = self.land_slots.copy()
            writes[:, self._n_land(n_tokens):] = -1
        self.pending = Pending(n_tokens, event, self.from_host.copy(), writes, self.seqs)
        if previous is not None:
            self._learn(*previous, after=event, writing=self.pending.land_slots)
        self.next = self._prepare(1 - self.current, writing=self.pending.land_slots)

    def flush(self) -> None:
        """Learn from the last step now (before a prompt changes the cache, or counters are read)."""
        p = self.pending
        if p is not None and not p.absorbed:
            self._absorb(p)
        self.next = None                         # the cache changes now (and a prompt may follow)
        previous = self._take_pending()
        if previous is not None:
            self._learn(*previous, after=None, writing=None)

    def _routed(self, p) -> np.ndarray:
        """(L, T k) routed ids of the pending step (its read-back has completed)."""
        if p.event is not None:
            p.event.synchronize()                # normally long done: the caller read that step's logits
        return self.routed_host[:, :p.n_tokens * self.top_k].numpy().copy()

    def _take_pending(self):
        p, self.pending = self.pending, None
        return None if p is None else (self._routed(p), p.from_host, p.seqs)

    def _absorb(self, p) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The experts a step wrote into its landing slots as it read them (read-through) become resident there:
        the step has completed, so their bytes are in place. The host replays the kernel's rule on the step's
        routing and table: one token's first host-read choices in choice order (kernels.decode.landing_slots and
        stage.landed_experts agree there), several tokens' by landing_slots_grouped or, staged, landed_experts.
        Returns the (layers, experts, slots) placed. (This runs between steps: one token's rule is vectorised.)"""
        p.absorbed = True
        none = (np.zeros(0, dtype=np.int64),) * 3
        if p.land_slots is None:
            return none
        n = p.n_tokens * self.top_k
        if self.scratch is not None and n > MAX_CHOICES:
            return none                          # read in place, landing nothing (kernels.staged)
        routed, res = self._routed(p), self.residency
        layers = np.asarray(self.layers)
        ids = routed[layers, :n]
        on_host = p.from_host[layers[:, None], ids]                  # (host layers, T k): read from host memory
        n_land = self._n_land(p.n_tokens)
        if p.n_tokens == 1:
            rank = np.cumsum(on_host, axis=1) - 1
            i, j = np.nonzero(on_host & (rank < n_land))
            ls, es, rs = layers[i], ids[i, j], rank[i, j]
        else:
            from ..kernels.decode import landing_slots_grouped
            rule = landed_experts if self.scratch is not None else landing_slots_grouped
            lands = [(layers[i], e, r) for i in np.flatnonzero(on_host.any(axis=1))
                     for e, r in rule(ids[i], on_host[i], n_land)]
            ls, es, rs = (np.array(c, dtype=np.int64) for c in zip(*lands)) if lands else none
        ss = p.land_slots[ls, rs]
        ok = ss >= 0
        ok[ok] = res.slot_of[ls[ok], es[ok]] < 0              # (one being uploaded already keeps that slot)
        ls, es, ss = ls[ok], es[ok], ss[ok]
        res.place(ls, es, ss)
        self.slots.written(ss)
        self.stats.count(ls, "landed")
        return ls, es, ss

    def _landing_slots(self, writing) -> np.ndarray:
        """(L, R) slots for each host layer to land up to R experts in during the next step, -1 for none: empty,
        unread, not written by the step in flight (`writing`), and no copy still writing them (a slot emptied
        while its upload is in flight would get that upload's bytes after the step landed its own). Only with
        read-through, and where the pool holds a whole step's experts: a smaller one keeps its hottest experts.
        Every layer's first n_land (a one-token step's) are handed out first, then the several-token steps' rest."""
        res = self.residency
        out = np.full(self.land_slots.shape, -1, dtype=np.int64)
        if self.n_land and self._holds_a_step(self.top_k):
            self.slots.refresh_pins()
            free = (res.owner[:, 0] < 0) & ~res.pinned & self.slots.landed()
            if writing is not None:
                free[writing[writing >= 0]] = False
            count = self.land_count
            for los, his in ((np.zeros_like(count), count), (count, np.full_like(count, self.n_land_several))):
                for l in self.layers:
                    lo, hi = int(los[l]), int(his[l])
                    a, b = res.bounds[l]
                    got = a + np.flatnonzero(free[a:b])[:max(hi - lo, 0)]
                    free[got] = False
                    out[l, lo:lo + len(got)] = got
        return out

    def _learn(self, routed: np.ndarray, from_host: np.ndarray, seqs, after, writing) -> None:
        """The policy and counters see one step's routing (L, T k); the pool changes for the steps to come.

        - A one-token step, in a pool that holds a step's experts, with read-through: its misses landed in free
          slots as it read them (_absorb), so nothing is uploaded; each layer hands the next steps as many landing
          slots as its recent misses ask for (land_count), and the regions keep that many empty (_keep_reserve).
          An upload would move the bytes the step just read a second time: on a near-uniform routing (Qwen3-Next's
          reference) it moved 40% of the link's bytes, with no more hits (bench/host_learning.py, RESULTS.md).
        - The same without read-through: its misses are uploaded, in one batch on the copy stream, behind `after`
          (the step now queued, which may read their victims), or at once when nothing is queued (`writing`: the
          landing slots that step writes, not to be touched).
        - A step of several tokens (several streams decoded together), or any step in a pool smaller than one
          token's routed experts of every host layer, keeps each layer's most routed experts of recent steps
          (hot_set.py says why: uploading such steps' misses evicts what the next step reads), the union of the
          streams' hot sets as far as it fits. (With read-through its misses also land in free slots.)

        Hits and misses count as the step read its experts (a miss that landed is resident now, but was read from
        host). host_reads counts what crossed the link: a one-token step's host-read choices; a several-token
        step's distinct host-read experts, each read once by the grouped kernel (per choice with the quantized
        kernel)."""
        t0 = time.perf_counter()
        res, E, stats = self.residency, self.n_experts, self.stats
        one_token = routed.shape[1] == self.top_k and self._holds_a_step(self.top_k)
        upload = one_token and not self.n_land
        if seqs is not None:
            self.hot.seed(seqs)                  # a sequence's first step of a request: its prompt's tail
        self.slots.mark_reads()                  # slots a prompt handed out are free once its compute has run
        self.slots.refresh_pins()
        if writing is not None:
            self.slots.pin(writing[writing >= 0])
        empty = set(np.flatnonzero(res.owner[:, 0] < 0).tolist())     # no step in flight reads these
        self.step_bytes = 0.0
        now, behind = [], []                     # copies into empty slots (unread), into evicted ones (read)
        for l in self.layers:
            counts = np.bincount(routed[l], minlength=E)
            per_choice = counts[from_host[l]]        # each expert read from host: once, or once per choice
            reads = int(np.count_nonzero(per_choice) if self.reads_once else per_choice.sum())
            stats.record(l, host_reads=reads, host_read_bytes=reads * self.store.layer_bytes(l))
            self.step_bytes += reads * self.store.layer_bytes(l)
            routed_l = wanted = np.flatnonzero(counts).astype(np.int64)
            if len(self.planner.groups(l, wanted)) > 1:      # more than the layer's region holds: the most routed
                wanted = np.sort(wanted[np.argsort(-counts[wanted], kind="stable")[:res.region_size(l)]])
                # the rest are looked up too, and miss: they were read from host memory
                stats.record(l, misses=len(routed_l) - len(wanted))
            self.hot.observe(l, counts, routed[l], seqs)     # (both ways: a server's steps change size)
            read = int(from_host[l, wanted].sum())           # the misses as the step read them
            if not upload:
                slots = res.slot_of[l, wanted]
                slots = slots[slots >= 0]
                res.policy.touch(slots)
                self.slots.claim(slots)          # read by decode: no prefetch into them is pending
                stats.record(l, hits=len(wanted) - read, misses=read)
                if one_token:
                    self.miss_avg[l] = self.miss_avg[l] * MISS_DECAY + reads * (1 - MISS_DECAY)
                continue
            try:
                plan = self.planner.plan(l, wanted, read)
            except CacheTooSmall:                # a prompt's compute still reads its slots: let it finish
                self.device.synchronize()
                self.slots.refresh_pins()
                plan = self.planner.plan(l, wanted, read)
            self.slots.claim(plan.slots)         # read or refilled by decode: no prefetch into them is pending
            src = self.store.rows[l]
            for e, slot in plan.misses:
                (now if slot in empty else behind).append((slot, src[e]))
        self._submit(now, behind, after)
        if one_token:
            if self.n_land:
                self.land_count[:] = np.clip(np.ceil(self.miss_avg * LAND_MARGIN) + 1, LAND_PER_LAYER, self.n_land)
            self._keep_reserve()
        else:
            room = self._landing_room()
            self._submit(*self.hot.fill(empty, room), after)     # (the loop above moved nothing: `empty` holds)
            self.hot.make_room(room, writing)
        per_layer = (time.perf_counter() - t0) / len(self.layers)
        for l in self.layers:
            stats.record(l, host_s=per_layer)

    def _keep_reserve(self) -> None:
        """Empty the least valued slots of each region until RESERVE and two steps' landing slots (the step in
        flight's and the next's) are empty, at most a quarter of the region. The next step's table will not point
        at them, so the misses learned while that step runs can be copied into them at once, and land before the
        step after it, instead of queuing behind the step in flight; and the next step lands its misses in them."""
        res = self.residency
        for a, b in sorted(self.hot.regions):
            lands = 2 * int(sum(self.land_count[l] for l in self.layers if res.bounds[l] == (a, b)))
            keep = min(lands if self.n_land else RESERVE, (b - a) // RESERVE_SHARE)
            owned = a + np.flatnonzero((res.owner[a:b, 0] >= 0) & ~res.pinned[a:b])
            need = keep - ((b - a) - int((res.owner[a:b, 0] >= 0).sum()))
            if need > 0 and len(owned) > need:
                gone = res.evict(res.policy.lowest(owned, need))
                self.stats.count(np.array([l for l, _ in gone]), "evictions")

    def _landing_room(self) -> int:
        """Free slots a layer keeps for several-token steps to land their misses in (0 without read-through or in
        a pool smaller than a token's experts, where nothing lands)."""
        return ROOM_SEVERAL if self.n_land_several and self._holds_a_step(self.top_k) else 0

    def _holds_a_step(self, n_choices: int) -> bool:
        """Whether the pool holds a step's routed experts (n_choices per host layer): else it keeps its hottest."""
        return self.residency.n_slots >= len(self.layers) * n_choices

    def _submit(self, now: list, behind: list, after) -> None:
        """Copy (slot, host row) into slots no queued step reads at once, the others behind `after`."""
        for batch, wait in ((now, None), (behind, after)):
            if batch:
                self.slots.submit(batch, speculative=False, after=wait)


class Pending:
    """A queued step the host has not learned from yet."""

    def __init__(self, n_tokens: int, event, from_host: np.ndarray, land_slots: np.ndarray | None,
                 seqs: list[int] | None = None):
        self.n_tokens, self.event, self.from_host, self.land_slots = n_tokens, event, from_host, land_slots
        self.seqs = seqs                # each token's sequence, or None
        self.absorbed = False           # its landed experts (read-through) are in the residency map


class Prepared:
    """The next step's table, prepared while the step before it runs: the staging buffer it is in
    (ZeroCopyDecode.stagings[buffer]), which experts it reads from host, its landing slots, and the (flat) entries
    whose copies were still in flight, with their slots."""

    def __init__(self, buffer, from_host, land_slots, waiting, waiting_slots):
        self.buffer, self.from_host, self.land_slots = buffer, from_host, land_slots
        self.waiting, self.waiting_slots = waiting, waiting_slots
