"""Route observers: who sees each MoE layer's routing of a forward (routing traces, per-context statistics).

    class Counter(RouteObserver):
        def on_route(self, layer, ids, guess=None): ...        # ids (T, k) expert ids, on the device
    engine.observe(Counter())                                  # every forward from now on reports to it

The engine tells its observers where prompts and ubatches begin (`begin_prompt`, `begin_ubatch`); the forward
reports each MoE layer's routed ids (and, to observers with `wants_guess`, the lookahead guess of the next MoE
layer's experts, computed for them if nobody else asked for it). Every method is a no-op by default.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from .prefetch import RoutingStats

MAX_KEPT_OWNERS = 64        # counting(list): lists up to this long (decode steps) keep their device tensor


class RouteObserver:
    wants_guess = False                 # the forward computes the next layer's lookahead guess for this observer

    def begin_prompt(self, seq: int) -> None:
        """A new prompt of context `seq` begins (its prompt counters and statistics restart)."""

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        """A forward of n_tokens tokens begins; seq is its first segment's sequence, seqs (a decode step of
        several sequences) each token's."""

    def on_route(self, layer: int, ids, guess=None) -> None:
        """Layer `layer` routed ids (T, k); guess (T, k): the next MoE layer's guessed experts, or None."""


class RouteObservers(RouteObserver):
    """Several observers as one, called in the order they were added."""

    def __init__(self, observers: list[RouteObserver] | None = None):
        self.observers: list[RouteObserver] = list(observers or ())

    @property
    def wants_guess(self) -> bool:
        return any(o.wants_guess for o in self.observers)

    def add(self, observer: RouteObserver) -> None:
        if not isinstance(observer, RouteObserver):
            raise TypeError(f"{type(observer).__name__} is not a RouteObserver")
        self.observers.append(observer)

    def remove(self, observer: RouteObserver) -> None:
        self.observers.remove(observer)

    def begin_prompt(self, seq: int) -> None:
        for o in self.observers:
            o.begin_prompt(seq)

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        for o in self.observers:
            o.begin_ubatch(seq, n_tokens, is_prompt, seqs)

    def on_route(self, layer: int, ids, guess=None) -> None:
        for o in self.observers:
            o.on_route(layer, ids, guess if o.wants_guess else None)


class RouteCallback(RouteObserver):
    """A function as an observer: fn(layer, ids) sees each MoE layer's routing (tests, quick counts)."""

    def __init__(self, fn):
        self.fn = fn

    def on_route(self, layer: int, ids, guess=None) -> None:
        self.fn(layer, ids)


class RoutingStore(RouteObserver):
    """Per context (a KV sequence; a server slot is one), expert counts (layers x experts) of two kinds:

    prompts[seq]   a RoutingStats (prefetch.py), host data: the routing of the prompt ubatches in the host layers, as
                   the expert cache's prepare() reads it back anyway: the current prompt so far, its last ubatch and
                   the previous prompt. It seeds the prompt-path prefetch (prefetch.choose_seed). The cache records
                   it and starts each prompt's (ExpertCache.begin_prompt), so that a cache without an engine (a trace
                   replay) seeds as the live one does.
    current(seq), previous[seq]
                   every routing that forwards report while `counting` names the context's rows: prompt and decode,
                   every MoE layer, of the context's current request and of its previous one (/slots shows them).
                   They stay on the device, added with one index_add_ per engine call, so counting never
                   synchronizes; they are made at the first counted call (nothing else pays for them).

    The two differ in what they count (host layers vs all, prompts vs all, and a prompt that routed nothing leaves
    prompts[seq].previous as it was), so they stay two fields rather than one count that changes either.

        store = engine.routing                         # the engine's, with or without a cache; an observer of it
        with store.counting(2):                        # a prompt ubatch: every row is context 2's
            engine.prefill(2, tokens, start)
        with store.counting([0, 2]):                   # a batched decode: row i is context [0, 2][i]'s
            engine.decode(steps)
        with store.counting([0] * 3 + [2] * 5):        # a prompt batch of two contexts' parts, row by row
            engine.prefill_parts([(0, 0, a), (2, 0, b)])
        engine.begin_prompt(2)                         # a new request: context 2's current counts become previous
        store.current(2), store.previous[2]            # (n_layers, n_experts) int64 numpy arrays
        store.prompts[2].current                       # the host layers' prompt counts the cache seeds from

    Call everything on the thread that owns the engine.
    """

    def __init__(self, n_layers: int, n_experts: int, n_seq: int = 1, device="cpu"):
        self.n_layers, self.n_experts, self.n_seq, self.device = n_layers, n_experts, n_seq, device
        self.prompts = [RoutingStats(n_layers, n_experts) for _ in range(n_seq)]
        self.counts: torch.Tensor | None = None   # (n_layers, n_seq, n_experts) on the device, once counted
        self.previous = [np.zeros((n_layers, n_experts), dtype=np.int64) for _ in range(n_seq)]
        self._owner = None                        # int, (B,) tensor, or None while no counted call runs
        self._owners: dict[tuple[int, ...], torch.Tensor] = {}    # device tensors, made once per key
        self._bases: dict[tuple[int, ...], torch.Tensor] = {}
        self._routed: list[tuple[int, torch.Tensor]] = []       # (layer, ids (T, k)) of the running call

    # --- the requests' counts (/slots) ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def counting(self, owner: int | list[int] | None):
        """The engine call inside adds its routing to the owner's counts (None: not counted): an int owns every
        row, a list one row each. A call that raises counts nothing."""
        if isinstance(owner, list):
            key = tuple(owner)
            if len(key) > MAX_KEPT_OWNERS:       # a prompt batch of several contexts: made for this call alone
                owner = torch.tensor(key, dtype=torch.int64, device=self.device)
            else:                                # a decode step's contexts: the same few come back every step
                if key not in self._owners:
                    self._owners[key] = torch.tensor(key, dtype=torch.int64, device=self.device)
                owner = self._owners[key]
        self._owner, self._routed = owner, []
        try:
            yield
        finally:
            self._owner = None
        if owner is not None and self._routed:
            self._add(owner)
        self._routed = []

    def _add(self, owner) -> None:
        if self.counts is None:   # (n_layers, n_seq, n_experts): a layer's block is contiguous; dense layers stay 0
            self.counts = torch.zeros((self.n_layers, self.n_seq, self.n_experts), dtype=torch.int64,
                                      device=self.device)
        _, S, E = self.counts.shape
        by_layer: dict[int, list[torch.Tensor]] = {}
        for layer, ids in self._routed:       # a call of several ubatches sees a layer several times
            by_layer.setdefault(layer, []).append(ids)
        layers = tuple(sorted(by_layer))
        ids = torch.stack([torch.cat(by_layer[l]) for l in layers])                        # (nL, T, k)
        if layers not in self._bases:        # made once: a copy from pageable memory may synchronize the stream
            first = torch.tensor(layers, dtype=torch.int64, device=ids.device) * (S * E)         # (nL,)
            self._bases[layers] = first[:, None, None]
        base = self._bases[layers]                                                         # (nL, 1, 1)
        rows = owner * E if isinstance(owner, int) else (owner * E)[None, :, None]          # each row's context
        idx = (base + rows + ids).reshape(-1)                                              # into counts.view(-1)
        self.counts.view(-1).index_add_(0, idx, torch.ones_like(idx))

    def on_route(self, layer: int, ids, guess=None) -> None:
        if self._owner is not None:
            self._routed.append((layer, ids.to(self.device, non_blocking=True)))

    def begin_prompt(self, seq: int) -> None:
        """A new request in context `seq` (the engine's begin_prompt): its counts so far become the previous
        request's; the current ones restart. (prompts[seq] is the cache's to start: see the class.)"""
        self.previous[seq] = self.current(seq)
        if self.counts is not None:
            self.counts[:, seq].zero_()

    def current(self, seq: int) -> np.ndarray:
        """(n_layers, n_experts): the counts of context seq's current request."""
        if self.counts is None:
            return np.zeros((self.n_layers, self.n_experts), dtype=np.int64)
        return self.counts[:, seq].to("cpu", copy=True).numpy()

    def clear_requests(self) -> None:
        """Every context's request counts, current and previous, back to zero (a new server's slots)."""
        if self.counts is not None:
            self.counts.zero_()
        self.previous = [np.zeros((self.n_layers, self.n_experts), dtype=np.int64) for _ in range(self.n_seq)]

    # --- the prompts' counts (prefetch seeding) --------------------------------------------------------------------
    def clear_prompts(self) -> None:
        """Every context's prompt counts back to zero (a new cache learns from scratch: reconfigure_cache)."""
        self.prompts = [RoutingStats(self.n_layers, self.n_experts) for _ in range(self.n_seq)]


def report_route(observer: RouteObserver | None, layer: int, ids, guess=None) -> None:
    """Tell `observer`, if any, what a layer routed: ids (T, k), and the guess (T, k) only where it asks for
    guesses (`wants_guess`). The forward calls this for each MoE layer, zero-copy decode once a step is queued."""
    if observer is not None:
        observer.on_route(layer, ids, guess if observer.wants_guess else None)
