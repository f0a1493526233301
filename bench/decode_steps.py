"""Where a decode step's wall time goes: the GPU's time per step against the host's, before the step (the zero-copy
address table onto the device) and while it runs (learning from the previous step's routing), all on the GPU and
over caches. The `profile` suite of bench/gpu.sh runs it.

    python bench/decode_steps.py MODEL [--cpu-moe --moe-cache-mib 16000,24000] [--no-read-through] [-n 64]
                                       [--from-zero] [--cprofile] [--parallel 1,8]

Each configuration reads one 4096-token prompt (ubatch 2048), then decodes n tokens greedily, twice: the second
repetition decodes the same tokens again, so nearly every expert is resident by then. With --from-zero the decode
starts at position 0 after the prompt, as `moestream bench` tg does. The host parts are timed around the expert
cache's two decode hooks (begin_decode_step, end_decode_step), and the GPU's time is a pair of CUDA events between
them, around the step itself. All on the GPU there are no hooks: the events then bracket the whole call, and the
host columns are empty. --parallel B1,B2: B sequences, each with its own prompt (-p tokens), decoded together, one
step of B tokens at a time (as the server's batched decode). --cprofile: the host's time by function (cProfile) over one more repetition of the last
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
ap.add_argument("--moe-cache-mib", default="16000", help="cache sizes, comma list (with --cpu-moe; none: no cache)")
ap.add_argument("--read-through", action=argparse.BooleanOptionalAction, default=True)
ap.add_argument("-n", type=int, default=64)
ap.add_argument("-p", type=int, default=4096)
ap.add_argument("--from-zero", action="store_true", help="decode from position 0 after the prompt, as bench tg does")
ap.add_argument("--parallel", default="1", help="sequences decoded together, comma list")
ap.add_argument("--policy", default="lfru", help="the cache's policy")
ap.add_argument("--keep-hottest", action="store_true",
                help="experiment: decode never uploads its misses; the pool keeps each layer's hottest experts")
ap.add_argument("--fill", type=int, default=None, help="experiment: hot_set.FILL_PER_LAYER")
ap.add_argument("--per-choice", action="store_true",
                help="experiment: several-token steps read an expert once per token that chose it, landing nothing "
                     "(the kernel before kernels/decode_grouped.py), and count their host reads so")
ap.add_argument("--trace", help="experiment: save each step's routing (steps, layers, B k) to this .npy")
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


def decode(eng, prompts: list[list[int]], calls: list | None = None) -> tuple[float, list[float], dict]:
    """Prefill each sequence's prompt, then n greedy steps of all of them together: (seconds for all the steps,
    each step's wall seconds, the counters before the steps: theirs, not the prompts', are the difference)."""
    toks = []
    for s, prompt in enumerate(prompts):
        eng.begin_prompt(s)
        toks.append(int(eng.prefill(s, prompt, 0)[-1].argmax()) if not ns.from_zero else prompt[0])
    start = 0 if ns.from_zero else ns.p
    eng.synchronize()
    before = eng.stats()["total"]
    walls = []
    t_all = time.perf_counter()
    for pos in range(start, start + ns.n):
        t, a = time.perf_counter(), event()
        lg = eng.decode([(s, tok, pos) for s, tok in enumerate(toks)])
        if calls is not None:
            calls.append((a, event()))
        toks = lg.argmax(-1).tolist()
        walls.append(time.perf_counter() - t)
    eng.synchronize()
    return time.perf_counter() - t_all, walls, before


KEYS = ("hits", "misses", "host_reads", "host_read_bytes", "uploaded_bytes", "copies", "landed", "evictions")


def run(llm, label: str, last: bool, B: int) -> None:
    eng = llm.engine
    V = llm.model_config.vocab_size
    prompts = [torch.randint(0, V, (ns.p,), generator=torch.Generator().manual_seed(7 + s)).tolist() for s in range(B)]
    label = f"{label}, B={B}"
    for rep in range(2):
        CLOCK.clear()
        calls = []
        total, walls, before = decode(eng, prompts, calls)
        after = llm.stats()["total"]
        counts = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in KEYS}
        counts = {k: (f"{v / ns.n / 1e6:.0f} MB/step" if k.endswith("bytes") else f"{v / ns.n:.1f}/step")
                  for k, v in counts.items()}
        pairs = CLOCK.gpu if CLOCK.gpu else calls      # all on the GPU: the whole call
        gpus = [a.elapsed_time(b) / 1e3 for a, b in pairs if a is not None]
        gap = f"{1e3 * (statistics.median(walls) - statistics.median(gpus)):.3f}" if gpus else "–"
        print(f"| {label} | {rep} | {B * ns.n / total:.1f} | {ms(walls)} | {ms(gpus)} | {gap} | {ms(CLOCK.before)} | "
              f"{ms(CLOCK.during)} | {counts} |", flush=True)
        if rep:
            print("  per step wall ms:", " ".join(f"{1e3 * w:.2f}" for w in walls))
            print("  per step GPU ms: ", " ".join(f"{1e3 * g:.2f}" for g in gpus))
    if last and ns.cprofile:
        pr = cProfile.Profile()
        pr.enable()
        decode(eng, prompts)
        pr.disable()
        print(f"\nthe host's time by function, {label}: {B} prompts of {ns.p} tokens and {ns.n} decode steps")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumtime").print_stats("moestream", 30)


print("| config | rep | tok/s | wall ms/step (median) | GPU ms/step (events) | gap ms | host ms before the step | "
      "host ms while it runs | counts |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
from moestream.experts import read_through, zero_copy  # noqa: E402
if ns.keep_hottest:
    read_through.ReadThrough.holds_a_step = lambda self, n: False
if ns.fill is not None:
    from moestream.experts import hot_set
    hot_set.FILL_PER_LAYER = ns.fill
if ns.per_choice:
    from moestream.kernels import decode as decode_kernel
    kernel = decode_kernel.experts_by_address
    kernel.__defaults__ = kernel.__defaults__[:-1] + (False,)            # grouped=False
    read_through.ReadThrough.count = lambda self, n_tokens: self.n_land if n_tokens == 1 else 0
    _init = zero_copy.ZeroCopyDecode.__init__

    def _per_choice(self, *a, **kw):
        _init(self, *a, **kw)
        self.reads_once = False
    zero_copy.ZeroCopyDecode.__init__ = _per_choice
ROUTES = []
if ns.trace:
    _learn = zero_copy.ZeroCopyDecode._learn

    def _traced(self, routed, *a, **kw):
        ROUTES.append(routed.copy())
        return _learn(self, routed, *a, **kw)
    zero_copy.ZeroCopyDecode._learn = _traced
BS = [int(b) for b in ns.parallel.split(",")]
kw = dict(ctx_size=ns.p + ns.n, ubatch_size=2048, batch_size=4096, zero_copy_decode=True, n_seq=max(BS))
if not ns.cpu_moe:
    llm = LLM(ns.model, **kw)
    for B in BS:
        run(llm, "all-GPU", last=B == BS[-1], B=B)
else:
    sizes = [None if s == "none" else int(s) for s in ns.moe_cache_mib.split(",")]
    llm = LLM(ns.model, cpu_moe=True, moe_cache_mib=sizes[0], read_through=ns.read_through,
              cache_policy=ns.policy, **kw)
    for i, mib in enumerate(sizes):
        if i:
            llm.engine.reconfigure_cache(moe_cache_mib=mib, read_through=ns.read_through, cache_policy=ns.policy)
        for B in BS:
            run(llm, f"{mib} MiB{'' if ns.read_through else ' no read-through'}{' from 0' if ns.from_zero else ''}",
                last=i == len(sizes) - 1 and B == BS[-1], B=B)
if ns.trace:
    import numpy as np
    np.save(ns.trace, np.array([r for r in ROUTES if r.shape == ROUTES[-1].shape]))
