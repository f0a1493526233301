"""The host provider's device ops around a zero-copy decode step, shared by the eager path (runtime/decode.py) and
the captured one (runtime/graphs.py, which records them inside the graph).

    out = between_ops(step_ops(engine, by_address), n_tokens, lambda: engine.model.forward(...))
"""
from __future__ import annotations


def step_ops(engine, by_address) -> tuple | None:
    """The host provider's device ops around a zero-copy step (ExpertProvider.decode_step_ops), or None."""
    return engine.host.decode_step_ops() if engine.host is not None and by_address is not None else None


def between_ops(ops, n_tokens: int, forward):
    """forward() between the step ops' first and last (step_ops; None: forward() alone)."""
    if ops is not None:
        ops[0]()
    out = forward()
    if ops is not None:
        ops[1](n_tokens)
    return out
