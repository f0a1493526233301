"""Process-wide knobs, read from the environment once. Every `MOESTREAM_*` name the code reads is here:

    MOESTREAM_DELTA=fla|torch      the DeltaNet kernels on CUDA: torch keeps the plain-torch references where fla-core
                                   is installed but does not run (kernels/delta.py)
    MOESTREAM_API_KEY=KEY          the server's key when --api-key is not given (server/cli.py)

A value outside a knob's choices logs a warning and keeps the default, so a typo never changes what runs
unnoticed (a lease once exported MOESTREAM_DELTA=fla-unfused, a name no code knew: RESULTS.md, stop 15).

Knobs kept only to repeat a finished A/B were removed at stop 47 (bench/RESULTS.md names each one's figures):
MOESTREAM_COPY, MOESTREAM_COPY_PROGRAMS, MOESTREAM_FLOAT_POOL, MOESTREAM_HOT_SET, MOESTREAM_DECODE_QUANT,
MOESTREAM_LANDINGS, MOESTREAM_HOST_ARRAYS and MOESTREAM_DELTA=fla-recurrent. The automatic choices they overrode
stay, each with its fallback where a platform lacks something (no Triton, no batch copy call in the driver).
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

