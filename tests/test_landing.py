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

from conftest import CUDA

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


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("mib,staged", [(8, False), (12, False), (12, True), (16, True)])
def test_a_steps_landings_reach_the_next_table_on_the_device(device, mib, staged):
    """A step notes where it landed what (note_landings), the next step's table takes them in on the device
    (apply_landings), and the host takes them in only after that step is queued, not between the two: exactly what
    the device took in, at the same addresses. Steps of one token and of two (two sequences every other step: the
    grouped kernel's rule, or staged, the stage copy's) alike; and the next steps do read them from their slots
    (hits, not host reads again). On CUDA (in bfloat16) the steps replay CUDA graphs, which run both ops inside,
    and whose warm-up keeps the table. (Taking them in on the host first, MOESTREAM_LANDINGS=host, gave the same
    logits and counters; removed at stop 47.)"""
    from moestream import LLM

    def run():
        dtype = dict(dtype="bfloat16") if device == "cuda" else {}
        llm = LLM("synth:tiny", ctx_size=128, device=device, zero_copy_decode=True, cpu_moe=True, n_seq=2,
                  moe_cache_mib=mib, read_through=True, stage_host_reads=staged, **dtype)
        eng, zc = llm.engine, llm.engine.host.zero_copy
        deferred, begin, absorb, applied = [], zc.begin_step, zc._absorb, {}

        def counted(*a, **kw):
            p = zc.pending
            begin(*a, **kw)
            if p is not None and not p.absorbed:                     # deferred: what the next table takes in
                dl = zc.device_landings
                ok = dl.noted_ok & dl.absorbable
                applied[id(p)] = ok.clone(), dl.noted_addr[ok].clone()
                deferred.append((p.n_tokens, bool(ok.any())))

        def absorbed(p, *routed):                                    # the host takes in what the device did
            ls, es, ss = absorb(p, *routed)
            if id(p) in applied:
                ok, addr = applied.pop(id(p))
                placed = torch.zeros_like(ok)
                placed[torch.as_tensor(ls), torch.as_tensor(es)] = True
                assert torch.equal(placed, ok)
                assert torch.equal(addr.cpu(), torch.as_tensor(zc.pool_addr + ss * zc.row_bytes)[np.lexsort((es, ls))])
            return ls, es, ss
        zc.begin_step, zc._absorb = counted, absorbed
        ids = list(range(5, 40))
        tok, outs = int(eng.prefill(0, ids)[-1].argmax()), []
        other, at = int(eng.prefill(1, ids[::-1])[-1].argmax()), 35
        for i, pos in enumerate(range(35, 75)):
            both = i >= 12 and i % 3 != 0            # one token a step, then two in two steps of three
            lg = eng.decode([(0, tok, pos)] + ([(1, other, at)] if both else []))
            outs.append(lg.clone())
            tok = int(lg[0].argmax())
            other, at = (int(lg[1].argmax()), at + 1) if both else (other, at)
        eng.host.flush_decode()
        counts = {k: v for k, v in eng.stats()["total"].items()      # (not the times, nor the prompt's waits for
                  if not k.endswith("_s") and k != "waits"}             # copies, which on CUDA depend on timing)
        return outs, counts, deferred

    dev = run()
    assert dev[1]["landed"] > 0 and dev[1]["hits"] > 0
    assert len(dev[2]) == 39                              # every step after the first took the last one's on the device
    assert (1, True) in dev[2] and (2, True) in dev[2]               # steps of one token and of two that landed


@pytest.mark.parametrize("n_tokens,staged", [(1, True), (1, False), (3, True), (3, False)])
def test_the_device_notes_what_the_kernels_rule_lands_and_no_more_than_its_slots(n_tokens, staged):
    """DeviceLandings.note against the host's form of the kernels' rule (stage.landed_experts, staged or one token:
    first choice order; decode.landing_slots_grouped: ascending id), where layers read more experts from host than
    they have landing slots (R = 3 of 5 columns handed, a fifth of them none): exactly the rule's experts are noted,
    each at its slot's address, and nothing beyond the R-th."""
    from types import SimpleNamespace
    from moestream.kernels.decode import landing_slots_grouped
    from moestream.kernels.stage import landed_experts
    g = torch.Generator().manual_seed(n_tokens + 2 * staged)
    nl, ne, k, R = 12, 16, 6, 3
    rt = SimpleNamespace(count=lambda n: R, reads_in_place=lambda n: False, staged=staged)
    dl = read_through.DeviceLandings(rt, k, (nl, ne), "cpu")
    host_tab = torch.arange(1, nl * ne + 1).view(nl, ne) * 1000
    table = torch.where(torch.rand(nl, ne, generator=g) < 0.7, host_tab, -host_tab)      # 70% read from host
    routed = torch.stack([torch.cat([torch.randperm(ne, generator=g)[:k] for _ in range(n_tokens)]) for _ in range(nl)])
    land = torch.randint(1, 999, (nl, 5), generator=g) * (torch.rand(nl, 5, generator=g) < 0.8)   # 0: no slot
    dl.note(table, host_tab, routed, land, n_tokens)
    rule = landed_experts if staged or n_tokens == 1 else landing_slots_grouped
    want = torch.zeros(nl, ne, dtype=torch.bool)
    beyond = 0
    for l in range(nl):
        on_host = (table[l] == host_tab[l])[routed[l]].tolist()
        beyond += len({int(e) for e, h in zip(routed[l].tolist(), on_host) if h}) > R
        for e, r in rule(routed[l].tolist(), on_host, R):
            if land[l, r] != 0:
                want[l, e] = True
                assert dl.noted_addr[l, e] == land[l, r], (l, e, r)
    assert beyond > 0 and want.any()                     # layers with more host reads than slots, and landings
    assert torch.equal(dl.noted_ok, want)
