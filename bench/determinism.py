"""Is a forward deterministic on CUDA? Repeats identical prompts and decodes, with cuDNN's SDPA on and off.

    python bench/determinism.py
"""
import hashlib

import torch

from moestream import LLM

spec = "synth:qwen3-30b-a3b:layers=2"
ids = torch.randint(0, 151936, (1024,), generator=torch.Generator().manual_seed(3)).tolist()


def digest(t):
    return hashlib.sha256(t.float().cpu().numpy().tobytes()).hexdigest()[:12]


for cudnn in (True, False):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    for kw in ({}, {"cpu_moe": True, "moe_cache_mib": 1200}, {"cpu_moe": True, "moe_cache_mib": 1200, "prefetch": False}):
        llm = LLM(spec, ctx_size=1100, ubatch_size=512, **kw)
        lg = {digest(llm.logits(ids)) for _ in range(3)}
        hs = {llm.generate(ids[:64], max_tokens=32, ignore_eos=True).sha256[:12] for _ in range(3)}
        print(f"cudnn_sdp={cudnn} {kw}: logits {sorted(lg)} decode {sorted(hs)}", flush=True)
        del llm
        torch.cuda.empty_cache()
