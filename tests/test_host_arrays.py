"""kernels/host_arrays.py: small host arrays onto the device by a kernel that reads pinned host memory in place. The
kernel byte for byte against the host bytes (in the interpreter, and on CUDA); uploads of every dtype the engine
sends, across the arena's halves; and what it is for: an upload on the compute stream does not wait behind copies
queued on another stream."""
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
def test_an_upload_does_not_wait_behind_the_copy_streams_copies():
    """A copy of 2 GB queued on a side stream first (tens of ms on the copy engines), then an upload and a kernel
    that reads it on the compute stream: the upload's values are there while the big copy is still running. A
    copy call on the compute stream would have queued behind it."""
    ha.upload(np.zeros(4, dtype=np.int64), torch.device("cuda"))       # (compiled before the clock matters)
    src = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    t = ha.upload(np.arange(512, dtype=np.int64), torch.device("cuda"))
    s = t.sum()
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    running = not copied.query()
    torch.cuda.synchronize()
    assert s.item() == 511 * 512 // 2
    assert running, "the upload waited for the side stream's copy"


if __name__ == "__main__":
    globals()[sys.argv[1]]()
