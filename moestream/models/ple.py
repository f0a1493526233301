"""Per-layer n-gram embeddings (PLE), Qwen3.8-Flash-Next's (transformers' Qwen4ExpTextNGramEmbedding and
Qwen4ExpTextPLELayer): each token's 2- .. ngram_size-grams are hashed into rows of one huge table (tens of billions
of parameters), which a layer adds into every residual stream.

    consts = NGramHash.of(cfg)                    # the hash: multipliers, per-head prime row counts, offsets
    ids = consts.rows(context, tokens)            # (T, heads) table rows of tokens, after the sequence's context
    table = PLETable(weights)                     # the table, kept in host memory; gathers rows into staging
    emb = table.gather(ids, device)               # (T, ple_embed_dim): a few KB a token cross the link
    add, conv_state = ple_add(h, emb, lw, cfg, conv_state)      # h (T, hc*H) + add: the layer's streams

The hash of token t's n-gram: tokens t, t-1, .. t-n+1 times their multipliers, xor-ed (int64, no overflow: each
multiplier is below 2**63 / vocab), modulo each head's prime, plus the head's offset. A token before a sequence's
start, or before the last EOS that precedes t, reads as EOS (the n-grams do not cross documents). So token t's rows
depend on t-2, t-1 and t only (trigrams): a sequence keeps its last ngram_size-1 tokens (`context`) for its next
ubatch or decode step, EOS-filled at its start.

The layer: k = the key projection's streams normed, q = the residual streams normed, v = the value projection;
gate_s = signed sqrt(|<k_s, q_s>| / sqrt(H)); out_s = sigmoid(gate_s) v; the streams get out + silu(conv(norm(out)))
where conv is a depthwise conv of kernel K, dilation ngram_size over the sequence: a sequence keeps its last
(K-1)*ngram_size normed rows (`conv_state`, zeros at its start).

In the decoder (models/transformer.py) the PLE block holds the table and the hash; a sequence's n-gram context
and conv rows are its cache's (runtime/kv_cache.py's Qwen4Cache: ngram, ple_conv):

    ple = PLE(cfg, table)                         # table: (rows, d) in host memory, never on the device
    emb = ple.embeddings(batch, kv)               # (T, ple_embed_dim) on the batch's device; contexts advanced
    h = h + ple.add(h, emb, lw, batch, kv, layer)    # each segment's conv rows (kv.ple_conv) read and written back

A decode step over a table readable in place (a pinned tensor: runtime/load.py pins an HF checkpoint's on a GPU)
reads nothing back (PLE.on_device): its contexts are read by the step's device tensor of sequences and hashed
there (NGramHash.rows_decode: the same integer ops, so the same rows), its rows read from host memory where they
lie by kernels/ple_gather.py, its sequences' conv rows gathered and written back by that tensor (ple_add_decode);
so the step can be captured in a CUDA graph. A GGUF's quantized table copied into pinned memory (BlockTable:
runtime/load.py copies its blocks as the file holds them) is read in place too, its rows dequantized on the device;
a table left mapped (a float GGUF's, a type the gather has no decoder for, or one the host has no room for) keeps
the host path, and so do prompts, verify steps and the CPU (its oracle).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..arch.ngram import ngram_constants
from ..config import ModelConfig
from .residual import group_rms_norm


class NGramHash:
    """The hash constants of PLE layer `index` (the first: 0), as transformers derives them from the config."""

    def __init__(self, multipliers: list[int], sizes: list[int], eos: int, ngram_size: int, per_ngram: int,
                 divisor: int):
        self.multipliers, self.sizes, self.eos = multipliers, sizes, eos
        self.ngram_size, self.per_ngram = ngram_size, per_ngram
        self.offsets = [sum(sizes[:h]) for h in range(len(sizes))]
        self.rows_total = -(-sum(sizes) // divisor) * divisor         # the table's rows, padded

    @staticmethod
    def of(cfg: ModelConfig, index: int = 0) -> "NGramHash":
        mult, sizes = ngram_constants(cfg, index)
        return NGramHash(mult, sizes, cfg.eos_token_ids[0], cfg.ngram_size, cfg.heads_per_ngram,
                         cfg.ngram_vocab_divisor)

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1

    def start_context(self) -> list[int]:
        """A sequence's context at its start: EOS, as transformers fills it."""
        return [self.eos] * self.context_len

    def rows(self, context: list[int] | torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(T, heads) int64 table rows of `tokens` (T,), which follow `context` (the sequence's last
        ngram_size-1 tokens before them) -> on tokens' device."""
        ctx = torch.as_tensor(context, dtype=torch.long, device=tokens.device)
        hist = torch.cat([ctx, tokens.long()])                       # (L,)
        L = hist.shape[0]
        pos = torch.arange(L, device=hist.device)
        eos_at = torch.where(hist == self.eos, pos, -1)
        prev_eos = torch.cat([eos_at.new_full((1,), -1), torch.cummax(eos_at, 0).values[:-1]])
        in_segment = pos - (prev_eos + 1)
        shifted = [hist]
        for s in range(1, self.ngram_size):
            src = pos - s
            valid = (in_segment >= s) & (src >= 0)
            shifted.append(torch.where(valid, hist[src.clamp_min(0)], hist.new_full((), self.eos)))
        return self._mix(shifted)[-tokens.shape[0]:]

    def rows_decode(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """rows() of a decode step, batched and on the device with no host read: (B, heads) int64 table rows of
        tokens (B,), each after its sequence's context (B, ngram_size-1) int64 (on tokens' device). The same
        rule as rows(): the token s before t reads as EOS where any of tokens t-s .. t-1 is EOS."""
        hist = torch.cat([context, tokens.long()[:, None]], dim=1)                  # (B, ngram_size)
        c = self.context_len
        shifted = [hist[:, c]]
        for s in range(1, self.ngram_size):
            broken = (hist[:, c - s:c] == self.eos).any(dim=1)
            shifted.append(hist[:, c - s].masked_fill(broken, self.eos))
        return self._mix(shifted)

    def _mix(self, shifted: list[torch.Tensor]) -> torch.Tensor:
        """The hash of rows() and rows_decode(): shifted[s] (N,) int64 the token s before each token (EOS where it
        crosses one) -> (N, heads) int64 table rows, each n-gram's product-XOR of its tokens modulo each of its
        heads' sizes, plus the head's offset."""
        sizes, offsets = self._consts(shifted[0].device)
        blocks, mult = [], self.multipliers
        for n in range(2, self.ngram_size + 1):
            h0 = (n - 2) * self.per_ngram
            mixed = shifted[0] * mult[0]
            for j in range(1, n):
                mixed = torch.bitwise_xor(mixed, shifted[j] * mult[j])
            ids = torch.remainder(mixed[:, None], sizes[h0:h0 + self.per_ngram])
            blocks.append(ids + offsets[h0:h0 + self.per_ngram])
        return torch.cat(blocks, dim=-1)

    def _consts(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' row counts and offsets on `device`, made once (a step captured in a graph copies nothing)."""
        kept = self.__dict__.setdefault("_on", {})
        if device not in kept:
            kept[device] = (torch.tensor(self.sizes, dtype=torch.long, device=device),
                            torch.tensor(self.offsets, dtype=torch.long, device=device))
        return kept[device]

    @staticmethod
    def next_context(context: list[int], tokens: list[int], n: int) -> list[int]:
        """The last n tokens of context + tokens: a sequence's context after them."""
        return (list(context) + list(tokens))[-n:]


def readable_in_place(table) -> bool:
    """Whether a device kernel can read the table's rows where they lie (kernels/ple_gather.py): a contiguous
    tensor in pinned host memory, rows of whole 4-byte words, or a quantized table's blocks pinned (BlockTable, of
    a type the gather dequantizes), Triton there. A file's mapped rows (loading/gguf.py's MappedRows: quantized
    blocks, dequantized on the host, in pageable memory) cannot be."""
    from ..kernels.decode import triton
    if triton is None or not torch.cuda.is_available():
        return False
    if isinstance(table, BlockTable):
        from ..kernels.ple_gather import gathers_blocks
        return table.blocks.is_pinned() and gathers_blocks(table.qtype, table.shape[1])
    return (isinstance(table, torch.Tensor) and table.is_contiguous()
            and table.shape[1] * table.element_size() % 4 == 0 and table.is_pinned())


class BlockTable:
    """A quantized table's blocks as the file holds them, (rows, row_bytes) uint8 in host memory (runtime/load.py
    copies a GGUF's once into pinned memory: Q4_0's 18 bytes a 32 values, about a quarter of a bfloat16 table's),
    read by row: take(rows) dequantizes those rows' blocks on the host (float32, as loading/gguf.py's MappedRows),
    a decode step's kernel (kernels/ple_gather.py's gather_block_rows) on the device."""

    dtype = torch.float32

    def __init__(self, blocks: torch.Tensor, qtype, d: int):
        self.blocks, self.qtype = blocks, qtype
        self.shape = (blocks.shape[0], d)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) int64 row ids (on the host) -> (n, d) float32 rows, on the host."""
        from ..quant.dequant import dequantize
        return dequantize(self.blocks.index_select(0, rows), self.qtype).reshape(len(rows), self.shape[1])


class PLETable:
    """The n-gram table (rows_total, d), kept in host memory, read by row only: a ubatch's or decode step's rows are
    gathered on the host and copied to the device, `row_bytes` a row (heads of them a token). The table is a host
    tensor (gathered into a pinned staging buffer), or rows read by take(rows) (an object with shape and dtype: a
    file's mapped rows, loading/gguf.py's MappedRows, or its quantized blocks in host memory, BlockTable; both
    dequantized by row). Counts in neither the device budget nor the expert cache; `bytes_read` counts what crossed
    the link (not a captured step's: a graph replays without Python). in_place: a pinned tensor or BlockTable
    (readable_in_place), whose rows a decode step's kernel reads where they lie from rows picked on the device
    (gather_on_device: no host sync, so the step can be captured; a BlockTable's blocks cross the link, counted so,
    and are dequantized there)."""

    def __init__(self, table):
        self.table = table                          # (rows, d) on the host
        self.mapped = not isinstance(table, torch.Tensor)
        self.in_place = readable_in_place(table)
        self.bytes_read = 0
        self._staging: torch.Tensor | None = None

    def gather_on_device(self, rows: torch.Tensor) -> torch.Tensor:
        """(T, heads) rows on a device -> (T, heads * d) embeddings there, in the table's dtype, read where they lie
        (kernels/ple_gather.py; a BlockTable's blocks dequantized there) with no host sync; on the CPU the table's
        index_select or take (the kernels' oracles)."""
        idx = rows.reshape(-1)
        blocks = isinstance(self.table, BlockTable)
        if idx.device.type == "cpu":
            out = self.table.take(idx) if blocks else self.table.index_select(0, idx)
        else:
            from ..kernels.ple_gather import gather_block_rows, gather_rows
            out = torch.empty(idx.shape[0], self.table.shape[1], dtype=self.table.dtype, device=idx.device)
            if blocks:
                gather_block_rows(self.table.blocks.data_ptr(), self.table.blocks.shape[1], self.table.qtype, idx,
                                  out)
            else:
                gather_rows(self.table.data_ptr(), self.row_bytes // 4, idx, out)
        self.bytes_read += idx.shape[0] * (self.table.blocks.shape[1] if blocks else self.row_bytes)
        return out.view(rows.shape[0], -1)

    @property
    def row_bytes(self) -> int:
        """Bytes of one gathered row, as it crosses the link."""
        return self.table.shape[1] * torch.empty((), dtype=self.table.dtype).element_size()

    def gather(self, rows: torch.Tensor, device) -> torch.Tensor:
        """(T, heads) rows -> (T, heads * d) embeddings on `device`, in the table's dtype: the rows gathered on the
        host (into pinned staging where the device is a GPU and the table a tensor) and copied."""
        idx = rows.reshape(-1).cpu()
        n = idx.numel()
        dev = torch.device(device)
        if self.mapped:
            out = self.table.take(idx).to(dev)
        elif dev.type == "cpu":
            out = self.table.index_select(0, idx)
        else:
            if self._staging is None or self._staging.shape[0] < n:
                self._staging = torch.empty(max(n, 1024), self.table.shape[1], dtype=self.table.dtype,
                                            pin_memory=True)
            torch.index_select(self.table, 0, idx, out=self._staging[:n])
            out = self._staging[:n].to(dev, non_blocking=True)
            torch.cuda.current_stream(dev).synchronize()     # the staging is reused by the next gather
        self.bytes_read += n * self.row_bytes
        return out.view(rows.shape[0], -1)


def ple_add(h: torch.Tensor, emb: torch.Tensor, lw: dict, cfg: ModelConfig,
            conv_state: torch.Tensor | None, keep: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the PLE layer adds to the streams h (T, hc*H) of one sequence's consecutive tokens, from their
    embeddings emb (T, ple_embed_dim), and the conv state after them; conv_state ((K-1)*ngram_size, hc*H): the
    normed rows of the sequence's last tokens (None: its start, zeros). keep: a list that gets the rows before and
    of the tokens ((K-1)*ngram_size + T, hc*H), whose rows [t + 1, t + 1 + (K-1)*ngram_size) are the state after
    token t (a speculative verify step's, for Qwen4Cache.rollback)."""
    gated, normed = _gated(h, emb, lw, cfg)
    w = lw["ple_conv1d.weight"]                                                        # (hc*H, K)
    K, d = w.shape[1], cfg.ngram_size
    span = (K - 1) * d
    if conv_state is None:
        conv_state = normed.new_zeros(span, normed.shape[1])
    x = torch.cat([conv_state, normed])                                                # (span + T, C)
    y = F.conv1d(x.t()[None], w[:, None, :], groups=w.shape[0], dilation=d)[0].t()      # (T, C)
    if keep is not None:
        keep.append(x)
    return gated + F.silu(y), x[-span:].clone()


def ple_add_decode(h: torch.Tensor, emb: torch.Tensor, lw: dict, cfg: ModelConfig,
                   conv_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ple_add of a decode step's B sequences at once (one token each, h (B, hc*H), emb (B, ple_embed_dim)), their
    conv rows conv_states (B, (K-1)*ngram_size, hc*H): what they add, and their conv rows after. One sequence's
    bits are ple_add's (the same ops at B = 1)."""
    gated, normed = _gated(h, emb, lw, cfg)
    w = lw["ple_conv1d.weight"]
    x = torch.cat([conv_states, normed[:, None]], dim=1)                               # (B, span + 1, C)
    y = F.conv1d(x.transpose(1, 2), w[:, None, :], groups=w.shape[0], dilation=cfg.ngram_size)[..., 0]   # (B, C)
    return gated + F.silu(y), x[:, 1:]


def _gated(h: torch.Tensor, emb: torch.Tensor, lw: dict, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The PLE layer's gated value (T, hc*H) and its conv input, the same normed."""
    T, hc, H = h.shape[0], cfg.hc_count, cfg.hidden_size
    emb = emb.to(h.dtype)
    key = group_rms_norm(F.linear(emb, lw["ple_key.weight"]), lw["ple_norm_key.weight"], hc, cfg.rms_norm_eps)
    value = F.linear(emb, lw["ple_value.weight"])                                     # (T, H)
    query = group_rms_norm(h, lw["ple_norm_query.weight"], hc, cfg.rms_norm_eps)
    gate = (key.view(T, hc, H) * query.view(T, hc, H)).sum(dim=-1, keepdim=True) / math.sqrt(H)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value[:, None, :]).flatten(1)                       # (T, hc*H)
    return gated, group_rms_norm(gated, lw["ple_norm_conv.weight"], hc, cfg.rms_norm_eps)


class PLE:
    """The decoder's PLE block: the n-gram table in host memory (PLETable: its rows gathered on the host, counted
    in bytes_read) and the hash of ModelConfig's one PLE layer. Where the table is readable in place
    (PLETable.in_place), a decode step hashes and gathers on the device with no host read (`on_device`): it can be
    captured in a CUDA graph; prompts, verify steps and other tables take the host path (on the CPU its oracle)."""

    def __init__(self, cfg: ModelConfig, table: torch.Tensor):
        self.cfg = cfg
        self.table = PLETable(table)
        self.hash = NGramHash.of(cfg)

    def on_device(self, batch) -> bool:
        """Whether batch's n-gram rows are hashed and gathered on the device: a decode step (not a verify step's
        drafts) over a table read in place."""
        return self.table.in_place and batch.is_decode and not batch.keep_states

    def embeddings(self, batch, kv) -> torch.Tensor:
        """(T, ple_embed_dim) of batch's tokens on their device: each segment's rows hashed after its sequence's
        context (kv.ngram[seq], (ngram_size-1,) int64 on the cache's device), then gathered from the host table;
        each context advanced past its segment. On the host path the tokens are read back to the host (a decode
        step's sampled ones too): the rows are picked there. A verify step (batch.keep_states) leaves each segment's
        context and tokens with the cache (Qwen4Cache.keep_ngram), whose rollback takes the context after the
        accepted one. On the device path (on_device) the step's contexts are read by batch.seq_ids, hashed with
        its tokens (NGramHash.rows_decode), written back, and the rows read in place."""
        if self.on_device(batch):
            seq = batch.seq_ids
            ctx = kv.ngram.index_select(0, seq)                                    # (B, ngram_size-1)
            rows = self.hash.rows_decode(ctx, batch.tokens)
            kv.ngram.index_copy_(0, seq, torch.cat([ctx[:, 1:], batch.tokens.long()[:, None]], dim=1))
            return self.table.gather_on_device(rows)
        tokens = batch.tokens.cpu()
        rows, r = [], 0
        for s in batch.segments:
            toks = tokens[r:r + s.n]
            ctx = kv.ngram[s.seq].cpu()
            rows.append(self.hash.rows(ctx, toks))                             # (n, heads)
            if batch.keep_states and s.n > 1:
                kv.keep_ngram(s, torch.cat([ctx, toks]))
            kv.ngram[s.seq] = torch.cat([ctx, toks])[-self.hash.context_len:]
            r += s.n
        return self.table.gather(torch.cat(rows), batch.tokens.device)

    def add(self, h: torch.Tensor, emb: torch.Tensor, lw: dict, batch, kv, layer: int) -> torch.Tensor:
        """What PLE layer `layer` adds to the streams h (T, hc*H): ple_add of each segment, its sequence's conv rows
        read from kv.ple_conv[layer] (n_seq, (K-1)*ngram_size, hc*H) and written back; a verify step
        (batch.keep_states) leaves each segment's rows with the cache (Qwen4Cache.keep_ple) for its rollback. On
        the device path (on_device) the step's sequences at once (ple_add_decode), their rows read and written by
        batch.seq_ids."""
        conv = kv.ple_conv[layer]
        if self.on_device(batch):
            add, after = ple_add_decode(h, emb, lw, self.cfg, conv.index_select(0, batch.seq_ids))
            conv.index_copy_(0, batch.seq_ids, after)
            return add
        outs, r = [], 0
        for s in batch.segments:
            keep = [] if batch.keep_states and s.n > 1 else None
            add, conv[s.seq] = ple_add(h[r:r + s.n], emb[r:r + s.n], lw, self.cfg, conv[s.seq], keep)
            if keep:
                kv.keep_ple(layer, s, keep[0])
            outs.append(add)
            r += s.n
        return torch.cat(outs) if len(outs) > 1 else outs[0]
