"""OpenAI's response shapes, built from the scheduler's events: whole responses and server-sent-event chunks.

    out = Formatter("chat", "model-name", tokenizer, body, prompts)
    for ev in events:                              # ("token", index, piece, logprobs) / ("done", index, Result)
        chunks = out.event(ev)                     # stream: the chunks to send now
    out.response()                                 # not streamed: the whole response, once every choice is done

kind "text" is /v1/completions (object text_completion), "chat" is /v1/chat/completions. harmony (gpt-oss's chat
template): a chat answer's analysis channel is its reasoning_content, the rest its content (server/harmony.py).
"""
from __future__ import annotations

import json
import time
import uuid

from .harmony import HarmonySplit, split


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def detok(tokenizer, ids: list[int]) -> str:
    """Text of ids; a model without a tokenizer shows ids as the CLI does ("1 2 3 ")."""
    return tokenizer.decode(ids) if tokenizer is not None else "".join(f"{i} " for i in ids)


def logprobs_wanted(body, kind: str) -> int | None:
    """None: no logprobs; n: the chosen token's logprob and the top n."""
    if kind == "text":
        return body.logprobs
    return (body.top_logprobs or 0) if body.logprobs else None


class Formatter:
    def __init__(self, kind: str, model: str, tokenizer, body, prompts: list[list[int]], echo: list[str] | None = None,
                 harmony: bool = False):
        self.kind, self.model, self.tok, self.body = kind, model, tokenizer, body
        self.prompts, self.echo = prompts, echo
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.n_choices = len(prompts) * body.n
        self.results: dict[int, object] = {}
        self.offsets = [len(echo[i // body.n]) if echo else 0 for i in range(self.n_choices)]
        self.include_usage = body.include_usage
        self.want_logprobs = logprobs_wanted(body, kind) is not None
        self.harmony = harmony and kind == "chat"
        self.splits = [HarmonySplit() for _ in range(self.n_choices)] if self.harmony else None

    # --- streaming --------------------------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        """The chunks that open a stream: chat's role, or completions' echoed prompts."""
        if self.kind == "chat":
            return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n_choices)]
        if self.echo:
            return [self._chunk(i, self.echo[i // self.body.n]) for i in range(self.n_choices)]
        return []

    def event(self, ev) -> list[dict]:
        if ev[0] == "token":
            _, i, piece, lps = ev
            logprobs = self._logprobs(i, lps) if self.want_logprobs else None
            if self.harmony:
                return self._channels(i, self.splits[i].feed(piece), logprobs)
            content = {"content": piece} if self.kind == "chat" else piece
            return [self._chunk(i, content, logprobs=logprobs)]
        _, i, res = ev
        self.results[i] = res
        held = self._channels(i, self.splits[i].finish(), None) if self.harmony else []
        return held + [self._chunk(i, {} if self.kind == "chat" else "", finish=res)]

    def _channels(self, i: int, pieces: list[tuple[str, str]], logprobs) -> list[dict]:
        """A harmony piece's chunks: one a channel it wrote in (reasoning_content or content); a piece that was
        all markers writes none (but carries its logprobs in an empty content delta, where they are wanted)."""
        if not pieces:
            return [self._chunk(i, {"content": ""}, logprobs=logprobs)] if logprobs is not None else []
        return [self._chunk(i, {field: text}, logprobs=logprobs if j == 0 else None)
                for j, (field, text) in enumerate(pieces)]

    def _chunk(self, i: int, content, logprobs=None, finish=None) -> dict:
        choice = {"index": i, "delta" if self.kind == "chat" else "text": content, "logprobs": logprobs,
                  "finish_reason": finish.finish_reason if finish is not None else None}
        if finish is not None:
            choice["stop_reason"] = finish.stop_reason
        out = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict:
        out = self._chunk(0, "")
        out["choices"], out["usage"] = [], self.usage()
        return out

    # --- whole responses --------------------------------------------------------------------------------------------
    def response(self) -> dict:
        choices = []
        for i in range(self.n_choices):
            r = self.results[i]
            lps = self._logprobs(i, r.logprobs) if self.want_logprobs else None
            c = {"index": i, "logprobs": lps, "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
            if self.harmony:
                reasoning, content = split(r.text)
                c["message"] = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
            elif self.kind == "chat":
                c["message"] = {"role": "assistant", "content": r.text}
            else:
                c["text"] = (self.echo[i // self.body.n] if self.echo else "") + r.text
            if self.body.return_token_ids:
                c["token_ids"], c["prompt_token_ids"] = r.token_ids, self.prompts[i // self.body.n]
            choices.append(c)
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:
        n = self.body.n
        prompt = sum(len(p) for p in self.prompts)
        done = self.results.values()
        completion = sum(len(r.token_ids) for r in done)
        cached = sum(max((self.results[p * n + j].cached_tokens for j in range(n) if p * n + j in self.results),
                         default=0) for p in range(len(self.prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # --- logprobs ---------------------------------------------------------------------------------------------------
    def _piece(self, token: int) -> str:
        return self.tok.token_to_piece(token) if self.tok is not None else f"{token} "

    def _logprobs(self, i: int, entries) -> dict:
        if self.kind == "chat":
            return {"content": [{**self._tok_lp(t, lp), "top_logprobs": [self._tok_lp(a, b) for a, b in top]}
                                for t, lp, top in entries]}
        tokens, offsets = [], []
        for t, _, _ in entries:
            tokens.append(self._piece(t))
            offsets.append(self.offsets[i])
            self.offsets[i] += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self._piece(a): b for a, b in top} for _, _, top in entries],
                "text_offset": offsets}

    def _tok_lp(self, token: int, lp: float) -> dict:
        piece = self._piece(token)
        # A piece holding part of a UTF-8 character decodes to U+FFFD: its bytes are unknown here, so null.
        return {"token": piece, "logprob": lp, "bytes": None if "\ufffd" in piece else list(piece.encode())}
