"""One sequence's state (runtime/sequence.py): stop tokens and strings, max_tokens, the context's end, the flush."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from moestream.runtime.generate import Generation
from moestream.runtime.sampling import SamplingParams
from moestream.runtime.sequence import SequenceState

# A byte-level vocabulary: token 5 ends inside "é" (0xc3 0xa9), whose second byte is token 6.
VOCAB = [b"<eos>", b"Hel", b"lo <E", b"N", b"D> x", b"b\xc3", b"\xa9", b"a"]


class Decoder:
    """Like StreamDecoder: text ending in an incomplete character is held back until a token completes it."""

    def __init__(self):
        self.buf, self.out = b"", 0

    def push(self, token: int) -> str:
        self.buf += VOCAB[token]
        text = self.buf.decode(errors="replace")
        if text.endswith("\ufffd"):
            return ""
        new, self.out = text[self.out:], len(text)
        return new

    def flush(self) -> str:
        text = self.buf.decode(errors="replace")
        new, self.out = text[self.out:], len(text)
        return new


class Tokenizer:
    eos_ids = (0,)

    def stream_decoder(self):
        return Decoder()


def state(n_prompt=3, ctx=64, eos_ids=(), tokenizer=Tokenizer(), **params) -> SequenceState:
    return SequenceState(SamplingParams(**params), tokenizer, eos_ids, n_prompt, ctx)


def test_a_stop_string_split_across_tokens():
    s = state(max_tokens=16, stop=["<END>"])
    assert s.push(1) == ("Hel", False)
    assert s.push(2) == ("lo ", False)                  # "<E" could start "<END>": held back
    assert s.push(3) == ("", False)
    assert s.push(4) == ("", True)                      # the stop string and what follows it are cut
    assert (s.finish_reason, s.stop_reason, s.text, s.ids) == ("stop", "<END>", "Hello ", [1, 2, 3, 4])
    assert s.finish() == "" and s.finish_reason == "stop"


def test_a_stop_token_ends_the_sequence_and_is_not_part_of_it():
    s = state(max_tokens=16, stop_token_ids=(3,))
    assert s.push(1) == ("Hel", False)
    assert s.push(3) == ("", True)
    assert (s.finish_reason, s.stop_reason, s.ids, s.text) == ("stop", 3, [1], "Hel")


def test_eos_of_the_model_and_of_the_tokenizer_unless_ignore_eos():
    for eos in (0, 7):                                  # the tokenizer's, the model's
        s = state(max_tokens=16, eos_ids=(7,))
        assert s.push(1) == ("Hel", False) and s.push(eos) == ("", True) and s.stop_reason == eos
    s = state(max_tokens=16, eos_ids=(7,), ignore_eos=True)
    assert s.push(0) == ("<eos>", False) and s.push(7) == ("a", False) and not s.done
    assert s.ids == [0, 7]
    s = state(max_tokens=16, ignore_eos=True, stop_token_ids=(0,))     # stop_token_ids still stop
    assert s.push(0) == ("", True) and s.stop_reason == 0


def test_max_tokens_and_the_end_of_the_context_give_length():
    s = state(max_tokens=2)
    assert s.push(1) == ("Hel", False) and s.push(7) == ("a", True)
    assert (s.finish_reason, s.stop_reason) == ("length", None)
    s = state(max_tokens=16, n_prompt=3, ctx=4)         # positions 0..3: the second token has none to run at
    assert s.push(1) == ("Hel", False) and s.pos == 3
    assert s.push(7) == ("a", True) and s.pos == 4 and s.finish_reason == "length"
    s = state(max_tokens=0)                             # ends before any token
    assert s.finish() == "" and s.finish_reason == "length" and s.ids == []


def test_finish_flushes_held_text_and_finds_a_stop_string_at_the_very_end():
    s = state(max_tokens=2, stop=["abz"])
    assert s.push(7) == ("", False)                     # "a" could start "abz"
    assert s.push(5) == ("", True)                      # "b" and half of "é": held by the detokenizer
    assert s.finish() == "ab\ufffd" and s.finish_reason == "length" and s.text == "ab\ufffd"
    s = state(max_tokens=2, stop=["ab"])
    s.push(7), s.push(5)
    assert s.finish() == "" and (s.finish_reason, s.stop_reason, s.text) == ("stop", "ab", "")
    s = state(max_tokens=3, stop=["ab"])
    s.push(7), s.push(5)
    assert s.push(6) == ("", True)                      # "é" completes the held text: the stop is found in push
    assert (s.finish_reason, s.stop_reason, s.text) == ("stop", "ab", "")


def test_without_a_tokenizer_pieces_are_ids_and_stop_strings_are_ignored():
    s = state(max_tokens=3, tokenizer=None, eos_ids=(9,), stop=["1"])
    assert s.push(1) == ("1 ", False) and s.push(2) == ("2 ", False)
    assert s.push(9) == ("", True) and s.text == "1 2 " and s.finish() == ""


class ScriptedEngine:
    """Greedy decoding picks the scripted tokens in turn."""

    def __init__(self, script, ctx=64):
        self.script = list(script)
        self.device, self.cfg = SimpleNamespace(torch="cpu"), SimpleNamespace(eos_token_ids=())
        self.kv = SimpleNamespace(ctx=ctx)
        self.ecfg = SimpleNamespace(spec=SimpleNamespace(drafts=False))      # no MTP drafts
        self.fed = []

    def check_context(self, n): pass
    def begin_prompt(self, seq): pass
    def synchronize(self): pass

    def _next(self):
        logits = torch.zeros(1, len(VOCAB))
        logits[0, self.script.pop(0)] = 1.0
        return logits

    def prefill(self, seq, tokens, start):
        return self._next()

    def decode(self, steps, tokens=None):      # tokens: the sampled token, still on the device
        self.fed.append(steps[0][1:] if tokens is None else (int(tokens[0]), steps[0][2]))
        return self._next()


def test_generation_follows_the_state_and_keeps_its_pieces():
    eng = ScriptedEngine([1, 2, 3, 4, 7])
    gen = Generation(eng, Tokenizer(), [7, 7, 7], SamplingParams(max_tokens=16, stop=("<END>",)))
    assert list(gen) == ["Hel", "lo ", ""]              # the piece a stop string ends comes even when empty
    assert (gen.result.text, gen.result.finish_reason, gen.result.token_ids) == ("Hello ", "stop", [1, 2, 3, 4])
    # (token, position): each step is queued before its token is read back, so the stopping token's step runs too
    # (its logits are dropped)
    assert eng.fed == [(1, 3), (2, 4), (3, 5), (4, 6)]
    # ... but not where the token's push ends the sequence whatever it is: max_tokens, then the context's end
    eng = ScriptedEngine([1, 2, 3])
    assert Generation(eng, Tokenizer(), [7], SamplingParams(max_tokens=3)).run().token_ids == [1, 2, 3]
    assert eng.fed == [(1, 1), (2, 2)]
    eng = ScriptedEngine([1, 2, 3], ctx=3)
    assert Generation(eng, Tokenizer(), [7], SamplingParams(max_tokens=9)).run().finish_reason == "length"
    assert eng.fed == [(1, 1), (2, 2)]
    # Penalties read each token on the host first: nothing runs ahead, the stopping token is never run
    eng = ScriptedEngine([1, 2, 3, 4, 7])
    gen = Generation(eng, Tokenizer(), [7, 7, 7], SamplingParams(max_tokens=16, stop=("<END>",), repeat_penalty=1.1))
    assert gen.run().token_ids == [1, 2, 3, 4] and eng.fed == [(1, 3), (2, 4), (3, 5)]
    # A stop string that only the final flush completes cuts the text; Generation's reason stays "length".
    gen = Generation(ScriptedEngine([7, 5]), Tokenizer(), [7], SamplingParams(max_tokens=2, stop=("ab",)))
    assert list(gen) == [] and (gen.result.text, gen.result.finish_reason) == ("", "length")
    gen = Generation(ScriptedEngine([1, 7]), Tokenizer(), [7], SamplingParams(max_tokens=0))
    assert list(gen) == [] and (gen.result.token_ids, gen.result.finish_reason) == ([], "length")
