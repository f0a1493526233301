"""The grouped decode kernel (kernels/decode_grouped.py: a step of several tokens reads each routed expert once for
every token that chose it) compiled, in bfloat16, on a CUDA GPU (`pytest -m cuda`); tests/test_triton_kernels.py
checks the same kernel in Triton's interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _step(T, shared, seed):
    """A step of T tokens, k=8 of E experts, at the model's shape: device rows, the same bytes in pinned host rows in
    another order (expert e at host row perm[e]), the ids, both addresses, x, weights and I."""
    k, H, I = 8, 2048, 768
    E = 24 if shared else T * k
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = (torch.randn(E, 3 * I * H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    perm = torch.randperm(E, device="cuda", generator=g)
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host[perm.cpu()] = rows.cpu()
    if shared:
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
    else:
        ids = torch.randperm(E, device="cuda", generator=g)[:T * k].view(T, k)
    step = rows.stride(0) * rows.element_size()
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1).to(torch.bfloat16)
    return rows, host, ids, rows.data_ptr() + ids * step, host.data_ptr() + perm[ids] * step, x, w, I


@pytest.mark.parametrize("T,shared", [(2, True), (3, True), (8, True), (16, True), (8, False), (16, False)])
def test_grouped_decode_kernel_matches_reference_and_the_one_token_kernel(T, shared):
    """Close to the float32 oracle, to the one-token kernel token by token and to the per-choice kernel; the same
    bits with any experts read from pinned host memory (in another sort order), and with the tokens in another
    order in the same batch."""
    from moestream.kernels.decode import experts_by_address
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    rows, host, ids, dev_addr, host_addr, x, w, I = _step(T, shared, seed=T)
    book = AddressBook()
    book.add(rows)
    book.add(host)
    out = experts_by_address(x, dev_addr, w, I)
    ref = experts_by_address_reference(x.cpu(), dev_addr.cpu(), w.cpu(), I, book=book).cuda()
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2, _rel(out, ref)
    one = torch.cat([experts_by_address(x[t:t + 1], dev_addr[t:t + 1], w[t:t + 1], I) for t in range(T)])
    assert _rel(out, one) < 1e-2, _rel(out, one)
    assert _rel(out, experts_by_address(x, dev_addr, w, I, grouped=False)) < 1e-2
    on_host = torch.arange(rows.shape[0], device="cuda") % 3 == 0       # as a cache has it: each expert in one place
    for addrs in (host_addr, torch.where(on_host[ids], host_addr, dev_addr)):
        assert torch.equal(experts_by_address(x, addrs, w, I), out)
    back = torch.arange(T - 1, -1, -1, device="cuda")                  # the tokens reversed: other places in a run
    assert torch.equal(experts_by_address(x[back], dev_addr[back], w[back], I), out[back])


def test_grouped_decode_kernel_gives_a_token_the_same_bits_in_any_batch():
    """A token's bits whatever other tokens share its step, across batch widths too (T = 2, 5 and 16 compile
    different member widths, MP = 2, 8, 16). Each member's sums are the same operations on the same bytes; only the
    compiler could make them differ between widths. If this fails the kernel is still deterministic for a given T,
    but a stream's bits then depend on how many streams decode with it."""
    from moestream.kernels.decode import experts_by_address
    rows, host, ids, dev_addr, host_addr, x, w, I = _step(16, True, seed=5)
    out = experts_by_address(x, dev_addr, w, I)
    for sub in ([3, 11], [0, 4, 8, 12, 15], [15, 0]):
        sub = torch.tensor(sub, device="cuda")
        assert torch.equal(experts_by_address(x[sub], dev_addr[sub], w[sub], I), out[sub]), sub.tolist()


def test_grouped_decode_kernel_lands_the_host_read_experts_and_is_graph_safe():
    """Read-through in a several-token step: the experts read from pinned host memory, the distinct ones in
    ascending id, land in the landing slots (landing_slots_grouped) with their bytes, no other slot is written, the
    output is unchanged; the same launch captured in a CUDA graph (no host sync) gives the same bits and landings."""
    from moestream.kernels.decode import experts_by_address, landing_slots_grouped
    from moestream.kernels.stage import Landing
    T, E = 8, 24
    rows, host, ids, dev_addr, host_addr, x, w, I = _step(T, True, seed=9)
    pool = torch.zeros(6, rows.shape[1], dtype=rows.dtype, device="cuda")
    step = rows.stride(0) * rows.element_size()
    on_host = torch.arange(E, device="cuda") % 2 == 1
    addrs = torch.where(on_host[ids], host_addr, dev_addr)
    host_tab = host_addr.new_zeros(E)
    host_tab[ids.reshape(-1)] = host_addr.reshape(-1)                  # each routed expert's host row
    land = pool.data_ptr() + torch.arange(5, device="cuda") * step
    want = landing_slots_grouped(ids.reshape(-1).tolist(), on_host[ids].reshape(-1).tolist(), 5)
    assert len(want) == 5
    plain = experts_by_address(x, addrs, w, I)
    landing = Landing(ids, host_tab, land)
    assert torch.equal(experts_by_address(x, addrs, w, I, landing), plain)
    assert all(torch.equal(pool[i], rows[e]) for e, i in want) and not pool[5].any()
    pool.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts_by_address(x, addrs, w, I, landing)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, plain)
    assert all(torch.equal(pool[i], rows[e]) for e, i in want) and not pool[5].any()
