"""The engine: load a WeightSource, place its weights, and run forwards in ubatches.

    src = open_source("synth:tiny")
    ecfg = resolve(flags.apply(EngineConfig(), cpu_moe=True), src.dtype_of("token_embd.weight"))  # runtime/plan.py
    eng = load_engine(src, ecfg)                                  # runtime/load.py builds the engine
    logits = eng.prefill(seq=0, tokens=[1, 2, 3], start=0)        # (1, V): the last token's logits
    logits = eng.decode([(0, token, pos)])                        # (B, V): one token per sequence

Attention, norms, routers, embeddings and the KV cache live on the device; routed experts live on the device or,
for host layers (--cpu-moe / --n-cpu-moe), in pinned host memory behind an expert provider. On CUDA a decode step
reads each expert where it lies (zero-copy decode, experts/zero_copy.py) and runs as one CUDA graph; how decode
steps run is the decode plan, decided once at setup (runtime/plan.py) and handed to the engine, which builds its
decode path from it (runtime/decode.py), and to the host provider.

Hybrid families (Qwen3-Next, Qwen3.5-MoE: models/deltanet.py) keep, besides the KV of their attention layers, a conv
window and a recurrent state per DeltaNet layer and sequence (runtime/kv_cache.py's HybridCache): a forward's
segment must continue its sequence from where its state stopped, or start it again at position 0, and a new
prompt reuses a sequence's cache only as an exact continuation (reusable_prefix).
"""
from __future__ import annotations

import time

import torch

from .. import flags
from ..config import ModelConfig
from ..engine_config import EngineConfig
from ..device import Device
from ..errors import UserError
from ..experts.prefetch import DRAFT_SEED_LAYERS
from ..experts.routing import RouteObserver, RouteObservers, RoutingStore
from ..arch.families import FAMILIES
from ..kernels import AddressBook, by_address_kernels, pick_decode_kernel
from ..kernels.decode import MAX_TOKENS
from ..models.transformer import Batch, MoETransformer, Segment
from .decode import EagerDecode, decode_path
from .kv_cache import KVCache
from .engine_heads import EngineHeads
from .engine_reports import EngineReports
from .placement import fit_cache, host_provider
from .plan import DecodePlan, decode_plan
from .prompt_batch import segments_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MiB = 1 << 20


class Engine(EngineHeads, EngineReports):
    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, model: MoETransformer, experts, kv: KVCache,
                 kernel, device: Device, plan: DecodePlan, host=None, book: AddressBook | None = None,
                 routing: RoutingStore | None = None, quantized: bool = False, split=None):
        self.cfg, self.ecfg, self.model, self.experts, self.kv = cfg, ecfg, model, experts, kv
        self.kernel, self.device, self.plan = kernel, device, plan
        self.split = split              # runtime/split.py's Split where the layers are split over several devices
        self.host = host                # the HostProvider of host layers (experts/upload.py, cache.py, buffered.py)
        self.dtype = model.lm_head.dtype
        self.quantized = quantized      # expert rows are GGUF blocks, dequantized as kernels read them
        self.book = book or AddressBook()
        # Per-context routing counts (/slots, and the cache's prefetch seeds when there is a cache: the same store).
        self.routing = routing if routing is not None else RoutingStore(cfg.n_layers, cfg.n_experts, kv.n_seq,
                                                                         device.torch)
        self.observers = RouteObservers([self.routing])   # routing traces and statistics (experts/routing.py)
        # The kernels of decode steps of up to MAX_TOKENS tokens, which the decode path puts on each step's batch
        # (the model is not changed after load). Zero-copy decode reads each expert where it lies, on every
        # placement alike (so a cached decode gives the all-GPU bits); None: decode steps fetch their experts.
        layouts = [experts.layout(l) for l in cfg.moe_layers]
        self.decode_kernel = pick_decode_kernel(plan.zero_copy, device.torch, self.dtype, self.book, layouts)
        from ..kernels import fused
        # Norms, rotary, cache writes and top-k fused (CUDA), in every decode path alike: the same bits.
        takes = fused.fused_available(device.torch, self.dtype) and model.attention.takes_fused()
        self.fused = fused if takes else None
        self.eager = EagerDecode(self)      # the plain path; also every step the chosen path does not take
        # MTP head steps guess the verify step's first host MoE layers' experts, which the cache copies ahead from
        # the verify step's start (experts/prefetch.py's draft seed); the guesses of the head steps since the last
        # forward, (layers, k) ids each
        takes = host is not None and host.takes_seeds and cfg.nextn_layers
        self.seed_layers = tuple(l for l in sorted(ecfg.placement.host_layers(cfg)) if l in cfg.moe_layers
                                 )[:DRAFT_SEED_LAYERS] if takes else ()
        self.draft_guesses: list[torch.Tensor] = []
        self._setup_decode()

    # --- forwards ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, segments: list[Segment], tokens: list[int] | torch.Tensor, all_logits: bool = False,
                is_prompt: bool = False, kv_len: int | None = None, by_address=None, fused=None,
                observed: bool = True, hidden: list | None = None, keep_states: bool = False) -> torch.Tensor:
        """One eager forward. by_address, fused: a decode step's kernels (runtime/decode.py). observed: the route
        observers see its routing (in a zero-copy step with host experts the provider reports it instead).
        hidden: a list that gets every token's post-norm hidden state (T, H) (what an MTP head reads);
        keep_states: recurrent layers keep each token's state, for kv.rollback (a speculative verify step; the cache
        copies ahead the experts the head steps since the last forward guessed for its first layers)."""
        observer = self.observers if observed else None
        self.kv.check_ubatch(segments)
        batch = Batch.make(segments, tokens, self.device.torch, all_logits, kv_len, by_address, fused, observer,
                           keep_hidden=hidden is not None, keep_states=keep_states)
        guesses, self.draft_guesses = self.draft_guesses, []
        if keep_states and guesses:         # a verify step: its drafts' guesses go ahead of it
            self.host.seed_next(self._seed(guesses))
        logits = self._run(segments, [batch], is_prompt, observer)
        if hidden is not None:
            hidden.append(batch.hidden)
        return logits

    def _run(self, segments: list[Segment], batches: list[Batch], is_prompt: bool, observer) -> torch.Tensor:
        """The model's forward of `batches` (their segments: `segments`), with the cache and the providers and
        observers told around it, each of them once for all the batches' tokens."""
        self._begin(segments, is_prompt, observer)
        logits = self.model.forward_parts(batches, self.kv, self.experts, self.kernel)
        self.kv.end(segments)
        return logits

    def _begin(self, segments: list[Segment], is_prompt: bool, observer, states: bool = True) -> None:
        """states=False: a forward that touches no recurrent state (an MTP head step's)."""
        seq, n = segments[0].seq, sum(s.n for s in segments)
        # A recurrent state: each segment continues its sequence, or starts it again at 0 (checked before any
        # provider or observer starts a ubatch; a failed check changes nothing).
        if states:
            self.kv.begin(segments)
        # each token's sequence: a decode step's, and a prompt batch's of several sequences (their prompts' tails)
        several = not is_prompt or any(s.seq != seq for s in segments)
        seqs = [s.seq for s in segments for _ in range(s.n)] if several else None
        if self.host is not None:
            self.host.begin_ubatch(seq, n, is_prompt, seqs)
        if observer is not None:
            observer.begin_ubatch(seq, n, is_prompt, seqs)

    def check_context(self, n_tokens: int) -> None:
        if n_tokens > self.kv.ctx:
            raise UserError(f"the prompt and its continuation need {n_tokens} positions but the context is "
                            f"{self.kv.ctx}; raise -c/--ctx-size or shorten the prompt")

    def prefill(self, seq: int, tokens: list[int], start: int = 0, all_logits: bool = False,
                hidden: list | None = None) -> torch.Tensor:
        """Run `tokens` of sequence `seq` from position `start`, in batches of -b tokens cut into ubatches of -ub;
        logits of the last (or every) token. With host experts a batch runs layer by layer (forward_parts: each
        host layer's experts cross the link once a batch, not once a ubatch; the same bits), unless
        --no-batch-by-layer. hidden: a list that gets each ubatch's post-norm hidden states (an MTP head's input)."""
        self.check_context(start + len(tokens))
        if not tokens:
            raise UserError("empty prompt: give at least one token")
        b, ub = self.ecfg.batching.batch_size, self.ecfg.batching.ubatch
        # All on the device nothing crosses the link: a batch's ubatches run one after the other there.
        by_layer = self.host is not None and self.ecfg.batching.by_layer
        outs = []
        for i in range(0, len(tokens), b):
            last = i + b >= len(tokens)
            batch = tokens[i:i + b]         # ubatches cut within the batch, as llama.cpp's (the last may be short)
            parts = [(start + i + j, batch[j:j + ub]) for j in range(0, len(batch), ub)]
            if by_layer and len(parts) > 1:
                out = self.forward_parts([(seq, s, t) for s, t in parts], all_logits, hidden=hidden)
            else:
                each = [self.forward([Segment(seq, s, len(t))], t, all_logits, is_prompt=True, hidden=hidden)
                        for s, t in parts]
                out = torch.cat(each) if all_logits and len(each) > 1 else each[-1]
            if all_logits or last:
                outs.append(out)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def prefill_parts(self, parts: list[tuple[int, int, list[int]]], all_logits: bool = False,
                      hidden: list | None = None) -> list[torch.Tensor]:
        """Prompt ubatches of one or several sequences as one batch (the server's: the next ubatch of each prompt
        being read; perplexity's chunks): parts (seq, start, tokens), each at most -ub tokens, a sequence's parts
        consecutive and in order. Each part's ops are those of a forward of its own (the same bits as
        engine.prefill of the part); with host experts the parts run layer by layer, so a host layer's experts
        cross the link once for all of them. Each part's last token's logits (1, V), or every token's (n, V)
        with all_logits, in order. hidden: a list that gets each part's post-norm hidden states (an MTP head's)."""
        whole = self._segments(parts)
        if self.host is not None and self.ecfg.batching.by_layer:
            out = self.forward_parts(parts, all_logits, every_part=True, whole=whole, hidden=hidden)
            return list(out.split([len(t) for _, _, t in parts] if all_logits else 1))
        # all on the device nothing crosses the link: the parts run one after the other
        return [self.forward([Segment(q, s, len(t))], t, all_logits, is_prompt=True, hidden=hidden)
                for q, s, t in parts]

    def _segments(self, parts: list[tuple[int, int, list[int]]]) -> list[Segment]:
        """segments_of(parts), each within the context (one-line UserErrors otherwise)."""
        whole = segments_of(parts, self.ecfg.batching.ubatch)
        for seg in whole:
            self.check_context(seg.start + seg.n)
        return whole

    @torch.inference_mode()
    def forward_parts(self, parts: list[tuple[int, int, list[int]]], all_logits: bool = False,
                      every_part: bool = False, whole: list[Segment] | None = None,
                      hidden: list | None = None) -> torch.Tensor:
        """Prompt ubatches (seq, start, tokens) as one forward, layer by layer (models/transformer.py's
        forward_parts): the providers and observers see one ubatch of all their tokens. The logits of every token
        (all_logits), of each part's last token (every_part), or of the last part's last token. whole:
        segments_of(parts), where the caller has it. hidden: as forward's, a part after another."""
        whole = whole or segments_of(parts, self.ecfg.batching.ubatch)
        batches = self._part_batches(parts, all_logits, every_part, hidden is not None)
        logits = self._run(whole, batches, True, self.observers)
        if hidden is not None:
            hidden += [b.hidden for b in batches]
        return logits

    def _part_batches(self, parts, all_logits: bool, every_part: bool, keep_hidden: bool = False) -> list[Batch]:
        self.kv.check_ubatch([Segment(q, s, len(t)) for q, s, t in parts])
        return [Batch.make([Segment(q, s, len(t))], t, self.device.torch, all_logits, observer=self.observers,
                           logits=all_logits or every_part or k == len(parts) - 1, keep_hidden=keep_hidden)
                for k, (q, s, t) in enumerate(parts)]

    @property
    def pauses_prompts(self) -> bool:
        """Whether prompt_steps may pause a prompt batch between layers: the host provider keeps its ubatch's
        state aside (ExpertProvider.pauses), and no observer but the routing counts sees forwards (a routing trace
        records whole ubatches)."""
        return ((self.host is None or self.host.pauses) and len(self.observers.observers) == 1
                and self.split is None)     # a split's forward leaves its first device current only at its end

    @torch.inference_mode()
    def prompt_steps(self, parts: list[tuple[int, int, list[int]]], every: int, hidden: list | None = None):
        """prefill_parts as steps (a generator): it pauses (yields) after every `every` layers and returns what
        prefill_parts returns. While it is paused the caller may run decode steps of other sequences (the server,
        so that reading a prompt batch does not stall the requests generating): the host provider's prompt state
        is set aside meanwhile (ExpertProvider.suspend / resume). The parts run layer by layer as in
        forward_parts, with its ops: the same bits as prefill_parts. Only where pauses_prompts."""
        whole = self._segments(parts)
        batches = self._part_batches(parts, False, True, hidden is not None)
        self._begin(whole, True, self.observers)
        layers = self.model.layer_steps(batches, self.kv, self.experts, self.kernel)
        while True:
            try:
                layer = next(layers)
            except StopIteration as done:
                logits = done.value
                break
            if (layer + 1) % every == 0 and layer + 1 < self.cfg.n_layers:
                state = self.host.suspend() if self.host is not None else None
                yield layer
                if self.host is not None:
                    self.host.resume(state)
        self.kv.end(whole)
        if hidden is not None:
            hidden += [b.hidden for b in batches]
        return list(logits.split(1))

    def decode(self, steps: list[tuple[int, int, int]], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of several sequences: steps = [(seq, token, position)] -> (B, V) logits. tokens: the
        steps' tokens as a (B,) tensor on the device instead (sampled from the last step's logits and not read
        back: the step is queued before the host knows them, so the device never waits for the host between
        steps; the steps' own token ints are then ignored)."""
        for _, _, pos in steps:
            self.check_context(pos + 1)
        self.kv.check([Segment(s, p, 1) for s, _, p in steps])   # before the decode path starts the step
        if not self.decoder.takes(len(steps)) and len(steps) > MAX_TOKENS:
            # More tokens than a zero-copy step takes (-np above MAX_TOKENS): several such steps, each as fast as
            # one, rather than one eager step that decides on the host between layers.
            part = lambda i: (steps[i:i + MAX_TOKENS], None if tokens is None else tokens[i:i + MAX_TOKENS])
            return torch.cat([self.decode(*part(i)) for i in range(0, len(steps), MAX_TOKENS)])
        span = self.kv.span(max(p for _, _, p in steps) + 1)
        path = self.decoder if self.decoder.takes(len(steps)) else self.eager
        return path.run(steps, span, tokens)

    def warm_up_decode(self, n_seq: int) -> None:
        """Capture the decode graphs of 1..n_seq sequences at every span now, rather than in the middle of serving
        (a capture stalls every running request): steps of token 0 at each span's last position on sequences
        0..n_seq-1. They belong to no sequence (kv.kept: a recurrent state is put back; KV writes land where no
        request has been yet). Nothing to do where decode steps are not captured."""
        if not self.decoder.captures:
            return
        with self.kv.kept():
            for span in self.kv.spans():
                for b in range(1, n_seq + 1):
                    self.decode([(i, 0, span - 1) for i in range(b)])
        self.synchronize()

    @property
    def reuses_prefix_exactly_only(self) -> bool:
        """Whether a sequence's cache can only be continued, not cut back (a hybrid model's recurrent states)."""
        return self.kv.exact_prefix_only

    def reusable_prefix(self, cached: list[int], prompt: list[int], seq: int | None = None) -> int:
        """How many leading tokens of `prompt` need not run again on sequence `seq` whose cache holds `cached` (its
        tokens from position 0): the common prefix (at most all but the prompt's last token) for a KV cache; for a
        hybrid model all of `cached` where the prompt extends it, else 0 (its states cannot be cut back); with
        sliding layers' rings the common prefix where the ring still holds the window before it, else 0
        (runtime/sliding_kv.py)."""
        return self.kv.reusable_prefix(cached, prompt, seq)

    @property
    def reports_decode_routing(self) -> bool:
        """Whether decode steps report their routing to the route observers: eager forwards and steps with host
        experts do (zero-copy steps once queued); a replayed all-GPU graph does not."""
        return self.decoder.reports_routing

    def begin_prompt(self, seq: int = 0) -> None:
        """Start the per-prompt counters (a prompt and the decode that follows it) and the context's routing
        counts in self.routing (this prompt's become the previous prompt's: the cache's prompt counts, through the
        cache, and the request counts /slots shows, through the observers)."""
        if self.host is not None:
            self.host.begin_prompt(seq)
        self.observers.begin_prompt(seq)

    def observe(self, observer: RouteObserver) -> None:
        """From now on, every forward reports its routing to `observer` (a routing trace, per-context counts)."""
        self.observers.add(observer)

    def unobserve(self, observer: RouteObserver) -> None:
        self.observers.remove(observer)

    def reconfigure_cache(self, **changes) -> None:
        """A new expert cache (size, policy, prefetch switches) over the same pinned store, without reloading:
        e.g. reconfigure_cache(moe_cache_mib=16000, prefetch=False), by the flat names LLM takes (flags.py).
        Counters and routing statistics restart."""
        if self.host is None:
            raise UserError("no expert is in host memory: use --cpu-moe or --n-cpu-moe for a cache")
        if self.split is not None:
            raise UserError("a new expert cache without reloading is not made for layers split over several devices "
                            "yet; load the model again with the new --moe-cache-mib")
        ecfg = flags.apply(self.ecfg, **changes)
        store = self.host.store
        for rows in self.host.device_rows():
            self.book.discard(rows)
        self.host = None
        self.experts.by_layer = {l: p for l, p in self.experts.by_layer.items() if l not in store.rows}
        if self.device.is_cuda:
            torch.cuda.empty_cache()
        plan = decode_plan(ecfg, self.device.is_cuda, self.quantized, True, self.model.capturable,
                           by_address_kernels(FAMILIES[self.cfg.family].blocks))
        # auto: what is free now; the rest of the model is in place: the new pool needs the free memory
        ecfg, n_slots = fit_cache(self.cfg, ecfg, plan, self.device, self.dtype, set(store.rows), store.layouts,
                                  store.expert_bytes)
        self.routing.clear_prompts()         # the new cache learns the prompts' routing from scratch
        self.host = host_provider(self.cfg, ecfg, plan, store, self.device, n_slots, self.routing)
        self.experts.by_layer.update({l: self.host for l in store.rows})
        self.ecfg, self.plan = ecfg, plan
        self._setup_decode()

    def _setup_decode(self) -> None:
        """The host provider takes the decode plan (a cache's zero-copy decode), then the decode path is built from
        it (runtime/decode.py). A new cache gets a new path: its graphs read the new cache's tables."""
        if self.host is not None:
            self.host.use_plan(self.plan)
            for rows in self.host.device_rows():
                self.book.add(rows)          # what decode kernels read by address (the plain-torch one through it)
        self.decoder = decode_path(self)

    def set_batching(self, batch_size: int, ubatch_size: int) -> None:
        """Change -b/-ub without reloading (they change how prompts are cut, not where weights live). A larger -ub
        than the sliding layers' rings were sized for grows them (runtime/sliding_kv.py; each sequence keeps what
        it holds), and the decode path is made again (its graphs read the old rings)."""
        self.ecfg = flags.apply(self.ecfg, batch_size=batch_size, ubatch_size=ubatch_size)
        spec = self.ecfg.spec
        if self.kv.make_room(max(self.ecfg.batching.ubatch, spec.most + 1 if spec.drafts else 1),
                             self.device.free_memory() if self.device.is_cuda else None):
            self.decoder = decode_path(self)

    def synchronize(self) -> None:
        self.device.synchronize()

    def timed(self, fn, *args, **kw):
        """(result, seconds) with the device synchronised around the call."""
        self.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.synchronize()
        return out, time.perf_counter() - t0

