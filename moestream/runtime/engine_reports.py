"""What an engine reports to its user: one-line descriptions of its experts and KV cache (printed by bench), and
its counters (LLM.stats(), bench's columns, /metrics). A mixin of runtime/engine.py's Engine, which holds what these
read (cfg, dtype, kv, model, experts, host, split).

    eng.describe_kv()      # "kv cache: 576 values a token and layer (latent; ...), ..."
    eng.stats()["total"]   # uploads, hits and misses since load
"""
from __future__ import annotations


class EngineReports:
    def describe_experts(self, file_types: dict[str, int] | None = None) -> str:
        """One line: the experts' types per layer and bytes per expert (quant/layout.py describe)."""
        from ..quant.layout import describe
        layouts, sizes = {}, {}
        for l, p in self.experts.by_layer.items():
            layouts[l] = p.layout(l)
            sizes[l] = layouts[l].row_bytes_for(self.dtype)
        return describe(layouts, sizes, file_types)

    def describe_kv(self) -> str:
        """One line: what the KV cache keeps a token, and its size here and at 128k tokens (kv_cache.describe_kv)."""
        from .kv_cache import describe_kv
        return describe_kv(self.cfg, self.kv.n_seq, self.kv.ctx, self.dtype, max(self.kv.ring, default=0))

    def stats(self) -> dict:
        """Upload and cache counters: totals since load, the current prompt's, and per layer (cumulative); and the
        bytes of PLE n-gram rows gathered on the host and copied to the device since load (ple_bytes)."""
        from ..experts.stats import CacheStats
        st = self.host.counters() if self.host is not None else CacheStats()
        total = CacheStats.summary(st.total)
        cache = self.host.cache_info() if self.host is not None else None
        out = {"cache": cache, "total": total, "prompt": CacheStats.summary(st.prompt),
               "per_layer": {l: c.as_dict() for l, c in sorted(st.total.items())},
               "uploaded_bytes": total["uploaded_bytes"], "uploaded_experts": total["copies"],
               "ple_bytes": self.model.ple.table.bytes_read if self.model.ple is not None else 0}
        if self.split is not None:      # the layers split over several devices: each one's counters
            out["per_device"] = self.device_stats()
        return out

    def device_stats(self) -> list[dict]:
        """Each device's counters where the layers are split over several (runtime/split.py), in the split's order:
        {"gpu": its index, "device", "layers": its layers, "cache": its pool (None: none), "total", "prompt"}; a
        device with no host layer counts nothing."""
        from ..experts.stats import CacheStats
        host = self.host
        counted = host.per_device() if host is not None else {}
        infos = (host.cache_info() or {}).get("devices", {}) if host is not None else {}
        out = []
        for d, dev in enumerate(self.split.devices):
            st = counted.get(d, CacheStats())
            out.append({"gpu": d, "device": dev.name, "layers": list(self.split.layers(d)), "cache": infos.get(d),
                        "total": CacheStats.summary(st.total), "prompt": CacheStats.summary(st.prompt)})
        return out

    def pinned_slots(self) -> int | None:
        """The expert cache's slots that the next forward could not evict (None: no cache), for /metrics. Call it
        between forwards, on the thread that owns the engine: the compute that read the last forward's slots is
        queued by then, so its reads are marked first (the next forward would do so before planning anything) and
        only pins that outlive their compute count. At rest it is 0; a pin that never goes away shows here."""
        return self.host.pinned_slots() if self.host is not None else None
