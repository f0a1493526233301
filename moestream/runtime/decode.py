"""Decode paths: how a decode step runs, as the engine's decode plan says (runtime/plan.py: decided once when the
engine is set up, and again for a new cache).

    path = decode_path(engine)              # GraphDecode where the plan says graphs, else EagerDecode
    if path.takes(len(steps)):              # (the engine's EagerDecode runs the steps a path does not take)
        logits = path.run(steps, span)      # steps = [(seq, token, position)] -> (B, V) logits

- EagerDecode, the plain path: a step is one eager forward. Its experts are fetched through the providers (the
  host decides between layers: uploads, the cache) or, in a zero-copy step, read where they lie. It is the CPU
  reference, what --no-cuda-graphs gives on CUDA (and CUDA without Triton, where steps fetch their experts), and
  the path of every step longer than MAX_TOKENS tokens that has host experts.
- GraphDecode: one CUDA graph per (batch size, span) (runtime/graphs.py; layers split over several devices: one
  per device's share), for steps with no host step inside:
  zero-copy steps of at most MAX_TOKENS tokens on any placement, and every step when all experts are on the GPU.

What changes per step travels with the step's batch, decided here: a step of at most MAX_TOKENS tokens runs the
fused ops (kernels.fused, where the engine has them) and, with zero-copy decode, the decode expert kernel
(kernels/decode.py); longer steps run neither. In a zero-copy step with host experts the host provider writes its
address table before the step (begin_decode_step) and reports the step's routing to the route observers once the
step is queued (end_decode_step); the forward itself then reports nothing.
"""
from __future__ import annotations

import torch

from ..kernels.decode import MAX_TOKENS
from ..models.transformer import Segment
from .step_ops import between_ops, step_ops


class DecodePath:
    """What both paths do around a step; a subclass says how the step itself runs (`_step`)."""
    captures = False            # whether steps replay captured graphs (the server captures each size up front)

    def __init__(self, engine):
        self.engine = engine

    def takes(self, n_tokens: int) -> bool:
        """Whether this path runs a step of n_tokens tokens (the engine's eager path runs the others)."""
        return True

    @property
    def reports_routing(self) -> bool:
        """Whether its steps report their routing to the engine's route observers."""
        return True

    def kernels(self, n_tokens: int) -> tuple:
        """(by_address, fused) of a step of n_tokens tokens: the engine's, for steps of at most MAX_TOKENS."""
        if n_tokens > MAX_TOKENS:
            return None, None
        return self.engine.decode_kernel, self.engine.fused

    @torch.inference_mode()
    def run(self, steps: list[tuple[int, int, int]], span: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """steps = [(seq, token, position)], attending `span` keys -> (B, V) logits. tokens: the steps' tokens
        on the device instead (Engine.decode)."""
        eng, B = self.engine, len(steps)
        by_address, fused = self.kernels(B)
        host = eng.host if by_address is not None else None
        if host is None:
            return self._step(steps, span, by_address, fused, True, tokens)
        seqs = [s for s, _, _ in steps]
        host.begin_decode_step(seqs)                # the step's address table onto the device
        eng.observers.begin_ubatch(steps[0][0], B, False, seqs)
        logits = self._step(steps, span, by_address, fused, False, tokens)
        host.end_decode_step(B, eng.observers)      # the step is queued: its routing to the observers, then learn
        return logits

    def _step(self, steps, span: int, by_address, fused, observed: bool, tokens) -> torch.Tensor:
        raise NotImplementedError


class EagerDecode(DecodePath):
    """A decode step as one eager forward."""

    def _step(self, steps, span: int, by_address, fused, observed: bool, tokens) -> torch.Tensor:
        ids = [t for _, t, _ in steps] if tokens is None else tokens
        return between_ops(step_ops(self.engine, by_address), len(steps), lambda: self.engine.forward(
            [Segment(s, p, 1) for s, _, p in steps], ids, kv_len=span, by_address=by_address,
            fused=fused, observed=observed))


class GraphDecode(DecodePath):
    """A decode step as a replayed CUDA graph, captured at the first step of its (batch size, span). A graph
    reports no routing itself: with host experts the provider does (zero-copy decode, once the step is queued);
    all on the GPU, nobody does (the server then counts no decode routing)."""
    captures = True

    def __init__(self, engine):
        super().__init__(engine)
        from .graphs import DecodeGraphs
        self.graphs = DecodeGraphs(engine)

    def takes(self, n_tokens: int) -> bool:
        """Host experts: zero-copy steps only (a longer step decides on the host between layers); quantized
        experts too (a longer step dequantizes its experts, which sizes its scratch on the host)."""
        plan = self.engine.plan
        return plan.graph_all or n_tokens <= plan.max_tokens

    @property
    def reports_routing(self) -> bool:
        return self.engine.host is not None

    def _step(self, steps, span: int, by_address, fused, observed: bool, tokens) -> torch.Tensor:
        eng = self.engine
        if eng.host is not None:                    # as the eager forward tells it (the cache's clock and state)
            eng.host.begin_ubatch(steps[0][0], len(steps), False)
        segments = [Segment(s, p, 1) for s, _, p in steps]
        eng.kv.begin(segments)                      # as around an eager forward: a recurrent state's position
        logits = self.graphs.run(steps, span, by_address, fused, tokens)
        eng.kv.end(segments)
        return logits


def decode_path(engine) -> DecodePath:
    """GraphDecode where the engine's plan replays steps as CUDA graphs (DecodePlan.graphs), else EagerDecode.
    Zero-copy decode's expert kernel runs in eager steps alike."""
    return GraphDecode(engine) if engine.plan.graphs else EagerDecode(engine)
