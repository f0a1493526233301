"""torch's CPU threads for prompts and for decode steps: llama.cpp's -tb and -t.

    threads.configure(1, 2)      # -t 1 -tb 2: decode steps on one thread, prompts on two
    threads.use("prompt")        # before a prompt forward (Generation, the server's scheduler, perplexity)
    threads.use("decode")        # before decode steps

Unconfigured, use() changes nothing: torch keeps its own default (all cores). On a small model or a loaded machine
one thread can be many times faster than the default (the tiny model: 135 against 2.4-4 tok/s on two busy cores).
The setting is torch's, so it is process-wide, as the flags are.
"""
from __future__ import annotations

import torch

_counts: dict[str, int | None] = {"decode": None, "prompt": None}


def configure(threads: int | None, threads_batch: int | None = None) -> None:
    """-t for decode (and for prompts unless -tb), -tb for prompts; None leaves a phase as it is."""
    _counts["decode"] = threads
    _counts["prompt"] = threads_batch if threads_batch is not None else threads
    use("prompt")                    # loading (and whatever comes first) runs with the prompt's count


def use(phase: str) -> None:
    n = _counts[phase]
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
