"""What zero-copy decode keeps in the pool when a step has several tokens: each layer's most routed experts.

    hot = HotSet(residency, stats, store, layers, routing)        # routing: the RoutingStore of the prompts' tails
    hot.observe(layers, counts, ids, seqs)         # a step's routing of its layers: counts (n, E), ids (n, T k), and
                                                   # each token's sequence (or None), each step
    hot.forget(seq)                                # the sequence begins a new request: its counts leave
    hot.seed(seqs)                                 # a step's sequences: those new to it take their prompts' tails
    now, behind = hot.fill(empty, room)            # copies to make: (slot, host row), into empty slots / evicted ones
    hot.make_room(room, writing)                   # keep `room` slots a layer free for the next step to land in

Several streams decoded together route more experts than a pool holds, and uploading each step's misses evicts
what the next step reads (bench/RESULTS.md, issue 15: on the reference at 16000 MiB, 8 streams, 43 ms a step that
way). So a several-token step uploads no miss. The pool keeps the most routed experts of the host
layers in recent steps (counts decayed by FREQ_DECAY a step), ranked across the layers as one (a layer whose routing
is spread takes more slots than one whose few experts take most of its choices: on 8 streams' replayed routing,
4.1 experts a layer a step over the link against 4.6 with an equal share a layer), at most FILL_PER_LAYER uploads
a host layer a step, into empty slots first. `room` slots a layer stay free, emptied of the pool's least routed
experts, so that the step's kernel lands what it reads from host memory (read-through) at no cost on the link. A
pool smaller than one token's experts of every host layer keeps its experts this way too. On a skewed routing a few
experts a layer take most routings (REFERENCE.md: the top 10% take 81%), so even a small share saves much of the
link.

The counts are the sum of each sequence's own (the union of the active streams' hot sets). When a sequence begins
a new request its counts leave at once, and at its first step the routing of its prompt's last tokens (prompt.TAIL)
counts as its steps: fresh streams would otherwise find the pool kept for the streams before them, whose counts
fade over ~50 steps. An offline replay of 8 fresh streams' routing after 8 others (bench --parallel 8 -npp 512 -ntg
64 on a 12-layer reference, 74 slots a layer; bench/replay_streams.py): 9.75 experts a layer a step crossed the
link with one decaying sum, 4.42 with the sequences' counts, 4.12 seeded (bench/RESULTS.md, stop 28).
"""
from __future__ import annotations

import numpy as np

from .residency import CacheTooSmall, Residency
from .routing import RoutingStore
from .stats import CacheStats
from .store import ExpertStore

FREQ_DECAY = 0.98          # per step, of the routing counts the hottest experts are chosen by
FILL_PER_LAYER = 16        # uploads a step at most, per host layer: fresh streams warm the pool faster (replayed, 8
                           # streams at 74 slots a layer: 4.27 / 3.87 / 3.75 / 3.65 / 3.63 experts a layer a step over
                           # the link at 2.7 / 5.3 / 8 / 16 / 32 a layer; 64 a step was 2.7 a layer on the 24-layer
                           # file)


class HotSet:
    def __init__(self, residency: Residency, stats: CacheStats, store: ExpertStore, layers: list[int],
                 routing: RoutingStore | None = None):
        self.residency, self.stats, self.store, self.layers = residency, stats, store, layers
        self.routing = routing                              # prompts[seq].tail: what seeds a sequence (None: nothing)
        L, E = residency.slot_of.shape
        self.freq = np.zeros((L, E))                        # decayed routing counts of decode steps
        self.by_seq = np.zeros((0, L, E))                   # (S, L, E): sequence s's part of freq (grown as
                                                            # sequences appear; a server's are its slots)
        self.unseeded: set[int] = set()                     # sequences that began a request and took no step yet

    def observe(self, layers: np.ndarray, counts: np.ndarray, ids: np.ndarray | None = None,
                seqs: list[int] | None = None) -> None:
        """One step's routing of its layers (every step, whatever its size: a server's steps change): counts
        (n, E) of layers (n,), and their ids (n, T k) in token order with each token's sequence (None: the
        sequences are not known, and the counts stay in freq until they fade)."""
        self.freq[layers] = self.freq[layers] * FREQ_DECAY + counts
        self.by_seq[:, layers] *= FREQ_DECAY
        if seqs is None or ids is None:
            return
        self._grow(max(seqs))
        owner = np.repeat(np.asarray(seqs), ids.shape[1] // len(seqs))     # each choice's sequence
        np.add.at(self.by_seq, (owner[None, :], np.asarray(layers)[:, None], ids), 1)

    def _grow(self, seq: int) -> None:
        if seq >= len(self.by_seq):
            more = np.zeros((seq + 1 - len(self.by_seq), *self.freq.shape))
            self.by_seq = np.concatenate([self.by_seq, more])

    def forget(self, seq: int) -> None:
        """Sequence `seq` begins a new request: the counts of its earlier steps leave the hot set."""
        if seq < len(self.by_seq):
            np.maximum(self.freq - self.by_seq[seq], 0, out=self.freq)
            self.by_seq[seq] = 0
        self.unseeded.add(seq)

    def seed(self, seqs: list[int]) -> None:
        """A learned step's sequences: each one's first step of a request takes the routing of its prompt's last
        tokens (routing.prompts[seq].tail, L x E), each token counted as one of its steps, so that the pool takes in
        its experts before its own steps have shown them."""
        if self.routing is None:
            return
        for seq in self.unseeded.intersection(seqs):
            self.unseeded.discard(seq)
            self._grow(seq)
            tail = self.routing.prompts[seq].tail
            self.by_seq[seq] += tail
            self.freq += tail

    def desired(self, room: int) -> np.ndarray:
        """(L, E): the experts the pool keeps for several-token steps: the hottest experts of all host layers by
        decayed counts, one ranking (a layer whose routing is spread gets more slots than one whose few experts
        take most of its choices), as many as the pool holds less `room` free slots a layer; none that no step
        routed."""
        want = np.zeros(self.freq.shape, dtype=bool)
        layers = self.layers
        f = self.freq[layers].ravel()
        top = np.argsort(-f, kind="stable")[:max(self.residency.n_slots - room * len(layers), 0)]
        keep = np.zeros(f.shape, dtype=bool)
        keep[top[f[top] >= 1.0]] = True
        want[layers] = keep.reshape(len(layers), -1)
        return want

    def fill(self, empty_before: set, room: int) -> tuple[list, list]:
        """Upload (at most FILL_PER_LAYER a host layer, hottest first) the experts of `desired(room)` that are not
        resident, into free slots or ones whose experts are not desired: ([(slot, host row)] into slots empty before
        this step's learning, [(slot, host row)] into slots a queued step may read)."""
        res = self.residency
        desired = self.desired(room)
        want = [(self.freq[l, e], l, e) for l in self.layers
                for e in np.flatnonzero(desired[l] & (res.slot_of[l] < 0))]
        want.sort(key=lambda w: -w[0])
        now, behind = [], []
        for _, l, e in want[:FILL_PER_LAYER * len(self.layers)]:
            own, free = res.owner, ~res.pinned
            if not (free & (own[:, 0] < 0)).any():   # no empty slot: the least routed resident not desired goes
                ok = free & (own[:, 0] >= 0)
                ok[ok] = ~desired[own[ok, 0], own[ok, 1]]
                if not ok.any():
                    continue
                cand = np.flatnonzero(ok)
                victim = cand[np.argmin(self.freq[res.owner[cand, 0], res.owner[cand, 1]])]
                for old_l, _ in res.evict(np.array([victim])):
                    self.stats.record(old_l, evictions=1)
            try:
                res.ensure(l, np.array([e]))         # takes the lowest empty unpinned slot
            except CacheTooSmall:
                continue
            slot = int(res.slot_of[l, e])
            (now if slot in empty_before else behind).append((slot, self.store.rows[l][e]))
            self.stats.record(l, uploaded_bytes=self.store.layer_bytes(l), copies=1)
        return now, behind

    def make_room(self, room: int, writing) -> None:
        """Keep `room` slots a layer free in the pool, evicting its least routed residents, so that the next step
        lands what it reads from host memory instead of reading it again at every step. Never a pinned slot, nor
        one a queued step writes (`writing`: its landing slots, or None)."""
        if not room:
            return
        res = self.residency
        own = res.owner
        over = room * len(self.layers) - int((own[:, 0] < 0).sum())
        if over <= 0:
            return
        ok = (own[:, 0] >= 0) & ~res.pinned
        if writing is not None:
            ok[writing[writing >= 0]] = False
        slots = np.flatnonzero(ok)
        heat = self.freq[res.owner[slots, 0], res.owner[slots, 1]]
        victims = slots[np.argsort(heat, kind="stable")[:over]]
        self.stats.count(np.array([old_l for old_l, _ in res.evict(victims)]), "evictions")
