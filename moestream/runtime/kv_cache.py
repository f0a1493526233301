"""A sequence's cache on the device: the KV cache, preallocated per layer, one row per sequence, written in place by
(sequence, position); for hybrid families also each Gated DeltaNet layer's conv window and recurrent state.

    kv = KVCache(n_layers=24, n_seq=4, ctx=4096, n_kv=4, hd=128, dtype=torch.bfloat16, device="cuda")
    kv.write(layer, seq_ids, positions, k, v)        # k, v: (T, nkv, hd)
    cache = make_cache(model_cfg, n_seq, ctx, dtype, device)     # runtime/caches.py: the cache class the model needs

Latent attention (models/mla.py) keeps the latent layout: per layer, k holds each token's latent (n_seq, 1, ctx, r)
and v its rotary key (n_seq, 1, ctx, dr), one "head" each (`kv_layout`), so that writes, spans, prefix reuse and
batched decode are the KV cache's own.

The engine calls begin(segments) before a forward and end(segments) after it (and check(segments) before a decode
step, whose path starts work before the forward). A KV cache needs none of them: any
position can be rewritten, and a sequence can be cut back to any prefix (its later keys are masked, then
overwritten). A recurrent state cannot: HybridCache.begin takes a segment only where its sequence's state stopped,
or at 0 (which empties the state), and reusable_prefix keeps only an exact continuation. A model with sliding-window
layers (gpt-oss) keeps a ring of their last positions (runtime/sliding_kv.py's SlidingKVCache): begin tracks how
far each sequence's ring reached, and a prefix is reused only where its window is still there.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..errors import UserError


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVCache:
    exact_prefix_only = False       # a sequence may be cut back to any prefix of what it holds

    def __init__(self, n_layers: int, n_seq: int, ctx: int, n_kv: int, hd: int, dtype, device, hd_v: int | None = None,
                 ring: list[int] | None = None):
        """hd_v: the values' head size where it is not the keys' (the latent layout). device: one for every layer,
        or a list of one per KV layer (the layers split over several devices: runtime/split.py). ring: per KV layer,
        0 (it keeps every position of the context) or R (it keeps R positions, position p at index p % R: a
        sliding layer's ring, runtime/sliding_kv.py)."""
        self.n_seq, self.ctx = n_seq, ctx
        self.ring = list(ring) if ring is not None else [0] * n_layers
        on = device if isinstance(device, list) else [device] * n_layers
        rows = [r or ctx for r in self.ring]
        self.k = [torch.zeros((n_seq, n_kv, rows[j], hd), dtype=dtype, device=on[j]) for j in range(n_layers)]
        self.v = [torch.zeros((n_seq, n_kv, rows[j], hd_v or hd), dtype=dtype, device=on[j]) for j in range(n_layers)]

    def span(self, n: int) -> int:
        """Keys a decode step attends when its furthest token is at position n - 1: n rounded up to a power of two
        (at least 256, at most the cache), masked past each token's own position. Every decode path uses the same
        span, so eager and captured steps give the same bits, and a short context does not pay for a long one."""
        return min(self.ctx, max(256, 1 << (n - 1).bit_length()))

    def spans(self) -> list[int]:
        """Every span a decode step can use."""
        out, n = [], 1
        while not out or out[-1] < self.ctx:
            out.append(self.span(n))
            n = out[-1] + 1
        return out

    @staticmethod
    def nbytes_for(n_layers: int, n_seq: int, ctx: int, n_kv: int, hd: int, dtype, hd_v: int | None = None) -> int:
        return n_layers * n_seq * n_kv * ctx * (hd + (hd_v or hd)) * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, seq_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is (T, nkv, hd), k's own shape.
        if self.ring[layer]:
            positions = positions % self.ring[layer]
        self.k[layer][seq_ids, :, positions] = k
        self.v[layer][seq_ids, :, positions] = v

    def check(self, segments) -> None:
        """Raise UserError for segments this cache cannot run (models/transformer.py's Segment): none here."""

    def begin(self, segments) -> None:
        """Just before a forward over `segments`: check them (and, for a recurrent state, reset restarted ones)."""

    def end(self, segments) -> None:
        """After that forward completed."""

    def keep_steps(self, layer: int, segment, states) -> None:
        """A verify step's recurrent layer leaves each token's state (HybridCache's); a KV cache has none."""

    def rollback(self, seq: int, length: int) -> None:
        """Sequence seq holds its first `length` positions again, after a verify step wrote more (rejected drafts):
        a KV cache masks the later keys and overwrites them; HybridCache takes the states kept after position
        length - 1."""

    @contextmanager
    def kept(self):
        """Within it, forwards that belong to no sequence (a CUDA graph's warm-up) leave every sequence's cache as it
        was. A KV cache needs nothing: their writes land in the last position, rewritten before it is read (a
        sliding layer's ring copies itself aside: runtime/sliding_kv.py)."""
        yield

    def check_ubatch(self, segments) -> None:
        """Raise UserError for a segment of more tokens than one forward may write (a sliding layer's ring: none
        here)."""

    def make_room(self, n: int, free: int | None = None) -> bool:
        """Take forwards of up to n tokens of a sequence from now on; whether the cache's tensors changed (a
        sliding layer's ring grew: what captured them must be made again; `free`: the device's free bytes, which
        the growth must fit). A KV cache takes any."""
        return False

    def reusable_prefix(self, cached: list[int], prompt: list[int], seq: int | None = None) -> int:
        """How many leading tokens of `prompt` a sequence (`seq`) holding `cached` (the tokens in its cache, from
        position 0) keeps: their common prefix, less one where the prompt is all cached (a forward needs a token to
        run)."""
        return max(0, min(common_prefix(cached, prompt), len(prompt) - 1))


class HybridCache(KVCache):
    """The KV of the attention layers (k[j], v[j] for cfg.attention_layers[j]) and, per DeltaNet layer i, conv[i]
    (n_seq, C, kernel-1) in the model's dtype (the conv's last inputs) and ssm[i] (n_seq, nv, dk, dv) float32 (the
    recurrent state), and the position each sequence's state has reached (None: unknown, a forward failed)."""
    exact_prefix_only = True        # a recurrent state cannot be cut back: reuse an exact continuation or nothing

    def __init__(self, cfg, n_seq: int, ctx: int, dtype, device, where=None):
        """where: layer -> its device, where the layers are split over several (runtime/split.py)."""
        where = where or (lambda layer: device)
        super().__init__(len(cfg.attention_layers) + cfg.nextn_layers, n_seq, ctx, cfg.n_kv_heads, cfg.head_dim,
                         dtype, [where(i) for i in cfg.attention_layers + cfg.head_layers])   # an MTP head's KV last
        conv, ssm = self.state_shapes(cfg, n_seq)
        self.conv = {i: torch.zeros(conv, dtype=dtype, device=where(i)) for i in cfg.linear_layers}
        self.ssm = {i: torch.zeros(ssm, dtype=torch.float32, device=where(i)) for i in cfg.linear_layers}
        self.length: list[int | None] = [0] * n_seq
        self.steps: dict[tuple[int, int], tuple] = {}   # (layer, seq) -> (segment, DeltaState per token) of the
                                                        # sequence's last verify step
        self._kept = False          # inside kept(): forwards of no sequence, positions neither checked nor advanced

    @staticmethod
    def state_shapes(cfg, n_seq: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One DeltaNet layer's conv window and recurrent state shapes for n_seq sequences."""
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return (n_seq, 2 * nk * dk + nv * dv, cfg.linear_conv_kernel - 1), (n_seq, nv, dk, dv)

    @staticmethod
    def state_nbytes_for(cfg, n_seq: int, dtype) -> int:
        """Bytes of every DeltaNet layer's states for n_seq sequences (they do not grow with the context)."""
        conv, ssm = HybridCache.state_shapes(cfg, n_seq)
        size = torch.empty((), dtype=dtype).element_size()
        return len(cfg.linear_layers) * (size * conv[0] * conv[1] * conv[2] + 4 * ssm[0] * ssm[1] * ssm[2] * ssm[3])

    def check(self, segments) -> None:
        """Refuse a segment that does not continue its sequence's state (or start it again at 0), or a sequence
        twice in one forward."""
        seen = set()
        for s in segments:
            if s.seq in seen:
                raise UserError(f"sequence {s.seq} appears twice in one forward; a hybrid model's recurrent state "
                                "takes one segment of a sequence at a time")
            seen.add(s.seq)
            at = self.length[s.seq]
            if s.start != 0 and s.start != at and not self._kept:
                where = "is unknown (a forward failed)" if at is None else f"is at position {at}"
                raise UserError(f"sequence {s.seq}'s recurrent state {where}: a segment must continue it there or "
                                f"start again at 0, not at position {s.start} (a Gated DeltaNet state cannot be "
                                "cut back or skip ahead)")

    def begin(self, segments) -> None:
        """check(), then empty the states of sequences starting again. Until end(), the states of these sequences
        are marked unknown: a forward that fails half way leaves them to be started again."""
        self.check(segments)
        if self._kept:
            return
        for s in segments:
            if s.start == 0:
                for i in self.conv:
                    self.conv[i][s.seq].zero_()
                    self.ssm[i][s.seq].zero_()
            self.length[s.seq] = None

    def end(self, segments) -> None:
        if self._kept:
            return
        for s in segments:
            self.length[s.seq] = s.start + s.n

    def keep_steps(self, layer: int, segment, states) -> None:
        self.steps[layer, segment.seq] = (segment, states)

    def rollback(self, seq: int, length: int) -> None:
        """Each DeltaNet layer's state as it was after position length - 1, taken from the per-token states the
        last verify step of `seq` kept (none run again); the position then is `length`."""
        for i in self.conv:
            s, st = self.steps.pop((i, seq), (None, None))
            if s is None or not s.start < length <= s.start + s.n or self.length[seq] != s.start + s.n:
                raise ValueError(f"no kept state of sequence {seq} at position {length - 1}")
            self.conv[i][seq] = st.conv[0, length - s.start - 1]
            self.ssm[i][seq] = st.ssm[0, length - s.start - 1]
        self.length[seq] = length

    @contextmanager
    def kept(self):
        """Forwards within it belong to no sequence (CUDA graph warm-ups, the server's captures before serving): they
        may run at any position, and each sequence's states and position are put back afterwards (the states are
        copied aside: a few MiB a sequence and layer). Re-entrant: the outermost one saves and restores."""
        if self._kept:
            yield
            return
        saved = ({i: t.clone() for i, t in self.conv.items()}, {i: t.clone() for i, t in self.ssm.items()})
        length = list(self.length)
        self._kept = True
        try:
            yield
        finally:
            self._kept = False
            for now, before in zip((self.conv, self.ssm), saved):
                for i, t in now.items():
                    t.copy_(before[i])
            self.length = length

    def reusable_prefix(self, cached: list[int], prompt: list[int], seq: int | None = None) -> int:
        """len(cached) where the prompt extends it by at least one token (an exact continuation), else 0."""
        n = super().reusable_prefix(cached, prompt)
        return n if n == len(cached) else 0


class Qwen4Cache(HybridCache):
    """HybridCache plus what QSA and the PLE keep (Qwen3.8-Flash-Next): per attention layer j (an MTP head's last, as
    in the KV) each token's raw index key, index_keys[j] (n_seq, ctx, d) in the model's dtype, by position like K
    and V, and each complete block's key, block_keys[j] (n_seq, ctx // B, d), written when the block's last token
    lands (models/qsa.py: a block's key depends on its own tokens only, so a sequence's keys below its position are
    valid); per sequence its n-gram context, ngram (n_seq, ngram_size-1) int64 on the device (its last tokens, EOS
    at its start: a decode step hashes its next ones there, models/ple.py; the host path reads it back), and per PLE
    layer its conv rows, ple_conv[i] (n_seq, (K-1)*ngram_size,
    hc*H) (zeros at its start). The contexts and conv rows are states: reset with the DeltaNet's, kept by kept(),
    and undone after a verify step's rejected drafts as the DeltaNet's are: the step leaves each segment's context
    and tokens (keep_ngram) and each PLE layer's rows before and of its tokens (keep_ple), and rollback takes those
    after the accepted position (the index and block keys need nothing: keys past a sequence's position are not
    read, and a block's key is written again when its last token lands again)."""

    def __init__(self, cfg, n_seq: int, ctx: int, dtype, device):
        super().__init__(cfg, n_seq, ctx, dtype, device)
        self.index_keys = [torch.zeros(n_seq, ctx, cfg.indexer_head_dim, dtype=dtype, device=device)
                           for _ in cfg.attention_layers + cfg.head_layers] if cfg.indexer_heads else []
        self.block_keys = [torch.zeros(n_seq, ctx // cfg.indexer_block, cfg.indexer_head_dim, dtype=dtype,
                                       device=device) for _ in self.index_keys]
        self.eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        self.ngram = torch.full((n_seq, cfg.ngram_size - 1), self.eos, dtype=torch.long, device=device)
        self.ple_conv = {i: torch.zeros(self.ple_shape(cfg, n_seq), dtype=dtype, device=device)
                         for i in cfg.ple_layers}
        self.ngram_steps: dict[int, tuple] = {}          # seq -> (segment, its context then its tokens)
        self.ple_steps: dict[tuple[int, int], tuple] = {}    # (layer, seq) -> (segment, rows before and of it)

    @staticmethod
    def ple_shape(cfg, n_seq: int) -> tuple[int, int, int]:
        return n_seq, (cfg.ple_conv_kernel - 1) * cfg.ngram_size, cfg.hc_count * cfg.hidden_size

    @staticmethod
    def extra_nbytes(cfg, n_seq: int, ctx: int, dtype) -> tuple[int, int]:
        """(the index keys' and block keys' bytes, which grow with the context; the PLE conv rows', which do not)."""
        size = torch.empty((), dtype=dtype).element_size()
        rows = ctx + ctx // cfg.indexer_block if cfg.indexer_heads else 0
        keys = (len(cfg.attention_layers) + cfg.nextn_layers) * n_seq * rows * cfg.indexer_head_dim * size
        a, b, c = Qwen4Cache.ple_shape(cfg, n_seq)
        return keys, len(cfg.ple_layers) * a * b * c * size

    def begin(self, segments) -> None:
        super().begin(segments)
        if self._kept:
            return
        for s in segments:
            if s.start == 0:
                self.ngram[s.seq] = self.eos
                for t in self.ple_conv.values():
                    t[s.seq].zero_()

    def keep_ngram(self, segment, history: torch.Tensor) -> None:
        """A verify step's segment: its sequence's context before it and its tokens (ngram_size-1 + n,)."""
        self.ngram_steps[segment.seq] = (segment, history)

    def keep_ple(self, layer: int, segment, rows: torch.Tensor) -> None:
        """A verify step's segment: PLE layer `layer`'s conv rows before it and its own ((K-1)*ngram_size + n, C)."""
        self.ple_steps[layer, segment.seq] = (segment, rows)

    def rollback(self, seq: int, length: int) -> None:
        """HybridCache.rollback, then the n-gram context and each PLE layer's conv rows as they were after position
        length - 1: windows of what the last verify step of `seq` kept."""
        super().rollback(seq, length)
        kept = [(self.ngram, self.ngram_steps.pop(seq, (None, None)))]
        kept += [(self.ple_conv[i], self.ple_steps.pop((i, seq), (None, None))) for i in self.ple_conv]
        for state, (s, history) in kept:
            if s is None or not s.start < length <= s.start + s.n:
                raise ValueError(f"no kept n-gram context or PLE rows of sequence {seq} at position {length - 1}")
            k = length - s.start
            state[seq] = history[k:k + state.shape[1]]

    @contextmanager
    def kept(self):
        if self._kept:
            yield
            return
        ngram, conv = self.ngram.clone(), {i: t.clone() for i, t in self.ple_conv.items()}
        with super().kept():
            try:
                yield
            finally:
                self.ngram.copy_(ngram)
                for i, t in self.ple_conv.items():
                    t.copy_(conv[i])


def kv_layout(cfg) -> tuple[int, int, int]:
    """(heads, key head size, value head size) a token keeps per attention layer: GQA's KV heads, or latent
    attention's one latent of kv_lora_rank and one rotary key of qk_rope_head_dim (576 values at DeepSeek-V3's)."""
    if cfg.kv_lora_rank:
        return 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return cfg.n_kv_heads, cfg.head_dim, cfg.head_dim


def cache_nbytes(cfg, n_seq: int, ctx: int, dtype, ring: int = 0) -> tuple[int, int]:
    """(bytes that grow with the context: the attention layers' K and V, and QSA's index keys; bytes that do not:
    DeltaNet states, PLE conv rows, and with `ring` (make_cache's) the sliding layers' rings)."""
    n_kv, hd, hd_v = kv_layout(cfg)
    rings = len(cfg.sliding_layers) if ring else 0
    kv = KVCache.nbytes_for(len(cfg.attention_layers) + cfg.nextn_layers - rings, n_seq, ctx, n_kv, hd, dtype, hd_v)
    fixed = KVCache.nbytes_for(rings, n_seq, ring, n_kv, hd, dtype, hd_v)
    keys, ple = Qwen4Cache.extra_nbytes(cfg, n_seq, ctx, dtype)
    return kv + keys, (HybridCache.state_nbytes_for(cfg, n_seq, dtype) if cfg.linear_layers else 0) + ple + fixed


def describe_kv(cfg, n_seq: int, ctx: int, dtype, ring: int = 0) -> str:
    """One line for a user: what the KV cache keeps a token and layer, its bytes a token, and a 128k-token
    sequence's (latent attention keeps one latent and one rotary key, where grouped-query attention of as many heads
    would keep each head's keys and values; with `ring`, sliding layers keep only their ring: runtime/sliding_kv.py).

    describe_kv(deepseek_v3_61_layers, 1, 4096, torch.bfloat16) ->
        "kv cache: 576 values a token and layer (latent; 40960 as 128 heads' keys and values, 71x more), 68.6 KiB a
         token in bfloat16 (2 bytes a value), 8.58 GiB for 128k tokens; 274 MiB for 1 x 4096 here"
    describe_kv(gpt_oss_120b, 1, 131072, torch.bfloat16, ring=640) ->
        "kv cache: 1024 values a token and layer, 36.0 KiB a token in bfloat16 (2 bytes a value) in 18 full layers,
         the 18 sliding layers a ring of 640 positions (22.5 MiB a sequence), 4.52 GiB for 128k tokens (9.00 GiB
         keeping every position: 72.0 KiB a token); 4630 MiB for 1 x 131072 here"
    """
    import torch
    n_kv, hd, hd_v = kv_layout(cfg)
    values = n_kv * (hd + hd_v)
    per_token, fixed = cache_nbytes(cfg, 1, 1, dtype, ring)
    rings = fixed - cache_nbytes(cfg, 1, 1, dtype)[1]
    here = sum(cache_nbytes(cfg, n_seq, ctx, dtype, ring)) - cache_nbytes(cfg, n_seq, ctx, dtype)[1]
    size = torch.empty((), dtype=dtype).element_size()
    what = f"{values} values a token and layer"
    if cfg.kv_lora_rank:
        gqa = cfg.n_heads * (cfg.head_dim + cfg.v_head_dim)
        what += f" (latent; {gqa} as {cfg.n_heads} heads' keys and values, {gqa / values:.0f}x more)"
    where, linear = "", ""
    if ring:
        n_sliding = len(cfg.sliding_layers)
        every, _ = cache_nbytes(cfg, 1, 1, dtype)
        where = (f" in {len(cfg.attention_layers) + cfg.nextn_layers - n_sliding} full layers, the {n_sliding} "
                 f"sliding layers a ring of {ring} positions ({rings / 2**20:.1f} MiB a sequence)")
        linear = f" ({every * 131072 / 2**30:.2f} GiB keeping every position: {every / 1024:.1f} KiB a token)"
    return (f"kv cache: {what}, {per_token / 1024:.1f} KiB a token in {str(dtype).removeprefix('torch.')} "
            f"({size} bytes a value){where}, {(per_token * 131072 + rings) / 2**30:.2f} GiB for 128k tokens{linear}; "
            f"{here / 2**20:.0f} MiB for {n_seq} x {ctx} here")
