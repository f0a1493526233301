"""CUDA graphs for decode steps, replayed with new tokens and positions.

A decode token launches a few hundred small kernels; launched from Python one by one they cost more than the
work. Replaying a captured graph launches them all at once.

- DecodeGraphs: every expert resident on the GPU; one graph per batch size and attention span.
- HostDecodeGraphs: experts behind the expert cache; per batch size and span, one graph segment per host layer,
  with the host's decisions (routing read-back, uploads, the slot table) between segments. Uploads stay outside
  the graphs.

Attention in a graph spans a fixed number of keys (KVCache.span: a power of two, the mask hides positions past
each token's own), since a graph cannot change shapes between replays; eager decode steps use the same span.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..experts.provider import ExpertProvider, ExpertWeights
from ..models.moe import report_route
from ..models.transformer import Batch, Segment


def static_decode_batch(eng, B: int, span: int) -> tuple[torch.Tensor, Batch]:
    """A decode batch of B sequences attending `span` keys, over static device inputs (3, B): tokens, sequences,
    positions."""
    dev, ctx = eng.device.torch, eng.kv.ctx
    inputs = torch.zeros(3, B, dtype=torch.int64, device=dev)
    inputs[1] = torch.arange(B) % eng.kv.n_seq
    inputs[2] = ctx - 1                          # warm-up writes land in the last KV slot: rewritten before read
    batch = Batch(tokens=inputs[0], segments=[Segment(0, ctx - 1, 1)] * B, seq_ids=inputs[1],
                  positions=inputs[2], out_rows=torch.arange(B, device=dev), kv_len=span, decode_step=True)
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
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, Batch, torch.Tensor]] = {}
        self.pool = None

    def run(self, steps: list[tuple[int, int, int]], span: int) -> torch.Tensor:
        """steps = [(seq, token, position)] -> (B, V) logits (a buffer overwritten by the next replay)."""
        key = (len(steps), span)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, inputs, _, logits = self.graphs[key]
        inputs.copy_(step_inputs(steps, pinned=True), non_blocking=True)
        graph.replay()
        return logits

    @torch.inference_mode()
    def _capture(self, B: int, span: int):
        eng = self.engine
        dev = eng.device.torch
        inputs, batch = static_decode_batch(eng, B, span)
        warm_up(dev, lambda: eng.model.forward(batch, eng.kv, eng.experts, eng.kernel), times=2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = eng.model.forward(batch, eng.kv, eng.experts, eng.kernel)
        self.pool = graph.pool()
        return graph, inputs, batch, logits


class _TableProvider(ExpertProvider):
    """Host layers read their slots from a device table the host fills between graph segments; other layers go
    to their own provider. Nothing here touches the host, so the segments can be captured."""

    def __init__(self, cache, tables: dict[int, torch.Tensor], others):
        super().__init__()
        self.cache, self.tables, self.others = cache, tables, others

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None):
        if layer in self.tables:
            return ExpertWeights(*self.cache.layer_weights(layer), self.tables[layer][ids])
        return self.others.fetch(layer, ids, lookahead)

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        return min(1, self.others.lookahead_layers(layer, n_tokens))      # decode steps guess one layer ahead


class _Step:
    """One batch size's segments and the buffers they share with the host."""

    def __init__(self, segments, inputs, batch, logits, pauses, packed, host, tables):
        self.segments, self.inputs, self.batch, self.logits = segments, inputs, batch, logits
        self.pauses = pauses            # [(layer, number of routed ids, has a lookahead guess)] per pause
        self.packed = packed            # (P, 2 B k) int64 on the device: each pause's routed ids, then its guess
        self.host = host                # the same, pinned on the host (one small copy per pause)
        self.tables = tables            # layer -> (E,) slot table on the device, read by the captured experts


class HostDecodeGraphs:
    """Decode steps with experts in host memory, as captured segments: each segment runs from one host layer's
    experts to the next host layer's router (and packs that router's ids and lookahead guess into one buffer);
    between two segments the host reads the pack back, lets the expert cache upload its misses and make the
    compute stream wait for them, and writes the layer's slot table.

    A hit then costs one small read-back per layer instead of a few hundred Python launches. With capture=False
    the same segments run eagerly (the CPU tests check that path against the plain forward, bit for bit).
    Requires a pool that holds one decode step's routed experts (no waves).
    """

    def __init__(self, engine, capture: bool = True):
        self.engine, self.capture = engine, capture
        self.cache = engine.host
        self.host_layers = sorted(self.cache.store.rows)
        self.steps: dict[tuple[int, int], _Step] = {}
        self.pool = None

    @torch.inference_mode()
    def run(self, steps: list[tuple[int, int, int]], span: int) -> torch.Tensor:
        eng = self.engine
        cuda = eng.device.is_cuda
        B = len(steps)
        self.cache.begin_ubatch(steps[0][0], B, False)      # before a capture too: it decides on lookahead
        if (B, span) not in self.steps:
            self.steps[(B, span)] = self._build(B, span)
        st = self.steps[(B, span)]
        st.inputs.copy_(step_inputs(steps, pinned=cuda), non_blocking=cuda)
        on_route = eng.model.on_route
        E, k = eng.cfg.n_experts, eng.cfg.n_experts_used
        on_route.begin_ubatch(steps[0][0], B, False)
        compute = torch.cuda.current_stream(eng.device.torch) if cuda else None
        for j, segment in enumerate(st.segments):
            segment()
            if j:
                self.cache.experts_launched(st.pauses[j - 1][0])   # the previous pause's layer's experts are queued
            if j == len(st.pauses):
                break
            layer, n, has_guess = st.pauses[j]
            self.cache.slots.mark_reads()
            t0 = time.perf_counter()
            st.host[j].copy_(st.packed[j], non_blocking=cuda)
            if cuda:
                compute.synchronize()                     # the one host sync of this layer
            t1 = time.perf_counter()
            got = st.host[j].numpy()
            if on_route is not None:
                guess_ids = torch.from_numpy(got[n:2 * n].reshape(B, k).copy()) if has_guess else None
                report_route(on_route, layer, torch.from_numpy(got[:n].reshape(B, k).copy()), guess_ids)
            counts = np.bincount(got[:n], minlength=E)
            guess = np.bincount(got[n:2 * n], minlength=E) if has_guess else None
            table = self.cache.prepare(layer, counts, None if guess is None else [guess])
            if isinstance(table, list):
                raise RuntimeError("decode routed more experts than the cache holds: use a larger cache")
            self.cache.upload_table(layer, table, st.tables[layer])
            self.cache.stats.record(layer, sync_s=t1 - t0, host_s=time.perf_counter() - t1)
        return st.logits

    @torch.inference_mode()
    def _build(self, B: int, span: int) -> _Step:
        eng = self.engine
        dev = eng.device
        E, k = eng.cfg.n_experts, eng.cfg.n_experts_used
        inputs, batch = static_decode_batch(eng, B, span)
        tables = {l: torch.zeros(E, dtype=torch.int64, device=dev.torch) for l in self.host_layers}
        packed = torch.zeros(len(self.host_layers), 2 * B * k, dtype=torch.int64, device=dev.torch)
        host = dev.pinned_empty(tuple(packed.shape), torch.int64)
        provider = _TableProvider(self.cache, tables, eng.experts)
        split = frozenset(self.host_layers)
        pauses = []

        def pack(j, paused):
            layer, ids, guess = paused
            n = ids.numel()
            packed[j, :n].copy_(ids.reshape(-1))
            if guess is not None:
                packed[j, n:2 * n].copy_(guess[0].reshape(-1))
            if len(pauses) == j:
                pauses.append((layer, n, guess is not None))

        forward = lambda: eng.model.forward_steps(batch, eng.kv, provider, eng.kernel, split)    # noqa: E731
        if not self.capture:
            st = _Step(None, inputs, batch, None, pauses, packed, host, tables)
            st.segments = self._eager_segments(forward, pack, st)
            return st
        on_route, eng.model.on_route = eng.model.on_route, None     # callbacks run on the host, between segments
        try:
            warm_up(dev.torch, lambda: list(forward()))
            gen = forward()
            graphs, logits = [], None
            while logits is None:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    try:
                        pack(len(graphs), next(gen))
                    except StopIteration as done:
                        logits = done.value
                self.pool = g.pool()
                graphs.append(g.replay)
        finally:
            eng.model.on_route = on_route
        # The batch is kept too: the graphs read its tensors (out_rows is its own allocation).
        return _Step(graphs, inputs, batch, logits, pauses, packed, host, tables)

    def _eager_segments(self, forward, pack, st: _Step):
        """The same segments, uncaptured: each call advances the forward to its next pause and packs what it
        yields, as a graph replay would; the last one leaves the logits in the step."""
        state = {}

        def segment():
            if "gen" not in state:
                state.update(gen=forward(), j=0)
            try:
                pack(state["j"], next(state["gen"]))
                state["j"] += 1
            except StopIteration as done:
                st.logits = done.value
                state.clear()
        return [segment] * (len(self.host_layers) + 1)
