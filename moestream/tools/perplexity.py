"""`moestream perplexity`: perplexity, and KL divergence against saved base logits, shaped like llama-perplexity.

    moestream perplexity -m model.gguf -f wiki.test.raw -c 512 --chunks 100
    moestream perplexity -m model -f wiki.test.raw --kl-divergence-base base.kld              # also save the base
    moestream perplexity -m model --cpu-moe --kl-divergence-base base.kld --kl-divergence    # compare against it

Scoring, as llama-perplexity does it: the tokens are cut into chunks of -c tokens (default 512), each evaluated
from position 0 with an empty cache (where the tokenizer adds a BOS token, it replaces each chunk's first token).
Only the second half of each chunk is scored: the logits at positions c/2 .. c-2 predict tokens c/2+1 .. c-1
(c - 1 - c/2 tokens per chunk, 255 for c = 512), so every scored token has at least c/2 tokens of context.
Output: `[1]x,[2]y,...`, the running PPL after each chunk, then `Final estimate: PPL = x +/- y` with
y = PPL * sqrt((<nll^2> - <nll>^2) / (N - 1)) over the N scored tokens.

Input: -f FILE is text, tokenized with the model's tokenizer (BOS first where it adds one). A model without a
tokenizer, or --token-ids, reads token ids instead: integers separated by whitespace and/or commas.

--kl-divergence-base FILE (alone) saves the base, a new file (one that exists is refused: it may be the input):
a torch file with the tokens of each chunk and, per scored token, the top --kl-top-k log-probs (float32; 0 keeps
the whole vocabulary), the log of the probability outside them, the log-prob of the actual next token and the argmax
(see ppl_stats for the KL this gives). With --kl-divergence the tokens and -c come from that file (-f is not
needed) and the output is llama-perplexity's KL table and statistics.
As llama-perplexity, -b / -c chunks run together, one sequence each (n_seq; 4 at -b 2048 -c 512), each cut into
ubatches of -ub: with host experts they run layer by layer, so a layer's experts cross the link once for all of
them. Each ubatch gives the bits it gives alone, so -b changes no figure; logits are bit-identical for one -ub
whatever the placement of the experts, so `--cpu-moe` against every expert on the device gives KLD 0 exactly.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
import zipfile
from dataclasses import dataclass, field

import torch

from .. import compat, flags
from ..errors import UserError
from ..outputs import atomic_path, check_writable
from ..runtime import threads
from .ppl_stats import KLStats, Summary, kl_per_token, log_probs, ppl_estimate

BASE_FORMAT = "moestream-kld-base"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    flags.add_engine_arguments(p, ctx_size=dict(default=512,
                                                help="chunk size: tokens per evaluated chunk (default 512)"))
    p.add_argument("-f", "--file", help="the text to score (or token ids, see --token-ids)")
    p.add_argument("--chunks", type=int, default=-1, help="score at most N chunks (default: all)")
    p.add_argument("--token-ids", action="store_true",
                   help="FILE holds token ids (integers separated by whitespace or commas), not text")
    p.add_argument("--kl-divergence-base", metavar="FILE",
                   help="save the base log-probs here, a new file (or read them)")
    p.add_argument("--kl-divergence", action="store_true", help="compare against --kl-divergence-base FILE")
    p.add_argument("--kl-top-k", type=int, default=256,
                   help="log-probs kept per token in the base file (default 256; 0: the whole vocabulary)")
    p.add_argument("--plot", metavar="FILE.png", help="plot the running PPL per chunk (and the KLD histogram)")
    compat.add_arguments(p, "perplexity")
    p.set_defaults(func=main)


# --- input ---------------------------------------------------------------------------------------------------
def read_text(path: str) -> str:
    try:
        return open(path, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def read_tokens(path: str, llm, token_ids: bool = False, text: str | None = None) -> list[int]:
    """The tokens of -f FILE (its `text`, if already read): text through the tokenizer, or token ids."""
    text = read_text(path) if text is None else text
    if token_ids or llm.tokenizer is None:
        if not re.fullmatch(r"[\d\s,]*", text):
            why = "--token-ids was given" if token_ids else "this model has no tokenizer"
            raise UserError(f"{path!r} must hold token ids ({why}): integers separated by whitespace or commas")
        return llm.encode([int(t) for t in re.split(r"[\s,]+", text.strip()) if t])
    return llm.tokenizer.encode(text)


def make_chunks(tokens: list[int], n_ctx: int, n_chunks: int = -1, bos: int | None = None) -> list[list[int]]:
    """Whole chunks of n_ctx tokens (the rest is dropped, as llama-perplexity does); bos replaces each first token."""
    if n_ctx - 1 - n_ctx // 2 < 1:
        raise UserError(f"-c {n_ctx} scores no token: the second half of a chunk must hold 2 tokens (-c 4 or more)")
    n_max = len(tokens) // n_ctx
    if n_max == 0:
        raise UserError(f"the input has {len(tokens)} tokens, fewer than one chunk of -c {n_ctx}; "
                        "give a longer text or a smaller -c")
    n = n_max if n_chunks < 0 else min(n_chunks, n_max)
    chunks = [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n)]
    if bos is not None:
        chunks = [[bos, *c[1:]] for c in chunks]
    return chunks


# --- the runs ------------------------------------------------------------------------------------------------
@dataclass
class PerplexityResult:
    nll: torch.Tensor                                     # (N,) float64, every scored token in order
    chunk_ppl: list[float] = field(default_factory=list)  # the running PPL after each chunk
    base: Summary | None = None                           # with top_k: what a base file keeps

    @property
    def estimate(self) -> tuple[float, float | None]:
        return ppl_estimate(self.nll)


def scored(chunk: list[int]) -> tuple[int, torch.Tensor]:
    """(first, targets): logits at positions first .. c-2 predict the tokens first+1 .. c-1."""
    first = len(chunk) // 2
    return first, torch.tensor(chunk[first + 1:])


def chunk_logits(logits_fn, chunks: list[list[int]], per_batch: int = 1):
    """(i, chunk, its logits) in chunk order, `per_batch` chunks a call of logits_fn(list of chunks) -> their
    (len, V) float32 logits (LLM.logits_many: llama-perplexity's several sequences a batch)."""
    for i in range(0, len(chunks), per_batch):
        group = chunks[i:i + per_batch]
        yield from zip(range(i, i + len(group)), group, logits_fn(group))


def perplexity(logits_fn, chunks: list[list[int]], top_k: int | None = None, on_chunk=None,
               per_batch: int = 1) -> PerplexityResult:
    """logits_fn(list of chunks) -> their (len, V) float32 logits, `per_batch` chunks a call; top_k (not None):
    also keep the base summary."""
    nlls, parts, out = [], [], PerplexityResult(torch.empty(0, dtype=torch.float64))
    for i, chunk, logits in chunk_logits(logits_fn, chunks, per_batch):
        first, targets = scored(chunk)
        lp = log_probs(logits[first:-1])                                            # (c-1-first, V)
        nlls.append(-lp.gather(-1, targets[:, None])[:, 0])
        if top_k is not None:
            parts.append(Summary.of(lp, targets, top_k))
        all_nll = torch.cat(nlls)
        out.chunk_ppl.append(math.exp(float(all_nll.sum()) / all_nll.numel()))
        if on_chunk is not None:
            on_chunk(i, out.chunk_ppl[-1])
    out.nll = torch.cat(nlls)
    out.base = Summary.cat(parts) if parts else None
    return out


def kl_divergence(logits_fn, chunks: list[list[int]], base: Summary, on_chunk=None, per_batch: int = 1) -> KLStats:
    """Compare every chunk's log-probs with the base's (its rows in chunk order); on_chunk(i, stats) after each.
    logits_fn and per_batch as perplexity's."""
    st, row = KLStats(), 0
    for i, chunk, logits in chunk_logits(logits_fn, chunks, per_batch):
        first, targets = scored(chunk)
        b = base.rows(row, row + len(targets))
        row += len(targets)
        cur = b.compare(log_probs(logits[first:-1]), targets)
        st.add(-cur.target, -b.target, kl_per_token(b, cur), cur.top1 == b.top1)
        if on_chunk is not None:
            on_chunk(i, st)
    return st


# --- base files ----------------------------------------------------------------------------------------------
def save_base(path: str, chunks: list[list[int]], base: Summary, n_vocab: int, model: str) -> None:
    k = base.idx.shape[1]
    torch.save({"format": BASE_FORMAT, "version": 1, "model": model, "n_ctx": len(chunks[0]), "n_vocab": n_vocab,
                "top_k": 0 if k == n_vocab else k, "tokens": torch.tensor(chunks, dtype=torch.int32),
                **base.to_dict()}, path)


def save_base_file(path: str, *args) -> None:
    """save_base, whole or not at all: an interrupted save leaves no partial base file, and nothing that was at
    `path` (the input text, the model, given by mistake) is replaced."""
    with atomic_path(path, new=True) as tmp:
        save_base(tmp, *args)


def load_base(path: str) -> dict:
    """A base file save_base wrote, checked whole; one line (UserError) for anything else."""
    try:
        with open(path, "rb") as f:
            if f.read(8) == b"_logits_":
                raise UserError(f"{path!r} is a llama.cpp logits file; moestream reads the base files it writes "
                                "itself (moestream perplexity -f TEXT --kl-divergence-base FILE)")
        with zipfile.ZipFile(path) as z:    # torch.load reads no checksum: a flipped byte would load as data
            bad = z.testzip()
        if bad is not None:
            raise UserError(f"{path!r} is damaged (its data fail their CRC check); write it again with "
                            "--kl-divergence-base alone")
        d = torch.load(path, weights_only=True)
    except OSError as e:
        raise UserError(f"cannot read the base file {path!r}: {e.strerror}") from None
    except UserError:
        raise
    except Exception:                       # what torch.load raises on a file it did not write varies (pickle, zip)
        d = None
    if not isinstance(d, dict) or d.get("format") != BASE_FORMAT:
        raise UserError(f"{path!r} is not a moestream base file (write one with --kl-divergence-base alone)")
    _check_base(d, path)
    return d


def _check_base(d: dict, path: str) -> None:
    """Sizes and shapes that agree, and token ids within the vocabulary: what kl_divergence indexes with."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise UserError(f"{path!r} is not a whole base file ({what}); write it again with --kl-divergence-base "
                            "alone")

    def tensor(key: str, floating: bool, shape: tuple, high: int | None = None) -> None:
        t = d.get(key)
        need(isinstance(t, torch.Tensor) and t.is_floating_point() == floating and tuple(t.shape) == shape
             and (high is None or not t.numel() or (t.min() >= 0 and t.max() < high)), key)
    need(all(type(d.get(k)) is int for k in ("n_ctx", "n_vocab", "top_k")), "its sizes")
    n_ctx, vocab, top_k, tokens = d["n_ctx"], d["n_vocab"], d["top_k"], d.get("tokens")
    need(n_ctx >= 4 and vocab >= 1 and 0 <= top_k <= vocab, "its sizes")
    need(isinstance(tokens, torch.Tensor) and tokens.ndim == 2 and len(tokens) > 0, "tokens")
    tensor("tokens", False, (len(tokens), n_ctx), vocab)
    n = len(tokens) * (n_ctx - 1 - n_ctx // 2)                 # the scored tokens
    k = top_k or vocab                                         # Summary.of's k: top_k 0 keeps every token
    tensor("idx", False, (n, k), vocab)
    tensor("logp", True, (n, k))
    for key in ("tail", "target"):
        tensor(key, True, (n,))
    tensor("top1", False, (n,), vocab)


# --- the command ---------------------------------------------------------------------------------------------
def per_batch(a: argparse.Namespace, n_ctx: int) -> int:
    """Chunks a batch, as llama-perplexity's n_seq: -b / n_ctx (at least one)."""
    return max(1, a.batch_size // n_ctx)


def _load(a: argparse.Namespace, n_ctx: int):
    from ..cli import load_model
    a.ctx_size = n_ctx
    llm = load_model(a, flags.to_config(a), progress=a.verbose, n_seq=per_batch(a, n_ctx))
    threads.use("prompt")                   # every forward here is a prompt's (-tb, else -t)
    return llm


def _timed_logits(llm):
    """LLM.logits_many, and the seconds a chunk of its first call (t["first"])."""
    t = {"first": None}

    def fn(chunks):
        t0 = time.perf_counter()
        out = llm.logits_many(chunks)
        if t["first"] is None:
            t["first"] = (time.perf_counter() - t0) / len(chunks)
        return out
    return fn, t


def main(a: argparse.Namespace) -> int:
    if a.kl_divergence and not a.kl_divergence_base:
        raise UserError("--kl-divergence needs --kl-divergence-base FILE (written by a run without --kl-divergence)")
    if a.chunks == 0 or a.chunks < -1:
        raise UserError(f"--chunks must be at least 1, or -1 for all, got {a.chunks}")
    err = sys.stderr
    if a.plot:
        from .report import check_plot
        check_plot(a.plot)
    if a.kl_divergence_base and not a.kl_divergence:       # it will be written: refuse a bad path before the work
        check_writable(a.kl_divergence_base, "--kl-divergence-base", new=True)
    if a.kl_divergence:
        d = load_base(a.kl_divergence_base)
        chunks = d["tokens"].tolist()
        if a.chunks >= 0:
            chunks = chunks[:a.chunks]
        if a.file:
            print(f"perplexity: the tokens come from {a.kl_divergence_base}; -f {a.file} is not read", file=err)
        llm = _load(a, d["n_ctx"])
        if d["n_vocab"] != llm.model_config.vocab_size:
            raise UserError(f"the base file has a vocabulary of {d['n_vocab']} tokens, this model "
                            f"{llm.model_config.vocab_size}: it was written for another model")
        fn, t = _timed_logits(llm)
        print(f"kl_divergence: {len(chunks)} chunks of {d['n_ctx']} tokens from {a.kl_divergence_base}, scoring the "
              f"second half of each ({d['n_ctx'] - 1 - d['n_ctx'] // 2} tokens), base top-k {d['top_k'] or 'all'}",
              file=err)
        print("\n" + KLStats.HEADER)
        running = []

        def on_chunk(i, st):
            running.append(math.exp(st.log_ppl()[0]))
            if i == 0:
                print(f"kl_divergence: {t['first']:.2f} seconds per pass - ETA "
                      f"{t['first'] * len(chunks) / 60:.2f} minutes", file=err)
            print(st.chunk_line(i + 1), flush=True)
        st = kl_divergence(fn, chunks, Summary.from_dict(d), on_chunk, per_batch(a, d["n_ctx"]))
        if st.count < 100:
            print(f"kl_divergence: only {st.count} scored tokens (llama-perplexity prints no statistics under 100)",
                  file=err)
        print("\n" + st.report())
        if a.plot:
            from .report import plot_perplexity
            plot_perplexity(running, st.kld_values, a.plot)
        return 0

    if not a.file:
        raise UserError("no input: give -f FILE (text, or token ids with --token-ids)")
    text = read_text(a.file)                 # before the load: a bad file is refused at once
    llm = _load(a, a.ctx_size)
    print("perplexity: tokenizing the input ..", file=err)
    tok = llm.tokenizer
    tokens = read_tokens(a.file, llm, a.token_ids, text)
    chunks = make_chunks(tokens, a.ctx_size, a.chunks, tok.bos_id if tok is not None and tok.add_bos else None)
    n_scored = a.ctx_size - 1 - a.ctx_size // 2
    print(f"perplexity: calculating perplexity over {len(chunks)} chunks, n_ctx={a.ctx_size}, "
          f"batch_size={a.batch_size}, ubatch_size={a.ubatch_size}, n_seq={per_batch(a, a.ctx_size)}; scoring the "
          "second half of each chunk "
          f"({n_scored} tokens, as llama-perplexity)", file=err)
    fn, t = _timed_logits(llm)

    def on_chunk(i, ppl):
        if i == 0:
            print(f"perplexity: {t['first']:.2f} seconds per pass - ETA {t['first'] * len(chunks) / 60:.2f} minutes",
                  file=err)
        print("[%d]%.4f," % (i + 1, ppl), end="", flush=True)
    saving = a.kl_divergence_base is not None
    res = perplexity(fn, chunks, a.kl_top_k if saving else None, on_chunk, per_batch(a, a.ctx_size))
    print()
    ppl, unc = res.estimate
    if unc is None:
        print("Unexpected negative standard deviation of log(prob)", file=err)
    print("Final estimate: PPL = %.4f +/- %.5f" % (ppl, unc or 0.0))
    if saving:
        save_base_file(a.kl_divergence_base, chunks, res.base, llm.model_config.vocab_size, a.model)
        print(f"perplexity: saved the base log-probs of {res.nll.numel()} tokens to {a.kl_divergence_base}", file=err)
    if a.plot:
        from .report import plot_perplexity
        plot_perplexity(res.chunk_ppl, None, a.plot)
    return 0
