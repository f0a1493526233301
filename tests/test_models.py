"""moestream against transformers, family by family, on checkpoints transformers writes; and the placement contract.

Bound: float32 logits agree with transformers' to 5e-5 absolute (logits are O(5) here; what is left is the order
of float32 sums: expert outputs are combined in routing order, transformers adds them in expert-id order).
"""
from __future__ import annotations

import pytest
import torch

from moestream import LLM
from moestream.experts.routing import RouteCallback

ATOL = 5e-5


def prompt(n: int, seed: int = 1) -> list[int]:
    from conftest import VOCAB
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("ubatch", [512, 7])
def test_logits_match_transformers(checkpoint, ubatch):
    family, path, model = checkpoint
    ids = prompt(40)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    llm = LLM(path, ubatch_size=ubatch, ctx_size=64, device="cpu")
    out = llm.logits(ids)
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    assert err < ATOL, f"{family}: max |moestream - transformers| = {err}"


def test_greedy_generation_matches_transformers(checkpoint):
    family, path, model = checkpoint
    ids = prompt(12, seed=2)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    llm = LLM(path, ctx_size=64, device="cpu")
    out = llm.generate(ids, max_tokens=12, ignore_eos=True)
    assert out.token_ids == ref, family
    assert out.finish_reason == "length"


@pytest.mark.parametrize("ubatch", [512, 5])
def test_placement_is_bit_identical(checkpoint, ubatch):
    """Experts on the device, --cpu-moe and --n-cpu-moe give the same logits, bit for bit."""
    family, path, _ = checkpoint
    ids = prompt(33, seed=3)
    base = LLM(path, ubatch_size=ubatch, ctx_size=64, device="cpu").logits(ids)
    for kw in ({"cpu_moe": True}, {"n_cpu_moe": 1}):
        llm = LLM(path, ubatch_size=ubatch, ctx_size=64, device="cpu", **kw)
        assert torch.equal(llm.logits(ids), base), (family, kw)
        assert llm.stats()["uploaded_experts"] > 0


@pytest.mark.parametrize("by_layer", [True, False])
def test_cpu_moe_uploads_each_routed_expert_once_per_batch_or_per_ubatch(checkpoint, by_layer):
    """30 tokens in batches of 20 (-b), ubatches of 10: layer by layer (the default with host experts) a routed
    expert crosses once a batch, whatever the number of its ubatches that chose it; ubatch by ubatch
    (--no-batch-by-layer), once a ubatch. The logits are the same bits either way."""
    family, path, _ = checkpoint
    ids = prompt(30, seed=4)
    kw = dict(batch_size=20, ubatch_size=10, ctx_size=64, device="cpu", cpu_moe=True)
    llm = LLM(path, batch_by_layer=by_layer, **kw)
    routed: dict[tuple[int, int], set] = {}
    ubatch_no = {"n": -1}

    def on_route(layer, ids_):
        if layer == llm.model_config.moe_layers[0]:
            ubatch_no["n"] += 1
        routed.setdefault((ubatch_no["n"], layer), set()).update(ids_.flatten().tolist())

    llm.engine.observe(RouteCallback(on_route))
    out = llm.logits(ids)
    expected = sum(len(s) for s in routed.values())
    assert ubatch_no["n"] == (1 if by_layer else 2)  # what the providers see: 2 batches, or 3 ubatches
    assert llm.stats()["uploaded_experts"] == expected
    other = LLM(path, batch_by_layer=not by_layer, **kw)
    assert torch.equal(other.logits(ids), out)
    theirs = other.stats()["uploaded_experts"]
    per_batch, per_ubatch = (expected, theirs) if by_layer else (theirs, expected)
    assert per_batch < per_ubatch, family    # (ubatches of these prompts share some experts in every family)


def test_a_batch_that_is_not_whole_ubatches_runs_each_token_once(checkpoint):
    """-b 10 -ub 4 over 23 tokens: batches of 10, 10 and 3, cut into ubatches of 4, 4 and 2 (then 3); layer by layer
    each token runs once, at its position: the logits of every token equal ubatch by ubatch, and of all on the
    device with -b 10 -ub 4."""
    family, path, _ = checkpoint
    ids = prompt(23, seed=6)
    kw = dict(batch_size=10, ubatch_size=4, ctx_size=64, device="cpu")
    base = LLM(path, **kw).logits(ids)
    assert base.shape[0] == 23
    for by_layer in (True, False):
        assert torch.equal(LLM(path, cpu_moe=True, batch_by_layer=by_layer, **kw).logits(ids), base), (family, by_layer)


def test_batched_decode_of_several_sequences_matches_one_at_a_time(checkpoint):
    """A forward over several sequences at their own positions gives each one's logits as if run alone."""
    family, path, _ = checkpoint
    a, b = prompt(9, seed=5), prompt(14, seed=6)
    llm = LLM(path, ctx_size=64, device="cpu", n_seq=2)
    eng = llm.engine
    alone_a = llm.logits(a + [7])[-1]
    alone_b = llm.logits(b + [11])[-1]
    eng.prefill(0, a)
    eng.prefill(1, b)
    both = eng.decode([(0, 7, len(a)), (1, 11, len(b))])
    assert (both[0] - alone_a).abs().max() < 1e-5
    assert (both[1] - alone_b).abs().max() < 1e-5


def test_grouped_kernel_segments_a_large_pool(monkeypatch):
    """Pools over _grouped_mm's group limit run in segments of slots, with the same result (CPU _grouped_mm, bf16)."""
    import moestream.kernels.grouped as g
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    gen = torch.Generator().manual_seed(0)
    S, H, I, T, k = 11, 32, 16, 40, 3
    w13 = (torch.randn(S, 2 * I, H, generator=gen) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(S, H, I, generator=gen) * 0.2).to(torch.bfloat16)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(T)])
    whole = g.experts_grouped(x, slots, w13, w2)
    monkeypatch.setattr(g, "MAX_GROUPS", 4)
    assert torch.equal(g.experts_grouped(x, slots, w13, w2), whole)
    # the sync-free segmentation used inside CUDA graph captures
    order, counts = g.sort_by_slot(slots, S)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]
    y = g._segments_without_sync(xs, w13, w2, offs)
    out = torch.empty_like(y)
    out[order] = y
    assert torch.equal(out.view(T, k, -1), whole)
    from moestream.kernels.reference import experts_reference
    ref = experts_reference(x.double(), slots, w13.double(), w2.double())
    assert ((whole.double() - ref).norm() / ref.norm()) < 1e-2


def test_decode_span_rounds_up_to_a_power_of_two_within_the_cache():
    from moestream.runtime.kv_cache import KVCache
    kv = KVCache(1, 1, 4200, 1, 8, torch.float32, "cpu")
    assert [kv.span(n) for n in (1, 256, 257, 600, 4096, 4097, 4200)] == [256, 256, 512, 1024, 4096, 4200, 4200]
    assert kv.spans() == [256, 512, 1024, 2048, 4096, 4200]
    assert KVCache(1, 1, 100, 1, 8, torch.float32, "cpu").spans() == [100]


def test_decode_across_a_span_boundary_matches_the_prompt_path():
    """Decode steps at positions 250..261 attend 256 keys, then 512: each step's logits are the prompt path's."""
    llm = LLM("synth:tiny", device="cpu", ctx_size=600)
    eng = llm.engine
    ids = torch.randint(0, 1000, (250,), generator=torch.Generator().manual_seed(1)).tolist()
    tok = int(eng.prefill(0, ids, 0)[-1].argmax())
    for pos in range(250, 262):
        step = eng.decode([(0, tok, pos)])[0]
        ids.append(tok)
        full = llm.logits(ids)[-1]
        assert torch.allclose(step, full, atol=1e-4, rtol=1e-4), pos
        tok = int(step.argmax())
        eng.prefill(0, ids, 0)                    # the KV cache as the decode left it (logits() rewrote it)
