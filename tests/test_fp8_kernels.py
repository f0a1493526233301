"""The FP8 expert kernels (kernels/fp8.py) on the CPU, through Triton's interpreter (tests/interpreted.py): every
e4m3 byte decoded to torch's float32 bits; the prompt path's dequantizer bit for bit against the plain-torch
`ExpertLayout.dequantize`; the decode GEMVs against the plain-torch oracle in float32, and their bits the same
wherever the rows lie. Shapes with a whole 128 block and a partial one. The same kernels compiled (`cuda`)."""
from __future__ import annotations

import pytest
import torch

from fp8_checkpoint import quantize
from interpreted import close, run_check

CHECKS = ["bytes", "dequant", "decode:1,3", "decode:2,2"]


def fp8_rows(n: int, inter: int, hidden: int, g, pad: int = 32) -> torch.Tensor:
    """(n, nbytes + pad) uint8: n experts of random weights quantized to FP8 rows, the stride larger than a row."""
    from moestream.quant import fp8
    rows = []
    for _ in range(n):
        parts = [fp8.pack(*quantize(torch.randn(r, c, generator=g) * 0.1))
                 for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
        rows.append(torch.cat(parts + [torch.randint(0, 256, (pad,), dtype=torch.uint8, generator=g)]))
    return torch.stack(rows)


def layout(inter=160, hidden=192):
    from moestream.quant import fp8
    from moestream.quant.layout import ExpertLayout
    return ExpertLayout(inter, hidden, (fp8.FP8,) * 3)


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    from moestream.kernels.fp8 import e4m3

    @triton.jit
    def _decode(b_ptr, out_ptr):
        i = tl.arange(0, 256)
        tl.store(out_ptr + i, e4m3(tl.load(b_ptr + i)))


@pytest.mark.parametrize("check", CHECKS)
def test_fp8_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def bytes_check(device="cpu"):
    """kernels/fp8.py's e4m3 decodes each of the 256 bytes to float8_e4m3fn.float()'s bits (NaN as NaN)."""
    b = torch.arange(256, dtype=torch.uint8, device=device)
    out = torch.empty(256, device=device)
    _decode[(1,)](b, out)
    want = b.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan) and torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))


def dequant_check(device="cpu"):
    """Bit for bit: dequantize_rows == layout.dequantize(rows[index]).to(out_dtype), for slots in any order."""
    from moestream.kernels.dequant import dequantize_rows
    lay = layout()
    rows = fp8_rows(4, lay.inter, lay.hidden, torch.Generator().manual_seed(1)).to(device)
    index = torch.tensor([3, 0, 3, 2], device=device)
    ref13, ref2 = lay.dequantize(rows[index].cpu(), torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        w13, w2 = dequantize_rows(rows, index, lay, dtype)
        assert w13.shape == ref13.shape and w2.shape == ref2.shape and w13.dtype == dtype
        assert torch.equal(w13.cpu(), ref13.to(dtype)) and torch.equal(w2.cpu(), ref2.to(dtype)), dtype


def decode_check(T: int, k: int, device="cpu", inter=160, hidden=192):
    """Against the oracle (float32), and the same bits when each choice's rows are read from another copy (a slot
    and a host row: the kernel's result depends on the bytes alone)."""
    from moestream.kernels.decode_quant import decode_quant_available, experts_by_address_quant
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    lay = layout(inter, hidden)
    assert decode_quant_available(lay)
    E = 8
    g = torch.Generator().manual_seed(T)
    rows = fp8_rows(E, inter, hidden, g).to(device)
    other = rows.clone()
    book = AddressBook()
    book.add(rows)
    book.add(other)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    addrs = rows.data_ptr() + ids * rows.stride(0)
    x = torch.randn(T, hidden, generator=g).to(device)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(device)
    out = experts_by_address_quant(x, addrs, w, lay)
    close(out.cpu(), experts_by_address_reference(x.cpu(), addrs.cpu(), w.cpu(), lay, book=book))
    pick = torch.randint(0, 2, ids.shape, generator=g).to(device)
    starts = torch.tensor([rows.data_ptr(), other.data_ptr()], device=device)
    assert torch.equal(experts_by_address_quant(x, starts[pick] + ids * rows.stride(0), w, lay), out)


def check(name: str):
    if name == "bytes":
        return bytes_check()
    if name == "dequant":
        return dequant_check()
    T, k = map(int, name.split(":")[1].split(","))
    decode_check(T, k)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
def test_fp8_kernels_compiled():
    bytes_check("cuda")
    dequant_check("cuda")
    for T, k in ((1, 8), (8, 8), (3, 2)):
        decode_check(T, k, device="cuda")
    decode_check(1, 4, device="cuda", inter=768, hidden=2048)


if __name__ == "__main__":
    import sys
    check(sys.argv[1])
