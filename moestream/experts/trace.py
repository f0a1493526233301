"""Routing traces: record which experts every ubatch routed, and replay them against a cache offline.

    rec = TraceRecorder(n_layers, n_experts, expert_bytes)
    llm.engine.observe(rec)                  # sees (layer, ids (T, k)) of every MoE layer of every forward
    ...; rec.save("run.trace.npz")
    replay(load_trace("run.trace.npz"), n_slots=1700, policy="lfru")   # {"total": {...}, "per_layer": {...}}
    replay(trace, 1700, "lfru", prefetch=PrefetchConfig())             # with the prompt-path prefetch rules too

So policies, cache sizes and prefetch rules are compared on real routing without a GPU. The replay runs the live
cache's own code (planner, residency, waves, counters; with `prefetch`, the whole ExpertCache on the CPU over
stand-in rows), so it predicts the live counts exactly. Lookahead needs hidden states, which a trace does not hold,
so the recorder keeps the guesses themselves (the next layer's router on each layer's input), wherever the forward
made one (every eager forward while recording; captured decode steps only where the cache asked for them), and a
prefetch replay copies ahead from them as the live cache did.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import UserError
from .cache import ExpertCache
from .planner import CachePlanner
from .prefetch import PrefetchConfig
from ..quant.layout import ExpertLayout
from .provider import ExpertWeights
from .routing import RouteObserver


@dataclass
class Trace:
    layers: np.ndarray          # (R,) layer of each record, in forward order
    ids: list[np.ndarray]       # R arrays (T, k) of expert ids
    n_layers: int
    n_experts: int
    expert_bytes: int           # a slot's bytes: a replay counts each upload at this (a file whose layers' types
                                # differ moved less)
    ubatch_of: np.ndarray | None = None     # (R,) the ubatch of each record
    ubatches: np.ndarray | None = None      # (U, 4): sequence, tokens, is_prompt, begins a prompt
    guesses: list[np.ndarray | None] | None = None   # R lookahead guesses (T, k) of the next layer's experts
    quantized: bool = False     # the experts were quantized rows: their pool is one region (planner.py)
    step_seqs: list[np.ndarray | None] | None = None   # (U,) each ubatch's tokens' sequences, where told
    begun: list[np.ndarray] | None = None   # (U,) the sequences whose prompts began just before each ubatch


class TraceRecorder(RouteObserver):
    wants_guess = True                  # the forward computes the lookahead guess for the trace too

    def __init__(self, n_layers: int, n_experts: int, expert_bytes: int, quantized: bool = False):
        self.n_layers, self.n_experts, self.expert_bytes = n_layers, n_experts, expert_bytes
        self.quantized = quantized
        self.layers: list[int] = []
        self.ids: list[np.ndarray] = []
        self.guesses: list[np.ndarray | None] = []
        self.ubatch_of: list[int] = []
        self.ubatches: list[list[int]] = []
        self.step_seqs: list[list[int]] = []        # each ubatch's tokens' sequences ([] where not told)
        self.begun: list[list[int]] = []            # the sequences whose prompts began just before each ubatch
        self._new_prompt = False
        self._begun: list[int] = []

    # The engine calls these around forwards, so the trace knows where prompts and ubatches begin.
    def begin_prompt(self, seq: int) -> None:
        self._new_prompt = True
        self._begun.append(seq)

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        self.ubatches.append([seq, n_tokens, int(is_prompt), int(self._new_prompt and is_prompt)])
        self.step_seqs.append(list(seqs) if seqs is not None and len(seqs) == n_tokens else [])
        self.begun.append(self._begun)
        self._begun = []
        if is_prompt:
            self._new_prompt = False

    def on_route(self, layer: int, ids, guess=None) -> None:
        self.layers.append(layer)
        self.ids.append(ids.detach().cpu().numpy().astype(np.int16))
        self.guesses.append(None if guess is None else guess.detach().cpu().numpy().astype(np.int16))
        self.ubatch_of.append(len(self.ubatches) - 1)

    def save(self, path: str) -> None:
        rows = np.array([len(a) for a in self.ids], dtype=np.int64)
        k = self.ids[0].shape[1] if self.ids else 0
        flat = np.concatenate(self.ids) if self.ids else np.zeros((0, k), dtype=np.int16)
        g_rows = np.array([0 if g is None else len(g) for g in self.guesses], dtype=np.int64)
        given = [g for g in self.guesses if g is not None]
        g_flat = np.concatenate(given) if given else np.zeros((0, k), dtype=np.int16)
        np.savez_compressed(path, layers=np.array(self.layers, dtype=np.int32), rows=rows, ids=flat,
                            guess_rows=g_rows, guesses=g_flat,
                            meta=np.array([self.n_layers, self.n_experts, self.expert_bytes, int(self.quantized)],
                                              dtype=np.int64),
                            ubatch_of=np.array(self.ubatch_of, dtype=np.int64),
                            ubatches=np.array(self.ubatches, dtype=np.int64).reshape(-1, 4),
                            step_seq_counts=np.array([len(s) for s in self.step_seqs], dtype=np.int64),
                            step_seqs=np.array([s for ss in self.step_seqs for s in ss], dtype=np.int64),
                            begun_counts=np.array([len(b) for b in self.begun], dtype=np.int64),
                            begun=np.array([s for b in self.begun for s in b], dtype=np.int64))


def record(llm) -> TraceRecorder:
    """A recorder of every forward of `llm` (api.LLM) from now on, its expert size the host store's slot."""
    cfg = llm.model_config
    store = getattr(llm.engine.host, "store", None)       # a slot's bytes where experts are on the host
    recorder = TraceRecorder(cfg.n_layers, cfg.n_experts, store.expert_bytes if store is not None else
                             cfg.expert_numel * llm.engine.dtype.itemsize, llm.engine.quantized)
    llm.engine.observe(recorder)
    return recorder


def trace_file(path: str) -> str:
    """The file a trace given as `path` is written to: .npz added, numpy's rule for the name."""
    return path if path.endswith(".npz") else path + ".npz"


def check_trace_path(path: str) -> None:
    """Refuse --trace `path` before the work: a directory, or a file that cannot be written there."""
    from ..outputs import check_writable
    for p in dict.fromkeys((path, trace_file(path))):
        check_writable(p, "--trace")


def save_trace(recorder: TraceRecorder, path: str) -> str:
    """Writes the trace to trace_file(path) whole or not at all; returns the name."""
    from ..outputs import atomic_path
    target = trace_file(path)
    with atomic_path(target, suffix=".npz") as tmp:
        recorder.save(tmp)
    return target


def load_trace(path: str) -> Trace:
    try:
        z = np.load(path)
        layers, rows, flat, meta = z["layers"], z["rows"], z["ids"], z["meta"]
        ub_of = z["ubatch_of"] if "ubatch_of" in z.files else None
        ubs = z["ubatches"] if "ubatches" in z.files else None
        g_rows, g_flat = (z["guess_rows"], z["guesses"]) if "guesses" in z.files else (None, None)
        s_rows, s_flat = (z["step_seq_counts"], z["step_seqs"]) if "step_seqs" in z.files else (None, None)
        b_rows, b_flat = (z["begun_counts"], z["begun"]) if "begun" in z.files else (None, None)
    except OSError as e:
        raise UserError(f"cannot read routing trace {path!r} ({e.strerror or e}); record one with generate --trace "
                        "FILE") from None
    except (KeyError, ValueError, EOFError, zipfile.BadZipFile):     # not an .npz, or another program's
        raise UserError(f"{path!r} is not a routing trace; record one with generate --trace FILE") from None
    ids = np.split(flat, np.cumsum(rows)[:-1]) if len(rows) else []
    guesses = None
    if g_rows is not None:
        parts = np.split(g_flat, np.cumsum(g_rows)[:-1]) if len(g_rows) else []
        guesses = [p if n else None for p, n in zip(parts, g_rows.tolist())]
    quantized = len(meta) > 3 and bool(meta[3])            # (older traces: float experts)
    step_seqs = None
    if s_rows is not None:
        parts = np.split(s_flat, np.cumsum(s_rows)[:-1]) if len(s_rows) else []
        step_seqs = [p if len(p) else None for p in parts]
    begun = np.split(b_flat, np.cumsum(b_rows)[:-1]) if b_rows is not None and len(b_rows) else None
    return Trace(layers, ids, int(meta[0]), int(meta[1]), int(meta[2]), ub_of, ubs, guesses, quantized, step_seqs,
                 begun)


def replay(trace: Trace, n_slots: int, policy: str = "lfru", prefetch: PrefetchConfig | None = None,
           zero_copy: bool = False, read_through: bool = False, staged: bool = False) -> dict:
    """Counts the live cache would have had on this routing: totals and per layer. `zero_copy`: decode steps as
    zero-copy decode runs them (the default on CUDA: the cache learns one step late), with or without
    read-through, staged or not (kernels/stage.py, a quantized file's default); this replays the live cache
    itself, like `prefetch` (an empty PrefetchConfig if none given).
    A trace keeps one lookahead guess per layer, so the replay guesses one layer ahead (`lookahead_layers` 1)."""
    if prefetch is not None or zero_copy:
        prefetch = replace(prefetch or PrefetchConfig(enabled=False), lookahead_layers=1)
        return _replay_live(trace, n_slots, policy, prefetch, zero_copy, read_through, staged)
    planner = CachePlanner(n_slots, trace.n_layers, trace.n_experts, policy, trace.expert_bytes,
                           sorted(set(trace.layers.tolist())), one_region=trace.quantized)
    for layer, ids in zip(trace.layers.tolist(), trace.ids):
        for group in planner.groups(layer, np.unique(ids).astype(np.int64)):
            planner.plan(layer, group)
    return _report(planner.stats)


def _replay_live(trace: Trace, n_slots: int, policy: str, prefetch: PrefetchConfig, zero_copy: bool,
                 read_through: bool, staged: bool = False) -> dict:
    if trace.ubatches is None or trace.ubatch_of is None:
        raise UserError("this trace has no ubatch boundaries (an older recording): record it again to replay prefetch")
    from ..device import Device
    from .store import ExpertStore
    layers = sorted(set(trace.layers.tolist()))
    # Stand-in rows of one byte per expert: the cache's decisions do not depend on the bytes, and counters in
    # bytes are rescaled to the traced expert size below.
    store = ExpertStore({l: torch.zeros(trace.n_experts, 3, dtype=torch.uint8) for l in layers}, ExpertLayout(1, 1))
    guesses = trace.guesses or [None] * len(trace.ids)
    cache = ExpertCache(store, n_slots, trace.n_layers, trace.n_experts, Device("cpu"), policy, prefetch, layers,
                        int(trace.ubatches[:, 0].max()) + 1 if len(trace.ubatches) else 1,
                        trace.ids[0].shape[1] if trace.ids else 8, one_region=trace.quantized)
    if zero_copy:
        from ..kernels.decode import MAX_TOKENS
        cache.enable_zero_copy(MAX_TOKENS, read_through, staged=staged)
    zc = cache.zero_copy
    current, step = -1, None                 # step: the tokens of the zero-copy decode step being replayed
    for layer, ids, guess, ub in zip(trace.layers.tolist(), trace.ids, guesses, trace.ubatch_of.tolist()):
        if ub != current:
            if step is not None:
                zc.end_step(step)
            seq, n, is_prompt, new_prompt = trace.ubatches[ub].tolist()
            if trace.begun is not None:      # every sequence whose prompt began (a prompt batch holds several)
                for s in trace.begun[ub].tolist():
                    cache.begin_prompt(s)
            elif new_prompt:                 # (older traces: the ubatch's first sequence's)
                cache.begin_prompt(seq)
            told = trace.step_seqs[ub] if trace.step_seqs is not None else None     # each token's sequence
            told = None if told is None else told.tolist()
            cache.begin_ubatch(seq, n, bool(is_prompt), told)
            current = ub
            step = n if zc is not None and not is_prompt and n <= zc.max_tokens else None
            if step is not None:
                zc.begin_step(told)
        if step is not None:                 # the step's kernel reads where the table says: no fetch
            zc.replay_route(layer, ids)
            continue
        if guess is not None and cache.lookahead_layers(layer, len(ids)):    # as the live forward would have asked
            guess = (torch.from_numpy(guess.astype(np.int64)),)
        else:
            guess = None
        w = cache.fetch(layer, torch.from_numpy(ids.astype(np.int64)), guess)
        if not isinstance(w, ExpertWeights):
            for _ in w:                      # Waves: they load as they are iterated
                pass
        cache.experts_launched(layer)
    if step is not None:
        zc.end_step(step)
    cache.collect_waits()                    # learns from the last zero-copy step, as reading live counters does
    out = _report(cache.stats)
    for d in (out["total"], *out["per_layer"].values()):
        for key in ("uploaded_bytes", "prefetched_bytes", "host_read_bytes"):
            d[key] = d[key] // store.expert_bytes * trace.expert_bytes
    return out


def _report(stats) -> dict:
    return {"total": stats.summary(stats.total),
            "per_layer": {l: c.as_dict() for l, c in sorted(stats.total.items())}}
