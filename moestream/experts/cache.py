"""The GPU expert cache: a pool of expert slots under --moe-cache-mib, filled from the host store.

    cache = ExpertCache(store, n_slots=1702, n_layers=24, n_experts=128, device=dev, policy="lfru")
    cache.begin_ubatch(seq=0, n_tokens=4096, is_prompt=True)     # the engine, before each forward
    w = cache.fetch(layer, ids)          # uploads the misses on the copy stream; compute waits only for its slots
    y = kernel(x, w.slots, w.w13, w.w2); cache.experts_launched(layer)   # then the next layer's copies go ahead

The cache is the expert provider the engine sees, made of four parts:

    planner    (planner.py)    residency, policy and counters: the decisions, with no device
    slots      (slots.py)      the slot pool: the device tensor, copies, ready batches, pins, slot tables
    prompt     (prompt.py)     the prompt path: fetch, waves, prefetch, lookahead, fill
    zero_copy  (zero_copy.py)  zero-copy decode, when enabled: steps read experts where they lie

The prompt path and zero-copy decode are peers over the pool and the planner: each works through their public
methods, never through the other's state. This class only says which of the two a ubatch takes.
"""
from __future__ import annotations

import torch

from .planner import CachePlanner
from .prefetch import PrefetchConfig
from .prompt import PromptPath
from .provider import HostProvider
from .routing import RoutingStore
from .slots import SlotPool
from .store import ExpertStore

MiB = 1 << 20


class ExpertCache(HostProvider):
    def __init__(self, store: ExpertStore, n_slots: int, n_layers: int, n_experts: int, device, policy: str = "lfru",
                 prefetch: PrefetchConfig = PrefetchConfig(), host_layers: list[int] | None = None, n_seq: int = 1,
                 top_k: int = 8, moe_layers: list[int] | None = None, routing: RoutingStore | None = None):
        self.store, self.n_experts, self.device, self.prefetch = store, n_experts, device, prefetch
        self.layers = sorted(host_layers if host_layers is not None else store.rows)
        self.moe_layers = list(moe_layers) if moe_layers is not None else self.layers    # lookahead guesses' order
        self.planner = CachePlanner(n_slots, n_layers, n_experts, policy, store.expert_bytes, self.layers,
                                    {l: store.layer_bytes(l) for l in store.rows})
        self.residency, self.stats, self.policy_name = self.planner.residency, self.planner.stats, policy
        self.slots = SlotPool(store, self.residency, device)
        # Per context, the prompts' routing that seeds prefetch (routing.prompts[seq]): the engine's store, or its own.
        self.routing = routing if routing is not None else RoutingStore(n_layers, n_experts, n_seq)
        self.prompt = PromptPath(store, self.slots, self.planner, self.layers, self.moe_layers, prefetch,
                                 self.routing, top_k, device)
        self.top_k = top_k
        self.zero_copy = None                                   # ZeroCopyDecode, when decode reads in place

    def use_plan(self, plan) -> None:
        """Zero-copy decode over the pool where the plan (runtime/plan.py) says decode reads experts in place."""
        if plan.zero_copy:
            self.enable_zero_copy(plan.max_tokens, plan.lands, reads_once=plan.reads_once, staged=plan.staged)

    def enable_zero_copy(self, max_tokens: int, read_through: bool = False, reads_once: bool = True,
                         staged: bool = False) -> None:
        """Decode steps of up to max_tokens tokens read experts where they lie (experts/zero_copy.py); with
        read_through, a step also writes the experts it reads from host into free slots. reads_once: a
        several-token step's kernel reads each routed expert once (the bf16 kernel, or any kernel when staged;
        the quantized one unstaged reads it once per token that chose it). staged: a step copies its host reads
        to the device first (kernels/stage.py)."""
        from .zero_copy import ZeroCopyDecode
        self.zero_copy = ZeroCopyDecode(self.slots, self.planner, self.store, self.layers, max_tokens, self.top_k,
                                        read_through, reads_once, staged, self.routing)

    @property
    def pool(self):
        """The slot pool's device tensor (S, numel)."""
        return self.slots.pool

    @property
    def n_slots(self) -> int:
        return self.residency.n_slots

    def _in_place(self, n_tokens: int) -> bool:
        """Whether a decode step of n_tokens reads its experts in place (zero-copy) instead of fetching them."""
        return self.zero_copy is not None and n_tokens <= self.zero_copy.max_tokens

    # --- context --------------------------------------------------------------------------------------------
    def begin_prompt(self, seq: int = 0) -> None:
        self.flush_decode()
        if self.zero_copy is not None:
            self.zero_copy.begin_prompt(seq)
        self.stats.begin_prompt()
        self.routing.prompts[seq].begin_prompt()

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        if is_prompt or not self._in_place(n_tokens):
            self.flush_decode()                 # this ubatch decides on the host: the last zero-copy step first
        self.prompt.begin_ubatch(seq, n_tokens, is_prompt, seqs)

    def suspend(self):
        """A prompt ubatch pauses between layers (Engine.prompt_steps): the prompt path's state, which the decode
        steps in between reset. Over the pool the two are peers as between any prompt and decode step: slots a
        forward reads are pinned until it has read them, and a zero-copy table points only at landed copies."""
        return self.prompt.save()

    def resume(self, state) -> None:
        self.flush_decode()                     # as begin_ubatch: the prompt decides on the host, after the steps
        self.prompt.restore(state)

    @property
    def takes_seeds(self) -> bool:
        return self.prefetch.enabled

    def seed_next(self, counts) -> None:
        self.prompt.hint = counts

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        if self._in_place(n_tokens):
            return 0                            # a zero-copy decode step has no host step to copy ahead from
        return self.prompt.lookahead_layers(layer, n_tokens)

    # --- the prompt path (experts/prompt.py) ----------------------------------------------------------------
    def fetch(self, layer: int, ids, lookahead: tuple | None = None):
        return self.prompt.fetch(layer, ids, lookahead)

    def prepare(self, layer: int, counts, guesses=None):
        return self.prompt.prepare(layer, counts, guesses)

    def experts_launched(self, layer: int) -> None:
        self.prompt.experts_launched(layer)

    # --- zero-copy decode (experts/zero_copy.py) ---------------------------------------------------------------
    def address_table(self, layer: int):
        return self.zero_copy.address_table(layer)

    def layout(self, layer: int):
        return self.store.layouts[layer]

    def landing(self, layer: int, ids):
        return self.zero_copy.landing(layer, ids)

    def device_rows(self) -> list[torch.Tensor]:
        z = self.zero_copy
        return [self.pool] + ([z.scratch] if z is not None and z.scratch is not None else [])

    def begin_decode_step(self, seqs: list[int] | None = None) -> None:
        self.zero_copy.begin_step(seqs)

    def end_decode_step(self, n_tokens: int, observer=None) -> None:
        self.zero_copy.end_step(n_tokens, observer, noted=True)

    def decode_step_ops(self):
        zc = self.zero_copy
        return None if zc is None else (zc.apply_landings, zc.note_landings, zc.kept)

    def flush_decode(self) -> None:
        if self.zero_copy is not None:
            self.zero_copy.flush()

    def collect_waits(self) -> None:
        """Turn the compute stream's recorded waits into per-layer counts (synchronises; call when reading stats)."""
        self.flush_decode()
        self.slots.collect_waits(self.stats)

    # --- what the engine reports ---------------------------------------------------------------------------------
    BUFFER = False              # the upload buffer kept as the smallest cache (buffered.py), not --moe-cache-mib

    def counters(self):
        self.collect_waits()
        return self.stats

    def cache_info(self) -> dict:
        return {"slots": self.n_slots, "policy": self.policy_name, "mib": self.n_slots * self.store.expert_bytes / MiB,
                "buffer": self.BUFFER}

    def pinned_slots(self) -> int:
        """Call it between forwards, on the thread that owns the engine: the compute that read the last forward's
        slots is queued by then, so its reads are marked first (the next forward would do so before planning
        anything) and only pins that outlive their compute count. At rest it is 0."""
        self.slots.mark_reads()
        self.slots.refresh_pins()
        return int(self.residency.pinned.sum())
