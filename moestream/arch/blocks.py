"""The blocks a family's decoder is built from, as plain data: a family's entry (arch/families.py) picks each one
and its options, and models/ builds them (models/blocks.py), as llama.cpp's build_attn and build_moe_ffn take a
gating function, a bias, a scale and a norm flag.

    Blocks()                                          # GQA attention, softmax top-k, SwiGLU experts, plain residual
    Blocks(attention="gated", mixer="deltanet")       # Qwen3-Next: gated attention and Gated DeltaNet layers

What a checkpoint sets in its config.json (q/k/v biases, QK-norm, the clamp of q/k/v, renormalising the top-k
weights, a shared expert's width) is ModelConfig's; what a family fixes is here. An option's default is what
every family run today does; "room" marks an option the next families set, which models/blocks.py refuses until
its math is in: a new family is an entry, and only the blocks or options that are new.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ATTENTION_KINDS = ("gqa", "gated", "mla", "qsa")    # qsa: an indexer picks the key blocks (models/qsa.py)
MIXERS = ("deltanet",)                   # layer_types' linear_attention layers
RESIDUALS = ("plain", "hyper")           # hyper: hyper-connections, several residual streams (models/residual.py)


@dataclass(frozen=True)
class Attention:
    """The attention layers' block. gqa: grouped-query attention (with ModelConfig's biases, QK-norm, clamp and
    partial rotary); gated: GQA whose output a sigmoid of q_proj's second half gates per element, rotary on the
    first rotary_dim dims (Qwen3-Next); mla: multi-head latent attention (DeepSeek-V3), a latent KV cache; qsa:
    gated attention over the key blocks a learnt indexer picks, its keys cached beside K and V (Qwen3.8-Flash-Next)."""
    kind: str = "gqa"
    window: bool = False                 # layer_types' sliding_attention layers attend their last
                                         # ModelConfig.sliding_window keys only (gpt-oss)
    sinks: bool = False                  # a learnt sink logit per head joins the softmax: it takes mass and adds
                                         # no value (gpt-oss: attn_sinks.weight)
    out_bias: bool = False               # ModelConfig.attn_bias puts a bias on o_proj too (gpt-oss)


@dataclass(frozen=True)
class Router:
    """The MoE router: the gating function over every expert's logit, then top-k; ModelConfig.norm_topk_prob says
    whether the k weights are renormalised. A family's entry gives what its checkpoints default to where their
    config does not say (DeepSeek-V3's and GLM-4.5's: sigmoid with a correction bias; gpt-oss's softmax_weight);
    ModelConfig holds what a checkpoint sets, and models/router.py's router_of makes the block's options from it."""
    gating: str = "softmax"              # softmax in float32, sigmoid (DeepSeek-V3), or softmax_weight (llama.cpp's
                                         # name; gpt-oss): top-k over the logits, then a softmax over the chosen k
    bias: bool = False                   # a per-expert correction bias added for the choice only (exp_probs_b)
    groups: int = 1                      # top-k within the best topk_group of `groups` expert groups
    scale: float = 1.0                   # a factor on the routed weights (routed_scaling_factor)
    topk_group: int = 1
    linear_bias: bool = False            # the router's linear has a bias (gpt-oss: ffn_gate_inp.bias)


@dataclass(frozen=True)
class ExpertMLP:
    """One expert's MLP: SwiGLU, down(silu(gate x) * up x), in every kernel (kernels/); or swiglu_oai (gpt-oss,
    llama.cpp's name): gate clamped above at `clamp`, up to [-clamp, clamp], (up + 1) * gate * sigmoid(1.702 gate),
    with biases on gate, up and down (kernels/reference.py's OaiSwiglu)."""
    activation: str = "swiglu"           # swiglu | swiglu_oai
    clamp: float | None = None           # swiglu_oai's limit (7, as llama.cpp fixes it)
    bias: bool = False                   # biases on gate, up and down (ffn_{gate,up,down}_exps.bias), by expert id


@dataclass(frozen=True)
class Blocks:
    attention: Attention = field(default_factory=Attention)
    mixer: str | None = None             # the block of layer_types' linear_attention layers (None: none)
    router: Router = field(default_factory=Router)
    experts: ExpertMLP = field(default_factory=ExpertMLP)
    residual: str = "plain"
    shared_gate: bool = True             # a shared expert (ModelConfig's width) is sigmoid-gated (Qwen2-MoE); False:
                                         # always on, ungated (DeepSeek-V3, GLM-4.5)

    @property
    def hybrid(self) -> bool:
        """Layers of two kinds, a mixer's and attention's, by layer_types."""
        return self.mixer is not None


# The sets of blocks the families pick (arch/families.py).
MOE = Blocks(Attention("gqa"), router=Router("softmax"), experts=ExpertMLP("swiglu"), residual="plain")
# DeepSeek-V3 and GLM-4.5: sigmoid routing with a correction bias (groups and scale are the checkpoint's), shared
# experts always on.
SIGMOID = Router("sigmoid", bias=True)
MLA = Blocks(Attention("mla"), router=SIGMOID, shared_gate=False)
GQA_SIGMOID = Blocks(Attention("gqa"), router=SIGMOID, shared_gate=False)
GPT_OSS = Blocks(Attention("gqa", window=True, sinks=True, out_bias=True),
                 router=Router("softmax_weight", linear_bias=True),
                 experts=ExpertMLP("swiglu_oai", clamp=7.0, bias=True), residual="plain")
HYBRID = Blocks(Attention("gated"), mixer="deltanet", router=Router("softmax"), experts=ExpertMLP("swiglu"),
                residual="plain")
# Qwen3.8-Flash-Next (qwen4_exp): the hybrid's blocks with QSA attention and hyper-connections (models/qsa.py,
# residual.py's Hyper; its PLE layer is ModelConfig.ple_layers', models/ple.py).
QWEN4 = Blocks(Attention("qsa"), mixer="deltanet", router=Router("softmax"), experts=ExpertMLP("swiglu"),
               residual="hyper")
