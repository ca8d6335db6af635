"""Staging buffers for async saves: host copies of tensors, reused from one save to the next.

An async save blocks the training loop only while tensors are copied into these buffers. The
buffers are kept between saves (keyed by the tensor's name, shape and dtype), so host memory
stays at one copy of the state however many saves run. When CUDA is present the buffers are
pinned, so that device-to-host copies run at full speed without a bounce buffer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from orbit_pt._format.safetensors import check_storable


class StagingPool:
    """Host buffers for one item's tensors, by name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._in_use: set[str] = set()

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool (for tests and benchmarks)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def begin(self) -> None:
        """Start staging a new save; buffers not used by it are released at :meth:`finish`."""
        self._in_use.clear()

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` in the buffer reserved for ``name``.

        Raises:
            CheckpointTypeError, CheckpointValueError: a tensor with no dense bytes to copy
                (sparse, nested, quantized, meta), named -- as a synchronous save refuses it.
        """
        check_storable(name, tensor)
        source = tensor.detach()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pin = source.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
            self._buffers[name] = buffer
        self._in_use.add(name)
        # non_blocking from a device lets all copies of a save overlap; finish() waits once.
        buffer.copy_(source, non_blocking=source.device.type != "cpu")
        return buffer

    def copy_all(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` by name, staged as one save (begin, copy each, finish)."""
        self.begin()
        copies = {name: self.copy(name, tensor) for name, tensor in tensors.items()}
        self.finish()
        return copies

    def finish(self) -> None:
        """Wait for the copies of this save and drop buffers it no longer needs."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for name in set(self._buffers) - self._in_use:
            del self._buffers[name]
