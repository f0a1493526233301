"""`moestream bench --parallel`: several sequences decoded together, shaped like llama.cpp's llama-batched-bench.

    moestream bench -m ref.gguf --parallel 1,4,8 -npp 128 -ntg 128 --cpu-moe -r 3
    moestream bench -m ref.gguf -npl 1,8,16 -npp 512 -ntg 64 --cpu-moe --moe-cache-mib 0,8000,16000 -o json
    moestream bench -m ref.gguf -npl 4 -npp 512 -ntg 128 --spec-type draft-mtp --spec-draft-n-max 0,2 --spec-oracle 0.8

A row of B sequences (-npl B), PP prompt tokens (-npp) and TG generated tokens (-ntg) each, run by the serving loop
(runtime/serving.py), a slot a sequence: the B prompts are read as the server reads prompts arriving together, every
one before the first decode step (the loop's prompts_first): batches of up to -b tokens, each
prompt from position 0 in ubatches of -ub, the first sequences first (with host experts a batch runs layer by
layer, its experts crossing the link once for all its prompts, as llama-batched-bench's batches do); then TG
decode steps run all B sequences together, one forward of B tokens a step (`engine.decode([(seq, token, pos),
...])`), greedy, each step waiting for the previous one's argmax as a real decode does. The model loads once with
max(-npl) sequences, each with a KV cache of max(-c, PP + TG) positions. -npp, -ntg and -npl take comma lists (every
combination runs, as in llama-batched-bench).

Columns, as llama-batched-bench's: PP, TG, B, N_KV = B (PP + TG), T_PP s and S_PP t/s = B PP / T_PP (the prompts),
T_TG s and S_TG t/s = B TG / T_TG (the decode steps), T s and S t/s = N_KV / T. Then the engine's counters, over
the prompts and, separately, over the decode steps: the cache's hit rate, GB uploaded, GB that zero-copy decode read
from host memory in place, expert copies; and per decode step its ms, host-read GB and uploaded GB. `hash`: sha256
of every sequence's generated tokens, sequence after sequence, of the first timed run.

With --spec-type draft-mtp the sequences draft as the server's speculating slots do (runtime/serving.py: the head's
steps of all of them together, then one verify step of every sequence), a row for each --spec-draft-n-max of its
comma list (0: MTP off, the baseline in the same process; the model loads with the largest). Its columns: `steps`,
decode steps a run (TG without drafts; ms/step and the GB a step are per these steps), and per verify step of a
sequence the tokens drafted, accepted and committed (means over the timed runs). --spec-oracle P (a benchmark of
speculation at a known acceptance, as bench_spec.py's for pp/tg rows): sequence s drafts its own greedy
continuation (spec_oracle.py; from a pass over the same prompts without drafts, untimed, before the row's warm-up:
the n-max 0 row's runs where that row ran first), each token right with probability P, seeded per sequence and
run so that a rerun drafts the same; the verify steps, the rollback and the expert traffic are the real ones, and
the hash is the MTP-off row's.

Sequence s of run i gets its own seeded random prompt, the same for every configuration and every B (so hashes
compare across cache sizes, placements and policies); sequence 0's is `moestream bench -pg PP,TG`'s, so a B = 1 row
has that row's hash. A warm-up run (other prompts) precedes the -r timed ones; t/s is mean ± std over them.
--moe-cache-mib and -ncmoe lists, -ub, -b and -t sweep as they do in `moestream bench` (a cache size is a new cache
over the same pinned experts). Whether batched decode gives each sequence the tokens it gets decoded alone is
tests/test_bench_parallel.py's question, not the bench's.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import dataclass

from .. import flags
from ..errors import UserError
from . import report
from .bench_common import drafts_swept, ints, placement, release_memory, scalar
from .report import Col, na

KEYS = ("hits", "misses", "uploaded_bytes", "copies", "host_reads", "host_read_bytes")
SEQ_STRIDE = 104729                    # a prime: sequence s's prompt seed is sequence 0's + s * SEQ_STRIDE


def add_arguments(p: argparse.ArgumentParser) -> None:
    """bench's --parallel flags (llama-batched-bench's -npl, -npp, -ntg); bench.add_arguments calls this."""
    g = p.add_argument_group("several sequences decoded together, like llama-batched-bench (bench_parallel.py)")
    g.add_argument("-npl", "--parallel", dest="parallel", type=ints, default=None, metavar="B,...",
                   help="numbers of sequences decoded together, comma list: runs the batched bench instead of pp/tg")
    g.add_argument("-npp", dest="n_pp", type=ints, default=[128], metavar="N,...",
                   help="--parallel: prompt tokens per sequence, comma list (default 128)")
    g.add_argument("-ntg", dest="n_tg", type=ints, default=[128], metavar="N,...",
                   help="--parallel: generated tokens per sequence, comma list (default 128)")
    g.add_argument("--trace", metavar="FILE", default=None,
                   help="record the routing of the first row (--parallel) or of the first configuration's tests "
                        "(their warm-up and timed runs) to FILE (.npz), for moestream replay")


@dataclass(frozen=True)
class ParallelTest:
    n_pp: int
    n_tg: int
    n_pl: int
    seed: int

    @property
    def n_kv(self) -> int:
        return self.n_pl * (self.n_pp + self.n_tg)

    def prompts(self, vocab: int, i: int) -> list[list[int]]:
        """Run i's prompt of each sequence (i = -1: the warm-up's). Sequence 0's is BenchTest.prompt's."""
        import torch                           # here, not at import: `moestream bench --help` answers at once
        out = []
        for s in range(self.n_pl):
            g = torch.Generator().manual_seed(self.seed_of(i, s))
            out.append(torch.randint(0, vocab, (max(self.n_pp, 1),), generator=g).tolist())
        return out

    def seed_of(self, i: int, s: int) -> int:
        """Run i's seed of sequence s: its prompt's, and its oracle's (--spec-oracle: a rerun drafts the same)."""
        return self.seed * 7919 + i + 1 + s * SEQ_STRIDE


# --- one run --------------------------------------------------------------------------------------------------
def totals(engine) -> dict:
    """The engine's counters since load, summed over layers (experts/stats.py): those of KEYS."""
    t = engine.stats()["total"]
    return {k: float(t.get(k) or 0) for k in KEYS}


def diff(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in KEYS}
    lookups = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / lookups if lookups else None        # None: no cache lookup (all on the device)
    return d


def decode_together(engine, prompts: list[list[int]], n_pp: int, n_tg: int, n_max: int | None = None,
                    oracles: list | None = None) -> dict:
    """Sequence s = prompts[s]: the prompts read in prompt batches from position 0 (n_pp tokens; n_pp = 0: its
    first token is the first decode step's input), then n_tg decode steps of every sequence together, greedy: the
    serving loop (runtime/serving.py) with a slot a sequence, reading every prompt before the first decode step.
    With --spec-type draft-mtp each sequence drafts n_max tokens a step (None: the engine's --spec-draft-n-max; 0:
    none), the head's drafts or oracles[s]'s (fn(position, n) -> drafts: tools/spec_oracle.py).
    Returns each sequence's tokens (the first, sampled from its prompt, and the generated ones), the seconds of both
    phases, the counters over each, the decode phase's steps and the speculating sequences' SpecCounts."""
    from ..runtime.requests import Request, SchedulerConfig
    from ..runtime.sampling import SamplingParams
    from ..runtime.serving import ServingLoop
    B = len(prompts)
    loop = ServingLoop(engine, None, SchedulerConfig(n_slots=B, max_queue=0, prompts_first=True,
                                                     count_routing=False))
    # the token sampled from a prompt (or the first token, n_pp = 0) feeds the first decode step: one more token
    params = SamplingParams(max_tokens=n_tg + 1, ignore_eos=True)
    events: list[tuple] = []
    loop.submit([Request(p[:n_pp], params, events.append, index=s, cache_prompt=False,
                         first=None if n_pp else p[0], draft_n_max=n_max, oracle=oracles[s] if oracles else None)
                 for s, p in enumerate(prompts)])
    specs, steps = [], 0

    def prompt_phase():
        loop.admit()                           # request s in slot s (a new loop's idle slots go in order)
        specs.extend(s.run.spec for s in loop.slots if s.run.spec is not None)
        while loop.reading_prompts:            # the server's prompt batches: -b tokens, oldest (lowest s) first
            loop.step()

    def decode_phase():
        nonlocal steps
        while loop.busy:                       # a host sync each step: its tokens, the next step's inputs
            loop.step()
            steps += 1

    c0 = totals(engine)
    t_pp = engine.timed(prompt_phase)[1]
    c1 = totals(engine)                        # (engine.stats() synchronises: outside the timed phases)
    t_tg = engine.timed(decode_phase)[1] if n_tg else 0.0
    c2 = totals(engine)                        # a zero-copy decode's last step is learnt from here, in its phase
    results = {}
    for ev in events:
        if ev[0] == "error":
            raise (UserError if ev[2] == 400 else RuntimeError)(f"sequence {ev[1]}: {ev[3]}")
        results[ev[1]] = ev[2]
    tokens = [results[s].token_ids for s in range(B)]
    return {"tokens": tokens, "generated": [t[1:] for t in tokens], "t_pp": t_pp, "t_tg": t_tg,
            "pp": diff(c1, c0), "tg": diff(c2, c1), "steps": steps, "spec": [s.counts for s in specs]}


def oracle_runs(engine, test: ParallelTest, vocab: int, runs: list[int], n_max: int | None, p: float | None,
                plain: dict) -> dict:
    """Each run's oracles for --spec-oracle P: run i's sequence s drafts the greedy continuation of its own prompt
    (plain[(test, i)], from a run without drafts, untimed: the n-max 0 row's where it ran first), each token
    right with probability P, seeded per sequence (seed_of) so that a rerun drafts the same. {i: [Oracle of
    sequence s]}; empty without an oracle or drafts. Every first pass runs before the row's warm-up, so that no
    timed run follows its own prompts' pass."""
    from .spec_oracle import Oracle
    if p is None or not n_max:
        return {}
    for i in runs:
        if (test, i) not in plain:
            plain[(test, i)] = decode_together(engine, test.prompts(vocab, i), test.n_pp, test.n_tg, 0)["tokens"]
    return {i: [Oracle(test.n_pp, plain[(test, i)][s], p, vocab, seed=test.seed_of(i, s)) for s in range(test.n_pl)]
            for i in runs}


def summarise(test: ParallelTest, runs: list[dict]) -> dict:
    """One row: llama-batched-bench's columns (means over the timed runs) and the counters' means."""
    from ..runtime.generate import token_hash
    B, pp, tg = test.n_pl, test.n_pp, test.n_tg
    mean = lambda xs: statistics.mean(xs)
    std = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0
    speeds = lambda n, key: [n / r[key] for r in runs] if n and all(r[key] > 0 for r in runs) else None
    s_pp, s_tg = speeds(B * pp, "t_pp"), speeds(B * tg, "t_tg")
    s_all = [test.n_kv / (r["t_pp"] + r["t_tg"]) for r in runs]
    row = {"n_pp": pp, "n_tg": tg, "n_pl": B, "n_kv": test.n_kv, "reps": len(runs),
           "t_pp": mean([r["t_pp"] for r in runs]), "s_pp": s_pp and mean(s_pp), "s_pp_std": s_pp and std(s_pp),
           "t_tg": mean([r["t_tg"] for r in runs]), "s_tg": s_tg and mean(s_tg), "s_tg_std": s_tg and std(s_tg),
           "s": mean(s_all), "s_std": std(s_all)}
    row["t"] = row["t_pp"] + row["t_tg"]
    for phase in ("pp", "tg"):
        c = {k: mean([r[phase][k] for r in runs]) for k in KEYS}
        lookups = c["hits"] + c["misses"]
        row |= {f"{phase}_hit_rate": c["hits"] / lookups if lookups else None,
                f"{phase}_uploaded_gb": c["uploaded_bytes"] / 1e9, f"{phase}_copies": c["copies"],
                f"{phase}_host_reads": c["host_reads"], f"{phase}_host_read_gb": c["host_read_bytes"] / 1e9}
    steps = mean([r["steps"] for r in runs])          # TG without drafts; fewer where drafts are accepted
    per_step = lambda v: v / steps if tg else None
    row |= {"steps": steps, "ms_per_step": per_step(row["t_tg"] * 1e3),
            "host_read_gb_per_step": per_step(row["tg_host_read_gb"]),
            "uploaded_gb_per_step": per_step(row["tg_uploaded_gb"]),
            "hash": token_hash([t for g in runs[0]["generated"] for t in g])[:16] if tg else None,
            "spec": spec_summary([c for r in runs for c in r["spec"]])}
    return row


def spec_summary(counts: list) -> dict:
    """The speculating sequences' verify steps over the timed runs (SpecCounts each): a sequence's step drafted and
    accepted (their sums and means a step), acceptance, and tokens it committed a step: SpecCounts.summary of them
    all as one, and the means."""
    from ..runtime.speculate import SpecCounts
    merged = SpecCounts([n for c in counts for n in c.drafted], [a for c in counts for a in c.accepted])
    out = merged.summary()
    if out["steps"]:
        out |= {"drafted_per_step": out["drafted"] / out["steps"], "accepted_per_step": out["accepted"] / out["steps"]}
    return out


# --- configurations -------------------------------------------------------------------------------------------
def tests_of(a: argparse.Namespace) -> list[ParallelTest]:
    """Every (PP, TG, B) of -npp, -ntg, -npl, in llama-batched-bench's order; UserError for a bad value."""
    if not a.parallel:
        raise UserError("--parallel takes numbers of sequences, e.g. --parallel 1,4,8")
    if min(a.parallel) < 1:
        raise UserError(f"--parallel takes numbers of sequences of at least 1, got {min(a.parallel)}")
    for flag, values in (("-npp", a.n_pp), ("-ntg", a.n_tg)):
        if values and min(values) < 0:
            raise UserError(f"{flag} takes token counts of at least 0, got {min(values)}")
    tests = [ParallelTest(pp, tg, b, a.seed) for pp in a.n_pp for tg in a.n_tg for b in a.parallel if pp + tg > 0]
    if not tests:
        raise UserError("nothing to run: give -npp N or -ntg N with N > 0")
    return tests


def check_flags(a: argparse.Namespace) -> None:
    """The bench flags that mean nothing here: one line each, not a silent default."""
    if a.repetitions < 1:
        raise UserError(f"-r must be at least 1, got {a.repetitions}")
    given = [f for f, v in (("-p", a.n_prompt), ("-n", a.n_gen), ("-pg", a.pg or None), ("--compare", a.compare),
                            ("--plot", a.plot)) if v is not None]
    if given:
        raise UserError(f"--parallel takes -npp and -ntg (tokens per sequence), not {', '.join(given)}")
    n_maxes = [n for n in a.spec_draft_n_max if n is not None]         # (not given: [None], the engine's choice)
    if not a.spec_draft_n_max or n_maxes and min(n_maxes) < 0:
        raise UserError(f"--spec-draft-n-max takes drafts a step from 0 (MTP off) up, e.g. 0,2; got "
                        f"{','.join(map(str, n_maxes)) or 'none'}")
    if a.spec_type == "draft-mtp" and max(n_maxes, default=1) > 0 and 0 in a.n_pp:
        raise UserError("--spec-type draft-mtp drafts after a prompt (the head reads its hidden states), and -npp 0 "
                        "has none: give -npp N > 0")


def configurations(a: argparse.Namespace, ctx: int):
    """(flags, cache MiB, llm) for each placement and cache size, as `moestream bench` sweeps them: a new cache over
    the same pinned experts where only the size changes, else a new load, with max(-npl) sequences."""
    from ..cli import load_model
    loads = list(itertools.product(a.n_cpu_moe, getattr(a, "moe_cache_mib", [None])))
    llm = None
    # the engine drafts up to the largest n-max given (none given: its own choice); each row's requests ask for
    # theirs (Request.draft_n_max)
    most = max((n for n in a.spec_draft_n_max if n is not None), default=None)
    for i, (n_cpu_moe, mib) in enumerate(loads):
        ns = scalar(a, n_cpu_moe=n_cpu_moe, moe_cache_mib=mib, spec_draft_n_max=most)
        if llm is not None and loads[i - 1][0] == n_cpu_moe and llm.engine.host is not None:
            llm.engine.reconfigure_cache(moe_cache_mib=mib)
        else:
            llm = None
            release_memory()
            llm = load_model(ns, flags.to_config(ns), progress=ns.verbose, ctx_size=max(ns.ctx_size, ctx),
                             n_seq=max(a.parallel))
            if i == 0:
                from ..loading.gguf import GGUFSource
                counts = llm.source.type_counts() if isinstance(llm.source, GGUFSource) else None
                print(llm.engine.describe_experts(counts), file=sys.stderr)
                print(llm.engine.describe_kv(), file=sys.stderr)
                print(f"parallel: {max(a.parallel)} sequences of {llm.engine.kv.ctx} positions each", file=sys.stderr)
        yield ns, mib, llm
    llm = None
    release_memory()


GB = "{:.3f}"
pct = lambda v: na(None if v is None else 100 * v, "{:.1f}")
speed = lambda key: lambda r: na(r[key]) if r[key] is None else f"{r[key]:.2f} ± {r[key + '_std']:.2f}"
COLS = [
    Col("experts", "experts", right=False), Col("cache MiB", "moe_cache_mib"), Col("threads", "threads"),
    Col("n_ubatch", "n_ubatch"), Col("PP", "n_pp"), Col("TG", "n_tg"), Col("B", "n_pl"), Col("N_KV", "n_kv"),
    Col("T_PP s", "t_pp", lambda r: f"{r['t_pp']:.3f}"), Col("S_PP t/s", "s_pp", speed("s_pp")),
    Col("T_TG s", "t_tg", lambda r: f"{r['t_tg']:.3f}"), Col("S_TG t/s", "s_tg", speed("s_tg")),
    Col("T s", "t", lambda r: f"{r['t']:.3f}"), Col("S t/s", "s", speed("s")),
    Col("pp hit %", "pp_hit_rate", lambda r: pct(r["pp_hit_rate"])),
    Col("pp up GB", "pp_uploaded_gb", lambda r: GB.format(r["pp_uploaded_gb"])),
    Col("tg hit %", "tg_hit_rate", lambda r: pct(r["tg_hit_rate"])),
    Col("tg up GB", "tg_uploaded_gb", lambda r: GB.format(r["tg_uploaded_gb"])),
    Col("tg host GB", "tg_host_read_gb", lambda r: GB.format(r["tg_host_read_gb"])),
    Col("tg copies", "tg_copies", lambda r: f"{r['tg_copies']:.0f}"),
    Col("ms/step", "ms_per_step", lambda r: na(r["ms_per_step"])),
    Col("host GB/step", "host_read_gb_per_step", lambda r: na(r["host_read_gb_per_step"], "{:.4f}")),
    Col("up GB/step", "uploaded_gb_per_step", lambda r: na(r["uploaded_gb_per_step"], "{:.4f}")),
    Col("hash", "hash", lambda r: r["hash"] or "-", right=False),
]
# --spec-type draft-mtp: drafts a step (and the oracle's P), decode steps a run (TG without drafts), and per verify
# step of a speculating sequence: tokens drafted, accepted and committed (bench.py's SPEC_COLS for pp/tg rows)
per_seq_step = lambda key: lambda r: na(r["spec"].get(key))
SPEC_COLS = [
    Col("spec", "spec_n", lambda r: f"n{r['spec_n']}" + ("" if r["spec_oracle"] is None else f" P{r['spec_oracle']}")),
    Col("steps", "steps", lambda r: f"{r['steps']:.1f}"),
    Col("drafted/step", "spec", per_seq_step("drafted_per_step")),
    Col("accepted/step", "spec", per_seq_step("accepted_per_step")),
    Col("tok/step", "spec", per_seq_step("tokens_per_step")),
]


def main(a: argparse.Namespace) -> int:
    import torch
    from ..experts.trace import record, save_trace
    check_flags(a)
    tests = tests_of(a)
    if a.trace:
        from ..experts.trace import check_trace_path
        check_trace_path(a.trace)
    spec = a.spec_type == "draft-mtp"
    cols = COLS if a.threads else [c for c in COLS if c.key != "threads"]
    cols = cols + SPEC_COLS if spec else cols
    rows, stream_md = [], a.output == "md"
    for ns, mib, llm in configurations(a, max(t.n_pp + t.n_tg for t in tests)):
        eng, vocab = llm.engine, llm.model_config.vocab_size
        for threads, b, ub in itertools.product(a.threads or [None], a.batch_size, a.ubatch_size):
            if threads is not None:
                torch.set_num_threads(threads)
            eng.set_batching(b, ub)
            plain: dict = {}                   # (test, run) -> each sequence's tokens without drafts (the oracle's)
            for n_max, t in itertools.product(drafts_swept(a, eng), tests):
                runs = ([] if a.no_warmup else [-1]) + list(range(a.repetitions))
                oracles = oracle_runs(eng, t, vocab, runs, n_max, a.spec_oracle, plain)   # untimed, first
                recorder = record(llm) if a.trace and not rows else None
                done = [decode_together(eng, t.prompts(vocab, i), t.n_pp, t.n_tg, n_max, oracles.get(i))
                        for i in runs]
                if a.spec_oracle is not None and n_max == 0:
                    plain.update({(t, i): r["tokens"] for i, r in zip(runs, done)})
                if recorder is not None:
                    eng.unobserve(recorder)
                    print(f"trace: {save_trace(recorder, a.trace)}", file=sys.stderr)
                row = {"model": a.model, "device": eng.device.name, "experts": placement(ns),
                       "moe_cache_mib": eng.ecfg.cache.mib,
                       "cache_policy": getattr(ns, "cache_policy", None), "threads": torch.get_num_threads(),
                       "n_batch": b, "n_ubatch": ub, "spec_n": n_max, "spec_oracle": a.spec_oracle if spec else None,
                       **summarise(t, done[len(runs) - a.repetitions:])}
                if stream_md and not rows:
                    print(report.md_header(cols), flush=True)
                rows.append(row)
                if stream_md:
                    print(report.md_row(cols, row), flush=True)
        del llm, eng               # before the next load: the generator drops its reference, this one must go too
    if not stream_md:
        print(report.render(rows, a.output, cols))
    return 0
