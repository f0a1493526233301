"""No-cache uploads (experts/upload.py): with two sets of rows each host layer's copy-ahead is in its set when
compute reads it, the routed experts not copied ahead are uploaded on demand, and a model gives the same bits with
one set or two, with copy-ahead or without."""
from __future__ import annotations

import pytest
import torch

from moestream import LLM
from moestream.device import Device
from moestream.experts.buffered import BufferedCache
from moestream.experts.prefetch import PrefetchConfig
from moestream.experts.store import ExpertStore
from moestream.experts.upload import ALL_CHOICES, UploadPerUbatch
from moestream.quant.layout import ExpertLayout
from moestream.runtime import placement

L, E, K = 4, 8, 2
PF = PrefetchConfig(min_batch=4)


def _upload(second=True, prefetch=PF):
    """Each expert's row holds its own number (layer * E + expert) in every byte, so a row shows whose it is."""
    rows = {l: (l * E + torch.arange(E, dtype=torch.uint8)).repeat_interleave(3).view(E, 3) for l in range(L)}
    store = ExpertStore(rows, ExpertLayout(1, 1))
    return UploadPerUbatch(store, E, Device("cpu"), K, second=second, prefetch=prefetch)


def _ubatch(up, routed: dict[int, list[int]], n_tokens: int) -> dict[int, dict]:
    """One forward's host side, as the MoE blocks run it: per layer fetch, then experts_launched. Checks that when
    fetch returns, the rows it hands out hold every routed expert's bytes. Returns each layer's counters."""
    up.stats.begin_prompt()
    up.begin_ubatch(0, n_tokens, is_prompt=True)
    for l in range(L):
        ids = torch.tensor(routed[l]).view(-1, 1).expand(-1, K)
        up.fetch(l, ids)
        rows = up.sets[l % len(up.sets)]
        for e in routed[l]:
            assert int(rows[e, 0]) == l * E + e, (l, e)
        up.experts_launched(l)
    return {l: c.as_dict() for l, c in up.stats.prompt.items()}


def test_a_first_big_ubatch_copies_every_expert_ahead_and_uploads_nothing_on_demand():
    up = _upload()
    n = ALL_CHOICES * E // K                       # choices enough to copy every expert ahead
    got = _ubatch(up, {l: [1, 2, 5] for l in range(L)}, n)
    for l in range(L):
        c = got[l]
        assert (c["prefetched"], c["hits"], c["misses"], c["prefetch_wasted"]) == (E, 3, 0, E - 3)
        assert c["uploaded_bytes"] == E * up.store.layer_bytes(l)


def test_later_ubatches_copy_ahead_what_each_layer_routed_and_upload_the_rest_on_demand():
    up = _upload()
    first = {l: [l, l + 1, l + 2, l + 3] for l in range(L)}    # half of each layer's experts
    _ubatch(up, first, 4)                                # too few choices to copy all: demand only, learned
    got = _ubatch(up, {l: first[l] + [7] for l in range(L)}, 4)
    for l in range(L):
        c = got[l]
        assert (c["prefetched"], c["hits"], c["misses"], c["prefetch_wasted"]) == (4, 4, 1, 0), l
        assert c["uploaded_bytes"] == 5 * up.store.layer_bytes(l)
    assert up.copies_ahead(4) and not up.copies_ahead(3)


def test_a_forward_copies_ahead_only_where_the_layers_routed_half_their_experts_on_average_and_only_those():
    up = _upload()
    _ubatch(up, {l: [1, 2, 3, 4, 5] if l < 3 else [0, 1] for l in range(L)}, 64)     # (64: every expert ahead)
    assert up.copies_ahead(64)                                # 17 of 32 routed: on average more than half
    got = _ubatch(up, {l: [1, 2, 3] for l in range(L)}, 64)
    assert [got[l]["prefetched"] for l in range(L)] == [5, 5, 5, 0]      # the narrow layer is not copied ahead
    assert not up.copies_ahead(64)                            # 12 of 32: the cache's path past 2048
    got = _ubatch(up, {l: [0, 1, 2, 3, 4, 5] for l in range(L)}, 64)
    assert all((c["prefetched"], c["misses"]) == (0, 6) for c in got.values())  # nothing ahead, all learned
    got = _ubatch(up, {l: [0, 1, 2, 3, 4, 5] for l in range(L)}, 64)
    assert all((c["prefetched"], c["hits"], c["misses"]) == (6, 6, 0) for c in got.values())


@pytest.mark.parametrize("why", ["one set", "prefetch off", "small ubatch"])
def test_without_a_second_set_prefetch_or_a_big_enough_ubatch_every_routed_expert_is_a_demand_upload(why):
    up = _upload(second=why != "one set", prefetch=PrefetchConfig(enabled=False) if why == "prefetch off" else PF)
    n = 3 if why == "small ubatch" else 64
    for _ in range(2):
        got = _ubatch(up, {l: [0, 3] for l in range(L)}, n)
        assert all((c["prefetched"], c["misses"]) == (0, 2) for c in got.values())


def _llm(**kw):
    return LLM("synth:tiny", ctx_size=512, device="cpu", ubatch_size=256, **kw)


def test_logits_are_the_same_bits_with_one_set_of_rows_or_two_and_with_copy_ahead_or_without(monkeypatch):
    """A 300-token prompt in ubatches of 256 (the second set copies ahead: min_batch is 256) and of 44."""
    prompt = [(7 * i + 3) % 200 + 2 for i in range(300)]
    ref = _llm().logits(prompt)                                         # every expert on the device
    two = _llm(cpu_moe=True, zero_copy_decode=True)                    # the rows decode as a cache too
    assert isinstance(two.engine.host, BufferedCache) and two.engine.host.upload.pipelined
    for _ in range(2):                                     # the first prompt copies every expert, the next the seen
        assert torch.equal(two.logits(prompt), ref)
        assert two.stats()["prompt"]["prefetched"] > 0
    plain = _llm(cpu_moe=True, zero_copy_decode=False)                 # UploadPerUbatch on its own
    assert type(plain.engine.host) is UploadPerUbatch and plain.engine.host.pipelined
    assert torch.equal(plain.logits(prompt), ref)
    assert torch.equal(_llm(cpu_moe=True, prefetch=False).logits(prompt), ref)
    monkeypatch.setattr(placement, "SECOND_ROWS_FREE", 1 << 62)        # no room for a second set
    one = _llm(cpu_moe=True, zero_copy_decode=True)
    assert not one.engine.host.upload.pipelined
    assert torch.equal(one.logits(prompt), ref) and one.stats()["prompt"]["prefetched"] == 0
