"""The host layers of a model split over several devices (runtime/split.py): a host provider per device, each over
its share's host layers (its own pool sized by that device's --moe-cache-mib, its own copy stream, its own routing
statistics), seen by the engine as one.

    host = PerDevice([cache0, cache1], devices, {3: 0, 4: 0, 5: 1, 6: 1}, gpus=[0, 1])  # layer -> provider index
    host.fetch(5, ids)              # cache1's pool, on devices[1]
    host.per_device()               # {gpu: CacheStats}: bench, LLM.stats() and /metrics per GPU (the split's index)

Each provider hears what the engine tells (prompts and forwards begin, zero-copy decode steps begin and end) with
its device current, so its copies and events go to that device's streams. A zero-copy decode step reads each host
layer's experts by address through its layer's provider (its table, its landing slots, on its device); the step's
device ops (decode_step_ops) are each provider's, run with its device current, and `ops_of` gives one device's
alone, for the graph of that device's share (runtime/graphs.py).
"""
from __future__ import annotations

import torch

import contextlib

from ..device import Device
from .provider import HostProvider
from .stats import CacheStats


class PerDevice(HostProvider):
    pauses = False      # a paused prompt would leave another device current for the forwards in between

    def __init__(self, providers: list[HostProvider], devices: list[Device], owner: dict[int, int],
                 gpus: list[int]):
        super().__init__()
        self.providers, self.devices, self.owner = providers, devices, owner     # owner: layer -> provider index
        self.gpus = gpus                # each provider's device index in the split
        self.by_layer = {l: providers[d] for l, d in owner.items()}

    def _each(self, fn) -> None:
        for p, dev in zip(self.providers, self.devices):
            with dev.current():
                fn(p)

    # --- what the engine tells ---------------------------------------------------------------------------------
    def use_plan(self, plan) -> None:
        self._each(lambda p: p.use_plan(plan))

    def device_rows(self) -> list[torch.Tensor]:
        return [r for p in self.providers for r in p.device_rows()]

    def begin_prompt(self, seq: int) -> None:
        self._each(lambda p: p.begin_prompt(seq))

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        self._each(lambda p: p.begin_ubatch(seq, n_tokens, is_prompt, seqs))

    def begin_decode_step(self, seqs: list[int] | None = None) -> None:
        self._each(lambda p: p.begin_decode_step(seqs))         # each table onto its own device

    def end_decode_step(self, n_tokens: int, observer=None) -> None:
        self._each(lambda p: p.end_decode_step(n_tokens, observer))     # its layers' routing, in layer order

    def decode_step_ops(self) -> tuple | None:
        """Every provider's step ops (HostProvider.decode_step_ops), each run with its device current: the first
        ones before the step, the last ones after it. None where no provider has any."""
        ops = [(dev, o) for dev, o in zip(self.devices, (p.decode_step_ops() for p in self.providers))
               if o is not None]
        if not ops:
            return None

        def first():
            for dev, o in ops:
                with dev.current():
                    o[0]()

        def last(n_tokens: int):
            for dev, o in ops:
                with dev.current():
                    o[1](n_tokens)

        @contextlib.contextmanager
        def kept():
            with contextlib.ExitStack() as stack:
                for _, o in ops:
                    stack.enter_context(o[2]())
                yield
        return first, last, kept

    def ops_of(self, d: int) -> tuple | None:
        """The step ops of device d's provider (d: its index in the split; a graph of d's share runs them), or
        None (no provider there, or one with no ops)."""
        return self.providers[self.gpus.index(d)].decode_step_ops() if d in self.gpus else None

    # --- what the MoE block asks, of the layer's own provider ---------------------------------------------------
    def fetch(self, layer: int, ids, lookahead=None):
        return self.by_layer[layer].fetch(layer, ids, lookahead)

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        return self.by_layer[layer].lookahead_layers(layer, n_tokens)

    def experts_launched(self, layer: int) -> None:
        self.by_layer[layer].experts_launched(layer)

    def layout(self, layer: int):
        return self.by_layer[layer].layout(layer)

    def landing(self, layer: int, ids):
        return self.by_layer[layer].landing(layer, ids)

    def address_table(self, layer: int):
        return self.by_layer[layer].address_table(layer)

    # --- what the engine reports ---------------------------------------------------------------------------------
    def per_device(self) -> dict[int, CacheStats]:
        """Each device's counters, up to date, by its index in the split."""
        out = {}
        for g, p, dev in zip(self.gpus, self.providers, self.devices):
            with dev.current():
                out[g] = p.counters()
        return out

    def counters(self) -> CacheStats:
        return CacheStats.joined(list(self.per_device().values()))

    def cache_info(self) -> dict | None:
        infos = [p.cache_info() for p in self.providers]
        if all(i is None for i in infos):
            return None
        known = [i for i in infos if i is not None]
        return {"slots": sum(i["slots"] for i in known), "policy": known[0]["policy"],
                "mib": sum(i["mib"] for i in known), "buffer": all(i["buffer"] for i in known),
                "devices": {g: i for g, i in zip(self.gpus, infos)}}

    def pinned_slots(self) -> int | None:
        counts = [p.pinned_slots() for p in self.providers]
        return None if all(c is None for c in counts) else sum(c or 0 for c in counts)
