"""The fused kernels DeepSeek-V3's and GLM-4.5's decode steps take (kernels/gemv.py's norm_route with the sigmoid
router, kernels/shared_expert.py without a gate, kernels/mla.py's absorbed attention and its rope_kv): through
Triton's interpreter against their torch forms (tests/interpreted.py), and synth:tiny-deepseek's and synth:tiny-glm's
decode steps through them against their eager steps; on CUDA (`-m cuda`) the same kernels compiled at the real
models' widths. The decode path around them (graphs, no host reads, the stand-ins): tests/test_mla_decode.py."""
from __future__ import annotations

import sys

import pytest
import torch

from moestream import LLM

from batched import join_and_leave
from interpreted import close, run_check
from mla_stand_ins import rope_kv_ops

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("nh,r,dr,n", [(128, 512, 64, 4096), (128, 512, 64, 256), (16, 512, 64, 1024),
                                       (8, 64, 16, 256)])
def test_mla_attention_compiled_matches_the_torch_form(nh, r, dr, n):
    """kernels/mla.py compiled, bf16, DeepSeek-V3's widths (128 heads, r 512, dr 64) and tiny-deepseek's, against
    latent_attention (float32 softmax on the same bf16 inputs): within 2% of the largest output (the probabilities
    rounded to bf16, as tests/test_cuda_fused.py's decode attention); a token's bits the same alone and in the
    batch, and on a second call."""
    from moestream.kernels.mla import mla_decode_attention
    from moestream.models.mla import latent_attention
    g = torch.Generator(device="cuda").manual_seed(nh + n)
    latents = torch.randn(3, 1, 4096, r, device="cuda", generator=g).bfloat16()
    rot_keys = torch.randn(3, 1, 4096, dr, device="cuda", generator=g).bfloat16()
    seq = torch.tensor([1, 0, 2, 1], device="cuda")
    pos = torch.tensor([0, 63, n - 1, n // 2 + 5], device="cuda")
    q_lat = (torch.randn(nh, 4, r, device="cuda", generator=g) * 0.1).bfloat16().transpose(0, 1)
    q_rot = (torch.randn(4, nh, dr, device="cuda", generator=g) * 0.1).bfloat16()
    scale = 192 ** -0.5
    out = mla_decode_attention(q_lat, q_rot, latents, rot_keys, seq, pos, n, scale)
    mask = torch.arange(n, device="cuda")[None, :] <= pos[:, None]
    ref = latent_attention(q_lat, q_rot, latents, rot_keys, seq, mask, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (4, nh, r)
    assert (out.float() - ref.float()).abs().max() < 0.02 * ref.float().abs().max()
    assert torch.equal(mla_decode_attention(q_lat, q_rot, latents, rot_keys, seq, pos, n, scale), out)
    i = torch.tensor([2], device="cuda")
    assert torch.equal(mla_decode_attention(q_lat[i], q_rot[i], latents, rot_keys, seq[i], pos[i], n, scale), out[i])


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_rope_kv_compiled_matches_the_torch_ops(interleaved):
    """mla_rope_kv compiled, bf16, DeepSeek-V3's widths (128 heads of 128 + 64, r 512): within bf16 rounding of
    the torch ops it replaces, the caches written at the tokens' places only."""
    from moestream.kernels.mla import mla_rope_kv
    g = torch.Generator(device="cuda").manual_seed(9)
    T, nh, dn, r, dr = 4, 128, 128, 512, 64
    seq, pos = torch.tensor([2, 0, 1, 0], device="cuda"), torch.tensor([5, 0, 1000, 4095], device="cuda")
    q = torch.randn(T, nh, dn + dr, device="cuda", generator=g).bfloat16()
    kv = torch.randn(T, r + dr, device="cuda", generator=g).bfloat16()
    norm = (torch.rand(r, device="cuda", generator=g) + 0.5).bfloat16()
    ang = torch.rand(T, dr // 2, device="cuda", generator=g) * 6
    cos, sin = (torch.cat([f(ang)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    caches = [torch.randn(3, 1, 4096, w, device="cuda", generator=g).bfloat16() for w in (r, dr)]
    want = [t.clone() for t in caches]
    q_rot = mla_rope_kv(q, kv, norm, 1e-6, cos, sin, *caches, seq, pos, interleaved)
    ref = rope_kv_ops(q, kv, norm, 1e-6, cos, sin, *want, seq, pos, interleaved)
    assert (q_rot.float() - ref.float()).abs().max() < 0.02 * ref.float().abs().max()
    for got, ref in zip(caches, want):
        assert (got.float() - ref.float()).abs().max() < 0.02 * ref.float().abs().max()
        got[seq, :, pos] = ref[seq, :, pos]
        assert torch.equal(got, ref)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("T,E,groups,topk_group,k", [(1, 256, 8, 4, 8), (8, 256, 8, 4, 8), (3, 128, 1, 1, 8),
                                                     (2, 384, 1, 1, 8)])
def test_group_limited_route_compiled_matches_route(T, E, groups, topk_group, k):
    """norm_route's sigmoid router compiled, bf16 activations (DeepSeek-V3's 256 experts in 8 groups, GLM-4.5-Air's
    128 in one, Kimi K2's 384): the same choices as route on the kernel's normed rows but where two biased scores
    nearly tie (the logits are float32 sums in another order), the weights within float32 rounding; 100 launches,
    the first one's bits."""
    from moestream.arch.blocks import Router
    from moestream.kernels.gemv import _election_counts, norm_route
    from moestream.models.router import route
    H = 7168
    g = torch.Generator(device="cuda").manual_seed(E + T)
    h, d = (torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(2))
    nw = torch.rand(H, device="cuda", generator=g).bfloat16()
    router = (torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    spec = Router("sigmoid", True, groups, 2.5, topk_group)
    opts = dict(gating="sigmoid", bias=bias, groups=groups, topk_group=topk_group, scale=2.5)
    h2, x, w, ids, _ = norm_route(h, d, nw, 1e-6, router, k, True, torch.bfloat16, **opts)
    assert torch.equal(h2, h + d)
    rw, rids = route(x, router, k, True, spec, bias)
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.8
    order, rorder = ids.argsort(-1), rids.argsort(-1)
    assert torch.allclose(w.gather(-1, order)[same].float(), rw.gather(-1, rorder)[same].float(), rtol=1e-2)
    for _ in range(100):
        again = norm_route(h, d, nw, 1e-6, router, k, True, torch.bfloat16, **opts)
        assert torch.equal(again[2], w) and torch.equal(again[3], ids)
    assert not _election_counts(h.device).any()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("T,H,I", [(1, 7168, 2048), (4, 7168, 2048), (3, 4096, 1408)])
def test_ungated_shared_expert_compiled_matches_the_torch_form(T, H, I):
    """The gate-less shared expert compiled (DeepSeek-V3's and GLM-4.5-Air's shapes), bf16, against `_shared`'s torch
    form on float32 copies of the weights: within 1e-2 (relative norm, as the gated kernel's cuda test)."""
    import types
    from moestream.kernels.shared_expert import shared_expert
    from moestream.models.moe import _shared
    g = torch.Generator(device="cuda").manual_seed(T + I)
    names = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
    lw = {n: (torch.randn(*s, device="cuda", generator=g) * s[1] ** -0.5).bfloat16()
          for n, s in zip(names, ((I, H), (I, H), (H, I)))}
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    out = (torch.randn(T, H, device="cuda", generator=g) * 0.1).bfloat16()
    y = shared_expert(x, *(lw[n] for n in names), None, out)
    cfg = types.SimpleNamespace(shared_expert_intermediate_size=I)
    ref = _shared(x.float(), {n: w.float() for n, w in lw.items()}, cfg, out.float())
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(shared_expert(x, *(lw[n] for n in names), None, out), y)


# --- the fused kernels, through Triton's interpreter (tests/interpreted.py) ---
CHECKS = ["group_limited_route", "ungated_shared_expert", "mla_rope_kv", "mla_attention", "deepseek_decode",
          "glm_decode"]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def group_limited_route():
    """norm_route past plain softmax against models/router.py's route on the kernel's own normed rows (float32):
    the same ids, the weights within 1e-5 (as tests/test_gemv.py's softmax check). DeepSeek-V3's form (sigmoid, a
    correction bias, groups, a scale, renormalised), several groups kept of more, GLM-4.5's (one group, experts
    not a power of two), DeepSeek-V2's (softmax over groups, no bias, not renormalised); with a zero-copy table."""
    from moestream.arch.blocks import Router
    from moestream.kernels import gemv
    from moestream.models.router import route
    g = torch.Generator().manual_seed(5)
    cases = (  # T, E, K, k, renorm, Router(gating, bias, groups, scale, topk_group)
        (3, 16, 96, 4, True, Router("sigmoid", True, 4, 2.5, 2)),
        (1, 64, 64, 6, False, Router("sigmoid", True, 8, 1.0, 3)),
        (5, 20, 48, 4, True, Router("sigmoid", True, 1, 1.0, 1)),
        (2, 32, 40, 3, False, Router("softmax", False, 4, 1.5, 2)),
    )
    for T, E, K, k, renorm, spec in cases:
        h, d = torch.randn(T, K, generator=g), torch.randn(T, K, generator=g)
        nw, router = torch.rand(K, generator=g) + 0.5, torch.randn(E, K, generator=g) * K ** -0.5
        bias = torch.randn(E, generator=g) * 0.1 if spec.bias else None
        opts = dict(gating=spec.gating, bias=bias, groups=spec.groups, topk_group=spec.topk_group, scale=spec.scale)
        h2, normed, w, ids, _ = gemv.norm_route(h, d, nw, 1e-6, router, k, renorm, torch.float32, **opts)
        assert torch.equal(h2, h + d)
        rw, rids = route(normed, router, k, renorm, spec, bias)
        assert torch.equal(ids, rids), (spec, ids, rids)
        close(w, rw)
        tab, kept = torch.randint(0, 1 << 40, (E,), generator=g), torch.full((T * k,), -1)
        again = gemv.norm_route(h, d, nw, 1e-6, router, k, renorm, torch.float32, (tab, kept), **opts)
        assert torch.equal(again[2], w) and torch.equal(again[3], ids)
        assert torch.equal(again[4], tab[ids]) and torch.equal(kept, ids.reshape(-1))
    assert not gemv._election_counts(h.device).any()


def ungated_shared_expert():
    """kernels/shared_expert.py without a gate (DeepSeek-V3's, GLM-4.5's) against models/moe.py's `_shared`, 1, 3
    and 8 tokens, H and I not powers of two, the default blocks and small ones; `out` read, not written."""
    import types
    from moestream.kernels.shared_expert import shared_expert
    from moestream.models.moe import _shared
    H, I = 76, 42
    g = torch.Generator().manual_seed(4)
    lw = {"ffn_gate_shexp.weight": torch.randn(I, H, generator=g) * H ** -0.5,
          "ffn_up_shexp.weight": torch.randn(I, H, generator=g) * H ** -0.5,
          "ffn_down_shexp.weight": torch.randn(H, I, generator=g) * I ** -0.5}
    cfg = types.SimpleNamespace(shared_expert_intermediate_size=I)
    for T in (1, 3, 8):
        x, out = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
        kept = out.clone()
        want = _shared(x, lw, cfg, out)
        for config in ((), (((4, 32, 1), (8, 16, 1)),)):
            y = shared_expert(x, *(lw[f"ffn_{n}_shexp.weight"] for n in ("gate", "up", "down")), None, out, *config)
            close(y, want)
        assert torch.equal(out, kept)


def mla_rope_kv():
    """kernels/mla.py's mla_rope_kv against the torch ops it replaces (models/mla.py's), rotary on adjacent pairs
    and on halves, within 1e-5; the caches written at each token's (sequence, position) and nowhere else."""
    from moestream.kernels.mla import mla_rope_kv as kernel
    g = torch.Generator().manual_seed(7)
    T, nh, dn, r, dr = 3, 4, 32, 64, 16
    seq, pos = torch.tensor([2, 0, 1]), torch.tensor([5, 0, 31])
    q, kv = torch.randn(T, nh, dn + dr, generator=g), torch.randn(T, r + dr, generator=g)
    norm = torch.rand(r, generator=g) + 0.5
    ang = torch.rand(T, dr // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    for interleaved in (True, False):
        caches = [torch.randn(3, 1, 32, r, generator=g), torch.randn(3, 1, 32, dr, generator=g)]
        want = [t.clone() for t in caches]
        q_rot = kernel(q, kv, norm, 1e-6, cos, sin, *caches, seq, pos, interleaved)
        close(q_rot, rope_kv_ops(q, kv, norm, 1e-6, cos, sin, *want, seq, pos, interleaved))
        for got, ref in zip(caches, want):
            close(got[seq, :, pos], ref[seq, :, pos])
            got[seq, :, pos] = ref[seq, :, pos]
            assert torch.equal(got, ref)


def mla_attention():
    """kernels/mla.py against models/mla.py's latent_attention in float32, within 1e-5 (relative norm, as the
    other kernels' checks): fewer heads than a program's (masked rows), two head blocks the second part-full, one
    split and several, positions 0, mid-chunk and n - 1, q_lat as MLA passes it (a transposed view); each token's
    bits the same alone, in the batch and in another order (the batch's other tokens change nothing)."""
    from moestream.kernels.mla import mla_decode_attention
    from moestream.models.mla import latent_attention
    g = torch.Generator().manual_seed(6)
    for nh, r, dr, n in ((8, 64, 16, 128), (20, 32, 16, 64)):
        latents, rot_keys = torch.randn(3, 1, 256, r, generator=g), torch.randn(3, 1, 256, dr, generator=g)
        seq, pos = torch.tensor([1, 0, 2, 1]), torch.tensor([0, 37, n - 1, n // 2])
        q_lat = torch.randn(nh, 4, r, generator=g).transpose(0, 1)                  # (B, nh, r), a view
        q_rot = torch.randn(4, nh, dr, generator=g)
        scale = (r // 2) ** -0.5
        out = mla_decode_attention(q_lat, q_rot, latents, rot_keys, seq, pos, n, scale)
        mask = torch.arange(n)[None, :] <= pos[:, None]
        close(out, latent_attention(q_lat, q_rot, latents, rot_keys, seq, mask, scale))
        for order in ([2], [3, 0], [3, 2, 1, 0]):
            i = torch.tensor(order)
            alone = mla_decode_attention(q_lat[i], q_rot[i], latents, rot_keys, seq[i], pos[i], n, scale)
            assert torch.equal(alone, out[i]), order


def deepseek_decode():
    """synth:tiny-deepseek's decode steps (tests/batched.py's join_and_leave) with the fused kernels it takes, all
    Triton here (the latent attention's two, norm_route's sigmoid router, the ungated shared expert, add_rms_norm),
    against its eager steps, within 1e-5; prompts run none (their logits equal)."""
    import types
    from moestream.kernels import fused

    def run(with_fused: bool):
        eng, calls = LLM("synth:tiny-deepseek", device="cpu", ctx_size=128, n_seq=2).engine, []
        if with_fused:
            counted = lambda name: lambda *a, **kw: (calls.append(name), getattr(fused, name)(*a, **kw))[1]
            eng.fused = types.SimpleNamespace(**{n: counted(n) for n in ("mla_rope_kv", "mla_decode_attention",
                                                                         "add_rms_norm", "norm_route",
                                                                         "shared_expert")})
        return join_and_leave(eng), calls
    (eager, _), (out, calls) = run(False), run(True)
    assert calls.count("mla_rope_kv") == calls.count("mla_decode_attention") == 4 * 8          # 8 steps
    assert calls.count("norm_route") == calls.count("shared_expert") == 3 * 8
    assert torch.equal(out[0], eager[0]) and torch.equal(out[4], eager[4])                  # the prompts
    for a, b in zip(out, eager):
        close(a, b)


def glm_decode():
    """synth:tiny-glm's decode steps (tests/batched.py's join_and_leave) through the fused attention (qk_rope_kv
    with its partial rotary, half of each 32-wide head, QK-norm and the q/k/v biases in the projection before it;
    decode_attention), add_rms_norm, norm_route's sigmoid router and the shared expert, all Triton here but the
    plain GEMVs (tests/test_decode_paths.py's torch stand-ins), against its eager steps: the same greedy tokens,
    logits within 1e-5; prompts run none (their logits equal)."""
    import types
    from test_decode_paths import _stand_in_fused
    from moestream.kernels import fused

    def run(with_fused: bool):
        eng, calls = LLM("synth:tiny-glm", device="cpu", ctx_size=128, n_seq=2).engine, []
        if with_fused:
            gemvs = _stand_in_fused(calls)
            counted = lambda name: lambda *a, **kw: (calls.append(name), getattr(fused, name)(*a, **kw))[1]
            eng.fused = types.SimpleNamespace(linear=gemvs.linear, norm_linear=gemvs.norm_linear,
                                              **{n: counted(n) for n in ("qk_rope_kv", "decode_attention",
                                                                         "add_rms_norm", "norm_route",
                                                                         "shared_expert")})
            assert eng.model.attention.fuses(eng.fused) and eng.cfg.rotary_dim < eng.cfg.head_dim
        return join_and_leave(eng), calls
    (eager, _), (out, calls) = run(False), run(True)
    assert calls.count("qk_rope_kv") == calls.count("decode_attention") == 4 * 8              # 8 steps
    assert torch.equal(out[0], eager[0]) and torch.equal(out[4], eager[4])                  # the prompts
    for a, b in zip(out, eager):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        close(a, b, 1e-5)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
