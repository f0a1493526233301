"""`bench --spec-type draft-mtp --spec-draft-n-max 0,1,2,3 [--spec-oracle P]`: the decode of a test with drafts
(runtime/speculate.py), each step's drafts verified in one target step. n-max 0 is the same engine without drafts
(the baseline in the same process). The oracle's drafts (tools/spec_oracle.py) come from a first greedy pass over the
same prompt, untimed; the head's own are the real ones. After the timed runs one more, untimed, counts per step the
drafted and accepted tokens, the distinct experts each MoE layer read (a one-token step reads top-k) and the bytes
copied from host memory (its reads of the counters would slow the timed ones).
"""
from __future__ import annotations

from .spec_oracle import Oracle


def spec_run(n_max: int, p: float | None, test, llm, ids: list[int], i: int) -> dict:
    """BenchTest.run with n_max drafts a step (the oracle's, right with probability p, or the head's: p None): the
    same tokens as its plain decode (the row's hash), timed and counted alike."""
    from ..runtime.generate import token_hash
    from ..runtime.speculate import greedy_tokens
    from .bench_common import diff_counters, read_stats
    eng = llm.engine
    prompt = ids if test.n_prompt else ids[:1]
    # pp + tg: the tokens after the prompt's argmax, as the plain run's decode steps give them; tg: from its first
    n = test.n_gen + (1 if test.n_prompt else 0)
    oracle = None
    if p is not None:
        first, _ = greedy_tokens(eng, prompt, n, 0)
        oracle = Oracle(len(prompt), first, p, llm.model_config.vocab_size, seed=test.seed + i)
    before = read_stats(llm)
    (tokens, _), seconds = eng.timed(greedy_tokens, eng, prompt, n, n_max, oracle)
    after = read_stats(llm)
    if oracle is not None:
        oracle = Oracle(len(prompt), first, p, llm.model_config.vocab_size, seed=test.seed + i)   # same drafts
    _, counts = greedy_tokens(eng, prompt, n, n_max, oracle, measure=True)
    generated = tokens[1:] if test.n_prompt else tokens
    per_layer = {l: diff_counters(v, before[1].get(l)) for l, v in after[1].items()}
    return {"seconds": seconds, "total": diff_counters(after[0], before[0]), "per_layer": per_layer,
            "hash": token_hash(generated)[:16] if generated else None,
            "spec": dict(counts.summary(), top_k=llm.model_config.n_experts_used)}
