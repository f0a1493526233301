"""The quantized-expert kernels (kernels/dequant.py, kernels/decode_quant.py, kernels/decode_runs.py) on the CPU,
through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, as tests/test_triton_kernels.py does): the
dequantizer bit for bit against `ExpertLayout.dequantize` (gguf.quants' bits), the decode GEMV against the
plain-torch oracle in float32, and its bits the same wherever the rows lie; and the same kernels compiled on the
GPU (`cuda`-marked)."""
from __future__ import annotations

import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from interpreted import close, run_check

# Q2_K, Q3_K and the grid IQ types (kernels/qblocks_iq.py) are every type moestream loads.
GRID_TYPES = ["Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
TRITON_TYPES = ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16",
                "F32"] + GRID_TYPES
DECODE_TYPES = ["Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "IQ4_NL", "F16",
                "BF16"] + GRID_TYPES
# In the interpreter the grid types' bits are dequant's checks; the GEMV reads them through the same block_values,
# so two of them and two mixes check its tiles of (16, 16) and (8, 32) (the compiled tests take every type).
INTERPRETED_DECODE = [t for t in DECODE_TYPES if t not in GRID_TYPES] + ["Q2_K", "IQ2_XS"]
# Every Triton type, and the mixes of the files users download (Q4_K_M: Q6_K down; a float down; a fallback).
DEQUANT = [f"dequant:{t}" for t in TRITON_TYPES] + ["dequant:Q4_K,Q4_K,Q6_K", "dequant:Q5_K,Q5_K,F16",
                                                    "dequant:IQ2_XXS,IQ2_XXS,Q4_K"]
DECODE = [f"decode:{t}" for t in INTERPRETED_DECODE] + ["decode:Q4_K,Q4_K,Q6_K", "decode:Q8_0,Q4_0,Q5_K",
                                                  "decode:IQ1_M,IQ1_M,IQ2_XXS", "decode:IQ3_S,IQ3_S,Q3_K"]
# The "runs" variant (kernels/decode_runs.py) on each type it covers and on Q4_K_M's mixes; a down row of I=768
# (3 K-quant blocks, Q8_0's 24) is read a block a step. "kv4": its IQ4 codebook on each of the 16 codes.
RUNS_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
RUNS = [f"runs:{t}" for t in RUNS_TYPES] + ["runs:Q4_K,Q4_K,Q6_K", "runs:Q6_K,Q6_K,Q8_0", "runs:Q5_0,Q5_0,IQ4_NL",
                                            "kv4", "order:Q4_K,Q4_K,Q6_K", "order:IQ4_XS,IQ4_XS,Q8_0",
                                            "order:Q5_1,Q5_1,Q4_0"]


def layout_of(spec: str, inter: int, hidden: int):
    from moestream.quant.layout import ExpertLayout
    types = [Q[t] for t in spec.split(",")]
    return ExpertLayout(inter, hidden, tuple(types * 3 if len(types) == 1 else types))


def big_blocks(spec: str) -> bool:
    """Whether a type of spec has blocks of 256 values (the shapes must be multiples of 256)."""
    from moestream.quant.types import block_size
    return any(block_size(Q[t]) == 256 for t in spec.split(","))


def random_matrix(qtype, rows: int, cols: int, g) -> torch.Tensor:
    """(rows, row bytes) uint8: random valid blocks (finite scales, quant/dequant.py), or random raw floats."""
    from moestream.quant.dequant import random_blocks
    from moestream.quant.types import block_size, row_bytes
    return random_blocks(qtype, rows * cols // block_size(qtype), g).view(rows, row_bytes(qtype, cols))


def random_rows(layout, n: int, g, pad: int = 32) -> torch.Tensor:
    """(n, nbytes + pad) uint8: n random expert rows of layout, the row stride larger than a row."""
    I, H = layout.inter, layout.hidden
    parts = [random_matrix(t, r, c, g).reshape(-1) for _ in range(n)
             for t, r, c in zip(layout.types, (I, I, H), (H, H, I))]
    rows = torch.cat(parts).view(n, -1)
    return torch.cat([rows, torch.randint(0, 256, (n, pad), dtype=torch.uint8, generator=g)], 1)


@pytest.mark.parametrize("check", DEQUANT + DECODE + RUNS)
def test_quant_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=900)


def test_the_grid_kernels_read_the_table_where_it_is_laid_out():
    """kernels/qblocks_iq.py writes the device table's offsets as numbers: they are qblocks.TABLE_OFFSETS', every
    one; and the table holds what TABLE says, the IQ4 codebook first (the other kernels read it at 0)."""
    import inspect
    import re

    from moestream.kernels import qblocks, qblocks_iq
    literals = {int(n) for n in re.findall(r"tab \+ (\d+)", inspect.getsource(qblocks_iq))}
    assert literals == set(qblocks.TABLE_OFFSETS.values()) - {0}
    values = qblocks.table_values()
    assert len(values) == sum(n for _, n in qblocks.TABLE) and values[:16] == list(qblocks.KVALUES)


def dequant_check(spec: str, device="cpu", out_dtypes=(torch.float32, torch.bfloat16)):
    """Bit for bit: dequantize_rows == layout.dequantize(rows[index]).to(out_dtype), for slots in any order."""
    from moestream.kernels.dequant import dequantize_rows
    k_quant = big_blocks(spec)
    lay = layout_of(spec, 256 if k_quant else 96, 256 if k_quant else 64)
    g = torch.Generator().manual_seed(len(spec))
    rows = random_rows(lay, 4, g).to(device)
    index = torch.tensor([3, 0, 3, 2], device=device)
    ref13, ref2 = lay.dequantize(rows[index].cpu(), torch.float32)
    for dtype in out_dtypes:
        w13, w2 = dequantize_rows(rows, index, lay, dtype)
        assert w13.shape == ref13.shape and w2.shape == ref2.shape and w13.dtype == dtype
        assert torch.equal(w13.cpu(), ref13.to(dtype)) and torch.equal(w2.cpu(), ref2.to(dtype)), dtype


def decode_check(spec: str, T: int, k: int, seed: int = 0, inter: int = 256, variant: str = "values",
                 moved: bool = True):
    """Against the oracle (float32); with `moved`, the same bits when each choice's rows are read from one of four
    copies: 16-aligned (two: a slot and a host row), 4-aligned and odd (the runs variant's 128-bit loads, its shifted
    words, and both; "values" reads bytes, so for it one mixed call stands for every placement)."""
    from moestream.kernels.decode_quant import decode_quant_available, experts_by_address_quant
    from moestream.kernels.decode_runs import runs_layout
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    k_quant = big_blocks(spec)
    lay = layout_of(spec, inter if k_quant else 96, 256 if k_quant else 64)    # 96: 3 blocks a down row, masked
    assert decode_quant_available(lay)
    assert variant != "runs" or runs_layout(lay), spec
    E = 6
    g = torch.Generator().manual_seed(seed + T)
    rows = random_rows(lay, E, g)
    other = rows.clone()                              # the same experts elsewhere (a slot and a host row)
    book = AddressBook()
    book.add(rows)
    book.add(other)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    step = rows.stride(0)
    addrs = rows.data_ptr() + ids * step
    scale = lay.dequantize(rows[:1])[0].std().item() * lay.hidden ** 0.5            # gate x of order 1
    x = torch.randn(T, lay.hidden, generator=g) / scale
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    out = experts_by_address_quant(x, addrs, w, lay, variant=variant)
    close(out, experts_by_address_reference(x, addrs, w, lay, book=book))
    if not moved:
        return
    copies = [rows, other] + [moved_copy(rows, shift) for shift in (4, 1)]
    pick = torch.randint(0, len(copies), ids.shape, generator=g)
    pick[:, 0] = 2 + torch.arange(T) % 2      # each token's down rows through the shifted words (T >= 2: both)
    starts = torch.tensor([c.data_ptr() for c in copies])
    assert torch.equal(experts_by_address_quant(x, starts[pick] + ids * step, w, lay, variant=variant), out)


def moved_copy(rows: torch.Tensor, shift: int) -> torch.Tensor:
    """A copy of rows (on their device) whose start is `shift` past a multiple of 16."""
    buf = torch.empty(rows.numel() + 16, dtype=torch.uint8, device=rows.device)
    moved = buf[(shift - buf.data_ptr()) % 16:][:rows.numel()].view(rows.shape)
    moved.copy_(rows)
    assert moved.data_ptr() % 16 == shift
    return moved


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    from moestream.kernels.qruns_units import _kv4

    @triton.jit
    def _codebook(out_ptr, one):
        """out (32,) float32: _kv4 of the codes 0..15 as low nibbles (out[:16]), then as high ones."""
        i = tl.arange(0, 32)
        v = (i % 16).to(tl.uint32) * 0x11111111                # the code in every nibble of the word
        tl.store(out_ptr + i, _kv4(v, (4 * (i // 16) + 8 * (i % 4)).to(tl.uint32), one))


def kv4_check(device="cpu"):
    """The runs kernels' IQ4 codebook (qruns_units._kv4: a rounded quartic) is kvalues exactly, code by code."""
    from moestream.kernels.decode_runs import ONE
    from moestream.kernels.qblocks import KVALUES
    out = torch.empty(32, device=device)
    _codebook[(1,)](out, ONE)
    assert torch.equal(out.cpu(), torch.tensor(KVALUES * 2, dtype=torch.float32)), out


def order_check(spec: str):
    """x and h in the lanes' order give the bits of the rows' order (decode_runs.LANE_ORDER), with one and with two
    rows a down lane, for one token and several."""
    from moestream.kernels import decode_runs
    from moestream.kernels.decode_runs import experts_by_address_runs
    k_quant = big_blocks(spec)
    lay = layout_of(spec, 256 if k_quant else 96, 256 if k_quant else 64)
    g = torch.Generator().manual_seed(7)
    rows = random_rows(lay, 6, g)
    for T, k in ((1, 3), (2, 2)):           # one token, 4 choice lanes (one masked); several: T = 2 reaches it
        ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(T)])
        addrs = rows.data_ptr() + ids * rows.stride(0)
        x = torch.randn(T, lay.hidden, generator=g) * 0.05
        w = torch.softmax(torch.randn(T, k, generator=g), -1)
        outs, default = [], (decode_runs.LANE_ORDER, decode_runs.DOWN_ROWS_A_LANE)
        try:
            for order, down_rows in ((False, 2), (True, 1), (True, 2)):
                decode_runs.LANE_ORDER, decode_runs.DOWN_ROWS_A_LANE = order, down_rows
                outs.append(experts_by_address_runs(x, addrs, w, lay))
        finally:        # the checks after this one share its process (tests/interpreted.py): they see the defaults
            decode_runs.LANE_ORDER, decode_runs.DOWN_ROWS_A_LANE = default
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), spec


@pytest.mark.parametrize("qtype", RUNS_TYPES)
def test_the_lanes_order_is_a_permutation_of_each_row(qtype):
    """qruns.lane_order with k copies: every value of the k rows goes to its own place, and the places of copy j are
    copy 0's moved by 4 G (the step between choices that the down launch reads)."""
    import numpy as np
    from moestream.kernels.qruns import UNITS, lane_order
    from moestream.quant.types import block_size
    bs, nu = block_size(Q[qtype]), UNITS[Q[qtype]][0]
    for blocks, bb in ((8, 8), (8, 2), (3, 1)):
        for k in (1, 3, 8):
            pos = lane_order(Q[qtype], blocks * bs, bb, k)
            every = np.concatenate([pos + j * 4 * bb * nu for j in range(k)])
            assert np.array_equal(np.sort(every), np.arange(k * blocks * bs)), (qtype, blocks, bb, k)


def check(name: str):
    if name == "kv4":
        return kv4_check()
    kind, spec = name.split(":")
    if kind == "order":
        return order_check(spec)
    if kind == "dequant":
        dequant_check(spec)
    elif kind == "decode":
        # The interpreter runs a launch program by program: T k (I / R) gate/up programs and T (H / R) down ones, so
        # the shapes are the smallest that reach each branch. I = H = 256 (the least a 256-value block allows; the
        # 32-value types take 96 x 64: two tiles of rows, the second part-full, and 3 blocks a down row in a tile
        # of 4). "values" has no branch on T, k or the rows' addresses (it reads bytes; T and k are grid and loop
        # bounds), so T = 2, k = 2 (several tokens, the loop over choices) and one mixed call of the moved copies
        # check them all; Q4_K_M adds I = 768, where a K-quant down row is 3 blocks in a tile of 4, one masked.
        if spec == "Q4_K,Q4_K,Q6_K":
            decode_check(spec, 1, 3, inter=768, moved=False)
        decode_check(spec, 2, 2)
    else:
        # T = 1 (one row a down lane) with k = 3 (4 choice lanes, one masked); I = 768 for the mixes (a down row
        # of 3 blocks read a block a step, unrolled); T = 2 (two rows a down lane, as for any T >= 2). The moved
        # copies in both: the loads' alignment is decided per program, for each row-a-lane branch.
        decode_check(spec, 1, 3, inter=768 if "," in spec else 256, variant="runs")
        decode_check(spec, 2, 2, seed=1, variant="runs")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("spec", TRITON_TYPES + ["Q4_K,Q4_K,Q6_K", "Q4_K,Q4_K,Q3_K"])
def test_dequantize_rows_compiled_is_exact(spec):
    dequant_check(spec, device="cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("spec", DECODE_TYPES + ["Q4_K,Q4_K,Q6_K"])
@pytest.mark.parametrize("T,k,I,H", [(1, 8, 768, 2048), (8, 8, 768, 2048), (3, 6, 256, 512)])
def test_decode_quant_compiled_matches_reference_and_reads_host_memory_in_place(spec, T, k, I, H):
    """bfloat16 on the GPU, against the float32 oracle; the same bits from pinned host memory and mixed."""
    from moestream.kernels.decode_quant import experts_by_address_quant
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    lay = layout_of(spec, I, H)
    E = 12
    g = torch.Generator().manual_seed(T)
    host = random_rows(lay, E, g).pin_memory()
    rows = host.cuda()
    book = AddressBook()
    book.add(rows)
    book.add(host)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
    dev_addr, host_addr = rows.data_ptr() + ids * rows.stride(0), host.data_ptr() + ids * host.stride(0)
    x = (torch.randn(T, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    w = torch.softmax(torch.randn(T, k, device="cuda"), -1).to(torch.bfloat16)
    ref = experts_by_address_reference(x.cpu(), dev_addr.cpu(), w.cpu(), lay, book=book).cuda()
    odd = torch.empty(rows.numel() + 2, dtype=torch.uint8, device="cuda")[2:].view(rows.shape)   # 2-aligned only
    odd.copy_(rows)
    book.add(odd)
    on_host = torch.rand(E, device="cuda") < 0.5
    for variant in ("values", "runs"):
        out = experts_by_address_quant(x, dev_addr, w, lay, variant=variant)
        assert torch.isfinite(out).all()
        close(out, ref, tol=1e-2)
        for addrs in (host_addr, torch.where(on_host[ids], host_addr, dev_addr), odd.data_ptr() + ids * rows.stride(0)):
            assert torch.equal(experts_by_address_quant(x, addrs, w, lay, variant=variant), out)



@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("spec", RUNS_TYPES + ["Q4_K,Q4_K,Q6_K", "Q6_K,Q6_K,Q8_0", "IQ4_XS,IQ4_XS,Q6_K",
                                                "Q5_0,Q5_0,IQ4_NL"])
@pytest.mark.parametrize("T", [1, 8, 16])
def test_decode_runs_compiled_matches_reference_wherever_the_rows_lie(spec, T):
    """The runs variant compiled, k=8 on Qwen3-30B-A3B's expert shape: bfloat16 against the float32 oracle, and
    the same bits from pinned host memory, from 4-aligned and 2-aligned copies (its shifted words instead of its
    128-bit loads) and from a mix of all four placements, choice by choice."""
    from moestream.kernels.decode_quant import experts_by_address_quant
    from moestream.kernels.decode_runs import runs_layout
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    I, H, k, E = 768, 2048, 8, 16
    lay = layout_of(spec, I, H)
    assert runs_layout(lay)
    g = torch.Generator().manual_seed(T)
    host = random_rows(lay, E, g).pin_memory()
    rows = host.cuda()
    assert rows.data_ptr() % 16 == 0 and rows.stride(0) % 16 == 0
    book = AddressBook()
    book.add(rows)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).cuda()
    x = (torch.randn(T, H, generator=g) / H ** 0.5).to(torch.bfloat16).cuda()
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(torch.bfloat16).cuda()
    step = rows.stride(0)
    out = experts_by_address_quant(x, rows.data_ptr() + ids * step, w, lay, variant="runs")
    ref = experts_by_address_reference(x.cpu(), (rows.data_ptr() + ids * step).cpu(), w.cpu(), lay, book=book)
    assert torch.isfinite(out).all()
    close(out, ref.cuda(), tol=1e-2)
    copies = [rows, host, moved_copy(rows, 4), moved_copy(rows, 2)]
    starts = torch.tensor([c.data_ptr() for c in copies], device="cuda")
    pick = torch.randint(0, len(copies), ids.shape, generator=g).cuda()
    for addrs in [starts[i] + ids * step for i in range(1, len(copies))] + [starts[pick] + ids * step]:
        assert torch.equal(experts_by_address_quant(x, addrs, w, lay, variant="runs"), out)


@pytest.mark.cuda
@needs_cuda
def test_runs_codebook_compiled_is_exact():
    """Compiled, the quartic's multiply-adds fused: the same 16 codes, exactly."""
    kv4_check("cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_a_run_given_its_slots_on_the_host_gives_the_bits_of_one_that_finds_them(device):
    """ExpertWeights.run with `used` (the providers' host-known slots: no host sync) against torch.unique's."""
    import numpy as np

    from moestream.experts.provider import ExpertWeights
    from moestream.kernels.reference import experts_reference
    lay = layout_of("Q4_K,Q4_K,Q6_K", 256, 256)
    g = torch.Generator().manual_seed(5)
    rows = random_rows(lay, 6, g).to(device)
    slots = torch.tensor([[4, 1], [1, 5], [5, 4]], device=device)
    x = torch.randn(3, 256, generator=g).to(device)
    found = ExpertWeights.over(rows, lay, slots).run(experts_reference, x)
    given = ExpertWeights.over(rows, lay, slots, used=np.array([1, 4, 5])).run(experts_reference, x)
    assert torch.equal(found, given) and torch.isfinite(found).all()


if __name__ == "__main__":
    check(sys.argv[1])
