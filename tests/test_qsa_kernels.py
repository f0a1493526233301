"""QSA's kernels (kernels/qsa.py: block keys, the top-budget select, the block-sparse attention) against their torch
oracle (models/qsa.py's block_keys, select and the masked attention), through Triton's interpreter on the CPU
(float32, in a subprocess: tests/interpreted.py); the engine on tiny-flash-next with them against its torch path;
and the block keys the cache keeps against pooling every block again. On CUDA (`-m cuda`) the same compiled.

Bounds (float32): block keys and attention within 1e-5 relative (close); the picks equal (exact ties, the zeros of
all-negative products, straddle the cut in these cases and break by lower index in both); a token's outputs the
same bits alone or among others."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from moestream import LLM

from interpreted import close, run_check

KW = dict(device="cpu", ctx_size=96)


def qsa_case(g: torch.Generator, n_seq=3, ctx=48, B=4, d=16, ih=2, top=3, nh=8, nkv=2, hd=16, rd=4,
             device="cpu", dtype=torch.float32):
    """A config, an indexer norm weight, rotary tables, caches (raw index keys, block keys, K, V) of n_seq sequences
    and the tokens of a forward over them: sequence 1's every position, some of sequences 0 and 2, not in order.
    Block keys 1..8 have only negative entries and the queries only positive ones: those blocks score 0 (ties), and
    a query seeing 4 to 10 blocks has fewer than top positive ones: its cut falls among the zeros."""
    from moestream.models.layers import rope_tables
    cfg = SimpleNamespace(indexer_block=B, indexer_budget=top * B, indexer_head_dim=d, indexer_heads=ih,
                          rms_norm_eps=1e-6, n_heads=nh, n_kv_heads=nkv, head_dim=hd, rotary_dim=rd)
    r = lambda *s: torch.randn(*s, generator=g)                                     # noqa: E731
    rope_cfg = SimpleNamespace(rotary_dim=rd, rope_theta=1e4, rope={}, rope_type="default", head_dim=hd,
                               max_position_embeddings=ctx)
    cos, sin = rope_tables(rope_cfg, ctx, "cpu")
    keys = r(n_seq, ctx // B, d)
    keys[:, 1:9] = -keys[:, 1:9].abs()
    seq_ids = torch.tensor([1] * ctx + [0] * 9 + [2] * 5)
    positions = torch.cat([torch.arange(ctx), torch.arange(30, 39), torch.tensor([0, 3, 12, 22, 47])])
    order = torch.randperm(len(seq_ids), generator=g)
    t = dict(cfg=cfg, norm=1 + 0.1 * r(d), cos=cos, sin=sin, raw=r(n_seq, ctx, d), keys=keys,
             k=r(n_seq, nkv, ctx, hd), v=r(n_seq, nkv, ctx, hd), iq=r(len(seq_ids), ih, d).abs(),
             q=r(len(seq_ids), nh, hd), seq_ids=seq_ids[order], positions=positions[order])
    return {n: x.to(device, dtype) if torch.is_tensor(x) and x.is_floating_point() else
            x.to(device) if torch.is_tensor(x) else x for n, x in t.items()}


def check_block_keys(c) -> None:
    from moestream.kernels import qsa as K
    from moestream.models import qsa
    cfg, B = c["cfg"], c["cfg"].indexer_block
    got = torch.zeros_like(c["keys"])
    K.block_keys(c["raw"], c["norm"], cfg.rms_norm_eps, c["cos"], c["sin"], got, c["seq_ids"], c["positions"])
    lw = {"indexer.k_norm.weight": c["norm"]}
    want = qsa.block_keys(c["raw"][1], lw, cfg, c["cos"], c["sin"])          # every block of sequence 1
    close(got[1], want)
    # sequence 0's tokens at 30..38 complete blocks 7 and 8; sequence 2's at 3 and 47 blocks 0 and 11
    for seq, blocks in ((0, [7, 8]), (2, [0, 11])):
        for b in blocks:
            close(got[seq, b], qsa.block_keys(c["raw"][seq, b * B:b * B + B], lw, cfg, c["cos"], c["sin"], b)[0])
        others = [b for b in range(got.shape[1]) if b not in blocks]
        assert not got[seq, others].any()                   # only the blocks a token completed


def torch_keep(c, t: int) -> torch.Tensor:
    """The oracle's keep row of token t, (pos + 1,) bool."""
    from moestream.models import qsa
    s, p = int(c["seq_ids"][t]), int(c["positions"][t])
    nb = (p + 1) // c["cfg"].indexer_block
    return qsa.select(c["iq"][t:t + 1], c["keys"][s, :nb], c["positions"][t:t + 1], c["cfg"], p + 1)[0]


def check_select(c) -> None:
    from moestream.kernels import qsa as K
    cfg, B = c["cfg"], c["cfg"].indexer_block
    top = cfg.indexer_budget // B
    picks = K.select(c["iq"], c["keys"], c["seq_ids"], c["positions"], B, top, c["raw"].shape[1])
    tied = 0
    for t in range(len(c["seq_ids"])):
        p = int(c["positions"][t])
        nb = (p + 1) // B
        got = picks[t, :min(top, nb)].tolist()
        keep = torch_keep(c, t)
        assert got == [b for b in range(nb) if keep[b * B]], (t, p, got)     # ascending, the oracle's blocks
        zeros = [bool(keep[b * B]) for b in range(1, min(9, nb))]         # blocks scoring 0
        tied += any(zeros) and not all(zeros)
    assert tied                                                     # tokens whose cut falls among zero ties


def check_attend(c) -> None:
    from moestream.kernels import qsa as K
    from moestream.models.layers import masked_attention
    cfg, B = c["cfg"], c["cfg"].indexer_block
    top = cfg.indexer_budget // B
    args = (c["seq_ids"], c["positions"])
    picks = K.select(c["iq"], c["keys"], *args, B, top, c["raw"].shape[1])
    got = K.attend(c["q"], c["k"], c["v"], picks, *args, B, top)
    for t in range(len(c["seq_ids"])):
        s, p = int(c["seq_ids"][t]), int(c["positions"][t])
        want = masked_attention(c["q"][t:t + 1], c["k"][s, :, :p + 1], c["v"][s, :, :p + 1], torch_keep(c, t)[None])
        close(got[t], want[0])
    some = torch.tensor([5, 50, 2])                                 # a few tokens alone: their rows' bits
    alone = K.attend(c["q"][some], c["k"], c["v"], picks[some], c["seq_ids"][some], c["positions"][some], B, top)
    assert torch.equal(alone, got[some])


def check_engine() -> None:
    """tiny-flash-next (QSA budget 16 in blocks of 4) with the kernels, a 28-token prompt in ubatches of 7 then
    greedy steps, against its torch path in one ubatch: the same tokens; the kernels' decode steps read nothing
    back to the host (what a CUDA graph could not capture)."""
    from moestream.kernels import qsa as K
    from test_mla_decode import no_host_reads
    prompt = [int(x) for x in torch.randint(3, 400, (28,), generator=torch.Generator().manual_seed(3))]

    def run(kernels: bool, ub: int):
        llm = LLM("synth:tiny-flash-next", ubatch_size=ub, **KW)
        attn = llm.engine.model.attention
        attn.kernels, attend, steps = (K if kernels else None), attn.attend, []

        def checked(q, x, lw, slot, batch, *a):
            if not batch.is_decode:
                return attend(q, x, lw, slot, batch, *a)
            steps.append(slot)
            with no_host_reads():
                return attend(q, x, lw, slot, batch, *a)
        attn.attend = checked
        out = llm.generate(prompt, max_tokens=5, ignore_eos=True).token_ids
        assert len(steps) == 8                      # 4 steps, 2 layers
        return out
    assert run(True, 7) == run(False, 512)


CHECKS = ["block_keys", "select", "attend", "engine"]


@pytest.mark.parametrize("name", CHECKS)
def test_kernels_in_the_interpreter(name):
    pytest.importorskip("triton")
    run_check(__file__, name, timeout=600)


def check(name: str, device: str = "cpu") -> None:
    if name == "engine":
        return check_engine()
    c = qsa_case(torch.Generator().manual_seed(0), device=device)
    {"block_keys": check_block_keys, "select": check_select, "attend": check_attend}[name](c)


def test_the_cache_keeps_the_keys_pooling_every_block_gives():
    """The block keys the engine's torch path keeps (each made once, when its block's last token lands, a prompt in
    ubatches of 5 then decode steps) are the bits of pooling every block of the raw keys again."""
    from moestream.models import qsa
    llm = LLM("synth:tiny-flash-next", ubatch_size=5, **KW)
    llm.generate(list(range(10, 47)), max_tokens=7, ignore_eos=True)
    eng, cfg = llm.engine, llm.engine.cfg
    n = 37 + 6                                                      # the tokens in the cache
    attn = eng.model.attention
    for slot, i in enumerate(cfg.attention_layers):
        lw = eng.model.layers[i]
        raw = eng.kv.index_keys[slot]
        want = qsa.block_keys(raw[0, :n], lw, cfg, *attn.rope_all(eng.kv.ctx, raw))
        assert torch.equal(eng.kv.block_keys[slot][0, :n // 4], want)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", ["block_keys", "select", "attend"])
def test_compiled_kernels_match_the_oracle(name):
    check(name, "cuda")


@pytest.mark.cuda
@needs_cuda
def test_cuda_topk_takes_tied_scores_by_lower_index():
    """Transformers' indexer on CUDA (scores.topk) picks as ours: tied scores by lower index."""
    g = torch.Generator().manual_seed(0)
    for n in (5, 37, 300, 5000):
        s = torch.relu(torch.randn(n, generator=g)).cuda()          # half of them 0
        k = max(1, n * 3 // 4)
        want = s.cpu().sort(descending=True, stable=True).indices[:k]
        assert set(s.topk(k).indices.tolist()) == set(want.tolist()), n


@pytest.mark.cuda
@needs_cuda
def test_the_engine_on_cuda_takes_the_kernels_and_the_torch_paths_tokens():
    from moestream.kernels import qsa as K
    prompt = list(range(10, 50))

    def run(kernels: bool):
        llm = LLM("synth:tiny-flash-next", device="cuda", ctx_size=96)
        assert llm.engine.model.attention.kernels is K
        if not kernels:
            llm.engine.model.attention.kernels = None
        return llm.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    assert run(True) == run(False)


if __name__ == "__main__":
    check(sys.argv[1])
