"""The slot pool's invariants (experts/slots.py), without a model: a few layers of one-byte-a-value expert rows on
the CPU device, the planner deciding, and a copy queue that lags as the GPU's does."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.device import Device
from moestream.experts.planner import CachePlanner
from moestream.experts.residency import CacheTooSmall
from moestream.experts.slots import NOT_YET, SlotPool
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout

L, E = 2, 8


def _pool(n_slots=4):
    """Each expert's row holds its own number (layer * E + expert) in every byte, so a slot shows whose bytes it
    holds."""
    rows = {l: (l * E + torch.arange(E, dtype=torch.uint8)).repeat_interleave(3).view(E, 3) for l in range(L)}
    store = ExpertStore(rows, ExpertLayout(1, 1))
    planner = CachePlanner(n_slots, L, E, "lfru", store.expert_bytes)
    return store, planner, SlotPool(store, planner.residency, Device("cpu"))


def _load(store, planner, slots, layer, experts, speculative=False):
    """What the prompt path does for a group: plan, copy the misses, hand the slots to compute."""
    slots.refresh_pins()
    plan = planner.plan(layer, np.array(experts, dtype=np.int64))
    if plan.misses:
        slots.submit([(s, store.rows[layer][e]) for e, s in plan.misses], speculative)
    slots.hand_out(layer, plan.slots)
    return plan


class Lagging:
    """A copy queue whose batches land only when told to, as copies still on the GPU's copy stream."""

    def __init__(self):
        self.seq = self.done = 0
        self.held = []

    def submit(self, pairs, speculative, after=None):
        self.seq += 1
        self.held.append((self.seq, list(pairs)))
        return self.seq

    def land(self):
        for seq, pairs in self.held:
            for dst, src in pairs:
                dst.copy_(src)
            self.done = seq
        self.held = []

    def poll(self):
        return self.done


def test_a_pinned_slot_is_never_a_victim():
    store, planner, slots = _pool(n_slots=4)
    plan = _load(store, planner, slots, 0, [1, 2])
    assert (slots.use[plan.slots] == NOT_YET).all()           # handed out: their reader has no event yet
    slots.refresh_pins()
    assert slots.residency.pinned[plan.slots].all()
    with pytest.raises(CacheTooSmall):                          # three misses, two unpinned slots
        planner.plan(1, np.array([5, 6, 7]))
    other = planner.plan(1, np.array([5, 6]))                  # the two others
    assert set(other.slots.tolist()).isdisjoint(plan.slots.tolist()) and not other.evicted
    with pytest.raises(CacheTooSmall):
        planner.plan(1, np.array([5, 6, 7]))                    # 5 and 6 are hits it hands out: no victim for 7
    assert [tuple(planner.residency.owner[s]) for s in plan.slots] == [(0, 1), (0, 2)]
    slots.mark_reads()                                          # the reading compute is queued (on the CPU: has run)
    slots.refresh_pins()
    assert not slots.residency.pinned.any()
    again = planner.plan(1, np.array([5, 6, 7]))                # now one of the first group's slots may go
    assert len(again.evicted) == 1 and again.evicted[0][0] == 0
    planner.residency.check()


def test_pin_holds_until_the_next_refresh():
    store, planner, slots = _pool(n_slots=2)
    _load(store, planner, slots, 0, [1, 2])
    slots.mark_reads()
    slots.refresh_pins()
    slots.pin(np.array([0, 1]))                                 # a decode step in flight writes them
    with pytest.raises(CacheTooSmall):
        planner.plan(0, np.array([3]))
    slots.refresh_pins()
    planner.plan(0, np.array([3]))


def test_ready_is_the_batch_that_filled_each_slot_and_landed_follows_the_queue():
    store, planner, slots = _pool(n_slots=4)
    slots.queue = Lagging()
    first = _load(store, planner, slots, 0, [1, 2])
    assert (slots.ready[first.slots] == 1).all() and not slots.landed(first.slots).any()
    slots.queue.land()
    assert slots.landed(first.slots).all() and slots.landed().all()
    second = _load(store, planner, slots, 1, [3])
    assert slots.ready[second.slots[0]] == 2 and not slots.landed(second.slots).any()
    assert slots.landed(first.slots).all()                      # an earlier batch stays landed
    slots.written(int(second.slots[0]))                         # compute wrote it in place (read-through)
    assert slots.landed(second.slots).all()


def test_a_table_points_only_at_landed_slots_holding_their_expert():
    """After the copies land, the table of each layer indexes its weights' views at the slot holding each expert's
    own bytes, and -1 where an expert is absent; the uploaded table is the same."""
    store, planner, slots = _pool(n_slots=6)
    slots.queue = Lagging()
    _load(store, planner, slots, 0, [1, 4, 6])
    _load(store, planner, slots, 1, [0, 4])
    slots.queue.land()
    for layer, held in ((0, {1, 4, 6}), (1, {0, 4})):
        table = slots.table(layer)
        assert set(np.flatnonzero(table >= 0).tolist()) == held
        assert torch.equal(slots.upload_table(layer, table), torch.from_numpy(table))
        w13, w2 = slots.layer_weights(layer)
        assert slots.landed(table[table >= 0]).all()
        for e in held:
            assert int(w13[table[e]].flatten()[0]) == int(w2[table[e]].flatten()[0]) == layer * E + e


def test_speculative_copies_are_claimed_once():
    store, planner, slots = _pool(n_slots=4)
    plan = _load(store, planner, slots, 0, [1, 2], speculative=True)
    assert slots.prefetched[plan.slots].all()
    assert slots.claim(plan.slots[:1]) == 1 and slots.claim(plan.slots) == 1 and slots.claim(plan.slots) == 0
    _load(store, planner, slots, 0, [3])                        # a demand copy marks nothing
    assert not slots.prefetched.any()


def test_copy_experts_copies_runs_of_consecutive_experts_and_slots_at_once():
    """copy_experts gives each slot its expert's bytes, as one copy per run of consecutive experts into
    consecutive slots (and per row where the layer's rows are narrower than the pool's, each run still one copy)."""
    rows = {0: torch.arange(10 * 4, dtype=torch.uint8).view(10, 4),          # layer 0: rows as wide as the pool
            1: 100 + torch.arange(10 * 3, dtype=torch.uint8).view(10, 3)}   # layer 1: narrower
    store = ExpertStore(rows, ExpertLayout(1, 1))
    planner = CachePlanner(12, 2, 10, "lfru", store.expert_bytes)
    slots = SlotPool(store, planner.residency, Device("cpu"))
    calls = []
    submit = slots.queue.submit
    slots.queue.submit = lambda pairs, *a, **kw: calls.append(len(pairs)) or submit(pairs, *a, **kw)
    misses = [(2, 0), (3, 1), (4, 2), (7, 5), (9, 6), (8, 9), (5, 10)]     # runs: 2-4 -> 0-2; 7; 9; 8; 5
    for layer in (0, 1):
        slots.copy_experts(layer, misses, speculative=False)
        w = rows[layer].shape[1]
        for e, s in misses:
            assert torch.equal(slots.pool[s, :w], rows[layer][e]), (layer, e, s)
    assert calls == [5, 5]
