"""The PLE n-gram table's rows read where they lie, in pinned host memory, by a kernel (Triton, CUDA): a decode
step's rows gathered with no host sync, so that the step can be captured in a CUDA graph (models/ple.py).

    gather_rows(table_addr, row_words, rows, out)     # out[i] <- the table's row rows[i] (row_words 4-byte words)

The table (rows_total, d) stays in host memory (tens of GB); program (i, c) reads words [c BLOCK, (c + 1) BLOCK)
of row rows[i] over the link in place (unified addressing, as kernels/host_arrays.py and the zero-copy decode
kernels read pinned memory) into out's row i on the device. The rows are the device's (hashed there): the host
never sees them. The table's address is baked into the launch, so the table must never move (PLETable keeps it).
A copy, bytes for bytes: the table's index_select is its oracle.

    gather_block_rows(table_addr, row_bytes, qtype, rows, out)    # out[i] (float32) <- row rows[i] dequantized

A GGUF's quantized table (Q8_0, Q4_0, ...: its blocks as in the file, row_bytes a row, pinned by runtime/load.py)
read the same way, its gathered blocks dequantized on the device by kernels/qblocks.py's decoders: float32 values,
gguf.quants' bits (no fused multiply-add), so the host's dequantized rows (models/ple.py's BlockTable.take) are its
oracle bit for bit.
"""
from __future__ import annotations

import torch

from ..quant.types import FLOAT
from .decode import triton
from .qblocks import SHAPES, has_path, kvalues

BLOCK = 1024                  # words (4 bytes) a program copies
VALUES = 1024                 # values a program of a quantized table dequantizes (whole blocks)


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

    from .qblocks import block_values

    @triton.jit(do_not_specialize=["table_addr"])
    def _gather_block_rows(table_addr, rows_ptr, out_ptr, kv_ptr, ROW_BYTES: tl.constexpr, NBLOCKS: tl.constexpr,
                           QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NSUB: tl.constexpr,
                           SUB: tl.constexpr, BB: tl.constexpr):
        """Program (i, c): blocks [c BB, (c + 1) BB) of table row rows[i], dequantized into out row i's values."""
        i = tl.program_id(0)
        b = tl.program_id(1) * BB + tl.arange(0, BB)[:, None, None]                        # (BB, 1, 1)
        j = tl.arange(0, NSUB)[None, :, None]
        l = tl.arange(0, SUB)[None, None, :]
        m = b < NBLOCKS
        row = tl.load(rows_ptr + i).to(tl.int64)
        p = table_addr.to(tl.int64).to(tl.pointer_type(tl.uint8)) + row * ROW_BYTES + b * TS
        v = block_values(p, j, l, m, kv_ptr, QT)                                           # (BB, NSUB, SUB)
        dst = out_ptr + i.to(tl.int64) * (NBLOCKS * BS) + b * BS + j * SUB + l
        tl.store(dst, v, mask=m & (j >= 0) & (l >= 0))


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


def gathers_blocks(qtype, d: int) -> bool:
    """Whether rows of d values of quantized qtype have gather_block_rows (kernels/qblocks.py decodes the type)."""
    return has_path(qtype, d) and qtype not in FLOAT


def gather_block_rows(table_addr: int, row_bytes: int, qtype, rows: torch.Tensor, out: torch.Tensor) -> None:
    """out (n, d) float32 contiguous <- the host table's rows `rows` (n,) int64 (on out's device), each row_bytes of
    qtype's blocks read from table_addr on and dequantized on the device, on the current stream. Nothing is read
    back to the host."""
    n, d = out.shape
    bs, ts, nsub, sub = SHAPES[qtype]
    assert out.dtype == torch.float32 and out.is_contiguous() and rows.numel() == n and d % bs == 0 \
        and row_bytes == d // bs * ts, (out.shape, out.dtype, rows.shape, row_bytes, qtype)
    if n:
        bb = max(1, VALUES // bs)
        _gather_block_rows[(n, triton.cdiv(d // bs, bb))](
            table_addr, rows.reshape(-1).contiguous(), out, kvalues(out.device), ROW_BYTES=row_bytes,
            NBLOCKS=d // bs, QT=int(qtype), BS=bs, TS=ts, NSUB=nsub, SUB=sub, BB=bb, num_warps=4,
            enable_fp_fusion=False)
