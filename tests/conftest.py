"""Shared fixtures: small random checkpoints that transformers itself writes, one per family."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true, .ci/run) a skipped test fails: the test extra installs every package a test may skip
    without, so a skip there means a test that would pass unrun."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() in ("1", "true") and report.skipped and not getattr(report, "wasxfail", None):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {report.longrepr}"

VOCAB = 160
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)


def family_configs():
    """HF config class name -> kwargs: each family with the features that set it apart switched on."""
    return {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(head_dim=16, num_experts=8, moe_intermediate_size=32, intermediate_size=48,
                           norm_topk_prob=True, mlp_only_layers=[1])),
        "qwen3_moe_yarn": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(head_dim=16, num_experts=8, moe_intermediate_size=32, norm_topk_prob=False,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 128})),
        "qwen3_moe_linear_tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                  dict(head_dim=16, num_experts=8, moe_intermediate_size=32, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(num_experts=8, moe_intermediate_size=32, intermediate_size=48,
                           shared_expert_intermediate_size=40, decoder_sparse_step=2)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, intermediate_size=32)),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, intermediate_size=32, clip_qkv=4.0)),
    }


def write_checkpoint(family: str, out_dir: str, dtype=torch.float32, seed: int = 0):
    """A random checkpoint written by transformers' save_pretrained; returns the transformers model (eval)."""
    import transformers
    cfg_name, model_name, extra = family_configs()[family]
    cfg = getattr(transformers, cfg_name)(**(COMMON | extra))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        # Larger weights than transformers' init (std 0.02), so that routing is far from uniform and
        # a wrong expert or a wrong weight shows in the logits.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    model = model.to(dtype)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session", params=list(family_configs()))
def checkpoint(request, tmp_path_factory):
    """(family, path, transformers model) for each family."""
    path = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(request.param, str(path))
    return request.param, str(path), model


def has_cuda() -> bool:
    return torch.cuda.is_available()
