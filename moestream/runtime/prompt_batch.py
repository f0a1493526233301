"""Prompt batches of several sequences, as llama-server and llama-batched-bench form them.

    parts = next_batch([(seq, prompt, done), ...], ubatch=512, budget=2048)   # oldest prompt first
    logits = engine.prefill_parts(parts)                 # (1, V) each part's last token's
    ends = reached(parts)                                # {seq: how far its prompt got}

A batch takes up to `budget` (-b) tokens of the prompts being read, oldest first, each cut into ubatches of -ub
from where its sequence stands; a prompt that does not fit waits for the next batch. With host experts the engine
runs a batch layer by layer, so a layer's experts cross the link once for all its prompts.
"""
from __future__ import annotations

from ..errors import UserError
from ..models.transformer import Segment


def next_batch(prompts: list[tuple[int, list[int], int]], ubatch: int, budget: int) -> list[tuple[int, int, list[int]]]:
    """prompts: (seq, tokens, done) of each prompt being read, oldest first (done: its tokens already in the
    sequence's cache) -> the next batch's parts (seq, start, tokens): at most `budget` tokens, at least one part."""
    parts, total = [], 0
    for seq, tokens, at in prompts:
        while at < len(tokens) and (not parts or total + min(ubatch, len(tokens) - at) <= budget):
            chunk = tokens[at:at + ubatch]
            parts.append((seq, at, chunk))
            at, total = at + len(chunk), total + len(chunk)
        if at < len(tokens):
            break                               # the budget is spent: later prompts wait for the next batch
    return parts


def reached(parts: list[tuple[int, int, list[int]]]) -> dict[int, tuple[int, int]]:
    """Each sequence of a batch: (how far its prompt got, the index of its last part)."""
    return {seq: (start + len(tokens), i) for i, (seq, start, tokens) in enumerate(parts)}


def segments_of(parts: list[tuple[int, int, list[int]]], ubatch: int) -> list[Segment]:
    """Each sequence's parts as one segment (what its cache and recurrent state see of the batch), in order of
    first appearance; a one-line UserError for an empty part, one longer than `ubatch`, or a sequence's parts out
    of order."""
    whole: dict[int, Segment] = {}
    for seq, start, tokens in parts:
        if not tokens:
            raise UserError(f"an empty prompt part for sequence {seq}: give at least one token")
        if len(tokens) > ubatch:
            raise UserError(f"a prompt part of {len(tokens)} tokens is longer than -ub {ubatch}")
        if seq not in whole:
            whole[seq] = Segment(seq, start, len(tokens))
        elif start != whole[seq].start + whole[seq].n:
            raise UserError(f"sequence {seq}'s prompt parts are not consecutive: one at {start} after "
                            f"{whole[seq].start + whole[seq].n}")
        else:
            whole[seq].n += len(tokens)
    return list(whole.values())
