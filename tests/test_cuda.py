"""The same contracts on a CUDA GPU (run on the GPU machine: `pytest -m cuda`)."""
from __future__ import annotations

import pytest
import torch

from moestream import LLM
from moestream.kernels.reference import experts_reference

from batched import decode_three

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _weights(S, H, I, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(S, 2 * I, H, device="cuda", generator=g).to(dtype) * H ** -0.5
    w2 = torch.randn(S, H, I, device="cuda", generator=g).to(dtype) * I ** -0.5
    return w13, w2


@needs_cuda
@pytest.mark.parametrize("T", [1, 37, 512])
def test_grouped_kernel_matches_reference(T):
    from moestream.kernels.grouped import experts_grouped
    S, H, I, k = 16, 256, 128, 4
    w13, w2 = _weights(S, H, I, torch.bfloat16)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    slots = torch.stack([torch.randperm(S, device="cuda")[:k] for _ in range(T)])      # (T, k) distinct per token
    ref = experts_reference(x.double(), slots, w13.double(), w2.double())
    out = experts_grouped(x, slots, w13, w2)
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


@needs_cuda
def test_grouped_kernel_result_does_not_depend_on_the_slot():
    """An expert's output is the same bits whichever slot holds it and whatever else is in the launch."""
    from moestream.kernels.grouped import experts_grouped
    S, H, I, k, T = 32, 256, 128, 2, 64
    w13, w2 = _weights(S, H, I, torch.bfloat16)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    slots = torch.randint(0, S // 2, (T, k), device="cuda")
    out = experts_grouped(x, slots, w13, w2)
    perm = torch.randperm(S, device="cuda")                   # move every expert to another slot
    w13p, w2p = torch.empty_like(w13), torch.empty_like(w2)
    w13p[perm], w2p[perm] = w13, w2
    assert torch.equal(experts_grouped(x, perm[slots], w13p, w2p), out)


@needs_cuda
@pytest.mark.parametrize("ubatch", [512, 7])
def test_logits_match_transformers_on_cuda(checkpoint, ubatch):
    """ubatch 7: chunks after the first attend to the cache with a lower-right causal mask (flash attention)."""
    family, path, model = checkpoint
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    out = LLM(path, ctx_size=64, device="cuda", ubatch_size=ubatch).logits(ids)
    # float32 on the GPU: matmuls may use TF32-free cuBLAS paths, different sum orders than the CPU.
    assert (out - ref).abs().max().item() < 1e-3


@needs_cuda
@pytest.mark.parametrize("ubatch", [512, 6])
def test_placement_bit_identical_bf16_grouped(checkpoint, ubatch):
    family, path, _ = checkpoint
    ids = list(range(5, 45))
    base = LLM(path, ctx_size=64, device="cuda", dtype="bfloat16", ubatch_size=ubatch).logits(ids)
    for kw in ({"cpu_moe": True}, {"n_cpu_moe": 1}):
        assert torch.equal(LLM(path, ctx_size=64, device="cuda", dtype="bfloat16", ubatch_size=ubatch, **kw)
                           .logits(ids), base), kw


@needs_cuda
def test_greedy_decode_hash_same_on_every_placement(checkpoint):
    family, path, _ = checkpoint
    hashes = {LLM(path, ctx_size=64, device="cuda", dtype="bfloat16", **kw)
              .generate(list(range(7, 19)), max_tokens=16, ignore_eos=True).sha256
              for kw in ({}, {"cpu_moe": True}, {"n_cpu_moe": 1})}
    assert len(hashes) == 1


@needs_cuda
@pytest.mark.parametrize("ubatch", [16, 512])
def test_cache_sizes_policies_and_prefetch_bit_identical_on_cuda(ubatch):
    """bf16, grouped kernel, copy stream: 1 MiB (5 slots: waves), 0 (16), 3 MiB, every expert; prefetch on and off."""
    spec = "synth:tiny:dtype=bfloat16"
    prompts = [list(range(1 + s, 300 + s, 3)) for s in range(3)]
    base = LLM(spec, ctx_size=512, device="cuda", ubatch_size=ubatch)
    want = [base.logits(p) for p in prompts]
    hashes = {base.generate(prompts[0], max_tokens=24, ignore_eos=True).sha256}
    for kw in ({"moe_cache_mib": 1}, {"moe_cache_mib": 0}, {"moe_cache_mib": 3, "cache_policy": "lru"},
               {"moe_cache_mib": 100}, {"moe_cache_mib": 3, "prefetch": False},
               {"moe_cache_mib": 3, "prefetch_min_batch": 8, "prefetch_first_all": True},
               {"moe_cache_mib": 3, "prefetch_min_batch": 8, "lookahead_layers": 4}):
        llm = LLM(spec, ctx_size=512, device="cuda", ubatch_size=ubatch, cpu_moe=True, **kw)
        for p, w in zip(prompts, want):
            assert torch.equal(llm.logits(p), w), kw
        hashes.add(llm.generate(prompts[0], max_tokens=24, ignore_eos=True).sha256)
        assert llm.stats()["total"]["misses"] > 0
    assert len(hashes) == 1


@needs_cuda
def test_copy_queue_counts_the_copies_not_done():
    from moestream.device import Device
    from moestream.experts.copy_queue import CopyQueue
    q = CopyQueue(Device("cuda:0"))
    src = torch.ones(4, 64 << 20, dtype=torch.uint8).pin_memory()     # 4 x 64 MiB: about 5 ms over the link
    dst = torch.zeros_like(src, device="cuda")
    seq = q.submit(list(zip(dst, src)), speculative=True)
    assert 0 < q.pending_bytes() <= src.numel() and q.speculative_inflight() > 0
    q.wait(seq, torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert q.pending_bytes() == 0 and q.speculative_inflight() == 0 and bool((dst == 1).all())
    q.submit(list(zip(dst, src)), speculative=False)   # done batches' marks go with poll, not only
    torch.cuda.synchronize()                                         # with pending (decode never asks pending)
    q.poll()
    assert not q.marks


@needs_cuda
def test_grouped_kernel_segments_of_a_big_pool_agree():
    """A pool of more slots than one launch takes: segments found by a read-back and the sync-free (capturable)
    segments give the same bits."""
    import numpy as np
    from moestream.kernels.grouped import experts_grouped
    S, H, I, k, T = 2100, 64, 32, 4, 300
    w13, w2 = _weights(S, H, I, torch.bfloat16)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    table = np.random.default_rng(0).permutation(S)[:64]                 # 64 experts scattered over the pool
    ids = torch.randint(0, 64, (T, k), device="cuda")
    slots = torch.from_numpy(table).cuda()[ids]
    synced = experts_grouped(x, slots, w13, w2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = experts_grouped(x, slots, w13, w2)
    g.replay()
    assert torch.equal(synced, captured)


@needs_cuda
def test_chunked_prompt_matches_one_chunk_bf16():
    """Chunks after the first (lower-right causal mask over the cache) against one chunk, in bf16 with flash."""
    spec = "synth:tiny:dtype=bfloat16"
    ids = list(range(1, 300, 3))
    one = LLM(spec, ctx_size=512, device="cuda", ubatch_size=512).logits(ids)
    chunked = LLM(spec, ctx_size=512, device="cuda", ubatch_size=16).logits(ids)
    assert (one - chunked).abs().max() / one.abs().max() < 0.05


@needs_cuda
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 12}])
def test_captured_decode_matches_eager_across_a_span_boundary(kw):
    """Positions 250..261 cross the 256-key span: graphs captured per span give the eager decode's bits, all on
    the GPU and with host experts (zero-copy graphs)."""
    def run(graphs):
        llm = LLM("synth:tiny:dtype=bfloat16", ctx_size=600, device="cuda", cuda_graphs=graphs, **kw)
        eng = llm.engine
        ids = torch.randint(0, 1000, (250,), generator=torch.Generator().manual_seed(1)).tolist()
        tok, outs = int(eng.prefill(0, ids, 0)[-1].argmax()), []
        for pos in range(250, 262):
            lg = eng.decode([(0, tok, pos)])
            outs.append(lg.clone())
            tok = int(lg[0].argmax())
        return outs
    eager, graphs = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphs))


# --- zero-copy decode: the Triton kernel reads experts by address, from the device or from pinned host memory ---
def _expert_rows(E, H, I, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randn(E, 3 * I * H, device="cuda", generator=g) * H ** -0.5
    return rows.to(torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("T,k,H,I", [(1, 8, 2048, 768), (8, 8, 2048, 768), (5, 8, 256, 128), (3, 6, 96, 40),
                                     (16, 2, 64, 32)])
def test_decode_kernel_matches_reference_and_reads_host_memory_in_place(T, k, H, I):
    """Against the float32 oracle; the same bits when any of the experts are read from pinned host memory instead
    of the device (odd sizes and k check the masks). Several tokens share some of the 12 experts."""
    from moestream.kernels.decode import experts_by_address
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    E = 12
    rows = _expert_rows(E, H, I, seed=T)
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows)
    book = AddressBook()
    book.add(rows)
    book.add(host)
    step = rows.stride(0) * rows.element_size()
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    dev_addr = rows.data_ptr() + ids * step
    host_addr = host.data_ptr() + ids * step
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    w = torch.softmax(torch.randn(T, k, device="cuda"), -1).to(torch.bfloat16)
    out = experts_by_address(x, dev_addr, w, I)
    ref = experts_by_address_reference(x.cpu(), dev_addr.cpu(), w.cpu(), I, book=book).cuda()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert torch.isfinite(out).all() and rel < 1e-2, rel
    on_host = torch.rand(E, device="cuda") < 0.5          # as a cache has it: each expert in one place
    mixed = torch.where(on_host[ids], host_addr, dev_addr)
    for addrs in (host_addr, mixed):
        assert torch.equal(experts_by_address(x, addrs, w, I), out)


@needs_cuda
def test_zero_copy_decode_hash_same_on_every_placement_and_cache():
    """Zero-copy decode (the default on CUDA): all on the GPU, no cache, caches from the smallest to every expert,
    eager and captured: the same greedy tokens; with a cache the misses are read in place and then uploaded."""
    spec = "synth:tiny:dtype=bfloat16"
    prompt = list(range(3, 60, 2))
    hashes, reads = set(), {}
    for kw in ({}, {"cuda_graphs": False}, {"cpu_moe": True}, {"cpu_moe": True, "moe_cache_mib": 0},
               {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 100},
               {"cpu_moe": True, "moe_cache_mib": 100, "cuda_graphs": False}, {"n_cpu_moe": 1, "moe_cache_mib": 3},
               {"cpu_moe": True, "stage_host_reads": True}, {"cpu_moe": True, "moe_cache_mib": 3,
                                                             "stage_host_reads": True}):
        llm = LLM(spec, ctx_size=256, device="cuda", **kw)
        assert llm.engine.decode_kernel is not None
        hashes.add(llm.generate(prompt, max_tokens=32, ignore_eos=True).sha256)
        reads[str(kw)] = llm.stats()["total"]["host_reads"]
    assert len(hashes) == 1, hashes
    assert reads[str({"cpu_moe": True})] > reads[str({"cpu_moe": True, "moe_cache_mib": 100})] > 0


@needs_cuda
def test_batched_zero_copy_decode_identical_on_every_placement():
    """Three sequences decoding in one step: the same logits all on the GPU, from host memory with no cache, and
    behind a cache, captured and eager."""
    def run(**kw):
        return decode_three(LLM("synth:tiny:dtype=bfloat16", ctx_size=64, device="cuda", n_seq=3, **kw).engine)
    base = run()
    for kw in ({"cpu_moe": True}, {"cpu_moe": True, "moe_cache_mib": 12}, {"cpu_moe": True, "moe_cache_mib": 12,
                                                                          "cuda_graphs": False},
               {"cpu_moe": True, "stage_host_reads": True}, {"cpu_moe": True, "moe_cache_mib": 12,
                                                             "stage_host_reads": True}):
        assert all(torch.equal(a, b) for a, b in zip(run(**kw), base)), kw


@needs_cuda
def test_read_through_keeps_the_hash_and_lands_experts():
    """--read-through (added after the last GPU run): the greedy tokens of every placement, and experts landed
    by the decode kernel as it read them."""
    spec, prompt = "synth:tiny:dtype=bfloat16", list(range(3, 60, 2))
    want = LLM(spec, ctx_size=256, device="cuda").generate(prompt, max_tokens=32, ignore_eos=True).sha256
    for kw in ({"moe_cache_mib": 3}, {"moe_cache_mib": 100}, {"moe_cache_mib": 100, "cuda_graphs": False},
               {"moe_cache_mib": 100, "stage_host_reads": True}):
        llm = LLM(spec, ctx_size=256, device="cuda", cpu_moe=True, read_through=True, **kw)
        assert llm.generate(prompt, max_tokens=32, ignore_eos=True).sha256 == want, kw
        assert llm.stats()["total"]["landed"] > 0, kw
