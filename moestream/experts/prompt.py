"""The prompt path: a ubatch's routed experts fetched into the slot pool layer by layer, and what comes next copied
ahead (prefetch, lookahead, fill).

    prompt = PromptPath(store, slots, planner, layers, layers, PrefetchConfig(), routing, top_k=8, device=dev)
    prompt.begin_ubatch(seq=0, n_tokens=4096, is_prompt=True)   # rules 2-4: the first host layer's guess goes now
    w = prompt.fetch(layer, ids)         # uploads the misses on the copy stream; compute waits only for its slots
    y = kernel(x, w.slots, w.w13, w.w2); prompt.experts_launched(layer)     # then the next layer's copies go ahead

Misses go on the copy stream ahead of the speculative copies (prefetch), whose bytes in flight are bounded. When a
ubatch routes more experts in one layer than the pool holds, `fetch` returns Waves. The decisions are the
planner's (planner.py); the slots, copies and pins are the pool's (slots.py), which zero-copy decode shares.
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch

from .planner import CachePlanner
from .prefetch import PrefetchConfig, Seed, choose_seed, predicted
from .provider import ExpertWeights
from .residency import CacheTooSmall
from .routing import RoutingStore
from .slots import SlotPool
from .store import ExpertStore

FILL_LOW_BYTES = 24 << 20                 # fill: copy ahead when no more than this is left on the copy stream
FILL_LAUNCH_BYTES = 96 << 20              # ... and up to this much once a layer's experts are queued (the host
                                          # looks again only at the next routing)
FILL_POLL_S = 50e-6                       # ... looking this often while the host waits for a routing
TAIL = 16                                 # a prompt ubatch's last tokens, whose routing seeds its sequence's share
                                          # of the decode hot set (hot_set.py; the same read-back carries it)


class Waves:
    """A layer's routed experts in groups that fit the pool; iterating uploads each group just before its use."""

    def __init__(self, prompt: "PromptPath", layer: int, ids: torch.Tensor, groups: list[np.ndarray]):
        self.prompt, self.layer, self.ids, self.groups = prompt, layer, ids, groups

    def __iter__(self):
        for g in self.groups:
            self.prompt.slots.mark_reads()       # the previous wave's compute is queued: its slots may go
            w = self.prompt._load(self.layer, self.ids, g)
            member = torch.zeros(self.prompt.n_experts, dtype=torch.bool)
            member[torch.from_numpy(g)] = True
            yield w, member.to(self.ids.device)[self.ids]          # (T, k): choices this wave computes


class PromptPath:
    def __init__(self, store: ExpertStore, slots: SlotPool, planner: CachePlanner, layers: list[int],
                 moe_layers: list[int], prefetch: PrefetchConfig, routing: RoutingStore, top_k: int, device):
        self.store, self.slots, self.planner, self.prefetch, self.device = store, slots, planner, prefetch, device
        self.residency, self.stats, self.n_experts = planner.residency, planner.stats, slots.n_experts
        self.layers, self.moe_layers = layers, moe_layers          # host layers; every MoE layer (guesses' order)
        self.host_set = set(layers)
        self.routing = routing                                  # per context: routing.prompts[seq]
        self.seed: Seed | None = None
        self.hint: np.ndarray | None = None                     # the next ubatch's guessed experts (seed_next)
        self.seq, self.is_prompt, self.n_tokens = 0, False, 0
        self.rows: dict[int, tuple[int, int]] = {}              # a prompt ubatch's sequences: each one's rows
        self.top_k = top_k
        self.predicted: dict[int, np.ndarray] = {}              # lookahead: layer -> its predicted experts
        self.pending: tuple[int, np.ndarray] | None = None      # the next layer's copy-ahead, until experts_launched
        self.fill: list[tuple[int, np.ndarray]] = []           # later layers' guesses, for a copy stream short of work
        rows = 1 + max(1, prefetch.lookahead_layers) + routing.n_seq      # the routing, the guesses, the tails
        self.counts_host = device.pinned_empty((rows, self.n_experts), torch.int64)

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        """seqs: each token's sequence where the forward has several (a prompt batch of several sequences' parts,
        each sequence's tokens together): each one's tail is its own last tokens; the batch's routing is recorded
        as each one's (it seeds from the first's)."""
        self.seq, self.is_prompt, self.n_tokens = seq, is_prompt, n_tokens
        stats = self.routing.prompts[seq]
        hint, self.hint = self.hint, None       # a verify step's drafts' guesses (ExpertCache.seed_next)
        self.seed = choose_seed(n_tokens, is_prompt, stats, self.prefetch) if hint is None else Seed("draft", hint)
        self.rows = {seq: (0, n_tokens)}        # each sequence's rows [a, b): its prompt's tail ends at b
        if is_prompt and seqs is not None:
            last = {s: i + 1 for i, s in enumerate(seqs)}
            first = {s: i for i, s in reversed(list(enumerate(seqs)))}
            self.rows = {s: (first[s], b) for s, b in last.items()}
        if is_prompt:
            for s in self.rows:
                self.routing.prompts[s].begin_ubatch(n_tokens)
        self.fill = []
        if self.seed is not None:           # rule 2-4: the first host layer's experts go ahead now, the next
            self._prefetch(self.layers[0], self._predicted(self.layers[0]))      # ones as fill
            self.fill = [(l, self._predicted(l)) for l in self.layers[1:self.prefetch.lookahead_layers]]

    # A prompt ubatch paused between layers (ExpertCache.suspend): what begin_ubatch, prepare and fetch set.
    _STATE = ("seq", "is_prompt", "n_tokens", "seed", "rows", "predicted", "pending", "fill")

    def save(self) -> tuple:
        """(the dict and list copied: an eager decode step in between changes them in place)"""
        return tuple(copy.copy(getattr(self, name)) for name in self._STATE)

    def restore(self, state: tuple) -> None:
        for name, value in zip(self._STATE, state):
            setattr(self, name, value)

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        """How many MoE layers ahead to guess experts through their routers (0: none): one for decode-sized
        ubatches, `lookahead_layers` for prompt ubatches big enough to prefetch (their routed set; the guess is then
        far more specific than earlier prompts' counts)."""
        pf = self.prefetch
        if not (pf.enabled and pf.lookahead) or layer == self.layers[-1]:
            return 0
        if self.is_prompt:
            return pf.lookahead_layers if pf.prompt_lookahead and n_tokens >= pf.min_batch else 0
        return 1 if n_tokens <= 8 else 0

    # --- the hot path ---------------------------------------------------------------------------------------
    def fetch(self, layer: int, ids: torch.Tensor, lookahead: tuple | None = None):
        """ids (T, k) routed expert ids -> ExpertWeights, or Waves when the pool cannot hold them all at once.
        lookahead: the guessed ids (T, k) of the next MoE layers, nearest first."""
        self.slots.mark_reads()
        t0 = time.perf_counter()
        E = self.n_experts
        tails = [ids[max(b - TAIL, a):b] for a, b in self.rows.values()] if self.is_prompt else []
        parts = [ids, *(lookahead or ())] + tails
        counts = torch.zeros(len(parts), E, dtype=torch.int64, device=ids.device)
        for row, p in zip(counts, parts):        # routings per expert, on the device: no sort, no big read-back
            row.scatter_add_(0, p.reshape(-1), torch.ones(p.numel(), dtype=torch.int64, device=ids.device))
        got = self._read_back(counts)            # the one host sync of this layer: its routing and the guesses
        if self.is_prompt:
            for s, row in zip(self.rows, got[len(got) - len(tails):]):
                self.routing.prompts[s].tail[layer] = row
            got = got[:len(got) - len(tails)]
        t1 = time.perf_counter()
        table = self.prepare(layer, got[0], got[1:] if lookahead else None)
        if isinstance(table, list):
            w = Waves(self, layer, ids, table)
        else:
            used = np.unique(table[np.flatnonzero(got[0])])                  # the slots it reads, ascending
            w = self.slots.weights(layer, self.slots.upload_table(layer, table)[ids], used)
        self.stats.record(layer, sync_s=t1 - t0, host_s=time.perf_counter() - t1)
        return w

    def prepare(self, layer: int, counts: np.ndarray, guesses=None):
        """The host's part of one MoE layer, once its routing is on the host as counts per expert (E,): routing
        statistics, counters, uploads of the misses, the compute stream's wait, and the prefetch of what comes
        next (`guesses`: the lookahead's counts per expert (E,) of the next MoE layers, nearest first: the first
        host layer among them is copied once this layer's experts are queued, the others whenever the copy stream
        runs short of work, `_fill`). Returns the layer's slot table (E,) (slot of each expert id within the
        pool, -1 if absent), or the groups of experts to run in waves when the pool cannot hold them all
        at once (then nothing is loaded yet)."""
        self._copy_pending()                    # a copy-ahead nobody launched yet goes now (it is still useful)
        wanted = np.flatnonzero(counts).astype(np.int64)
        if self.is_prompt:
            for s in self.rows:
                self.routing.prompts[s].record(layer, counts)
        self._score_lookahead(layer, counts, len(wanted))
        groups = self.planner.groups(layer, wanted)
        if len(groups) > 1:
            return groups
        self._load_slots(layer, groups[0])
        if guesses is not None:
            i = self.moe_layers.index(layer)
            ahead = [(l, predicted(g, self.n_experts)) for l, g in zip(self.moe_layers[i + 1:], guesses)
                     if l in self.host_set]
            self.fill = ahead           # the next layer's guess first: what its copy-ahead leaves (the in-flight
            if ahead:                   # bound) follows as the copy stream drains, then the later layers'
                self.predicted[ahead[0][0]] = ahead[0][1]       # scored when that layer routes
                self.pending = ahead[0]
        elif self.seed is not None and (nxt := self._next_layer(layer)) is not None:
            self.pending = (nxt, self._predicted(nxt))
        return self.slots.table(layer)

    def experts_launched(self, layer: int) -> None:
        """The layer's expert kernels are queued: now copy ahead what the next layer is predicted to need, and
        (fill) the later layers' guesses if that leaves the copy stream short of work. The bookkeeping then runs
        while the GPU computes, not while it waits for this layer's table."""
        self._copy_pending()
        self._fill(FILL_LAUNCH_BYTES)

    def _copy_pending(self) -> None:
        if self.pending is not None:
            nxt, experts = self.pending
            self.pending = None
            self._prefetch(nxt, experts)

    def _load(self, layer: int, ids: torch.Tensor, group: np.ndarray) -> ExpertWeights:
        self._load_slots(layer, group)
        lut = torch.from_numpy(self.slots.table(layer)).to(self.device.torch)     # (E,): a wave reuses no staging
        return self.slots.weights(layer, lut[ids])

    def _load_slots(self, layer: int, group: np.ndarray) -> None:
        """Make `group` resident: plan, copy the misses on the copy stream, make compute wait for its slots and
        pin them until it has read them."""
        self.slots.refresh_pins()
        try:
            plan = self.planner.plan(layer, group)
        except CacheTooSmall:                # pins hold too much: let queued compute finish, then every slot is free
            self.device.synchronize()
            self.slots.refresh_pins()
            plan = self.planner.plan(layer, group)
        victims = np.array([s for _, s in plan.misses], dtype=np.int64)
        n_used = self.slots.claim(plan.slots[plan.hit])
        wasted = self.slots.claim(victims)
        if n_used or wasted:
            self.stats.record(layer, prefetch_used=n_used, prefetch_wasted=wasted)
        if plan.misses:
            self.slots.copy_experts(layer, plan.misses, speculative=False)
        self.slots.hand_out(layer, plan.slots)

    def _read_back(self, counts: torch.Tensor) -> np.ndarray:
        """counts (n, E) on the host. While the device gets there, the copy stream is kept fed from `fill`."""
        if not self.device.is_cuda:
            return counts.numpy()
        buf = self.counts_host[:counts.shape[0]]
        buf.copy_(counts, non_blocking=True)
        there = torch.cuda.Event()
        there.record()
        while not there.query():
            if not self._fill():
                there.synchronize()
                break
            time.sleep(FILL_POLL_S)
        return buf.numpy().copy()

    def _fill(self, low: int | None = None) -> bool:
        """When the copy stream has less than `low` bytes left to copy (FILL_LOW_BYTES), copy ahead the next guessed
        experts of the layers after the next one (`fill`, most likely first) up to that. False once there is
        nothing to copy. While the speculative bytes in flight are at their bound the fill waits (True): it used to
        end there, and a prompt that sweeps every expert left the link idle until the next routing (RESULTS.md,
        stop 26)."""
        eb = self.store.expert_bytes
        room = (FILL_LOW_BYTES if low is None else low) - self.slots.queue.pending_bytes()
        if room < eb:
            return True
        if (self.prefetch.max_inflight_mib << 20) < eb:        # never room for one expert
            self.fill = []
            return False
        if not self.fill:
            return False
        in_flight_room = self._in_flight_room()
        if in_flight_room < eb:
            return True
        while self.fill:
            layer, experts = self.fill[0]
            missing = experts[self.residency.slot_of[layer, experts] < 0]
            if not len(missing):
                self.fill.pop(0)
                continue
            copied = self._prefetch(layer, missing[:max(1, room // eb)], in_flight_room)   # the first ones
            if not copied:                          # every slot is pinned
                self.fill = []
                return False
            self.fill[0] = (layer, missing[copied:])
            self.stats.record(layer, filled=copied)
            return True
        return False

    def _in_flight_room(self) -> int:
        """Speculative bytes the in-flight bound still admits."""
        return (self.prefetch.max_inflight_mib << 20) - self.slots.queue.speculative_inflight()

    def _prefetch(self, layer: int, experts: np.ndarray, room: int | None = None) -> int:
        """Copy ahead the experts of `layer` not resident, in the given order, within the in-flight bound (`room`:
        what it admits, if the caller has just asked). Returns how many it copied."""
        res = self.residency
        experts = experts[res.slot_of[layer, experts] < 0]
        if not len(experts):
            return 0
        room = self._in_flight_room() if room is None else room
        n = min(len(experts), max(0, room // self.store.expert_bytes))
        self.slots.refresh_pins()
        n = min(n, int((~res.pinned).sum()) - 1)
        if n <= 0:
            return 0
        experts = np.sort(experts[:n])      # (one batch: its order is not a priority; ascending, it copies in runs)
        plan = res.ensure(layer, experts)
        victims = np.array([s for _, s in plan.misses], dtype=np.int64)
        wasted = self.slots.claim(victims)
        nbytes = len(plan.misses) * self.store.layer_bytes(layer)
        self.slots.copy_experts(layer, plan.misses, speculative=True)
        self.stats.record(layer, evictions=len(plan.evicted), uploaded_bytes=nbytes, copies=len(plan.misses),
                          prefetched=len(plan.misses), prefetched_bytes=nbytes, prefetch_wasted=wasted)
        return len(plan.misses)

    # --- bookkeeping ----------------------------------------------------------------------------------------
    def _predicted(self, layer: int) -> np.ndarray:
        row = None if self.seed.counts is None else self.seed.counts[layer]
        return predicted(row, self.n_experts, self.n_tokens * self.top_k, self.prefetch.min_use)

    def _next_layer(self, layer: int) -> int | None:
        i = self.layers.index(layer)
        return self.layers[i + 1] if i + 1 < len(self.layers) else None

    def _score_lookahead(self, layer: int, counts: np.ndarray, n_wanted: int) -> None:
        guess = self.predicted.pop(layer, None)
        if guess is not None:
            tp = int(np.count_nonzero(counts[guess]))
            self.stats.record(layer, lookahead_tp=tp, lookahead_fp=len(guess) - tp, lookahead_fn=n_wanted - tp)
