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

import functools
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
    quantized: bool = False     # the experts were quantized rows
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
    cfg = llm.engine.cfg                                   # (an MTP head, where loaded, is layer n_layers)
    store = getattr(llm.engine.host, "store", None)       # a slot's bytes where experts are on the host
    recorder = TraceRecorder(cfg.n_stored_layers, cfg.n_experts, store.expert_bytes if store is not None else
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
    """The trace save_trace wrote at `path`; one line (UserError) for a file that is not one, or a damaged one."""
    try:
        with np.load(path) as z:
            a = {k: z[k] for k in z.files}
    except OSError as e:
        raise UserError(f"cannot read routing trace {path!r} ({e.strerror or e}); record one with generate --trace "
                        "FILE") from None
    except Exception:   # not an .npz, or a damaged one: zipfile, zlib and numpy raise a dozen types between them
        raise UserError(f"{path!r} is not a routing trace; record one with generate --trace FILE") from None

    def need(ok, what: str) -> None:
        if not ok:
            raise UserError(f"{path!r} is not a whole routing trace ({what}); record it again with generate --trace "
                            "FILE")
    need(all(k in a for k in ("layers", "rows", "ids", "meta")), "arrays missing")
    need(all(np.issubdtype(v.dtype, np.integer) for v in a.values()), "arrays that are not integers")
    meta, layers = a["meta"], a["layers"]
    need(meta.ndim == 1 and len(meta) >= 3 and (meta[:3] > 0).all(), "its sizes")
    n_layers, n_experts = int(meta[0]), int(meta[1])
    need(layers.ndim == 1 and _within(layers, n_layers), "layers")
    split = functools.partial(_split, need=need)
    ids = split(a, "rows", "ids", len(layers), n_experts, ndim=2)
    guesses = ub_of = ubs = step_seqs = begun = None
    if "guesses" in a:
        guesses = [p if len(p) else None for p in split(a, "guess_rows", "guesses", len(layers), n_experts, ndim=2)]
    if "ubatches" in a:
        ubs, ub_of = a["ubatches"], a.get("ubatch_of")
        need(ubs.ndim == 2 and ubs.shape[1] == 4 and (ubs >= 0).all(), "ubatches")
        need(ub_of is not None and ub_of.shape == layers.shape and _within(ub_of, len(ubs)), "ubatch_of")
        if "step_seqs" in a:
            step_seqs = [p if len(p) else None for p in split(a, "step_seq_counts", "step_seqs", len(ubs))]
        if "begun" in a and len(ubs):
            begun = split(a, "begun_counts", "begun", len(ubs))
    quantized = len(meta) > 3 and bool(meta[3])            # (older traces: float experts)
    if ubs is not None:
        ubs, step_seqs, begun = _dense_sequences(ubs, step_seqs, begun)
    return Trace(layers, ids, n_layers, n_experts, int(meta[2]), ub_of, ubs, guesses, quantized, step_seqs, begun)


def _dense_sequences(ubs: np.ndarray, step_seqs: list | None, begun: list | None):
    """The trace's sequence ids renumbered 0, 1, ... in their order: the replayed cache keeps state per sequence
    number, and a recorded id (a server's request counter, or a damaged file's) may be any size."""
    parts = [ubs[:, 0], *(p for p in step_seqs or () if p is not None), *(begun or ())]
    ids = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    dense = lambda p: None if p is None else np.searchsorted(ids, p).astype(np.int64)    # noqa: E731
    ubs = ubs.copy()
    ubs[:, 0] = dense(ubs[:, 0])
    return (ubs, None if step_seqs is None else [dense(p) for p in step_seqs],
            None if begun is None else [dense(p) for p in begun])


def _within(a: np.ndarray, high: int | None) -> bool:
    """Every value of `a` in [0, high) (high None: any value >= 0)."""
    return not a.size or (a.min() >= 0 and (high is None or a.max() < high))


def _split(a: dict, counts: str, flat: str, n: int, high: int | None = None, *, ndim: int = 1,
           need) -> list[np.ndarray]:
    """a[flat] (ndim dims) cut into n parts of a[counts] rows each, checked whole (its values in [0, high))."""
    c, f = a.get(counts), a[flat]
    need(c is not None and c.shape == (n,) and _within(c, None) and f.ndim == ndim and int(c.sum()) == len(f)
         and _within(f, high), flat)
    return np.split(f, np.cumsum(c)[:-1]) if n else []


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
                           sorted(set(trace.layers.tolist())))
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
                        _n_seq(trace),
                        trace.ids[0].shape[1] if trace.ids else 8)
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


def _n_seq(trace: Trace) -> int:
    """Sequences the replayed cache keeps routing for: every one the trace names (a batch's others than its first
    are in step_seqs and begun only)."""
    seqs = [trace.ubatches[:, 0], *(p for p in trace.step_seqs or () if p is not None), *(trace.begun or ())]
    return max((int(p.max()) + 1 for p in seqs if len(p)), default=1)


def _report(stats) -> dict:
    return {"total": stats.summary(stats.total),
            "per_layer": {l: c.as_dict() for l, c in sorted(stats.total.items())}}
