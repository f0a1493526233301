"""The host's time in zero-copy decode steps, by function (cProfile), on the reference shapes with a cache.

    python bench/profile_host.py [MODEL] [--read-through]
"""
import cProfile
import pstats
import sys

import torch

from moestream import LLM

model = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "synth:qwen3-30b-a3b:layers=8"
rt = "--read-through" in sys.argv
llm = LLM(model, ctx_size=1024, cpu_moe=True, moe_cache_mib=int(sys.argv[-1]) if sys.argv[-1].isdigit() else 4000,
          read_through=rt)
eng = llm.engine
ids = torch.randint(0, llm.model_config.vocab_size, (512,), generator=torch.Generator().manual_seed(3)).tolist()
tok = int(eng.prefill(0, ids)[-1].argmax())
for pos in range(512, 540):
    tok = int(eng.decode([(0, tok, pos)])[0].argmax())
pr = cProfile.Profile()
pr.enable()
for pos in range(540, 640):
    tok = int(eng.decode([(0, tok, pos)])[0].argmax())
pr.disable()
print(f"read_through={rt}: 100 decode steps")
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
pstats.Stats(pr).sort_stats("cumtime").print_stats("zero_copy|cache.py|graphs.py|engine.py|copy_queue", 30)
