"""CUDA graphs for decode steps, replayed with new tokens and positions (runtime/decode.py's GraphDecode uses them).

    graphs = DecodeGraphs(engine)
    logits = graphs.run(steps, span, by_address, fused)   # (B, V); captured at the first step of (B, span)

A decode token launches a few hundred small kernels; launched from Python one by one they cost more than the
work. Replaying a captured graph launches them all at once. One graph per batch size and attention span; a graph
holds no host step, so its experts are either all on the GPU or read where they lie (zero-copy decode, whose
address tables are written before each replay, outside the graph).

A hybrid model's step updates each sequence's recurrent state in place, inside the graph; the engine checks and
advances the states' positions on the host around each replay (GraphDecode), as around an eager forward.

Attention in a graph spans a fixed number of keys (KVCache.span: a power of two, the mask hides positions past
each token's own), since a graph cannot change shapes between replays; eager decode steps use the same span.
"""
from __future__ import annotations

import contextlib

import torch

from ..models.transformer import Batch, Segment
from .step_ops import between_ops, step_ops


def static_decode_batch(eng, B: int, span: int, by_address=None, fused=None) -> tuple[torch.Tensor, Batch]:
    """A decode batch of B sequences attending `span` keys, over static device inputs (3, B): tokens, sequences,
    positions. No route observer: a captured step cannot call the host (zero-copy decode reports the routing once
    the step is queued)."""
    dev, ctx = eng.device.torch, eng.kv.ctx
    inputs = torch.zeros(3, B, dtype=torch.int64, device=dev)
    inputs[1] = torch.arange(B) % eng.kv.n_seq
    inputs[2] = ctx - 1                          # warm-up writes land in the last KV slot: rewritten before read
                                                 # (a sliding layer's ring: in a live slot, which kv.kept puts back)
    batch = Batch(tokens=inputs[0], segments=[Segment(0, ctx - 1, 1)] * B, seq_ids=inputs[1],
                  positions=inputs[2], out_rows=torch.arange(B, device=dev), kv_len=span, by_address=by_address,
                  fused=fused)
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

    def run(self, steps: list[tuple[int, int, int]], span: int, by_address=None, fused=None,
            tokens: torch.Tensor | None = None) -> torch.Tensor:
        """steps = [(seq, token, position)] -> (B, V) logits (a buffer overwritten by the next replay). by_address
        and fused: the kernels of a step of this size (runtime/decode.py), taken in when its graph is captured.
        tokens: the steps' tokens on the device instead (copied in stream order: the host need not know them)."""
        key = (len(steps), span)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key, by_address, fused)
        graph, inputs, _, logits = self.graphs[key]
        inputs.copy_(step_inputs(steps, pinned=True), non_blocking=True)
        if tokens is not None:
            inputs[0].copy_(tokens)
        graph.replay()
        return logits

    @torch.inference_mode()
    def _capture(self, B: int, span: int, by_address, fused):
        eng = self.engine
        inputs, batch = static_decode_batch(eng, B, span, by_address, fused)
        ops = step_ops(eng, by_address)         # the host provider's device ops around a zero-copy step
        step = lambda: between_ops(ops, B, lambda: eng.model.forward(batch, eng.kv, eng.experts, eng.kernel))
        kept = ops[2]() if ops is not None else contextlib.nullcontext()
        with eng.kv.kept(), kept:       # the warm-up's steps run on real sequences' recurrent states (hybrids), and
            warm_up(eng.device.torch, step, times=2)      # on the provider's real table
        graph, logits, self.pool = record(step, self.pool)
        return graph, inputs, batch, logits


def record(fn, pool):
    """(graph, fn's output buffer, the graph's memory pool): fn captured as a CUDA graph (nothing runs yet; each
    replay runs it and overwrites the buffer). tests/test_decode_paths.py stands in for it on the CPU."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out, graph.pool()
