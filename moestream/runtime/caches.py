"""Which KV cache a model keeps, and making it: a KVCache of every layer, a HybridCache where the model has DeltaNet
layers, a Qwen4Cache with QSA's keys or a PLE layer's states, a SlidingKVCache where sliding layers keep a ring.

    kv = make_cache(cfg, n_seq, ctx, torch.bfloat16, "cuda", ring=engine_ring(cfg, ecfg))
"""
from __future__ import annotations

from .kv_cache import HybridCache, KVCache, Qwen4Cache, kv_layout
from .sliding_kv import SlidingKVCache


def cache_class(cfg) -> type[KVCache]:
    """The cache a model of `cfg` keeps: a HybridCache where it has DeltaNet layers (a Qwen4Cache with QSA's keys or
    a PLE layer's states), else a KVCache of every layer."""
    if cfg.indexer_heads or cfg.ple_layers:
        return Qwen4Cache
    return HybridCache if cfg.linear_layers else KVCache


def make_cache(cfg, n_seq: int, ctx: int, dtype, device, where=None, ring: int = 0) -> KVCache:
    """The cache of a model of `cfg` (cache_class). where: layer -> the device of its share, where the layers are
    split over several (runtime/split.py; not with QSA or a PLE); None: every layer's on `device`. ring: positions
    each sliding layer keeps (runtime/sliding_kv.py's ring_positions; 0: the whole context)."""
    kind = cache_class(cfg)
    if kind is Qwen4Cache:
        return Qwen4Cache(cfg, n_seq, ctx, dtype, device)
    if kind is HybridCache:
        return HybridCache(cfg, n_seq, ctx, dtype, device, where)
    n_kv, hd, hd_v = kv_layout(cfg)
    on = device if where is None else [where(i) for i in range(cfg.n_stored_layers)]
    if ring:
        return SlidingKVCache(cfg, n_seq, ctx, ring, dtype, on)
    return KVCache(cfg.n_stored_layers, n_seq, ctx, n_kv, hd, dtype, on, hd_v)
