"""Memory budgets of the experts: --moe-cache-mib as slots, and whether a placement fits the device.

    n = cache_slots(16000, expert_bytes=9_437_184, n_experts=128, n_host_layers=48, ubatch_routes=512 * 8)  # 1777
    check_cache_fits(16000, n * 9_437_184, rest_bytes=..., free=dev.free_memory(), device="cuda:0")
    check_placement_fits(need_bytes, free, "cuda:0", n_experts * expert_bytes, n_moe_layers, n_device_layers)

Plain integers in, UserError out: each refusal says which flag to change, and to what. Device-free on purpose
(the engine measures free memory and the rest of the model and passes them in).
"""
from __future__ import annotations

import logging

from ..errors import UserError

log = logging.getLogger("moestream")
MiB = 1 << 20
MARGIN = 256 * MiB          # left free when suggesting a cache size: allocator slack, CUDA graphs, workspaces


def cache_slots(mib: int | None, expert_bytes: int, n_experts: int, n_host_layers: int,
                ubatch_routes: int) -> int | None:
    """Slots of the expert cache for --moe-cache-mib `mib` (None: no cache, each ubatch uploads its experts). 0 MiB:
    one layer's experts, the smallest pool that never needs waves. Never more slots than host experts.
    ubatch_routes (tokens x top-k of one ubatch) only decides whether to warn about waves."""
    if mib is None or not n_host_layers:
        return None
    if mib == 0:
        n = n_experts
    else:
        n = mib * MiB // expert_bytes
        if n < 1:
            raise UserError(f"--moe-cache-mib {mib} holds no expert (one is {expert_bytes / MiB:.1f} MiB); "
                            f"use at least {-(-expert_bytes // MiB)} or 0 for the smallest pool")
    n = min(n, n_host_layers * n_experts)
    if n < min(n_experts, ubatch_routes):
        log.warning("moe cache of %d slots is smaller than one layer's %d experts: ubatches that route more than %d "
                    "experts in one layer run in waves (correct, but slower)", n, n_experts, n)
    return n


def check_cache_fits(mib: int | None, pool_bytes: int, rest_bytes: int, free: int, device: str) -> None:
    """Refuse a cache of `pool_bytes` that does not fit in `free` bytes beside `rest_bytes` (the rest of the model
    still to be allocated; 0 when it already is, as for a new cache over a loaded model)."""
    if pool_bytes + rest_bytes <= free:
        return
    rest = f" and the rest of the model takes {rest_bytes / MiB:.0f} MiB" if rest_bytes else ""
    room = free - rest_bytes - MARGIN
    raise UserError(f"--moe-cache-mib {mib} does not fit: {free / MiB:.0f} MiB are free on {device}{rest}; "
                    f"use --moe-cache-mib {max(0, int(room // MiB))} or less")


def check_placement_fits(need_bytes: int, free: int, device: str, layer_bytes: int, n_moe_layers: int,
                         n_device_layers: int) -> None:
    """Refuse a placement that needs more than `free` bytes on the device, suggesting how many MoE layers
    (`layer_bytes` each; `n_device_layers` of them on the device now) to keep in host memory instead."""
    if need_bytes <= free:
        return
    fit = max(0, int((free - (need_bytes - n_device_layers * layer_bytes)) // layer_bytes))
    raise UserError(f"the model needs about {need_bytes / MiB:.0f} MiB on {device} but {free / MiB:.0f} MiB are "
                    f"free; keep experts in host memory with --cpu-moe or --n-cpu-moe {n_moe_layers - fit}")
