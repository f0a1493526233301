"""Where host layers' experts go on the device: the provider of host layers (uploads per ubatch, the expert cache,
or the upload rows kept as the smallest cache), the cache's slots, and whether the device's part of a placement
fits, checked before anything is loaded.

    ecfg, n_slots = fit_cache(cfg, ecfg, plan, dev, dtype, host, layouts)  # auto in MiB; None: no cache; UserError
    provider = host_provider(cfg, ecfg, plan, store, dev, n_slots, routing)
    ecfg, n_slots = fit_cache(cfg, ecfg, plan, dev, dtype, host, layouts, store.expert_bytes)   # a new cache
"""
from __future__ import annotations

import logging

import torch

from ..config import ModelConfig
from ..engine_config import EngineConfig
from ..device import Device
from ..errors import UserError
from ..experts.budget import cache_slots, check_cache_fits, check_placement_fits
from ..experts.buffered import BufferedCache, buffer_decodes
from ..experts.cache import ExpertCache
from ..experts.per_device import PerDevice
from ..experts.routing import RoutingStore
from ..experts.store import ExpertStore
from ..experts.upload import UploadPerUbatch
from ..kernels.stage import staging_bytes
from ..arch.names import dense_numel
from ..quant.layout import ExpertLayout
from .kv_cache import cache_nbytes
from .sliding_kv import engine_ring
from .memory import AUTO_RESERVE, auto_cache_mib, context_that_fits, fewer_sequences
from .plan import DecodePlan

log = logging.getLogger("moestream")

MiB = 1 << 20
SECOND_ROWS_FREE = 2 << 30     # no cache: a second set of upload rows only where this much stays free


def host_provider(cfg: ModelConfig, ecfg: EngineConfig, plan: DecodePlan, store: ExpertStore, dev: Device,
                  n_slots: int | None, routing: RoutingStore):
    """No cache: uploads per ubatch, into rows that zero-copy decode keeps as the smallest cache (buffered.py) where
    the plan has it and it gains (buffer_decodes); or the expert cache with its copy stream and prefetcher."""
    args = (cfg.n_stored_layers, cfg.n_experts, dev, ecfg.cache.policy, ecfg.cache.prefetch, sorted(store.rows),
            ecfg.batching.n_seq, cfg.n_experts_used, cfg.expert_layers, routing)
    if n_slots is None:
        second = second_rows(cfg, ecfg, store, dev)
        if plan.zero_copy and buffer_decodes(cfg.n_experts, len(store.rows), cfg.n_experts_used, plan.lands):
            return BufferedCache(store, *args, second=second)
        return UploadPerUbatch(store, cfg.n_experts, dev, cfg.n_experts_used, plan.staged,
                               second=second, prefetch=ecfg.cache.prefetch)
    log.info("moe cache: %.0f MiB = %d slots of %.1f MB (%s policy)", n_slots * store.expert_bytes / MiB, n_slots,
             store.expert_bytes / 1e6, ecfg.cache.policy)
    return ExpertCache(store, n_slots, *args)


def second_rows(cfg: ModelConfig, ecfg: EngineConfig, store: ExpertStore, dev: Device) -> bool:
    """Whether no-cache uploads get a second set of rows (experts/upload.py: the next layer's copies under this
    one's compute): with prefetch on, and where both sets leave SECOND_ROWS_FREE of device memory free."""
    rows = cfg.n_experts * max(r.shape[1] * r.element_size() for r in store.rows.values())
    second = ecfg.cache.prefetch.enabled and dev.free_memory() - 2 * rows >= SECOND_ROWS_FREE
    if second and len(store.rows) > 1:
        log.info("uploads: two sets of expert rows (%.0f MiB each), one layer's copies under another's compute",
                 rows / MiB)
    return second and len(store.rows) > 1


def split_provider(cfg: ModelConfig, ecfg: EngineConfig, plan: DecodePlan, split, host_rows: dict, layouts: dict,
                   n_slots: dict[int, int | None]) -> PerDevice:
    """The host layers of a split (runtime/split.py): host_provider per device over its share's host layers, each
    with its own store view (the same pinned rows), pool, copy stream and routing statistics."""
    providers, devices, owner, gpus = [], [], {}, []
    for d, dev in enumerate(split.devices):
        mine = sorted(split.holds(d, host_rows))
        if not mine:
            continue
        store = ExpertStore({l: host_rows[l] for l in mine}, {l: layouts[l] for l in mine})
        routing = RoutingStore(cfg.n_stored_layers, cfg.n_experts, ecfg.batching.n_seq, dev.torch)
        with dev.current():
            providers.append(host_provider(cfg, ecfg, plan, store, dev, n_slots[d], routing))
        owner.update({l: len(devices) for l in mine})
        devices.append(dev)
        gpus.append(d)
    return PerDevice(providers, devices, owner, gpus)


def fit_split(cfg: ModelConfig, ecfg: EngineConfig, plan: DecodePlan, split, dtype: torch.dtype, host: set[int],
              layouts: dict[int, ExpertLayout]) -> tuple[EngineConfig, dict[int, int | None]]:
    """fit_cache for each device of a split: its share's host layers get a pool of its --moe-cache-mib (a figure
    per device, or the one figure for each), checked against its share of the model. `ecfg` with auto made each
    device's MiB; the slots per device index."""
    mib = ecfg.cache.mib
    mibs = mib if isinstance(mib, tuple) else (mib,) * len(split)
    n_slots, made = {}, list(mibs)
    for d, dev in enumerate(split.devices):
        mine, on = split.holds(d, host), split.holds(d, cfg.expert_layers) | set(split.layers(d))
        if not on:
            continue
        fitted, n_slots[d] = fit_cache(cfg, ecfg.updated({"cache.mib": mibs[d] if mine else None}), plan, dev,
                                       dtype, mine, layouts, on=on)
        made[d] = fitted.cache.mib if mine else mibs[d]
        if mine and n_slots[d] is not None:
            log.info("moe cache on %s: layers %s", dev.name, ",".join(map(str, sorted(mine))))
    return (ecfg.updated({"cache.mib": tuple(made)}) if "auto" in mibs else ecfg), n_slots


def fit_cache(cfg: ModelConfig, ecfg: EngineConfig, plan: DecodePlan, dev: Device, dtype: torch.dtype,
              host: set[int], layouts: dict[int, ExpertLayout],
              slot: int | None = None, on: set[int] | None = None) -> tuple[EngineConfig, int | None]:
    """The slots-and-fit sequence of a new pool, at load and for a new cache (Engine.reconfigure_cache): `ecfg`
    with --moe-cache-mib auto made a number of MiB (auto_cache), and the expert cache's slots (experts/budget.py;
    None: no cache), refused with a UserError where they do not fit the device: at load, with everything else the
    device will hold (check_device_fits, before anything is loaded); over a loaded model (the old cache gone:
    `slot`, the store's expert bytes, given), the pool alone in the free memory. on: the layers this device holds,
    where the layers are split over several (fit_split; None: every layer)."""
    loaded = slot is not None
    slot = slot if loaded else slot_bytes(layouts, host, dtype)
    rest = 0 if loaded else device_bytes(cfg, ecfg, dtype, host, layouts, on)   # the rest of the model: in place
    ecfg = auto_cache(cfg, ecfg, plan, dev, dtype, len(host), slot, rest)
    n_slots = cache_slots(ecfg.cache.mib, slot, cfg.n_experts, len(host), ecfg.batching.ubatch * cfg.n_experts_used)
    if not loaded:
        check_device_fits(cfg, ecfg, plan, dev, dtype, host, n_slots, layouts, on)
    elif n_slots is not None:
        check_cache_fits(ecfg.cache.mib, n_slots * slot, 0, dev.free_memory(), dev.name)
    return ecfg, n_slots


def auto_cache(cfg: ModelConfig, ecfg: EngineConfig, plan: DecodePlan, dev: Device, dtype: torch.dtype,
               n_host_layers: int, slot: int, rest: int = 0) -> EngineConfig:
    """`ecfg` with --moe-cache-mib auto made the MiB the device has left (memory.auto_cache_mib), logged; `ecfg`
    itself for a number, or with no host layer (no cache). rest: what the model still places on the device
    (device_bytes; 0 for a new cache over a loaded model). On the CPU, auto is 0, the smallest pool: the experts
    are already in host memory, and a bigger cache would only copy them there once more."""
    if ecfg.cache.mib != "auto" or not n_host_layers:
        return ecfg
    if not dev.is_cuda:
        log.info("moe cache: auto = 0 MiB on %s (the smallest pool: the experts are in this memory already)",
                 dev.name)
        return ecfg.updated({"cache.mib": 0})
    if plan.staged:
        rest += staging_bytes(slot, cfg.n_experts_used)      # the staged host reads' rows, beside the pool
    scratch = cfg.n_experts * cfg.expert_numel * torch.empty((), dtype=dtype).element_size()
    free = dev.free_memory()
    mib = auto_cache_mib(free, rest, scratch, n_host_layers * cfg.n_experts * slot)
    log.info("moe cache: auto = %d MiB (%.0f MiB free on %s, less %.0f MiB for the rest of the model, %.0f MiB for "
             "a prompt's dequantized experts and %.0f MiB kept free)", mib, free / MiB, dev.name, rest / MiB,
             scratch / MiB, AUTO_RESERVE / MiB)
    return ecfg.updated({"cache.mib": mib})


def device_bytes(cfg: ModelConfig, ecfg: EngineConfig, dtype: torch.dtype, host: set[int],
                 layouts: dict[int, ExpertLayout], on: set[int] | None = None) -> int:
    """The bytes a placement puts on the device besides the host layers' pool (check_device_fits' sums): dense
    weights, the KV cache of -c and recurrent states, the device layers' experts (on: of the layers it holds, the
    dense part and the caches as their share of the layers)."""
    size = torch.empty((), dtype=dtype).element_size()
    experts = sum(cfg.n_experts * layouts[l].row_bytes_for(dtype) for l in _held(cfg, on) if l not in host)
    kv, states = cache_nbytes(cfg, ecfg.batching.n_seq, ecfg.batching.ctx_size, dtype, engine_ring(cfg, ecfg))
    return int((dense_numel(cfg) * size + kv + states) * _share(cfg, on)) + experts


def _held(cfg: ModelConfig, on: set[int] | None) -> list[int]:
    return [l for l in cfg.expert_layers if on is None or l in on]


def _share(cfg: ModelConfig, on: set[int] | None) -> float:
    """The share of the model's layers a device holds (1: every layer, one device)."""
    return 1.0 if on is None else len([l for l in on if l < cfg.n_layers]) / cfg.n_layers


def slot_bytes(layouts: dict[int, ExpertLayout], host: set[int], dtype: torch.dtype) -> int:
    """The bytes of one cache slot: the largest host layer's expert row."""
    return max((layouts[l].row_bytes_for(dtype) for l in host), default=0)


def check_device_fits(cfg: ModelConfig, ecfg: EngineConfig, plan: DecodePlan, dev: Device, dtype: torch.dtype,
                      host: set[int], n_slots: int | None, layouts: dict[int, ExpertLayout],
                      on: set[int] | None = None) -> None:
    """Refuse, before loading anything, a placement whose device part cannot fit in free device memory (on: the
    layers it holds, where they are split over several devices)."""
    if not dev.is_cuda:
        return
    size = torch.empty((), dtype=dtype).element_size()
    dev_layers = [l for l in _held(cfg, on) if l not in host]
    rest = sum(cfg.n_experts * layouts[l].row_bytes_for(dtype) for l in dev_layers)     # the device layers' experts
    b = ecfg.batching
    kv, states = cache_nbytes(cfg, b.n_seq, b.ctx_size, dtype, engine_ring(cfg, ecfg))   # states: DeltaNet layers',
    # sliding layers' rings: the same for any -c
    kv, states = int(kv * _share(cfg, on)), int(states * _share(cfg, on))
    fixed = int(dense_numel(cfg) * size * _share(cfg, on)) + states      # what does not shrink with -c
    free = dev.free_memory()
    if fixed + kv > free:                 # no placement of the experts helps: the context is what does not fit
        fits = max(1, context_that_fits(kv, b.ctx_size, free - fixed)) if free > fixed else 0
        seqs = f" ({b.n_seq} sequences)" if b.n_seq > 1 else ""
        kept = "recurrent states" if cfg.linear_layers else "sliding layers' rings"
        what = f"attention, embeddings and {kept}" if states else "attention and embeddings"
        raise UserError(f"-c {b.ctx_size}: the KV cache{seqs} needs {kv / MiB:.0f} MiB on {dev.name} beside "
                        f"{fixed / MiB:.0f} MiB of {what}, but {free / MiB:.0f} MiB are free; "
                        + (f"use -c {fits} or less" + fewer_sequences(kv, b.n_seq, free - fixed)
                           if fits else "this model does not fit on this device"))
    rest += kv + fixed
    pool = 0
    slot = slot_bytes(layouts, host, dtype)
    if host:
        pool = (n_slots if n_slots is not None else cfg.n_experts) * slot   # the cache or upload buffer
        if plan.staged:
            pool += staging_bytes(slot, cfg.n_experts_used)         # the staged host reads' scratch rows
    if n_slots is not None:
        check_cache_fits(ecfg.cache.mib, pool, rest, free, dev.name)
    layer = max(cfg.n_experts * lay.row_bytes_for(dtype) for lay in layouts.values()) if layouts else 0
    check_placement_fits(rest + pool, free, dev.name, layer, len(cfg.moe_layers), len(dev_layers))
