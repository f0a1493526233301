"""Copying further ahead while the host waits: the lookahead's guesses for the layers after the next one are copied
(`fill`) whenever the copy stream is about to run dry, and doing so changes no output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.config import ModelConfig
from moestream.device import Device
from moestream.experts import prompt as prompt_mod
from moestream.experts.cache import ExpertCache
from moestream.experts.prompt import PromptPath
from moestream.experts.prefetch import PrefetchConfig
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout
from moestream.models.moe import moe_route


def _cache(n_slots=12, layers=(0, 1, 2, 3), moe_layers=None, lookahead_layers=2, max_inflight_mib=512):
    """Four layers of 8 one-byte experts (the cache's decisions do not depend on the bytes), no device."""
    store = ExpertStore({l: torch.arange(8, dtype=torch.uint8).repeat_interleave(3).view(8, 3) for l in layers}, ExpertLayout(1, 1))
    pf = PrefetchConfig(min_batch=8, lookahead_layers=lookahead_layers, max_inflight_mib=max_inflight_mib)
    c = ExpertCache(store, n_slots, 4, 8, Device("cpu"), "lfru", pf, list(layers), top_k=2, moe_layers=moe_layers)
    c.begin_prompt(0)
    c.begin_ubatch(0, 64, True)
    return c


def _counts(**by_expert):
    c = np.zeros(8, dtype=np.int64)
    for e, n in by_expert.items():
        c[int(e[1:])] = n
    return c


def test_the_next_layer_s_guess_goes_at_once_and_the_one_after_it_waits_for_the_fill():
    c = _cache()
    c.prepare(0, _counts(e0=5, e1=3), [_counts(e2=1, e3=4), _counts(e4=2, e5=6, e6=1)])
    assert c.prompt.pending[0] == 1 and list(c.prompt.pending[1]) == [3, 2]  # most-routed first
    assert [(l, list(e)) for l, e in c.prompt.fill] == [(1, [3, 2]), (2, [5, 4, 6])]
    assert (c.residency.slot_of[2] < 0).all()                           # nothing of layer 2 copied yet
    c.prompt._copy_pending()                                            # (experts_launched)
    assert c.prompt._fill()                                             # layer 1 is resident: on to layer 2
    assert (c.residency.slot_of[2, [4, 5, 6]] >= 0).all()
    assert c.stats.prompt[2].filled == 3 and c.stats.prompt[2].prefetched == 3
    assert not c.prompt._fill()                                         # spent


def test_what_the_in_flight_bound_leaves_of_the_next_layer_is_filled_before_the_layers_after_it():
    """The next layer's copy-ahead stops at the bound on speculative bytes in flight; the rest of its guess is the
    fill's first work (a prompt layer of Qwen3-Next misses more than the bound), then the layers after it."""
    c = _cache()
    c.prepare(0, _counts(e0=5), [_counts(e2=1, e3=4), _counts(e4=2)])
    queue = c.slots.queue
    full = PrefetchConfig().max_inflight_mib << 20
    queue.speculative_inflight = lambda: full - c.store.expert_bytes      # room for one copy
    c.prompt._copy_pending()
    assert c.residency.slot_of[1, 3] >= 0 and c.residency.slot_of[1, 2] < 0      # the most routed went
    del queue.speculative_inflight
    assert c.prompt._fill() and c.residency.slot_of[1, 2] >= 0 and (c.residency.slot_of[2] < 0).all()
    assert c.prompt._fill() and c.residency.slot_of[2, 4] >= 0
    assert c.stats.prompt[1].filled == 1 and c.stats.prompt[1].prefetched == 2


def test_the_fill_waits_while_the_copy_stream_still_has_work():
    c = _cache()
    c.prepare(0, _counts(e0=5), [_counts(e2=1), _counts(e4=2)])
    c.prompt._copy_pending()

    class Busy:
        def pending_bytes(self):
            return prompt_mod.FILL_LOW_BYTES + c.store.expert_bytes

    queue, c.slots.queue = c.slots.queue, Busy()
    assert c.prompt._fill() and c.residency.slot_of[2, 4] < 0           # keeps waiting, copies nothing yet
    c.slots.queue = queue
    assert c.prompt._fill() and c.residency.slot_of[2, 4] >= 0


def test_once_a_layer_is_launched_the_next_layer_goes_ahead_then_the_fill_if_the_stream_is_short_of_work():
    c = _cache()
    c.prepare(0, _counts(e0=5), [_counts(e2=1, e3=4), _counts(e4=2, e5=6)])
    c.experts_launched(0)
    assert (c.residency.slot_of[1, [2, 3]] >= 0).all() and (c.residency.slot_of[2, [4, 5]] >= 0).all()
    assert c.stats.prompt[1].filled == 0 and c.stats.prompt[2].filled == 2

    busy = _cache()
    busy.prepare(0, _counts(e0=5), [_counts(e2=1, e3=4), _counts(e4=2, e5=6)])
    busy.slots.queue.pending_bytes = lambda: prompt_mod.FILL_LAUNCH_BYTES
    busy.experts_launched(0)
    assert (busy.residency.slot_of[1, [2, 3]] >= 0).all() and (busy.residency.slot_of[2] < 0).all()


def test_the_fill_copies_a_few_at_a_time_and_skips_what_is_resident(monkeypatch):
    c = _cache()
    monkeypatch.setattr(prompt_mod, "FILL_LOW_BYTES", 2 * c.store.expert_bytes)  # two copies per call
    c.prepare(0, _counts(e0=5), [_counts(e2=1), _counts(e1=9, e4=8, e5=7, e6=6)])
    c.prompt._copy_pending()
    c.prompt._prefetch(2, np.array([4]))                                # already there: not copied again
    assert c.prompt._fill() and (c.residency.slot_of[2, [1, 5]] >= 0).all() and c.residency.slot_of[2, 6] < 0
    assert c.prompt._fill() and c.residency.slot_of[2, 6] >= 0
    assert c.stats.prompt[2].filled == 3 and not c.prompt._fill()


def test_no_room_in_flight_ends_the_fill():
    c = _cache(max_inflight_mib=0)
    c.prepare(0, _counts(e0=5), [_counts(e2=1), _counts(e4=2)])
    assert not c.prompt._fill() and c.prompt.fill == [] and (c.residency.slot_of[2] < 0).all()


def test_the_fill_waits_while_the_speculative_bytes_in_flight_are_at_their_bound():
    """The copy stream near its end (pending under the fill's low mark) may still hold a full bound of speculative
    bytes: the fill keeps its guesses and copies them once the bound has room, instead of ending."""
    c = _cache()
    c.prepare(0, _counts(e0=5), [_counts(e2=1), _counts(e4=2)])
    c.prompt._copy_pending()
    queue = c.slots.queue
    queue.speculative_inflight = lambda: PrefetchConfig().max_inflight_mib << 20
    assert c.prompt._fill() and c.prompt.fill and (c.residency.slot_of[2] < 0).all()     # waits, keeps the guess
    del queue.speculative_inflight
    assert c.prompt._fill() and c.residency.slot_of[2, 4] >= 0


def test_guesses_for_a_layer_on_the_gpu_are_skipped():
    c = _cache(layers=(0, 2, 3), moe_layers=[0, 1, 2, 3])                # layer 1's experts are not the cache's
    c.prepare(0, _counts(e0=5), [_counts(e1=1), _counts(e4=2), _counts(e6=3)])
    assert c.prompt.pending[0] == 2 and list(c.prompt.pending[1]) == [4]
    assert [(l, list(e)) for l, e in c.prompt.fill] == [(2, [4]), (3, [6])]


def test_one_layer_ahead_fills_only_what_its_copy_ahead_left():
    c = _cache(lookahead_layers=1)
    assert c.lookahead_layers(0, 64) == 1 and c.lookahead_layers(3, 64) == 0
    c.prepare(0, _counts(e0=5), [_counts(e2=1)])
    assert [(l, list(e)) for l, e in c.prompt.fill] == [(1, [2])]
    c.prompt._copy_pending()
    assert not c.prompt._fill() and c.prompt.fill == []


def test_moe_route_guesses_as_many_layers_ahead_as_the_provider_asks():
    cfg = ModelConfig(family="qwen3_moe", vocab_size=8, hidden_size=16, n_layers=4, n_heads=2, n_kv_heads=1,
                      head_dim=8, n_experts=8, n_experts_used=2, moe_intermediate_size=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g)
    routers = tuple(torch.randn(8, 16, generator=g) for _ in range(4))
    lw = {"ffn_gate_inp.weight": routers[0]}

    class Asks:
        def __init__(self, n):
            self.n = n

        def lookahead_layers(self, layer, n_tokens):
            return self.n

    for n in (0, 1, 2, 3):
        _, ids, guess = moe_route([x], lw, 0, cfg, Asks(n), next_routers=routers[1:])
        if n == 0:
            assert guess is None
            continue
        assert len(guess) == n
        for j, gj in enumerate(guess):
            assert torch.equal(gj, torch.topk(x @ routers[1 + j].T, 2, dim=-1).indices)
    _, _, guess = moe_route([x], lw, 0, cfg, Asks(4), next_routers=routers[1:])
    assert len(guess) == 3                                              # no more than the layers that follow


def _prompt(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mib", [2, 12])
def test_filling_changes_no_logits(monkeypatch, mib):
    """The read-back stands in for a long wait on the GPU: it fills until nothing is left, every layer."""
    def waiting(self, counts):
        while self._fill():
            pass
        return counts.numpy()

    kw = dict(ubatch_size=32, ctx_size=256, device="cpu", cpu_moe=True, moe_cache_mib=mib, prefetch_min_batch=8)
    off = LLM("synth:tiny", prefetch=False, **kw)
    monkeypatch.setattr(PromptPath, "_read_back", waiting)
    on = LLM("synth:tiny", lookahead_layers=3, **kw)
    for s in range(3):
        ids = _prompt(70, s)                            # ubatches of 32, 32 and a 6-token tail
        assert torch.equal(on.logits(ids), off.logits(ids)), (mib, s)
    t = on.stats()["total"]
    assert t["filled"] > 0 and t["filled"] <= t["prefetched"]
