"""Routing statistics and the prompt-path prefetch rules (docs/ARCHITECTURE.md, "The prompt path").

    stats = RoutingStats(n_layers, n_experts)          # one per context: RoutingStore.prompts (routing.py)
    stats.begin_prompt()                               # the current prompt becomes the previous one
    rule = choose_seed(n_tokens=4096, stats, cfg)      # which statistics predict this ubatch, or None
    experts = predicted(rule.counts[layer])            # the next layer's experts, most-routed first

Plain data: counts are (layers x experts) int64 arrays, no device, savable with numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np



class RoutingStats:
    """Expert counts per layer: the current prompt so far, its last ubatch, the previous prompt, and the last
    ubatch's last tokens (prompt.TAIL: the decode hot set's seed)."""

    def __init__(self, n_layers: int, n_experts: int):
        self.current = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.previous = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.last_ubatch = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.tail = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.ubatches = 0               # prompt ubatches seen in the current prompt
        self.last_ubatch_tokens = 0

    def begin_prompt(self) -> None:
        if self.current.any():
            self.previous = self.current.copy()
        self.current[:] = 0
        self.last_ubatch[:] = 0
        self.tail[:] = 0
        self.ubatches = 0
        self.last_ubatch_tokens = 0

    def begin_ubatch(self, n_tokens: int) -> None:
        """A prompt ubatch starts (call after choose_seed, which reads the previous ubatch's counts)."""
        self.ubatches += 1
        self.last_ubatch_tokens = n_tokens
        self.last_ubatch[:] = 0

    def record(self, layer: int, counts: np.ndarray) -> None:
        """counts: (E,) how many of one prompt ubatch's tokens routed to each expert in `layer`."""
        self.current[layer] += counts
        self.last_ubatch[layer] += counts

    def save(self, path: str) -> None:
        np.savez(path, current=self.current, previous=self.previous)

    @staticmethod
    def load(path: str) -> "RoutingStats":
        z = np.load(path)
        s = RoutingStats(*z["current"].shape)
        s.current, s.previous = z["current"], z["previous"]
        return s


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool = True
    min_batch: int = 256            # rule 1: a ubatch of at least this many tokens prefetches
    seed_previous: bool = True      # rule 2: the first big chunk of a prompt seeds from the previous prompt
    first_chunk_all: bool = False   # rule 2's option: copy every expert of the next layer instead
    lookahead: bool = True          # decode: the next layer's router on the current hidden state
    prompt_lookahead: bool = True   # the same for prompt ubatches of >= min_batch tokens (their routed set)
    lookahead_layers: int = 2       # ... guessing this many layers ahead: the next at once, the rest whenever the
                                    # copy stream runs short of work (PromptPath._fill)
    max_inflight_mib: int = 512     # speculative bytes on the copy stream at once (demand misses go first)
    min_use: float = 0.0            # copy ahead only experts the ubatch routes with at least this probability


# A speculative verify step's first host MoE layers, whose experts its drafts guess (the MTP head's MoE input through
# their routers: Engine.head_step) and the cache copies ahead from the step's start (Seed "draft").
DRAFT_SEED_LAYERS = 2


@dataclass
class Seed:
    rule: str                       # "first-chunk", "own-prompt", "tail", "all", "draft"
    counts: np.ndarray | None       # (L, E) counts that rank the experts to copy ahead; None with rule "all"


def choose_seed(n_tokens: int, is_prompt: bool, stats: RoutingStats, cfg: PrefetchConfig) -> Seed | None:
    """Which statistics predict the experts of the ubatch about to run (None: demand misses only). Call before
    stats.begin_ubatch for that ubatch.

    1. a ubatch shorter than min_batch leaves many experts unrouted and has little compute to hide copies: no
       prefetch, except
    4. a small tail after big ubatches of the same prompt, which reads the routing of the big ubatch before it;
    2. a ubatch of >= 4 x min_batch with no routing of its own prompt yet (the first big chunk) seeds from the
       previous prompt's routing (or copies every expert, as an option);
    3. later chunks of the same prompt seed from their own prompt's routing so far.
    """
    if not cfg.enabled or not is_prompt:
        return None
    own = stats.ubatches > 0 and stats.current.any()
    if n_tokens < cfg.min_batch:
        if own and stats.last_ubatch_tokens >= cfg.min_batch:
            return Seed("tail", stats.last_ubatch.copy())
        return None
    if own:
        return Seed("own-prompt", stats.current.copy())
    if n_tokens >= 4 * cfg.min_batch:
        if cfg.first_chunk_all:
            return Seed("all", None)
        if cfg.seed_previous and stats.previous.any():
            return Seed("first-chunk", stats.previous.copy())
    return None


def predicted(counts_row: np.ndarray | None, n_experts: int, n_routings: int = 0, min_use: float = 0.0) -> np.ndarray:
    """A layer's experts to copy ahead, most-routed first (every expert for the "all" rule).

    With `min_use`, only experts the coming ubatch is likely to route: an expert with share p of the seed's
    routings is routed at least once among the ubatch's n_routings (tokens x k) with probability about
    1 - exp(-n_routings p). Copying ahead an expert the ubatch then does not route wastes the link and evicts a
    resident expert that may be needed.
    """
    if counts_row is None:
        return np.arange(n_experts, dtype=np.int64)
    nz = np.flatnonzero(counts_row)
    if min_use > 0 and n_routings > 0:
        use = 1.0 - np.exp(-n_routings * counts_row[nz] / counts_row.sum())
        nz = nz[use >= min_use]
    return nz[np.argsort(-counts_row[nz], kind="stable")].astype(np.int64)
