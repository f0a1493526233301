"""The fill around the ring (MOESTREAM_FILL_AHEAD=ring): while a prompt ubatch sweeps (routes nearly every expert of
each layer, as Qwen3-Next's do), the copy stream's spare time goes on to every later host layer and then to the next
ubatch's first layers, and such a copy evicts only experts whose next use in the ring is farther than its own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.device import Device
from moestream.experts import prompt as prompt_mod
from moestream.experts.cache import ExpertCache
from moestream.experts.prefetch import PrefetchConfig
from moestream.experts.prompt import PromptPath
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout

L, E = 6, 8
EVERY = np.full(E, 5, dtype=np.int64)                       # a sweep: every expert routed


@pytest.fixture
def ring(monkeypatch):
    monkeypatch.setattr(prompt_mod, "FILL_AHEAD", "ring")


def _cache(n_slots: int, policy: str = "cycle") -> ExpertCache:
    store = ExpertStore({l: torch.arange(E, dtype=torch.uint8).repeat_interleave(3).view(E, 3) for l in range(L)},
                        ExpertLayout(1, 1))
    return ExpertCache(store, n_slots, L, E, Device("cpu"), policy, PrefetchConfig(min_batch=8, lookahead_layers=2),
                       list(range(L)), top_k=2)


def _prompt(c: ExpertCache, each=None) -> None:
    """One sweeping prompt ubatch through the prompt path, as the forward calls it; each(layer) after a layer's
    prepare."""
    c.begin_prompt(0)
    c.begin_ubatch(0, 64, True)
    for layer in range(L):
        c.slots.mark_reads()                                # (the layer before computed)
        c.prepare(layer, EVERY, [EVERY] * min(2, L - 1 - layer) or None)
        if each:
            each(layer)
        c.experts_launched(layer)


def test_a_sweep_fills_every_later_layer_after_the_lookahead_s_and_wraps_to_the_next_ubatch(ring):
    c = _cache(30)
    _prompt(c)                                              # the first prompt: no seed for the later layers yet
    fills = {}
    _prompt(c, lambda layer: fills.setdefault(layer, [l for l, _ in c.prompt.fill]))
    assert fills[0] == [1, 2, 3, 4, 5]                      # the lookahead's two, then the seed's
    assert fills[2][:2] == [3, 4] and fills[2][-1] == 5
    assert fills[L - 1][-L + 1:] == [0, 1, 2, 3, 4]        # the last layer: the next ubatch's, first to last


def test_without_a_sweep_or_under_another_policy_the_fill_stays_within_the_lookahead(ring):
    for policy, counts in (("cycle", np.array([5, 3, 0, 0, 0, 0, 0, 1])), ("lfru", EVERY)):
        c = _cache(30, policy)
        for _ in range(2):
            c.begin_prompt(0)
            c.begin_ubatch(0, 64, True)
            c.slots.mark_reads()
            c.prepare(0, counts, [counts, counts])
        assert [l for l, _ in c.prompt.fill] == [1, 2], policy


@pytest.mark.parametrize("n_slots", [32, 40, 44])
def test_a_ring_copy_evicts_only_experts_used_after_its_own(ring, n_slots):
    c = _cache(n_slots)
    path, H = c.prompt, L
    seen = []
    prefetch, evict = path._prefetch, c.residency.evict

    def watched_prefetch(layer, experts, room=None):
        d = (layer - path.at) % H
        if d > path.prefetch.lookahead_layers:              # a ring copy
            def watched_evict(slots):
                gone = evict(slots)
                seen.extend((d, (gl - path.at) % H) for gl, _ in gone)
                return gone
            c.residency.evict = watched_evict
            try:
                return prefetch(layer, experts, room)
            finally:
                c.residency.evict = evict
        return prefetch(layer, experts, room)

    path._prefetch = watched_prefetch
    for _ in range(4):
        _prompt(c)
    assert seen, "no ring copy evicted anything: the case tests nothing"
    assert all(far > d for d, far in seen), seen


def test_steady_sweeps_upload_no_more_with_the_ring_than_without(monkeypatch):
    """Once the first prompt has seeded the guesses: the ring moves the copies earlier, not more of them."""
    def uploads(mode):
        monkeypatch.setattr(prompt_mod, "FILL_AHEAD", mode)
        c = _cache(30)
        out = []
        for _ in range(5):
            before = c.stats.summary(c.stats.total)["uploaded_bytes"]
            _prompt(c)
            out.append(c.stats.summary(c.stats.total)["uploaded_bytes"] - before)
        return out
    ring, plain = uploads("ring"), uploads("lookahead")
    assert ring[2:] == plain[2:] and sum(ring[1:]) <= sum(plain[1:]), (ring, plain)


@pytest.mark.parametrize("mib", [16, 20])
def test_the_ring_changes_no_logits(ring, monkeypatch, mib):
    """synth:tiny's four layers, one guessed ahead: the ring copies the two after it (sizes where it finds room)."""
    rooms = []
    farther = PromptPath._farther
    monkeypatch.setattr(PromptPath, "_farther", lambda self, layer: rooms.append(farther(self, layer)) or rooms[-1])
    kw = dict(ubatch_size=64, ctx_size=512, device="cpu", cpu_moe=True, moe_cache_mib=mib, prefetch_min_batch=8)
    off = LLM("synth:tiny", prefetch=False, **kw)
    on = LLM("synth:tiny", lookahead_layers=1, **kw)
    g = torch.Generator().manual_seed(0)
    for s in range(3):
        ids = torch.randint(0, 1000, (200,), generator=g).tolist()
        assert torch.equal(on.logits(ids), off.logits(ids)), (mib, s)
    assert any(r > 0 for r in rooms), rooms                 # ring copies had room: the case tests the ring
