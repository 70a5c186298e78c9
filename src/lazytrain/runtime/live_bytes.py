"""The true device bytes of a step: every storage that lives on the device, not only the arena's slots.

The arena (runtime/device.py) counts what the step program allocates; compute makes more: autograd's saved
tensors, a backward's gradients before they reach a slot, a kernel's outputs. `LiveBytes` sees every storage
an aten op creates on the thread that runs the step's compute (a `TorchDispatchMode`, thread-local, so the
link workers' host jobs are not counted) and each storage the arena allocates, and keeps the sum of those
alive, and its high-water mark, until each is released (a weakref finalizer on the storage fires when the
last tensor, view or autograd-saved reference to it goes, on whatever thread that is).

What it cannot see: scratch a kernel allocates and frees inside one aten call (e.g. a BLAS or attention
kernel's workspace); on CUDA `torch.cuda.max_memory_allocated` sees those too (benchmarks/gpu.py compares).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Sum and peak of the live storages made while active (`with live:`) or passed to `add`."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # StorageImpl address -> bytes
        self.used_bytes = 0
        self.peak_bytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage until it is released (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key, num_bytes = storage._cdata, storage.nbytes()
        with self._lock:
            old = self._live.get(key)
            if old == num_bytes:
                return
            self._live[key] = num_bytes
            self.used_bytes += num_bytes - (old or 0)
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        if old is None:
            weakref.finalize(storage, self._released, key)

    def _released(self, key: int) -> None:
        with self._lock:
            self.used_bytes -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.used_bytes

    @contextmanager
    def active(self, on: bool = True) -> Iterator[None]:
        """Count what the enclosed code creates (on this thread); `on=False`: a no-op, for callers' one path."""
        if not on:
            yield
            return
        with self:
            yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            # a view or an in-place result shares an input's storage: nothing new, unless it grew (resize_)
            if isinstance(t, torch.Tensor) and (t.untyped_storage()._cdata not in inputs
                                                or t.untyped_storage()._cdata in self._live):
                self.add(t)
        return out
