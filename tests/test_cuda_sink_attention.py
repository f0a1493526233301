"""gpt-oss's attention kernels compiled, on a CUDA GPU (`pytest -m cuda`), at gpt-oss's heads (64 query heads of 64,
8 KV heads, a window of 128) in bf16: the fused decode attention with sinks and a window (kernels/fused.py) and the
prompt's sink_attention (kernels/sink_attention.py) against their float32 oracles in models/layers.py; their bits
across batches and ubatch splits; tiny-gptoss through the engine. The interpreter runs the same kernels' indexing on
the CPU: tests/test_sink_attention.py."""
from __future__ import annotations

import pytest
import torch

from moestream import LLM

from batched import first_decodes

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NH, NKV, HD, WINDOW = 64, 8, 64, 128


def _cache(n_seq: int, ctx: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(n_seq, NKV, ctx, HD, device="cuda", generator=g).to(torch.bfloat16)
    return kc, torch.randn(kc.shape, device="cuda", generator=g).to(torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("window", [WINDOW, 0])
def test_fused_decode_attention_with_sinks_and_a_window(window):
    """Against layers.decode_attention (float32 softmax with the sink column) under the window's mask, for tokens
    inside the first chunk, at a chunk's edge, past the window and at the span's end; each token alone and the batch
    reversed give the batch's bits."""
    from moestream.kernels.fused import decode_attention as fused_attention
    from moestream.models.layers import decode_attention
    n = 1024
    kc, vc = _cache(3, 2048)
    seq = torch.tensor([1, 0, 2, 1], device="cuda")
    pos = torch.tensor([0, 63, n - 1, 300], device="cuda")
    q = torch.randn(4, NH, HD, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(NH, device="cuda").to(torch.bfloat16)
    out = fused_attention(q, kc, vc, seq, pos, n, sinks=sinks, window=window)
    keys = torch.arange(n, device="cuda")[None, :]
    mask = (keys <= pos[:, None]) & ((keys > pos[:, None] - window) if window else True)
    ref = decode_attention(q.float(), kc[seq, :, :n].float(), vc[seq, :, :n].float(), mask, sinks.float())
    assert (out.float() - ref).abs().max() < 0.02 * ref.abs().max()
    for i in range(4):
        alone = fused_attention(q[i:i + 1], kc, vc, seq[i:i + 1], pos[i:i + 1], n, sinks=sinks, window=window)
        assert torch.equal(alone[0], out[i])
    back = fused_attention(q.flip(0), kc, vc, seq.flip(0), pos.flip(0), n, sinks=sinks, window=window)
    assert torch.equal(back.flip(0), out)


@needs_cuda
@pytest.mark.parametrize("window", [WINDOW, 0])
@pytest.mark.parametrize("Tq,Tk", [(2048, 2048), (1000, 1300)])
def test_sink_attention_matches_its_oracle(window, Tq, Tk):
    """A whole prompt and a chunk after a cached prefix, as attend passes them (views of the cache), against
    attention_sinks in float32."""
    from moestream.kernels.sink_attention import sink_attention
    from moestream.models.layers import attention_sinks
    kc, vc = _cache(2, 4096)
    k, v = kc[1:2, :, :Tk], vc[1:2, :, :Tk]
    q = torch.randn(Tq, NH, HD, device="cuda").to(torch.bfloat16).transpose(0, 1).unsqueeze(0)
    sinks = torch.randn(NH, device="cuda").to(torch.bfloat16)
    out = sink_attention(q, k, v, sinks, window)
    ref = attention_sinks(q.float(), k.float(), v.float(), sinks.float(), window)
    assert (out.float() - ref).abs().max() < 0.02 * ref.abs().max()


@needs_cuda
@pytest.mark.parametrize("window", [WINDOW, 0])
def test_sink_attention_bits_do_not_depend_on_the_ubatch_split(window):
    """A prompt of 1500 in one launch, and in chunks of 700, 77 and the rest (not multiples of the block): the same
    bits for every query (key blocks start at multiples of BLOCK; a block that masks a query out whole leaves its
    sums as they were)."""
    from moestream.kernels.sink_attention import sink_attention
    T = 1500
    kc, vc = _cache(1, T)
    q = torch.randn(1, NH, T, HD, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(NH, device="cuda").to(torch.bfloat16)
    whole = sink_attention(q, kc, vc, sinks, window)
    parts, a = [], 0
    for b in (700, 777, T):
        parts.append(sink_attention(q[:, :, a:b], kc[:, :, :b], vc[:, :, :b], sinks, window))
        a = b
    assert torch.equal(torch.cat(parts, dim=2), whole)


@needs_cuda
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 4}])
def test_tiny_gptoss_takes_the_kernels_and_captured_steps_give_the_eager_bits(kw):
    """synth:tiny-gptoss in bf16 on the GPU: its decode steps run the fused attention (sinks, window 16), its prompts
    sink_attention; positions 250..261 cross the 256-key span; captured steps give the eager steps' bits."""
    import moestream.models.attention as attention

    def run(graphs):
        eng = LLM("synth:tiny-gptoss:dtype=bfloat16", ctx_size=600, device="cuda", cuda_graphs=graphs, **kw).engine
        assert eng.fused is not None and eng.model.attention.fuses(eng.fused)
        ids = torch.randint(0, 1000, (250,), generator=torch.Generator().manual_seed(1)).tolist()
        tok, outs = int(eng.prefill(0, ids, 0)[-1].argmax()), []
        for pos in range(250, 262):
            lg = eng.decode([(0, tok, pos)]).clone()
            outs.append(lg)
            tok = int(lg[0].argmax())
        return outs
    calls = []
    kernel = attention.sink_attention
    attention.sink_attention = lambda *a, **kw: (calls.append(1), kernel(*a, **kw))[1]
    try:
        eager = run(False)
    finally:
        attention.sink_attention = kernel
    assert calls and len(calls) % 4 == 0          # each layer of each prompt ubatch
    assert all(torch.equal(a, b) for a, b in zip(run(True), eager))


@needs_cuda
def test_fused_gptoss_decode_as_close_to_float32_as_the_eager_ops():
    """The first decode logits of four prompts past the window with the fused kernels and with torch's bf16 ops,
    against the same bf16 weights run in float32: the fused step is as close (within 1.5x, as
    tests/test_cuda_fused.py's bound for the other families)."""
    def first(fused: bool, dtype: str = "bfloat16") -> torch.Tensor:
        return first_decodes("synth:tiny-gptoss:dtype=bfloat16", 4, fused, dtype, cuda_graphs=False)
    truth = first(False, "float32")
    fused, eager = first(True) - truth, first(False) - truth
    assert fused.norm() <= 1.5 * eager.norm() + 1e-3 * truth.norm()
