"""The public API.

    from moestream import LLM
    llm = LLM("synth:tiny", cpu_moe=True)
    out = llm.generate("The capital of France is", max_tokens=16)
    print(out.text)
    logits = llm.logits([1, 2, 3])          # (3, V) float32 on the CPU
"""
from __future__ import annotations

import torch

from . import flags
from .config import EngineConfig
from .errors import UserError
from .loading.source import open_source
from .runtime.engine import Engine
from .runtime.generate import Completion, Generation
from .runtime.sampling import SamplingParams


class LLM:
    """A model loaded for generation. Engine options come as a config, as flat keywords, or both:

        LLM("model.gguf", cpu_moe=True, moe_cache_mib=16000)           # the names of flags.py, which the flags set
        LLM("model.gguf", flags.to_config(args), n_seq=4)                # a config from the command line, one change
    """

    def __init__(self, model: str, config: EngineConfig | None = None, *, progress: bool = False, **overrides):
        config = flags.apply(config or EngineConfig(), **overrides)     # validated before anything loads
        self.source = open_source(model, progress=progress)
        # "auto" decided for this machine and this checkpoint's dtype (None: quantized), once (Engine.load takes
        # it resolved)
        self.config = config.resolve(self.source.dtype_of("token_embd.weight"))
        self.engine = Engine.load(self.source, self.config, progress=progress)
        self.tokenizer = self.source.tokenizer
        self.model_config = self.source.config

    # --- prompts ------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError("this model has no tokenizer: give the prompt as token ids "
                                "(on the command line: -p '1,2,3')")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
        return ids

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None:
            raise UserError("this model has no tokenizer, so no chat template: give token ids")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # --- generation ---------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, **kw) -> Generation:
        """An iterator of text pieces; its `.result` is the Completion once exhausted."""
        return Generation(self.engine, self.tokenizer, self.encode(prompt), params or SamplingParams(**kw))

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, **kw) -> Completion:
        """Greedy by default: generate(prompt, max_tokens=32, temperature=0.8, top_p=0.95, seed=1, stop=["\\n"])."""
        if "stop" in kw and isinstance(kw["stop"], str):
            kw["stop"] = (kw["stop"],)
        for key in ("stop", "stop_token_ids"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return self.stream(prompt, params, **kw).run()

    def chat(self, messages: list[dict], params: SamplingParams | None = None, **kw) -> Completion:
        return self.generate(self.chat_prompt(messages), params, **kw)

    @torch.inference_mode()
    def logits(self, token_ids: list[int], seq: int = 0) -> torch.Tensor:
        """float32 logits for every position of token_ids (N, V), on the CPU: for tests and perplexity."""
        self.engine.begin_prompt(seq)
        return self.engine.prefill(seq, self.encode(list(token_ids)), 0, all_logits=True).float().cpu()

    def stats(self) -> dict:
        """Cache and upload counters: {"cache", "total", "prompt", "per_layer", "uploaded_bytes", "uploaded_experts"};
        totals and per-layer counts are cumulative, "prompt" counts since the last prompt began."""
        return self.engine.stats()
