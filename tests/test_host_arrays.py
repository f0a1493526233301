"""kernels/host_arrays.py: small host arrays onto the device by a kernel that reads pinned host memory in place. The
kernel byte for byte against the host bytes (in the interpreter, and on CUDA); uploads of every dtype the engine
sends, across the arena's halves; and what it is for: an upload on the compute stream, behind its wait for the
copy stream's copies, does not wait for the copies that stream gets after it."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from interpreted import run_check

from moestream.kernels import host_arrays as ha


def kernel(device="cpu"):
    """Sizes of one word, of part of a program's block and of several blocks: dst's first nbytes are the host's
    bytes from that address, the rest untouched."""
    if device == "cpu":
        ha.BLOCK = 8                              # several programs, in the interpreter
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    if device != "cpu":
        host = host.pin_memory()
    for at, nbytes in ((0, 4), (16, 20), (100, 36), (64, 4 * 8 * 3 + 12), (512, 2048)):
        if device == "cpu" and nbytes > 200:
            continue
        dst = torch.full((nbytes + 64,), 7, dtype=torch.uint8, device=device)
        ha.copy_from_host(dst, host.data_ptr() + at, nbytes)
        want = torch.full((nbytes + 64,), 7, dtype=torch.uint8)
        want[:nbytes] = host[at:at + nbytes]
        assert torch.equal(dst.cpu(), want), (at, nbytes)


def test_the_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    run_check(__file__, "kernel", timeout=600)


def test_upload_off_cuda_is_a_plain_copy():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)[:, 1:]        # not contiguous
    t = ha.upload(a, torch.device("cpu"))
    assert t.dtype == torch.int64 and torch.equal(t, torch.from_numpy(np.ascontiguousarray(a)))


@pytest.mark.cuda
def test_the_kernel_on_cuda_reads_pinned_host_bytes():
    kernel("cuda")


@pytest.mark.cuda
def test_uploads_of_each_dtype_across_the_arenas_halves(monkeypatch):
    """A small arena, so that uploads wrap from half to half many times; each upload's values, and those of earlier
    uploads (still read after the arena moved on) unchanged."""
    monkeypatch.setattr(ha, "HALF_BYTES", 4096)
    up = ha.SmallUploads(torch.device("cuda", torch.cuda.current_device()))
    rng = np.random.default_rng(0)
    kept = []
    for i in range(200):
        n = int(rng.integers(0, 300))
        a = [rng.integers(-1, 1 << 40, n).astype(np.int64), rng.integers(0, 2, n).astype(bool),
             rng.standard_normal(n).astype(np.float32), rng.integers(0, 9, (n, 3)).astype(np.int32)][i % 4]
        t = up.upload(a)
        assert t.shape == a.shape and t.dtype == torch.from_numpy(a).dtype
        kept.append((t, a.copy()))
    for t, a in kept:
        assert np.array_equal(t.cpu().numpy(), a)
    big = np.arange(4096, dtype=np.int64)                        # over half the arena: by copy call
    assert np.array_equal(up.upload(big).cpu().numpy(), big)


@pytest.mark.cuda
def test_an_upload_does_not_wait_for_copies_queued_after_it():
    """The prompt's order: the copy stream gets a layer's missed experts, the compute stream waits for them and
    queues the layer's slot table, then the copy stream gets the next layer's experts (2 GB here, tens of ms).
    The upload has run once the first copies have, while the later ones still run. (A copy call in its place ran
    only after all of them: 35 ms on an H100, .carry's fifo3.py in bench/RESULTS.md, stop 38.)"""
    from moestream.kernels.batch_copy import batch_copy, batch_copy_available
    dev = torch.device("cuda", torch.cuda.current_device())
    ha.upload(np.zeros(4, dtype=np.int64), dev).sum()       # (compiled and loaded before the clock matters)
    row, E, demand_rows = 1 << 21, 1000, 100
    src = torch.empty(E, row, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(E, row, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()

    def copies(a, b):
        with torch.cuda.stream(side):
            if batch_copy_available(dev):           # as the slot pool copies, a batch call a piece
                at = np.arange(a, b, dtype=np.uint64) * np.uint64(row)
                to, frm = np.uint64(dst.data_ptr()) + at, np.uint64(src.data_ptr()) + at
                for i in range(0, b - a, 16):
                    batch_copy(to[i:i + 16], frm[i:i + 16], row, side)
            else:
                for i in range(a, b, 16):
                    dst[i:min(i + 16, b)].copy_(src[i:min(i + 16, b)], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        return ev

    torch.cuda.synchronize()
    demand = copies(0, demand_rows)
    torch.cuda.current_stream().wait_event(demand)
    total = ha.upload(np.arange(512, dtype=np.int64), dev).sum()
    done = torch.cuda.Event()
    done.record()
    ahead = copies(demand_rows, E)
    done.synchronize()
    running = not ahead.query()
    torch.cuda.synchronize()
    assert total.item() == 511 * 512 // 2
    assert running, "the upload waited for the copies queued after it"


if __name__ == "__main__":
    globals()[sys.argv[1]]()
