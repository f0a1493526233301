"""Expert kernels: `reference` (plain torch: the CPU path and every test's oracle) and `grouped` (CUDA), and for
zero-copy decode steps `decode` (Triton; steps of several tokens in `decode_grouped`) with its plain-torch oracle.

The first two have one signature:

    y = experts(x, slots, w13, w2)     # x (T, H); slots (T, k) int64; w13 (S, 2I, H); w2 (S, H, I) -> (T, k, H)
    y = experts(x, slots, w13, w2, act)     # gpt-oss: act an OaiSwiglu (each choice's expert id, biases, clamp)

`slots[t, j]` is the slot holding token t's j-th routed expert. The output is unweighted: the MoE block combines
the k outputs in a fixed order, so an expert's result never depends on its slot or on the other experts.

The decode kernels (pick_decode_kernel) take each choice's address instead of its slot, and the same OaiSwiglu:

    out = by_address(x, addrs, weights, layout, landing)            # -> (T, H), combined
    out = by_address(x, addrs, weights, layout, landing, act)       # gpt-oss: biases read at act.ids, never a slot
"""
from __future__ import annotations

import torch

from .reference import AddressBook, OaiSwiglu, experts_by_address_reference, experts_reference


def by_address_kernels(blocks) -> bool:
    """Whether the zero-copy decode kernels (decode.py, decode_grouped.py, decode_quant.py with its runs, fp8.py,
    and their oracle) compute this family's expert MLP (arch/blocks.py's Blocks): SwiGLU, and gpt-oss's clamped
    SwiGLU with biases on every expert layout (an OaiSwiglu, kernels/decode_act.py). A family whose MLP they do not
    compute gets no by-address kernel from the decode plan (runtime/plan.py): its decode steps fetch."""
    e = blocks.experts
    return (e.activation == "swiglu" and not e.bias) or (e.activation == "swiglu_oai" and e.bias)


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


def pick_decode_kernel(want: bool | None, device: torch.device, dtype: torch.dtype, book: AddressBook,
                       layouts: list | None = None):
    """The kernel of zero-copy decode steps, `fn(x, addrs, weights, layout, landing) -> (T, H)`, or None (decode
    fetches). want None: on where a Triton kernel runs: CUDA, 16-bit activations, and float expert rows or
    quantized ones whose types all have a path (kernels/decode_quant.py). On the CPU it can be asked for (the
    tests do): the plain-torch oracle then reads experts by address through `book`."""
    from .decode import decode_available, experts_by_address
    quantized = any(lay.quantized for lay in layouts or ())
    if want in (None, True) and decode_available(device, dtype):
        if not quantized:
            return staged(lambda x, addrs, weights, layout, landing=None, act=None: experts_by_address(
                x, addrs, weights, layout.inter, landing, act=act))
        from .decode_quant import decode_quant_available, experts_by_address_quant
        from .qblocks import kvalues
        if all(decode_quant_available(lay) for lay in layouts):
            kvalues(torch.device(device))           # made now: the steps' graphs may not copy it in
            return staged(experts_by_address_quant)
    if want and device.type == "cpu":
        return staged(lambda x, addrs, weights, layout, landing=None, act=None: experts_by_address_reference(
            x, addrs, weights, layout, landing, book=book, act=act), book)
    if want:
        from ..errors import UserError
        raise UserError("zero-copy decode needs Triton and 16-bit weights on CUDA, and a Triton path for every "
                        "expert type of the file; drop --zero-copy-decode")
    return None


def staged(kernel, book: AddressBook | None = None):
    """The decode kernel behind staged host reads (kernels/stage.py): where the step's landing carries a scratch,
    its host rows are copied to the device first (by the Triton launch, or on the CPU through `book`), and the
    kernel reads them there and lands nothing itself. A step of more choices than one copy launch plans
    (stage.MAX_CHOICES) reads its host rows in place and lands nothing (ReadThrough.absorb replays the
    same rule)."""
    from .stage import stage_host_rows, stage_reference, stages

    def run(x, addrs, weights, layout, landing=None, act=None):
        if landing is not None and landing.scratch is not None:
            if stages(landing, addrs.numel()):
                nbytes = layout.row_bytes_for(x.dtype)
                addrs = (stage_host_rows(addrs, landing, nbytes) if book is None
                         else stage_reference(addrs, landing, nbytes, book))
            landing = None
        return kernel(x, addrs, weights, layout, landing, act=act)
    return run
