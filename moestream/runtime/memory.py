"""Host memory: whether a model, its experts kept in host memory and (on the CPU) its KV cache fit, checked before
anything is allocated. The device's side is runtime/placement.py's (check_device_fits, with experts/budget.py).

    check_host_fits(model_config, ecfg)        # ecfg resolved; UserError saying what is needed and what is free

On the CPU every weight and the KV cache are in host memory; with a GPU, only the experts of host layers (pinned).
Available memory is the kernel's MemAvailable, or less where a cgroup (a container) sets a lower limit.

And the arithmetic of --moe-cache-mib auto (placement.py measures the device and calls it):

    auto_cache_mib(free=24_000 * MiB, rest=3_900 * MiB, scratch=1_152 * MiB, most=17_000 * MiB)     # 17000
"""
from __future__ import annotations

from ..errors import UserError
from ..arch.names import dense_numel
from .kv_cache import cache_nbytes
from .sliding_kv import engine_ring

MiB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def available_host_memory() -> int | None:
    """Bytes a new allocation can take without swapping, or None where this cannot be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:                                               # cgroup v2: the container's limit less what it uses
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            found.append(int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def host_bytes(cfg, ecfg, expert_bytes: int | None = None) -> tuple[int, int]:
    """(weights, KV cache) bytes that loading `cfg` as the resolved `ecfg` places in host memory (a hybrid model's
    recurrent states, whose size -c does not change, count as weights). expert_bytes: one expert's (a quantized
    file's blocks), if not the model dtype's."""
    size = DTYPE_BYTES[ecfg.placement.dtype]
    expert = expert_bytes or cfg.expert_numel * size
    b = ecfg.batching
    if ecfg.placement.device != "cpu":
        return len(ecfg.placement.host_layers(cfg)) * cfg.n_experts * expert, 0
    experts = len(cfg.expert_layers) * cfg.n_experts * expert
    # A hybrid model's DeltaNet states do not grow with -c: counted with the weights, the KV with the context.
    kv, states = cache_nbytes(cfg, b.n_seq, b.ctx_size, _torch_dtype(ecfg.placement.dtype), engine_ring(cfg, ecfg))
    return dense_numel(cfg) * size + experts + states, kv


def context_that_fits(kv_bytes: int, ctx: int, room: int) -> int:
    """The longest -c whose KV cache fits in `room` bytes, a tenth left for activations and the allocator, given
    the KV cache of `ctx` positions takes kv_bytes (every sequence's K and V, every layer); 0 when none does."""
    return max(0, int(0.9 * room // (kv_bytes // ctx)))


def check_host_fits(cfg, ecfg, available: int | None = None, expert_bytes: int | None = None) -> None:
    """Refuse, before loading, what cannot fit in host memory: the weights there, and the KV cache of -c (on the
    CPU), naming what each needs, what is available and a -c that fits."""
    available = available_host_memory() if available is None else available
    if available is None:
        return
    weights, kv = host_bytes(cfg, ecfg, expert_bytes)
    if weights + kv <= available:
        return
    b = ecfg.batching
    where = "the model's weights" if ecfg.placement.device == "cpu" else "the experts kept in host memory"
    if weights >= available:
        raise UserError(f"{where} need about {weights / MiB:.0f} MiB of host memory but {available / MiB:.0f} MiB are "
                        "available" + ("; keep fewer experts in host memory (--n-cpu-moe N)"
                                       if ecfg.placement.device != "cpu" else ""))
    fits = context_that_fits(kv, b.ctx_size, available - weights)
    seqs = f" ({b.n_seq} sequences)" if b.n_seq > 1 else ""
    raise UserError(f"-c {b.ctx_size}: the KV cache{seqs} needs {kv / MiB:.0f} MiB and {where} {weights / MiB:.0f} "
                    f"MiB, but {available / MiB:.0f} MiB of host memory are available; use -c {max(fits, 1)} or less"
                    + fewer_sequences(kv, b.n_seq, available - weights))


def fewer_sequences(kv_bytes: int, n_seq: int, room: int) -> str:
    """For several sequences, the other way out of a KV cache that does not fit: ", or at most N sequences" at this
    -c (the KV cache is linear in both), "" for one sequence."""
    if n_seq <= 1:
        return ""
    n = context_that_fits(kv_bytes, n_seq, room)          # the same arithmetic, over sequences instead of positions
    return f", or at most {n} sequences" if n else ""


AUTO_RESERVE = 1 << 30     # --moe-cache-mib auto leaves this free: activations, CUDA graphs' pools, workspaces,
                           # the allocator's slack (none of them is counted elsewhere before loading)


def auto_cache_mib(free: int, rest: int, scratch: int, most: int) -> int:
    """--moe-cache-mib auto, in MiB: the device's `free` bytes less `rest` (what the model still places there:
    dense weights, KV cache and recurrent states, device layers' experts, staging rows; 0 for a new cache over a
    loaded model), `scratch` (a prompt ubatch's routed experts dequantized or gathered into the compute dtype: one
    layer's) and AUTO_RESERVE. Never more than `most` (every host expert cached), rounded up to whole MiB; 0, the
    smallest pool, when nothing is left (the fit check then says what does not fit)."""
    room = free - rest - scratch - AUTO_RESERVE
    return max(0, min(room // MiB, -(-most // MiB)))


def _torch_dtype(name: str):
    import torch
    return getattr(torch, name)
