"""Residency: which (layer, expert) sits in which slot of the GPU pool. Host-side, numpy, no device.

    res = Residency(n_slots=1700, n_layers=24, n_experts=128, policy=make_policy("lfru", 1700))
    plan = res.ensure(layer=3, experts=np.array([5, 9, 17]))
    plan.slots        # the slot of each asked expert
    plan.misses       # [(expert, slot)] to upload now
    plan.evicted      # [(layer, expert)] that lost their slot

Invariants (tested directly, without a model):
- `slot_of[l, e] == s` if and only if `owner[s] == (l, e)`: the map always points at its expert's slot, and no expert
  is in two slots.
- A pinned slot is never a victim. An `ensure` pins, for its own duration, every slot it returns, so one call
  never evicts an expert it is about to hand out.
- `ensure` asks for at most one upload per expert: a hit uploads nothing.
- The pool is one region: an expert of any host layer may take any slot (regions of at most one grouped GEMM
  launch each were measured and removed at stop 47: bench/RESULTS.md, stops 27 and 36).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class CacheTooSmall(Exception):
    """More experts asked for at once than there are unpinned slots: the caller runs the layer in waves."""


@dataclass
class Plan:
    slots: np.ndarray                                   # (n,) slot of each asked expert
    hit: np.ndarray | None = None                       # (n,) bool: it was resident already
    misses: list[tuple[int, int]] = field(default_factory=list)     # (expert, slot): copy these
    evicted: list[tuple[int, int]] = field(default_factory=list)    # (layer, expert) no longer resident


class Residency:
    def __init__(self, n_slots: int, n_layers: int, n_experts: int, policy):
        self.n_slots = n_slots
        self.slot_of = np.full((n_layers, n_experts), -1, dtype=np.int64)     # (L, E): slot or -1
        self.owner = np.full((n_slots, 2), -1, dtype=np.int64)                # (S, 2): (layer, expert) or -1
        self.pinned = np.zeros(n_slots, dtype=bool)                           # read by queued compute
        self.policy = policy

    def resident(self, layer: int) -> np.ndarray:
        return np.flatnonzero(self.slot_of[layer] >= 0)

    def ensure(self, layer: int, experts: np.ndarray) -> Plan:
        """Make every expert in `experts` (distinct ids) resident in `layer`; CacheTooSmall if they cannot all be."""
        experts = np.asarray(experts, dtype=np.int64)
        slots = self.slot_of[layer, experts]
        hit = slots >= 0
        plan = Plan(slots, hit)
        if not hit.all():
            need = experts[~hit]
            busy = self.pinned.copy()
            busy[slots[hit]] = True                     # this call's hits are handed out: not victims
            free = np.flatnonzero(~busy)
            if len(free) < len(need):
                raise CacheTooSmall(f"{len(need)} misses but {len(free)} unpinned slots")
            owned = self.owner[free, 0] >= 0
            victims = free[~owned][:len(need)]                  # empty slots first
            if len(victims) < len(need):
                cand = free[owned]
                taken = self.policy.lowest(cand, len(need) - len(victims), self.owner[cand, 0])
                plan.evicted = self.evict(taken)
                # in slot order: ascending experts then fill runs of consecutive slots, each run one copy
                victims = np.sort(np.concatenate([victims, taken]))
            self.policy.forget(victims)
            self.owner[victims, 0] = layer
            self.owner[victims, 1] = need
            self.slot_of[layer, need] = victims
            slots[~hit] = victims
            plan.misses = list(zip(need.tolist(), victims.tolist()))
        self.policy.touch(slots)
        return plan

    def place(self, layers: np.ndarray, experts: np.ndarray, slots: np.ndarray) -> None:
        """Make empty slots hold these experts (their bytes were put there already): one (layer, expert, slot) per
        index, distinct experts and slots."""
        assert (self.owner[slots, 0] < 0).all() and (self.slot_of[layers, experts] < 0).all(), \
            (layers, experts, slots)
        self.owner[slots, 0], self.owner[slots, 1] = layers, experts
        self.slot_of[layers, experts] = slots
        self.policy.touch(slots)

    def evict(self, slots: np.ndarray) -> list[tuple[int, int]]:
        """Empty these slots (owned, unpinned): the (layer, expert) pairs that lost their slot."""
        le = self.owner[slots]                                              # (n, 2): layer, expert
        self.slot_of[le[:, 0], le[:, 1]] = -1
        gone = list(zip(*le.T.tolist()))
        self.owner[slots] = -1
        self.policy.forget(slots)
        return gone

    def check(self) -> None:
        """Assert the invariants (for tests)."""
        ls, es = np.nonzero(self.slot_of >= 0)
        s = self.slot_of[ls, es]
        assert len(np.unique(s)) == len(s), "a slot holds two experts"
        assert (self.owner[s, 0] == ls).all() and (self.owner[s, 1] == es).all(), "map and owner disagree"
        used = self.owner[:, 0] >= 0
        assert used.sum() == len(s), "an owned slot is not in the map"
