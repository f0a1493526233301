"""Choosing the next token from logits, and cutting the text at stop strings.

    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=1)
    gen = make_generator(params, device)                   # one per request: a seeded request replays on its own
    next_ids = Sampler().sample(logits, [params], [gen])   # logits (B, V) -> ids (B,)
    Sampler().sample(logits, [penalized], [gen], [prompt_ids + generated_ids])   # penalties read each row's tokens
    stops = StopChecker(params.stop)
    text, stopped = stops.push(piece)                      # text safe to show; True once a stop string appeared

temperature 0 is greedy (argmax, ties to the lowest id), the default: greedy outputs are the ones this project
compares across cache sizes and prefetch rules. Otherwise the order is vLLM's: temperature, top-k, top-p, min-p, draw.
Penalties come first, on greedy rows too, as llama.cpp applies them: over the last repeat_last_n tokens (prompt and
generated; -1: all of them), a token seen there has its logit divided by repeat_penalty (multiplied, if negative),
then lowered by frequency_penalty x its count and by presence_penalty once. llama-server's rule, which its
presence_penalty and frequency_penalty (OpenAI's names) follow too; OpenAI counts generated tokens only.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError

# Below this, dividing logits by the temperature can overflow float32; so small a temperature is greedy in effect.
_MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # <= 0: greedy
    top_k: int = 0                    # 0 (or -1, vLLM's spelling): off
    top_p: float = 1.0                # 1.0: off
    min_p: float = 0.0                # 0.0: off; else keep tokens with prob >= min_p * the top prob
    seed: int | None = None
    stop: tuple[str, ...] = ()        # stop strings, not included in the output (as in OpenAI's API)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repeat_penalty: float = 1.0       # 1.0: off (llama.cpp's --repeat-penalty)
    presence_penalty: float = 0.0     # 0.0: off
    frequency_penalty: float = 0.0    # 0.0: off
    repeat_last_n: int = 64           # the tokens the penalties look at: the last N (-1: all; 0: none)

    def __post_init__(self):
        # Accept the shapes requests arrive in (a single stop string, lists) and store tuples: hashable, frozen.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids or ()))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise UserError(f"max_tokens must be a whole number >= 0, got {self.max_tokens!r}")
        if not 0 <= self.temperature < float("inf"):      # also rejects NaN
            raise UserError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise UserError(f"top_k must be a whole number >= 0 (0 is off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1] (1 is off), got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1] (0 is off), got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -(1 << 63) <= self.seed < 1 << 64):
            raise UserError(f"seed must be a whole number from -2**63 to 2**64-1 (torch's range), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise UserError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        if not 0 < self.repeat_penalty < float("inf"):
            raise UserError(f"repeat_penalty must be positive (1 is off), got {self.repeat_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -1e9 < getattr(self, name) < 1e9:
                raise UserError(f"{name} must be a finite number (0 is off), got {getattr(self, name)!r}")
        if not isinstance(self.repeat_last_n, int) or self.repeat_last_n < -1:
            raise UserError(f"repeat_last_n must be -1 (all), 0 (none) or a count, got {self.repeat_last_n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    def window(self, tokens: list[int]) -> list[int]:
        """The tokens the penalties look at, of all the sequence's tokens so far (prompt, then generated)."""
        return list(tokens) if self.repeat_last_n < 0 else list(tokens[-self.repeat_last_n:])


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator:
    """The random stream of one request: from params.seed, else from a fresh random seed."""
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return g


class Sampler:
    """Stateless: all randomness comes from the generators passed in, one per row."""

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None], history: list[list[int]] | None = None) -> torch.Tensor:
        """logits (B, V) -> token ids (B,) int64, on logits' device.

        A row's generator may live on the CPU or on logits' device; None draws from torch's global CPU generator.
        Each sampled row draws exactly one uniform from its generator per call. history: each row's tokens so far
        (prompt and generated), which the penalties read; None where no row is penalized.
        """
        B, V = logits.shape
        if len(params) != B or len(generators) != B:
            raise ValueError(f"sample: {B} rows of logits, {len(params)} params, {len(generators)} generators")
        dev = logits.device
        if history is not None and any(p.penalized for p in params):
            logits = _penalize(logits, params, history)
        out = logits.argmax(dim=-1)                                                  # (B,) greedy, stays on dev
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return out
        sel = [params[i] for i in rows]
        n = len(rows)

        idx = torch.tensor(rows, dtype=torch.long).to(dev)                            # (n,)
        probs, keep, order = filtered(logits.index_select(0, idx), sel)
        n_kept = keep.sum(dim=-1, keepdim=True)                                       # (n, 1)

        # Inverse-CDF draw on the kept mass (float64: a 150k-token cumsum in float32 loses the tail).
        cdf = (probs * keep).cumsum(dim=-1, dtype=torch.float64)                      # (n, V)
        u = torch.stack([_uniform(generators[i], dev) for i in rows]).view(n, 1)      # (n, 1) in [0, 1)
        choice = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)                 # (n, 1) first cdf > target
        choice = torch.minimum(choice, n_kept - 1)                                    # u * total rounding to total
        out[idx] = order.gather(1, choice).squeeze(1)
        return out


def filtered(logits: torch.Tensor, params: list[SamplingParams]):
    """The sampler's filters on logits (n, V), one row a params: temperature, top-k, top-p, min-p -> (probs (n, V)
    sorted descending, keep (n, V) the kept prefix, order (n, V) the token of each sorted column)."""
    dev, V = logits.device, logits.shape[-1]

    def column(values, dtype):                                                        # (n, 1) per-row setting
        return torch.tensor(values, dtype=dtype).to(dev).unsqueeze(1)

    temp = column([max(p.temperature, _MIN_TEMPERATURE) for p in params], torch.float32)
    x = logits.float() / temp                                                         # (n, V)
    # Stable sort: among equal logits the lowest id comes first, so top_k=1 agrees with argmax.
    vals, order = x.sort(dim=-1, descending=True, stable=True)                        # (n, V) each
    probs = vals.softmax(dim=-1)                                                      # (n, V), sorted descending
    pos = torch.arange(V, device=dev)                                                 # (V,)

    # Every filter keeps a prefix of the sorted tokens, so "kept" is a prefix too, never empty.
    top_k = column([min(p.top_k, V) if p.top_k > 0 else V for p in params], torch.long)
    keep = pos < top_k                                                                # (n, V)
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)                                   # renormalized top-k
    # top-p: the smallest prefix whose mass reaches top_p = the tokens whose preceding mass is below it.
    mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))                         # (n, V), exclusive cumsum
    top_p = column([p.top_p if p.top_p < 1 else 2.0 for p in params], torch.float32)  # 2.0: keep all (rounding)
    keep &= mass_before < top_p
    min_p = column([p.min_p for p in params], torch.float32)
    keep &= probs >= min_p * probs[:, :1]
    keep[:, 0] = True
    return probs, keep, order


def _penalize(logits: torch.Tensor, params: list[SamplingParams], history: list[list[int]]) -> torch.Tensor:
    """A float32 copy of logits (B, V) with each penalized row's repeated tokens pushed down (llama.cpp's rule)."""
    out = logits.float().clone()
    for i, p in enumerate(params):
        window = p.window(history[i]) if p.penalized else []
        if not window:
            continue
        ids, counts = torch.tensor(window, dtype=torch.long).unique(return_counts=True)      # (u,), (u,)
        ids, counts = ids.to(out.device), counts.to(out.device, torch.float32)
        x = out[i, ids]                                                                       # (u,)
        x = torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty)
        out[i, ids] = x - counts * p.frequency_penalty - p.presence_penalty
    return out


def _uniform(g: torch.Generator | None, device) -> torch.Tensor:
    """One float64 uniform in [0, 1) from g (on g's own device), as a 0-d tensor on device."""
    if g is None:
        return torch.rand((), dtype=torch.float64).to(device)
    return torch.rand((), generator=g, device=g.device, dtype=torch.float64).to(device)


class StopChecker:
    """Cuts generated text at the first stop string, holding back what could be the start of one.

    push(piece) -> (text safe to emit now, stopped). Once stopped, the text before the stop string has been
    emitted, the stop string is not, and later pushes return ("", True). flush() returns the held-back text at
    the end of a generation that ended for another reason.
    """

    def __init__(self, stop_strings):
        self.stops = tuple(s for s in stop_strings if s)
        self.stopped = False
        self.matched: str | None = None         # the stop string that ended the text (OpenAI's stop_reason)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        # The held text holds no whole stop string, so every match ends in the new text. The text stops where the
        # first match ends, as it would have token by token, whatever the pieces; of matches ending there, the
        # longest is cut.
        hits = [(i + len(s), -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            end, neg_len, self.matched = min(hits)
            self.stopped, self._held = True, ""
            return buf[:end + neg_len], True
        cut = len(buf) - self._partial(buf)
        self._held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        text, self._held = self._held, ""
        return "" if self.stopped else text

    def _partial(self, buf: str) -> int:
        """The length of the longest end of buf that begins some stop string (shorter than that string)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


def token_logprobs(row: torch.Tensor, token: int, n: int) -> tuple:
    """(token, its logprob, [(id, logprob)] of the top n) from one row of raw logits (V,)."""
    # Clamped as vLLM does: a -inf (a masked or underflowed token) is not valid JSON.
    lp = torch.log_softmax(row.float(), dim=-1).clamp_min(-9999.0)
    top = lp.topk(n) if n > 0 else None
    tops = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return token, float(lp[token]), tops
