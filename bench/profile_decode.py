"""Where a decode step's GPU time goes: torch.profiler over eager decode steps, and graph vs eager step times.

    python bench/profile_decode.py synth:qwen3-30b-a3b:layers=4 [--cpu-moe]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moestream import LLM

spec = sys.argv[1]
kw = {"cpu_moe": "--cpu-moe" in sys.argv}
for graphs in (True, False):
    llm = LLM(spec, ctx_size=4096, cuda_graphs=graphs, **kw)
    eng = llm.engine
    eng.prefill(0, list(range(1, 17)))
    for p in range(16, 24):
        eng.decode([(0, 5, p)])
    eng.synchronize()
    t = time.perf_counter()
    for p in range(24, 88):
        int(eng.decode([(0, 5, p)])[0].argmax())
    eng.synchronize()
    print(f"graphs={graphs}: {(time.perf_counter() - t) / 64 * 1e3:.3f} ms per decode step", flush=True)
    if not graphs:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for p in range(100, 104):
                eng.decode([(0, 5, p)])
            eng.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    del llm, eng
    torch.cuda.empty_cache()
