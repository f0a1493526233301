"""kernels/gemv.py's decode GEMVs on the CPU, through Triton's interpreter (tests/interpreted.py), against the torch
ops they replace in float32: the GEMV with and without the add and norm before it, and the router's add, norm,
product, softmax and top-k in one launch. The cuda tests (tests/test_cuda.py) run them compiled, in bf16."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from interpreted import close, run_check

CHECKS = ["linear", "norm_linear", "norm_route", "norm_route_ties"]


@pytest.mark.parametrize("check", CHECKS)
def test_gemv_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def _rms(s, nw, eps):
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * nw


def linear():
    """Row counts that are not a multiple of the programs' tile (the masks), K under and over a tile, a bias; a
    several-token x goes to F.linear."""
    from moestream.kernels import gemv
    g = torch.Generator().manual_seed(0)
    for N, K, bias in ((70, 96, False), (300, 1100, True), (1030, 64, False)):
        x, w = torch.randn(1, K, generator=g), torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g) if bias else None
        close(gemv.linear(x, w, b), F.linear(x, w, b))
    x3 = torch.randn(3, 96, generator=g)
    w = torch.randn(70, 96, generator=g)
    assert torch.equal(gemv.linear(x3, w), F.linear(x3, w))


def norm_linear():
    """The new residual stream exactly h + delta; the normed row and the product as the eager ops give them."""
    from moestream.kernels import gemv
    g = torch.Generator().manual_seed(1)
    for N, K in ((70, 96), (600, 1536)):
        h, d = torch.randn(1, K, generator=g), torch.randn(1, K, generator=g)
        nw, w, b = torch.randn(K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        h2, normed, y = gemv.norm_linear(h, d, nw, 1e-6, w, b)
        assert torch.equal(h2, h + d)
        ref = _rms(h + d, nw, 1e-6)
        close(normed, ref)
        close(y, F.linear(ref, w, b))
    with pytest.raises(ValueError, match="one token"):
        gemv.norm_linear(torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(4, 8))


def _route_ref(h, d, nw, router, k, renorm, eps=1e-6):
    probs = torch.softmax(F.linear(_rms(h + d, nw, eps), router), -1)
    w, ids = torch.topk(probs, k, -1)
    return (w / w.sum(-1, keepdim=True) if renorm else w), ids


def norm_route():
    """Several tokens, expert counts that are and are not a multiple of a program's experts, top-k with and
    without renormalisation; twice in a row (the counts reset themselves), the same bits both times."""
    from moestream.kernels import gemv
    g = torch.Generator().manual_seed(2)
    for T, E, K, k, renorm in ((1, 128, 256, 8, True), (5, 60, 96, 4, False), (3, 10, 1100, 2, True)):
        h, d = torch.randn(T, K, generator=g), torch.randn(T, K, generator=g)
        nw, router = torch.randn(K, generator=g), torch.randn(E, K, generator=g)
        h2, normed, w, ids, _ = gemv.norm_route(h, d, nw, 1e-6, router, k, renorm, torch.float32)
        assert torch.equal(h2, h + d)
        close(normed, _rms(h + d, nw, 1e-6))
        rw, rids = _route_ref(h, d, nw, router, k, renorm)
        assert torch.equal(ids, rids)
        close(w, rw)
        tab, kept = torch.randint(0, 1 << 40, (E,), generator=g), torch.full((T * k + 3,), -1)
        again = gemv.norm_route(h, d, nw, 1e-6, router, k, renorm, torch.float32, (tab, kept))
        assert torch.equal(again[2], w) and torch.equal(again[3], ids)
        assert torch.equal(again[4], tab[ids]) and torch.equal(kept[:T * k], ids.reshape(-1))
        assert (kept[T * k:] == -1).all()
        assert norm_route_addrs_none(gemv, h, d, nw, router, k, renorm, tab)
        assert not gemv._election_counts(h.device).any()


def norm_route_addrs_none(gemv, h, d, nw, router, k, renorm, tab) -> bool:
    """No table: no addresses; a table without a row for the ids: the addresses alone."""
    plain = gemv.norm_route(h, d, nw, 1e-6, router, k, renorm, torch.float32)
    only = gemv.norm_route(h, d, nw, 1e-6, router, k, renorm, torch.float32, (tab, None))
    return plain[4] is None and torch.equal(only[4], tab[plain[3]])


def norm_route_ties():
    """Equal logits (two experts with the same router row) go to the lower id first, as torch.topk's order."""
    from moestream.kernels import gemv
    g = torch.Generator().manual_seed(3)
    K, E = 64, 16
    router = torch.randn(E, K, generator=g)
    router[9] = router[4]
    h = (router[4] * 5)[None]                                  # experts 4 and 9 lead, tied
    d = torch.zeros(1, K)
    _, _, w, ids, _ = gemv.norm_route(h, d, torch.ones(K), 1e-6, router, 3, False, torch.float32)
    assert ids[0, :2].tolist() == [4, 9] and w[0, 0] == w[0, 1]


if __name__ == "__main__":
    globals()[sys.argv[1]]()
