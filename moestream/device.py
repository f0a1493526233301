"""The CPU/CUDA shim: streams, events, pinned allocation and synchronisation behind one small interface.

On a CPU-only machine the "device" is the CPU: copies are plain copies and streams and events are no-ops, so the
same engine code runs in CI and on the GPU.

    dev = Device.resolve("auto")          # Device("cuda:0") where CUDA is, else Device("cpu")
    buf = dev.pinned_empty((n,), torch.bfloat16)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass(frozen=True)
class Device:
    name: str                                    # "cpu" or "cuda:N"

    @staticmethod
    def resolve(spec: str | None) -> "Device":
        if spec in (None, "auto"):
            return Device("cuda:0" if torch.cuda.is_available() else "cpu")
        if spec.startswith("cuda"):
            if not torch.cuda.is_available():
                raise UserError(f"device {spec!r} asked for, but this machine has no usable CUDA GPU; use --device cpu")
            index = int(spec.split(":")[1]) if ":" in spec and spec.split(":")[1].isdigit() else 0
            if index >= torch.cuda.device_count():
                raise UserError(f"device {spec!r} asked for, but this machine has {torch.cuda.device_count()} "
                                "CUDA GPU(s); use cuda:0 or --device cpu")
            return Device(f"cuda:{index}")
        if spec == "cpu":
            return Device("cpu")
        raise UserError(f"unknown device {spec!r}; use cpu, cuda or cuda:N")

    @property
    def torch(self) -> torch.device:
        return torch.device(self.name)

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda")

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        """Host memory the GPU can read by DMA (pinned) where there is a GPU; plain host memory otherwise."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch)

    def make_current(self) -> None:
        """Make this the current CUDA device (where Triton launches, and whose current stream the copy queue's
        waits go to): a share of the layers split over several devices runs so. Nothing on the CPU."""
        if self.is_cuda:
            torch.cuda.set_device(self.torch)

    def current(self):
        """Context manager making this the current CUDA device for what runs within (a no-op on the CPU)."""
        return torch.cuda.device(self.torch) if self.is_cuda else contextlib.nullcontext()

    def new_stream(self):
        return torch.cuda.Stream(self.torch) if self.is_cuda else None

    def stream(self, s):
        """Context manager making `s` current (a no-op on the CPU or for None)."""
        return torch.cuda.stream(s) if self.is_cuda and s is not None else contextlib.nullcontext()

    def allocated_memory(self) -> int | None:
        """Bytes torch's allocator holds in tensors on the device, this process's; None on the CPU."""
        return torch.cuda.memory_allocated(self.torch) if self.is_cuda else None

    def free_memory(self) -> int:
        """Free bytes on the device (for budgets); host memory is not budgeted here."""
        if self.is_cuda:
            return torch.cuda.mem_get_info(self.torch)[0]
        return 1 << 62
