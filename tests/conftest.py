"""Shared fixtures: small random checkpoints that transformers itself writes, one per family."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread a test process (and its subprocesses): the suite's ops are small, and two threads that wait on each
# other are many times slower on a shared machine or beside a second xdist worker (24 tokens of synth:tiny: 0.55 s
# on one thread, 9.6 s on two, with the machine's two cores busy).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true, .ci/run) a skipped test fails: the test extra installs every package a test may skip
    without, so a skip there means a test that would pass unrun."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() in ("1", "true") and report.skipped and not getattr(report, "wasxfail", None):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {report.longrepr}"


@pytest.hookimpl(optionalhook=True)      # (a hook of pytest-xdist's: without it installed, pytest knows no such hook)
def pytest_xdist_auto_num_workers(config):
    """addopts' -n auto: xdist's count (a worker a core) for the CPU suite; one process for `-m cuda`, whose tests
    share one GPU and read its free memory and timings."""
    if "cuda" in config.option.markexpr.replace("not cuda", ""):
        return 0
    return None


# The "cuda" case of a test parametrized over devices (deselected unless `-m cuda`, skipped without a GPU).
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])

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
        # GLM-4.5: q/k/v biases, QK-norm, half rotary, sigmoid routing with its bias in 2 of 4 groups, a shared
        # expert, a scale, a dense first layer
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                     dict(head_dim=16, n_routed_experts=8, moe_intermediate_size=32, intermediate_size=48,
                          attention_bias=True, use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=1.5,
                          first_k_dense_replace=1, n_shared_experts=1, norm_topk_prob=True)),
        # DeepSeek-V3: latent attention with q_lora_rank, groups, two shared experts, a dense first layer, YaRN
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(n_routed_experts=8, moe_intermediate_size=16, intermediate_size=48, q_lora_rank=24,
                             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_group=4,
                             topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, n_shared_experts=2,
                             num_key_value_heads=4,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 128, "beta_fast": 32,
                                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
        # Kimi K2's shape of it: q_proj without a low rank, one group, no dense layer, norm_topk_prob off
        "deepseek_v3_plain_q": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                                dict(n_routed_experts=8, moe_intermediate_size=16, q_lora_rank=None, kv_lora_rank=16,
                                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
                                     first_k_dense_replace=0, n_shared_experts=1, norm_topk_prob=False,
                                     num_key_value_heads=4)),
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
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):    # a correction bias that changes some choices
                b.copy_(0.1 * torch.randn_like(b))
    model = model.to(dtype)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session", params=list(family_configs()))
def checkpoint(request, tmp_path_factory):
    """(family, path, transformers model) for each family."""
    path = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(request.param, str(path))
    return request.param, str(path), model


# --- the hybrid families (Qwen3-Next, Qwen3.5-MoE): DeltaNet layers 0 and 2, gated attention layers 1 and 3 ---------
HYBRID_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                   full_attention_interval=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=40, max_position_embeddings=512, bos_token_id=None,
                   eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
HYBRID_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
# qwen3_next; qwen3_5_moe as the multimodal checkpoint (config.json nests text_config, tensors under
# model.language_model.); qwen3_5_moe_text, the text-only form transformers saves
HYBRID_FORMS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def hybrid_model(form: str):
    """A transformers model of a hybrid form, with transformers' init."""
    import transformers as tf
    if form == "qwen3_next":        # a dense layer too, and top-k renormalised by the config's choice
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**HYBRID_TEXT, intermediate_size=48, mlp_only_layers=[2],
                                                          norm_topk_prob=True))
    if form == "qwen3_5_moe":
        return tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=HYBRID_TEXT,
                                                                         vision_config=HYBRID_VISION))
    return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**HYBRID_TEXT))


def randomize_hybrid(model):
    """Weights far from transformers' init, so that a wrong head order, gate or norm shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-2, 0.5))     # decays exp(g) from ~0.9 down to ~0.2 a token
            elif name.endswith("dt_bias"):
                p.normal_(0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "norm" in name:            # zero-centred: the norm scales by 1 + w
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2)


@pytest.fixture(scope="session", params=HYBRID_FORMS)
def hybrid_checkpoint(request, tmp_path_factory):
    """(form, path, transformers model) of a random hybrid checkpoint that transformers wrote (float32)."""
    torch.manual_seed(0)
    model = hybrid_model(request.param).eval()
    randomize_hybrid(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path))
    return request.param, str(path), model


# --- Qwen3.8-Flash-Next (qwen4_exp): DeltaNet layers 0 and 2, QSA layers 1 and 3, 3 hyper-connection streams, a PLE
# layer (HF's 1-based id 1: layer 0); a QSA budget of 8 tokens in blocks of 4, so longer prompts drop blocks -------
QWEN4_EOS = 3
QWEN4_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"] * 2, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=40, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=QWEN4_EOS, pad_token_id=None, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  hc_count=3, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=32, ngram_vocab_size_base=50,
                  heads_per_ngram=2, split_ngram_parts=2, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                  indexer_budget=8, indexer_compress_ratio=4)


@pytest.fixture(scope="session")
def qwen4_checkpoint(tmp_path_factory):
    """(path, transformers model) of a random Qwen3.8-Flash-Next text checkpoint that transformers wrote (float32)."""
    import transformers as tf
    torch.manual_seed(0)
    model = tf.Qwen4ExpForCausalLM(tf.Qwen4ExpTextConfig(**QWEN4_TEXT)).eval()
    randomize_hybrid(model)
    path = tmp_path_factory.mktemp("qwen4_exp")
    model.save_pretrained(str(path))
    return str(path), model


@contextlib.contextmanager
def lower_index_ties():
    """Within it, Tensor.topk breaks ties by lower index (a stable sort), the rule of models/qsa.py's select and
    kernels/qsa.py (and, to check on the GPU, CUDA's topk: tests/test_qsa_kernels.py): transformers' QSA indexer,
    which calls scores.topk, then picks as ours where blocks tied at 0 straddle its cut (random checkpoints' indexers
    tie so often; the CPU's topk takes them in an order of its own). Where no tie straddles, the picks are topk's."""
    plain = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        idx = self.sort(dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))
    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = plain


def greedy_steps(eng, prompt: list[int], n: int) -> list[torch.Tensor]:
    """The prompt in sequence 0 of engine `eng`, then n greedy one-token decode steps: each step's logits (V,)."""
    tok, steps = int(eng.prefill(0, prompt)[-1].argmax()), []
    for pos in range(len(prompt), len(prompt) + n):
        steps.append(eng.decode([(0, tok, pos)])[0].clone())
        tok = int(steps[-1].argmax())
    return steps


def logits_and_steps(llm, prompt: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A placement's bits as the hybrid tests compare them: the prompt's logits, then those of n greedy decode
    steps after it (n, V)."""
    logits = llm.logits(prompt)
    return logits, torch.stack(greedy_steps(llm.engine, prompt, n))


def has_cuda() -> bool:
    return torch.cuda.is_available()
