"""The cache's decisions with no device: the policy's clock, residency, counters and waves.

    planner = CachePlanner(n_slots=1702, n_layers=24, n_experts=128, policy="lfru", expert_bytes=9437184)
    for group in planner.groups(layer, wanted):      # one group, or waves when they can't all fit
        plan = planner.plan(layer, group)            # hits, the misses to copy and their slots, evictions

The live cache (cache.py) and the offline trace replay (trace.py) both run this, so a replay predicts the live
demand counts.
"""
from __future__ import annotations

import numpy as np

from .policy import make_policy
from .residency import Residency
from .stats import CacheStats

# The pool is one region of any size: a float layer whose slots span more than one grouped GEMM launch reads a
# window or a compact stack of them (ExpertWeights.dense), quantized rows a compact dequantized stack. (Regions of at
# most one launch each were measured and removed at stop 47: bench/RESULTS.md, stops 27 and 36.)
SWEEP_SHARE = 0.9                         # a ubatch that routes this share of a layer's experts sweeps the layer


class CachePlanner:
    """Residency under one policy, with its counters; `groups` splits a layer into waves where it must."""

    def __init__(self, n_slots: int, n_layers: int, n_experts: int, policy: str, expert_bytes: int,
                 layers: list[int] | None = None, layer_bytes: dict[int, int] | None = None):
        layers = layers if layers is not None else list(range(n_layers))
        self.residency = Residency(n_slots, n_layers, n_experts, make_policy(policy, n_slots, layers))
        self.stats = CacheStats()
        self.policy_name, self.expert_bytes = policy, expert_bytes
        self.layer_bytes = layer_bytes or {}            # a layer's expert bytes where they differ from expert_bytes
        self._last_layer = None

    def see(self, layer: int, n_wanted: int) -> None:
        """The policy learns that the ubatch's routing of `layer` (n_wanted distinct experts) is planned now: its
        clock counts ubatches, and a sweep of the layer orders the victims (policy.at_layer)."""
        if self._last_layer is None or layer <= self._last_layer:
            self.residency.policy.tick()                # a new ubatch
        self._last_layer = layer
        self.residency.policy.at_layer(layer, n_wanted >= SWEEP_SHARE * self.residency.slot_of.shape[1])

    def groups(self, layer: int, wanted: np.ndarray) -> list[np.ndarray]:
        """The ubatch's routed experts of `layer` (distinct): one group, or waves when they can't all fit. Waves take
        the resident experts first (no later wave's uploads evict them) and half the pool each, so that a wave's
        uploads land in slots the wave before it does not read and cross the link while it computes."""
        self.see(layer, len(wanted))
        n = self.residency.n_slots
        if len(wanted) <= n:
            return [wanted]
        hit = self.residency.slot_of[layer, wanted] >= 0
        order, size = np.concatenate([wanted[hit], wanted[~hit]]), max(1, n // 2)
        return [order[i:i + size] for i in range(0, len(order), size)]

    def plan(self, layer: int, group: np.ndarray, read_misses: int | None = None):
        """Make the group resident; count its hits, misses and uploads. read_misses: where the group was read
        already (a zero-copy decode step), how many it read from host memory, the misses it counts (a miss the
        step landed in a slot is resident now, and uploads nothing)."""
        plan = self.residency.ensure(layer, group)
        m = len(plan.misses)
        missed = m if read_misses is None else read_misses
        self.stats.record(layer, hits=len(group) - missed, misses=missed, evictions=len(plan.evicted),
                          uploaded_bytes=m * self.layer_bytes.get(layer, self.expert_bytes), copies=m)
        return plan
