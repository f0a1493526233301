"""The decode loop of one sequence: prefill the prompt, then sample token by token until a stop.

    for piece in Generation(engine, tokenizer, prompt_ids, params):   # text pieces as they complete
        print(piece, end="")
    gen.result                                                       # Completion

Stops: max_tokens, an end-of-sequence token (unless ignore_eos), a stop token id, a stop string (not included in
the text, as in OpenAI's API), or the end of the context (finish_reason "length").
"""
from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field

import torch

from .sampling import Sampler, SamplingParams, StopChecker


def token_hash(ids) -> str:
    """sha256 of token ids written `1,2,3`: equal hashes mean equal tokens (`generate --hash`, bench's column)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


@dataclass
class Completion:
    token_ids: list[int]
    text: str | None                 # None for a model without a tokenizer
    finish_reason: str               # "stop" or "length"
    prompt_tokens: int
    prompt_s: float = 0.0
    decode_s: float = 0.0
    timings: dict = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """The hash of the generated token ids, for comparing configurations (`generate --hash`)."""
        return token_hash(self.token_ids)


class Generation:
    """An iterator of text pieces (token ids as strings for a tokenizer-less model); `.result` at the end."""

    def __init__(self, engine, tokenizer, prompt_ids: list[int], params: SamplingParams, seq: int = 0):
        self.engine, self.tokenizer, self.prompt, self.params, self.seq = engine, tokenizer, prompt_ids, params, seq
        self.result: Completion | None = None
        engine.check_context(len(prompt_ids))

    def __iter__(self):
        eng, p, tok = self.engine, self.params, self.tokenizer
        gen = torch.Generator(device=eng.device.torch)
        gen.manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eng.cfg.eos_token_ids))
        if tok is not None and not p.ignore_eos:
            stop_ids |= set(tok.eos_ids)
        detok = tok.stream_decoder() if tok is not None else None
        stops = StopChecker(list(p.stop)) if p.stop and tok is not None else None
        sampler = Sampler()
        ids, text, reason = [], [], "length"

        eng.begin_prompt(self.seq)
        t0 = time.perf_counter()
        logits = eng.prefill(self.seq, self.prompt, 0)
        eng.synchronize()
        t1 = time.perf_counter()
        pos = len(self.prompt)
        while len(ids) < p.max_tokens:
            token = int(sampler.sample(logits[-1:], [p], [gen])[0])
            if token in stop_ids:
                reason = "stop"
                break
            ids.append(token)
            piece = detok.push(token) if detok is not None else f"{token} "
            if stops is not None:
                piece, stopped = stops.push(piece)
                if stopped:
                    text.append(piece)
                    yield piece
                    reason = "stop"
                    break
            if piece:
                text.append(piece)
                yield piece
            if len(ids) >= p.max_tokens or pos >= eng.kv.ctx:
                break
            logits = eng.decode([(self.seq, token, pos)])
            pos += 1
        if detok is not None and not (stops is not None and stops.stopped):
            rest = detok.flush()
            if stops is not None:
                rest = stops.push(rest)[0] + stops.flush()
            if rest:
                text.append(rest)
                yield rest
        eng.synchronize()
        t2 = time.perf_counter()
        self.result = Completion(ids, "".join(text) if tok is not None else None, reason, len(self.prompt),
                                 prompt_s=t1 - t0, decode_s=t2 - t1)

    def run(self) -> Completion:
        for _ in self:
            pass
        return self.result
