"""MXFP4 expert rows in the quantized-expert kernels (kernels/dequant.py, kernels/decode_quant.py), through Triton's
interpreter on the CPU as tests/test_quant_kernels.py runs the other types (its checks, on MXFP4 layouts): the
prompt path's dequantizer bit for bit against `ExpertLayout.dequantize` (quant/mxfp4.py's oracle), the decode GEMV
against the float32 oracle, with the same bits wherever the rows lie; and the same compiled on the GPU (`cuda`)."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreted import run_check

# MXFP4 alone, and beside the types a llama-quantize'd file may mix with it (a fallback down row of F16; Q8_0)
CHECKS = ["dequant:MXFP4", "dequant:MXFP4,MXFP4,F16", "decode:MXFP4", "decode:MXFP4,MXFP4,Q8_0"]


@pytest.mark.parametrize("check", CHECKS)
def test_mxfp4_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def check(name: str):
    from test_quant_kernels import decode_check, dequant_check
    kind, spec = name.split(":")
    if kind == "dequant":
        dequant_check(spec)
    else:
        decode_check(spec, 2, 2)


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


if __name__ == "__main__":
    check(sys.argv[1])
