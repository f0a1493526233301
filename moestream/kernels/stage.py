"""Staged host reads: a decode step copies the experts it reads from pinned host memory into device memory first,
in one copy launch, and the expert kernel then reads every choice from the device.

    staged = stage_host_rows(addrs, landing, nbytes)     # addrs (T, k) -> (T, k): host rows now device copies
    out = kernel(x, staged, weights, layout)             # reads nothing over the link

Why: the quantized decode kernels read host rows in place at 29-34 GB/s of the link's 55 (bench/RESULTS.md, issue
14, stop 15): they are busy unpacking while their loads cross the link. A copy has nothing else to do, so its
loads keep the link full; the kernel then reads the copies from HBM, where it runs 20x faster. The bits do not
change: the kernels' results depend on the bytes alone, never on where they were read.

Where each host-read expert goes (`Landing`): the step's first host-read experts (each distinct expert once, in
flattened choice order t k + j) take the layer's R landing slots of the cache (land: (R,) addresses, 0 for none),
so that the cache keeps them (read-through: the host takes them in after the step, `landed_experts`); the next
S go to the scratch rows (S, row) the step may overwrite; any further ones are read in place, as before. A choice
whose expert another choice copies reads that copy: a miss crosses the link once a step, however many tokens
chose it.

`stage_plan` is the rule in plain torch (the CPU path, with the copies made through an AddressBook, and the
oracle of the Triton kernel).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .decode import triton

MAX_CHOICES = 128            # a step of more routed choices a layer than this reads its host rows in place
BLOCK_BYTES = 65536          # what one copy program moves (a Q4_K_M expert of the reference: 47 programs)
WARPS = 8
STAGE_BYTES = 64 << 20       # the scratch rows a step copies the host reads that land nowhere into (at least top_k
                             # rows, one token's; one scratch serves every layer: their launches are in order)


class Landing(NamedTuple):
    """Where a step's host reads go, per layer: ids (T, k) routed ids; host (E,) each expert's host-row address
    (a choice reads from host when its address is its expert's host row); land (R,) landing slots' addresses in
    the cache, 0 for none; scratch (S, row) uint8 device rows the step may overwrite, or None (then nothing is
    staged, and a kernel that lands as it reads, kernels/decode.py, does the landing)."""
    ids: torch.Tensor
    host: torch.Tensor
    land: torch.Tensor
    scratch: torch.Tensor | None = None
    aligned: bool = False        # every host row, slot and scratch row 16-byte aligned, row bytes too


def staging_rows(pool: torch.Tensor, top_k: int) -> torch.Tensor:
    """(S, row) device rows like the pool's, that a staged step copies the host reads into that land nowhere
    (staging_bytes)."""
    row = pool.stride(0) * pool.element_size()
    return torch.empty(staging_bytes(row, top_k) // row, pool.shape[1], dtype=pool.dtype, device=pool.device)


def staging_bytes(row_bytes: int, top_k: int) -> int:
    """The scratch of staged host reads: STAGE_BYTES of rows, at least one token's top_k and at most a step's
    MAX_CHOICES (what the engine counts beside the cache's pool)."""
    return min(MAX_CHOICES, max(top_k, STAGE_BYTES // row_bytes)) * row_bytes


def stage_plan(addrs: torch.Tensor, lan: Landing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The staging rule, plain torch: (staged (T, k) addresses, src (N,), dst (N,)), N = T k: choice i copies its
    row from src[i] to dst[i] where src[i] != 0 (the first choice of each distinct host-read expert that has a
    destination), and every choice reads from staged."""
    flat = addrs.reshape(-1)
    ids = lan.ids.reshape(-1)
    n = flat.numel()
    on_host = flat == lan.host[ids]
    same = ids[:, None] == ids[None, :]                         # (N, N): choices of one expert
    earlier = same & torch.ones(n, n, dtype=torch.bool, device=flat.device).tril(-1)
    first = on_host & ~earlier.any(dim=1)                       # (N,): the first choice of its expert
    rank = torch.cumsum(first.long(), 0) - 1
    R = lan.land.numel()
    land = torch.where(first & (rank < R), lan.land[rank.clamp(0, max(R - 1, 0))] if R else 0, 0)
    to_scratch = first & (land == 0)
    srank = torch.cumsum(to_scratch.long(), 0) - 1
    if lan.scratch is not None:
        S, stride = lan.scratch.shape[0], lan.scratch.stride(0) * lan.scratch.element_size()
        scr = torch.where(to_scratch & (srank < S), lan.scratch.data_ptr() + srank * stride, 0)
    else:
        scr = torch.zeros_like(land)
    dest_first = torch.where(first, land + scr, 0)              # (N,) (land and scr are never both set)
    dest = ((same & first[None, :]).long() * dest_first[None, :]).sum(dim=1)      # each choice: its expert's copy, 0 if none
    staged = torch.where(on_host & (dest != 0), dest, flat)
    src = torch.where(first & (dest_first != 0), flat, 0)
    return staged.view_as(addrs), src, dest_first


def landed_experts(ids, on_host, n_slots: int) -> list[tuple[int, int]]:
    """The kernel's landing rule, on the host: [(expert, landing slot r)] for a step's T k choices in flattened
    order (ids; on_host: read from host memory), the distinct host-read experts in order of first choice, the first
    n_slots of them. For one token (k distinct experts) it is kernels.decode.landing_slots' rule."""
    out, seen = [], set()
    for e, h in zip(ids, on_host):
        e = int(e)
        if h and e not in seen:
            seen.add(e)
            if len(out) == n_slots:
                break
            out.append((e, len(out)))
    return out


def stage_reference(addrs: torch.Tensor, lan: Landing, nbytes: int, book) -> torch.Tensor:
    """stage_host_rows on the CPU: the rule's copies made through an AddressBook (kernels/reference.py)."""
    staged, src, dst = stage_plan(addrs, lan)
    for s, d in zip(src.tolist(), dst.tolist()):
        if s:
            book.row(d).view(torch.uint8)[:nbytes].copy_(book.row(s).view(torch.uint8)[:nbytes])
    return staged


def stages(lan: Landing | None, n_choices: int) -> bool:
    """Whether a step stages its host reads: a scratch to stage into, and few enough choices for one program's
    plan (MAX_CHOICES)."""
    return lan is not None and lan.scratch is not None and n_choices <= MAX_CHOICES


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _stage(addr_ptr, ids_ptr, host_ptr, land_ptr, out_ptr, R, scratch, S, stride, N, n_words,
               NP: tl.constexpr, BLOCK: tl.constexpr, A16: tl.constexpr):
        """Program (c, i): the plan of every choice (stage_plan's rule, in registers), then chunk c of choice i's
        copy if it makes one; chunk 0 also writes choice i's staged address."""
        c = tl.program_id(0)
        i = tl.program_id(1)
        js = tl.arange(0, NP)
        jm = js < N
        a = tl.load(addr_ptr + js, mask=jm, other=0)
        e = tl.load(ids_ptr + js, mask=jm, other=0)
        on_host = jm & (a == tl.load(host_ptr + e, mask=jm, other=-1))
        same = (e[:, None] == e[None, :]) & jm[None, :]                        # (NP, NP)
        earlier = same & (js[None, :] < js[:, None])
        first = on_host & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
        rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
        land = tl.load(land_ptr + rank, mask=first & (rank < R), other=0)
        to_scratch = first & (land == 0)
        srank = tl.cumsum(to_scratch.to(tl.int32), axis=0) - 1
        scr = tl.where(to_scratch & (srank < S), scratch + srank.to(tl.int64) * stride, 0)
        dest_first = tl.where(first, land + scr, 0)
        mine = js == i
        e_i = tl.sum(tl.where(mine, e, 0), axis=0)
        a_i = tl.sum(tl.where(mine, a, 0), axis=0)
        host_i = tl.sum(tl.where(mine & on_host, 1, 0), axis=0) > 0
        first_i = tl.sum(tl.where(mine & first, 1, 0), axis=0) > 0
        dest = tl.sum(tl.where((e == e_i) & first, dest_first, 0), axis=0)      # its expert's copy, 0 if none
        if c == 0:
            tl.store(out_ptr + i, tl.where(host_i & (dest != 0), dest, a_i))
        if first_i & (dest != 0):
            src, dst = a_i, dest
            if A16:                     # (the shifts tell the compiler both are 16-aligned: 128-bit loads)
                src, dst = (src >> 4) << 4, (dst >> 4) << 4
            offs = c * BLOCK + tl.arange(0, BLOCK)
            m = offs < n_words
            v = tl.load(src.to(tl.pointer_type(tl.int32)) + offs, mask=m)
            tl.store(dst.to(tl.pointer_type(tl.int32)) + offs, v, mask=m)


def stage_host_rows(addrs: torch.Tensor, lan: Landing, nbytes: int) -> torch.Tensor:
    """addrs (T, k) int64 -> (T, k): each host-read choice's address replaced by its device copy's (module
    docstring), after one launch that makes the copies. nbytes: the layer's row bytes (a multiple of 4; slots and
    scratch rows may be wider)."""
    T, k = addrs.shape
    N = T * k
    scratch = lan.scratch
    stride = scratch.stride(0) * scratch.element_size()
    assert nbytes % 4 == 0 and stride >= nbytes and N <= MAX_CHOICES, (nbytes, stride, N)
    a16 = lan.aligned and nbytes % 16 == 0 and stride % 16 == 0 and scratch.data_ptr() % 16 == 0
    out = torch.empty_like(addrs)
    words = nbytes // 4
    block = BLOCK_BYTES // 4
    _stage[(triton.cdiv(words, block), N)](addrs.contiguous(), lan.ids.contiguous(), lan.host, lan.land, out,
                                           lan.land.numel(), scratch.data_ptr(), scratch.shape[0], stride, N, words,
                                           NP=max(16, triton.next_power_of_2(N)), BLOCK=block, A16=a16,
                                           num_warps=WARPS)
    return out
