"""Shared test drivers: three sequences of one engine decoding together, greedy, step by step; one request through
a started Scheduler; first decode steps after prompts, fused or not."""
from __future__ import annotations

import torch


def decode_three(eng, n_steps: int = 6, follow: list | None = None) -> list:
    """Prefill three sequences (prompts of 20, 22 and 24 ids), then n_steps decode steps of all three at once, each
    step's tokens the argmax of the last (of `follow`'s logits, another run's, where given: the same inputs whatever
    this run's logits pick): each step's (3, V) logits."""
    for s in range(3):
        eng.prefill(s, list(range(5 + s, 25 + 2 * s)))
    toks, outs = [(0, 7, 20), (1, 9, 22), (2, 3, 24)], []
    for _ in range(n_steps):
        lg = eng.decode(toks)
        outs.append(lg.clone())
        pick = lg if follow is None else follow[len(outs) - 1]
        toks = [(s, int(pick[i].argmax()), p + 1) for i, (s, _, p) in enumerate(toks)]
    return outs


def join_and_leave(eng) -> list:
    """Sequence 0 decodes alone, sequence 1 joins it (the step of two is first run, or captured, in the middle of
    0's decode, on both sequences' states), then 0 decodes alone again: every prompt's and step's logits, copied
    out at once (a replayed CUDA graph's logits are its buffer, which the next replay of its size overwrites)."""
    out = lambda t: t.to("cpu", torch.float32, copy=True)
    a, b = list(range(3, 30)), list(range(40, 51))
    outs = [out(eng.prefill(0, a))]
    outs += [out(eng.decode([(0, 7 + i, len(a) + i)])) for i in range(3)]
    outs.append(out(eng.prefill(1, b)))
    outs += [out(eng.decode([(0, 20 + i, len(a) + 3 + i), (1, 30 + i, len(b) + i)])) for i in range(3)]
    outs += [out(eng.decode([(0, 40 + i, len(a) + 6 + i)])) for i in range(2)]
    return outs


def served(sched, prompt: list[int], max_tokens: int = 4):
    """One request through a started Scheduler, waited for: its done event's result."""
    import queue

    from moestream import SamplingParams
    from moestream.runtime.scheduler import Request
    events = queue.Queue()
    sched.submit([Request(prompt, SamplingParams(max_tokens=max_tokens), events.put)])
    while (ev := events.get(timeout=60))[0] == "token":
        pass
    assert ev[0] == "done", ev
    return ev[2]


def first_decodes(model: str, n: int, fused: bool, dtype: str = "bfloat16", **kw) -> torch.Tensor:
    """On CUDA: n prompts (ids 3+s .. 39+s) in sequence 0 of `model`, each then one decode step at position 37 of
    token 11+s, with the fused decode kernels or (fused False) torch's ops: the steps' logits, float32 (n, V)."""
    from moestream import LLM
    llm = LLM(model, ctx_size=128, device="cuda", dtype=dtype, **kw)
    if not fused:
        llm.engine.fused = None
    eng, out = llm.engine, []
    for s in range(n):
        eng.prefill(0, list(range(3 + s, 40 + s)))
        out.append(eng.decode([(0, 11 + s, 37)]).float())
    return torch.cat(out)
