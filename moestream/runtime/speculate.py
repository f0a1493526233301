"""Speculative decoding with the model's MTP head (`--spec-type draft-mtp --spec-draft-n-max N`), one sequence.

    spec = MTPDecode(engine, seq=0, n_max=2)
    logits = spec.prefill(prompt)                    # the trunk's, every prompt token's hidden state kept
    token = argmax(logits)                           # (or sampled)
    while ...:
        new = spec.step(token, params, gen)          # the tokens after `token` this step commits (1 to N+1)
        token = new[-1]

A step: the head drafts N tokens (chained: the first reads the trunk's hidden state, each next one the head's own
post-norm output; Qwen3.8-Flash-Next's reads streams before the output mixer instead, the trunk's and its own: the
engine's `hidden` is what the family's head reads, models/residual.py's head_read), then one target step verifies
the N + 1 positions [token, d1 .. dN] (a prompt-like forward of N + 1 tokens of the sequence: each host layer's
experts for the union of its tokens, each crossing the link once), accepts drafts while the target agrees (greedy:
the target's argmax; sampling: runtime/spec_sampling.py, which keeps the target's distribution) and commits one more
token from the target's own logits. What rejected drafts wrote is undone: the KV past the accepted position is
masked and overwritten later; the DeltaNet layers keep every verify token's state and take the accepted one
(HybridCache.rollback), never running the prefix again. The head's KV at the accepted positions is written again
from the trunk's hidden states at the next step's first draft (the head reads them in one step beside its draft).

Several sequences (the serving loop's speculating slots) draft together (draft_together): draft position j of all
of them is one head forward (Engine.head_steps: segments of different lengths in one batch, the head's experts
once for all), N head forwards a step instead of one per sequence and position; a sequence beside others gets
its drafts alone's, up to the last bits of GEMMs over more rows (tests/test_mtp_streams.py).

Greedy output is the target's: a verify step's row j computes position m + j as a prompt ubatch does (chunk-free
recurrent rule, prompt attention), which may differ in the last bits from a one-token decode step; the tokens agree
on every test model in float32, and in bfloat16 on a GPU up to a near-tie, which the two forms may break either way
(docs/ARCHITECTURE.md, tests/test_mtp.py, tests/test_mtp_heads.py). `oracle`: bench --spec-oracle's drafts instead of
the head's (tools/bench_spec.py): the verify, the rollback and the expert traffic stay the real ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..experts.routing import RouteCallback
from ..models.transformer import Segment
from .sampling import SamplingParams
from .spec_sampling import accept_drafts, distribution

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class SpecCounts:
    """What speculation did: per verify step, tokens drafted and accepted; with `measure`, the distinct experts each
    MoE layer read (a one-token step reads top-k) and the bytes copied from host memory."""
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    experts: list[float] = field(default_factory=list)      # mean distinct experts a layer, per verify step
    bytes: list[int] = field(default_factory=list)          # bytes uploaded from host, per step (verify and drafts)

    @property
    def acceptance(self) -> float:
        return sum(self.accepted) / max(1, sum(self.drafted))

    def summary(self) -> dict:
        if not self.drafted:
            return {"steps": 0}
        steps = len(self.drafted)
        out = {"steps": len(self.drafted), "drafted": sum(self.drafted), "accepted": sum(self.accepted),
               "acceptance": round(self.acceptance, 4), "tokens_per_step": round(
                   (sum(self.accepted) + len(self.drafted)) / steps, 4)}
        if self.experts:
            out.update(experts_per_layer=round(float(np.mean(self.experts)), 3),
                       bytes_per_step=int(np.mean(self.bytes)))
        return out


class MTPDecode:
    """One sequence's speculative decode over an engine loaded with its MTP head (--spec-type draft-mtp)."""

    def __init__(self, engine, seq: int = 0, n_max: int = 2, oracle=None, measure: bool = False):
        """oracle: fn(position, n) -> n draft tokens for positions position.. (bench --spec-oracle), or None (the
        head drafts). measure: count each step's distinct experts and uploaded bytes (SpecCounts)."""
        self.eng, self.seq, self.n_max, self.oracle, self.measure = engine, seq, n_max, oracle, measure
        self.counts = SpecCounts()
        self.pos = 0                    # the next position the trunk runs (the last committed token's)
        self.pending: list[int] = []    # tokens the head has yet to read, at positions head_pos..
        self.head_pos = 0
        self.hidden = None              # (.., H): the trunk's post-norm hidden states at head_pos .. pos - 1

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """The trunk over the prompt (engine.prefill); its last token's logits (1, V)."""
        hidden: list[torch.Tensor] = []
        logits = self.eng.prefill(self.seq, prompt, 0, hidden=hidden)
        self.start(prompt, torch.cat(hidden))
        return logits

    def start(self, prompt: list[int], hidden: torch.Tensor) -> None:
        """The trunk has read `prompt` from position 0, its post-norm hidden states `hidden` (P, H): the head reads
        them at the first draft."""
        self.pending, self.head_pos, self.pos, self.hidden = list(prompt[1:]), 0, len(prompt), hidden

    def step(self, token: int, params: SamplingParams, gen: torch.Generator | None = None) -> list[int]:
        """`token` (at position pos) committed: draft, verify, accept; the tokens committed after it (1 to N + 1,
        the last one the target's own). Every later position of the cache is the accepted ones' only."""
        eng = self.eng
        before = eng.stats()["uploaded_bytes"] if self.measure else 0
        drafts, q = self.draft(token, params, gen)
        seen: dict[int, set] = {}
        watch = RouteCallback(lambda layer, ids: seen.setdefault(layer, set()).update(ids.flatten().tolist()))
        if self.measure:
            eng.observe(watch)
        hidden: list[torch.Tensor] = []
        try:
            logits = eng.forward([self.segment(drafts)], [token, *drafts], all_logits=True, is_prompt=True,
                                 hidden=hidden, keep_states=bool(drafts))    # (n + 1, V)
        finally:
            if self.measure:
                eng.unobserve(watch)
        new = self.commit(logits, hidden[0], drafts, q, params, gen)
        if self.measure:
            moe = [l for l in seen if l < eng.cfg.n_layers]
            self.counts.experts.append(float(np.mean([len(seen[l]) for l in moe])) if moe else 0.0)
            self.counts.bytes.append(eng.stats()["uploaded_bytes"] - before)
        return new

    def segment(self, drafts: list[int]) -> Segment:
        """The verify step's segment: the committed token and the drafts, from position pos."""
        return Segment(self.seq, self.pos, len(drafts) + 1)

    def commit(self, logits: torch.Tensor, hidden: torch.Tensor, drafts: list[int], q, params: SamplingParams,
               gen) -> list[int]:
        """The verify step's rows (n + 1, V) and post-norm hidden states (n + 1, H): accept drafts, roll the cache
        back to the accepted position; the tokens committed (the accepted drafts and the target's own)."""
        m, n = self.pos, len(drafts)
        if params.greedy:
            target = logits.argmax(dim=-1).tolist()
            a = next((j for j in range(n) if drafts[j] != target[j]), n)
            new = drafts[:a] + [target[a]]
        else:
            a, last = accept_drafts(distribution(logits, params), q, drafts, gen)
            new = drafts[:a] + [last]
        if n:
            self.eng.kv.rollback(self.seq, m + a + 1)
        # the head's next read: the accepted tokens beside the trunk's hidden states at m .. m + a
        self.pending, self.head_pos, self.hidden = new[:-1], m, hidden[:a + 1]
        self.pos = m + a + 1
        self.counts.drafted.append(n)
        self.counts.accepted.append(a)
        return new

    def draft(self, token: int, params: SamplingParams, gen) -> tuple[list[int], torch.Tensor | None]:
        """Drafts after `token` (at position pos; as many as n_max and the context allow) and, when sampling, their
        distributions q (n, V): draft_together of this sequence alone."""
        return draft_together(self.eng, [(self, token, params, gen)])[0]

    def n_drafts(self) -> int:
        """How many drafts the next step takes: n_max, as far as the context allows."""
        return min(self.n_max, self.eng.kv.ctx - 1 - self.pos)

    def first_read(self, token: int) -> tuple[int, int, list[int], torch.Tensor]:
        """The head's first read of a step (Engine.head_steps'): what it has not read yet, then `token` beside the
        trunk's hidden state before it."""
        return self.seq, self.head_pos, self.pending + [token], self.hidden


def draft_together(engine, steps: list[tuple[MTPDecode, int, SamplingParams, torch.Generator | None]]
                   ) -> list[tuple[list[int], torch.Tensor | None]]:
    """Each sequence's drafts after its committed token and, when it samples, their distributions q (n, V): steps
    (its MTPDecode, token, params, generator), distinct sequences of one engine. Draft position j of every sequence
    still drafting is one head forward (Engine.head_steps: the head's experts once for all of them), the first
    one reading each sequence's accepted positions again; a sequence whose drafts stop (its n_max, its context's
    end, an oracle's drafts) leaves the later ones. Each sequence draws from its own generator, as alone."""
    out: list[tuple[list[int], list]] = [([], []) for _ in steps]
    n = [spec.n_drafts() for spec, *_ in steps]
    live = []                           # the sequences the head drafts for
    for i, (spec, token, _, _) in enumerate(steps):
        if n[i] and spec.oracle is not None:
            out[i][0].extend(spec.oracle(spec.pos + 1, n[i]))
        elif n[i]:
            live.append(i)
    reads = [steps[i][0].first_read(steps[i][1]) for i in live]
    while live:
        logits, outs = engine.head_steps(reads)                              # (len(live), V)
        picks = logits.argmax(dim=-1).tolist()                               # (one read back for the greedy)
        going, reads = [], []
        for row, pick, i, o in zip(logits, picks, live, outs):
            spec, _, params, gen = steps[i]
            drafts, qs = out[i]
            if params.greedy:
                d = pick
            else:
                q = distribution(row[None], params)                          # (1, V)
                d = int(torch.multinomial(q[0], 1, generator=gen))
                qs.append(q)
            drafts.append(d)
            if len(drafts) < n[i]:      # the chain: the next draft reads the head's own post-norm output
                going.append(i)
                reads.append((spec.seq, spec.pos + len(drafts) - 1, [d], o[-1:]))
        live = going
    return [(drafts, torch.cat(qs) if qs else None) for drafts, qs in out]


def greedy_tokens(engine, prompt: list[int], n_tokens: int, n_max: int, oracle=None, measure: bool = False,
                  seq: int = 0) -> tuple[list[int], SpecCounts]:
    """n_tokens greedy tokens after `prompt` with drafts (the head's, or the oracle's), no stop but the count:
    bench's decode and the tests' comparison with plain decoding. The context must hold them."""
    engine.check_context(len(prompt) + n_tokens)
    spec = MTPDecode(engine, seq, n_max, oracle, measure)
    engine.begin_prompt(seq)
    if n_max == 0:                      # no drafts: the plain decode path, a token a step
        out = [int(engine.prefill(seq, prompt)[-1].argmax())]
        for pos in range(len(prompt), len(prompt) + n_tokens - 1):
            out.append(int(engine.decode([(seq, out[-1], pos)])[0].argmax()))
        return out, spec.counts
    out = [int(spec.prefill(prompt)[-1].argmax())]
    while len(out) < n_tokens:
        out += spec.step(out[-1], GREEDY)
    return out[:n_tokens], spec.counts

