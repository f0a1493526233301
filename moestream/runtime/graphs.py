"""CUDA graphs for decode steps: one captured forward per batch size, replayed with new tokens and positions.

A decode token launches a few hundred small kernels; launched from Python one by one they cost more than the
work. Replaying a captured graph launches them all at once. Applies where nothing in the forward needs the host:
every expert resident on the GPU and the grouped kernel (host layers choose their uploads on the host, so they
run eagerly; uploads stay outside captured graphs).

Attention in a graph always spans the whole context (the mask hides positions past each token's own), since a
graph cannot change shapes between replays.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..experts.provider import ExpertWeights
from ..experts.stats import Counts
from ..models.transformer import Batch, Segment


def static_decode_batch(eng, B: int) -> tuple[torch.Tensor, Batch]:
    """A decode batch of B sequences over static device inputs (3, B): tokens, sequences, positions."""
    dev, ctx = eng.device.torch, eng.kv.ctx
    inputs = torch.zeros(3, B, dtype=torch.int64, device=dev)
    inputs[1] = torch.arange(B) % eng.kv.n_seq
    inputs[2] = ctx - 1                          # warm-up writes land in the last KV slot: rewritten before read
    batch = Batch(tokens=inputs[0], segments=[Segment(0, ctx - 1, 1)] * B, seq_ids=inputs[1],
                  positions=inputs[2], out_rows=torch.arange(B, device=dev), kv_len=ctx)
    return inputs, batch


def warm_up(dev, fn, times: int = 1) -> None:
    """Run fn on a side stream before a capture: lazy initialisation and workspaces stay out of the graph."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)


def step_inputs(steps: list[tuple[int, int, int]], pinned: bool) -> torch.Tensor:
    """(3, B) host tensor of a decode step's tokens, sequences and positions, for one copy into the static inputs."""
    t = torch.tensor([[tok for _, tok, _ in steps], [s for s, _, _ in steps], [p for _, _, p in steps]],
                     dtype=torch.int64)
    return t.pin_memory() if pinned else t


class DecodeGraphs:
    def __init__(self, engine):
        self.engine = engine
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, Batch, torch.Tensor]] = {}
        self.pool = None

    def run(self, steps: list[tuple[int, int, int]]) -> torch.Tensor:
        """steps = [(seq, token, position)] -> (B, V) logits (a buffer overwritten by the next replay)."""
        B = len(steps)
        if B not in self.graphs:
            self.graphs[B] = self._capture(B)
        graph, inputs, _, logits = self.graphs[B]
        inputs.copy_(step_inputs(steps, pinned=True), non_blocking=True)
        graph.replay()
        return logits

    @torch.inference_mode()
    def _capture(self, B: int):
        eng = self.engine
        dev = eng.device.torch
        inputs, batch = static_decode_batch(eng, B)
        warm_up(dev, lambda: eng.model.forward(batch, eng.kv, eng.experts, eng.kernel), times=2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = eng.model.forward(batch, eng.kv, eng.experts, eng.kernel)
        self.pool = graph.pool()
        return graph, inputs, batch, logits


class _TableProvider:
    """Host layers read their slots from a device table the host fills between graph segments; other layers go
    to their own provider. Nothing here touches the host, so the segments can be captured."""

    def __init__(self, cache, tables: dict[int, torch.Tensor], others):
        self.cache, self.tables, self.others = cache, tables, others

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None):
        if layer in self.tables:
            return ExpertWeights(self.cache.w13, self.cache.w2, self.tables[layer][ids])
        return self.others.fetch(layer, ids, lookahead)

    def wants_lookahead(self, layer: int, n_tokens: int) -> bool:
        return self.others.wants_lookahead(layer, n_tokens)


class HostDecodeGraphs:
    """Decode steps with experts in host memory, as captured segments: each segment runs from one host layer's
    experts to the next host layer's router; between two segments the host reads that layer's routing, lets the
    expert cache upload its misses and make the compute stream wait for them, and writes the layer's slot table.

    A hit then costs one read-back per layer instead of a few hundred Python launches. With capture=False the
    same segments run eagerly (the CPU tests check that path against the plain forward, bit for bit).
    Requires a pool that holds one decode step's routed experts (no waves).
    """

    def __init__(self, engine, capture: bool = True):
        self.engine, self.capture = engine, capture
        self.cache = engine.host
        self.host_layers = sorted(self.cache.store.rows)
        self.steps: dict[int, tuple] = {}
        self.pool = None

    @torch.inference_mode()
    def run(self, steps: list[tuple[int, int, int]]) -> torch.Tensor:
        eng = self.engine
        B = len(steps)
        self.cache.begin_ubatch(steps[0][0], B, False)      # before a capture too: it decides on lookahead
        if B not in self.steps:
            self.steps[B] = self._build(B)
        segments, inputs, pauses, logits, tables = self.steps[B]
        inputs.copy_(step_inputs(steps, pinned=eng.device.is_cuda), non_blocking=eng.device.is_cuda)
        on_route = eng.model.on_route
        E = eng.cfg.n_experts
        if hasattr(on_route, "begin_ubatch"):
            on_route.begin_ubatch(steps[0][0], B, False)
        for j, segment in enumerate(segments):
            segment()
            if j < len(pauses):
                layer, ids, guess = pauses[j]
                self.cache._mark_reads()
                t0 = time.perf_counter()
                got = torch.cat([ids.reshape(-1), guess.reshape(-1)]) if guess is not None else ids.reshape(-1)
                got = got.cpu().numpy()                                   # the one host sync of this layer
                t1 = time.perf_counter()
                ids_np = got[:ids.numel()].reshape(ids.shape)
                if on_route is not None:
                    on_route(layer, torch.from_numpy(ids_np))
                counts = np.bincount(ids_np.reshape(-1), minlength=E)
                g = np.bincount(got[ids.numel():], minlength=E) if guess is not None else None
                table = self.cache.prepare(layer, counts, g)
                if isinstance(table, list):
                    raise RuntimeError("decode routed more experts than the cache holds: use a larger cache")
                tables[layer].copy_(torch.from_numpy(table))
                self.cache.stats.record(layer, Counts(sync_s=t1 - t0, host_s=time.perf_counter() - t1))
        return logits

    @torch.inference_mode()
    def _build(self, B: int):
        eng = self.engine
        dev = eng.device.torch
        inputs, batch = static_decode_batch(eng, B)
        tables = {l: torch.zeros(eng.cfg.n_experts, dtype=torch.int64, device=dev) for l in self.host_layers}
        provider = _TableProvider(self.cache, tables, eng.experts)
        split = frozenset(self.host_layers)
        if not self.capture:
            return self._eager_build(batch, provider, split, inputs, tables)
        on_route, eng.model.on_route = eng.model.on_route, None     # callbacks run on the host, between segments
        try:
            warm_up(dev, lambda: list(eng.model.forward_steps(batch, eng.kv, provider, eng.kernel, split)))
            gen = eng.model.forward_steps(batch, eng.kv, provider, eng.kernel, split)
            graphs, pauses, logits = [], [], None
            while logits is None:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    try:
                        pauses.append(next(gen))
                    except StopIteration as done:
                        logits = done.value
                self.pool = g.pool()
                graphs.append(g.replay)
        finally:
            eng.model.on_route = on_route
        return graphs, inputs, pauses, logits, tables

    def _eager_build(self, batch, provider, split, inputs, tables):
        """The same segments, uncaptured: each call advances the forward's generator to its next pause and copies
        what it yields into static buffers, as a graph replay would leave them."""
        eng = self.engine
        steps = eng.model.forward_steps(batch, eng.kv, provider, eng.kernel, split)
        pauses = []
        try:                                                   # one dry run, for the buffers' shapes
            while True:
                layer, ids, guess = next(steps)
                pauses.append((layer, ids.clone(), None if guess is None else guess.clone()))
        except StopIteration as done:
            logits = done.value.clone()
        state = {}

        def segment():
            if "gen" not in state:
                state.update(gen=eng.model.forward_steps(batch, eng.kv, provider, eng.kernel, split), j=0)
            try:
                _, ids, guess = next(state["gen"])
                _, static_ids, static_guess = pauses[state["j"]]
                static_ids.copy_(ids)
                if guess is not None:
                    static_guess.copy_(guess)
                state["j"] += 1
            except StopIteration as done:
                logits.copy_(done.value)
                state.clear()
        return [segment] * (len(pauses) + 1), inputs, pauses, logits, tables
