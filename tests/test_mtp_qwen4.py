"""Speculative decoding's rollback on Qwen3.8-Flash-Next's cache (runtime/kv_cache.py's Qwen4Cache): besides the
DeltaNet states, the n-gram context and the PLE layer's conv rows a verify step wrote past its accepted position are
undone from what the step kept, float32 on the CPU (tiny-flash-next: QSA budget 16 in blocks of 4, so a verify step
from position 14 crosses a block's end and the budget).

Bounds: the n-gram context equal; the PLE conv rows, DeltaNet conv windows and recurrent states within 1e-5 of a
plain prefill of the accepted tokens (the verify step runs the recurrent rule a token at a time, a prompt the chunked
one); the next step's logits within 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from moestream import LLM, UserError
from moestream.models.transformer import Segment

KW = dict(device="cpu", ctx_size=64)


def test_a_rollback_at_every_position_equals_a_prefill_of_the_accepted_tokens():
    eng = LLM("synth:tiny-flash-next", n_seq=2, **KW).engine
    kv = eng.kv
    g = torch.Generator().manual_seed(3)
    prompt, verify = torch.randint(0, 500, (14,), generator=g).tolist(), torch.randint(0, 500, (4,), generator=g).tolist()
    for j in range(4):
        eng.prefill(0, prompt)
        eng.forward([Segment(0, len(prompt), 4)], verify, all_logits=True, is_prompt=True, keep_states=True)
        kv.rollback(0, len(prompt) + j + 1)
        eng.prefill(1, prompt + verify[:j + 1])
        assert kv.length[0] == kv.length[1] == len(prompt) + j + 1
        assert kv.ngram[0].tolist() == kv.ngram[1].tolist() == (prompt + verify[:j + 1])[-2:]
        for i in kv.ple_conv:
            torch.testing.assert_close(kv.ple_conv[i][0], kv.ple_conv[i][1], atol=1e-5, rtol=0)
        for i in kv.conv:
            torch.testing.assert_close(kv.conv[i][0], kv.conv[i][1], atol=1e-5, rtol=0)
            torch.testing.assert_close(kv.ssm[i][0], kv.ssm[i][1], atol=1e-5, rtol=0)
        a = eng.forward([Segment(0, len(prompt) + j + 1, 2)], [3, 7], all_logits=True, is_prompt=True)
        b = eng.forward([Segment(1, len(prompt) + j + 1, 2)], [3, 7], all_logits=True, is_prompt=True)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_rollback_without_a_kept_step_is_refused():
    eng = LLM("synth:tiny-flash-next", **KW).engine
    eng.prefill(0, [5, 6, 7])
    with pytest.raises(ValueError, match="no kept"):
        eng.kv.rollback(0, 2)


def test_speculation_without_a_head_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"this Qwen3.8-Flash-Next checkpoint ships no MTP head \(HF: none read"):
        LLM("synth:tiny-flash-next", spec_type="draft-mtp", **KW)
