"""A shared test driver: three sequences of one engine decoding together, greedy, step by step."""
from __future__ import annotations


def decode_three(eng, n_steps: int = 6) -> list:
    """Prefill three sequences (prompts of 20, 22 and 24 ids), then n_steps decode steps of all three at once, each
    step's tokens the argmax of the last: each step's (3, V) logits."""
    for s in range(3):
        eng.prefill(s, list(range(5 + s, 25 + 2 * s)))
    toks, outs = [(0, 7, 20), (1, 9, 22), (2, 3, 24)], []
    for _ in range(n_steps):
        lg = eng.decode(toks)
        outs.append(lg.clone())
        toks = [(s, int(lg[i].argmax()), p + 1) for i, (s, _, p) in enumerate(toks)]
    return outs
