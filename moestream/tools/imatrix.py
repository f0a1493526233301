"""`moestream imatrix`: an importance matrix over a text, in the GGUF format llama-imatrix writes.

    moestream imatrix -m model.gguf -f calibration.txt -o imatrix.gguf --chunks 100 -c 512
    moestream imatrix -m ref.gguf -f ids.txt --token-ids        # token ids (a model without a tokenizer reads ids)
    moestream quantize model.gguf iq1_m.gguf IQ1_M --imatrix imatrix.gguf

As llama-imatrix: the tokens are cut into chunks of -c tokens (default 512; where the tokenizer adds a BOS token it
replaces each chunk's first), each run from position 0, and for every weight matrix of a layer (`blk.*`) the
activations entering it are summed, squared and plain, by column: for a dense matrix over every token of a
forward of 16 tokens or more (llama-imatrix skips smaller ones), for an expert stack per expert over the tokens
routed to it (its count: those tokens). Attention's q, k and v (one GEMM here) each get the entry of their shared
input; qwen3next's ssm_in its attn_qkv and attn_gate. Unlike llama-imatrix, Qwen3.8-Flash-Next's output mixer
(`output_hc_down`, `output_hc_up`) gets entries too, without which an IQ1/IQ2 file of it cannot be made. The file:
moestream/quant/imatrix.py. llama-imatrix's perplexity printout and its .stats tensors are not made.

The collection runs on the CPU path (plain-torch expert kernel, every expert on the host: `--cpu-moe` is implied)
through a torch function mode that sees each F.linear, and a wrapper of the expert kernel told each layer's routing
as a route observer is: nothing of it runs, or costs, in a forward without it.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import flags
from ..errors import UserError
from ..experts.routing import RouteObserver
from ..kernels.reference import OaiSwiglu, glu
from ..outputs import check_writable

MIN_ROWS = 16       # llama-imatrix ignores the dense products of smaller batches


def weight_names(model, cfg) -> dict[int, list[str]]:
    """id of each layer weight the forward multiplies by -> the GGUF names whose input it is."""
    from ..arch.names import gguf_name, gguf_tensors
    file_names = {n for n, _ in gguf_tensors(cfg)}
    out = {}
    for i, lw in enumerate(model.layers):
        for key, t in lw.items():
            if not key.endswith("weight") or t.dim() < 2:
                continue
            name = f"blk.{i}.{key}"
            if name in file_names:
                names = [name]
            elif key == "attn_qkv.weight":          # attn_q, attn_k and attn_v concatenated at load
                names = [f"blk.{i}.attn_{p}.weight" for p in "qkv"]
            elif key == "ssm_in.weight":            # llama.cpp's qwen3next holds it as attn_qkv and attn_gate
                names = [f"blk.{i}.attn_qkv.weight", f"blk.{i}.attn_gate.weight"]
            elif key == "ssm_proj.weight":          # the split layout's input projections, fused at load
                names = [f"blk.{i}.{n}.weight" for n in ("attn_qkv", "attn_gate", "ssm_ba", "ssm_beta", "ssm_alpha")]
            else:
                continue
            out[id(t)] = [gguf_name(cfg, n) for n in names if n in file_names]
    # Qwen3.8-Flash-Next's output mixer (output_hc_down, output_hc_up), outside blk.*: llama-imatrix b11549 leaves
    # it out (imatrix.cpp collect_imatrix: blk.* only), and llama-quantize then refuses an IQ1/IQ2 file of the family
    # ("Missing importance matrix for tensor output_hc_down.weight"): moestream's file has its entries
    for key, t in model.w.items():
        if key.startswith("output_hc_") and t.dim() == 2 and key in file_names:
            out[id(t)] = [gguf_name(cfg, key)]
    return out


class Collector(RouteObserver):
    """Sums of x^2 and x by column of the activations entering each named weight matrix (float64), and counts."""

    def __init__(self, names: dict[int, list[str]], n_experts: int):
        self.names, self.n_experts = names, n_experts
        self.sum2: dict[str, torch.Tensor] = {}      # name -> (n_mat, n)
        self.sum1: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}    # name -> (n_mat,) int64
        self.layer, self.ids, self.offset = None, None, 0

    def _entry(self, name: str, n_mat: int, n: int):
        if name not in self.sum2:
            self.sum2[name] = torch.zeros(n_mat, n, dtype=torch.float64)
            self.sum1[name] = torch.zeros(n_mat, n, dtype=torch.float64)
            self.counts[name] = torch.zeros(n_mat, dtype=torch.int64)
        return self.sum2[name], self.sum1[name], self.counts[name]

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        names = self.names.get(id(weight))
        if not names:
            return
        x = x.detach().reshape(-1, x.shape[-1]).double()
        if x.shape[0] < MIN_ROWS:
            return
        for name in names:
            s2, s1, c = self._entry(name, 1, x.shape[1])
            s2[0] += (x * x).sum(0)
            s1[0] += x.sum(0)
            c[0] += x.shape[0]

    def on_route(self, layer: int, ids, guess=None) -> None:
        self.layer, self.ids, self.offset = layer, ids.detach().cpu(), 0

    def experts(self, x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                act: OaiSwiglu | None = None) -> None:
        """One part's call of the expert kernel (moe.moe_experts): its rows of the layer's routing follow the
        previous part's. Gate and up see x; down sees each choice's activation as the kernel computes it
        (silu(gate) * up, or with `act` gpt-oss's clamped SwiGLU with biases)."""
        T, k = slots.shape
        ids = self.ids[self.offset:self.offset + T]
        self.offset += T
        if ids.shape != slots.shape:
            raise UserError("imatrix: the experts of a layer ran in waves (an expert cache smaller than one ubatch's "
                            "routed set); run it on the CPU (--device cpu) or with a larger --moe-cache-mib")
        from ..arch.names import EXPERT_STACKS
        prefix = f"blk.{self.layer}."
        flat_ids, flat_slots = ids.reshape(-1), slots.reshape(-1).cpu()
        xs = x.detach().cpu().double().repeat_interleave(k, dim=0)                     # (T k, H)
        inter = w2.shape[-1]
        h = torch.empty(T * k, inter, dtype=torch.float64)
        for s in flat_slots.unique().tolist():
            rows = (flat_slots == s).nonzero().squeeze(1)
            gu = F.linear(x.detach()[rows // k], w13[s])                               # the kernel's own product
            h[rows] = glu(gu, inter, act, None if act is None else act.ids.reshape(-1)[rows]).cpu().double()
        for stack, inp in zip(EXPERT_STACKS, (xs, xs, h)):
            s2, s1, c = self._entry(prefix + stack + ".weight", self.n_experts, inp.shape[1])
            s2.index_add_(0, flat_ids, inp * inp)
            s1.index_add_(0, flat_ids, inp)
            c.index_add_(0, flat_ids, torch.ones_like(flat_ids))

    def imatrix(self, datasets: list[str], chunk_count: int, chunk_size: int):
        from ..quant.imatrix import Imatrix
        return Imatrix({n: s.float().numpy() for n, s in self.sum2.items()},
                       {n: c.numpy() for n, c in self.counts.items()}, datasets, chunk_count, chunk_size,
                       {n: s.float().numpy() for n, s in self.sum1.items()})


class _Tap(TorchFunctionMode):
    """Hands every F.linear's input and weight to the collector while active."""

    def __init__(self, collector: Collector):
        super().__init__()
        self.collector = collector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            self.collector.linear(args[0], args[1] if len(args) > 1 else kwargs["weight"])
        return func(*args, **kwargs)


class _ExpertTap:
    """The engine's expert kernel, also telling the collector what it saw."""

    def __init__(self, kernel, collector: Collector):
        self.kernel, self.collector = kernel, collector

    def __call__(self, x, slots, w13, w2, *act):
        self.collector.experts(x, slots, w13, w2, *act)
        return self.kernel(x, slots, w13, w2, *act)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


@contextlib.contextmanager
def collecting(llm):
    """Collect over the forwards run inside: yields the Collector."""
    engine = llm.engine
    col = Collector(weight_names(engine.model, llm.model_config), llm.model_config.n_experts)
    kernel = engine.kernel
    engine.kernel = _ExpertTap(kernel, col)
    engine.observers.add(col)
    try:
        with _Tap(col):
            yield col
    finally:
        engine.kernel = kernel
        engine.observers.remove(col)


def compute_imatrix(llm, chunks: list[list[int]], dataset: str, on_chunk=None):
    """The Imatrix of the model over the chunks (each run from position 0 with an empty cache)."""
    with collecting(llm) as col:
        for i, chunk in enumerate(chunks):
            llm.logits(chunk)
            if on_chunk:
                on_chunk(i)
    return col.imatrix([dataset], len(chunks), len(chunks[0]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    flags.add_engine_arguments(p, ctx_size=dict(default=512, help="chunk size: tokens per chunk (default 512)"))
    p.add_argument("-f", "--file", help="the calibration text (or token ids, see --token-ids)")
    p.add_argument("-o", "--output-file", default="imatrix.gguf", help="the file to write (default imatrix.gguf)")
    p.add_argument("--chunks", type=int, default=-1, help="use at most N chunks (default: all)")
    p.add_argument("--token-ids", action="store_true",
                   help="FILE holds token ids (integers separated by whitespace or commas), not text")
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    from ..cli import load_model
    from ..quant.imatrix import write_imatrix
    from .perplexity import make_chunks, read_text, read_tokens
    if not a.file:
        raise UserError("no input: give -f FILE (text, or token ids with --token-ids)")
    if a.chunks == 0 or a.chunks < -1:
        raise UserError(f"--chunks must be at least 1, or -1 for all, got {a.chunks}")
    check_writable(a.output_file, "-o")
    text = read_text(a.file)
    a.cpu_moe = True                                    # the plain-torch expert kernel over every expert
    llm = load_model(a, flags.to_config(a), progress=a.verbose)
    tok = llm.tokenizer
    tokens = read_tokens(a.file, llm, a.token_ids, text)
    chunks = make_chunks(tokens, a.ctx_size, a.chunks, tok.bos_id if tok is not None and tok.add_bos else None)
    err = sys.stderr
    print(f"imatrix: computing over {len(chunks)} chunks, n_ctx={a.ctx_size}", file=err)
    im = compute_imatrix(llm, chunks, a.file, lambda i: print(f"[{i + 1}]", end="", file=err, flush=True))
    print(file=err)
    partial = [n for n, c in im.counts.items() if (c == 0).any()]
    if partial:
        print(f"imatrix: {len(partial)} expert stacks have experts no token reached (their importance reads as 1, as "
              f"llama-quantize takes it), e.g. {partial[0]}", file=err)
    path = write_imatrix(a.output_file, im)
    print(f"wrote {path}: {len(im.sums)} entries over {len(chunks)} chunks of {a.ctx_size} tokens")
    return 0
