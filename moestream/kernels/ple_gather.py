"""The PLE n-gram table's rows read where they lie, in pinned host memory, by a kernel (Triton, CUDA): a decode
step's rows gathered with no host sync, so that the step can be captured in a CUDA graph (models/ple.py).

    gather_rows(table_addr, row_words, rows, out)     # out[i] <- the table's row rows[i] (row_words 4-byte words)

The table (rows_total, d) stays in host memory (tens of GB); program (i, c) reads words [c BLOCK, (c + 1) BLOCK)
of row rows[i] over the link in place (unified addressing, as kernels/host_arrays.py and the zero-copy decode
kernels read pinned memory) into out's row i on the device. The rows are the device's (hashed there): the host
never sees them. The table's address is baked into the launch, so the table must never move (PLETable keeps it).
A copy, bytes for bytes: the table's index_select is its oracle.
"""
from __future__ import annotations

import torch

from .decode import triton

BLOCK = 1024                  # words (4 bytes) a program copies


if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["table_addr"])
    def _gather_rows(table_addr, rows_ptr, out_ptr, WORDS: tl.constexpr, BLOCK: tl.constexpr):
        """Program (i, c): words [c BLOCK, (c + 1) BLOCK) of table row rows[i] into out row i."""
        i = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < WORDS
        row = tl.load(rows_ptr + i).to(tl.int64)
        src = table_addr.to(tl.int64).to(tl.pointer_type(tl.int32)) + row * WORDS
        tl.store(out_ptr + i.to(tl.int64) * WORDS + offs, tl.load(src + offs, mask=m), mask=m)


def gather_rows(table_addr: int, row_words: int, rows: torch.Tensor, out: torch.Tensor) -> None:
    """out (n, row) contiguous, row_words 4-byte words a row <- the host table's rows `rows` (n,) int64 (on out's
    device), read from table_addr on, on the current stream. Nothing is read back to the host."""
    n = rows.numel()
    assert out.is_contiguous() and out.shape[0] == n and out.numel() * out.element_size() == n * row_words * 4, \
        (out.shape, n, row_words)
    if n:
        _gather_rows[(n, triton.cdiv(row_words, BLOCK))](table_addr, rows.reshape(-1).contiguous(),
                                                        out.view(torch.int32), WORDS=row_words, BLOCK=BLOCK,
                                                        num_warps=4)
