"""Where a decode step's wall time goes: the GPU's time per step against the host's, before the step (the zero-copy
address table onto the device) and while it runs (learning from the previous step's routing), all on the GPU and
over caches. The `profile` suite of bench/gpu.sh runs it.

    python bench/decode_steps.py MODEL [--cpu-moe --moe-cache-mib 16000,24000] [--no-read-through] [-n 64]
                                       [--from-zero] [--cprofile]

Each configuration reads one 4096-token prompt (ubatch 2048), then decodes n tokens greedily, twice: the second
repetition decodes the same tokens again, so nearly every expert is resident by then. With --from-zero the decode
starts at position 0 after the prompt, as `moestream bench` tg does. The host parts are timed around the expert
cache's two decode hooks (begin_decode_step, end_decode_step), and the GPU's time is a pair of CUDA events between
them, around the step itself. All on the GPU there are no hooks: the events then bracket the whole call, and the
host columns are empty. --cprofile: the host's time by function (cProfile) over one more repetition of the last
configuration, after the timed ones.
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch

from moestream import LLM
from moestream.experts.cache import ExpertCache

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--cpu-moe", action="store_true")
ap.add_argument("--moe-cache-mib", default="16000", help="cache sizes, comma list (with --cpu-moe)")
ap.add_argument("--read-through", action=argparse.BooleanOptionalAction, default=True)
ap.add_argument("-n", type=int, default=64)
ap.add_argument("-p", type=int, default=4096)
ap.add_argument("--from-zero", action="store_true", help="decode from position 0 after the prompt, as bench tg does")
ap.add_argument("--cprofile", action="store_true", help="print the host's time by function over one more repetition")
ns = ap.parse_args()
CUDA = torch.cuda.is_available()


def event():
    """A timing event recorded on the current stream now (None on the CPU)."""
    if not CUDA:
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


class StepClock:
    """Per decode step: the host's seconds in the cache's two decode hooks, and the events between them (after the
    address table is queued, before the host learns: the step's own GPU work lies in between)."""

    def __init__(self):
        self.before, self.during, self.gpu = [], [], []
        self._start = None
        begin, end = ExpertCache.begin_decode_step, ExpertCache.end_decode_step
        clock = self

        def begin_decode_step(cache, *a, **kw):
            t = time.perf_counter()
            begin(cache, *a, **kw)
            clock.before.append(time.perf_counter() - t)
            clock._start = event()

        def end_decode_step(cache, *a, **kw):
            clock.gpu.append((clock._start, event()))
            t = time.perf_counter()
            end(cache, *a, **kw)
            clock.during.append(time.perf_counter() - t)

        ExpertCache.begin_decode_step, ExpertCache.end_decode_step = begin_decode_step, end_decode_step

    def clear(self):
        self.before, self.during, self.gpu = [], [], []


CLOCK = StepClock()


def ms(xs) -> str:
    return f"{1e3 * statistics.median(xs):.3f}" if xs else "–"


def decode(eng, prompt: list[int], calls: list | None = None) -> tuple[float, list[float]]:
    """Prefill the prompt, then n greedy steps: (seconds for all of them, each step's wall seconds)."""
    eng.begin_prompt(0)
    tok = int(eng.prefill(0, prompt, 0)[-1].argmax())
    start = 0 if ns.from_zero else ns.p
    if ns.from_zero:
        tok = prompt[0]
    eng.synchronize()
    walls = []
    t_all = time.perf_counter()
    for pos in range(start, start + ns.n):
        t, a = time.perf_counter(), event()
        lg = eng.decode([(0, tok, pos)])
        if calls is not None:
            calls.append((a, event()))
        tok = int(lg[0].argmax())
        walls.append(time.perf_counter() - t)
    eng.synchronize()
    return time.perf_counter() - t_all, walls


def run(llm, label: str, last: bool) -> None:
    eng = llm.engine
    V = llm.model_config.vocab_size
    prompt = torch.randint(0, V, (ns.p,), generator=torch.Generator().manual_seed(7)).tolist()
    for rep in range(2):
        before = llm.stats()["total"]
        CLOCK.clear()
        calls = []
        total, walls = decode(eng, prompt, calls)
        after = llm.stats()["total"]
        counts = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in ("host_reads", "copies", "landed")}
        pairs = CLOCK.gpu if CLOCK.gpu else calls      # all on the GPU: the whole call
        gpus = [a.elapsed_time(b) / 1e3 for a, b in pairs if a is not None]
        gap = f"{1e3 * (statistics.median(walls) - statistics.median(gpus)):.3f}" if gpus else "–"
        print(f"| {label} | {rep} | {ns.n / total:.1f} | {ms(walls)} | {ms(gpus)} | {gap} | {ms(CLOCK.before)} | "
              f"{ms(CLOCK.during)} | {counts} |", flush=True)
        if rep:
            print("  per step wall ms:", " ".join(f"{1e3 * w:.2f}" for w in walls))
            print("  per step GPU ms: ", " ".join(f"{1e3 * g:.2f}" for g in gpus))
    if last and ns.cprofile:
        pr = cProfile.Profile()
        pr.enable()
        decode(eng, prompt)
        pr.disable()
        print(f"\nthe host's time by function, {label}: one prompt of {ns.p} tokens and {ns.n} decode steps")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumtime").print_stats("moestream", 30)


print("| config | rep | tok/s | wall ms/step (median) | GPU ms/step (events) | gap ms | host ms before the step | "
      "host ms while it runs | counts |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
kw = dict(ctx_size=ns.p + ns.n, ubatch_size=2048, batch_size=4096, zero_copy_decode=True)
if not ns.cpu_moe:
    run(LLM(ns.model, **kw), "all-GPU", last=True)
else:
    sizes = [int(s) for s in ns.moe_cache_mib.split(",")]
    llm = LLM(ns.model, cpu_moe=True, moe_cache_mib=sizes[0], read_through=ns.read_through, **kw)
    for i, mib in enumerate(sizes):
        if i:
            llm.engine.reconfigure_cache(moe_cache_mib=mib, read_through=ns.read_through)
        run(llm, f"{mib} MiB{'' if ns.read_through else ' no read-through'}{' from 0' if ns.from_zero else ''}",
            last=i == len(sizes) - 1)
