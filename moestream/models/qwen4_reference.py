"""A plain-torch forward of a whole Qwen3.8-Flash-Next (qwen4_exp) over several sequences' states: the oracle of
its blocks (residual.py's Hyper, ple.py, qsa.py) against transformers, and of the engine's path once it runs them.

    ref = Qwen4Reference(cfg, canonical_from_hf(cfg, sd), ctx=256)      # the PLE table stays on the host
    st = ref.new_state(n_seq=2)
    a, b = ref.forward(st, [(0, 0, prompt_a), (1, 0, prompt_b)])      # (n_a, V), (n_b, V) float32 logits
    step = ref.forward(st, [(0, len(prompt_a), [tok])])[0]            # sequence 0 continues where it stopped

Each layer: [the PLE add, on its layer] the attention mixer's input from the streams, the DeltaNet or QSA
attention, its output written back to each stream; the same around the MoE; at the end the output mixer and the
head. A sequence's state is HybridState's (KV, DeltaNet conv and recurrent states, its position) and, for this
family, each attention layer's raw index keys by position, the PLE layer's conv rows, and its last ngram_size-1
tokens (the n-gram context of its next tokens; transformers keeps them as a third conv state).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .next_reference import HybridReference, HybridState
from .ple import NGramHash, PLETable, ple_add
from .qsa import qsa_attention
from .residual import Hyper


class Qwen4State(HybridState):
    """HybridState plus the indexer's raw keys (n_seq, ctx, d) per attention layer, and per sequence its n-gram
    context and PLE conv rows."""

    def __init__(self, cfg: ModelConfig, n_seq: int, ctx: int, dtype, device, ngram: NGramHash | None):
        super().__init__(cfg, n_seq, ctx, dtype, device)
        self.index_keys = [torch.zeros(n_seq, ctx, cfg.indexer_head_dim, dtype=dtype, device=device)
                           for _ in cfg.attention_layers]
        self.ngram = ngram
        self.context = [ngram.start_context() if ngram else [] for _ in range(n_seq)]
        self.ple_conv: list[dict] = [{} for _ in range(n_seq)]           # per sequence: PLE layer -> its rows

    def reset(self, seq: int):
        super().reset(seq)
        self.context[seq] = self.ngram.start_context() if self.ngram else []
        self.ple_conv[seq] = {}


class Qwen4Reference(HybridReference):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ctx: int, device="cpu"):
        """weights: canonical, per_layer_token_embd (the PLE table) kept on the host, whatever `device` is."""
        table = weights.get("per_layer_token_embd.weight")
        dev = {n: t.to(device) for n, t in weights.items() if n != "per_layer_token_embd.weight"}
        super().__init__(cfg, dev, ctx, device)
        self.table = None if table is None else PLETable(table)
        self.ngram = NGramHash.of(cfg) if cfg.ple_layers else None
        self.hyper = Hyper(cfg.rms_norm_eps, cfg.hc_count)

    def new_state(self, n_seq: int = 1) -> Qwen4State:
        return Qwen4State(self.cfg, n_seq, self.ctx, self.dtype, self.device, self.ngram)

    def forward(self, state: Qwen4State, segments: list[tuple[int, int, list[int]]], mode: str = "auto",
                trace: list | None = None) -> list[torch.Tensor]:
        """HybridReference.forward's contract; `trace` gets each layer's streams (T, hc*H)."""
        cfg, hy = self.cfg, self.hyper
        tokens, lens, cos, sin = self._begin(state, segments)
        rope_all = (self.cos.to(self.dtype), self.sin.to(self.dtype))
        ids = torch.tensor(tokens, device=self.device)
        h = hy.expand(self.w["token_embd.weight"][ids])                                  # (T, hc*H)
        for i, lw in enumerate(self.layers):
            if i in cfg.ple_layers:
                h = h + self._ple(h, lw, i, state, segments, lens)
            x, gate = hy.mix(h, hy.weights(lw, "hc_attn"))
            if i in state.delta:
                out = self._deltanet(x, lw, state.delta[i], segments, lens, mode)
            else:
                parts, r = [], 0
                slot = state.kv_slot[i]
                for (seq, start, _), n in zip(segments, lens):
                    parts.append(qsa_attention(x[r:r + n], lw, cfg, cos[r:r + n], sin[r:r + n], rope_all,
                                               state.kv, state.index_keys[slot], slot, seq, start))
                    r += n
                out = torch.cat(parts)
            h = hy.write(h, (out, gate))
            x, gate = hy.mix(h, hy.weights(lw, "hc_ffn"))
            h = hy.write(h, (self._moe(x, lw), gate))
            if trace is not None:
                trace.append(h)
        for (seq, start, toks), n in zip(segments, lens):
            state.length[seq] = start + n
            if self.ngram is not None:
                state.context[seq] = NGramHash.next_context(state.context[seq], toks, self.ngram.context_len)
        out = hy.mix(h, hy.weights(self.w, "output_hc"))[0]
        return list(F.linear(out, self.lm_head).float().split(lens))

    def _ple(self, h, lw, layer: int, state: Qwen4State, segments, lens) -> torch.Tensor:
        """The PLE layer's add to the streams of every segment: each one's n-gram rows gathered from the host
        table, from its sequence's context and conv rows (updated)."""
        parts, r = [], 0
        for (seq, _, toks), n in zip(segments, lens):
            rows = self.ngram.rows(state.context[seq], torch.tensor(toks))
            emb = self.table.gather(rows, self.device)
            add, state.ple_conv[seq][layer] = ple_add(h[r:r + n], emb, lw, self.cfg,
                                                      state.ple_conv[seq].get(layer))
            parts.append(add)
            r += n
        return torch.cat(parts)
