"""The GPU expert cache: a pool of expert slots under --moe-cache-mib, filled from the host store.

    cache = ExpertCache(store, n_slots=1702, n_layers=24, n_experts=128, device=dev, policy="lfru")
    cache.begin_ubatch(seq=0, n_tokens=4096, is_prompt=True)     # the engine, before each forward
    w = cache.fetch(layer, ids)          # uploads the misses on the copy stream; compute waits only for its slots
    y = kernel(x, w.slots, w.w13, w.w2); cache.experts_launched(layer)   # then the next layer's copies go ahead

Compute reads weights from the pool by slot index (no staging copy). Misses go on the copy stream ahead of the
speculative copies (prefetch), whose bytes in flight are bounded. A slot that queued compute still reads is
pinned: it is never a victim, so a copy never overwrites weights before their reader ran. When a ubatch routes more
experts in one layer than the pool holds, `fetch` returns Waves. The decisions themselves, with no device, are
planner.py's.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .copy_queue import CopyQueue
from .planner import CachePlanner
from .prefetch import PrefetchConfig, Seed, choose_seed, predicted
from .provider import ExpertProvider, ExpertWeights
from .residency import CacheTooSmall
from .routing import RoutingStore
from .store import ExpertStore, expert_views

NOT_YET = np.iinfo(np.int64).max          # a slot handed out whose reading compute has no event yet
FILL_LOW_BYTES = 24 << 20                 # fill: copy ahead when no more than this is left on the copy stream
FILL_LAUNCH_BYTES = 96 << 20              # ... and up to this much once a layer's experts are queued (the host
                                          # looks again only at the next routing)
FILL_POLL_S = 50e-6                       # ... looking this often while the host waits for a routing


class Waves:
    """A layer's routed experts in groups that fit the pool; iterating uploads each group just before its use."""

    def __init__(self, cache: "ExpertCache", layer: int, ids: torch.Tensor, groups: list[np.ndarray]):
        self.cache, self.layer, self.ids, self.groups = cache, layer, ids, groups

    def __iter__(self):
        for g in self.groups:
            self.cache._mark_reads()             # the previous wave's compute is queued: its slots may go
            w = self.cache._load(self.layer, self.ids, g)
            member = torch.zeros(self.cache.n_experts, dtype=torch.bool)
            member[torch.from_numpy(g)] = True
            yield w, member.to(self.ids.device)[self.ids]          # (T, k): choices this wave computes


class ExpertCache(ExpertProvider):
    def __init__(self, store: ExpertStore, n_slots: int, n_layers: int, n_experts: int, device, policy: str = "lfru",
                 prefetch: PrefetchConfig = PrefetchConfig(), host_layers: list[int] | None = None, n_seq: int = 1,
                 top_k: int = 8, moe_layers: list[int] | None = None, routing: RoutingStore | None = None):
        any_rows = next(iter(store.rows.values()))
        self.store, self.n_experts, self.device, self.prefetch = store, n_experts, device, prefetch
        self.pool = torch.empty(n_slots, any_rows.shape[1], dtype=any_rows.dtype, device=device.torch)  # (S, numel)
        self.layers = sorted(host_layers if host_layers is not None else store.rows)
        self.moe_layers = list(moe_layers) if moe_layers is not None else self.layers    # lookahead guesses' order
        self.host_set = set(self.layers)
        self.planner = CachePlanner(n_slots, n_layers, n_experts, policy, store.expert_bytes, self.layers)
        self.residency, self.stats, self.policy_name = self.planner.residency, self.planner.stats, policy
        w13, w2 = expert_views(self.pool, store.inter, store.hidden)
        self.views = {l: (w13[a:b], w2[a:b], a) for l, (a, b) in enumerate(self.residency.bounds)}
        self.lut_host = device.pinned_empty((n_layers, n_experts), torch.int64)    # staging of slot tables
        self.queue = CopyQueue(device)
        # Per context, the prompts' routing that seeds prefetch (routing.prompts[seq]): the engine's store, or its own.
        self.routing = routing if routing is not None else RoutingStore(n_layers, n_experts, n_seq)
        self.ready = np.zeros(n_slots, dtype=np.int64)          # copy batch that filled each slot
        self.use = np.full(n_slots, -1, dtype=np.int64)         # compute event after each slot's last read
        self.use_events: dict[int, object] = {}
        self.use_seq, self.use_done = 0, 0
        self.spec_flag = np.zeros(n_slots, dtype=bool)          # filled by a prefetch, not used yet
        self.handed: np.ndarray = np.zeros(0, dtype=np.int64)   # slots the last fetch handed out
        self.seed: Seed | None = None
        self.seq, self.is_prompt, self.n_tokens = 0, False, 0
        self.top_k = top_k
        self.predicted: dict[int, np.ndarray] = {}              # lookahead: layer -> its predicted experts
        self.pending: tuple[int, np.ndarray] | None = None      # the next layer's copy-ahead, until experts_launched
        self.fill: list[tuple[int, np.ndarray]] = []           # later layers' guesses, for a copy stream short of work
        self.counts_host = device.pinned_empty((1 + max(1, prefetch.lookahead_layers), n_experts), torch.int64)
        self.waits: list[tuple[int, object, object]] = []      # (layer, before, after) compute-stream events
        self.zero_copy = None                                   # ZeroCopyDecode, when decode reads in place

    def enable_zero_copy(self, max_tokens: int, read_through: bool = False) -> None:
        """Decode steps of up to max_tokens tokens read experts where they lie (experts/zero_copy.py); with
        read_through, a one-token step also writes the experts it reads from host into free slots."""
        from .zero_copy import ZeroCopyDecode
        self.zero_copy = ZeroCopyDecode(self, max_tokens, self.top_k, read_through)
        self.zero_copy_max = max_tokens

    @property
    def n_slots(self) -> int:
        return self.residency.n_slots

    @property
    def min_region(self) -> int:
        """The fewest slots any host layer can use (a decode step's routed experts must fit without waves)."""
        return min(self.residency.region_size(l) for l in self.layers)

    # --- context --------------------------------------------------------------------------------------------
    def begin_prompt(self, seq: int = 0) -> None:
        self.flush_decode()
        self.stats.begin_prompt()
        self.routing.prompts[seq].begin_prompt()

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool) -> None:
        if is_prompt or self.zero_copy is None or n_tokens > self.zero_copy_max:
            self.flush_decode()                 # this ubatch decides on the host: the last zero-copy step first
        self.seq, self.is_prompt, self.n_tokens = seq, is_prompt, n_tokens
        stats = self.routing.prompts[seq]
        self.seed = choose_seed(n_tokens, is_prompt, stats, self.prefetch)
        if is_prompt:
            stats.begin_ubatch(n_tokens)
        self.fill = []
        if self.seed is not None:           # rule 2-4: the first host layer's experts go ahead now, the next
            self._prefetch(self.layers[0], self._predicted(self.layers[0]))      # ones as fill
            self.fill = [(l, self._predicted(l)) for l in self.layers[1:self.prefetch.lookahead_layers]]

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        """How many MoE layers ahead to guess experts through their routers (0: none): one for decode-sized
        ubatches, `lookahead_layers` for prompt ubatches big enough to prefetch (their routed set; the guess is then
        far more specific than earlier prompts' counts)."""
        pf = self.prefetch
        if not (pf.enabled and pf.lookahead) or layer == self.layers[-1]:
            return 0
        if self.zero_copy is not None and n_tokens <= self.zero_copy_max:
            return 0                            # a zero-copy decode step has no host step to copy ahead from
        if self.is_prompt:
            return pf.lookahead_layers if pf.prompt_lookahead and n_tokens >= pf.min_batch else 0
        return 1 if n_tokens <= 8 else 0

    # --- the hot path ---------------------------------------------------------------------------------------
    def fetch(self, layer: int, ids: torch.Tensor, lookahead: tuple | None = None):
        """ids (T, k) routed expert ids -> ExpertWeights, or Waves when the pool cannot hold them all at once.
        lookahead: the guessed ids (T, k) of the next MoE layers, nearest first."""
        self._mark_reads()
        t0 = time.perf_counter()
        E = self.n_experts
        parts = [ids, *(lookahead or ())]
        counts = torch.zeros(len(parts), E, dtype=torch.int64, device=ids.device)
        for row, p in zip(counts, parts):        # routings per expert, on the device: no sort, no big read-back
            row.scatter_add_(0, p.reshape(-1), torch.ones(p.numel(), dtype=torch.int64, device=ids.device))
        got = self._read_back(counts)            # the one host sync of this layer: its routing and the guesses
        t1 = time.perf_counter()
        table = self.prepare(layer, got[0], got[1:] if lookahead else None)
        if isinstance(table, list):
            w = Waves(self, layer, ids, table)
        else:
            w = ExpertWeights(*self.layer_weights(layer), self.upload_table(layer, table)[ids])
        self.stats.record(layer, sync_s=t1 - t0, host_s=time.perf_counter() - t1)
        return w

    def prepare(self, layer: int, counts: np.ndarray, guesses=None):
        """The host's part of one MoE layer, once its routing is on the host as counts per expert (E,): routing
        statistics, counters, uploads of the misses, the compute stream's wait, and the prefetch of what comes
        next (`guesses`: the lookahead's counts per expert (E,) of the next MoE layers, nearest first: the first
        host layer among them is copied once this layer's experts are queued, the others whenever the copy stream
        runs short of work, `_fill`). Returns the layer's slot table (E,) (slot of each expert id within the
        layer's region, -1 if absent), or the groups of experts to run in waves when the pool cannot hold them all
        at once (then nothing is loaded yet)."""
        self._copy_pending()                    # a copy-ahead nobody launched yet goes now (it is still useful)
        wanted = np.flatnonzero(counts).astype(np.int64)
        if self.is_prompt:
            self.routing.prompts[self.seq].record(layer, counts)
        self._score_lookahead(layer, counts, len(wanted))
        groups = self.planner.groups(layer, wanted)
        if len(groups) > 1:
            return groups
        self._load_slots(layer, groups[0])
        if guesses is not None:
            i = self.moe_layers.index(layer)
            ahead = [(l, predicted(g, self.n_experts)) for l, g in zip(self.moe_layers[i + 1:], guesses)
                     if l in self.host_set]
            self.fill = ahead[1:]
            if ahead:
                self.predicted[ahead[0][0]] = ahead[0][1]       # scored when that layer routes
                self.pending = ahead[0]
        elif self.seed is not None and (nxt := self._next_layer(layer)) is not None:
            self.pending = (nxt, self._predicted(nxt))
        return self.table(layer)

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

    def table(self, layer: int) -> np.ndarray:
        """The layer's slot table (E,): each expert's slot within the layer's region (its weights' views), -1 if
        absent."""
        t = self.residency.slot_of[layer].copy()
        t[t >= 0] -= self.views[layer][2]
        return t

    def upload_table(self, layer: int, table: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's slot table (E,) on the device (into `out`, or a new tensor), through pinned staging: a copy
        from pageable memory would wait for the compute stream. Call after this layer's host sync: the staging's
        last copy was queued before it, so it is free again."""
        self.lut_host[layer].numpy()[:] = table
        if out is None:
            out = torch.empty(self.n_experts, dtype=torch.int64, device=self.device.torch)
        return out.copy_(self.lut_host[layer], non_blocking=True)

    def layer_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (S_region, 2I, H) and (S_region, H, I) views of the layer's region, which its table indexes."""
        w13, w2, _ = self.views[layer]
        return w13, w2

    def _load(self, layer: int, ids: torch.Tensor, group: np.ndarray) -> ExpertWeights:
        self._load_slots(layer, group)
        lut = torch.from_numpy(self.table(layer)).to(self.device.torch)        # (E,): a wave reuses no staging
        return ExpertWeights(*self.layer_weights(layer), lut[ids])

    # --- zero-copy decode (experts/zero_copy.py) ---------------------------------------------------------------
    def addresses(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        return self.zero_copy.addresses(layer, ids)

    def landing(self, layer: int, ids: torch.Tensor):
        return self.zero_copy.landing(layer, ids)

    def begin_decode_step(self) -> None:
        self.zero_copy.begin_step()

    def end_decode_step(self, n_tokens: int, on_route=None) -> None:
        self.zero_copy.end_step(n_tokens, on_route)

    def flush_decode(self) -> None:
        if self.zero_copy is not None:
            self.zero_copy.flush()

    def _load_slots(self, layer: int, group: np.ndarray, compute_waits: bool = True, after=None) -> None:
        """Make `group` resident: plan, copy the misses on the copy stream (behind the compute event `after`, if
        given), and (compute_waits) make compute wait for its slots and pin them until it has read them."""
        self._update_pins()
        try:
            plan = self.planner.plan(layer, group)
        except CacheTooSmall:                # pins hold too much: let queued compute finish, then every slot is free
            self.device.synchronize()
            self._update_pins()
            plan = self.planner.plan(layer, group)
        hit_slots = plan.slots[plan.hit]
        used = self.spec_flag[hit_slots]
        victims = np.array([s for _, s in plan.misses], dtype=np.int64)
        wasted = int(self.spec_flag[victims].sum()) if len(victims) else 0
        self.spec_flag[hit_slots] = False
        self.spec_flag[victims] = False
        n_used = int(used.sum())
        if n_used or wasted:
            self.stats.record(layer, prefetch_used=n_used, prefetch_wasted=wasted)
        if plan.misses:
            src = self.store.rows[layer]
            seq = self.queue.submit([(self.pool[s], src[e]) for e, s in plan.misses],
                                    len(plan.misses) * self.store.expert_bytes, speculative=False, after=after)
            self.ready[victims] = seq
        if not compute_waits:
            return
        self._wait_for(layer, int(self.ready[plan.slots].max()))
        self.use[plan.slots] = NOT_YET
        self.handed = plan.slots

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
        nothing to copy."""
        eb = self.store.expert_bytes
        room = (FILL_LOW_BYTES if low is None else low) - self.queue.pending() * eb
        if room < eb:
            return True
        while self.fill:
            layer, experts = self.fill[0]
            missing = experts[self.residency.slot_of[layer, experts] < 0]
            if not len(missing):
                self.fill.pop(0)
                continue
            copied = self._prefetch(layer, missing[:max(1, room // eb)])       # the first ones, in order
            if not copied:                          # no room: the in-flight bound, or every slot is pinned
                self.fill = []
                return False
            self.fill[0] = (layer, missing[copied:])
            self.stats.record(layer, filled=copied)
            return True
        return False

    def _prefetch(self, layer: int, experts: np.ndarray) -> int:
        """Copy ahead the experts of `layer` not resident, in the given order, within the in-flight bound. Returns
        how many it copied."""
        res = self.residency
        experts = experts[res.slot_of[layer, experts] < 0]
        if not len(experts):
            return 0
        room = self.prefetch.max_inflight_mib * (1 << 20) - self.queue.speculative_inflight()
        n = min(len(experts), max(0, room // self.store.expert_bytes))
        self._update_pins()
        n = min(n, int((~res.pinned).sum()) - 1)
        if n <= 0:
            return 0
        experts = experts[:n]
        plan = res.ensure(layer, experts)
        victims = np.array([s for _, s in plan.misses], dtype=np.int64)
        wasted = int(self.spec_flag[victims].sum())
        self.spec_flag[victims] = True
        src = self.store.rows[layer]
        nbytes = len(plan.misses) * self.store.expert_bytes
        seq = self.queue.submit([(self.pool[s], src[e]) for e, s in plan.misses], nbytes, speculative=True)
        self.ready[victims] = seq
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

    def _mark_reads(self) -> None:
        """An event after everything queued so far, which includes the compute that read the last fetch's slots.
        On the CPU that compute has already run: the slots are free at once."""
        if not self.device.is_cuda:
            self.use[self.handed] = 0
            return
        self.use_seq += 1
        ev = torch.cuda.Event()
        ev.record()
        self.use_events[self.use_seq] = ev
        self.use[self.handed] = self.use_seq
        self.handed = np.zeros(0, dtype=np.int64)

    def _update_pins(self) -> None:
        while self.use_done < self.use_seq and self.use_events[self.use_done + 1].query():
            del self.use_events[self.use_done + 1]
            self.use_done += 1
        self.residency.pinned = self.use > self.use_done

    def _wait_for(self, layer: int, seq: int) -> None:
        """The compute stream waits for copy batch `seq` (if still running), timed with a pair of events."""
        if not self.device.is_cuda or seq <= self.queue.poll():
            return
        compute = torch.cuda.current_stream(self.device.torch)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        self.queue.wait(seq, compute)
        after.record(compute)
        self.waits.append((layer, before, after))

    def collect_waits(self) -> None:
        """Turn recorded event pairs into per-layer wait counts (synchronises; call when reading stats)."""
        self.flush_decode()
        if self.waits:
            self.device.synchronize()
            for layer, before, after in self.waits:
                self.stats.record(layer, waits=1, wait_s=before.elapsed_time(after) / 1e3)
            self.waits = []
