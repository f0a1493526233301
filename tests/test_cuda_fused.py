"""The fused decode kernels (kernels/fused.py, kernels/shared_expert.py) on a CUDA GPU against the eager torch ops
they replace (run on the GPU machine: `pytest -m cuda`)."""
from __future__ import annotations

import pytest
import torch

from batched import first_decodes

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("nh,nkv,hd,rd", [(8, 2, 128, 128), (96, 8, 128, 64)])     # whole heads; GLM-4.5-Air's
def test_fused_qk_rope_kv_matches_the_eager_ops(norm, nh, nkv, hd, rd):
    """Head norms, rotary embedding (on each head's first rd dims) and the cache writes of a decode step in one
    kernel, against layers.py's ops and gated_attention.py's partial_rope; only each token's own (sequence,
    position) rows of the caches change."""
    from moestream.kernels.fused import qk_rope_kv
    from moestream.models.gated_attention import partial_rope
    from moestream.models.layers import rms_norm
    T, n_seq, ctx, eps = 3, 4, 64, 1e-6
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, device="cuda").to(torch.bfloat16)
    qw, kw = (torch.rand(hd, device="cuda") + 0.5).to(torch.bfloat16), (torch.rand(hd, device="cuda") + 0.5).to(torch.bfloat16)
    ang = torch.rand(T, rd // 2, device="cuda") * 6
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
    rq, rk = partial_rope(rq.float(), cos.float(), sin.float()), partial_rope(rk.float(), cos.float(), sin.float())
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
    models/attention.py's ops in float32; only each token's own (sequence, position) rows of the caches change."""
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
        return first_decodes("synth:tiny:dtype=bfloat16", 8, fused, dtype)
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
