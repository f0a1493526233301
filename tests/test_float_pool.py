"""A float pool is one region (experts/planner.py): a layer whose slots span more than one grouped GEMM launch reads
them from a window of the pool or a compact stack gathered on the device (ExpertWeights.dense), with the bits of the
pool itself; and sweeping prompts keep experts across prompts. (Regions of one launch each, MOESTREAM_FLOAT_POOL=
regions, kept fewer: removed at stop 47.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.device import Device
from moestream.experts.cache import ExpertCache
from moestream.experts.prefetch import PrefetchConfig
from moestream.experts.provider import ExpertWeights
from moestream.experts.store import ExpertStore
from moestream.kernels import grouped
from moestream.kernels.reference import experts_reference
from moestream.quant.layout import ExpertLayout


@pytest.fixture
def launch_of_8(monkeypatch):
    """One grouped GEMM launch takes 8 slots."""
    monkeypatch.setattr(grouped, "MAX_GROUPS", 8)


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


@pytest.mark.parametrize("mib", [3, 1000])
def test_logits_are_those_of_every_expert_on_the_device(launch_of_8, mib):
    """3 MiB is 8 slots (one launch), 1000 MiB all 64 experts: one region of 64 slots whose layers are read
    through windows and gathers."""
    base = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu")
    want = [base.logits(_prompt(40, s)) for s in range(2)]
    llm = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=mib)
    assert llm.engine.host.n_slots == (8 if mib == 3 else 64)
    for s, base_logits in enumerate(want):
        assert torch.equal(llm.logits(_prompt(40, s)), base_logits), (mib, s)


REGIONS_UPLOADS = 180        # prompts 2-6 in four regions: [48, 36, 36, 36, 36, 36] (main at 9bd1b02)


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


def test_sweeps_keep_experts_across_prompts(launch_of_8):
    """30 slots for 6 layers of 8 experts: a sweep evicts the layers just passed, and the next prompt finds what
    it kept. (Four regions of 7-8 slots, each holding at most one expert beside the layer it holds, uploaded
    more: REGIONS_UPLOADS, measured before they were removed.)"""
    one = _uploads_per_prompt(30)
    assert one == [48, 20, 34, 20, 34, 20]                  # (the same as before regions were removed)
    assert sum(one[1:]) < REGIONS_UPLOADS, one


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_kernel_over_windows_and_gathers_gives_the_all_gpu_logits_on_cuda(launch_of_8):
    """bf16, the grouped kernel and the copy stream: launches of 8 slots over a pool of every expert (64 slots),
    read through windows and gathered stacks, give the bits of every expert on the GPU."""
    spec = "synth:tiny:dtype=bfloat16"
    prompts = [list(range(1 + s, 300 + s, 3)) for s in range(2)]
    base = LLM(spec, ctx_size=512, device="cuda", ubatch_size=64)
    want = [base.logits(p) for p in prompts]
    for mib in (3, 100):
        llm = LLM(spec, ctx_size=512, device="cuda", ubatch_size=64, cpu_moe=True, moe_cache_mib=mib)
        for p, w in zip(prompts, want):
            assert torch.equal(llm.logits(p), w), mib
