"""Where a decode step's wall time goes: the GPU's time per step (CUDA events around the step) against the host's
(the zero-copy table written before it, the learning after it), all on the GPU and over caches.

    python bench/decode_steps.py MODEL [--cpu-moe --moe-cache-mib 16000,24000] [--read-through] [-n 64]

Each configuration reads one 4096-token prompt (ubatch 2048), then decodes n tokens greedily, as `bench` tg does.
"""
import argparse
import statistics
import time

import torch

from moestream import LLM
from moestream.experts import zero_copy
from moestream.runtime import graphs

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--cpu-moe", action="store_true")
ap.add_argument("--moe-cache-mib", default="16000")
ap.add_argument("--read-through", action="store_true")
ap.add_argument("-n", type=int, default=64)
ap.add_argument("-p", type=int, default=4096)
ap.add_argument("--from-zero", action="store_true", help="decode from position 0 after the prompt, as bench tg does")
ns = ap.parse_args()

TIMES: dict[str, list[float]] = {}


def timed(cls, name):
    fn = getattr(cls, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TIMES.setdefault(name, []).append(time.perf_counter() - t)
    setattr(cls, name, wrapper)


for name in ("begin_step", "end_step", "_learn", "_absorb", "_hand_out_landing"):
    timed(zero_copy.ZeroCopyDecode, name)
CUDA = torch.cuda.is_available()
EVENTS: list = []                # (before, after) the graph replay of each step: the GPU's own time
_replay = graphs.DecodeGraphs.run


def replay(self, steps, span):
    if not CUDA:
        return _replay(self, steps, span)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = _replay(self, steps, span)
    b.record()
    EVENTS.append((a, b))
    return out


graphs.DecodeGraphs.run = replay


def run(llm, label):
    eng = llm.engine
    V = llm.model_config.vocab_size
    prompt = torch.randint(0, V, (ns.p,), generator=torch.Generator().manual_seed(7)).tolist()
    for rep in range(2):
        eng.begin_prompt(0)
        tok = int(eng.prefill(0, prompt, 0)[-1].argmax())
        before = llm.stats()["total"]
        TIMES.clear()
        EVENTS.clear()
        walls = []
        start = 0 if ns.from_zero else ns.p
        if ns.from_zero:
            tok = prompt[0]
        eng.synchronize()
        t_all = time.perf_counter()
        for pos in range(start, start + ns.n):
            t = time.perf_counter()
            lg = eng.decode([(0, tok, pos)])
            tok = int(lg[0].argmax())
            walls.append(time.perf_counter() - t)
        eng.synchronize()
        total = time.perf_counter() - t_all
        after = llm.stats()["total"]
        reads = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in ("host_reads", "copies", "landed")}
        gpus = [a.elapsed_time(b) / 1e3 for a, b in EVENTS]
        ms = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0      # noqa: E731
        parts = " ".join(f"{k} {ms(v):.3f}" for k, v in sorted(TIMES.items()))
        print(f"| {label} | {rep} | {ns.n / total:.1f} | {ms(walls):.3f} | {ms(gpus):.3f} | "
              f"{ms(walls) - ms(gpus):.3f} | {parts} | {reads} |", flush=True)
        if rep:
            print("  per step wall ms:", " ".join(f"{1e3 * w:.2f}" for w in walls))
            print("  per step GPU ms: ", " ".join(f"{g * 1e3:.2f}" for g in gpus))


print("| config | rep | tok/s | wall ms/step (median) | GPU ms/step (events) | gap ms | host parts ms (median) | counts |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
if not ns.cpu_moe:
    run(LLM(ns.model, ctx_size=ns.p + ns.n, ubatch_size=2048, batch_size=4096, zero_copy_decode=True), "all-GPU")
else:
    sizes = [int(s) for s in ns.moe_cache_mib.split(",")]
    llm = LLM(ns.model, ctx_size=ns.p + ns.n, ubatch_size=2048, batch_size=4096, cpu_moe=True, moe_cache_mib=sizes[0],
              zero_copy_decode=True, read_through=ns.read_through)
    for i, mib in enumerate(sizes):
        if i:
            llm.engine.reconfigure_cache(moe_cache_mib=mib, read_through=ns.read_through)
        run(llm, f"{mib} MiB{' read-through' if ns.read_through else ''}{' from 0' if ns.from_zero else ''}")
