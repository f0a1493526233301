"""The decode expert kernel on the reference shapes: correctness against the plain-torch oracle, the same bits
from device and pinned host memory, and its time beside the grouped GEMM path, with 0-8 experts read from host.

    python bench/decode_kernel.py [--sweep]
"""
import sys

import torch
import triton.testing

from moestream.kernels.decode import experts_by_address, GATE_UP, DOWN
from moestream.kernels.grouped import experts_grouped
from moestream.kernels.reference import AddressBook, experts_by_address_reference
from moestream.models.moe import combine

H, I, E, K = 2048, 768, 128, 8
torch.manual_seed(0)
dev = torch.device("cuda")
numel = 3 * I * H
rows = (torch.randn(E, numel, device=dev) * 0.02).to(torch.bfloat16)
host = torch.empty(E, numel, dtype=torch.bfloat16, pin_memory=True)
host.copy_(rows)
row_bytes = numel * 2
book = AddressBook()
book.add(rows)
book.add(host)


def addrs_for(ids, n_host):
    """(T, k) addresses: the first n_host choices of each token from host memory, the rest from the device."""
    a = rows.data_ptr() + ids * row_bytes
    h = host.data_ptr() + ids * row_bytes
    a[:, :n_host] = h[:, :n_host]
    return a


def bench(fn, n=20):
    """Median us per call, from replays of a CUDA graph of n calls (no launch overhead, as in a decode graph)."""
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=150, return_mode="median") * 1e3 / n


for T in (1, 4, 8):
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, device=dev), -1).to(torch.bfloat16)
    out = experts_by_address(x, addrs_for(ids, 0), w, I)
    ref = experts_by_address_reference(x.cpu(), addrs_for(ids, 0).cpu(), w.cpu(), I, book=book).to(dev)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    same = {n: torch.equal(out, experts_by_address(x, addrs_for(ids, n), w, I)) for n in (1, 2, K)}
    print(f"T={T}: rel err vs reference {rel:.2e}; same bits with n experts from host: {same}", flush=True)
    a0 = addrs_for(ids, 0)
    t_dev = bench(lambda: experts_by_address(x, a0, w, I))
    w13, w2 = rows[:, :2 * I * H].view(E, 2 * I, H), rows[:, 2 * I * H:].view(E, H, I)
    t_grp = bench(lambda: combine(experts_grouped(x, ids, w13, w2), w))
    line = f"T={T}: by address {t_dev:.1f} us ({T * K * row_bytes / t_dev / 1e3:.0f} GB/s), grouped+combine {t_grp:.1f} us"
    for n in (1, 2, 4, K):
        an = addrs_for(ids, n)
        t = bench(lambda: experts_by_address(x, an, w, I))
        line += f"; {n} from host {t:.0f} us ({n * T * row_bytes / max(t - t_dev, 1e-3) / 1e3:.1f} GB/s extra)"
    print(line, flush=True)

if "--sweep" in sys.argv:
    x = torch.randn(1, H, device=dev).to(torch.bfloat16)
    ids = torch.randperm(E, device=dev)[:K][None]
    w = torch.softmax(torch.randn(1, K, device=dev), -1).to(torch.bfloat16)
    a0, a1 = addrs_for(ids, 0), addrs_for(ids, 1)
    for gu in [(8, 256, 4), (8, 1024, 4), (8, 1024, 8), (4, 1024, 4), (4, 2048, 8), (16, 512, 8), (2, 2048, 4)]:
        for dn in [(4, 256, 4), (8, 256, 8), (2, 256, 4), (16, 128, 8), (8, 128, 4), (16, 256, 8)]:
            cfg = (gu, dn)
            t = bench(lambda: experts_by_address(x, a0, w, I, cfg))
            th = bench(lambda: experts_by_address(x, a1, w, I, cfg))
            print(f"gate_up {gu} down {dn}: {t:.1f} us, 1 from host {th:.0f} us", flush=True)
