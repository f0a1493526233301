"""The harmony format's channels (gpt-oss): the analysis channel is the answer's `reasoning_content`, the final
channel (and any other) its `content`, as llama-server and vLLM return them.

    split("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi.")
    # ("Think.", "Hi.")
    s = HarmonySplit()
    s.feed("<|channel|>analysis<|message|>Th")      # [("reasoning_content", "Th")]
    s.finish()                                       # what was held back, at the end of the text

A model writes a message as `<|start|>ROLE<|channel|>NAME [to=...] [<|constrain|>...]<|message|>TEXT<|end|>`
(its first one without `<|start|>ROLE`: the chat template's generation prompt wrote it); `<|return|>` and `<|call|>`
end the last one. The markers are special tokens, which the streamed text keeps: a marker split over two pieces
is held back until it is whole. Text outside any message is content.
"""
from __future__ import annotations

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
REASONING, CONTENT = "reasoning_content", "content"


def is_harmony(tokenizer) -> bool:
    """Whether a model's chat template writes harmony (gpt-oss's)."""
    return tokenizer is not None and "<|channel|>" in (getattr(tokenizer, "chat_template", None) or "")


class HarmonySplit:
    """A stream of harmony text cut into (field, text) pieces: REASONING for the analysis channel, CONTENT else."""

    def __init__(self):
        self.buf = ""
        self.in_header = False       # between <|start|> / <|channel|> and <|message|>: the header's words
        self.header = ""             # the channel's name and options, as far as read
        self.channel = None          # the current message's channel (None: outside any message)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            at = self.buf.find("<|")
            if at < 0:
                keep = self.buf.endswith("<")             # perhaps a marker's start
                self._text(self.buf[:-1] if keep else self.buf, out)
                self.buf = "<" if keep else ""
                break
            self._text(self.buf[:at], out)
            self.buf = self.buf[at:]
            marker = next((m for m in MARKERS if self.buf.startswith(m)), None)
            if marker is None:
                if any(m.startswith(self.buf) for m in MARKERS):
                    break                                   # part of a marker: wait for the rest
                self._text("<|", out)                       # not a marker: text
                self.buf = self.buf[2:]
                continue
            self.buf = self.buf[len(marker):]
            self._marker(marker)
        return _merged(out)

    def finish(self) -> list[tuple[str, str]]:
        """What was held back (a marker's start that the text ended in), as text."""
        out: list[tuple[str, str]] = []
        self._text(self.buf, out)
        self.buf = ""
        return _merged(out)

    def _marker(self, marker: str) -> None:
        if marker in ("<|start|>", "<|channel|>"):
            self.in_header, self.header = True, ""          # the role's name, then the channel's
        elif marker == "<|message|>":
            self.in_header = False
            self.channel = (self.header.split() or [self.channel or "final"])[0]
        elif marker in ("<|end|>", "<|return|>", "<|call|>"):
            self.in_header, self.channel = False, None
        # <|constrain|>: part of the header

    def _text(self, text: str, out: list) -> None:
        if not text:
            return
        if self.in_header:
            self.header += text
        else:
            out.append((REASONING if self.channel == "analysis" else CONTENT, text))


def _merged(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for field, text in pieces:
        if out and out[-1][0] == field:
            out[-1] = (field, out[-1][1] + text)
        else:
            out.append((field, text))
    return out


def split(text: str) -> tuple[str, str]:
    """A whole answer's (reasoning_content, content)."""
    s = HarmonySplit()
    parts = s.feed(text) + s.finish()
    return ("".join(t for f, t in parts if f == REASONING), "".join(t for f, t in parts if f == CONTENT))
