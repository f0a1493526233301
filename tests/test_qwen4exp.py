"""Qwen3.8-Flash-Next (qwen4_exp): hyper-connections, the PLE n-gram table and QSA attention (models/residual.py,
ple.py, qsa.py, qwen4_reference.py) against transformers' Qwen4Exp on a small random checkpoint it writes
(float32), and against themselves: a prompt in ubatches against one, sequences together against each alone.

Bound: 1e-4 absolute on float32 logits (O(5)); observed about 1e-6. The QSA budget is 8 tokens in blocks of 4, so
every query past position 11 drops blocks (a 48-token prompt drops most of them), and the prompts hold EOS so
that the n-grams' document boundaries are crossed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moestream.arch.hf_config import config_from_hf
from moestream.arch.hybrid_names import canonical_from_hf, hybrid_names
from moestream.arch.names import canonical_shape
from moestream.errors import UserError
from moestream.models import qsa
from moestream.models.ple import NGramHash, PLETable
from moestream.models.qwen4_reference import Qwen4Reference

from conftest import QWEN4_EOS as EOS, QWEN4_TEXT as TEXT, VOCAB, lower_index_ties

ATOL = 1e-4


@pytest.fixture(scope="module")
def qwen4(qwen4_checkpoint):
    """(ModelConfig read from the written config.json, canonical weights from its safetensors, the model)."""
    from safetensors.torch import load_file
    path, model = qwen4_checkpoint
    cfg = config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    return cfg, canonical_from_hf(cfg, load_file(str(Path(path) / "model.safetensors"))), model


def _ids(n: int, seed: int = 1) -> list[int]:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
    ids[n // 3] = ids[n // 2] = EOS                 # n-grams restart after an EOS
    return ids.tolist()


def test_config_and_names(qwen4):
    cfg, weights, _ = qwen4
    assert cfg.family == "qwen4_exp" and cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert (cfg.hc_count, cfg.hc_lowrank, cfg.ple_layers, cfg.ple_embed_dim, cfg.heads_per_ngram) == (3, 8, (0,), 32, 2)
    assert (cfg.indexer_heads, cfg.indexer_head_dim, cfg.indexer_budget, cfg.indexer_block) == (2, 16, 8, 4)
    assert cfg.rotary_dim == 8 and cfg.norm_topk_prob and cfg.eos_token_ids == (EOS,)
    assert set(weights) == set(hybrid_names(cfg))
    assert all(tuple(t.shape) == canonical_shape(cfg, n) for n, t in weights.items() if "_exps." not in n)
    assert weights["per_layer_token_embd.weight"].shape == (NGramHash.of(cfg).rows_total, 8)
    # the checkpoints' spelling of the QSA layers, and transformers' default rotary (none given: all of head_dim)
    c = dict(TEXT, architectures=["Qwen4ExpForCausalLM"], model_type="qwen4_exp_text")
    assert config_from_hf(c) == config_from_hf(dict(c, layer_types=["linear_attention", "indexed_attention"] * 2))
    assert config_from_hf(dict(c, rope_parameters={"rope_type": "default", "rope_theta": 1e4})).rotary_dim == 16
    mm = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "text_config": c,
          "vision_config": {"depth": 1}}
    assert config_from_hf(mm) == config_from_hf(c)


@pytest.mark.parametrize("change, named", [({"indexer_kv_heads": 2}, "indexer_kv_heads=2"),
                                           ({"indexer_mode": "dsa"}, "indexer_mode 'dsa'"),
                                           ({"output_gate_type": "tanh"}, "output_gate_type 'tanh'"),
                                           ({"ple_layer_ids": [1, 3]}, "2 PLE layers"),
                                           ({"indexer_budget": None}, "dense attention layers")])
def test_an_option_not_run_is_a_one_line_error(change, named):
    with pytest.raises(UserError) as e:
        config_from_hf(dict(TEXT, architectures=["Qwen4ExpForCausalLM"]) | change)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_ple_rows_gathered_on_the_host_equal_the_lookup(qwen4):
    """NGramHash's rows gathered from the host table equal transformers' n-gram embedding of the same tokens, in
    one call and continued from a sequence's context."""
    cfg, weights, model = qwen4
    module = model.model.layers[0].ple.ple_embedding
    ids = torch.tensor(_ids(30))
    ngram, table = NGramHash.of(cfg), PLETable(weights["per_layer_token_embd.weight"])
    assert ngram.multipliers == module.layer_multipliers.tolist() and ngram.sizes == module.head_vocab_sizes
    with torch.no_grad():
        want = module(ids[None], None)[0]                                   # (T, ple_embed_dim)
    got = table.gather(ngram.rows(ngram.start_context(), ids), "cpu")
    assert torch.equal(got, want)
    ctx = NGramHash.next_context(ngram.start_context(), ids[:17].tolist(), 2)
    assert torch.equal(table.gather(ngram.rows(ctx, ids[17:]), "cpu"), want[17:])
    assert table.bytes_read == (30 + 13) * 4 * 8 * 4                       # tokens x heads x row bytes


def test_qsa_select_breaks_ties_by_lower_block_and_is_topk_elsewhere():
    """Scores tied at 0 (every head's product negative) straddling the cut: the lower blocks among the tied win;
    where no tie straddles the cut, the picks are torch.topk's over each query's own blocks, as transformers' indexer
    calls it (so the checkpoints' logits below are transformers')."""
    cfg = type("C", (), dict(indexer_block=2, indexer_budget=4, indexer_head_dim=4))
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(12, 4, generator=g)
    keys[3:9] = -keys[3:9].abs()
    q = torch.randn(24, 2, 4, generator=g).abs()                           # relu(q.k) = 0 on blocks 3..8
    keep = qsa.select(q, keys, torch.arange(24), cfg, 24)
    straddled = 0
    for p in range(24):
        nb = (p + 1) // 2
        s = torch.relu(torch.matmul(q[p], keys[:nb].t()).t()).sum(-1) / 2
        got = {b for b in range(nb) if keep[p, 2 * b]}
        ranked = sorted(range(nb), key=lambda b: (-s[b].item(), b))
        assert got == set(ranked[:2]), p
        if nb > 2 and s[ranked[1]] == s[ranked[2]]:
            straddled += 1
        else:
            assert got == set(s.topk(min(2, nb), dim=0).indices.tolist()), p
        assert keep[p, 2 * nb:p + 1].all() and not keep[p, p + 1:].any()
    assert straddled


def test_logits_match_transformers(qwen4):
    cfg, weights, model = qwen4
    ids = _ids(48)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    got = Qwen4Reference(cfg, weights, ctx=64).forward(Qwen4Reference(cfg, weights, ctx=64).new_state(),
                                                         [(0, 0, ids)])[0]
    assert (got - want).abs().max() < ATOL


def test_greedy_generation_matches_transformers(qwen4):
    """Transformers' cached decode (its indexer's cached keys, the n-gram context, the PLE conv) against ours, ties
    broken as ours (tied blocks straddle the cut here)."""
    cfg, weights, model = qwen4
    ids = _ids(20, seed=2)
    with torch.no_grad(), lower_index_ties():
        want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    got = Qwen4Reference(cfg, weights, ctx=64).greedy(ids, 10)
    assert got == want


def test_ubatches_and_sequences_together(qwen4):
    """A prompt past the budget in ubatches of 7 against one ubatch, then two sequences decoded together against
    each alone."""
    cfg, weights, _ = qwen4
    ref = Qwen4Reference(cfg, weights, ctx=64)
    a, b = _ids(40, seed=3), _ids(29, seed=4)
    one = ref.forward(ref.new_state(), [(0, 0, a)])[0]
    st = ref.new_state()
    parts = [ref.forward(st, [(0, s, a[s:s + 7])])[0] for s in range(0, 40, 7)]
    assert (torch.cat(parts) - one).abs().max() < 1e-5
    alone = []
    for seq in (a, b):
        st = ref.new_state()
        ref.forward(st, [(0, 0, seq[:-1])])
        alone.append(ref.forward(st, [(0, len(seq) - 1, seq[-1:])])[0])
    st = ref.new_state(2)
    ref.forward(st, [(0, 0, a[:-1]), (1, 0, b[:-1])])
    both = ref.forward(st, [(0, 39, a[-1:]), (1, 28, b[-1:])])
    assert all((x - y).abs().max() < 1e-5 for x, y in zip(both, alone))


def test_the_hf_source_reads_it(qwen4, tmp_path):
    """loading/hf.py's HFSource (shapes checked from the headers) gives canonical_from_hf's tensors, the n-gram
    table from its row shards and the indexer's q/k from index_qk_proj."""
    from moestream.loading.source import open_source
    cfg, weights, model = qwen4
    model.save_pretrained(str(tmp_path))
    src = open_source(str(tmp_path))
    assert src.config == cfg
    for name, t in weights.items():
        if "_exps." not in name:
            assert torch.equal(src.tensor(name), t), name
