"""No cache, but decode over the upload buffer: `--cpu-moe` without `--moe-cache-mib`.

    host = BufferedCache(store, n_layers=24, n_experts=128, device=dev)    # one layer's experts of device memory
    host.begin_ubatch(seq, 512, is_prompt=True)      # prompts upload each ubatch's experts into it (UploadPerUbatch)
    host.begin_decode_step()                         # decode steps use the same rows as the smallest cache

Without a cache, every ubatch's routed experts are uploaded into a buffer of one layer's experts (E rows), and a
decode step read every expert over the link. The same E rows, kept as the smallest expert cache (cache.py with E
slots: the slot pool, its policy, read-through and staging), keep what consecutive decode steps route again: on
the reference's Q4_K_M file a third of a token's experts (bench/RESULTS.md, stop 19: 103 against 76 tok/s), in
the same device memory. Prompts keep the buffer's plain path (upload.py; with its second set of rows where the
device has room, `second`): with one set, at ubatch 512 and 2048 it was the faster of the two (6403 against 4500,
17552 against 16835 tok/s), as the pool's planning per layer costs more than it saves when one layer's experts
fill it; at 4096 the pool's copy stream was faster (30480 against 26193), so ubatches of more than
POOL_PROMPT_TOKENS take the cache's prompt path, unless the rows copy ahead (a wide routing: Qwen3-Next's).

Where the E rows are fewer than a token's routed experts of every host layer (the 30B reference: 128 < 24 x 8),
such a pool keeps each layer's most routed experts of recent steps (hot_set.py) and reads the rest where they lie
(staged), uploading no miss. Where they hold a step's experts, as Qwen3-Next's 512 for 12 layers of top-10 do,
decode steps land what they read in the rows' free slots (read-through; zero_copy.py) and upload nothing: on that
reference's near-uniform routing the rows then give a few percent of hits for nothing on the link. (Before
one-token steps landed their misses instead of uploading them, such rows uploaded each miss, evicting what the
next step read: 21.5% hit, 11.5 GB uploaded over 64 tokens, 114 tok/s against the plain buffer's 162.) Without
read-through (`buffer_decodes`) they keep the plain buffer.

The two uses of the rows take turns: a ubatch through the buffer first empties the cache (after its last decode
step is learned from and its copies have landed), as the buffer's uploads overwrite the slots; decode then
refills them. Both write the rows in stream order with the compute that reads them (the buffer's uploads on the
compute stream, the cache's behind its events), and each expert's result does not depend on its row, so the
numerics contract holds across the switch.
"""
from __future__ import annotations

import numpy as np
import torch

from .cache import ExpertCache
from .upload import UploadPerUbatch

POOL_PROMPT_TOKENS = 2048      # prompt forwards (a ubatch, or a batch read layer by layer) above this take the
                               # cache's prompt path, unless the rows copy ahead


def buffer_decodes(n_experts: int, n_host_layers: int, top_k: int, lands: bool) -> bool:
    """Whether no-cache decode keeps the upload buffer's E rows as the smallest cache: where decode steps land
    what they read (read-through: a one-token step then uploads nothing, so the rows' hits cost nothing on the
    link), or where the rows are fewer than a token's routed experts of every host layer (see above)."""
    return lands or n_experts < n_host_layers * top_k


class BufferedCache(ExpertCache):
    pauses = False      # a prompt's uploads fill the rows that decode steps read as the cache's slots
    BUFFER = True       # (Engine.stats: no --moe-cache-mib, the upload buffer)

    def __init__(self, store, n_layers: int, n_experts: int, device, *args, second: bool = False, **kw):
        """ExpertCache's arguments but n_slots: the rows are one layer's experts, one slot an expert id. second:
        prompts upload through a second set of rows too (upload.py: one layer's copies under another's compute)."""
        super().__init__(store, n_experts, n_layers, n_experts, device, *args, **kw)
        self.upload = UploadPerUbatch(store, n_experts, device, self.top_k, buf=self.pool, second=second,
                                      prefetch=self.prefetch)
        self.upload.stats = self.stats                 # one set of counters for both uses of the rows
        self.buffering = False                         # the rows hold a ubatch's uploads, not the cache's slots

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        if is_prompt:
            through_buffer = n_tokens <= POOL_PROMPT_TOKENS or self.upload.copies_ahead(n_tokens)
        else:                                   # a decode step too long to read in place (the eager path)
            through_buffer = not self._in_place(n_tokens)
        if not through_buffer:
            self.buffering = False
            super().begin_ubatch(seq, n_tokens, is_prompt, seqs)
            return
        if not self.buffering:
            self.empty()
            self.upload.forget_readers()       # decode steps read the first set as the cache's slots
            self.buffering = True
        self.upload.begin_ubatch(seq, n_tokens, is_prompt)

    def empty(self) -> None:
        """Every slot empty, the last decode step learned from; the compute stream, which the buffer's uploads
        run on, waits for the copy stream's last copies (one landing later would overwrite an upload)."""
        self.flush_decode()
        q = self.slots.queue
        if self.device.is_cuda:
            q.wait(q.seq, torch.cuda.current_stream(self.device.torch))
        res = self.residency
        owned = np.flatnonzero(res.owner[:, 0] >= 0)
        if len(owned):
            res.evict(owned)
        self.slots.prefetched[:] = False

    def begin_decode_step(self, seqs: list[int] | None = None) -> None:
        self.buffering = False
        super().begin_decode_step(seqs)

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        return 0 if self.buffering else super().lookahead_layers(layer, n_tokens)

    def fetch(self, layer: int, ids, lookahead: tuple | None = None):
        if self.buffering:
            return self.upload.fetch(layer, ids)
        return super().fetch(layer, ids, lookahead)

    def experts_launched(self, layer: int) -> None:
        if self.buffering:
            self.upload.experts_launched(layer)
        else:
            super().experts_launched(layer)
