"""The statistics of `moestream perplexity`, with llama-perplexity's formulas and output lines.

    nll = -log_probs(logits)[torch.arange(n), targets]             # (n,) float64 per scored token
    ppl, unc = ppl_estimate(nll)                                    # Final estimate: PPL = ppl +/- unc
    base = Summary.of(log_probs(base_logits), targets, top_k=256)   # what a base file keeps per scored token
    kl = kl_per_token(base, base.compare(log_probs(logits)))        # (n,) float64, exactly 0 for the same logits
    st = KLStats(); st.add(nll, -base.target, kl, same_top); print(st.report())

KL(base || current) per token: sum over the base's top-k tokens of p (log p - log q), plus the rest of the
vocabulary as one bucket, p_rest (log p_rest - log q_rest). With k = the vocabulary size that is the whole KL;
with fewer it is a lower bound (merging tokens never raises a KL), exact up to the mass outside the top k. Both
sides go through the same float32 rounding of the same log-probs, so comparing a run to itself gives 0 exactly.
llama.cpp instead stores every log-prob as uint16 over [max - 16, max] and skips the terms with p < e^-16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """(n, V) float64 log-softmax: one function for every run, so equal logits give equal log-probs."""
    return torch.log_softmax(logits.double(), dim=-1)


def ppl_estimate(nll: torch.Tensor) -> tuple[float, float | None]:
    """(PPL, its uncertainty) as llama-perplexity's `Final estimate`: exp(<nll>) and
    PPL * sqrt((<nll^2> - <nll>^2) / (N - 1)); the uncertainty is None where that variance is not positive."""
    n = nll.numel()
    mean = float(nll.sum()) / n
    var = float((nll * nll).sum()) / n - mean * mean
    ppl = math.exp(mean)
    return ppl, (math.sqrt(var / (n - 1)) * ppl if var > 0 and n > 1 else None)


@dataclass
class Summary:
    """Per scored position, what a base file keeps of a distribution (N positions, k of V tokens)."""
    idx: torch.Tensor         # (N, k) int64: the base's top-k token ids
    logp: torch.Tensor        # (N, k) float32: log-probs of those tokens
    tail: torch.Tensor        # (N,) float32: log of the probability outside them (-inf when k = V)
    target: torch.Tensor      # (N,) float64: log-prob of the actual next token
    top1: torch.Tensor        # (N,) int64: the argmax

    @staticmethod
    def of(lp: torch.Tensor, targets: torch.Tensor, top_k: int = 0) -> "Summary":
        """lp (N, V) from log_probs; top_k <= 0 or >= V keeps the whole vocabulary."""
        k = lp.shape[-1] if top_k <= 0 else min(top_k, lp.shape[-1])
        idx = lp.topk(k, dim=-1).indices                                        # (N, k)
        logp, tail = _at(lp, idx)
        return Summary(idx, logp, tail, lp.gather(-1, targets[:, None].long())[:, 0], lp.argmax(-1))

    def compare(self, lq: torch.Tensor, targets: torch.Tensor | None = None) -> "Summary":
        """Another run's log-probs lq (N, V) read at this base's tokens (the same rounding as the base's)."""
        logp, tail = _at(lq, self.idx)
        tgt = lq.gather(-1, targets[:, None].long())[:, 0] if targets is not None else None
        return Summary(self.idx, logp, tail, tgt, lq.argmax(-1))

    def to_dict(self) -> dict:
        return {"idx": self.idx.int(), "logp": self.logp, "tail": self.tail, "target": self.target,
                "top1": self.top1.int()}

    @staticmethod
    def from_dict(d: dict) -> "Summary":
        return Summary(d["idx"].long(), d["logp"], d["tail"], d["target"], d["top1"].long())

    @staticmethod
    def cat(parts: list["Summary"]) -> "Summary":
        return Summary(*(torch.cat([getattr(p, f) for p in parts]) for f in ("idx", "logp", "tail", "target", "top1")))

    def rows(self, lo: int, hi: int) -> "Summary":
        return Summary(self.idx[lo:hi], self.logp[lo:hi], self.tail[lo:hi], self.target[lo:hi], self.top1[lo:hi])


def _at(lp: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log-probs at idx (N, k) and float32 log of the probability of every other token (N,)."""
    rest = lp.scatter(-1, idx, -math.inf)                                       # (N, V), idx masked out
    return lp.gather(-1, idx).float(), torch.logsumexp(rest, dim=-1).float()


def kl_per_token(base: Summary, cur: Summary) -> torch.Tensor:
    """KL(base || cur) per position (N,) float64, from the top-k tokens and the one bucket of the rest."""
    p, q = base.logp.double(), cur.logp.double()
    terms = torch.where(p > -math.inf, p.exp() * (p - q), 0.0)                 # (N, k)
    pt, qt = base.tail.double(), cur.tail.double()
    rest = torch.where(pt > -math.inf, pt.exp() * (pt - qt), 0.0)
    return terms.sum(-1) + rest


# --- llama-perplexity's KL divergence report -------------------------------------------------------------------
def mean_and_uncertainty(s: float, s2: float, n: int) -> tuple[float, float]:
    if n < 1:
        return 0.0, 0.0
    f = s / n
    df = s2 / n - f * f
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def covariance(sa: float, sb: float, sab: float, n: int) -> float:
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


def percentile(sorted_values: list[float], fraction: float) -> float:
    if fraction <= 0:
        return sorted_values[0]
    if fraction >= 1:
        return sorted_values[-1]
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return (1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)]


def median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    return 0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2]


def _sqrt0(x: float) -> float:
    return math.sqrt(x) if x > 0 else 0.0       # rounding can make a zero variance slightly negative


class KLStats:
    """Sums over scored tokens, as llama.cpp's kl_divergence_result, and the per-token values for percentiles."""

    HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
              "Δp RMS            Same top p")

    def __init__(self):
        self.nll, self.nll2, self.nll_base, self.nll_base2, self.nll_nll_base = 0.0, 0.0, 0.0, 0.0, 0.0
        self.kld_sum, self.kld2, self.p_diff, self.p_diff2, self.p_diff4 = 0.0, 0.0, 0.0, 0.0, 0.0
        self.n_same_top, self.count = 0, 0
        self.kld_values: list[float] = []
        self.p_diff_values: list[float] = []

    def add(self, nll: torch.Tensor, nll_base: torch.Tensor, kld: torch.Tensor, same_top: torch.Tensor) -> None:
        """One chunk: (n,) float64 nll of the current run and of the base, KL per token, (n,) bool same argmax."""
        pd = (-nll).exp() - (-nll_base).exp()
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.nll_base += float(nll_base.sum())
        self.nll_base2 += float((nll_base * nll_base).sum())
        self.nll_nll_base += float((nll * nll_base).sum())
        self.kld_sum += float(kld.sum())
        self.kld2 += float((kld * kld).sum())
        self.p_diff += float(pd.sum())
        self.p_diff2 += float((pd * pd).sum())
        self.p_diff4 += float((pd ** 4).sum())
        self.n_same_top += int(same_top.sum())
        self.count += nll.numel()
        self.kld_values += kld.tolist()
        self.p_diff_values += pd.tolist()

    # the figures, each (value, uncertainty)
    def log_ppl(self):
        return mean_and_uncertainty(self.nll, self.nll2, self.count)

    def log_ppl_base(self):
        return mean_and_uncertainty(self.nll_base, self.nll_base2, self.count)

    def log_ppl_cov(self) -> float:
        return covariance(self.nll, self.nll_base, self.nll_nll_base, self.count)

    def log_ratio(self):
        (a, da), (b, db) = self.log_ppl(), self.log_ppl_base()
        return a - b, _sqrt0(da * da + db * db - 2.0 * self.log_ppl_cov())

    def kld(self):
        return mean_and_uncertainty(self.kld_sum, self.kld2, self.count)

    def p_diff_rms(self):
        mse, dmse = mean_and_uncertainty(self.p_diff2, self.p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, (0.5 / rms * dmse if rms > 0 else 0.0)

    def same_top(self):
        p = self.n_same_top / self.count
        return p, (math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0)

    def chunk_line(self, i: int) -> str:
        """The running figures after chunk i (1-based), as llama-perplexity prints them under HEADER."""
        lp, dlp = self.log_ppl()
        ppl = math.exp(lp)
        return ("%4d" % i + "    %9.4f ± %9.4f" % (ppl, ppl * dlp) + "    %10.5f ± %10.5f" % self.log_ratio()
                + "    %10.5f ± %10.5f" % self.kld()
                + "    %6.3f ± %6.3f %%" % tuple(100 * v for v in self.p_diff_rms())
                + "    %6.3f ± %6.3f %%" % tuple(100 * v for v in self.same_top()))

    def report(self) -> str:
        """llama-perplexity's three blocks: perplexity, KL divergence and token probability statistics."""
        (lp, dlp), (lb, dlb) = self.log_ppl(), self.log_ppl_base()
        ppl, ppl_base = math.exp(lp), math.exp(lb)
        unc, unc_base = ppl * dlp, ppl_base * dlb
        cov = self.log_ppl_cov()
        cor = cov / (dlp * dlb) if dlp * dlb > 0 else math.nan
        ratio, dratio = self.log_ratio()
        k = sorted(self.kld_values)
        d = sorted(self.p_diff_values)
        mk, dmk = self.kld()
        mp, dmp = mean_and_uncertainty(self.p_diff, self.p_diff2, self.count)
        rms, drms = self.p_diff_rms()
        top, dtop = self.same_top()
        out = ["====== Perplexity statistics ======",
               "Mean PPL(Q)                   : %10.6f ± %10.6f" % (ppl, unc),
               "Mean PPL(base)                : %10.6f ± %10.6f" % (ppl_base, unc_base),
               "Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%" % (100.0 * cor),
               "Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f" % (ratio, dratio),
               "Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f" % (math.exp(ratio), math.exp(ratio) * dratio),
               "Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f" % (
                   ppl - ppl_base, _sqrt0(unc * unc + unc_base * unc_base - 2.0 * ppl * ppl_base * cov)),
               "",
               "====== KL divergence statistics ======",
               "Mean    KLD: %10.6f ± %10.6f" % (mk, dmk),
               "Maximum KLD: %10.6f" % k[-1]]
        pct = lambda f: "%-7s" % ("%4.1f%%" % (100 * f))                   # "99.9%  ", " 0.1%  "
        out += ["%s KLD: %10.6f" % (pct(f), percentile(k, f)) for f in (0.999, 0.99, 0.95, 0.90)]
        out += ["Median  KLD: %10.6f" % median(k)]
        out += ["%s KLD: %10.6f" % (pct(f), percentile(k, f)) for f in (0.10, 0.05, 0.01, 0.001)]
        out += ["Minimum KLD: %10.6f" % k[0],
                "",
                "====== Token probability statistics ======",
                "Mean    Δp: %6.3f ± %5.3f %%" % (100 * mp, 100 * dmp),
                "Maximum Δp: %6.3f%%" % (100 * d[-1])]
        out += ["%s Δp: %6.3f%%" % (pct(f), 100 * percentile(d, f)) for f in (0.999, 0.99, 0.95, 0.90, 0.75)]
        out += ["Median  Δp: %6.3f%%" % (100 * median(d))]
        out += ["%s Δp: %6.3f%%" % (pct(f), 100 * percentile(d, f)) for f in (0.25, 0.10, 0.05, 0.01, 0.001)]
        out += ["Minimum Δp: %6.3f%%" % (100 * d[0]),
                "RMS Δp    : %6.3f ± %5.3f %%" % (100 * rms, 100 * drms),
                "Same top p: %6.3f ± %5.3f %%" % (100 * top, 100 * dtop)]
        return "\n".join(out)
