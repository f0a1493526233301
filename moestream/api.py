"""The public API.

    from moestream import LLM
    llm = LLM("synth:tiny", cpu_moe=True)
    out = llm.generate("The capital of France is", max_tokens=16)
    print(out.text)
    outs = LLM("synth:tiny", n_seq=4).generate(["Once upon", "Light travels"], max_tokens=16)   # together
    logits = llm.logits([1, 2, 3])          # (3, V) float32 on the CPU
"""
from __future__ import annotations

import logging
import sys
import time

import torch

from . import flags
from .engine_config import EngineConfig
from .errors import UserError
from .loading.draft import with_head
from .loading.source import open_source
from .quant.layout import expert_layouts
from .runtime.generate import Completion, Generation
from .runtime.load import load_engine, model_config
from .runtime.memory import check_host_fits
from .runtime.plan import resolve
from .runtime.prompt_batch import next_batch
from .runtime.requests import Request
from .runtime.sampling import SamplingParams
from .runtime.serving import ServingLoop

log = logging.getLogger("moestream")


def encode(tokenizer, vocab_size: int, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: text through the tokenizer, ids checked against the vocabulary. Needs no weights, so
    the CLI runs it before they load (LLM.encode is this)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise UserError("this model has no tokenizer: give the prompt as token ids "
                            "(on the command line: -p '1,2,3')")
        return tokenizer.encode(prompt)
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of `messages` in the tokenizer's chat template, ready for the assistant's answer."""
    if tokenizer is None:
        raise UserError("this model has no tokenizer, so no chat template: give token ids")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class LLM:
    """A model loaded for generation. Engine options come as a config, as flat keywords, or both:

        LLM("model.gguf", cpu_moe=True, moe_cache_mib=16000)           # the names of flags.py, which the flags set
        LLM("model.gguf", flags.to_config(args), n_seq=4)                # a config from the command line, one change

    progress: a loading bar, then one line on stderr saying what was loaded and where. check(source), if given,
    runs once the model's config and tokenizer are known (source.config, source.tokenizer) and before its weights
    load: the CLI checks -ngl and the prompt there.
    """

    def __init__(self, model: str, config: EngineConfig | None = None, *, progress: bool = False, check=None,
                 **overrides):
        config = flags.apply(config or EngineConfig(), **overrides)     # validated before anything loads
        t0 = time.perf_counter()
        self.source = open_source(model, progress=progress)
        if config.spec.model_draft is not None:            # an MTP head of its own file (--model-draft)
            self.source = with_head(self.source, config.spec.model_draft, config.spec)
        if check is not None:
            check(self.source)
        # "auto" decided for this machine and this checkpoint's dtype (None: quantized), once (load_engine takes
        # it resolved)
        self.config = resolve(config, self.source.dtype_of("token_embd.weight"))
        cfg = model_config(self.source.config, self.config)
        layouts = expert_layouts(self.source, cfg)       # a quantized file's experts are its blocks' bytes
        size = max(lay.row_bytes_for(getattr(torch, self.config.placement.dtype)) for lay in layouts.values())
        check_host_fits(cfg, self.config, expert_bytes=size)   # before any large allocation (the device's: load)
        if self.config.cache.mib is not None and not self.config.placement.host_layers(cfg):
            log.warning("--moe-cache-mib %s does nothing: no expert is in host memory (add --cpu-moe or "
                        "--n-cpu-moe N to keep experts there and cache them on the device)", self.config.cache.mib)
        self.engine = load_engine(self.source, self.config, progress=progress)
        if progress:
            p = self.config.placement
            host = len(p.host_layers(cfg))
            auto = f"moe cache: auto = {self.engine.ecfg.cache.mib} MiB; " if self.config.cache.mib == "auto" else ""
            print(f"loaded {model}: {cfg.family}, "
                  f"{cfg.n_layers} layers, {cfg.n_experts} experts (top {cfg.n_experts_used}), {p.dtype} on "
                  f"{p.device}; experts of {host} of {len(cfg.expert_layers)} MoE layers in host memory"
                  f"{' (one an MTP head)' if cfg.nextn_layers else ''}; {auto}"
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        self.tokenizer = self.source.tokenizer
        self.model_config = self.source.config

    # --- prompts ------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode(self.tokenizer, self.model_config.vocab_size, prompt)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return chat_prompt(self.tokenizer, messages)

    # --- generation ---------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, **kw) -> Generation:
        """An iterator of text pieces; its `.result` is the Completion once exhausted."""
        return Generation(self.engine, self.tokenizer, self.encode(prompt), params or SamplingParams(**kw))

    def generate(self, prompt, params: SamplingParams | None = None, **kw) -> Completion | list[Completion]:
        """Greedy by default: generate(prompt, max_tokens=32, temperature=0.8, top_p=0.95, seed=1, stop=["\\n"]).

        A list of prompts (strings, or lists of token ids) gives a list of Completions, in order: they run as the
        server runs requests, up to n_seq at a time (LLM(..., n_seq=8)): prompts in batches (-b tokens; with host
        experts a layer's experts cross the link once a batch), decode steps of every running sequence together.
        Each gets the tokens it gets alone (greedy, or with a seed)."""
        if "stop" in kw and isinstance(kw["stop"], str):
            kw["stop"] = (kw["stop"],)
        for key in ("stop", "stop_token_ids"):
            if key in kw:
                kw[key] = tuple(kw[key])
        if isinstance(prompt, (list, tuple)) and all(isinstance(p, (str, list, tuple)) for p in prompt) and prompt:
            return self._generate_many(list(prompt), params or SamplingParams(**kw))
        return self.stream(prompt, params, **kw).run()

    def _generate_many(self, prompts: list, params: SamplingParams) -> list[Completion]:
        """The prompts as requests of the serving loop (runtime/serving.py), turned here until each has ended."""
        ids = [self.encode(p) for p in prompts]
        for p in ids:                          # refused before anything runs, as generate() refuses one
            if not p:
                raise UserError("empty prompt: give at least one token")
            self.engine.check_context(len(p))
        events: list[tuple] = []
        reqs = [Request(p, params, events.append, index=i) for i, p in enumerate(ids)]
        loop = ServingLoop(self.engine, self.tokenizer, n_slots=self.engine.kv.n_seq, max_queue=len(reqs))
        loop.submit(reqs)
        results: dict[int, object] = {}
        while loop.busy:
            loop.step()
            for ev in events:
                if ev[0] == "error":
                    raise UserError(f"prompt {ev[1]}: {ev[3]}")
                results[ev[1]] = ev[2]       # "done" (not streamed: no "token" events)
            events.clear()
        return [Completion(r.token_ids, r.text if self.tokenizer is not None else None, r.finish_reason,
                           r.prompt_tokens, prompt_s=r.ttft_s, decode_s=r.duration_s - r.ttft_s)
                for r in (results[i] for i in range(len(reqs)))]

    def chat(self, messages: list[dict], params: SamplingParams | None = None, **kw) -> Completion:
        return self.generate(self.chat_prompt(messages), params, **kw)

    @torch.inference_mode()
    def logits(self, token_ids: list[int], seq: int = 0) -> torch.Tensor:
        """float32 logits for every position of token_ids (N, V), on the CPU: for tests and perplexity."""
        self.engine.begin_prompt(seq)
        return self.engine.prefill(seq, self.encode(list(token_ids)), 0, all_logits=True).float().cpu()

    @torch.inference_mode()
    def logits_many(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """logits() of several token lists at once, chunk i on sequence i (llama-perplexity's several sequences a
        batch): their ubatches as one prompt batch (engine.prefill_parts; with host experts layer by layer, so a
        layer's experts cross the link once for all of them). Each chunk's logits are the bits logits() gives it."""
        if len(chunks) == 1:
            return [self.logits(chunks[0])]
        if len(chunks) > self.engine.kv.n_seq or any(len(c) > self.engine.ecfg.batching.batch_size for c in chunks):
            raise UserError(f"logits_many takes at most {self.engine.kv.n_seq} lists (the engine's sequences) of "
                            f"at most -b {self.engine.ecfg.batching.batch_size} tokens each")
        ids = [self.encode(list(c)) for c in chunks]
        for s in range(len(ids)):
            self.engine.begin_prompt(s)
        # every chunk whole, in ubatches from position 0: the server's cuts (runtime/prompt_batch.py)
        parts = next_batch([(s, c, 0) for s, c in enumerate(ids)], self.engine.ecfg.batching.ubatch,
                           sum(map(len, ids)))
        out = self.engine.prefill_parts(parts, all_logits=True)
        per = [[] for _ in ids]
        for (s, _, _), lg in zip(parts, out):
            per[s].append(lg)
        return [torch.cat(p).float().cpu() for p in per]

    def stats(self) -> dict:
        """Cache and upload counters: {"cache", "total", "prompt", "per_layer", "uploaded_bytes", "uploaded_experts"};
        totals and per-layer counts are cumulative, "prompt" counts since the last prompt began."""
        return self.engine.stats()
