"""Plain-torch dequantizers, one per GGML type: the CPU path and every test's oracle.

    w = dequantize(data, Q.Q4_K)       # data (..., nbytes) uint8 -> (..., n) float32, bit-identical to gguf.quants

PLACEHOLDER until the torch dequantizers land: goes through gguf.quants (numpy, CPU).
"""
from __future__ import annotations

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as Q


def dequantize(data: torch.Tensor, qtype: Q) -> torch.Tensor:
    out = gguf.quants.dequantize(np.ascontiguousarray(data.cpu().numpy()), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(data.device)
