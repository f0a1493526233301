"""The host's time by function (cProfile): zero-copy decode steps, or (--prompt) prompt ubatches, with a cache.

    python bench/profile_host.py [MODEL] [--mib N] [--no-read-through]
    python bench/profile_host.py MODEL --prompt [-ub 4096] [--mib N]   three warm 4096-token prompts, one profiled

A prompt ubatch's host time per layer (the `host ms/layer` column of bench) is the GPU's idle time between the
routing's read-back and the experts' launch: this says which calls it is made of.
"""
import argparse
import cProfile
import pstats

import torch

from moestream import LLM

ap = argparse.ArgumentParser()
ap.add_argument("model", nargs="?", default="synth:qwen3-30b-a3b:layers=8")
ap.add_argument("--mib", type=int, default=4000, help="--moe-cache-mib")
ap.add_argument("--read-through", action=argparse.BooleanOptionalAction, default=True)
ap.add_argument("--prompt", action="store_true")
ap.add_argument("-ub", type=int, default=4096)
ns = ap.parse_args()

ctx = 4096 + 64 if ns.prompt else 1024
llm = LLM(ns.model, ctx_size=ctx, cpu_moe=True, moe_cache_mib=ns.mib, read_through=ns.read_through,
          ubatch_size=ns.ub, batch_size=max(ns.ub, 2048))
eng = llm.engine
V = llm.model_config.vocab_size
rand = lambda n, s: torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(s)).tolist()  # noqa: E731
pr = cProfile.Profile()
if ns.prompt:
    for s in range(3):
        eng.begin_prompt(0)
        eng.prefill(0, rand(4096, s))
    eng.synchronize()
    eng.begin_prompt(0)
    pr.enable()
    eng.prefill(0, rand(4096, 3))
    eng.synchronize()
    pr.disable()
    print(f"one 4096-token prompt at ubatch {ns.ub}, {ns.mib} MiB; stats: {llm.stats()['prompt']}")
else:
    tok = int(eng.prefill(0, rand(512, 3))[-1].argmax())
    for pos in range(512, 540):
        tok = int(eng.decode([(0, tok, pos)])[0].argmax())
    pr.enable()
    for pos in range(540, 640):
        tok = int(eng.decode([(0, tok, pos)])[0].argmax())
    pr.disable()
    print(f"read_through={ns.read_through}: 100 decode steps")
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
pstats.Stats(pr).sort_stats("cumtime").print_stats("zero_copy|cache.py|graphs.py|engine.py|copy_queue|residency|moe.py", 30)
