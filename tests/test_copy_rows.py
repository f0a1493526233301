"""kernels/copy_rows.py: expert rows copied from pinned host memory into scattered slots by one launch. The kernel
byte for byte against plain copies (through the interpreter, and on CUDA), the copy queue's launched pieces, and a
model whose cache fills its slots by the kernel computing what it computes with copy calls."""
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


def test_the_programs_knob_takes_a_positive_whole_number_or_warns(monkeypatch, caplog):
    from moestream.kernels.copy_rows import _programs
    monkeypatch.setenv("MOESTREAM_COPY_PROGRAMS", "8")
    assert _programs() == 8
    for bad in ("0", "eight"):
        monkeypatch.setenv("MOESTREAM_COPY_PROGRAMS", bad)
        assert _programs() == 16 and "not a positive whole number" in caplog.text


def test_the_copy_queue_runs_launched_pieces_and_pairs_in_order():
    q = CopyQueue(Device("cpu"))
    dst = torch.zeros(3, dtype=torch.int64)
    order = []

    def launch():
        order.append("launch")
        dst[1] = dst[0] + 1                 # sees the pair before it
        return 8

    seq = q.submit([(dst[0:1], torch.tensor([5])), launch], 16, speculative=False)
    assert order == ["launch"] and dst.tolist() == [5, 6, 0] and q.poll() == seq


@pytest.mark.cuda
def test_a_cache_filled_by_the_kernel_computes_what_copy_calls_fill():
    """The prompt path's misses and copy-ahead go through the kernel on CUDA; the logits are the all-GPU model's,
    and those of the same cache filled by copy calls."""
    import moestream.experts.slots as slots_mod
    ids = torch.randint(0, 1000, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(ubatch_size=32, ctx_size=128, device="cuda")
    want = LLM("synth:tiny", **kw).logits(ids)
    for by_kernel, max_row in ((True, slots_mod.KERNEL_MAX_ROW), (False, slots_mod.KERNEL_MAX_ROW), (True, 0)):
        slots_mod.KERNEL_COPIES, default = by_kernel, slots_mod.KERNEL_MAX_ROW
        slots_mod.KERNEL_MAX_ROW = max_row                 # 0: rows too wide for the kernel keep copy calls
        try:
            llm = LLM("synth:tiny", **kw, cpu_moe=True, moe_cache_mib=20)
        finally:
            slots_mod.KERNEL_COPIES, slots_mod.KERNEL_MAX_ROW = True, default
        assert bool(llm.engine.host.slots.by_kernel) == (by_kernel and max_row > 0)
        assert torch.equal(llm.logits(ids), want), (by_kernel, max_row)
        assert llm.stats()["total"]["misses"] > 0


if __name__ == "__main__":
    globals()[sys.argv[1]]()
