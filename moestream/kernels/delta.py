"""Which Gated DeltaNet kernels a forward runs (models/deltanet.py's DeltaKernels), decided once at load.

    k = pick_delta_kernels(device, dtype)       # DeltaKernels: conv, chunk (prompts), recurrent (decode steps)
    y, st = gated_deltanet(x, lw, cfg, st, kernels=k)

Plain torch everywhere today (models/deltanet.py: the CPU path and the oracle). fla-core's CUDA kernels
(causal_conv1d, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) go here, behind a lazy import and an
adapter to the references' signatures, tested against them as the expert kernels are against theirs.
"""
from __future__ import annotations

import torch


def pick_delta_kernels(device: torch.device, dtype: torch.dtype):
    """The DeltaNet kernels for this device and dtype: the plain-torch references (the only ones yet)."""
    from ..models.deltanet import TORCH
    return TORCH
