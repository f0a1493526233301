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
    seq = q.submit(list(zip(dst, src)), src.numel(), speculative=True)
    assert 0 < q.pending_bytes() <= src.numel() and q.speculative_inflight() > 0
    q.wait(seq, torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert q.pending_bytes() == 0 and q.speculative_inflight() == 0 and bool((dst == 1).all())
    q.submit(list(zip(dst, src)), src.numel(), speculative=False)   # done batches' marks go with poll, not only
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
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 12},
                                {"cpu_moe": True, "moe_cache_mib": 12, "zero_copy_decode": False}])
def test_captured_decode_matches_eager_across_a_span_boundary(kw):
    """Positions 250..261 cross the 256-key span: graphs captured per span give the eager decode's bits, all on
    the GPU and with host experts (zero-copy graphs); --no-zero-copy-decode with host experts decodes eagerly either
    way (the plain path)."""
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
@pytest.mark.parametrize("norm", [True, False])
def test_fused_qk_rope_kv_matches_the_eager_ops(norm):
    """Head norms, rotary embedding and the cache writes of a decode step in one kernel, against layers.py's ops;
    only each token's own (sequence, position) rows of the caches change."""
    from moestream.kernels.fused import qk_rope_kv
    from moestream.models.layers import apply_rope, rms_norm
    T, nh, nkv, hd, n_seq, ctx, eps = 3, 8, 2, 128, 4, 64, 1e-6
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, device="cuda").to(torch.bfloat16)
    qw, kw = (torch.rand(hd, device="cuda") + 0.5).to(torch.bfloat16), (torch.rand(hd, device="cuda") + 0.5).to(torch.bfloat16)
    ang = torch.rand(T, hd // 2, device="cuda") * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16), torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
    seq, pos = torch.tensor([2, 0, 3], device="cuda"), torch.tensor([5, 63, 0], device="cuda")
    kc = torch.randn(n_seq, nkv, ctx, hd, device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    kc0, vc0 = kc.clone(), vc.clone()
    q = qk_rope_kv(qkv, torch.cat([qw, kw]) if norm else None, eps, cos, sin, kc, vc, seq, pos, nh, nkv)
    rq, rk, rv = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    rq, rk, rv = rq.view(T, nh, hd), rk.view(T, nkv, hd), rv.view(T, nkv, hd)
    if norm:
        rq, rk = rms_norm(rq.float(), qw.float(), eps), rms_norm(rk.float(), kw.float(), eps)
    rq, rk = apply_rope(rq.float(), cos.float(), sin.float()), apply_rope(rk.float(), cos.float(), sin.float())
    assert (q.float() - rq).abs().max() < 0.05 * rq.abs().max()
    assert (kc[seq, :, pos].float() - rk).abs().max() < 0.05 * rk.abs().max()
    assert torch.equal(vc[seq, :, pos], rv)
    kc[seq, :, pos], vc[seq, :, pos] = kc0[seq, :, pos], vc0[seq, :, pos]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)         # nothing else written


@needs_cuda
@pytest.mark.parametrize("nh,nkv,hd,rd", [(16, 2, 256, 64), (6, 2, 64, 12)])
def test_fused_gated_attention_matches_the_eager_ops(nh, nkv, hd, rd):
    """Qwen3-Next's gated attention in a decode step (its heads, 256 wide with rotary on 64; a group of 3 and a
    rotary width not a power of two): gated_qk_rope_kv and decode_attention with the gates, in bf16, against
    models/hybrid.py's ops in float32; only each token's own (sequence, position) rows of the caches change."""
    from moestream.kernels.fused import decode_attention, gated_qk_rope_kv
    from moestream.models.gated_attention import partial_rope
    from moestream.models.layers import decode_attention as attend, rms_norm
    T, n_seq, ctx, n, eps, bf = 3, 4, 512, 256, 1e-6, torch.bfloat16
    qkv = torch.randn(T, (2 * nh + 2 * nkv) * hd, device="cuda").to(bf)     # per head [q_h | gate_h], then k, v
    w = (1 + 0.3 * torch.randn(2 * hd, device="cuda")).to(bf)                # the q then the k norm, as loaded
    ang = torch.rand(T, rd // 2, device="cuda") * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(bf), torch.cat([ang.sin()] * 2, -1).to(bf)     # (T, rd)
    seq, pos = torch.tensor([2, 0, 3], device="cuda"), torch.tensor([5, n - 1, 63], device="cuda")
    kc = torch.randn(n_seq, nkv, ctx, hd, device="cuda").to(bf)
    vc = torch.randn_like(kc)
    kc0, vc0 = kc.clone(), vc.clone()
    q, gate = gated_qk_rope_kv(qkv, w, eps, cos, sin, kc, vc, seq, pos, nh, nkv)
    o = decode_attention(q, kc, vc, seq, pos, n, gate)
    qg, rk, rv = qkv.split([2 * nh * hd, nkv * hd, nkv * hd], -1)
    rq, rg = qg.float().view(T, nh, 2 * hd).chunk(2, -1)
    rq = partial_rope(rms_norm(rq, w[:hd].float(), eps), cos.float(), sin.float())
    rk = partial_rope(rms_norm(rk.float().view(T, nkv, hd), w[hd:].float(), eps), cos.float(), sin.float())
    assert torch.equal(gate.float(), rg)
    assert (q.float() - rq).abs().max() < 0.05 * rq.abs().max()
    assert (kc[seq, :, pos].float() - rk).abs().max() < 0.05 * rk.abs().max()
    assert torch.equal(vc[seq, :, pos], rv.view(T, nkv, hd))
    mask = torch.arange(n, device="cuda")[None, :] <= pos[:, None]
    ref = attend(q.float(), kc[seq, :, :n].float(), vc[seq, :, :n].float(), mask) * torch.sigmoid(rg)
    assert (o.float() - ref).abs().max() < 0.02 * ref.abs().max()
    kc[seq, :, pos], vc[seq, :, pos] = kc0[seq, :, pos], vc0[seq, :, pos]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)         # nothing else written


@needs_cuda
def test_fused_decode_step_as_close_to_float32_as_the_eager_ops():
    """The first decode logits of eight prompts with the fused kernels and with torch's bf16 ops, against the same
    bf16 weights run in float32: the fused step is as close (within 1.5x: both round, in other places, and its
    router's float32 logits may pick another expert at a near-tie than the eager bf16 ones, or than float32)."""
    def first(fused: bool, dtype: str = "bfloat16") -> torch.Tensor:
        llm = LLM("synth:tiny:dtype=bfloat16", ctx_size=128, device="cuda", dtype=dtype)
        if not fused:
            llm.engine.fused = None
        eng, out = llm.engine, []
        for s in range(8):
            eng.prefill(0, list(range(3 + s, 40 + s)))
            out.append(eng.decode([(0, 11 + s, 37)]).float())
        return torch.cat(out)
    truth = first(False, "float32")
    fused, eager = first(True) - truth, first(False) - truth
    assert fused.norm() <= 1.5 * eager.norm() + 1e-3 * truth.norm()


@needs_cuda
@pytest.mark.parametrize("nh,nkv,hd,n", [(32, 4, 128, 256), (8, 2, 64, 1024), (4, 4, 128, 256)])
def test_fused_decode_attention_matches_the_two_matmuls(nh, nkv, hd, n):
    """Split over chunks of keys and merged, against layers.decode_attention (float32 softmax), for tokens of
    several sequences at positions inside the first chunk, at a chunk's edge and at the end of the span."""
    from moestream.kernels.fused import decode_attention as fused_attention
    from moestream.models.layers import decode_attention
    n_seq, ctx = 3, 2048
    kc = torch.randn(n_seq, nkv, ctx, hd, device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    seq = torch.tensor([1, 0, 2, 1], device="cuda")
    pos = torch.tensor([0, 63, n - 1, 100], device="cuda")
    q = torch.randn(4, nh, hd, device="cuda").to(torch.bfloat16)
    out = fused_attention(q, kc, vc, seq, pos, n)
    mask = torch.arange(n, device="cuda")[None, :] <= pos[:, None]
    ref = decode_attention(q, kc[seq, :, :n], vc[seq, :, :n], mask)
    assert (out.float() - ref.float()).abs().max() < 0.02 * ref.float().abs().max()


@needs_cuda
def test_fused_add_rms_norm_matches_the_two_ops():
    from moestream.kernels.fused import add_rms_norm
    from moestream.models.layers import rms_norm
    h, d = (torch.randn(3, 2048, device="cuda").to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(2048, device="cuda") + 0.5).to(torch.bfloat16)
    new_h, normed = add_rms_norm(h, d, w, 1e-6)
    assert torch.equal(new_h, h + d)                      # the residual stream keeps torch's bits
    ref = rms_norm(h + d, w, 1e-6)
    assert (normed.float() - ref.float()).abs().max() < 0.02 * ref.float().abs().max()


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


@needs_cuda
@pytest.mark.parametrize("T,H,I,dtype", [(1, 2048, 512, torch.bfloat16), (3, 2048, 512, torch.bfloat16),
                                         (8, 2048, 512, torch.bfloat16), (16, 2048, 512, torch.bfloat16),
                                         (5, 2048, 5632, torch.bfloat16), (3, 1000, 200, torch.bfloat16),
                                         (4, 2048, 512, torch.float32)])
def test_fused_shared_expert_matches_the_torch_form_and_keeps_its_bits(T, H, I, dtype):
    """kernels/shared_expert.py against models/moe.py's torch form (Qwen3-Next's shapes, Qwen1.5-MoE's wider
    one, sizes not powers of two, float32): within the activations' rounding of a float32 oracle; the same bits
    on a second call and with `out` (and x) at other addresses."""
    import types
    from moestream.kernels.shared_expert import shared_expert
    from moestream.models.moe import _shared
    g = torch.Generator(device="cuda").manual_seed(T * 7 + I)
    names = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")
    shapes = ((I, H), (I, H), (H, I), (1, H))
    lw = {n: (torch.randn(*s, device="cuda", generator=g) * s[1] ** -0.5).to(dtype) for n, s in zip(names, shapes)}
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    out = (torch.randn(T, H, device="cuda", generator=g) * 0.1).to(dtype)
    cfg = types.SimpleNamespace(shared_expert_intermediate_size=I)
    y = shared_expert(x, *(lw[n] for n in names), out)
    ref = _shared(x.float(), {n: w.float() for n, w in lw.items()}, cfg, out.float())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert y.dtype == dtype and y.shape == (T, H) and torch.isfinite(y).all()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < tol, rel
    eager = _shared(x, lw, cfg, out)                             # torch's own form, in the activations' dtype
    assert ((y.float() - eager.float()).norm() / ref.norm()).item() < 2 * tol
    assert torch.equal(shared_expert(x, *(lw[n] for n in names), out), y)
    big = torch.empty(3, T + 5, H, dtype=dtype, device="cuda")
    big[2, 5:] = out                                             # the same values at another address
    bx = torch.empty_like(big)
    bx[1, 3:T + 3] = x
    assert torch.equal(shared_expert(bx[1, 3:T + 3], *(lw[n] for n in names), big[2, 5:]), y)
