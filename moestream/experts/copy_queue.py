"""The copy queue: host-to-device expert copies on their own CUDA stream, each batch returning an event.

    q = CopyQueue(device)
    seq = q.submit([(pool[s], store_row)], speculative=False)    # a sequence number (None on the CPU)
    q.wait(seq, compute_stream)      # the compute stream waits for that batch (and, FIFO, all before it)

One stream keeps copies in order, so waiting for batch n waits for every batch before it too. Speculative bytes in
flight are bounded by the caller (`speculative_inflight()`), so a demand miss never queues behind more than that.
`pending_bytes()` and `speculative_inflight()` count the bytes of the copies not yet done (an event after each
piece, not each batch), so a caller can keep the stream fed a copy at a time: a batch near its end no longer counts
whole. On the CPU copies run inline and every call is a no-op.
"""
from __future__ import annotations

from collections import deque

import torch


class CopyQueue:
    def __init__(self, device):
        self.device = device
        self.stream = device.new_stream() if device.is_cuda else None    # the copy stream
        self.events: dict[int, torch.cuda.Event] = {}                    # seq -> event, until known complete
        self.seq = 0                                                     # last submitted batch
        self.done = 0                                                    # every batch <= done has completed
        self.marks = deque()                        # (seq, event after each piece, its bytes, speculative) not done

    def submit(self, pieces: list, speculative: bool, after=None) -> int:
        """Queue the copies: each piece a (dst, src) pair of tensors, or a callable that launches copies on the
        current stream (the copy stream) and returns their bytes (kernels/batch_copy.py, copy_rows.py). `after`: a
        compute-stream event they must wait for (their slots' last readers). Returns the batch's sequence number."""
        self.seq += 1
        if self.stream is None:
            for piece in pieces:
                _run(piece, non_blocking=False)
            self.done = self.seq
            return self.seq
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            for piece in pieces:
                n = _run(piece, non_blocking=True)
                mark = torch.cuda.Event()
                mark.record(self.stream)
                self.marks.append((self.seq, mark, n, speculative))
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[self.seq] = ev
        return self.seq

    def poll(self) -> int:
        """Advance `done` past every completed batch (events complete in order on one stream)."""
        while self.done < self.seq:
            ev = self.events.get(self.done + 1)
            if ev is not None and not ev.query():
                break
            self.events.pop(self.done + 1, None)
            self.done += 1
        while self.marks and self.marks[0][0] <= self.done:     # what completed batches left behind
            self.marks.popleft()
        return self.done

    def _pending(self) -> deque:
        """The marks of the pieces not done yet (events complete in order)."""
        self.poll()
        while self.marks and self.marks[0][1].query():
            self.marks.popleft()
        return self.marks

    def pending_bytes(self) -> int:
        """Bytes of the copies queued and not done yet."""
        return sum(m[2] for m in self._pending())

    def speculative_inflight(self) -> int:
        """Bytes of the speculative copies (prefetch) queued and not done yet."""
        return sum(m[2] for m in self._pending() if m[3])

    def wait(self, seq: int, stream) -> bool:
        """Make `stream` wait for batch `seq`; False when it had already completed (no wait was queued)."""
        if seq <= self.poll():
            return False
        stream.wait_event(self.events[seq])
        return True


def _run(piece, non_blocking: bool) -> int:
    """Queue one piece (submit's): its bytes."""
    if callable(piece):
        return piece()
    dst, src = piece
    dst.copy_(src, non_blocking=non_blocking)
    return dst.numel() * dst.element_size()
