"""kernels/copy_rows.py and kernels/batch_copy.py: expert rows copied from pinned host memory into scattered slots by
one launch, or by one batch call to the copy engines. Each byte for byte against plain copies (the kernel through
the interpreter, both on CUDA), the copy queue's launched pieces, the choice of a layer's copier, and a model whose
cache fills its slots each way computing what it computes with copy calls."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from interpreted import run_check

from moestream import LLM
from moestream.device import Device
from moestream.experts.copy_queue import CopyQueue
from moestream.experts.slots import run_copies


def kernel(device="cpu"):
    """Rows of 16-byte words and of 4-byte words, slots wider than the rows, one chunk a row and several, more
    work items than programs: each slot asked for holds its expert's bytes, every other byte is untouched."""
    from moestream.kernels import copy_rows as cr
    if device == "cpu":
        cr.BLOCK_BYTES, cr.PROGRAMS = 64, 3        # several chunks a row, programs looping, in the interpreter
    g = torch.Generator().manual_seed(0)
    for nbytes, stride, aligned in ((160, 160, True), (100, 112, False), (3 * 65536 + 48, 3 * 65536 + 64, True)):
        if device == "cpu" and nbytes > 1000:
            continue
        E, P, n = 16, 10, 7
        host = torch.randint(0, 256, (E, nbytes), dtype=torch.uint8, generator=g)
        if device != "cpu":
            host = host.pin_memory()
        pool = torch.zeros(P, stride, dtype=torch.uint8, device=device)
        experts, slots = torch.randperm(E, generator=g)[:n], torch.randperm(P, generator=g)[:n]
        src = (host.data_ptr() + experts * host.stride(0)).to(device)
        dst = (pool.data_ptr() + slots * pool.stride(0)).to(device)
        cr.copy_rows(src, dst, nbytes, aligned, first=0, count=3)           # in two launches, as copy_experts
        cr.copy_rows(src, dst, nbytes, aligned, first=3)
        want = torch.zeros(P, stride, dtype=torch.uint8)
        for d, s in run_copies(want, host.cpu(), experts.numpy(), slots.numpy()):    # the copy calls it replaces
            d.copy_(s)
        assert torch.equal(pool.cpu(), want), (nbytes, stride)


@pytest.mark.parametrize("check", ["kernel"])
def test_copy_rows_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


@pytest.mark.cuda
def test_copy_rows_kernel_on_cuda_copies_pinned_host_rows():
    kernel("cuda")


@pytest.mark.cuda
def test_a_batch_call_copies_pinned_host_rows_into_scattered_slots():
    """Rows of odd sizes into a wider pool, over several calls on a side stream: the copy calls' bytes."""
    from moestream.kernels.batch_copy import batch_copy, batch_copy_available
    assert batch_copy_available(torch.device("cuda")), "the H200's driver (CUDA 13) has cuMemcpyBatchAsync"
    g = torch.Generator().manual_seed(0)
    stream = torch.cuda.Stream()
    for nbytes, stride in ((160, 160), (100, 112), (3 * 65536 + 48, 3 * 65536 + 64)):
        E, P, n = 16, 10, 7
        host = torch.randint(0, 256, (E, nbytes), dtype=torch.uint8, generator=g).pin_memory()
        pool = torch.zeros(P, stride, dtype=torch.uint8, device="cuda")
        experts, slots = torch.randperm(E, generator=g)[:n].numpy(), torch.randperm(P, generator=g)[:n].numpy()
        src, dst = host.data_ptr() + experts * nbytes, pool.data_ptr() + slots * stride
        batch_copy(dst[:3], src[:3], nbytes, stream)
        batch_copy(dst[3:], src[3:], nbytes, stream)
        stream.synchronize()
        want = torch.zeros(P, stride, dtype=torch.uint8)
        for d, s in run_copies(want, host.cpu(), experts, slots):
            d.copy_(s)
        assert torch.equal(pool.cpu(), want), (nbytes, stride)


def test_a_layer_s_copier_is_the_batch_call_for_pinned_rows_up_to_4_mib_else_the_kernel_else_copy_calls(monkeypatch):
    """The rule of SlotPool._copier, with the device's answers stood in for (no CUDA here)."""
    import moestream.experts.slots as slots_mod

    class Rows:                         # a layer's host rows: (E, row) of bytes, pinned or not
        def __init__(self, row, pinned=True):
            self.shape, self._pinned = (8, row), pinned

        def is_pinned(self):
            return self._pinned

        def element_size(self):
            return 1

    pool = slots_mod.SlotPool.__new__(slots_mod.SlotPool)
    pool.pool = torch.empty(0)
    q4, bf16 = 3 << 20, 9 << 20                                         # a Q4_K_M expert's row, a bf16 one's
    for batch, kernel, rows, want in (
            (True, True, Rows(q4), "batch"),
            (True, True, Rows(bf16), "calls"),
            (True, True, Rows(q4, pinned=False), "calls"),
            (False, True, Rows(q4), "kernel"),                 # a driver with no batch call
            (False, True, Rows(q4 + 2), "calls"),              # not whole 4-byte words
            (False, False, Rows(q4), "calls")):
        monkeypatch.setattr(slots_mod, "batch_copy_available", lambda dev, ok=batch: ok)
        monkeypatch.setattr(slots_mod, "copy_rows_available", lambda dev, ok=kernel: ok)
        assert pool._copier(rows) == want, (batch, kernel, rows.shape, rows._pinned)


def test_on_the_cpu_every_layer_copies_by_copy_calls():
    from moestream.kernels.batch_copy import batch_copy_available
    assert not batch_copy_available(torch.device("cpu"))
    llm = LLM("synth:tiny", ubatch_size=32, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=20)
    assert set(llm.engine.host.slots.copier.values()) == {"calls"}


def test_the_copy_queue_runs_launched_pieces_and_pairs_in_order():
    q = CopyQueue(Device("cpu"))
    dst = torch.zeros(3, dtype=torch.int64)
    order = []

    def launch():
        order.append("launch")
        dst[1] = dst[0] + 1                 # sees the pair before it
        return 8

    seq = q.submit([(dst[0:1], torch.tensor([5])), launch], speculative=False)
    assert order == ["launch"] and dst.tolist() == [5, 6, 0] and q.poll() == seq


@pytest.mark.cuda
def test_a_cache_filled_by_batch_calls_or_the_kernel_computes_what_copy_calls_fill():
    """The prompt path's misses and copy-ahead go by batch calls (or, where the driver has none, the kernel; or copy
    calls where neither runs) on CUDA; the logits are the all-GPU model's whichever fills the cache."""
    import moestream.experts.slots as slots_mod
    ids = torch.randint(0, 1000, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(ubatch_size=32, ctx_size=128, device="cuda")
    want = LLM("synth:tiny", **kw).logits(ids)
    cap = slots_mod.MANY_ROWS_MAX
    default = slots_mod.batch_copy_available, slots_mod.copy_rows_available, cap
    no = lambda dev: False      # noqa: E731
    for batch, kernel, max_row, copier in ((default[0], default[1], cap, "batch"), (no, default[1], cap, "kernel"),
                                           (no, no, cap, "calls"),
                                           (default[0], default[1], 0, "calls")):    # 0: rows too wide for either
        slots_mod.batch_copy_available, slots_mod.copy_rows_available, slots_mod.MANY_ROWS_MAX = batch, kernel, max_row
        try:
            llm = LLM("synth:tiny", **kw, cpu_moe=True, moe_cache_mib=20)
        finally:
            slots_mod.batch_copy_available, slots_mod.copy_rows_available, slots_mod.MANY_ROWS_MAX = default
        assert set(llm.engine.host.slots.copier.values()) == {copier}, (copier, max_row)
        assert torch.equal(llm.logits(ids), want), (copier, max_row)
        assert llm.stats()["total"]["misses"] > 0


if __name__ == "__main__":
    globals()[sys.argv[1]]()
