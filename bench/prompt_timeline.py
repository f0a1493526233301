"""Where a cached prompt's time goes on the GPU: the copy stream and the compute stream, from a torch.profiler trace.
The `profile` suite of bench/gpu.sh runs it.

    python bench/prompt_timeline.py MODEL OUT [--mib 16000] [-ub 4096,2048] [-p 4096] [--cprofile] [ENGINE FLAGS]

Per ubatch size (one load for all): three warm prompts of 4096 tokens (-p), then one profiled. Prints each stream's busy
time, the copies' bytes and rate, and the copy stream's idle gaps inside the prompt (the link is the bound at 16000
MiB: every gap is time lost to it). The trace goes to OUT/prompt_trace_UB.json.gz for a closer look; the host's
per-layer calls into the expert cache are marked ("fetch L", "launched L": the layer's routing is read and its
misses queued; its experts are queued and the next layers' copies go ahead). --cprofile: then one more warm prompt
under cProfile, the host's time by function (the `host ms/layer` column of bench is the GPU's idle time between a
layer's routing read-back and its experts' launch: this says which calls it is made of).
"""
import argparse
import cProfile
import gzip
import json
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moestream import LLM, flags
from moestream.experts.cache import ExpertCache

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("out")
ap.add_argument("--mib", type=int, default=16000)
ap.add_argument("-ub", default="4096", help="ubatch sizes, comma list")
ap.add_argument("-p", type=int, default=4096, help="tokens per prompt")
ap.add_argument("--cprofile", action="store_true", help="also the host's time by function over one more prompt")
OWN = ("ctx_size", "batch_size", "ubatch_size", "cpu_moe", "n_cpu_moe", "moe_cache_mib")    # this script sets these
ENGINE = [o.name for o in flags.OPTIONS if o.flags and o.name not in OWN]
flags.add_engine_arguments(ap, ENGINE)      # the rest, as moestream's commands spell them (--prefetch-max-inflight-mib)
ns = ap.parse_args()
os.makedirs(ns.out, exist_ok=True)
N = ns.p


def marked(name, fn):
    def wrapper(self, layer, *a, **kw):
        with record_function(f"{name} {layer}"):
            return fn(self, layer, *a, **kw)
    return wrapper


ExpertCache.fetch = marked("fetch", ExpertCache.fetch)
ExpertCache.experts_launched = marked("launched", ExpertCache.experts_launched)


def union(iv):
    """Sorted intervals [a, b) merged where they overlap."""
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def timeline(llm, ub: int, seed: int) -> None:
    eng = llm.engine
    V = llm.model_config.vocab_size
    eng.set_batching(max(ub, 4096), ub)
    for s in range(3):
        eng.begin_prompt(0)
        eng.prefill(0, rand(V, N, seed + s))
    eng.synchronize()
    eng.begin_prompt(0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.prefill(0, rand(V, N, seed + 3))
        eng.synchronize()
    path = os.path.join(ns.out, f"prompt_trace_{ub}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    with gzip.open(path + ".gz", "wt") as f:
        json.dump(trace, f)
    os.remove(path)

    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print(f"ubatch {ub}: no GPU events in the trace (a CUDA machine is needed); stats {llm.stats()['prompt']}")
        return
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    print(f"ubatch {ub}, {ns.mib} MiB: GPU span {(t1 - t0) / 1e3:.2f} ms; stats {llm.stats()['prompt']}")
    streams = {}
    for e in gpu:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    for s, es in sorted(streams.items(), key=lambda kv: -len(kv[1])):
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in es])
        cats = {c: sum(1 for e in es if e["cat"] == c) for c in ("kernel", "gpu_memcpy", "gpu_memset")}
        print(f"stream {s}: {len(es)} events {cats}, busy {sum(b - a for a, b in busy) / 1e3:.2f} ms, "
              f"from {(busy[0][0] - t0) / 1e3:.2f} to {(busy[-1][1] - t0) / 1e3:.2f} ms")
    h2d = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
    big = [e for e in h2d if e["args"].get("bytes", 0) >= 1 << 20]              # expert copies, not tables
    if not big:
        return
    nbytes = sum(e["args"]["bytes"] for e in big)
    dur = sum(e["dur"] for e in big) / 1e6
    print(f"expert copies: {len(big)}, {nbytes / 1e9:.2f} GB in {dur * 1e3:.2f} ms of copy time "
          f"({nbytes / dur / 1e9:.1f} GB/s while copying)")
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in big])
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    lost = sum(b - a for a, b in gaps)
    print(f"copy-stream gaps between the first and last expert copy: {len(gaps)}, {lost / 1e3:.2f} ms; "
          f"before the first {(busy[0][0] - t0) / 1e3:.2f} ms, after the last {(t1 - busy[-1][1]) / 1e3:.2f} ms")
    marks = sorted((e["ts"], e["name"]) for e in ev if e.get("cat") == "user_annotation")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:15]:
        before = [n for t, n in marks if t <= a][-1:]
        print(f"  gap at {(a - t0) / 1e3:7.2f} ms: {(b - a) / 1e3:.3f} ms (host last entered: {before})")


def host_profile(llm, ub: int, seed: int) -> None:
    """cProfile over one more warm prompt: the host's calls, by time spent in them and under them."""
    eng = llm.engine
    eng.begin_prompt(0)
    pr = cProfile.Profile()
    pr.enable()
    eng.prefill(0, rand(llm.model_config.vocab_size, N, seed))
    eng.synchronize()
    pr.disable()
    print(f"\none {N}-token prompt at ubatch {ub}, {ns.mib} MiB, under cProfile; stats {llm.stats()['prompt']}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    pstats.Stats(pr).sort_stats("cumtime").print_stats("moestream", 30)


def rand(V: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


ubatches = [int(u) for u in ns.ub.split(",")]
opts = {n: getattr(ns, n) for n in ENGINE if getattr(ns, n) != flags.BY_NAME[n].default}
llm = LLM(ns.model, ctx_size=N + 64, cpu_moe=True, moe_cache_mib=ns.mib, ubatch_size=ubatches[0],
          batch_size=max(ubatches[0], 4096), **opts)
for i, ub in enumerate(ubatches):
    timeline(llm, ub, 10 * i)             # each ubatch size its own fresh prompts
    if ns.cprofile:
        host_profile(llm, ub, 10 * i + 4)
