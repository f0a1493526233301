"""The parts of `moestream bench` that its modes share (bench.py: pp/tg rows; bench_compare.py: --compare;
bench_parallel.py: --parallel): the tests, the engine's counters, the flags swept and the loads. torch and the
engine are imported where they are used, so that `moestream bench --help` answers at once.

    t = BenchTest(512, 0, seed=1234)                     # pp512
    run = t.run(load(scalar(a), t.n_tokens), 0)          # {"seconds", "total", "per_layer", "hash"}
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys

from .. import flags
from ..errors import UserError

COUNTERS = ("hits", "misses", "evictions", "uploaded_bytes", "copies", "wait_s", "host_s",
            "ple_bytes")                # PLE n-gram rows gathered on the host (Qwen3.8-Flash-Next), whole-run only
SWEPT = ("batch_size", "ubatch_size", "n_cpu_moe", "moe_cache_mib",      # engine flags that take comma lists here
         "spec_draft_n_max")


def ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


# --- the engine's statistics ----------------------------------------------------------------------------------
def read_stats(llm) -> tuple[dict, dict[int, dict]]:
    """(total, per_layer) counters from llm.stats(), whichever version of it the engine has.

    Each counter in COUNTERS is a number, or None where the engine does not count it (no cache: no hits).
    """
    st = llm.stats()

    def norm(d: dict) -> dict:
        return {k: (float(d[k]) if d.get(k) is not None else None) for k in COUNTERS}

    if "total" in st:
        total = norm({**st["total"], "ple_bytes": st.get("ple_bytes", 0)})
    else:                                                  # the engine before the cache: uploads only
        total = norm({"uploaded_bytes": st.get("uploaded_bytes", 0), "copies": st.get("uploaded_experts", 0)})
    if "per_layer" in st:
        per_layer = {int(l): norm(v) for l, v in st["per_layer"].items()}
    else:
        per_layer = {int(l): norm({"uploaded_bytes": b}) for l, b in st.get("uploaded_bytes_per_layer", {}).items()}
    return total, per_layer


def diff_counters(after: dict, before: dict | None) -> dict:
    """after - before per counter, and the hit rate of the difference (None where not counted or no lookups)."""
    before = before or {}
    d = {k: (None if after.get(k) is None else after[k] - (before.get(k) or 0.0)) for k in COUNTERS}
    lookups = (d["hits"] or 0) + (d["misses"] or 0)
    d["hit_rate"] = d["hits"] / lookups if d["hits"] is not None and lookups > 0 else None
    return d


def mean_counters(ds: list[dict]) -> dict:
    """The mean of several diffs (per run), hit rate recomputed from the summed hits and misses."""
    out = {k: (None if any(d[k] is None for d in ds) else sum(d[k] for d in ds) / len(ds)) for k in COUNTERS}
    lookups = (out["hits"] or 0) + (out["misses"] or 0)
    out["hit_rate"] = out["hits"] / lookups if out["hits"] is not None and lookups > 0 else None
    return out


def per_gpu(engine, per_layer: dict) -> list[dict] | None:
    """A row's counters per device where the layers are split over several (runtime/split.py): the per-layer means
    summed over each device's layers, {"gpu", "device", "layers", "uploaded_gb", "copies", "hits", "misses",
    "hit_rate", "wait_s"}; None on one device."""
    split = getattr(engine, "split", None)
    if split is None:
        return None
    out = []
    for d, dev in enumerate(split.devices):
        mine = [per_layer[l] for l in sorted(split.holds(d, per_layer))]
        sums = {k: sum(c[k] or 0 for c in mine) for k in ("uploaded_bytes", "copies", "hits", "misses", "wait_s")}
        lookups = sums["hits"] + sums["misses"]
        out.append({"gpu": d, "device": dev.name, "layers": list(split.layers(d)),
                    "uploaded_gb": sums.pop("uploaded_bytes") / 1e9, **sums,
                    "hit_rate": sums["hits"] / lookups if lookups else None})
    return out


def per_gpu_lines(rows: list[dict] | None) -> str:
    """per_gpu's rows as lines for stderr: 'gpu 0 (cuda:0, layers 0-23): 1.20 GB uploaded, hit rate 52%, ...'."""
    return "\n".join(f"gpu {r['gpu']} ({r['device']}, layers {r['layers'][0]}-{r['layers'][-1]}): "
                     f"{r['uploaded_gb']:.2f} GB uploaded, {r['copies']:.0f} copies, hit rate "
                     + ("-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%")
                     + f", waits {1e3 * r['wait_s']:.1f} ms" for r in rows or [] if r["layers"])


# --- one test -------------------------------------------------------------------------------------------------
class BenchTest:
    """pp N, tg N or pp PP + tg TG; `run(llm, i)` times the i-th run (i = -1 is the warm-up)."""

    def __init__(self, n_prompt: int, n_gen: int, seed: int):
        self.n_prompt, self.n_gen, self.seed = n_prompt, n_gen, seed
        self.name = "+".join(f"{k}{n}" for k, n in (("pp", n_prompt), ("tg", n_gen)) if n)
        self.spec = None                # with drafts: fn(test, llm, ids, i), the run (bench_spec.py's spec_run)

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen

    def prompt(self, vocab: int, i: int) -> list[int]:
        import torch
        g = torch.Generator().manual_seed(self.seed * 7919 + i + 1)
        return torch.randint(0, vocab, (max(self.n_prompt, 1),), generator=g).tolist()

    def run(self, llm, i: int) -> dict:
        import torch
        from ..runtime.generate import token_hash
        eng = llm.engine
        ids = self.prompt(llm.model_config.vocab_size, i)

        generated = []

        if self.spec is not None and self.n_gen:
            return self.spec(self, llm, ids, i)

        def once():
            # Greedy, each step queued on the last one's argmax on the device, as generate does (its tokens are read
            # back at the end): the device does not wait for the host between steps.
            tok = None
            if self.n_prompt:
                tok = eng.prefill(0, ids, 0)[-1:].argmax(-1)
            out = []
            for pos in range(self.n_prompt, self.n_tokens):
                tok = eng.decode([(0, ids[0], pos)], tokens=tok)[:1].argmax(-1)
                out.append(tok)
            generated.extend(torch.cat(out).tolist() if out else [])

        begin = getattr(eng, "begin_prompt", None)           # the engine's per-prompt counters and routing
        if begin is not None:
            begin()
        before = read_stats(llm)
        seconds = eng.timed(once)[1]
        after = read_stats(llm)
        per_layer = {l: diff_counters(v, before[1].get(l)) for l, v in after[1].items()}
        return {"seconds": seconds, "total": diff_counters(after[0], before[0]), "per_layer": per_layer,
                "hash": token_hash(generated)[:16] if generated else None}


# --- configurations -------------------------------------------------------------------------------------------
def tests_of(a: argparse.Namespace) -> list[BenchTest]:
    n_prompt, n_gen = [512] if a.n_prompt is None else a.n_prompt, [128] if a.n_gen is None else a.n_gen
    tests = [BenchTest(n, 0, a.seed) for n in n_prompt if n > 0] + [BenchTest(0, n, a.seed) for n in n_gen if n > 0]
    tests += [BenchTest(pp, tg, a.seed) for pp, tg in a.pg if pp + tg > 0]
    if not tests:
        raise UserError("nothing to run: give -p N, -n N or -pg PP,TG with N > 0")
    return tests


def placement(ns: argparse.Namespace) -> str:
    """Where the experts live: host (--cpu-moe), host xN (--n-cpu-moe N) or device (all on the GPU, or the CPU)."""
    return "host" if ns.cpu_moe else (f"host x{ns.n_cpu_moe}" if ns.n_cpu_moe else "device")


def load(ns: argparse.Namespace, ctx: int):
    from ..cli import load_model
    return load_model(ns, flags.to_config(ns), progress=ns.verbose, ctx_size=max(ns.ctx_size, ctx))


def release_memory() -> None:
    """After the last reference to an LLM is gone: give its memory back before the next load."""
    gc.collect()
    torch = sys.modules.get("torch")          # none loaded: nothing to give back
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def drafts_swept(a: argparse.Namespace, engine) -> list[int | None]:
    """The rows' drafts a step: --spec-draft-n-max's list, where not given the engine's own choice for its placement
    and cache now (Engine.draft_n_max); [None] (no drafting) without --spec-type draft-mtp."""
    if a.spec_type != "draft-mtp":
        return [None]
    return [engine.draft_n_max if n is None else n for n in a.spec_draft_n_max]


def scalar(a: argparse.Namespace, **values) -> argparse.Namespace:
    """A copy of the bench's flags with one value for each swept flag (the first, unless given)."""
    ns = copy.copy(a)
    for k in SWEPT:
        if isinstance(getattr(ns, k, None), list):
            setattr(ns, k, values.get(k, getattr(ns, k)[0]))
    return ns
