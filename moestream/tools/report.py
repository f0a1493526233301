"""Tables and pictures for the tools: markdown, JSON and CSV rows (llama-bench's three formats) and PNG plots.

    cols = [Col("test", "test"), Col("t/s", "tps_mean", lambda r: f"{r['tps_mean']:.2f} ± {r['tps_std']:.2f}")]
    print(md_header(cols)); print(md_row(cols, row))       # markdown, one row at a time (rows print as measured)
    print(render(rows, "json", cols))                     # or "csv": every key of the rows but nested ones
    plot_bench(rows, "bench.png")                         # needs matplotlib (pip install 'moestream[plot]')

A value that was not measured (no GPU, no cache statistics) is None: `n/a` in markdown, null in JSON, an empty
field in CSV.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass
from typing import Callable

from ..errors import UserError
from ..outputs import atomic_path, check_writable


@dataclass(frozen=True)
class Col:
    header: str
    key: str
    fmt: Callable[[dict], str] | None = None     # the cell from the whole row; default: the value, n/a for None
    right: bool = True                           # right-aligned (numbers)

    def cell(self, row: dict) -> str:
        if self.fmt is not None:
            return self.fmt(row)
        return na(row.get(self.key), "{}")


def na(value, spec: str = "{:.2f}") -> str:
    """`spec` applied to value, or n/a where nothing was measured."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return spec.format(value)


def md_header(cols: list[Col]) -> str:
    head = "| " + " | ".join(c.header for c in cols) + " |"
    rule = "| " + " | ".join("---:" if c.right else "---" for c in cols) + " |"
    return head + "\n" + rule


def md_row(cols: list[Col], row: dict) -> str:
    return "| " + " | ".join(c.cell(row) for c in cols) + " |"


def render(rows: list[dict], fmt: str, cols: list[Col]) -> str:
    """All rows in one format: md (cols), json (every key, nested ones too) or csv (every flat key)."""
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        keys = [k for k in (rows[0] if rows else {}) if not isinstance(rows[0][k], (dict, list))]
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue().rstrip("\n")
    return "\n".join([md_header(cols)] + [md_row(cols, r) for r in rows])


# --- pictures -------------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported only when a plot is asked for."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib (or pip install 'moestream[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_plot(path: str) -> None:
    """Refuse a --plot path before the work: one that cannot be created, or whose extension matplotlib cannot write
    (it takes the format from there)."""
    check_writable(path, "--plot")
    pyplot()
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1][1:].lower()
    if ext not in formats:
        why = f"matplotlib cannot write .{ext} files" if ext else "the name has no extension to take the format from"
        raise UserError(f"--plot {path!r}: {why}; end it in .png (or .svg, .pdf, .jpg)")


def _integer_x(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _label(r: dict) -> str:
    cache = f" cache {r['moe_cache_mib']}" if r.get("moe_cache_mib") is not None else ""
    return f"{r['test']} {r['experts']} ub {r['n_ubatch']}{cache}"


def _by(rows: list[dict], key) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def plot_bench(rows: list[dict], path: str) -> None:
    """Prompt tok/s against ubatch (and against the cache size, for a cache sweep); generation tok/s per
    configuration; per layer, uploaded MB per run and hit rate of the prompt runs at the largest ubatch (where
    per-layer statistics exist)."""
    plt = pyplot()
    prompt = [r for r in rows if r["n_prompt"]]
    gen = [r for r in rows if not r["n_prompt"] and r["n_gen"]]
    top_ub = max((r["n_ubatch"] for r in prompt), default=None)
    layered = [r for r in prompt if r.get("per_layer") and r["n_ubatch"] == top_ub]
    with_hits = [r for r in layered if any(v.get("hit_rate") is not None for v in r["per_layer"].values())]
    sizes = sorted({r["moe_cache_mib"] for r in prompt if r.get("moe_cache_mib") is not None})
    panels = bool(prompt) + (len(sizes) > 1) + bool(gen) + bool(layered) + bool(with_hits)
    fig, axes = plt.subplots(max(panels, 1), 1, figsize=(10, 3.4 * max(panels, 1)), squeeze=False)
    axes = [a[0] for a in axes]

    def config(r):
        cache = f", cache {r['moe_cache_mib']} MiB" if r.get("moe_cache_mib") is not None else ""
        return f"{r['experts']}{cache}, b {r['n_batch']}"

    def finish(ax, title, xlabel, ylabel):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))

    if prompt:
        ax = axes.pop(0)
        for (test, cfg), rs in _by(prompt, lambda r: (r["test"], config(r))).items():
            rs = sorted(rs, key=lambda r: r["n_ubatch"])
            ax.errorbar([r["n_ubatch"] for r in rs], [r["tps_mean"] for r in rs], yerr=[r["tps_std"] for r in rs],
                        marker="o", capsize=3, label=f"{test}, {cfg}")
        ax.set_xscale("log", base=2)
        finish(ax, "prompt speed", "n_ubatch", "tokens / s")
    if len(sizes) > 1:                          # a cache-size sweep: tok/s against the cache, a line per ubatch
        ax = axes.pop(0)
        for (test, ub), rs in _by(prompt, lambda r: (r["test"], r["n_ubatch"])).items():
            rs = sorted((r for r in rs if r.get("moe_cache_mib") is not None), key=lambda r: r["moe_cache_mib"])
            ax.errorbar([r["moe_cache_mib"] for r in rs], [r["tps_mean"] for r in rs],
                        yerr=[r["tps_std"] for r in rs], marker="o", capsize=3, label=f"{test}, ubatch {ub}")
        finish(ax, "prompt speed against the expert cache", "--moe-cache-mib", "tokens / s")
    if gen:
        ax = axes.pop(0)
        by = _by(gen, lambda r: f"{r['test']}, {config(r)}")
        names = list(by)
        ax.bar(range(len(names)), [sum(r["tps_mean"] for r in by[n]) / len(by[n]) for n in names],
               color=[f"C{i % 10}" for i in range(len(names))], label=None)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
        ax.set_title("generation speed (mean over the ubatch sizes)")
        ax.set_ylabel("tokens / s")
    for rs, key, title, ylabel in ((layered, "uploaded_bytes", "uploads per layer", "uploaded MB per run"),
                                   (with_hits, "hit_rate", "expert cache hit rate per layer", "hit rate %")):
        if not rs:
            continue
        ax = axes.pop(0)
        for r in rs:
            layers = sorted(r["per_layer"])
            vals = [r["per_layer"][l].get(key) for l in layers]
            scale = 1e-6 if key == "uploaded_bytes" else 100
            ax.plot(layers, [math.nan if v is None else v * scale for v in vals], marker=".", label=_label(r))
        _integer_x(ax)
        if key == "hit_rate":
            ax.set_ylim(0, 100)
        finish(ax, f"{title} (prompts at ubatch {top_ub})", "layer", ylabel)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _save(fig, path: str) -> None:
    """The figure at path, whole or not at all (its format from path's extension)."""
    with atomic_path(path, suffix=os.path.splitext(path)[1]) as tmp:
        fig.savefig(tmp, dpi=110)


def plot_perplexity(chunk_ppl: list[float], kld_values: list[float] | None, path: str) -> None:
    """The running perplexity per chunk and, against a base, the histogram of the per-token KL divergence."""
    plt = pyplot()
    panels = 1 + (kld_values is not None)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.8), squeeze=False)
    ax = axes[0][0]
    ax.plot(range(1, len(chunk_ppl) + 1), chunk_ppl, marker=".")
    ax.set_xlabel("chunk")
    _integer_x(ax)
    ax.set_ylabel("PPL (running estimate)")
    ax.set_title("perplexity")
    if kld_values is not None:
        ax = axes[0][1]
        pos = [v for v in kld_values if v > 0]
        if pos:
            lo, hi = math.log10(min(pos)), math.log10(max(pos))
            edges = [10 ** (lo + (hi - lo) * i / 40) for i in range(41)] if hi > lo else 20
            ax.hist(pos, bins=edges)
            ax.set_xscale("log")
        zeros = len(kld_values) - len(pos)
        ax.set_title(f"KL divergence per token ({zeros} of {len(kld_values)} are 0)")
        ax.set_xlabel("KLD (nats)")
        ax.set_ylabel("tokens")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
