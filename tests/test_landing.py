"""Zero-copy decode's one-token steps without a model (experts/zero_copy.py): with read-through they land their
misses in free slots and upload nothing, each layer hands out as many landing slots as its misses ask for, and
hits and misses count as the step read its experts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.device import Device
from moestream.experts import read_through
from moestream.experts.cache import ExpertCache
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout

L, E, K, SLOTS = 4, 64, 6, 200          # the pool holds a step (4 x 6) and a fraction of the 256 experts


def _cache(read_through: bool) -> ExpertCache:
    store = ExpertStore({l: torch.zeros(E, 16, dtype=torch.uint8) for l in range(L)}, ExpertLayout(1, 1))
    cache = ExpertCache(store, SLOTS, L, E, Device("cpu"), host_layers=list(range(L)), top_k=K)
    cache.enable_zero_copy(16, read_through=read_through, staged=True)
    return cache


def _decode(cache: ExpertCache, steps: int, seed: int = 0) -> None:
    """One-token steps of a uniform routing, replayed as a step keeps its ids (no kernel runs)."""
    rng, zc = np.random.default_rng(seed), cache.zero_copy
    for _ in range(steps):
        zc.begin_step()
        for l in range(L):
            zc.replay_route(l, rng.choice(E, K, replace=False)[None])
        zc.end_step(1)
    cache.flush_decode()


@pytest.mark.parametrize("read_through", [True, False])
def test_one_token_steps_land_their_misses_and_count_them_as_misses(read_through):
    cache = _cache(read_through)
    _decode(cache, 60)
    t = cache.stats.summary(cache.stats.total)
    assert t["hits"] + t["misses"] == 60 * L * K                     # every choice once
    assert t["misses"] == t["host_reads"] > 0                        # a miss is a choice read from host memory
    if read_through:
        assert t["copies"] == t["uploaded_bytes"] == 0               # nothing crosses the link a second time
        assert t["landed"] > 0.9 * t["misses"]                       # nearly every miss landed where it was read
        assert t["hits"] > 0
    else:
        assert t["landed"] == 0 and t["copies"] > 0.9 * t["misses"]    # the misses were uploaded
    cache.residency.check()


def test_a_layer_hands_out_as_many_landing_slots_as_its_misses_ask_for():
    cache = _cache(True)
    zc = cache.zero_copy
    assert zc.n_land == K and (zc.rt.land_count == read_through.LAND_PER_LAYER).all()
    _decode(cache, 40)                                   # uniform: most of a token's K choices miss
    assert (zc.rt.land_count[:L] > read_through.LAND_PER_LAYER).all() and (zc.rt.land_count <= K).all()
    zc.begin_step()                                      # the next step's landing slots: land_count[l] a layer
    handed = (zc.land_slots[:L, :K] >= 0).sum(axis=1)
    assert (handed == zc.rt.land_count[:L]).all()
    given = zc.land_slots[zc.land_slots >= 0]
    assert len(set(given.tolist())) == len(given) and (cache.residency.owner[given, 0] < 0).all()


def test_the_host_learning_replay_runs_and_counts_no_upload_with_read_through():
    """bench/host_learning.py (RESULTS.md, stop 21): the decode path's host side over a Zipf routing."""
    import argparse
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("host_learning",
                                                  Path(__file__).resolve().parents[1] / "bench" / "host_learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = dict(layers=3, experts=32, top_k=4, slots=40, tokens=1, skew=1.0, steps=20, warmup=5, staged=True,
                profile=False)
    lands = mod.run(argparse.Namespace(**args, no_read_through=False))
    uploads = mod.run(argparse.Namespace(**args, no_read_through=True))
    assert lands["copies"] == 0 < lands["landed"] and uploads["landed"] == 0 < uploads["copies"]
    assert 0 < lands["hit_rate"] < 1 and lands["misses"] == lands["host_reads"]
