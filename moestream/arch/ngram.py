"""The PLE n-gram hash's constants (Qwen3.8-Flash-Next, models/ple.py), from the config alone, as transformers'
Qwen4ExpTextNGramEmbedding derives them: what the table's shape (arch/names.py) and the hash both need.

    mult, sizes = ngram_constants(cfg)        # ngram_size odd multipliers; one prime row count per hash head
    rows = table_rows(cfg)                    # the table's rows: the heads' sum, padded
"""
from __future__ import annotations

import math

from ..config import ModelConfig

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ngram_constants(cfg: ModelConfig, index: int = 0) -> tuple[list[int], list[int]]:
    """PLE layer `index`'s (the first: 0) hash multipliers (odd, from splitmix64 of the seed) and its heads' row
    counts: consecutive primes above ngram_vocab_base, the layers' heads one after the other."""
    half = max(1, ((1 << 63) - 1) // max(cfg.vocab_size, 1) // 2)
    seed = cfg.ngram_seed + 10007 * index
    mult = [2 * (_splitmix64((seed + _GAMMA * (j + 1)) & _MASK64) % half) + 1 for j in range(cfg.ngram_size)]
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    sizes, p = [], cfg.ngram_vocab_base - 1
    while len(sizes) < heads * (index + 1):
        p += 1
        while not _is_prime(p):
            p += 1
        sizes.append(p)
    return mult, sizes[heads * index:]


def table_rows(cfg: ModelConfig, index: int = 0) -> int:
    """The n-gram table's rows: every head's, padded to a multiple of ngram_vocab_divisor."""
    return -(-sum(ngram_constants(cfg, index)[1]) // cfg.ngram_vocab_divisor) * cfg.ngram_vocab_divisor
