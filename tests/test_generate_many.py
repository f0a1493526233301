"""LLM.generate of a list of prompts: they run together as the server runs requests (prompt batches, decode steps
of every running sequence), and each gets the tokens it gets alone."""
from __future__ import annotations

import pytest

from moestream import LLM
from moestream.errors import UserError

PROMPTS = ["Once upon a time", "Light travels about three hundred thousand kilometres", "The", "A cat and a dog",
           [5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def alone():
    return LLM("synth:tiny", ctx_size=128, device="cpu")


@pytest.mark.parametrize("kw", [dict(), dict(cpu_moe=True, moe_cache_mib=1)])
def test_a_list_of_prompts_gives_each_the_tokens_it_gets_alone(alone, kw):
    llm = LLM("synth:tiny", ctx_size=128, device="cpu", n_seq=3, ubatch_size=4, batch_size=8, **kw)
    check_against(llm, alone)


def test_a_hybrid_models_prompts_together_keep_their_tokens():
    """Qwen3-Next's recurrent states: each sequence's in a batch of several, as alone."""
    alone = LLM("synth:tiny-next", ctx_size=128, device="cpu")
    check_against(LLM("synth:tiny-next", ctx_size=128, device="cpu", n_seq=3, ubatch_size=4, batch_size=8,
                      cpu_moe=True, moe_cache_mib=1), alone)


def check_against(llm, alone):
    outs = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    assert len(outs) == len(PROMPTS)                 # five prompts over three sequences: two wait for a slot
    for out, p in zip(outs, PROMPTS):
        want = alone.generate(p, max_tokens=8, ignore_eos=True)
        assert out.token_ids == want.token_ids and out.text == want.text and out.finish_reason == "length"
        assert out.prompt_tokens == want.prompt_tokens
    seeded = llm.generate(PROMPTS[:2], max_tokens=6, temperature=0.9, seed=3)
    assert [o.token_ids for o in seeded] == [alone.generate(p, max_tokens=6, temperature=0.9, seed=3).token_ids
                                             for p in PROMPTS[:2]]


def test_a_bad_prompt_in_a_list_is_refused_before_anything_runs(alone):
    llm = LLM("synth:tiny", ctx_size=16, device="cpu", n_seq=2)
    with pytest.raises(UserError, match="context is 16"):
        llm.generate(["Once", list(range(1, 30))], max_tokens=2)
    with pytest.raises(UserError, match="empty prompt"):
        llm.generate(["Once", []], max_tokens=2)
    assert llm.generate([[1, 2, 3]], max_tokens=2)[0].prompt_tokens == 3      # one prompt in a list: a list back
