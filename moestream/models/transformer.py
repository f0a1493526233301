"""The decoder of every supported family, as math, built from the blocks its family's entry picks (arch/blocks.py,
models/blocks.py) with ModelConfig's options.

    model = MoETransformer(cfg, weights, rope=(cos, sin), blocks=FAMILIES[cfg.family].blocks)   # weights on device
    batch = Batch.make(segments, tokens, device, observer=observers)     # what changes per forward travels here
    logits = model.forward(batch, kv, experts, kernel)          # (R, V) float32 for batch.out_rows

Each layer: the residual block's add and norm, the layer's token mixer (an attention kind, models/attention.py, or
by layer_types a mixer such as the Gated DeltaNet, models/deltanet.py), the add and norm again, then the MoE block
(models/moe.py: the router block, the experts, the shared expert) or a dense MLP where `cfg.dense_layers` says.
Qwen3-MoE: GQA with per-head QK-norm. Qwen2-MoE: q/k/v biases and a sigmoid-gated shared expert. OLMoE: QK-norm
over the whole projection and optional clipping. Mixtral: none of these. Qwen3-Next and Qwen3.5-MoE: gated
attention between DeltaNet layers, whose states the cache (runtime/kv_cache.py's HybridCache) holds per sequence:
row s of conv[i] and ssm[i] is sequence s's, read at each segment's sequence and written back, the cache checking
positions and resetting restarted sequences before the forward (HybridCache.begin). Qwen3.8-Flash-Next: QSA
attention (models/qsa.py), hyper-connections for the residual (models/residual.py's Hyper: the streams, each
block's input mixed from them, its output written back by gates) and, on its PLE layer, n-gram embeddings gathered
from a table in host memory (models/ple.py's PLE); its cache (Qwen4Cache) holds the indexer's keys, each
sequence's n-gram context and PLE conv rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..arch.blocks import Blocks
from ..config import ModelConfig
from ..kernels.delta_reference import DeltaKernels
from ..kernels.host_arrays import upload
from .blocks import build
from .layers import swiglu
from .moe import guess, moe_experts, moe_route
from .mtp import mtp_input, mtp_io, mtp_streams
from .ple import PLE
from .router import fused_options, fuses as router_fuses

MAX_AHEAD = 4                   # lookahead guesses reach at most this many MoE layers ahead


@dataclass
class Segment:
    """`n` consecutive tokens of sequence `seq` at positions start..start+n-1."""
    seq: int
    start: int
    n: int


@dataclass
class Batch:
    """One forward's tokens: segments of several sequences, each at its own position in its own KV cache."""
    tokens: torch.Tensor           # (T,) int64 on the device, segments concatenated
    segments: list[Segment]
    seq_ids: torch.Tensor          # (T,) int64: each token's sequence
    positions: torch.Tensor        # (T,) int64: each token's position
    out_rows: torch.Tensor         # (R,) int64: the rows whose logits are wanted
    kv_len: int | None = None      # decode: keys attended, masked past each token's position (None: the context)
    # What the caller decides per forward (runtime/decode.py for decode steps); the model reads, never keeps them.
    by_address: object = None      # zero-copy decode step: fn(x, addrs, weights, inter, landing) -> (T, H)
    fused: object = None           # kernels.fused for a decode step on CUDA: norms, rotary, cache writes, top-k
    observer: object = None        # a RouteObserver (experts/routing.py) told each MoE layer's routing, or None
    # Multi-token prediction (models/mtp.py): a head step reads `head`, the hidden states (T, H) beside its tokens,
    # through the MTP head's block instead of the trunk; keep_hidden: the forward leaves every token's post-norm
    # hidden state (T, H) in `hidden` (what the next head step reads; hyper-connections: the streams before the
    # output mixer, (T, hc*H)).
    head: torch.Tensor | None = None
    keep_hidden: bool = False
    keep_states: bool = False      # a verify step: recurrent layers keep each token's state of each segment of
                                   # several tokens (models/deltanet.py), for kv.rollback
    hidden: torch.Tensor | None = None
    # A head step: the trunk's MoE layers whose routers guess, from each segment's last token's MoE input, the
    # experts of the verify step's first layers (experts/prefetch.py's draft seed); the forward leaves them in
    # `guesses` (len(guess_layers), B*k) expert ids, k for each segment's last token.
    guess_layers: tuple[int, ...] = ()
    guesses: torch.Tensor | None = None

    @staticmethod
    def make(segments: list[Segment], tokens: list[int] | torch.Tensor, device, all_logits: bool = False,
             kv_len: int | None = None, by_address=None, fused=None, observer=None, logits: bool = True,
             head: torch.Tensor | None = None, keep_hidden: bool = False, keep_states: bool = False,
             guess_layers: tuple[int, ...] = ()) -> "Batch":
        """all_logits: every token's logits, else each segment's last token's; logits=False: none (a part of a
        prompt's batch before its last, models/transformer.py's forward_parts). tokens: ids, or a (T,) tensor of
        them on the device (a decode step's sampled tokens, not read back)."""
        on_device = tokens if isinstance(tokens, torch.Tensor) else None
        if on_device is not None:
            tokens = [0] * len(on_device)
        seq_ids, pos, last = [], [], []
        for s in segments:
            seq_ids += [s.seq] * s.n
            pos += range(s.start, s.start + s.n)
            last.append(len(pos) - 1)
        rows = (list(range(len(pos))) if all_logits else last) if logits else []
        flat = upload(np.array(tokens + seq_ids + pos + rows, dtype=np.int64), torch.device(device))  # no wait
        T = len(tokens)
        return Batch(flat[:T] if on_device is None else on_device, segments, flat[T:2 * T], flat[2 * T:3 * T],
                     flat[3 * T:], kv_len, by_address, fused, observer, head, keep_hidden, keep_states,
                     guess_layers=tuple(guess_layers))

    def move(self, device) -> None:
        """The batch's index tensors onto `device`, where the next share of a split runs (runtime/split.py)."""
        self.seq_ids, self.positions, self.out_rows = (t.to(device) for t in (self.seq_ids, self.positions,
                                                                              self.out_rows))

    @property
    def is_decode(self) -> bool:
        """Every segment is one token: attention runs batched over sequences."""
        return all(s.n == 1 for s in self.segments)


class MoETransformer:
    @staticmethod
    def capturable_for(cfg: ModelConfig, ple_in_place: bool = False, qsa_kernels: bool = False) -> bool:
        """Whether a decode step may be captured in a CUDA graph (runtime/decode.py). A DeltaNet's states are
        gathered and written back by the step's device tensor of sequences (no host sync); the engine checks and
        advances each sequence's position around every replay (GraphDecode), and a graph's warm-up leaves the states
        as they were (HybridCache.kept). A PLE layer only where its table is read in place (ple_in_place: a pinned
        tensor, or a GGUF's quantized blocks pinned: models/ple.py's readable_in_place; its step's rows hashed and
        gathered on the device); else its rows are picked and gathered on the host from the step's tokens read back
        (a table left mapped from its GGUF). QSA only with its CUDA kernels (qsa_kernels, kernels/qsa.py: they read
        nothing back); its torch form slices each sequence's cache by its host-known position."""
        return (not cfg.ple_layers or ple_in_place) and (not cfg.indexer_heads or qsa_kernels)

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 blocks: Blocks = Blocks(), delta: DeltaKernels | None = None, split=None, qsa=None):
        """blocks: the family's (arch/families.py); delta: a DeltaNet mixer's kernels (kernels/delta.py picks;
        None: the plain-torch references); qsa: QSA's kernels (kernels/qsa.py picks; None: the torch form).
        weights: on the device but the PLE table (per_layer_token_embd), which the loader leaves in host memory.
        split: where the layers are split over several devices (runtime/split.py's Split; each layer's weights on
        its device, the embeddings on the first, the final norm and lm_head on the last), or None: one device."""
        self.cfg, self.split = cfg, split
        built = build(cfg, blocks, delta, qsa)
        self.attention, self.mixers, self.router, self.residual = (built.attention, built.mixers, built.router,
                                                                   built.residual)
        self.mlp = blocks.experts
        weights = dict(weights)
        table = weights.pop("per_layer_token_embd.weight", None)
        self.ple = PLE(cfg, table) if cfg.ple_layers else None
        self.capturable = self.capturable_for(cfg, self.ple is not None and self.ple.table.in_place, qsa is not None)
        # layer -> its KV cache layer; an MTP head's after the trunk's
        self.kv_slot = {i: j for j, i in enumerate(cfg.attention_layers + cfg.head_layers)}
        # the layers' tensors live in self.layers only: what __init__ concatenates there does not keep its parts
        self.w = {n: t for n, t in weights.items() if not n.startswith("blk.")}
        self.layers = [{k[len(f"blk.{i}."):]: v for k, v in weights.items() if k.startswith(f"blk.{i}.")}
                       for i in range(cfg.n_stored_layers)]       # the trunk's, then the MTP heads'
        for lw in self.layers:          # q, k and v in one GEMM: one launch and one pass over x instead of three
            for kind in ("weight", "bias"):       # (latent attention has attn_q alone: left as it is)
                if all(f"attn_{n}.{kind}" in lw for n in "qkv"):
                    lw[f"attn_qkv.{kind}"] = torch.cat([lw.pop(f"attn_{n}.{kind}") for n in "qkv"])
        self.cos, self.sin = rope                                            # (P, hd) float32 each
        self.lm_head = weights.get("output.weight", weights["token_embd.weight"])
        if cfg.qk_norm == "head":       # the fused decode kernel takes both head norms' weights in one tensor
            for lw in self.layers:
                if "attn_q_norm.weight" in lw:
                    lw["attn_qk_norm.weight"] = torch.cat([lw["attn_q_norm.weight"], lw["attn_k_norm.weight"]])
        for lw in self.layers:          # gpt-oss's expert biases as the kernels add them: (E, 2I) gate | up
            if "ffn_gate_exps.bias" in lw:
                lw["ffn_gate_up_exps.bias"] = torch.cat([lw.pop("ffn_gate_exps.bias"), lw.pop("ffn_up_exps.bias")], 1)
        moe = cfg.moe_layers            # the routers of the next MoE layers, for lookahead (split: on the same
        # device, whose cache copies their experts ahead)
        self.next_routers = {a: tuple(self.layers[b]["ffn_gate_inp.weight"] for b in moe[i + 1:i + 1 + MAX_AHEAD]
                                      if split is None or split.index(b) == split.index(a))
                             for i, a in enumerate(moe)} | {h: () for h in cfg.head_layers}
        for mixer, lw in zip(self.mixers, self.layers):
            mixer.prepare(lw)

    def forward(self, batch: Batch, kv, experts, kernel) -> torch.Tensor:
        """(R, V) float32 logits of batch.out_rows. The batch says how its experts are read (fetched through
        `experts` and run by `kernel`, or, a zero-copy decode step, `batch.by_address`), whether the fused decode
        ops run (`batch.fused`) and who sees the routing (`batch.observer`)."""
        return self.forward_parts([batch], kv, experts, kernel)

    def forward_parts(self, parts: list[Batch], kv, experts, kernel) -> torch.Tensor:
        """forward() of consecutive ubatches of one prompt, layer by layer: each layer runs over every part before
        the next layer does, so a host layer's experts are fetched once for all the parts (moe.py), not once a
        part. Each part's ops are those of a forward of its own, with the same shapes: the same bits as forwards
        one part after the other (a part's attention reads the keys its predecessors wrote in the layer, and a
        DeltaNet layer's state continues from theirs, before it runs). The logits of each part's out_rows, in
        order. A decode step is one part; the first part's by_address, fused and observer serve all."""
        return drain(self.layer_steps(parts, kv, experts, kernel))

    def layer_steps(self, parts: list[Batch], kv, experts, kernel):
        """forward_parts as a generator: it yields each layer's index once the layer's work is queued and returns
        the logits (StopIteration.value; `drain` runs it through). Between two layers the caller may run other
        sequences' forwards (the server's decode steps while a prompt batch is read): these parts' state is this
        generator's alone, so their ops and bits are those of forward_parts."""
        flow = self.begin_flow(parts, kv)
        for dev, run in [(None, flow.layers)] if self.split is None else self.split.runs(flow.layers):
            if dev is not None:         # a device's share of a split: the activations cross to it here, and only here
                dev.make_current()
                flow.cross(dev.torch)
            yield from self.run_layers(flow, run, kv, experts, kernel)
        logits = self.end_flow(flow)
        if self.split is not None:      # the logits back to the first device, where the sampler and the next step are
            self.split.devices[0].make_current()
            logits = logits.to(self.split.devices[0].torch)
        return logits

    def begin_flow(self, parts: list[Batch], kv) -> "Flow":
        """A forward's parts before its first layer: the embeddings, rotary rows and masks (layer_steps)."""
        cfg = self.cfg
        fused = parts[0].fused
        res = self.residual
        head = parts[0].head is not None        # an MTP head step: its block, from the embeddings and hidden states
        layers = cfg.head_layers[:1] if head else range(cfg.n_layers)
        # a head's own embedding and output head where it has them (DeepSeek-V3's, GLM-4.5's), else the trunk's
        embed, lm_head = mtp_io(self.layers[layers[0]], self.w["token_embd.weight"], self.lm_head) if head else \
            (self.w["token_embd.weight"], self.lm_head)
        xs = [embed[p.tokens] for p in parts]                                # (T, H) each
        if head and cfg.hc_count:       # hyper-connections: the head's input streams, one eh_proj a stream
            hs = [mtp_streams(x, p.head, self.layers[layers[0]], cfg.rms_norm_eps, cfg.hc_count)
                  for p, x in zip(parts, xs)]                               # (T, hc*H) each
        else:
            if head:
                xs = [mtp_input(x, p.head, self.layers[layers[0]], cfg.rms_norm_eps) for p, x in zip(parts, xs)]
            hs = [res.expand(x) for x in xs]                                 # (T, H) each (hyper: hc*H)
        # the PLE layer's n-gram embeddings, gathered on the host from each sequence's context (advanced now)
        embs = [self.ple.embeddings(p, kv) for p in parts] if self.ple is not None and not head else None
        rope = [(self.cos[p.positions].to(h.dtype), self.sin[p.positions].to(h.dtype)) for p, h in zip(parts, hs)]
        masks = [None] * len(parts)
        for j, p in enumerate(parts):
            if p.is_decode and not self.attention.fuses(fused):   # the keys each token attends, for every layer
                n = p.kv_len or kv.ctx
                masks[j] = torch.arange(n, device=hs[j].device)[None, :] <= p.positions[:, None]     # (B, n)
        # deltas: each part's last block output, not yet added to its residual stream; gates: what each part's
        # block output needs back (hyper: the streams' gates)
        return Flow(parts, layers, head, lm_head, embs, hs, [None] * len(parts), [None] * len(parts), masks, rope)

    def run_layers(self, flow: "Flow", run, kv, experts, kernel):
        """Layers `run` (consecutive, on the current device) over `flow`, yielding each one's index once queued."""
        cfg, parts, res = self.cfg, flow.parts, self.residual
        by_address, fused, observer = parts[0].by_address, parts[0].fused, parts[0].observer
        hs, deltas, gates, masks, rope = flow.hs, flow.deltas, flow.gates, flow.masks, flow.rope
        head, embs = flow.head, flow.embs
        for i in run:
            lw = self.layers[i]
            for j, p in enumerate(parts):
                if i in cfg.ple_layers:     # the n-gram embeddings added into the streams before the layer's mixer
                    hs[j], deltas[j] = res.add(hs[j], deltas[j]), None
                    hs[j] = hs[j] + self.ple.add(hs[j], embs[j], lw, p, kv, i)
                hs[j], a, gates[j], proj = self._norm_project(hs[j], deltas[j], lw, i, fused)
                deltas[j] = res.block_output(self.mix(a, lw, i, p, kv, *rope[j], masks[j], fused, proj), gates[j])
            if i in cfg.dense_layers:
                for j in range(len(parts)):
                    hs[j], m, gates[j] = res.block_input(hs[j], deltas[j], lw, "ffn", fused)
                    deltas[j] = res.block_output(swiglu(m, lw["ffn_gate.weight"], lw["ffn_up.weight"],
                                                        lw["ffn_down.weight"]), gates[j])
                yield i
                continue
            routed = addrs = None
            ms = []
            for j in range(len(parts)):
                if fused is not None and res.fuses and router_fuses(self.router):   # a decode step: the add,
                    # norm, router, top-k and addresses in one launch (models/router.py's `fuses`)
                    table = experts.address_table(i) if by_address is not None else None
                    hs[j], m, *routed, addrs = fused.norm_route(hs[j], deltas[j], lw["ffn_norm.weight"],
                                                                cfg.rms_norm_eps, lw["ffn_gate_inp.weight"],
                                                                cfg.n_experts_used, cfg.norm_topk_prob, hs[j].dtype,
                                                                table, **fused_options(self.router, lw))
                else:
                    hs[j], m, gates[j] = res.block_input(hs[j], deltas[j], lw, "ffn", fused)
                ms.append(m)
            weights, ids, ahead = moe_route(ms, lw, i, cfg, experts, observer, self.next_routers[i], routed,
                                            self.router)
            if head and parts[-1].guess_layers:     # the verify step's first layers' experts, from each
                step = parts[-1]                        # segment's last token
                x = ms[-1][step.out_rows]               # (B, H); the routers may be on another device (split)
                step.guesses = torch.stack([guess(x, self.layers[l]["ffn_gate_inp.weight"].to(x.device),
                                                  cfg.n_experts_used).flatten() for l in step.guess_layers])
            outs = moe_experts(ms, lw, i, cfg, experts, kernel, weights, ids, ahead, by_address, fused, addrs,
                               self.mlp)
            deltas[:] = [res.block_output(o, g) for o, g in zip(outs, gates)]
            yield i

    def end_flow(self, flow: "Flow") -> torch.Tensor:
        """The logits of the parts' out_rows after their last layer (on the last layer's device), in order."""
        res, outs = self.residual, []
        final_w = self._final_weights(flow.layers[0]) if flow.head else self.w
        for p, h, delta in zip(flow.parts, flow.hs, flow.deltas):
            if p.keep_hidden:           # what a head step reads of every token (T, H) (hyper: the streams, hc*H)
                p.hidden = res.head_read(h, delta, final_w)
            if len(p.out_rows):         # (a shape, known on the host)
                h = res.read_out(p.hidden[p.out_rows], final_w) if p.keep_hidden else \
                    res.final(h, delta, final_w, p.out_rows)
                outs.append(F.linear(h, flow.lm_head).float())               # (R, V)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _final_weights(self, head: int) -> dict:
        """MTP head layer `head`'s final norm under the model's names: its shared_head_norm as output_norm, or (hyper)
        its output mixer nextn.hc_head_* as output_hc_*."""
        lw = self.layers[head]
        if self.cfg.hc_count:
            return {f"output_hc_{t}.weight": lw[f"nextn.hc_head_{t}.weight"] for t in ("norm", "down", "up")}
        return {"output_norm.weight": lw["nextn.shared_head_norm.weight"]}

    def _norm_project(self, h, delta, lw, layer, fused):
        """The residual add and the mixer's input: (h, x, what its output needs back, None); in a one-token fused
        step of a plain residual, with the mixer's input projection (`in_proj`) in the same launch: (h, x, None,
        the projection of x)."""
        w = self.mixers[layer].in_proj(lw)
        if fused is None or not self.residual.fuses or delta is None or h.shape[0] != 1 or w is None:
            return (*self.residual.block_input(h, delta, lw, "attn", fused), None)
        h, x, proj = fused.norm_linear(h, delta, lw["attn_norm.weight"], self.cfg.rms_norm_eps, lw[f"{w}.weight"],
                                       lw.get(f"{w}.bias"))
        return h, x, None, proj

    def mix(self, x, lw, layer, batch: Batch, kv, cos, sin, mask=None, fused=None, proj=None) -> torch.Tensor:
        """Layer `layer`'s token mixer on the normed residual stream x (T, H) -> (T, H): the attention kind on KV
        layer kv_slot[layer], or the mixer (its states are the layer's own). proj: the mixer's input projection of
        x, where the step computed it with the norm (_norm_project)."""
        mixer = self.mixers[layer]
        index = self.kv_slot[layer] if mixer is self.attention else layer
        return mixer(x, lw, index, batch, kv, cos, sin, mask, fused, proj)


@dataclass
class Flow:
    """A forward between two of its layers (MoETransformer.begin_flow, run_layers, end_flow): its parts and what it
    decided before its first layer, and what crosses between the shares of a split (`crossing`): each part's
    residual stream, last block output not yet added, that output's gate (None where a part has none), attention
    mask and rotary rows."""
    parts: list[Batch]
    layers: object                 # the layers it runs: the trunk's, or an MTP head's
    head: bool
    lm_head: torch.Tensor
    embs: list | None              # the PLE layer's n-gram embeddings, each part's
    hs: list
    deltas: list
    gates: list
    masks: list
    rope: list                     # [(cos, sin)], each part's

    def crossing(self) -> list:
        """The tensors that cross to the next share, in one order (None where a part has none)."""
        return [*self.hs, *self.deltas, *self.gates, *self.masks, *(t for r in self.rope for t in r)]

    def take(self, tensors: list) -> None:
        """Put `tensors` (crossing's order) in place of what crosses."""
        n = len(self.parts)
        self.hs, self.deltas, self.gates, self.masks = (list(tensors[i * n:(i + 1) * n]) for i in range(4))
        r = tensors[4 * n:]
        self.rope = [(r[2 * j], r[2 * j + 1]) for j in range(n)]

    def cross(self, device) -> None:
        """The activations and the parts' index tensors onto `device` (Batch.move)."""
        self.take([_to(t, device) for t in self.crossing()])
        for p in self.parts:
            p.move(device)


def _to(t, device):
    """A part's activation (a tensor, or None where it has none yet) on `device`."""
    return None if t is None else t.to(device)


def drain(steps):
    """Run a generator through; its return value (a forward's logits from MoETransformer.layer_steps)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
