"""What a decode step's GPU time is made of, kernel by kernel: n greedy steps of B sequences after a short prompt,
eagerly (--no-cuda-graphs: one launch per kernel, as a graph replays them) under torch.profiler, then the same
steps replayed from CUDA graphs, timed by events. The `next` suite of bench/gpu.sh runs it.

    python bench/step_profile.py MODEL [--cpu-moe --moe-cache-mib 4000] [-n 16] [-p 64] [-B 1] [--top 30]

Prints the steps' wall and GPU ms (eager and from graphs), the number of kernels a step launches, and the kernels
by GPU time a step (name, launches a step, µs a step): the sum is the step's busy time; the graph step's time
minus it is what launches and gaps between kernels cost.
"""
import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moestream import LLM

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--cpu-moe", action="store_true")
ap.add_argument("--moe-cache-mib", type=int, default=None)
ap.add_argument("-n", type=int, default=16, help="decode steps profiled")
ap.add_argument("-p", type=int, default=64, help="prompt tokens before the steps")
ap.add_argument("-B", type=int, default=1, help="sequences decoded together")
ap.add_argument("--top", type=int, default=30)
ns = ap.parse_args()


def prompts(llm) -> list[int]:
    """B sequences' random prompts, read: each one's next token."""
    eng = llm.engine
    V = llm.model_config.vocab_size
    toks = []
    for s in range(ns.B):
        prompt = torch.randint(0, V, (ns.p,), generator=torch.Generator().manual_seed(3 + s)).tolist()
        eng.begin_prompt(s)
        toks.append(int(eng.prefill(s, prompt, 0)[-1].argmax()))
    eng.synchronize()
    return toks


def steps(llm, toks: list[int], n: int) -> tuple[float, float]:
    """n greedy steps of all B sequences after their prompts: (wall ms a step, GPU ms a step by events)."""
    eng = llm.engine
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for pos in range(ns.p, ns.p + n):
        toks = eng.decode([(s, tok, pos) for s, tok in enumerate(toks)]).argmax(-1).tolist()
    b.record()
    eng.synchronize()
    return 1e3 * (time.perf_counter() - t) / n, a.elapsed_time(b) / n


kw = dict(ctx_size=ns.p + 2 * ns.n + 8, n_seq=ns.B)
if ns.cpu_moe:
    kw.update(cpu_moe=True, moe_cache_mib=ns.moe_cache_mib)
for graphs in (False, True):
    llm = LLM(ns.model, cuda_graphs=graphs, **kw)
    delta = getattr(llm.engine.model, "delta", None)
    steps(llm, prompts(llm), 4)                        # warm: compiles, captures
    wall, gpu = steps(llm, prompts(llm), ns.n)
    print(f"## {'graphs' if graphs else 'eager'}{f', delta kernels {delta.name}' if delta else ''}: "
          f"{wall:.3f} ms a step wall, {gpu:.3f} ms GPU (events), B={ns.B}", flush=True)
    if not graphs:
        toks = prompts(llm)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(llm, toks, ns.n)
        by = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                by[e.name][0] += 1
                by[e.name][1] += e.device_time
        print(f"{sum(c for c, _ in by.values()) / ns.n:.0f} kernels a step; by GPU time:")
        print("| kernel | launches a step | µs a step |\n| --- | ---: | ---: |")
        rows = sorted(by.items(), key=lambda kv: -kv[1][1])
        busy = sum(us for _, us in by.values()) / ns.n
        for name, (c, us) in rows[:ns.top]:
            print(f"| {name[:110]} | {c / ns.n:.1f} | {us / ns.n:.1f} |")
        print(f"busy: {busy:.1f} µs a step", flush=True)
    del llm
    torch.cuda.empty_cache()
