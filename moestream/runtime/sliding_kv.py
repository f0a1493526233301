"""The KV cache of a model with sliding-window layers (gpt-oss): each sliding layer keeps a ring of R positions a
sequence, position p at index p % R, instead of the whole context; full layers keep every position.

    R = ring_positions(cfg, ubatch=512, drafts=0, ctx=131072)     # window + the most tokens one forward writes
    kv = SlidingKVCache(cfg, n_seq=4, ctx=131072, ring=R, dtype=torch.bfloat16, device="cuda")
    kv.write(layer, seq_ids, positions, k, v)       # a sliding layer's keys land at positions % R

Why R = W + n (W the window, n the most tokens one forward of a sequence writes: a ubatch, or a verify step's
drafts and one more): a forward writes its n keys before its queries read any, and its first query reads positions
from p0 - W + 1; with R >= W + n - 1 its last key (p0 + n - 1) lands in no slot of them. A rejected draft only wrote
positions past the accepted one, which overwrote positions older than any later query's window. Every reader sees
logical positions: decode attends keys 0..span-1 read at index key % R (the same keys at the same places of the
softmax sum as the linear cache, so the same bits), a prompt's chunk its window's keys by position.

What the ring still holds: each sequence's `top`, one past the highest position written since it last started at
0 (the engine tells begin(segments) before each forward). The keys of positions >= top - R are intact; a forward at
position m needs those of [m - W + 1, m). So a segment starting there is refused (UserError) where they were
overwritten, and prefix reuse (reusable_prefix: the server's prompt cache) keeps a common prefix m only where
top - m <= R - W + 1; otherwise it starts again from 0. Backing off to a shorter prefix never helps: an earlier
position's window is older still (and recomputing a sliding layer's keys needs the sliding layers below it, back to
the start). Rollback (rejected drafts) changes nothing: top stays where the drafts reached.

Forwards inside kept() (CUDA graph warm-ups) write at positions of no request; the ring slots they land in may
hold a live sequence's window, so kept() copies the sliding layers aside and puts them back.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..errors import UserError
from .kv_cache import KVCache, kv_layout


def engine_ring(cfg, ecfg) -> int:
    """ring_positions of a model of `cfg` loaded as the resolved `ecfg`: its -ub, its drafts (--spec-draft-n-max
    with --spec-type draft-mtp), its -c."""
    spec, b = ecfg.spec, ecfg.batching
    return ring_positions(cfg, b.ubatch, spec.most if spec.drafts else 0, b.ctx_size)


def ring_positions(cfg, ubatch: int, drafts: int, ctx: int) -> int:
    """Positions a sliding layer keeps a sequence: cfg.sliding_window + the most tokens one forward writes (a
    ubatch; a verify step of `drafts` drafts writes drafts + 1); 0 (keep the whole context) where the model has no
    sliding layer or that is no fewer than ctx."""
    if not cfg.sliding_layers:
        return 0
    ring = cfg.sliding_window + max(ubatch, drafts + 1)
    return ring if ring < ctx else 0


class SlidingKVCache(KVCache):
    """KVCache whose sliding layers (cfg.sliding_layers among cfg.attention_layers) keep a ring of `ring` positions."""

    def __init__(self, cfg, n_seq: int, ctx: int, ring: int, dtype, device):
        sliding = set(cfg.sliding_layers)
        layers = cfg.attention_layers + cfg.head_layers              # the KV layers; an MTP head's attends all
        n_kv, hd, hd_v = kv_layout(cfg)
        super().__init__(len(layers), n_seq, ctx, n_kv, hd, dtype, device, hd_v,
                         ring=[ring if i in sliding and j < len(cfg.attention_layers) else 0
                               for j, i in enumerate(layers)])
        self.window, self.size = cfg.sliding_window, ring
        self.top = [0] * n_seq          # per sequence: one past the highest position written since it started at 0
        self._kept = False

    @property
    def max_tokens(self) -> int:
        """The most tokens one forward may write into a sequence: R - W (the ring was sized for them), any where
        the ring is the whole context (grown to it: positions never wrap)."""
        return self.size - self.window if self.size < self.ctx else self.ctx

    def holds(self, seq: int, m: int) -> bool:
        """Whether the ring still holds the keys a forward at position m reads before it: [m - W + 1, m)."""
        return max(0, m - self.window + 1) >= self.top[seq] - self.size

    def check_ubatch(self, segments) -> None:
        for s in segments:
            if s.n > self.max_tokens:
                raise UserError(f"a forward of {s.n} tokens of one sequence is more than the sliding layers' ring "
                                f"takes ({self.size} positions = window {self.window} + {self.max_tokens}, sized at "
                                "load from -ub; engine.set_batching grows it)")

    def check(self, segments) -> None:
        """Refuse a segment whose window before it the ring no longer holds (it starts again at 0, or at a prefix
        reusable_prefix gave)."""
        if self._kept:
            return
        for s in segments:
            if s.start and not self.holds(s.seq, s.start):
                raise UserError(f"sequence {s.seq} no longer holds the sliding window before position {s.start} "
                                f"(its ring of {self.size} positions reached position {self.top[s.seq] - 1}); run "
                                "it again from position 0")

    def begin(self, segments) -> None:
        self.check(segments)
        if self._kept:
            return
        for s in segments:
            self.top[s.seq] = max(0 if s.start == 0 else self.top[s.seq], s.start + s.n)

    def reusable_prefix(self, cached: list[int], prompt: list[int], seq: int | None = None) -> int:
        """The common prefix (KVCache's) where the ring still holds the window before it, else 0; seq None: the
        sequence is taken to have written `cached` and no further."""
        n = super().reusable_prefix(cached, prompt)
        top = len(cached) if seq is None else self.top[seq]
        return n if max(0, n - self.window + 1) >= top - self.size else 0

    def make_room(self, n: int, free: int | None = None) -> bool:
        """A ring of W + n positions (at most the context) where it is smaller: each sequence's held positions
        moved into it. The tensors are new: whatever captured the old ones (decode graphs) must be made again.
        free: the device's free bytes; a growth that needs more (the new rings beside the old ones while the
        positions move) is refused in one line, the cache as it was."""
        ring = min(self.window + n, self.ctx)
        if ring <= self.size:
            return False
        need = sum(t[j][:, :, :1].nelement() * t[j].element_size() * ring
                   for j, r in enumerate(self.ring) if r for t in (self.k, self.v))
        if free is not None and need > free:
            raise UserError(f"a forward of {n} tokens needs the sliding layers' rings grown to {ring} positions "
                            f"({need / 2**20:.0f} MiB more on the device, {free / 2**20:.0f} MiB free); use a smaller "
                            "-ub, or load the model with this one")
        for j, r in enumerate(self.ring):
            if not r:
                continue
            for t in (self.k, self.v):
                old = t[j]
                new = old.new_zeros(old.shape[:2] + (ring,) + old.shape[3:])
                for s, top in enumerate(self.top):
                    pos = torch.arange(max(0, top - r), top, device=old.device)
                    new[s, :, pos % ring] = old[s, :, pos % r]
                t[j] = new
            self.ring[j] = ring
        self.size = ring
        return True

    @contextmanager
    def kept(self):
        """Forwards of no sequence: the sliding layers' rings and each sequence's top are put back after."""
        if self._kept:
            yield
            return
        saved = {j: (self.k[j].clone(), self.v[j].clone()) for j, r in enumerate(self.ring) if r}
        top = list(self.top)
        self._kept = True
        try:
            yield
        finally:
            self._kept = False
            for j, (k, v) in saved.items():
                self.k[j].copy_(k)
                self.v[j].copy_(v)
            self.top = top
