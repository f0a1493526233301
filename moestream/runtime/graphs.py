"""CUDA graphs for decode steps, replayed with new tokens and positions (runtime/decode.py's GraphDecode uses them).

    graphs = DecodeGraphs(engine)
    logits = graphs.run(steps, span, by_address, fused)   # (B, V); captured at the first step of (B, span)

A decode token launches a few hundred small kernels; launched from Python one by one they cost more than the
work. Replaying a captured graph launches them all at once. One graph per batch size and attention span; a graph
holds no host step, so its experts are either all on the GPU or read where they lie (zero-copy decode, whose
address tables are written before each replay, outside the graph).

A hybrid model's step updates each sequence's recurrent state in place, inside the graph; the engine checks and
advances the states' positions on the host around each replay (GraphDecode), as around an eager forward.

Layers split over several devices (runtime/split.py) take one graph per device's share of the layers
(_capture_split): a CUDA graph is captured on one device, into that device's memory pool; what crosses at a split
point is copied between the replays, from one share's static output into the next one's static input.

Attention in a graph spans a fixed number of keys (KVCache.span: a power of two, the mask hides positions past
each token's own), since a graph cannot change shapes between replays; eager decode steps use the same span.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch

from ..models.transformer import Batch, Segment, drain
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
        # (B, span) -> (replay, the static inputs (3, B), the logits buffer, what the graphs read that was made
        # outside them: the static batches, which must live as long as the graphs do; a graph holds no reference)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor, torch.Tensor, list]] = {}
        self.pool = None
        self.pools: dict[int, object] = {}          # a split's: each device's graph memory pool, by its index

    def run(self, steps: list[tuple[int, int, int]], span: int, by_address=None, fused=None,
            tokens: torch.Tensor | None = None) -> torch.Tensor:
        """steps = [(seq, token, position)] -> (B, V) logits (a buffer overwritten by the next replay). by_address
        and fused: the kernels of a step of this size (runtime/decode.py), taken in when its graph is captured.
        tokens: the steps' tokens on the device instead (copied in stream order: the host need not know them)."""
        key = (len(steps), span)
        if key not in self.graphs:
            capture = self._capture if self.engine.split is None else self._capture_split
            self.graphs[key] = capture(*key, by_address, fused)
        replay, inputs, logits, _ = self.graphs[key]
        inputs.copy_(step_inputs(steps, pinned=True), non_blocking=True)
        if tokens is not None:
            inputs[0].copy_(tokens)
        replay()
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
        return graph.replay, inputs, logits, [batch]

    @torch.inference_mode()
    def _capture_split(self, B: int, span: int, by_address, fused):
        """A split's step (runtime/split.py) as one graph per device's share of the layers, each captured on its
        own device with its provider's step ops (PerDevice.ops_of) and its own memory pool. What crosses at a split
        point (models/transformer.py's Flow.crossing, and the step's inputs) is copied between the replays, from
        one share's static output into the next one's static input, as an eager step copies it there; the last
        share's logits go back to the first device."""
        eng, model, split = self.engine, self.engine.model, self.engine.split
        inputs, batch = static_decode_batch(eng, B, span, by_address, fused)
        host = eng.host if by_address is not None else None
        runs = split.runs(range(eng.cfg.n_layers))
        shares, first, held = [], [], None
        for k, (dev, run) in enumerate(runs):
            d, last = split.index(run[0]), k == len(runs) - 1
            ops = host.ops_of(d) if host is not None else None
            with dev.current():
                ins = into = None
                parts = [batch]
                if k:                   # the step's inputs and what crosses in, static on this device
                    ins = inputs.to(dev.torch)
                    parts = [dataclasses.replace(batch, tokens=ins[0], seq_ids=ins[1], positions=ins[2],
                                                 out_rows=batch.out_rows.to(dev.torch))]
                    into = [None if t is None else t.to(dev.torch) for t in held]

                def share(parts=parts, into=into, run=run, last=last):
                    if into is None:
                        flow = model.begin_flow(parts, eng.kv)
                        first[:] = [flow]
                    else:
                        flow = dataclasses.replace(first[0], parts=parts)
                        flow.take(list(into))
                    drain(model.run_layers(flow, run, eng.kv, eng.experts, eng.kernel))
                    return model.end_flow(flow) if last else flow.crossing()
                step = lambda share=share, ops=ops: between_ops(ops, B, share)
                outs = []
                kept = ops[2]() if ops is not None else contextlib.nullcontext()
                with eng.kv.kept(), kept:       # (as _capture's); its output what the next share's warm-up reads
                    warm_up(dev.torch, lambda: outs.append(step()), times=2)
                held = outs[-1]
                graph, out, self.pools[d] = record(step, self.pools.get(d))
                shares.append((dev, graph, ins, into, out, parts))
        logits = torch.empty_like(shares[-1][4], device=split.devices[0].torch)

        def replay():
            crossing = None
            for dev, graph, ins, into, out, _ in shares:
                with dev.current():
                    if ins is not None:
                        ins.copy_(inputs)
                        for dst, src in zip(into, crossing):
                            if dst is not None:
                                dst.copy_(src)
                    graph.replay()
                crossing = out
            logits.copy_(crossing)
        return replay, inputs, logits, [batch]


def record(fn, pool):
    """(graph, fn's output buffer, the graph's memory pool): fn captured as a CUDA graph (nothing runs yet; each
    replay runs it and overwrites the buffer). tests/test_decode_paths.py stands in for it on the CPU."""
    graph = torch.cuda.CUDAGraph()
    # No cyclic garbage collection while it captures: a collection may free an earlier engine's CUDA objects
    # (graphs, events, pinned blocks), calls a capture forbids ("operation not permitted when stream is
    # capturing"); torch.cuda.graph no longer collects before it begins. Refcounted frees go on as ever.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out, graph.pool()
