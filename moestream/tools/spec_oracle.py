"""`bench --spec-oracle P`: drafts that are right with a known probability, to measure speculation's speed at a
given acceptance on random weights (whose own MTP head accepts almost nothing). A benchmark tool only: the verify
step, the rollback and the expert traffic it drives are the real ones (runtime/speculate.py).

    first = greedy continuation of the prompt (a pass without drafts)
    oracle = Oracle(len(prompt), first, p=0.8, vocab=V, seed=0)
    drafts = oracle(position, n)        # the tokens first holds at position.., each replaced by another w.p. 1 - p
"""
from __future__ import annotations

import random


class Oracle:
    def __init__(self, prompt_len: int, continuation: list[int], p: float, vocab: int, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--spec-oracle takes a probability in [0, 1], got {p}")
        self.start, self.tokens, self.p, self.vocab = prompt_len, list(continuation), p, vocab
        self.rng = random.Random(seed)

    def __call__(self, position: int, n: int) -> list[int]:
        """n drafts for positions position ..: the continuation's tokens, each wrong with probability 1 - p (a
        position past the continuation is always wrong)."""
        out = []
        for pos in range(position, position + n):
            k = pos - self.start
            right = self.tokens[k] if 0 <= k < len(self.tokens) else None
            if right is not None and self.rng.random() < self.p:
                out.append(right)
            else:               # any other token (the right one + 1..V-1, mod V)
                out.append(((right or 0) + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
        return out
