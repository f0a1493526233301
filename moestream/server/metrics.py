"""Prometheus metrics of the server: requests, tokens, latencies, and the engine's expert-cache counters.

    m = ServerMetrics()                      # its own registry: several servers in one process (tests) do not clash
    m.on_first_token(0.05)                   # the scheduler thread reports events as they happen
    m.on_http_error(404, "model_not_found")  # the ASGI guard reports every 4xx and 5xx answer
    m.set_engine_stats(engine_snapshot(llm))  # before a scrape, read on the scheduler thread
    body = m.render()                        # the text exposition format, for GET /metrics

The expert-cache counters are read from `LLM.stats()` at scrape time and exported only for the keys that exist:
`stats()["total"]` holds hits, misses, evictions, uploaded_bytes, copies, wait_s where the engine counts them;
older engines have uploaded_bytes and uploaded_experts at the top level. The gauges of ENGINE_GAUGES (the expert
pool's slots and pinned slots, the device memory torch holds) come from the top level of the same snapshot, where
it has them; the process's own (resident memory, CPU seconds, open files) are prometheus_client's `process_*`, so
that a soak (bench/soak.py) can watch a server it did not start. Where the layers are split over several GPUs
(`stats()["per_device"]`), the counters, the pool's slots and the memory held come one sample per GPU, with a `gpu`
label (its index in the split): `sum()` gives the totals.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The engine's counters: stats key -> (metric name without _total, help). Looked up in stats()["total"], then at the
# top level.
ENGINE_COUNTERS = {
    "hits": ("moestream_expert_cache_hits", "Routed experts found resident in the GPU expert cache"),
    "misses": ("moestream_expert_cache_misses", "Routed experts that had to be uploaded on demand"),
    "evictions": ("moestream_expert_cache_evictions", "Experts evicted from the GPU expert cache"),
    "uploaded_bytes": ("moestream_expert_uploaded_bytes", "Bytes of expert weights copied host to GPU"),
    "copies": ("moestream_expert_copies", "Expert copies host to GPU"),
    "uploaded_experts": ("moestream_expert_uploaded_experts", "Experts copied host to GPU"),
    "wait_s": ("moestream_expert_wait_seconds", "Time the compute stream waited for expert copies"),
    "host_read_bytes": ("moestream_expert_host_read_bytes",
                        "Bytes of expert weights decode kernels read in place from host memory (zero-copy decode)"),
}

# Gauges of the engine's snapshot: key -> (metric name, help); a key the snapshot lacks or holds None for is left out.
ENGINE_GAUGES = {
    "pool_slots": ("moestream_pool_slots", "Slots of the GPU expert cache (--moe-cache-mib)"),
    "pool_pinned_slots": ("moestream_pool_pinned_slots",
                          "Expert cache slots the next forward could not evict (0 at rest: a pin outliving its "
                          "compute shows here)"),
    "gpu_memory_bytes": ("moestream_gpu_memory_bytes", "Bytes torch's allocator holds in tensors on the GPU"),
}


def engine_snapshot(llm) -> dict:
    """llm.stats() and the gauges of ENGINE_GAUGES, read on the thread that owns the engine, between forwards."""
    st = llm.stats()
    eng = llm.engine
    snap = {**st, "pool_slots": (st.get("cache") or {}).get("slots"), "pool_pinned_slots": eng.pinned_slots(),
            "gpu_memory_bytes": eng.device.allocated_memory()}
    for d in snap.get("per_device", []):         # a split: each GPU's pool and memory beside its counters
        d["pool_slots"] = (d.get("cache") or {}).get("slots")
        d["gpu_memory_bytes"] = eng.split.devices[d["gpu"]].allocated_memory()
    return snap


class ServerMetrics:
    def __init__(self, n_slots: int = 0, queue_sizes=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moestream_requests", "Finished requests, by outcome (stop, length, cancelled, "
                                "error, rejected)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("moestream_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("moestream_prompt_tokens_cached",
                                     "Prompt tokens whose KV cache was reused (cache_prompt)", registry=r)
        self.generated = Counter("moestream_generation_tokens", "Generated tokens", registry=r)
        self.errors = Counter("moestream_http_errors", "Error answers, by status and kind (the error's code, else its "
                              "type: model_not_found, invalid_request_error, invalid_api_key, ...)",
                              ["status", "kind"], registry=r)
        self.ttft = Histogram("moestream_time_to_first_token_seconds", "From arrival to the first sampled token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.itl = Histogram("moestream_inter_token_latency_seconds", "Between two tokens of one request",
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.duration = Histogram("moestream_request_duration_seconds", "From arrival to the last token",
                                  buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.batch = Histogram("moestream_decode_batch_size", "Requests in one batched decode step",
                               buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.prompt_batch = Histogram("moestream_prompt_batch_size", "Prompts read in one prompt batch (-b tokens)",
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self._engine: dict = {}
        self._lock = threading.Lock()
        self._n_slots, self._queue_sizes = n_slots, queue_sizes
        r.register(_Collector(self))
        ProcessCollector(registry=r)         # process_resident_memory_bytes, ... (read from /proc: Linux only)

    # --- events (scheduler thread; prometheus_client is thread-safe) -----------------------------------------------
    def on_admit(self, req, n_cached: int) -> None:
        self.prompt_tokens.inc(len(req.prompt))
        self.cached_tokens.inc(n_cached)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.generated.inc()

    def on_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.generated.inc()

    def on_decode_batch(self, n: int) -> None:
        self.batch.observe(n)

    def on_prompt_batch(self, n: int) -> None:
        self.prompt_batch.observe(n)

    def on_finish(self, outcome: str, result=None) -> None:
        self.requests.labels(outcome).inc()
        if result is not None:
            self.duration.observe(result.duration_s)

    def on_rejected(self) -> None:
        self.requests.labels("rejected").inc()

    def on_http_error(self, status: int, kind: str) -> None:
        self.errors.labels(str(status), kind).inc()

    # --- scrape ----------------------------------------------------------------------------------------------------
    def set_engine_stats(self, stats: dict) -> None:
        with self._lock:
            self._engine = dict(stats or {})

    def set_queue_sizes(self, n_slots: int, fn) -> None:
        """fn() -> (running, waiting), read at scrape time."""
        self._n_slots, self._queue_sizes = n_slots, fn

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    """Gauges and engine counters computed at scrape time."""

    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        m = self.m
        if m._queue_sizes is not None:
            running, waiting = m._queue_sizes()
            for name, doc, v in (("moestream_requests_running", "Requests in a slot", running),
                                 ("moestream_requests_waiting", "Requests queued for a slot", waiting),
                                 ("moestream_slots", "Slots (parallel sequences, -np)", m._n_slots)):
                yield GaugeMetricFamily(name, doc, value=v)
        with m._lock:
            stats = m._engine
        devices = stats.get("per_device")
        if devices:
            yield from _per_gpu(devices)
            return
        total = stats.get("total") if isinstance(stats.get("total"), dict) else {}
        for key, (name, doc) in ENGINE_COUNTERS.items():
            v = total.get(key, stats.get(key))
            if _is_number(v):
                yield CounterMetricFamily(name, doc, value=v)
        for key, (name, doc) in ENGINE_GAUGES.items():
            v = stats.get(key)
            if _is_number(v):
                yield GaugeMetricFamily(name, doc, value=v)

    def describe(self):
        return []                          # computed at scrape time: nothing to check at registration


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_gpu(devices: list[dict]):
    """The engine's counters and gauges of a split, a sample per GPU (label gpu: its index in the split)."""
    for key, (name, doc) in ENGINE_COUNTERS.items():
        fam = CounterMetricFamily(name, doc, labels=["gpu"])
        for d in devices:
            if _is_number(d["total"].get(key)):
                fam.add_metric([str(d["gpu"])], d["total"][key])
        if fam.samples:
            yield fam
    for key, (name, doc) in ENGINE_GAUGES.items():
        fam = GaugeMetricFamily(name, doc, labels=["gpu"])
        for d in devices:
            if _is_number(d.get(key)):
                fam.add_metric([str(d["gpu"])], d[key])
        if fam.samples:
            yield fam
