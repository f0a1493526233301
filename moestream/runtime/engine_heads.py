"""The engine's MTP head steps (models/mtp.py): drafts read through the head's block beside the trunk's (or the head's
own) post-norm hidden states, several sequences in one forward, and the verify step's guessed experts they leave. A
mixin of runtime/engine.py's Engine, which holds what these use (cfg, ecfg, device, model, kv, experts, kernel,
observers, seed_layers, draft_guesses, _begin, check_context).

    logits, outs = eng.head_steps([(seq, start, tokens, hidden), ...])    # (B, V), each read's (T, H)
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import UserError
from ..models.transformer import Batch, Segment
from .plan import draft_n_max


class EngineHeads:
    @property
    def draft_n_max(self) -> int:
        """The drafts a decode step takes now (runtime/plan.py's draft_n_max: --spec-draft-n-max, else by the
        placement and the cache, which reconfigure_cache may change)."""
        return draft_n_max(self.ecfg.spec, self.device.is_cuda, self.host is not None, self.ecfg.cache.mib)

    def head_step(self, seq: int, start: int, tokens: list[int], hidden: torch.Tensor, head: int = 0):
        """head_steps of one sequence: (its last token's logits (1, V), every token's post-norm output (T, H))."""
        logits, outs = self.head_steps([(seq, start, tokens, hidden)], head)
        return logits, outs[0]

    @torch.inference_mode()
    def head_steps(self, reads: list[tuple[int, int, list[int], torch.Tensor]], head: int = 0):
        """MTP head `head` (models/mtp.py) over reads (seq, start, tokens, hidden) of distinct sequences: `tokens`
        of sequence seq at positions start.., beside the post-norm hidden states (T, H) of the positions before
        them (the trunk's, or the head's own for a chained draft). Every read's segment in one forward (each host
        layer's experts once for all of them) where they add up to at most -ub tokens, else in forwards of at most
        that (a few slots' first reads of whole prompts); a read longer than -ub is cut into ubatches from its
        start, as alone, and its earlier ubatches go in forwards before (aligned to the end: the last round holds
        every read's last ubatch). Returns each read's last token's logits (B, V) and each read's every token's
        post-norm output (T, H).
        It writes the head's KV layer only (no recurrent state); its experts are layer n_layers + head of the
        providers."""
        n_heads = self.cfg.nextn_layers
        if not 0 <= head < n_heads:
            raise UserError(f"this engine has {n_heads} MTP heads loaded; load it with --spec-type draft-mtp")
        for _, start, tokens, _ in reads:
            self.check_context(start + len(tokens))
        ub = self.ecfg.batching.ubatch
        cuts = [range(0, len(tokens), ub) for _, _, tokens, _ in reads]     # each read's ubatches' offsets
        rounds = max(len(c) for c in cuts)
        outs: list[list[torch.Tensor]] = [[] for _ in reads]
        last_logits = []
        for r in range(rounds):
            last = r == rounds - 1      # its tokens are the verify step's first rows (their guesses: seed_layers)
            members = [(i, c[r - rounds + len(c)]) for i, c in enumerate(cuts) if r >= rounds - len(c)]
            for group in _within(members, [len(reads[i][2][at:at + ub]) for i, at in members], ub):
                segs, tokens, hidden = [], [], []
                for i, at in group:
                    seq, start, toks, h = reads[i]
                    part = toks[at:at + ub]
                    segs.append(Segment(seq, start + at, len(part)))
                    tokens += part
                    hidden.append(h[at:at + len(part)])
                batch = Batch.make(segs, tokens, self.device.torch, observer=self.observers,
                                   head=torch.cat(hidden) if len(hidden) > 1 else hidden[0], keep_hidden=True,
                                   guess_layers=self.seed_layers if last else ())
                self._begin(segs, True, self.observers, states=False)
                logits = self.model.forward(batch, self.kv, self.experts, self.kernel)      # (len(group), V)
                for (i, _), out in zip(group, batch.hidden.split([s.n for s in segs])):
                    outs[i].append(out)
                if last:
                    last_logits.append(logits)
                    if batch.guesses is not None:
                        self.draft_guesses.append(batch.guesses)
        logits = torch.cat(last_logits) if len(last_logits) > 1 else last_logits[0]
        return logits, [torch.cat(o) if len(o) > 1 else o[0] for o in outs]

    def _seed(self, guesses: list[torch.Tensor]) -> np.ndarray:
        """Head steps' guesses ((len(seed_layers), B*k) ids each, B the sequences of the step) as counts (layers, E)
        per expert (seed_next): the union of every sequence's."""
        counts = np.zeros((self.cfg.n_stored_layers, self.cfg.n_experts), dtype=np.int64)
        ids = torch.cat(guesses, dim=1).cpu().numpy()                 # (len(seed_layers), steps' B*k)
        for j, layer in enumerate(self.seed_layers):
            np.add.at(counts[layer], ids[j], 1)
        return counts


def _within(members: list, sizes: list[int], limit: int) -> list[list]:
    """members in order, in groups whose sizes add up to at most `limit` (a member larger than it alone): the
    head reads of one round, at most a ubatch's tokens a forward (several prompts' first reads would be more)."""
    groups, total = [[]], 0
    for m, n in zip(members, sizes):
        if groups[-1] and total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(m)
        total += n
    return groups
