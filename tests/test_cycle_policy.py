"""The cycle policy (experts/policy.py `Cycle`): lfru, but a prompt ubatch that routes nearly every expert of each
layer (a sweep, as Qwen3-Next's ubatches of 2048 tokens do) evicts the experts of the layers it has just passed
first, the farthest next use. Its ranking, and the prompt path's uploads over sweeping prompts against lfru's."""
from __future__ import annotations

import numpy as np
import torch

from moestream.device import Device
from moestream.experts.cache import ExpertCache
from moestream.experts.policy import make_policy
from moestream.experts.prefetch import PrefetchConfig
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout


def test_a_sweep_evicts_the_layers_just_passed_latest_first_and_keeps_the_next_ones():
    p = make_policy("cycle", 8, layers=[0, 1, 2, 3])
    slots = np.arange(8)
    layers = np.array([0, 0, 1, 1, 2, 2, 3, 3])             # slot -> its expert's layer
    p.touch(slots)
    p.at_layer(2, sweeping=True)                            # layer 2 now: 1 just passed, then 0, then 3 (next)
    assert list(p.lowest(slots, 8, layers)) == [2, 3, 0, 1, 6, 7, 4, 5]
    assert list(p.lowest(slots, 3, layers)) == [2, 3, 0]
    p.at_layer(2, sweeping=False)                           # not a sweep: lfru's order (ties by slot)
    lfru = make_policy("lfru", 8)
    lfru.touch(slots)
    assert list(p.lowest(slots, 8, layers)) == list(lfru.lowest(slots, 8)) == list(range(8))


def _uploads_per_prompt(policy: str, n_slots: int, prompts: int = 5, L: int = 6, E: int = 8) -> tuple[list, int]:
    """Sweeping prompts through the prompt path on the CPU (every expert of every layer routed, the next two layers
    guessed and copied ahead): experts uploaded a prompt, and copy-ahead evicted unused."""
    store = ExpertStore({l: torch.arange(E, dtype=torch.uint8).repeat_interleave(3).view(E, 3) for l in range(L)},
                        ExpertLayout(1, 1))
    c = ExpertCache(store, n_slots, L, E, Device("cpu"), policy, PrefetchConfig(min_batch=8, lookahead_layers=2),
                    list(range(L)), top_k=2)
    every = np.full(E, 5, dtype=np.int64)                   # routings per expert: all of them
    out = []
    for _ in range(prompts):
        c.begin_prompt(0)
        c.begin_ubatch(0, 64, True)
        for layer in range(L):
            c.slots.mark_reads()                            # (the layer before computed)
            c.prepare(layer, every, [every] * min(2, L - 1 - layer) or None)
            c.experts_launched(layer)
        out.append(sum(s.uploaded_bytes for s in c.stats.prompt.values()) // store.expert_bytes)
    return out, c.stats.summary(c.stats.total)["prefetch_wasted"]


def test_sweeping_prompts_upload_fewer_experts_under_cycle_than_lfru():
    """48 experts a prompt, a pool of 30 (24 while three layers are held): lfru evicts the next layers' experts
    (copied ahead, or kept from the last prompt) before the layers just passed, and copies some twice a prompt."""
    lfru, lfru_wasted = _uploads_per_prompt("lfru", 30)
    cycle, cycle_wasted = _uploads_per_prompt("cycle", 30)
    assert all(c <= 48 for c in cycle) and cycle_wasted == 0
    assert sum(cycle[1:]) < sum(lfru[1:]) and lfru_wasted > 0, (cycle, lfru)
    assert max(cycle[1:]) <= 0.8 * 48                       # a fifth or more kept across prompts


def _decode_set_after_sweeps(policy: str, L: int = 4, E: int = 8, n_slots: int = 16) -> int:
    """Decode uses experts 0 and 1 of every layer for a while; then three prompts sweep every expert of every layer,
    layer by layer: how many of the decode set's 2 * L experts are still resident."""
    from moestream.experts.residency import Residency
    res = Residency(n_slots, L, E, make_policy(policy, n_slots, list(range(L))))
    hot = np.array([0, 1])
    for _ in range(50):
        res.policy.tick()
        for layer in range(L):
            res.policy.at_layer(layer, sweeping=False)
            res.ensure(layer, hot)
    for _ in range(3):
        res.policy.tick()
        for layer in range(L):
            res.policy.at_layer(layer, sweeping=True)
            res.ensure(layer, np.arange(E))
    return int((res.slot_of[:, hot] >= 0).sum())


def test_sweeps_keep_the_decode_set_under_cycle_as_under_lfru():
    """A sweep evicts the layer it has just passed, but within that layer lfru's order: the experts decode used
    often stay, the sweep's own (used once) go. So a server's prompt does not flush the streams' decode set where
    the pool holds it beside a layer's sweep; lru flushes it."""
    assert _decode_set_after_sweeps("cycle") == _decode_set_after_sweeps("lfru") == 8
    assert _decode_set_after_sweeps("lru") < 8
