"""Process-wide measurement knobs, read from the environment once (A/Bs in one tree; bench/RESULTS.md names each):

    MOESTREAM_COPY=batch|kernel|calls               how cache misses reach their slots (experts/slots.py)
    MOESTREAM_COPY_PROGRAMS=N                       the row-copy kernel's programs (kernels/copy_rows.py)
    MOESTREAM_FLOAT_POOL=one|regions                a float pool's regions (experts/planner.py)
    MOESTREAM_HOT_SET=sequences|sum                 whose counts several-token steps keep (experts/hot_set.py)
    MOESTREAM_DECODE_QUANT=values|subblocks|runs    the quantized decode kernel (kernels/decode_quant.py)
    MOESTREAM_DELTA=fla|fla-recurrent|torch         the DeltaNet kernels on CUDA (kernels/delta.py)
    MOESTREAM_LANDINGS=device|host                  how a step's landings reach the next table (experts/zero_copy.py)
    MOESTREAM_HOST_ARRAYS=kernel|copy               how small host arrays reach the device (kernels/host_arrays.py)

A value outside a knob's choices logs a warning and keeps the default, so a typo never changes what runs
unnoticed (a lease once exported MOESTREAM_DELTA=fla-unfused, a name no code knew: RESULTS.md, stop 15).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("moestream")


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment's value of `name` if it is one of `choices`, else `default` (with a warning if set)."""
    v = os.environ.get(name, default)
    if v not in choices:
        log.warning("%s=%r is not one of %s: %s", name, v, ", ".join(choices), default)
        return default
    return v


def positive_int(name: str, default: int) -> int:
    """The environment's value of `name` if it is a positive whole number, else `default` (with a warning if set)."""
    v = os.environ.get(name, "")
    if v.isdigit() and int(v) > 0:
        return int(v)
    if v:
        log.warning("%s=%r is not a positive whole number: %d", name, v, default)
    return default
