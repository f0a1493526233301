"""One sequence's generation state: its tokens, when it stops, and its text as it completes.

    seq = SequenceState(params, tokenizer, eos_ids=cfg.eos_token_ids, n_prompt=len(prompt_ids), ctx=kv.ctx)
    piece, done = seq.push(token)        # a sampled token -> the text it completes now ("" while held back)
    ...                                  # not done: feed `token` at position seq.pos and sample the next one
    rest = seq.finish()                  # once done: the held-back text, flushed
    seq.ids, seq.text, seq.finish_reason, seq.stop_reason

The rules, the same for `LLM.generate` (runtime/generate.py) and the serving loop (runtime/serving.py):
- a stop token ends the sequence and is not part of it: the eos ids of the model and of its tokenizer (unless
  ignore_eos) and params.stop_token_ids. finish_reason "stop", stop_reason the token id;
- a stop string ends it where it completes, the string itself not included (as in OpenAI's API): finish_reason
  "stop", stop_reason the string. Text that could be the start of one is held back until it cannot;
- max_tokens, or the end of the context (the next token would have no position), ends it: finish_reason "length";
- a model without a tokenizer has no text: each token's piece is its id and a space, and stop strings are ignored.
"""
from __future__ import annotations

from .sampling import SamplingParams, StopChecker


class SequenceState:
    def __init__(self, params: SamplingParams, tokenizer, eos_ids, n_prompt: int, ctx: int):
        self.params, self.n_prompt, self.ctx = params, n_prompt, ctx
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if tokenizer is not None and not params.ignore_eos:
            self.stop_ids |= set(tokenizer.eos_ids)
        self.detok = tokenizer.stream_decoder() if tokenizer is not None else None
        self.stops = StopChecker(params.stop) if params.stop and tokenizer is not None else None
        self.ids: list[int] = []              # the generated tokens, stop tokens excluded
        self.finish_reason: str | None = None  # None while generating; then "stop" or "length"
        self.stop_reason: str | int | None = None   # the stop string or stop token id that ended it
        self._text: list[str] = []            # the pieces returned so far

    @property
    def pos(self) -> int:
        """The position of the next token to feed: the last one generated."""
        return self.n_prompt + len(self.ids) - 1

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> tuple[str, bool]:
        """A sampled token -> (the text it completes, to show now; whether the sequence has ended). Once it has
        ended, finish_reason and stop_reason say why and finish() returns the rest of the text."""
        if token in self.stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
            return "", True
        self.ids.append(token)
        piece = self.detok.push(token) if self.detok is not None else f"{token} "
        if self.stops is not None:
            piece, stopped = self.stops.push(piece)
            if stopped:
                self.finish_reason, self.stop_reason = "stop", self.stops.matched
                return self._piece(piece), True
        self._piece(piece)
        if len(self.ids) >= self.params.max_tokens or self.pos >= self.ctx:
            self.finish_reason = "length"
        return piece, self.done

    def goes_on_unless_stopped(self) -> bool:
        """Whether the next token, unless it is a stop, leaves the sequence going: push would not end it by length
        (generate.py queues that token's step before reading it)."""
        return len(self.ids) + 1 < self.params.max_tokens and self.pos + 1 < self.ctx

    def finish(self, reason: str = "length") -> str:
        """End the sequence: the text the detokenizer and the stop checker still hold ("" if none). The finish
        reason stays push's; `reason` is for a sequence push did not end (max_tokens 0 ends one before any token).
        A stop string that the flushed text completes cuts it there and makes the reason "stop"."""
        if self.finish_reason is None:
            self.finish_reason = reason
        if self.detok is None or (self.stops is not None and self.stops.stopped):
            return ""
        rest = self.detok.flush()
        if self.stops is not None:
            rest, stopped = self.stops.push(rest)
            rest += self.stops.flush()
            if stopped:
                self.finish_reason, self.stop_reason = "stop", self.stops.matched
        return self._piece(rest)

    def _piece(self, piece: str) -> str:
        if piece:
            self._text.append(piece)
        return piece
