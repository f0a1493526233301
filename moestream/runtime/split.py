"""Several devices in one process (llama.cpp's --split-mode layer): each holds a contiguous share of the layers, with
their attention, routers, KV cache and GPU-resident experts, and a cache of its own for its host layers' experts
(its pool, its copy stream). The activations cross between devices only where one share ends and the next begins.

    devices, shares = split_devices(placement, n_mib=None)      # [Device("cuda:0"), Device("cuda:1")], (3.0, 1.0)
    split = Split.by_shares(cfg.n_layers, devices, shares)      # layers 0..17 on cuda:0, 18..23 on cuda:1
    split.index(20), split.device(20), split.layers(1)          # 1, Device("cuda:1"), range(18, 24)

On the CPU, "cpu,cpu" gives two stand-ins (the same memory, the same bits): what the tests run the split's
bookkeeping on. A model's MTP head layers go with its last layer. One device is no Split at all: the engine's path
is the one-device path, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import Device
from ..engine_config import Placement
from ..errors import UserError


def split_devices(p: Placement) -> tuple[list[Device], tuple[float, ...] | None]:
    """The devices a placement runs on, and each one's share of the layers (None for one device): --device (auto:
    every CUDA GPU with --split-mode layer), --split-mode none (the --main-gpu of them), --tensor-split (default:
    by free memory, as llama.cpp). One-line UserErrors for a split over one device, a --tensor-split longer than
    the devices, a --main-gpu out of range."""
    if p.device == "auto":
        cuda = torch.cuda.is_available()
        names = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
    else:
        names = p.device.split(",")
    several = p.device == "auto" or len(names) > 1
    if several and p.main_gpu >= len(names):
        raise UserError(f"--main-gpu {p.main_gpu}: there {'is' if len(names) == 1 else 'are'} {len(names)} "
                        f"device(s) ({', '.join(names)}); use --main-gpu 0" + (f" to {len(names) - 1}"
                                                                              if len(names) > 1 else ""))
    if p.split_mode == "none" and len(names) > 1:
        names = [names[p.main_gpu]]
    devices = [Device.resolve(n) for n in names]
    shares = p.tensor_split
    if shares is not None and len(devices) == 1:
        raise UserError(f"--tensor-split {_spell(shares)} splits the layers over several devices, but only "
                        f"{devices[0].name} is in use; drop --tensor-split (or give --device cuda:0,cuda:1)")
    if len(devices) == 1:
        return devices, None
    if shares is None:                  # as llama.cpp: each device's share is its free memory
        shares = tuple(float(d.free_memory() >> 20) for d in devices)
    if len(shares) > len(devices):
        raise UserError(f"--tensor-split {_spell(shares)} gives {len(shares)} shares, but {len(devices)} devices are "
                        f"in use ({', '.join(d.name for d in devices)}); give at most {len(devices)}")
    return devices, tuple(shares) + (0.0,) * (len(devices) - len(shares))       # the rest: none, as llama.cpp's


def _spell(shares) -> str:
    return ",".join(f"{x:g}" for x in shares)


@dataclass(frozen=True)
class Split:
    """Which device holds each layer: devices[d] holds layers first[d] .. first[d + 1] - 1 (the last device also
    the layers past n_layers, an MTP head's). Every device holds at least one layer."""
    devices: tuple[Device, ...]
    first: tuple[int, ...]
    n_layers: int

    @staticmethod
    def by_shares(n_layers: int, devices: list[Device], shares: tuple[float, ...]) -> "Split":
        """Layer i goes to the first device whose cumulative share passes i / n_layers (llama.cpp's rule). A device
        may be left with no layer (a share of 0): it holds nothing, and no activation crosses to it."""
        total, acc, bounds = sum(shares), 0.0, []
        for s in shares:
            acc += s
            bounds.append(acc / total)
        owner = [min(sum(b <= i / n_layers for b in bounds), len(devices) - 1) for i in range(n_layers)]
        first = tuple(sum(o < d for o in owner) for d in range(len(devices)))
        return Split(tuple(devices), first, n_layers)

    def __len__(self) -> int:
        return len(self.devices)

    def index(self, layer: int) -> int:
        """The device index of `layer` (an MTP head's, past n_layers: the last layer's)."""
        return sum(f <= min(layer, self.n_layers - 1) for f in self.first) - 1

    def device(self, layer: int) -> Device:
        return self.devices[self.index(layer)]

    def layers(self, d: int) -> range:
        """Device d's trunk layers."""
        return range(self.first[d], self.first[d + 1] if d + 1 < len(self.first) else self.n_layers)

    def runs(self, layers) -> list[tuple[Device, list[int]]]:
        """`layers` (in order) cut where the device changes: [(device, its consecutive layers), ...]."""
        out: list[tuple[Device, list[int]]] = []
        last = None
        for i in layers:
            d = self.index(i)
            if d != last:
                out.append((self.devices[d], []))
                last = d
            out[-1][1].append(i)
        return out

    def describe(self) -> str:
        """One line: 'layers 0-17 on cuda:0, 18-23 on cuda:1'."""
        return ", ".join(f"{r.start}-{r.stop - 1} on {d.name}" for d, r in
                         ((self.devices[k], self.layers(k)) for k in range(len(self))) if len(r))

    def holds(self, d: int, layers) -> set[int]:
        """Those of `layers` that device d holds."""
        return {l for l in layers if self.index(l) == d}
