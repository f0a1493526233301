"""CUDA graphs for decode steps: one captured forward per batch size, replayed with new tokens and positions.

A decode token launches a few hundred small kernels; launched from Python one by one they cost more than the
work. Replaying a captured graph launches them all at once. Applies where nothing in the forward needs the host:
every expert resident on the GPU and the grouped kernel (host layers choose their uploads on the host, so they
run eagerly; uploads stay outside captured graphs).

Attention in a graph always spans the whole context (the mask hides positions past each token's own), since a
graph cannot change shapes between replays.
"""
from __future__ import annotations

import torch

from ..models.transformer import Batch, Segment


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
        host = torch.tensor([[t for _, t, _ in steps], [s for s, _, _ in steps], [p for _, _, p in steps]],
                            dtype=torch.int64).pin_memory()
        inputs.copy_(host, non_blocking=True)                # (3, B): tokens, sequences, positions
        graph.replay()
        return logits

    @torch.inference_mode()
    def _capture(self, B: int):
        eng = self.engine
        dev = eng.device.torch
        ctx = eng.kv.ctx
        inputs = torch.zeros(3, B, dtype=torch.int64, device=dev)
        inputs[1] = torch.arange(B) % eng.kv.n_seq
        inputs[2] = ctx - 1                          # warm-up writes land in the last KV slot: rewritten before read
        batch = Batch(tokens=inputs[0], segments=[Segment(0, ctx - 1, 1)] * B, seq_ids=inputs[1],
                      positions=inputs[2], out_rows=torch.arange(B, device=dev), kv_len=ctx)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):                       # warm-up: lazy initialisation, workspace allocation
                eng.model.forward(batch, eng.kv, eng.experts, eng.kernel)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = eng.model.forward(batch, eng.kv, eng.experts, eng.kernel)
        self.pool = graph.pool()
        return graph, inputs, batch, logits
