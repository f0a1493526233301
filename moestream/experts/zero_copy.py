"""Zero-copy decode: a decode step reads each routed expert where it lies, a cache slot or pinned host memory.

    zc = ZeroCopyDecode(slots, planner, store, layers, max_tokens=16, top_k=8)      # over the cache's pool
    zc.begin_step()                      # the address table (layer, expert) -> slot or host row, onto the device
    table, routed = zc.address_table(layer)   # inside the (captured) step: the addresses table[ids]; ids kept in routed
    zc.end_step(n_tokens)                # after the step is queued: learn from the previous step's routing

A decode step then needs no host decision: the whole step is one CUDA graph, and a miss costs its bytes over the
link once, read in place by the kernel (kernels/decode.py). The cache still learns: after each step is queued, the
host reads the previous step's routing back and runs the policy on it (_learn says what each kind of step keeps).
It works through the slot pool (slots.py) and the planner, as the prompt path (prompt.py) does: they are peers.

Read-through (on by default; --no-read-through; read_through.py): a step is also handed empty slots per layer,
and its kernel writes the first experts it reads from host memory into them as it reads them. Before the next
step's table goes to the device the host replays the kernel's rule on the step's routing and takes those experts
in, so the next step reads them from their slots. Staged host reads (`staged`, the default for quantized experts:
kernels/stage.py): a step's first launch a layer copies the experts it reads from host memory into device memory,
its landing slots first (the same read-through, for every kernel and any number of tokens: distinct experts in
order of first choice, stage.landed_experts) and then scratch rows, and the expert kernel reads them all there.

Without read-through a one-token step's misses are uploaded on the copy stream behind the step in flight. Why
that is safe without pins: a table is written on the compute stream before its step and points only at slots
whose copy has completed. The misses of step t are learned while step t+1 runs (step t has completed: its routing
was read back). A copy into a slot that step t+1's table may point at waits for step t+1; a copy into one of the
empty slots kept in reserve starts at once and lands, normally, before step t+2, whose table then points at it.

The table leaves the critical path between steps: it is prepared from the residency map while the step before
it runs (after learning), and begin_step only patches in the copies that have landed since, then copies it over
(one small copy). A step's landed experts reach the next step's table on the device: the step ends by noting where
it landed what (note_landings, ReadThrough.absorb's rule in device ops), the next one starts by pointing its table
there (apply_landings; both inside the steps' graphs), and the host takes them in while that next step runs. So
nothing of the host's waits between two steps but the table's copy. (Taking them in on the host first, in
begin_step, was measured and removed at stop 47: bench/RESULTS.md, stop 34.)
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from ..kernels.stage import Landing, staging_rows
from .hot_set import HotSet
from .planner import CachePlanner
from .provider import row_addresses
from .read_through import DeviceLandings, ReadThrough
from .residency import CacheTooSmall
from .routing import report_route
from .slots import SlotPool
from .store import ExpertStore


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
        self.layer_ids = np.asarray(layers, dtype=np.int64)            # the host layers, for the host's learning
        self.layer_base = (np.arange(len(layers)) * E)[:, None]         # ... a layer's block of (n, E) counts
        self.layer_bytes = np.array([store.layer_bytes(l) for l in layers], dtype=np.int64)
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
        self.hot = HotSet(self.residency, self.stats, store, layers, routing)     # what several-token steps keep
        self.rt = ReadThrough(slots, self.residency, self.stats, layers, top_k, read_through, staged)
        self.n_land = self.rt.n_land                        # a one-token step's landing slots a layer (0: none)
        self.host_tab = torch.from_numpy(self.host_addr).to(dev.torch)              # (L, E) host-row addresses
        self.scratch = staging_rows(slots.pool, top_k) if staged else None          # (S, row)
        self.aligned = store.aligned16(slots.pool, self.scratch)
        shape = (L, max(self.n_land, self.rt.n_land_several, 1))                            # (L, R)
        self.land = torch.zeros(shape, dtype=torch.int64, device=dev.torch)                # addresses
        self.land_slots = np.full(shape, -1, dtype=np.int64)                      # the queued step's, as slots
        # The next step's table is prepared while the step before it runs (end_step), in the staging buffer that
        # step's own table copy does not read; begin_step patches in what landed since, and copies it over.
        self.stagings = [(dev.pinned_empty((L, E), torch.int64), dev.pinned_empty(shape, torch.int64),
                          dev.pinned_empty((L, E), torch.bool)) for _ in (0, 1)]
        self.current = 0                                    # the staging buffer of the queued step's table
        self.next = None                                    # Prepared: the next step's table, or None
        # A step's landings, noted on the device for the next step's table (module docstring), or None.
        self.device_landings = DeviceLandings(self.rt, top_k, (L, E), dev.torch) \
            if self.n_land > 0 else None

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
        addresses: as many as ReadThrough.count gives a step of its tokens; the scratch rows when staged); None when
        neither is on."""
        if not self.n_land and self.scratch is None:
            return None
        return Landing(ids, self.host_tab[layer], self.land[layer, :self.rt.count(ids.shape[0])], self.scratch,
                       self.aligned)

    def begin_prompt(self, seq: int) -> None:
        """Sequence `seq` begins a new request: the hot set forgets its earlier steps."""
        self.hot.forget(seq)

    def begin_step(self, seqs: list[int] | None = None) -> None:
        """Put the step's address table on the device: an expert resident in a slot whose copy has landed reads
        from the slot, every other one from its host row. The table was prepared while the last step ran (or is
        prepared now, after a prompt); here it only takes in what changed since: with read-through, the experts the
        last step wrote into its landing slots (the next step reads them there), and copies that have landed.
        seqs: each token's sequence (the hot set keeps each sequence's counts; None: not told)."""
        self.seqs = seqs
        p = self.pending
        # The last step's landings go to this table on the device (apply_landings), where it noted them and the
        # next table was prepared while it ran (not after a prompt, nor a trace's replay).
        deferred = p is not None and p.noted and not p.absorbed and self.next is not None
        if p is not None and p.event is not None and not deferred:
            p.event.synchronize()                # that step has run: its table copy is done, its landings are in
        nxt, self.next = self.next, None
        absorbed = self._absorb(p) if p is not None and not p.absorbed and not deferred else None
        fresh = nxt is None
        if fresh:                                # (after a prompt: it takes in what was just absorbed)
            nxt = self._prepare(1 - self.current, writing=None)
        staging, land_staging, absorbable = self.stagings[nxt.buffer]
        if not fresh:
            self._patch(nxt, staging.numpy(), absorbed)
        self.from_host[:] = nxt.from_host
        self.land_slots[:] = nxt.land_slots
        self.current = nxt.buffer
        self.table.copy_(staging, non_blocking=True)
        if self.n_land:
            self.land.copy_(land_staging, non_blocking=True)
        if self.device_landings is not None:
            self.device_landings.absorbable.copy_(absorbable, non_blocking=True)
            if not deferred:
                self.device_landings.noted_ok.zero_()        # nothing for this step's table to take in on the device

    def apply_landings(self) -> None:
        """A step's first ops (inside its graph): the last step's landed experts into its table (DeviceLandings)."""
        if self.device_landings is not None:
            self.device_landings.apply(self.table)

    def note_landings(self, n_tokens: int) -> None:
        """A step's last ops (inside its graph): which experts it landed in which landing slots (DeviceLandings)."""
        if self.device_landings is not None:
            self.device_landings.note(self.table, self.host_tab, self.routed, self.land, n_tokens)

    @contextlib.contextmanager
    def kept(self):
        """The table and the noted landings as they are now, back after the block (a graph's warm-up steps run
        note_landings on no real step's routing)."""
        kept = (self.table,) + (self.device_landings.state() if self.device_landings is not None else ())
        saved = [t.clone() for t in kept]
        try:
            yield
        finally:
            for t, v in zip(kept, saved):
                t.copy_(v)

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
        staging, land_staging, absorbable = self.stagings[buffer]
        staging.numpy()[:] = np.where(landed, self.pool_addr + slot * self.row_bytes, self.host_addr)
        if self.device_landings is not None:
            absorbable.numpy()[:] = ~held
        waiting = np.flatnonzero((held & ~landed).ravel())
        land_slots = self.rt.hand_out(self.land_slots.shape, writing)
        if self.n_land:
            land_staging.numpy()[:] = np.where(land_slots >= 0, self.pool_addr + land_slots * self.row_bytes, 0)
        return Prepared(buffer, ~landed, land_slots, waiting, slot.ravel()[waiting])

    def end_step(self, n_tokens: int, observer=None, noted: bool = False) -> None:
        """The step is queued: report its routing (device views, in stream order) to `observer` (a RouteObserver),
        then learn from the previous step's while this one runs. noted: the step ran note_landings (a decode
        path's step; not a trace's replay)."""
        n = n_tokens * self.top_k
        for l in self.layers:
            report_route(observer, l, self.routed[l, :n].view(n_tokens, self.top_k))
        p = self.pending
        previous = self._take_pending()
        if p is not None and not p.absorbed:     # its landings went to this step's table on the device
            ls, es, _ = self._absorb(p, previous[0])
            self.from_host[ls, es] = False
        event = None
        if self.device.is_cuda:          # the whole buffer: contiguous, so the copy stays asynchronous
            self.routed_host.copy_(self.routed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            self.routed_host.copy_(self.routed)
        writes = None                            # the landing slots this step's kernel may write
        if self.n_land:
            writes = self.land_slots.copy()
            writes[:, self.rt.count(n_tokens):] = -1
        self.pending = Pending(n_tokens, event, self.from_host.copy(), writes, self.seqs,
                               noted and self.device_landings is not None)
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

    def _absorb(self, p, routed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The experts the pending step landed (read-through) become resident: (layers, experts, slots). routed:
        its routing, where the caller has read it back already."""
        p.absorbed = True
        return self.rt.absorb(self._routed(p) if routed is None else routed, p.from_host, p.land_slots, p.n_tokens)

    def _learn(self, routed: np.ndarray, from_host: np.ndarray, seqs, after, writing) -> None:
        """The policy and counters see one step's routing (L, T k); the pool changes for the steps to come.

        - A one-token step, in a pool that holds a step's experts, with read-through: its misses landed in free
          slots as it read them (_absorb), so nothing is uploaded; each layer hands the next steps as many landing
          slots as its recent misses ask for, and the pool keeps that many empty (read_through.py).
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
        one_token = routed.shape[1] == self.top_k and self.rt.holds_a_step(self.top_k)
        upload = one_token and not self.n_land
        if seqs is not None:
            self.hot.seed(seqs)                  # a sequence's first step of a request: its prompt's tail
        self.slots.mark_reads()                  # slots a prompt handed out are free once its compute has run
        self.slots.refresh_pins()
        if writing is not None:
            self.slots.pin(writing[writing >= 0])
        empty = set(np.flatnonzero(res.owner[:, 0] < 0).tolist())     # no step in flight reads these
        # Every host layer at once: (n, E) routings per expert, what was read from host memory and its bytes.
        L, ids, on_host = self.layer_ids, routed[self.layer_ids], from_host[self.layer_ids]   # (n,), (n, T k), (n, E)
        counts = np.bincount((ids + self.layer_base).ravel(), minlength=len(L) * E).reshape(len(L), E)
        per_choice = np.where(on_host, counts, 0)       # each expert read from host: once, or once per choice
        reads = np.count_nonzero(per_choice, axis=1) if self.reads_once else per_choice.sum(axis=1)
        read_bytes = reads * self.layer_bytes
        wanted = counts > 0                      # (n, E)
        n_routed = wanted.sum(axis=1)
        extra = np.zeros(len(L), dtype=np.int64)    # routed beyond what the pool holds: looked up, missed
        for i in np.flatnonzero(n_routed > res.n_slots):     # (rare: more than the pool)
            routed_i = np.flatnonzero(wanted[i])
            keep = routed_i[np.argsort(-counts[i, routed_i], kind="stable")[:res.n_slots]]
            wanted[i] = False
            wanted[i, keep] = True
            extra[i] = len(routed_i) - len(keep)
        self.hot.observe(L, counts, ids, seqs)       # (both ways: a server's steps change size)
        read = (wanted & on_host).sum(axis=1)            # the misses as the step read them
        if upload:
            self._upload(wanted, n_routed, read, empty, after)
        else:
            for l, n in zip(L.tolist(), n_routed.tolist()):
                self.planner.see(l, n)           # the policy's clock and the layer it is at, as a plan's would
            slots = res.slot_of[L][wanted]
            slots = slots[slots >= 0]
            res.policy.touch(slots)
            self.slots.claim(slots)              # read by decode: no prefetch into them is pending
            if one_token:
                self.rt.note_one_token(L, reads)
        if one_token:
            self.rt.after_one_token()
        else:
            room = self.rt.room()
            self._submit(*self.hot.fill(empty, room), after)     # (nothing moved above: `empty` holds)
            self.hot.make_room(room, writing)
        if upload:                               # (the plans counted the hits and misses of what they loaded)
            hits, misses = np.zeros_like(extra), extra
        else:
            hits, misses = wanted.sum(axis=1) - read, read + extra
        stats.record_layers(L, host_reads=reads, host_read_bytes=read_bytes, hits=hits, misses=misses,
                            host_s=(time.perf_counter() - t0) / len(L))

    def _upload(self, wanted: np.ndarray, n_routed: np.ndarray, read: np.ndarray, empty: set, after) -> None:
        """A one-token step without read-through: each layer's misses uploaded (plans count hits and misses)."""
        now, behind = [], []                     # copies into empty slots (unread), into evicted ones (read)
        for i, l in enumerate(self.layers):
            want = np.flatnonzero(wanted[i]).astype(np.int64)
            self.planner.see(l, int(n_routed[i]))
            try:
                plan = self.planner.plan(l, want, int(read[i]))
            except CacheTooSmall:                # a prompt's compute still reads its slots: let it finish
                self.device.synchronize()
                self.slots.refresh_pins()
                plan = self.planner.plan(l, want, int(read[i]))
            self.slots.claim(plan.slots)         # read or refilled by decode: no prefetch into them is pending
            src = self.store.rows[l]
            for e, slot in plan.misses:
                (now if slot in empty else behind).append((slot, src[e]))
        self._submit(now, behind, after)

    def _submit(self, now: list, behind: list, after) -> None:
        """Copy (slot, host row) into slots no queued step reads at once, the others behind `after`."""
        for batch, wait in ((now, None), (behind, after)):
            if batch:
                self.slots.submit(batch, speculative=False, after=wait)


class Pending:
    """A queued step the host has not learned from yet."""

    def __init__(self, n_tokens: int, event, from_host: np.ndarray, land_slots: np.ndarray | None,
                 seqs: list[int] | None = None, noted: bool = False):
        self.n_tokens, self.event, self.from_host, self.land_slots = n_tokens, event, from_host, land_slots
        self.seqs = seqs                # each token's sequence, or None
        self.noted = noted              # its landings were noted on the device (note_landings)
        self.absorbed = False           # its landed experts (read-through) are in the residency map


class Prepared:
    """The next step's table, prepared while the step before it runs: the staging buffer it is in
    (ZeroCopyDecode.stagings[buffer]), which experts it reads from host, its landing slots, and the (flat) entries
    whose copies were still in flight, with their slots."""

    def __init__(self, buffer, from_host, land_slots, waiting, waiting_slots):
        self.buffer, self.from_host, self.land_slots = buffer, from_host, land_slots
        self.waiting, self.waiting_slots = waiting, waiting_slots
