"""Sampling: params validation, greedy, top-k/top-p/min-p filters, the draw's distribution, stop strings."""
from __future__ import annotations

import random

import pytest
import torch

from moestream.errors import UserError
from moestream.runtime.sampling import Sampler, SamplingParams, StopChecker, make_generator

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])       # a known distribution, as logits below


def logits_of(probs: torch.Tensor, rows: int) -> torch.Tensor:
    return probs.log().expand(rows, -1).contiguous()        # (rows, V)


def draw(params: SamplingParams, n: int = 4000, probs: torch.Tensor = PROBS, seed: int = 0) -> torch.Tensor:
    """n independent draws: n rows of the same logits, one seeded generator shared by all rows."""
    g = torch.Generator().manual_seed(seed)
    return Sampler().sample(logits_of(probs, n), [params] * n, [g] * n)


def counts(tokens: torch.Tensor, V: int) -> list[int]:
    return torch.bincount(tokens, minlength=V).tolist()


# ---- SamplingParams ---------------------------------------------------------------------------------------------
def test_defaults_are_greedy_and_inputs_are_normalized():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (16, 0.0, 0, 1.0, 0.0, None)
    assert p.greedy and not SamplingParams(temperature=0.8).greedy
    assert SamplingParams(stop="END").stop == ("END",)
    q = SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4])
    assert q.stop == ("a", "b") and q.stop_token_ids == (3, 4)
    hash(q)                                                   # frozen, usable as a key


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=1.1), dict(max_tokens=-1),
                                dict(top_k=-2), dict(top_k=1.5), dict(stop=("",)), dict(seed="x")])
def test_nonsense_params_are_user_errors(kw):
    with pytest.raises(UserError):
        SamplingParams(**kw)


# ---- greedy and filters -----------------------------------------------------------------------------------------
def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1        # a tie: id 7 wins
    out = Sampler().sample(logits, [SamplingParams()] * 6, [None] * 6)
    assert out.dtype == torch.long and out.shape == (6,)
    assert torch.equal(out, logits.argmax(-1)) and out[2] == 7


def test_top_k_1_is_greedy():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    logits[5, 11] = logits[5, 200] = logits[5].max() + 1
    params = [SamplingParams(temperature=1.3, top_k=1)] * 64
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    assert torch.equal(Sampler().sample(logits, params, gens), logits.argmax(-1))


def test_greedy_rows_are_untouched_by_sampled_rows_of_the_batch():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=2.0)]
    out = Sampler().sample(logits, params, [None, torch.Generator(), None, torch.Generator()])
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_request_is_reproducible_on_its_own():
    V = 1000
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_with_others: bool):
        gens = [make_generator(p), make_generator(SamplingParams(temperature=1.0)), None]
        out = []
        for _ in range(20):
            if batch_with_others:
                out.append(int(Sampler().sample(logits, [p, SamplingParams(temperature=1.0), p], gens)[0]))
            else:
                out.append(int(Sampler().sample(logits[:1], [p], gens[:1])[0]))
        return out

    alone = run(False)
    assert alone == run(False) == run(True)
    assert len(set(alone)) > 5                                # it did sample


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 < 0.7 <= 0.5 + 0.25: {0, 1}; 0.5 >= 0.4: {0}; 0.9 <= 0.5 + 0.25 + 0.15: {0, 1, 2}
    for top_p, kept in ((0.7, 2), (0.4, 1), (0.85, 3)):
        c = counts(draw(SamplingParams(temperature=1.0, top_p=top_p)), 5)
        assert all(c[i] > 0 for i in range(kept)) and sum(c[kept:]) == 0, (top_p, c)
    c = counts(draw(SamplingParams(temperature=1.0, top_p=0.7)), 5)
    assert abs(c[0] / (c[0] + c[1]) - 2 / 3) < 0.03           # renormalized over the kept tokens


def test_min_p_is_relative_to_the_top_probability():
    # threshold 0.25 * 0.5 = 0.125: {0, 1, 2}; 0.1 * 0.5 = 0.05: {0, 1, 2, 3}
    for min_p, kept in ((0.25, 3), (0.1, 4), (1.0, 1)):
        c = counts(draw(SamplingParams(temperature=1.0, min_p=min_p)), 5)
        assert all(c[i] > 0 for i in range(kept)) and sum(c[kept:]) == 0, (min_p, c)


def test_filters_combine():
    c = counts(draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.99, min_p=0.05)), 5)
    assert all(c[i] > 0 for i in range(3)) and sum(c[3:]) == 0
    # top-p applies to the top-k renormalized mass: top 2 = 0.5 / 0.75 = 0.67 of it, < 0.7, so two are kept
    c = counts(draw(SamplingParams(temperature=1.0, top_k=2, top_p=0.7)), 5)
    assert c[0] > 0 and c[1] > 0 and sum(c[2:]) == 0


def chi_square(observed: list[int], expected: torch.Tensor) -> float:
    n = sum(observed)
    return sum((o - n * float(e)) ** 2 / (n * float(e)) for o, e in zip(observed, expected))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_follows_the_tempered_softmax(temperature):
    n, V = 20000, len(PROBS)
    c = counts(draw(SamplingParams(temperature=temperature), n=n, seed=7), V)
    expected = (PROBS.log() / temperature).softmax(-1)
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001. The seed is fixed, so this never flakes.
    assert chi_square(c, expected) < 18.47, (c, (expected * n).tolist())


def test_large_vocabulary_and_other_dtypes():
    V = 152_000
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
    out = Sampler().sample(logits, [p, p], [torch.Generator().manual_seed(5)] * 2)
    top50 = logits.float().topk(50, dim=-1).indices
    assert all(int(out[i]) in top50[i].tolist() for i in range(2))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_greedy_and_sampling_stay_on_the_device():
    logits = torch.randn(8, 5000, generator=torch.Generator().manual_seed(6))
    cuda = logits.cuda()
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02)] * 4
    gens = [None, torch.Generator(device="cuda").manual_seed(1)] * 4
    out = Sampler().sample(cuda, params, gens)
    assert out.device.type == "cuda"
    assert torch.equal(out[0::2].cpu(), logits[0::2].argmax(-1))
    top40 = logits.topk(40, dim=-1).indices
    assert all(int(out[i]) in top40[i].tolist() for i in range(1, 8, 2))
    # A CPU generator works with CUDA logits, and a seeded CUDA generator replays.
    Sampler().sample(cuda, params, [None, torch.Generator().manual_seed(1)] * 4)
    again = Sampler().sample(cuda, params, [None, torch.Generator(device="cuda").manual_seed(1)] * 4)
    assert torch.equal(out, again)


# ---- stop strings -----------------------------------------------------------------------------------------------
def run_stops(stops, pieces):
    sc = StopChecker(stops)
    out = []
    for p in pieces:
        text, stopped = sc.push(p)
        out.append(text)
        if stopped:
            return "".join(out), True, sc
    return "".join(out) + sc.flush(), False, sc


def test_stop_string_split_across_pieces():
    sc = StopChecker(["<END>"])
    assert sc.push("Hello <E") == ("Hello ", False)            # "<E" could start "<END>": held back
    assert sc.push("N") == ("", False)
    assert sc.push("D> more") == ("", True) and sc.matched == "<END>"
    assert sc.push("later") == ("", True) and sc.flush() == ""


def test_held_text_is_released_when_it_is_not_a_stop():
    sc = StopChecker(["<END>"])
    assert sc.push("a <EN") == ("a ", False)
    assert sc.push("X") == ("<ENX", False)
    assert sc.push("<") == ("", False)
    assert sc.flush() == "<"


def test_no_stop_strings_pass_everything():
    assert run_stops([], ["a", "b", "c"])[:2] == ("abc", False)
    sc = StopChecker([])
    assert sc.push("abc") == ("abc", False)


def test_the_first_stop_to_complete_wins_whatever_the_pieces():
    assert run_stops(["world", "lo"], ["hello world"])[:2] == ("hel", True)
    assert run_stops(["abcd", "bc"], ["abcd"])[:2] == ("a", True)      # "bc" completes first
    assert run_stops(["abcd", "cd"], ["ab", "cd"])[:2] == ("", True)   # both end together: cut the longer


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Token by token (one character a token): the text up to where the first stop string completes."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))], True
    return text, False


def test_stop_checker_matches_the_character_by_character_reference():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        got, stopped, _ = run_stops(stops, pieces)
        assert (got, stopped) == reference(text, stops), (stops, pieces)


# --- penalties ------------------------------------------------------------------------------------------------------
def test_greedy_with_a_repeat_penalty_avoids_the_repeated_token():
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0]])                  # argmax 1; 2 close behind
    plain = SamplingParams(max_tokens=4)
    assert int(Sampler().sample(logits, [plain], [None], [[1]])[0]) == 1          # no penalty: history ignored
    for p in (SamplingParams(max_tokens=4, repeat_penalty=1.5), SamplingParams(max_tokens=4, presence_penalty=1.0),
              SamplingParams(max_tokens=4, frequency_penalty=0.6)):
        assert p.penalized
        assert int(Sampler().sample(logits, [p], [None], [[1]])[0]) == 2, p
        assert int(Sampler().sample(logits, [p], [None], [[3, 0]])[0]) == 1, p   # 1 not repeated: unchanged
    # a negative logit is multiplied, so that a penalty never raises a token
    neg = torch.tensor([[-1.0, -1.2]])
    assert int(Sampler().sample(neg, [SamplingParams(repeat_penalty=1.5)], [None], [[0]])[0]) == 1


def test_frequency_counts_and_the_window_is_the_last_n_tokens():
    logits = torch.tensor([[3.0, 2.0]])
    p = SamplingParams(frequency_penalty=0.6)
    assert int(Sampler().sample(logits, [p], [None], [[0]])[0]) == 0             # 3 - 0.6 > 2
    assert int(Sampler().sample(logits, [p], [None], [[0, 0]])[0]) == 1          # 3 - 1.2 < 2
    last1 = SamplingParams(frequency_penalty=0.6, repeat_last_n=1)
    assert int(Sampler().sample(logits, [last1], [None], [[0, 0, 1]])[0]) == 0   # only the last token counts
    assert not SamplingParams(repeat_penalty=2.0, repeat_last_n=0).penalized


def test_penalties_in_a_batch_touch_only_their_rows():
    logits = torch.tensor([[0.0, 3.0, 2.5], [0.0, 3.0, 2.5]])
    out = Sampler().sample(logits, [SamplingParams(), SamplingParams(presence_penalty=1.0)], [None, None],
                           [[1], [1]])
    assert out.tolist() == [1, 2]


@pytest.mark.parametrize("kw", [dict(repeat_penalty=0.0), dict(repeat_penalty=float("nan")),
                                dict(presence_penalty=float("inf")), dict(repeat_last_n=-2)])
def test_nonsense_penalties_are_user_errors(kw):
    with pytest.raises(UserError):
        SamplingParams(**kw)
