"""The GPU expert cache: a pool of expert slots under --moe-cache-mib, filled from the host store on misses.

    cache = ExpertCache(store, n_slots=1702, layers=[0..23], n_experts=128, device="cuda", policy="lfru")
    w = cache.fetch(layer, ids)        # uploads only the misses; w.slots index the pool

Compute reads weights from the pool by slot index (no staging copy). When a ubatch routes more experts in one layer
than the pool has slots, `fetch` returns Waves: groups of experts that fit, uploaded one group at a time, each
group's compute queued before the next group's uploads overwrite slots.
"""
from __future__ import annotations

import logging
import numpy as np
import torch

from .policy import make_policy
from .provider import ExpertWeights
from .residency import Residency
from .stats import CacheStats, Counts
from .store import ExpertStore, expert_views

log = logging.getLogger("moestream")

class CachePlanner:
    """The decisions of the cache, with no device: the policy's clock, residency, the counters, waves.

    The live cache and the offline trace replay both run this, so a replay predicts the live counts exactly.
    """

    def __init__(self, n_slots: int, n_layers: int, n_experts: int, policy: str, expert_bytes: int):
        self.residency = Residency(n_slots, n_layers, n_experts, make_policy(policy, n_slots))
        self.stats = CacheStats()
        self.policy_name, self.expert_bytes = policy, expert_bytes
        self._last_layer = None

    def groups(self, layer: int, wanted: np.ndarray) -> list[np.ndarray]:
        """The ubatch's routed experts of `layer` (distinct): one group, or waves when they can't all fit."""
        if self._last_layer is None or layer <= self._last_layer:
            self.residency.policy.tick()                # a new ubatch: the policy's clock counts ubatches
        self._last_layer = layer
        n = self.residency.n_slots
        return [wanted] if len(wanted) <= n else [wanted[i:i + n] for i in range(0, len(wanted), n)]

    def plan(self, layer: int, group: np.ndarray):
        plan = self.residency.ensure(layer, group)
        m = len(plan.misses)
        self.stats.record(layer, Counts(hits=len(group) - m, misses=m, evictions=len(plan.evicted),
                                        uploaded_bytes=m * self.expert_bytes, copies=m))
        return plan


class Waves:
    """A layer's routed experts in groups that fit the pool; iterating uploads each group just before its use."""

    def __init__(self, cache: "ExpertCache", layer: int, ids: torch.Tensor, groups: list[np.ndarray]):
        self.cache, self.layer, self.ids, self.groups = cache, layer, ids, groups

    def __iter__(self):
        for g in self.groups:
            w = self.cache._load(self.layer, self.ids, g)
            member = torch.zeros(self.cache.n_experts, dtype=torch.bool)
            member[torch.from_numpy(g)] = True
            yield w, member.to(self.ids.device)[self.ids]          # (T, k): choices this wave computes


class ExpertCache:
    def __init__(self, store: ExpertStore, n_slots: int, n_layers: int, n_experts: int, device: torch.device,
                 policy: str = "lfru"):
        any_rows = next(iter(store.rows.values()))
        self.store, self.n_experts, self.device = store, n_experts, device
        self.pool = torch.empty(n_slots, any_rows.shape[1], dtype=any_rows.dtype, device=device)   # (S, numel)
        self.w13, self.w2 = expert_views(self.pool, store.inter, store.hidden)
        self.planner = CachePlanner(n_slots, n_layers, n_experts, policy, store.expert_bytes)
        self.residency, self.stats, self.policy_name = self.planner.residency, self.planner.stats, policy

    @property
    def n_slots(self) -> int:
        return self.residency.n_slots

    def fetch(self, layer: int, ids: torch.Tensor):
        """ids (T, k) routed expert ids -> ExpertWeights, or Waves when the pool cannot hold them all at once."""
        wanted = torch.unique(ids).cpu().numpy()        # host sync: the copies are chosen on the host
        groups = self.planner.groups(layer, wanted)
        if len(groups) == 1:
            return self._load(layer, ids, groups[0])
        return Waves(self, layer, ids, groups)

    def _load(self, layer: int, ids: torch.Tensor, group: np.ndarray) -> ExpertWeights:
        plan = self.planner.plan(layer, group)
        src = self.store.rows[layer]
        for e, s in plan.misses:                        # each miss once: one contiguous copy per expert
            self.pool[s].copy_(src[e], non_blocking=True)
        lut = torch.from_numpy(self.residency.slot_of[layer]).to(self.device, non_blocking=False)   # (E,)
        return ExpertWeights(self.w13, self.w2, lut[ids])
