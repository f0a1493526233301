"""The decode loop of one sequence: prefill the prompt, then sample token by token until a stop.

    for piece in Generation(engine, tokenizer, prompt_ids, params):   # text pieces as they complete
        print(piece, end="")
    gen.result                                                       # Completion

Stops: max_tokens, an end-of-sequence token (unless ignore_eos), a stop token id, a stop string (not included in
the text, as in OpenAI's API), or the end of the context (finish_reason "length"): sequence.py's rules, which the
server's scheduler follows too.
"""
from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field

import torch

from . import threads
from .sampling import Sampler, SamplingParams
from .sequence import SequenceState
from .speculate import MTPDecode


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
        seq = SequenceState(p, tok, eng.cfg.eos_token_ids, len(self.prompt), eng.kv.ctx)
        sampler = Sampler()

        # --spec-type draft-mtp: the MTP head drafts, the trunk verifies (runtime/speculate.py); not under penalties,
        # which read each token's history on the host
        spec = eng.ecfg.spec
        n_max = eng.draft_n_max if spec.drafts else 0        # (the engine's choice: its placement and cache)
        self.spec = MTPDecode(eng, self.seq, n_max) if n_max and not p.penalized else None
        eng.begin_prompt(self.seq)
        threads.use("prompt")
        t0 = time.perf_counter()
        logits = self.spec.prefill(self.prompt) if self.spec else eng.prefill(self.seq, self.prompt, 0)
        eng.synchronize()
        t1 = time.perf_counter()
        threads.use("decode")
        done = p.max_tokens == 0
        if self.spec is not None and not done:
            yield from self._speculate(seq, logits, sampler, gen)
            done = True
        while not done:
            history = [self.prompt + seq.ids] if p.penalized else None
            sampled = sampler.sample(logits[-1:], [p], [gen], history)               # (1,) on the device
            # The step that feeds it is queued before it is read back, so the device does not wait for the host
            # between steps; if it turns out to be a stop, that step's logits are dropped. Not where its push
            # ends the sequence whatever it is (length), nor under penalties (they read it on the host).
            ahead = None
            if not p.penalized and seq.goes_on_unless_stopped():
                ahead = eng.decode([(self.seq, 0, seq.pos + 1)], tokens=sampled)
            token = int(sampled[0])
            piece, done = seq.push(token)
            if piece or isinstance(seq.stop_reason, str):   # a stop string's piece comes even when it is empty
                yield piece
            if not done:
                logits = ahead if ahead is not None else eng.decode([(self.seq, token, seq.pos)])
        # Generation's reason is the one the tokens gave: a stop string that only the final flush completes cuts
        # the text but leaves "length" here (the server's Result says "stop").
        reason = seq.finish_reason or "length"
        rest = seq.finish()
        if rest:
            yield rest
        eng.synchronize()
        t2 = time.perf_counter()
        self.result = Completion(seq.ids, seq.text if tok is not None else None, reason, len(self.prompt),
                                 prompt_s=t1 - t0, decode_s=t2 - t1,
                                 timings={"spec": self.spec.counts.summary()} if self.spec else {})

    def _speculate(self, seq: SequenceState, logits, sampler: Sampler, gen):
        """The decode loop with drafts: each step commits the tokens the target accepted and one of its own."""
        token = int(sampler.sample(logits[-1:], [self.params], [gen])[0])
        new = [token]
        while True:
            for t in new:
                piece, done = seq.push(t)
                if piece or isinstance(seq.stop_reason, str):
                    yield piece
                if done:
                    return
            new = self.spec.step(token, self.params, gen)
            token = new[-1]

    def run(self) -> Completion:
        for _ in self:
            pass
        return self.result
