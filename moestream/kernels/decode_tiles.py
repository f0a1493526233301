"""The decode expert kernels' tiles: the fixed block shapes of kernels/decode.py (one token) that
kernels/decode_grouped.py (several tokens) reuses, and the rule that fits a block to a dimension (also
kernels/shared_expert.py's).

    bi, bh = fit(inter, GATE_UP[0]), fit(H, GATE_UP[1])

Fixed, not autotuned: a tuned choice could differ between runs, and with it the bits.
"""
from __future__ import annotations

try:
    import triton
except ImportError:          # the CPU build of torch has no Triton: no kernel launches there, so nothing fits
    triton = None

# (BLOCK_I, BLOCK_H, warps) of the gate/up launch, (BLOCK_O, BLOCK_I, warps) of the down launch.
GATE_UP = (2, 2048, 4)          # the fastest of 42 shapes on the H200 (bench/decode_kernel.py --sweep, since
                                # deleted: the sweep lives in git history at a5d4676)
DOWN = (4, 256, 4)


def fit(n: int, want: int) -> int:
    """The block along a dimension of n: `want`, or n's next power of two where that is smaller."""
    return min(want, triton.next_power_of_2(n))
