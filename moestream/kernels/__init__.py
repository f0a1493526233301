"""Expert kernels: `reference` (plain torch: the CPU path and every test's oracle) and `grouped` (CUDA), and for
zero-copy decode steps `decode` (Triton) with its plain-torch oracle.

Both have one signature:

    y = experts(x, slots, w13, w2)     # x (T, H); slots (T, k) int64; w13 (S, 2I, H); w2 (S, H, I) -> (T, k, H)

`slots[t, j]` is the slot holding token t's j-th routed expert. The output is unweighted: the MoE block combines
the k outputs in a fixed order, so an expert's result never depends on its slot or on the other experts.
"""
from __future__ import annotations

import functools

import torch

from .reference import AddressBook, experts_by_address_reference, experts_reference


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


def pick_decode_kernel(want: bool | None, device: torch.device, dtype: torch.dtype, book: AddressBook):
    """The kernel of zero-copy decode steps, `fn(x, addrs, weights, inter) -> (T, H)`, or None (decode fetches).
    want None: on where the Triton kernel runs (CUDA, 16-bit weights). On the CPU it can be asked for (the tests
    do): the plain-torch oracle then reads experts by address through `book`."""
    from .decode import decode_available, experts_by_address
    if decode_available(device, dtype) and want in (None, True):
        return experts_by_address
    if want and device.type == "cpu":
        return functools.partial(experts_by_address_reference, book=book)
    if want:
        from ..errors import UserError
        raise UserError("zero-copy decode needs Triton and 16-bit weights on CUDA; drop --zero-copy-decode")
    return None
