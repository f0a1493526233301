"""A plain-torch forward of a whole hybrid model (Qwen3-Next, Qwen3.5-MoE) over several sequences' states: the
oracle the engine's integration of these families is tested against. Not wired into the Engine.

    ref = HybridReference(cfg, canonical_from_hf(cfg, sd), ctx=256, device="cpu")
    st = ref.new_state(n_seq=2)
    a, b = ref.forward(st, [(0, 0, prompt_a), (1, 0, prompt_b)])      # (n_a, V), (n_b, V) float32 logits
    step = ref.forward(st, [(0, len(prompt_a), [tok])])[0]            # sequence 0 continues where it stopped

A sequence's state (HybridState) is, besides the KV of the attention layers, a conv window and a recurrent state
per DeltaNet layer. A recurrent state is only valid at the position it has reached: a segment continues its
sequence from exactly there, or starts it again at 0; it cannot be cut back to a prefix (keep snapshots for that).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.reference import experts_reference
from .deltanet import DeltaState, gated_deltanet
from .gated_attention import gated_attention
from .layers import rms_norm, rope_tables, swiglu
from .moe import combine
from .router import route


class KV:
    """The attention layers' keys and values, preallocated (n_seq, nkv, ctx, hd) per layer and written in place by
    (sequence, position): runtime/kv_cache.py's KVCache interface (k, v, write), which models/ does not import."""

    def __init__(self, n_layers: int, n_seq: int, ctx: int, n_kv: int, hd: int, dtype, device):
        self.k = [torch.zeros(n_seq, n_kv, ctx, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(n_seq, n_kv, ctx, hd, dtype=dtype, device=device) for _ in range(n_layers)]

    def write(self, layer: int, seq_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k[layer][seq_ids, :, positions] = k                                    # k, v: (T, nkv, hd)
        self.v[layer][seq_ids, :, positions] = v


class HybridState:
    """n_seq sequences' states: per DeltaNet layer a DeltaState with one row per sequence, per attention layer the
    KV's, and the position each sequence has reached."""

    def __init__(self, cfg: ModelConfig, n_seq: int, ctx: int, dtype, device):
        self.delta = {i: DeltaState.zeros(cfg, n_seq, dtype, device) for i in cfg.linear_layers}
        self.kv_slot = {i: j for j, i in enumerate(cfg.attention_layers)}     # layer -> its KVCache layer
        self.kv = KV(len(self.kv_slot), n_seq, ctx, cfg.n_kv_heads, cfg.head_dim, dtype, device)
        self.length = [0] * n_seq

    def reset(self, seq: int):
        """Sequence `seq` starts again: empty conv windows and states (its stale KV is never read)."""
        for st in self.delta.values():
            st.conv[seq].zero_()
            st.ssm[seq].zero_()
        self.length[seq] = 0


class HybridReference:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ctx: int, device="cpu"):
        self.cfg, self.w, self.ctx = cfg, weights, ctx
        self.layers = [{k[len(f"blk.{i}."):]: v for k, v in weights.items() if k.startswith(f"blk.{i}.")}
                       for i in range(cfg.n_layers)]
        self.cos, self.sin = rope_tables(cfg, ctx, device)        # (ctx, rotary_dim): the first rotary_dim dims
        self.lm_head = weights.get("output.weight", weights["token_embd.weight"])
        self.dtype, self.device = weights["token_embd.weight"].dtype, device

    def new_state(self, n_seq: int = 1) -> HybridState:
        return HybridState(self.cfg, n_seq, self.ctx, self.dtype, self.device)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n greedy tokens after the prompt ids, in a new state: the prompt in one forward, then a token at a time
        (the cached path a decode step takes)."""
        st = self.new_state()
        got = [int(self.forward(st, [(0, 0, ids)])[0][-1].argmax())]
        while len(got) < n:
            got.append(int(self.forward(st, [(0, st.length[0], [got[-1]])])[0][-1].argmax()))
        return got

    def _begin(self, state: HybridState, segments: list[tuple[int, int, list[int]]]):
        """Each segment's sequence started again (start 0) or checked to continue where it is -> the tokens (flat),
        each segment's length, and the rotary tables at their positions (T, rotary_dim)."""
        for seq, start, _ in segments:
            if start == 0:
                state.reset(seq)
            elif start != state.length[seq]:
                raise ValueError(f"sequence {seq} is at position {state.length[seq]}: a recurrent state cannot "
                                 f"continue from {start}")
        tokens = [t for _, _, toks in segments for t in toks]
        lens = [len(toks) for _, _, toks in segments]
        pos = torch.cat([torch.arange(s, s + n) for (_, s, _), n in zip(segments, lens)]).to(self.device)
        return tokens, lens, self.cos[pos].to(self.dtype), self.sin[pos].to(self.dtype)

    def forward(self, state: HybridState, segments: list[tuple[int, int, list[int]]], mode: str = "auto",
                trace: list | None = None) -> list[torch.Tensor]:
        """Each segment (seq, start, tokens) runs tokens at positions start.. of its sequence, which must be where
        the sequence is (or 0: it starts again) -> each segment's (n, V) float32 logits. Segments of one length
        run their DeltaNet layers as one batch. `mode` is gated_deltanet's; `trace`, if given, gets each layer's
        output (the residual stream, (T, H))."""
        cfg = self.cfg
        tokens, lens, cos, sin = self._begin(state, segments)
        h = self.w["token_embd.weight"][torch.tensor(tokens, device=self.device)]      # (T, H)
        for i, lw in enumerate(self.layers):
            a = rms_norm(h, lw["attn_norm.weight"], cfg.rms_norm_eps)
            if i in state.delta:
                h = h + self._deltanet(a, lw, state.delta[i], segments, lens, mode)
            else:
                parts, r = [], 0
                for (seq, start, _), n in zip(segments, lens):
                    parts.append(gated_attention(a[r:r + n], lw, cfg, cos[r:r + n], sin[r:r + n], state.kv,
                                                 state.kv_slot[i], seq, start))
                    r += n
                h = h + torch.cat(parts)
            m = rms_norm(h, lw["ffn_norm.weight"], cfg.rms_norm_eps)
            h = h + (self._dense(m, lw) if i in cfg.dense_layers else self._moe(m, lw))
            if trace is not None:
                trace.append(h)
        for (seq, start, _), n in zip(segments, lens):
            state.length[seq] = start + n
        logits = F.linear(rms_norm(h, self.w["output_norm.weight"], cfg.rms_norm_eps), self.lm_head).float()
        return list(logits.split(lens))

    def _deltanet(self, a, lw, st: DeltaState, segments, lens, mode) -> torch.Tensor:
        """The DeltaNet layer over every segment, reading and writing each one's state row."""
        rows = [seq for seq, _, _ in segments]
        if len(set(lens)) == 1 and len(set(rows)) == len(rows):     # one batch (B, n, H)
            idx = torch.tensor(rows, device=a.device)
            y, new = gated_deltanet(a.view(len(rows), lens[0], -1), lw, self.cfg,
                                    DeltaState(st.conv[idx], st.ssm[idx]), mode)
            st.conv[idx], st.ssm[idx] = new.conv, new.ssm
            return y.reshape(a.shape)
        parts, r = [], 0
        for seq, n in zip(rows, lens):
            y, new = gated_deltanet(a[None, r:r + n], lw, self.cfg,
                                    DeltaState(st.conv[seq:seq + 1], st.ssm[seq:seq + 1]), mode)
            st.conv[seq:seq + 1], st.ssm[seq:seq + 1] = new.conv, new.ssm
            parts.append(y[0])
            r += n
        return torch.cat(parts)

    def _dense(self, m, lw) -> torch.Tensor:
        return swiglu(m, lw["ffn_gate.weight"], lw["ffn_up.weight"], lw["ffn_down.weight"])

    def _moe(self, m, lw) -> torch.Tensor:
        """Softmax router, top-k (renormalised where the config says), the experts, a sigmoid-gated shared expert."""
        cfg = self.cfg
        weights, ids = route(m, lw["ffn_gate_inp.weight"], cfg.n_experts_used, cfg.norm_topk_prob)
        w13 = torch.cat([lw["ffn_gate_exps.weight"], lw["ffn_up_exps.weight"]], dim=1)     # (E, 2I, H)
        out = combine(experts_reference(m, ids, w13, lw["ffn_down_exps.weight"]), weights)
        if cfg.shared_expert_intermediate_size:
            shared = swiglu(m, lw["ffn_gate_shexp.weight"], lw["ffn_up_shexp.weight"], lw["ffn_down_shexp.weight"])
            out = out + torch.sigmoid(F.linear(m, lw["ffn_gate_inp_shexp.weight"])) * shared
        return out
