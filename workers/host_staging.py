"""Copies a step's host arrays (token ids, positions, slots, block tables) to the device.

On CUDA each named array goes through its own pinned buffer, kept from step to step
(allocating pinned memory costs far more than the copy), with a non-blocking copy, so the
step's inputs travel while the host prepares the rest and the GPU still runs the last step.
A buffer is rewritten only after its previous copy has finished (an event per buffer): a
step that samples nothing never waits on the GPU, so nothing else orders the two.
On a CPU the array's own memory is used: there is nothing to copy.
"""

from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied: dict[str, torch.cuda.Event] = {}

    def __call__(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if not self.pinned:
            return host.to(self.device)
        staged = self._staging(name, host)
        staged.copy_(host)
        on_device = staged.to(self.device, non_blocking=True)
        self._copied[name].record()
        return on_device

    def _staging(self, name: str, host: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is not None:
            self._copied[name].synchronize()
        if buffer is None or buffer.dtype != host.dtype or buffer.numel() < host.numel():
            size = max(host.numel(), 2 * buffer.numel() if buffer is not None else 0, 256)
            buffer = self._buffers[name] = torch.empty(size, dtype=host.dtype, pin_memory=True)
            self._copied[name] = torch.cuda.Event()
        return buffer[:host.numel()].view(host.shape)
