"""MXFP4 expert rows in the quantized-expert kernels (kernels/dequant.py, kernels/decode_quant.py), through Triton's
interpreter on the CPU as tests/test_quant_kernels.py runs the other types (its checks, on MXFP4 layouts): the
prompt path's dequantizer bit for bit against `ExpertLayout.dequantize` (quant/mxfp4.py's oracle), the decode GEMV
against the float32 oracle, with the same bits wherever the rows lie; and the same compiled on the GPU (`cuda`)."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreted import run_check

# MXFP4 alone, and beside the types a llama-quantize'd file may mix with it (a fallback down row of F16; Q8_0);
# the "runs" decode variant (kernels/qruns_units.py's _fp4) as tests/test_quant_kernels.py checks each type it covers,
# "fp4": its codes on each of the 16 nibbles. (The mixes with Q8_0 in the decode kernels and the lanes' order check
# cost the interpreter 20 s more: the mixes run compiled, `cuda`; the order is Q4_0's, below.)
CHECKS = ["dequant:MXFP4", "dequant:MXFP4,MXFP4,F16", "decode:MXFP4", "runs:MXFP4", "fp4"]


@pytest.mark.parametrize("check", CHECKS)
def test_mxfp4_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def test_mxfp4_lanes_read_x_in_q4_0s_order():
    """MXFP4's units and parts are Q4_0's (a block a unit, low then high nibbles of one run), so x in the lanes' order
    is Q4_0's, which tests/test_quant_kernels.py's order checks run through the kernel."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from moestream.kernels.qruns import lane_order, parts_words
    assert parts_words(Q.MXFP4) == parts_words(Q.Q4_0)
    for n, bb, k in ((256, 8, 1), (96, 1, 3), (2880, 2, 4)):
        assert np.array_equal(lane_order(Q.MXFP4, n, bb, k), lane_order(Q.Q4_0, n, bb, k))


def check(name: str):
    from test_quant_kernels import decode_check, dequant_check
    if name == "fp4":
        return fp4_check()
    kind, spec = name.split(":")
    if kind == "dequant":
        dequant_check(spec)
    elif kind == "decode":
        decode_check(spec, 2, 2)
    else:       # as test_quant_kernels' runs checks: one token with k = 3 and a down row of 3 blocks, then T = 2
        decode_check(spec, 1, 3, inter=768 if "," in spec else 256, variant="runs")
        decode_check(spec, 2, 2, seed=1, variant="runs")


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    from moestream.kernels.qruns_units import _fp4

    @triton.jit
    def _codes(out_ptr):
        """out (32,) float32: _fp4 of the nibbles 0..15 as low nibbles (out[:16]), then as high ones."""
        i = tl.arange(0, 32)
        v = (i % 16).to(tl.uint32) * 0x11111111                # the code in every nibble of the word
        tl.store(out_ptr + i, _fp4(v, (4 * (i // 16) + 8 * (i % 4)).to(tl.uint32)))


def fp4_check(device="cpu"):
    """The runs kernels' MXFP4 codes (qruns_units._fp4, float bits made with integers) are kvalues_mxfp4 exactly, but for
    code 8, -0.0."""
    from moestream.quant.mxfp4 import KVALUES
    out = torch.empty(32, device=device)
    _codes[(1,)](out)
    want = torch.tensor(KVALUES * 2, dtype=torch.float32)
    want[[8, 24]] = -0.0
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32)), out


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("spec", ["MXFP4", "MXFP4,MXFP4,Q8_0"])
def test_mxfp4_dequantize_rows_compiled_is_exact(spec):
    from test_quant_kernels import dequant_check
    dequant_check(spec, device="cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("T,k,I,H", [(1, 4, 2880, 2880), (8, 4, 768, 2048), (3, 6, 256, 512)])
def test_mxfp4_decode_compiled_matches_reference_and_reads_host_memory_in_place(T, k, I, H):
    """gpt-oss's expert shape (2880 x 2880, k = 4) among them; "runs" falls back to "values" for MXFP4."""
    from test_quant_kernels import test_decode_quant_compiled_matches_reference_and_reads_host_memory_in_place as t
    t("MXFP4", T, k, I, H)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("T", [1, 8])
def test_mxfp4_decode_runs_compiled_matches_reference_wherever_the_rows_lie(T):
    from test_quant_kernels import test_decode_runs_compiled_matches_reference_wherever_the_rows_lie as t
    t("MXFP4", T)
    t("MXFP4,MXFP4,Q8_0", T)


@pytest.mark.cuda
@needs_cuda
def test_mxfp4_codes_compiled_are_exact():
    fp4_check("cuda")


if __name__ == "__main__":
    check(sys.argv[1])
