"""Expert kernels: `reference` (plain torch: the CPU path and every test's oracle) and `grouped` (CUDA).

Both have one signature:

    y = experts(x, slots, w13, w2)     # x (T, H); slots (T, k) int64; w13 (S, 2I, H); w2 (S, H, I) -> (T, k, H)

`slots[t, j]` is the slot holding token t's j-th routed expert. The output is unweighted: the MoE block combines
the k outputs in a fixed order, so an expert's result never depends on its slot or on the other experts.
"""
from __future__ import annotations

import torch

from .reference import experts_reference


def pick_kernel(name: str, device: torch.device, dtype: torch.dtype):
    """`auto` takes the grouped GEMM where it applies (CUDA, bf16), the reference everywhere else."""
    if name == "reference":
        return experts_reference
    if name == "grouped" or (name == "auto" and device.type == "cuda" and dtype == torch.bfloat16):
        from .grouped import experts_grouped, grouped_available
        if grouped_available(device, dtype):
            return experts_grouped
        if name == "grouped":
            from ..errors import UserError
            raise UserError("--kernel grouped needs CUDA, bfloat16 weights and torch._grouped_mm; use --kernel auto")
    return experts_reference
