"""The per-context routing store (experts/routing.RoutingStore): request counts by owner, prompts' counts for the
cache, and the engine owning one store that its cache reads."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.experts.prefetch import RoutingStats
from moestream.experts.routing import RoutingStore


def forward(store: RoutingStore, routed: dict[int, list[list[int]]]) -> str:
    """An engine call that reports each layer's routed ids (T, k), as the MoE blocks do."""
    for layer, ids in routed.items():
        store.on_route(layer, torch.tensor(ids))
    return "logits"


def test_counting_adds_each_row_to_its_owner():
    store = RoutingStore(n_layers=3, n_experts=4, n_seq=3)
    assert store.counts is None and np.array_equal(store.current(1), np.zeros((3, 4)))   # made when first counted
    with store.counting(1):                              # a prompt ubatch: every row is context 1's
        assert forward(store, {0: [[0, 1], [1, 2]], 2: [[3, 3], [3, 0]]}) == "logits"
    want = np.zeros((3, 4), dtype=np.int64)
    want[0] = [1, 2, 1, 0]
    want[2] = [1, 0, 0, 3]
    assert np.array_equal(store.current(1), want) and not store.current(0).any()
    with store.counting([2, 0]):                         # a batched decode: row 0 is context 2's, row 1 context 0's
        forward(store, {0: [[1, 2], [3, 0]]})
    assert store.current(2)[0].tolist() == [0, 1, 1, 0] and store.current(0)[0].tolist() == [1, 0, 0, 1]
    with store.counting(2):                              # a prompt of several ubatches sees a layer twice
        forward(store, {0: [[1, 1]]})
        forward(store, {0: [[3, 3], [0, 1]]})
    assert store.current(2)[0].tolist() == [1, 4, 1, 2]
    with store.counting(None):                           # not counted (a replayed all-GPU decode graph)
        forward(store, {0: [[0, 0]]})
    forward(store, {0: [[0, 0]]})                        # outside counting: not counted either
    with pytest.raises(RuntimeError):                    # a call that fails counts nothing
        with store.counting(1):
            forward(store, {1: [[0, 0]]})
            raise RuntimeError("boom")
    assert np.array_equal(store.current(1), want)


def test_begin_prompt_rolls_the_request_counts_over():
    store = RoutingStore(2, 4, n_seq=2)
    store.begin_prompt(0)                                # nothing counted yet: nothing made
    assert store.counts is None and not store.previous[0].any()
    with store.counting(0):
        forward(store, {1: [[2, 3]]})
    first = store.current(0)
    store.begin_prompt(0)
    assert np.array_equal(store.previous[0], first) and not store.current(0).any()
    store.begin_prompt(0)                                # a request that routed nothing: previous is it (zeros)
    assert not store.previous[0].any()
    with store.counting(1):
        forward(store, {0: [[1, 1]]})
    store.prompts[1].record(0, np.array([0, 2, 0, 0]))
    store.clear_requests()
    assert not store.current(1).any() and not any(p.any() for p in store.previous)
    assert store.prompts[1].current.any()                # the prompts' counts are the cache's: untouched
    store.clear_prompts()
    assert isinstance(store.prompts[1], RoutingStats) and not store.prompts[1].current.any()


def test_the_engine_owns_one_store_that_its_cache_reads():
    llm = LLM("synth:tiny", ctx_size=64, n_seq=2, cpu_moe=True, moe_cache_mib=2)
    eng = llm.engine
    assert eng.host.routing is eng.routing
    prompt = llm.encode("Once upon a time there was a")
    llm.generate(prompt, max_tokens=2)
    stats = eng.routing.prompts[0]                       # the prompt's routing in the host layers, as prepare saw it
    k = llm.model_config.n_experts_used
    assert [int(stats.current[l].sum()) for l in eng.host.layers] == [len(prompt) * k] * len(eng.host.layers)
    assert eng.routing.counts is None                    # nobody counted requests: no device counts
    llm.generate(prompt, max_tokens=2)
    assert np.array_equal(stats.previous, stats.current)  # the same prompt again: previous is the first one's
    eng.reconfigure_cache(moe_cache_mib=4)
    assert eng.host.routing is eng.routing and not eng.routing.prompts[0].current.any()
    assert LLM("synth:tiny", ctx_size=64).engine.routing.n_seq == 1   # all-GPU: a store too (/slots)
