"""A shared test driver for the slot scheduler without HTTP: requests submitted together, and a prompt's routing
counts run alone (test_scheduler.py, test_prefill_layers.py)."""
from __future__ import annotations

import queue

import numpy as np

from moestream import SamplingParams
from moestream.experts.routing import RouteCallback
from moestream.runtime.scheduler import Request

CTX = 128


def run(sched, prompts, max_tokens=8, **kw) -> list[tuple]:
    """Submit one request per prompt at once; each one's final event, in prompt order."""
    events = queue.Queue()
    reqs = [Request(p, SamplingParams(max_tokens=max_tokens), events.put, index=i, **kw) for i, p in enumerate(prompts)]
    sched.submit(reqs)
    done = {}
    while len(done) < len(reqs):
        ev = events.get(timeout=30)
        if ev[0] != "token":
            done[ev[1]] = ev
    return [done[i] for i in range(len(reqs))], reqs


def reference_routing(ref, prompt, max_tokens) -> tuple[np.ndarray, list[int]]:
    """Routing counts (layers x experts) of the prompt and its greedy continuation, run alone."""
    cfg = ref.model_config
    counts = np.zeros((cfg.n_layers, cfg.n_experts), dtype=np.int64)

    def on_route(layer, ids):
        np.add.at(counts[layer], ids.reshape(-1).cpu().numpy(), 1)

    observer = RouteCallback(on_route)
    ref.engine.observe(observer)
    try:
        out = ref.generate(prompt, max_tokens=max_tokens)
    finally:
        ref.engine.unobserve(observer)
    return counts, out.token_ids
