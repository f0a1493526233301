"""The "runs" decode kernel (kernels/decode_runs.py) reads no byte past the expert rows it is given: on the CPU,
through Triton's interpreter (in a subprocess, tests/interpreted.py), with the last row ending where an unreadable
page starts (mprotect PROT_NONE), so that a read past it kills the process. On the GPU such a read is an illegal
address where a layer's rows fill their allocation to the byte (Qwen3-Next's 512 Q4_K_M experts of 1.95 MiB each
fill 498 whole 2 MiB segments); a word that holds a wanted byte cannot cross into an unmapped page, a word past the
last wanted byte can."""
from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from interpreted import run_check

# Q6_K's d is its block's last 2 bytes: a block ending a page has it at a word's high half (the case that read the
# word past it: Q4_K_M's down rows); Q8_0's block ends in quants read as unaligned runs of words.
SPECS = ["Q4_K,Q4_K,Q6_K", "Q8_0"]


def guarded(rows: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """A copy of rows (uint8, CPU) whose last byte is the last before a PROT_NONE page; keep the mmap alive."""
    page = mmap.PAGESIZE
    size = -(-rows.numel() // page) * page
    mm = mmap.mmap(-1, size + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base + size, page, 0) == 0, ctypes.get_errno()     # PROT_NONE: any read faults
    buf = torch.frombuffer(mm, dtype=torch.uint8, count=size)
    out = buf[size - rows.numel():].view(rows.shape)
    out.copy_(rows)
    return out, mm


def check(spec: str) -> None:
    from test_quant_kernels import layout_of, random_rows
    from moestream.kernels.decode_runs import experts_by_address_runs, runs_layout
    lay = layout_of(spec, 256, 256)
    assert runs_layout(lay), spec
    E, k, T = 4, 2, 2
    g = torch.Generator().manual_seed(5)
    rows = random_rows(lay, E, g, pad=0)                      # (E, row bytes): rows back to back, no slack
    safe = rows.clone()
    last, mm = guarded(rows)
    ids = torch.tensor([[E - 1, 0], [1, E - 1]])              # every token reads the last row, which ends the page
    x = torch.randn(T, lay.hidden, generator=g) / 16
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    out = experts_by_address_runs(x, last.data_ptr() + ids * last.stride(0), w, lay)
    assert torch.equal(out, experts_by_address_runs(x, safe.data_ptr() + ids * safe.stride(0), w, lay))
    print("ok", spec, len(mm))


@pytest.mark.parametrize("spec", SPECS)
def test_the_runs_kernel_reads_nothing_past_the_last_row(spec):
    pytest.importorskip("triton")
    run_check(__file__, spec, timeout=600)


if __name__ == "__main__":
    check(sys.argv[1])
