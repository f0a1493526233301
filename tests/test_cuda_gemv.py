"""kernels/gemv.py compiled, in bf16 on the GPU: one token's GEMV with and without the add and norm before it against
F.linear, and the router's launch against the eager router and top-k, many launches giving the same bits (the
interpreter runs the same kernels on the CPU: tests/test_gemv.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("T,k,E,renorm", [(1, 8, 128, True), (5, 6, 60, True), (16, 10, 512, True), (3, 2, 8, False)])
def test_norm_route_matches_the_eager_route(T, k, E, renorm):
    """kernels/gemv.py's add, norm, router, softmax and top-k in one launch against the eager ops on the same bf16
    inputs (its logits are float32 sums, not cuBLAS's bf16: ids may swap only where two probabilities nearly tie);
    launched 200 times, every launch gives the first one's bits (the election of the last program is sound)."""
    from moestream.kernels.gemv import _election_counts, norm_route
    from moestream.models.layers import rms_norm
    from moestream.models.router import route
    H = 2048
    g = torch.Generator(device="cuda").manual_seed(E)
    h, d = (torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(2))
    nw = torch.rand(H, device="cuda", generator=g).bfloat16()
    router = (torch.randn(E, H, device="cuda", generator=g) * 0.05).bfloat16()
    h2, x, w, ids, _ = norm_route(h, d, nw, 1e-6, router, k, renorm, torch.bfloat16)
    assert torch.equal(h2, h + d)
    ref = rms_norm(h + d, nw, 1e-6)
    assert (x.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
    rw, rids = route(ref, router, k, renorm)
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.8
    order, rorder = ids.argsort(-1), rids.argsort(-1)
    assert torch.allclose(w.gather(-1, order)[same].float(), rw.gather(-1, rorder)[same].float(), rtol=2e-2, atol=1e-3)
    for _ in range(200):
        again = norm_route(h, d, nw, 1e-6, router, k, renorm, torch.bfloat16)
        assert torch.equal(again[2], w) and torch.equal(again[3], ids)
    assert not _election_counts(h.device).any()


@needs_cuda
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096), (12352, 2048), (100, 96)])
def test_gemv_matches_the_eager_linear(N, K):
    """One token's GEMV, with and without the add and norm before it, against F.linear in float32 on bf16 data."""
    from moestream.kernels.gemv import linear, norm_linear
    from moestream.models.layers import rms_norm
    g = torch.Generator(device="cuda").manual_seed(N)
    h, d = (torch.randn(1, K, device="cuda", generator=g).bfloat16() for _ in range(2))
    nw = torch.rand(K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    ref = torch.nn.functional.linear(h.float(), w.float())
    assert (linear(h, w).float() - ref).norm() <= 0.01 * ref.norm()
    h2, x, y = norm_linear(h, d, nw, 1e-6, w)
    assert torch.equal(h2, h + d)
    xr = rms_norm(h + d, nw, 1e-6)
    assert (x.float() - xr.float()).abs().max() <= 0.02 * xr.float().abs().max()
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert (y.float() - ref).norm() <= 0.01 * ref.norm()
