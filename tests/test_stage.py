"""kernels/stage.py: staged host reads. The rule (stage_plan) by hand, its copies (stage_reference) byte for byte, the
host's replay of its landings (landed_experts), and the Triton kernel against the rule through the interpreter."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreted import run_check

from moestream.kernels.reference import AddressBook
from moestream.kernels.stage import Landing, landed_experts, stage_plan, stage_reference


class Memory:
    """Host rows (E, nbytes), a pool of P slots and S scratch rows (stride bytes each), all in one AddressBook."""

    def __init__(self, E=12, nbytes=64, P=6, S=3, stride=None, seed=0, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        stride = stride or nbytes
        self.host_rows = torch.randint(0, 256, (E, nbytes), dtype=torch.uint8, generator=g)
        if device != "cpu":
            self.host_rows = self.host_rows.pin_memory()          # read over the link, in place
        self.pool = torch.zeros(P, stride, dtype=torch.uint8, device=device)
        self.scratch = torch.zeros(S, stride, dtype=torch.uint8, device=device)
        self.book = AddressBook()
        for t in (self.host_rows, self.pool, self.scratch):
            self.book.add(t)
        self.nbytes = nbytes
        self.host = torch.tensor([self.addr(self.host_rows, e) for e in range(E)], device=device)
        self.resident = min(4, P, E - 6)         # slot s holds expert 6 + s; the other slots are empty
        for s in range(self.resident):
            self.pool[s, :nbytes] = self.host_rows[s + 6]

    @staticmethod
    def addr(rows, i):
        return rows.data_ptr() + i * rows.stride(0) * rows.element_size()

    def table(self):
        """(E,) where a step reads each expert: experts 6-9 from their slots, the rest from host."""
        t = self.host.clone()
        for e in range(6, 6 + self.resident):
            t[e] = self.addr(self.pool, e - 6)
        return t

    def landing(self, ids, land_slots):
        land = torch.tensor([self.addr(self.pool, s) if s >= 0 else 0 for s in land_slots], dtype=torch.int64,
                            device=self.host.device)
        return Landing(ids, self.host, land, self.scratch, aligned=True)


def test_the_rule_by_hand():
    m = Memory()
    ids = torch.tensor([[1, 7, 2], [2, 3, 8], [4, 1, 5]])       # 7, 8 resident; 1 and 2 chosen twice
    addrs = m.table()[ids]
    lan = m.landing(ids, [4, -1])                                # two landing slots, the second none
    staged, src, dst = stage_plan(addrs, lan)
    flat = staged.reshape(-1).tolist()
    # distinct host-read experts in first-choice order: 1, 2, 3, 4, 5. 1 lands in slot 4; 2 finds no landing
    # slot (0) and takes scratch 0; 3 and 4 scratch 1 and 2; 5 has no room: read in place.
    assert flat[0] == m.addr(m.pool, 4) == flat[7]                # both choices of expert 1 read its copy
    assert flat[2] == m.addr(m.scratch, 0) == flat[3]
    assert flat[4] == m.addr(m.scratch, 1) and flat[6] == m.addr(m.scratch, 2)
    assert flat[8] == m.host[5]                                   # in place
    assert flat[1] == addrs[0, 1] and flat[5] == addrs[1, 2]      # resident: unchanged
    assert src.tolist() == [m.host[1], 0, m.host[2], 0, m.host[3], 0, m.host[4], 0, 0]
    on_host = (addrs.reshape(-1) == m.host[ids.reshape(-1)]).tolist()
    assert landed_experts(ids.reshape(-1).tolist(), on_host, 2) == [(1, 0), (2, 1)]
    assert dst[0] == lan.land[0] and dst[2] == m.addr(m.scratch, 0)


def test_one_token_lands_as_the_unstaged_kernel_does():
    """For one token (k distinct experts) the landing order is kernels.decode.landing_slots' choice order."""
    from moestream.kernels.decode import landing_slots
    on_host = [False, True, True, False, True]
    ids = [9, 4, 2, 7, 5]
    assert landed_experts(ids, on_host, 2) == [(ids[j], r) for j, r in landing_slots(on_host, 2)]


def test_the_copies_are_the_experts_bytes():
    m = Memory(nbytes=48, stride=64)
    ids = torch.tensor([[0, 1, 7], [1, 2, 3]])
    addrs = m.table()[ids]
    lan = m.landing(ids, [5])
    staged = stage_reference(addrs, lan, m.nbytes, m.book)
    for a, e in zip(staged.reshape(-1).tolist(), ids.reshape(-1).tolist()):
        assert torch.equal(m.book.row(a)[:m.nbytes], m.host_rows[e])
    assert staged[0, 0] == m.addr(m.pool, 5)


def test_no_scratch_stages_nothing():
    m = Memory()
    ids = torch.tensor([[0, 1]])
    addrs = m.table()[ids]
    staged, src, _ = stage_plan(addrs, Landing(ids, m.host, torch.zeros(0, dtype=torch.int64)))
    assert torch.equal(staged, addrs) and not src.any()


@pytest.mark.parametrize("check", ["kernel"])
def test_stage_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


@pytest.mark.cuda
def test_stage_kernel_on_cuda_copies_pinned_host_rows():
    kernel("cuda")


def kernel(device="cpu"):
    """The kernel's staged addresses are the rule's, and its copies the experts' bytes: aligned rows (128-bit
    words) and rows of 4-byte words; several tokens with repeats; no landing slots; more host reads than room."""
    from moestream.kernels import stage
    g = torch.Generator().manual_seed(3)
    if device == "cpu":
        stage.BLOCK_BYTES = 64                     # several chunks a row in the interpreter
    for nbytes, stride, aligned in ((160, 160, True), (100, 112, False), (3 * 65536 + 48, 3 * 65536 + 64, True)):
        if device == "cpu" and nbytes > 1000:
            continue
        for T, k, land in ((1, 4, [4, 5]), (3, 4, [5, -1, 4]), (4, 3, []), (16, 8, [4])):
            m = Memory(E=16, nbytes=nbytes, P=6, S=3, stride=stride, device=device)
            ids = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(T)]).to(device)
            addrs = m.table()[ids]
            lan = m.landing(ids, land)._replace(aligned=aligned)
            want, _, _ = stage_plan(addrs, lan)
            got = stage.stage_host_rows(addrs, lan, nbytes)
            assert torch.equal(got, want), (got, want)
            for a, e in zip(got.reshape(-1).tolist(), ids.reshape(-1).tolist()):
                assert torch.equal(m.book.row(a)[:nbytes].cpu(), m.host_rows[e])


if __name__ == "__main__":
    globals()[sys.argv[1]]()
