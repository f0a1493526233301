"""Route observers: who sees each MoE layer's routing of a forward (routing traces, per-context statistics).

    class Counter(RouteObserver):
        def on_route(self, layer, ids, guess=None): ...        # ids (T, k) expert ids, on the device
    engine.observe(Counter())                                  # every forward from now on reports to it

The engine tells its observers where prompts and ubatches begin (`begin_prompt`, `begin_ubatch`); the forward
reports each MoE layer's routed ids (and, to observers with `wants_guess`, the lookahead guess of the next MoE
layer's experts, computed for them if nobody else asked for it). Every method is a no-op by default.
"""
from __future__ import annotations


class RouteObserver:
    wants_guess = False                 # the forward computes the next layer's lookahead guess for this observer

    def begin_prompt(self, seq: int) -> None:
        """A new prompt of context `seq` begins (its prompt counters and statistics restart)."""

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool) -> None:
        """A forward of n_tokens tokens begins; seq is its first segment's sequence."""

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

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool) -> None:
        for o in self.observers:
            o.begin_ubatch(seq, n_tokens, is_prompt)

    def on_route(self, layer: int, ids, guess=None) -> None:
        for o in self.observers:
            o.on_route(layer, ids, guess if o.wants_guess else None)


class RouteCallback(RouteObserver):
    """A function as an observer: fn(layer, ids) sees each MoE layer's routing (tests, quick counts)."""

    def __init__(self, fn):
        self.fn = fn

    def on_route(self, layer: int, ids, guess=None) -> None:
        self.fn(layer, ids)


def report_route(observer: RouteObserver | None, layer: int, ids, guess=None) -> None:
    """Tell `observer`, if any, what a layer routed: ids (T, k), and the guess (T, k) only where it asks for
    guesses (`wants_guess`). The forward calls this for each MoE layer, zero-copy decode once a step is queued."""
    if observer is not None:
        observer.on_route(layer, ids, guess if observer.wants_guess else None)
