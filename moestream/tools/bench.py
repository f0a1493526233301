"""`moestream bench`: prompt and generation speed, shaped like llama-bench, with the expert-streaming figures.

    moestream bench -m ref.gguf -p 4096 -n 64 -ub 512,2048,4096 -b 4096 --cpu-moe -r 3 -o md
    moestream bench -m ref.gguf -p 4096 -n 0 --cpu-moe --moe-cache-mib 0,8000,16000 --plot sweep.png
    moestream bench -m ref.gguf -p 2048 -n 32 -pg 2048,32 --compare "--cpu-moe" "--cpu-moe --moe-cache-mib 8000"
    moestream bench -m ref.gguf --parallel 1,4,8 -npp 128 -ntg 128 --cpu-moe     # llama-batched-bench's shape

pp N: one N-token prompt from position 0, in ubatches. tg N: N tokens decoded one at a time from position 0, each
fed the previous one's argmax on the device, as `generate` decodes (a step is queued before its token is read
back: the device does not wait for the host between steps). pg PP,TG: a PP-token prompt, then TG decoded
tokens; its t/s counts both. Each run gets its own seeded random prompt (the same sequence for every
configuration), so a cache cannot have learnt the exact prompt it is timed on. A warm-up run precedes the timed
repetitions; t/s is mean ± std over them.

A test that generates also gets `hash`: the sha256 of the first timed run's generated tokens. Each configuration
decodes the same prompt there, so equal hashes across configurations show the numerics contract (the cache, its
policy and prefetching change no token).

Beside t/s, from the engine's statistics (differences over each timed run, averaged): uploaded GB per run, the
expert cache's hit rate, the compute stream's wait per MoE layer (ms per run), and the roofline fraction
`bound / measured`, where bound = max(uploaded bytes / link speed, --compute-s-per-token x tokens). The link speed
is a pinned host -> device copy of --link-mib MiB timed with CUDA events at start (n/a on the CPU).

Sweeps: comma lists for -p, -n, -b, -ub, -t (torch's CPU threads), -ncmoe and --moe-cache-mib; -ngl and -fa take
llama-bench's lists too, but each value must mean every layer on the GPU and flash attention on, the only ones
here (compat.py). -b, -ub and -t change how prompts are cut and run, so the model loads once for them; each placement is its own load, and each cache size a new cache over the same pinned
experts (the cache starts empty; the warm-up run fills it). --compare A B loads both configurations
once and runs them alternately (A, B, A, B, ...) so that drift (clocks, heat, other tenants) cancels in the
ratio, printed pair by pair (bench_compare.py).

--parallel (-npl) B,... decodes B sequences together instead, with -npp/-ntg tokens each, as llama-batched-bench
does: bench_parallel.py. With --spec-type draft-mtp its sequences draft as the server's do, a row for each
--spec-draft-n-max (0: MTP off), with --spec-oracle P each sequence its own continuation's oracle.

torch and the engine are imported where they are used, so that `moestream bench --help` answers at once.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys

from .. import compat, flags
from ..argv import Parser
from ..errors import UserError
from . import bench_parallel, report
from .bench_common import (SWEPT, BenchTest, diff_counters, drafts_swept, ints, load, mean_counters, per_gpu,
                           per_gpu_lines, placement, release_memory, scalar, tests_of)
from .bench_compare import compare
from .bench_spec import spec_run
from .report import Col, na




def _mibs(s: str) -> list[int | str]:
    """--moe-cache-mib's comma list: sizes in MiB, and auto (what the device has left)."""
    return [flags.mib(x) for x in s.split(",") if x.strip() != ""]


def _sizes(s: str) -> list[int]:
    """-p, -n: token counts, where 0 skips the test; a negative one is a mistake, not a skip."""
    v = ints(s)
    if any(n < 0 for n in v):
        raise argparse.ArgumentTypeError(f"expected token counts >= 0 (0 skips the test), got {s!r}")
    return v


def _pair(s: str) -> tuple[int, int]:
    v = _sizes(s)
    if len(v) != 2:
        raise argparse.ArgumentTypeError(f"-pg takes PP,TG (two integers), got {s!r}")
    return v[0], v[1]


FORMATS = ("md", "json", "csv")


def _format(s: str) -> str:
    if s in FORMATS:
        return s
    hint = f"; to write a file: -o {s.rsplit('.', 1)[-1] if s.rsplit('.', 1)[-1] in FORMATS else 'json'} > {s}" \
        if "." in s or "/" in s else ""
    raise argparse.ArgumentTypeError(f"-o takes a format, {', '.join(FORMATS)} (as llama-bench's), not {s!r}{hint}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    # the sweepable engine flags take comma lists here
    flags.add_engine_arguments(p, **{k: dict(type=_mibs if k == "moe_cache_mib" else ints,
                                             default=[flags.BY_NAME[k].default]) for k in SWEPT})
    # None until given (512 and 128 then), so that --parallel can refuse them
    p.add_argument("-p", "--n-prompt", type=_sizes, default=None,
                   help="prompt lengths, comma list (default 512; 0 skips)")
    p.add_argument("-n", "--n-gen", type=_sizes, default=None,
                   help="generation lengths, comma list (default 128; 0 skips)")
    p.add_argument("-pg", dest="pg", type=_pair, action="append", default=[], metavar="PP,TG",
                   help="a prompt of PP tokens then TG generated ones (repeatable)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("-o", "--output", type=_format, default="md", metavar="md|json|csv", help="output format")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random prompt tokens")
    # REMAINDER, so that a set of one flag ("--cpu-moe") is taken as a value, not as the bench's own flag
    p.add_argument("--compare", nargs=argparse.REMAINDER, metavar="A B",
                   help="two sets of engine flags (quoted) run alternately; prints B/A of t/s pair by pair")
    p.add_argument("--link-mib", type=int, default=1024, help="MiB copied to measure the link at start (0: skip)")
    p.add_argument("--compute-s-per-token", type=float, default=None,
                   help="compute time per token for the roofline (default: the link bound alone)")
    p.add_argument("--spec-oracle", type=float, default=None, metavar="P",
                   help="with --spec-type draft-mtp: draft the model's own greedy continuation (a first pass over the "
                        "same prompt), each token wrong with probability 1 - P, instead of the head's drafts (a "
                        "benchmark of speculation at a known acceptance; bench_spec.py); with --parallel each "
                        "sequence drafts its own (bench_parallel.py)")
    p.add_argument("--plot", metavar="FILE.png", help="plot tok/s against ubatch and per-layer uploads/hit rate")
    bench_parallel.add_arguments(p)
    compat.add_arguments(p, "bench")
    p.set_defaults(func=main)


def measure_link(device, mib: int) -> float | None:
    """Host -> device bytes per second from pinned memory (a timed copy of `mib` MiB); None on the CPU."""
    if not device.is_cuda or mib <= 0:
        return None
    import torch
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)                 # (n,) pinned host bytes
    dst = torch.empty(n, dtype=torch.uint8, device=device.torch)
    dst.copy_(src, non_blocking=True)                                        # warm-up: first-touch costs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    bps = 3 * n / (start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bps


def summarise(test: BenchTest, runs: list[dict], n_layers: int, link_bps: float | None,
              compute_s_per_token: float | None) -> dict:
    """One result row: t/s mean ± std and the per-run means of the counters."""
    tps = [test.n_tokens / r["seconds"] for r in runs]
    seconds = statistics.mean(r["seconds"] for r in runs)
    tot = mean_counters([r["total"] for r in runs])
    layers = sorted({l for r in runs for l in r["per_layer"]})
    per_layer = {l: mean_counters([r["per_layer"].get(l) or diff_counters({}, None) for r in runs]) for l in layers}
    bounds = []
    if link_bps and tot["uploaded_bytes"] is not None:
        bounds.append(tot["uploaded_bytes"] / link_bps)
    if compute_s_per_token:
        bounds.append(compute_s_per_token * test.n_tokens)
    bound = max(bounds) if bounds else None
    wait, host = tot["wait_s"], tot["host_s"]
    return {"test": test.name, "n_prompt": test.n_prompt, "n_gen": test.n_gen, "reps": len(runs),
            "tps_mean": statistics.mean(tps), "tps_std": statistics.stdev(tps) if len(tps) > 1 else 0.0,
            "samples_ts": tps,                                      # each repetition's t/s (llama-bench's json)
            "seconds_mean": seconds,
            "uploaded_gb": None if tot["uploaded_bytes"] is None else tot["uploaded_bytes"] / 1e9,
            "copies": tot["copies"], "hit_rate": tot["hit_rate"],
            "ple_gb": None if tot["ple_bytes"] is None else tot["ple_bytes"] / 1e9,
            "wait_ms_per_layer": None if wait is None else wait * 1e3 / max(len(layers) or n_layers, 1),
            "host_ms_per_layer": None if host is None else host * 1e3 / max(len(layers) or n_layers, 1),
            "link_gbps": None if link_bps is None else link_bps / 1e9,
            "bound_s": bound, "roofline_frac": None if bound is None else bound / seconds,
            "hash": runs[0].get("hash"), "spec": runs[0].get("spec"),
            "per_layer": per_layer}


def _bench_flags_after_compare(a: argparse.Namespace) -> None:
    """--compare A B takes the rest of the line (see add_arguments): parse what follows A and B as bench flags."""
    if len(a.compare) < 2:
        raise UserError("--compare takes two quoted sets of engine flags, e.g. "
                        f"--compare \"--cpu-moe\" \"--cpu-moe --moe-cache-mib 8000\"; got {a.compare}")
    a.compare, rest = a.compare[:2], a.compare[2:]
    if rest:
        p = Parser(prog="moestream bench")
        add_arguments(p)
        for act in p._actions:
            act.required = False
        p.parse_args(rest, namespace=a)            # sets only the flags given: the namespace keeps the others


BENCH_COLS = [
    Col("model", "model", right=False), Col("experts", "experts", right=False),
    Col("cache MiB", "moe_cache_mib"), Col("threads", "threads"), Col("n_batch", "n_batch"), Col("n_ubatch", "n_ubatch"), Col("test", "test"),
    Col("t/s", "tps_mean", lambda r: f"{r['tps_mean']:.2f} ± {r['tps_std']:.2f}"),
    Col("up GB", "uploaded_gb", lambda r: na(r["uploaded_gb"], "{:.3f}")),
    Col("hit %", "hit_rate", lambda r: na(None if r["hit_rate"] is None else 100 * r["hit_rate"], "{:.1f}")),
    Col("wait ms/layer", "wait_ms_per_layer", lambda r: na(r["wait_ms_per_layer"], "{:.2f}")),
    Col("host ms/layer", "host_ms_per_layer", lambda r: na(r["host_ms_per_layer"], "{:.2f}")),
    Col("roofline", "roofline_frac", lambda r: na(r["roofline_frac"], "{:.2f}")),
    Col("hash", "hash", lambda r: r.get("hash") or "-", right=False),
]
# --spec-type draft-mtp: drafts a step (and the oracle's P), then per verify step: tokens committed, distinct
# experts a MoE layer read (against top-k for a one-token step) and bytes from host (bench_spec.py)
SPEC_COLS = [
    Col("spec", "spec_n", lambda r: f"n{r['spec_n']}" + ("" if r["spec_oracle"] is None else f" P{r['spec_oracle']}")),
    Col("tok/step", "spec", lambda r: na((r["spec"] or {}).get("tokens_per_step"), "{:.2f}")),
    Col("exp/layer", "spec", lambda r: na((r["spec"] or {}).get("experts_per_layer"), "{:.1f}")
        + (f" (k {r['spec']['top_k']})" if r["spec"] else "")),
    Col("MB/step", "spec", lambda r: na(None if (r["spec"] or {}).get("bytes_per_step") is None
                                        else r["spec"]["bytes_per_step"] / 1e6, "{:.2f}")),
]


def main(a: argparse.Namespace) -> int:
    import torch
    if not 0 <= a.seed < 1 << 32:
        raise UserError(f"--seed must be from 0 to {(1 << 32) - 1}, got {a.seed}")
    if a.link_mib < 0:
        raise UserError(f"--link-mib must be >= 0 (0 skips measuring the link), got {a.link_mib}")
    if a.compute_s_per_token is not None and not 0 < a.compute_s_per_token < float("inf"):
        raise UserError(f"--compute-s-per-token must be a positive number of seconds, got {a.compute_s_per_token}")
    if a.spec_oracle is not None and not (a.spec_type == "draft-mtp" and 0.0 <= a.spec_oracle <= 1.0):
        raise UserError(f"--spec-oracle takes a probability in [0, 1] with --spec-type draft-mtp, got "
                        f"{a.spec_oracle}{'' if a.spec_type == 'draft-mtp' else ' without it'}")
    if a.parallel is not None:
        return bench_parallel.main(a)
    if a.trace and a.compare is not None:
        raise UserError("--trace records one configuration's runs, not --compare's two: leave one of them out")
    if a.trace:
        from ..experts.trace import check_trace_path
        check_trace_path(a.trace)
    if a.repetitions < 1:
        raise UserError(f"-r must be at least 1, got {a.repetitions}")
    if a.plot:
        report.check_plot(a.plot)
    if a.compare is not None:
        _bench_flags_after_compare(a)
        return compare(a)
    tests = tests_of(a)
    cols = BENCH_COLS if a.threads else [c for c in BENCH_COLS if c.key != "threads"]
    spec = a.spec_type == "draft-mtp"
    cols = cols + SPEC_COLS if spec else cols
    ctx = max(t.n_tokens for t in tests)
    from ..device import Device
    link = measure_link(Device.resolve(a.device.split(",")[0]), a.link_mib)   # before loading: the memory is free
    print(f"link: host -> device {link / 1e9:.2f} GB/s (pinned, {a.link_mib} MiB, CUDA events)" if link
          else "link: not measured (no CUDA device, or --link-mib 0): roofline from --compute-s-per-token or n/a",
          file=sys.stderr)
    rows, stream_md, recorder = [], a.output == "md", None
    loads = list(itertools.product(a.n_cpu_moe, getattr(a, "moe_cache_mib", [None])))
    llm = None
    for i, (n_cpu_moe, mib) in enumerate(loads):
        ns = scalar(a, n_cpu_moe=n_cpu_moe, moe_cache_mib=mib)
        if (llm is not None and loads[i - 1][0] == n_cpu_moe and llm.engine.host is not None
                and llm.engine.split is None):         # (a split's caches are made at load: it loads again)
            llm.engine.reconfigure_cache(moe_cache_mib=mib)        # another cache over the same pinned experts
        else:
            llm = None
            release_memory()
            llm = load(ns, ctx)
            if i == 0:
                from ..loading.gguf import GGUFSource
                counts = llm.source.type_counts() if isinstance(llm.source, GGUFSource) else None
                print(llm.engine.describe_experts(counts), file=sys.stderr)
                print(llm.engine.describe_kv(), file=sys.stderr)
                if a.trace:                                     # the first configuration's tests, every run
                    from ..experts.trace import record
                    recorder = record(llm)
        for threads, b, ub, n_max in itertools.product(a.threads or [None], a.batch_size, a.ubatch_size,
                                                       drafts_swept(a, llm.engine)):
            if threads is not None:
                torch.set_num_threads(threads)                  # llama-bench's -t sweep
            llm.engine.set_batching(b, ub)
            for t in tests:
                t.spec = None if n_max is None else functools.partial(spec_run, n_max, a.spec_oracle)
                if not a.no_warmup:
                    t.run(llm, -1)                              # warm-up: allocations, kernels, caches
                runs = [t.run(llm, i) for i in range(a.repetitions)]
                row = {"model": a.model, "device": llm.engine.device.name, "experts": placement(ns),
                       "moe_cache_mib": llm.engine.ecfg.cache.mib, "cache_policy": getattr(ns, "cache_policy", None),
                       "threads": torch.get_num_threads(), "n_batch": b, "n_ubatch": ub,
                       "spec_n": n_max, "spec_oracle": a.spec_oracle,
                       **summarise(t, runs, len(llm.model_config.moe_layers), link, a.compute_s_per_token)}
                row["per_gpu"] = per_gpu(llm.engine, row["per_layer"])        # a split: each GPU's counters
                if row["per_gpu"]:
                    print(per_gpu_lines(row["per_gpu"]), file=sys.stderr)
                if stream_md and not rows:             # after the load's lines on stderr
                    print(report.md_header(cols), flush=True)
                rows.append(row)
                if stream_md:
                    print(report.md_row(cols, row), flush=True)
            if recorder is not None:
                from ..experts.trace import save_trace
                llm.engine.unobserve(recorder)
                print(f"trace: {save_trace(recorder, a.trace)}", file=sys.stderr)
                recorder = None
    llm = None
    release_memory()
    if not stream_md:
        print(report.render(rows, a.output, cols))
    if a.plot:
        report.plot_bench(rows, a.plot)
        print(f"plot: {a.plot}", file=sys.stderr)
    return 0
