"""A float pool in one region (MOESTREAM_FLOAT_POOL=one, the default; experts/planner.py): a layer whose slots span
more than one grouped GEMM launch reads them from a window of the pool or a compact stack gathered on the device
(ExpertWeights.dense), with the bits of the pool itself; and sweeping prompts keep more across prompts than in
regions (=regions), which hold three layers' experts at once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.device import Device
from moestream.experts import planner
from moestream.experts.cache import ExpertCache
from moestream.experts.prefetch import PrefetchConfig
from moestream.experts.provider import ExpertWeights
from moestream.experts.store import ExpertStore
from moestream.kernels import grouped
from moestream.kernels.reference import experts_reference
from moestream.quant.layout import ExpertLayout


@pytest.fixture
def launch_of_8(monkeypatch):
    """One grouped GEMM launch takes 8 slots, and a float region holds at most 8."""
    monkeypatch.setattr(grouped, "MAX_GROUPS", 8)
    monkeypatch.setattr(planner, "REGION_SLOTS", 8)


def test_a_stack_of_more_slots_than_a_launch_is_read_through_a_window_or_a_gather(launch_of_8):
    g = torch.Generator().manual_seed(0)
    S, H, I, T, k = 20, 16, 8, 6, 2
    w13, w2, x = torch.randn(S, 2 * I, H, generator=g), torch.randn(S, H, I, generator=g), torch.randn(T, H, generator=g)
    for slots in ([[5, 9], [12, 5], [9, 11], [6, 12], [5, 7], [11, 6]],       # within slots 5-12: a window
                  [[0, 19], [3, 19], [0, 7], [7, 3], [19, 0], [3, 7]]):        # spread: a gather
        slots = torch.tensor(slots)
        want = experts_reference(x, slots, w13, w2)
        used = np.unique(slots.numpy())
        for w in (ExpertWeights(w13, w2, slots, used=used), ExpertWeights(w13, w2, slots)):
            d = w.dense(x.dtype)
            assert d.w13.shape[0] <= 8
            assert torch.equal(experts_reference(x, d.slots, d.w13, d.w2), want)
        window = used[-1] - used[0] < 8
        d = ExpertWeights(w13, w2, slots, used=used).dense(x.dtype)
        assert (d.w13.data_ptr() == w13[used[0]].data_ptr()) == window   # a window is a view: no copy


def _prompt(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("pool", ["regions", "one"])
@pytest.mark.parametrize("mib", [3, 1000])
def test_logits_are_the_same_in_regions_and_in_one_region(launch_of_8, monkeypatch, pool, mib):
    """3 MiB is 7 slots (one region either way), 1000 MiB all 64 experts: a region a layer (16 slots, gathered),
    or one region of 64 slots whose layers are read through windows and gathers."""
    base = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu")
    want = [base.logits(_prompt(40, s)) for s in range(2)]
    monkeypatch.setattr(planner, "FLOAT_POOL", pool)
    llm = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=mib)
    n_regions = len({b for b in llm.engine.host.residency.bounds if b is not None})
    assert (n_regions == 1) == (pool == "one" or mib == 3)
    for s, base_logits in enumerate(want):
        assert torch.equal(llm.logits(_prompt(40, s)), base_logits), (pool, mib, s)


def _uploads_per_prompt(n_slots: int, prompts: int = 6, L: int = 6, E: int = 8) -> list[int]:
    """Sweeping prompts through the prompt path (every expert of every layer routed, the next layer guessed and
    copied ahead): experts uploaded a prompt."""
    store = ExpertStore({l: torch.arange(E, dtype=torch.uint8).repeat_interleave(3).view(E, 3) for l in range(L)},
                        ExpertLayout(1, 1))
    c = ExpertCache(store, n_slots, L, E, Device("cpu"), "cycle", PrefetchConfig(min_batch=8, lookahead_layers=1),
                    list(range(L)), top_k=2)
    every = np.full(E, 5, dtype=np.int64)
    out = []
    for _ in range(prompts):
        c.begin_prompt(0)
        c.begin_ubatch(0, 64, True)
        for layer in range(L):
            c.slots.mark_reads()
            c.prepare(layer, every, [every] if layer < L - 1 else None)
            c.experts_launched(layer)
        out.append(sum(s.uploaded_bytes for s in c.stats.prompt.values()) // store.expert_bytes)
    return out


def test_sweeps_keep_more_in_one_region_than_in_regions(launch_of_8, monkeypatch):
    """30 slots for 6 layers of 8 experts: four regions of 7-8 slots keep at most one expert a region beside the
    layer it holds; one region lets the sweep evict the layer just passed and keeps more."""
    monkeypatch.setattr(planner, "FLOAT_POOL", "regions")
    regions = _uploads_per_prompt(30)
    monkeypatch.setattr(planner, "FLOAT_POOL", "one")
    one = _uploads_per_prompt(30)
    assert regions[0] == one[0] == 48
    assert sum(one[1:]) < sum(regions[1:]), (one, regions)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool", ["regions", "one"])
def test_grouped_kernel_over_windows_and_gathers_gives_the_all_gpu_logits_on_cuda(launch_of_8, monkeypatch, pool):
    """bf16, the grouped kernel and the copy stream: launches of 8 slots over a pool of every expert (64 slots),
    read through windows and gathered stacks, give the bits of every expert on the GPU."""
    spec = "synth:tiny:dtype=bfloat16"
    prompts = [list(range(1 + s, 300 + s, 3)) for s in range(2)]
    base = LLM(spec, ctx_size=512, device="cuda", ubatch_size=64)
    want = [base.logits(p) for p in prompts]
    monkeypatch.setattr(planner, "FLOAT_POOL", pool)
    for mib in (3, 100):
        llm = LLM(spec, ctx_size=512, device="cuda", ubatch_size=64, cpu_moe=True, moe_cache_mib=mib)
        for p, w in zip(prompts, want):
            assert torch.equal(llm.logits(p), w), (pool, mib)
