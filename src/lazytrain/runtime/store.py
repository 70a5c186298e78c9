"""Host-side stores: packed layer weights, offloaded boundary activations, NVMe spill files.

- `WeightGroup`: one layer's (or the loss head's) parameters packed densely, in the compute dtype, into
  one host buffer that starts on a 4 KiB boundary, so a layer crosses the link as one copy.
  When the parameters are in the compute dtype (fp32 compute, or bf16 master weights) they are re-pointed at
  views of the buffer (no second copy; the optimizer updates the buffer in place); parameters that already lie
  packed so (a node's shared mapping, another executor's buffer) stay where they are. Otherwise (bf16 compute,
  fp32 masters) the buffer is a compute-dtype copy of the fp32 master parameters, re-packed before every step:
  fused optimizers (torch's fused AdamW, our 8-bit kernel) write parameters in place without bumping tensor
  version counters, so no cheaper staleness test is reliable. Where the update writes the copy itself in its
  pass over the masters (`copies`, `Hybrid8bitAdamW.step_group(copies=...)`: the same round-to-nearest cast),
  `written` records it and `pack` leaves those copies alone while their masters stay where they were, at the
  version the update left (a load into them bumps it). A copy shared by a node's ranks (`adopt`) is
  the exception: whoever updates the group refreshes it (`pack(force=True)`) and nothing else writes it.
  Gradients land (d2h) in the group's `landing` buffer, in the compute dtype, and stay there: with one
  micro-batch per step that buffer *is* the group's gradient, and no whole-model fp32 `.grad` exists. A step
  of several micro-batches (or a tied head in bf16, whose gradient sums the LM head's and the embedding's)
  sums them in an fp32 `accum` buffer instead, exactly as autograd's fp32 `.grad` would. `p.grad` is a view
  of the gradient where the dtypes agree; elsewhere `expose` casts the group into a transient buffer for the
  optimizer, one group at a time. Every buffer comes from one allocator (`host_empty`), so a group's weights
  and gradients could live in pinned or shared memory.
  Frozen parameters (`requires_grad` False: a LoRA base, the frozen layers of freeze tuning) stream like the
  others but have no gradient: the gradient buffers hold the trainable parameters alone, packed in their own
  order (`grad_slots`), so a frozen layer sends nothing back. Parameters in the compute dtype are views of the
  buffer one by one, so a bf16 frozen base is never copied while fp32 adapters beside it are re-packed.
- `ActivationStore`: host buffers for `cpu` boundaries and files for `nvme` boundaries, with a CRC32
  checked on read and every file closed when the step ends. Spill files have no name (O_TMPFILE, or
  unlinked right after creation): SIGKILL, SIGTERM or a crash leave nothing behind, and nobody can
  delete one mid-run; the kernel frees the blocks when the descriptor closes or the process ends.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.runtime.files import ALIGN_BYTES, bytes_view, io_error, open_nameless, read_all, write_all
from lazytrain.runtime.weights import host_value
from lazytrain.writes import alive

SPILL_PREFIX = "lazytrain-"
STALE_NAME = re.compile(r"^lazytrain-(\d+)-.*\.(spill|bin)$")  # pid in the name
SPILL_DIR_PREFIX = "lazytrain-nvme-"
STALE_DIR = re.compile(r"^lazytrain-nvme-(\d+)-\w+$")


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its group's flat buffer (elements)."""

    name: str  # name in the template module, for torch.func.functional_call
    offset: int
    numel: int
    shape: tuple[int, ...]


class WeightGroup:
    """The parameters of one layer (or the head) in one contiguous, aligned host buffer."""

    def __init__(self, name: str, named_params: list[tuple[str, torch.nn.Parameter]], dtype: torch.dtype,
                 host_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        self.name = name
        self.params = [p for _, p in named_params]
        self.dtype = dtype
        slots, offset = [], 0
        for pname, p in named_params:  # packed densely: the device slot holds exactly the layer's bytes
            slots.append(Slot(pname, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        grad_slots, offset = [], 0
        for s, p in zip(slots, self.params, strict=True):  # the trainable parameters alone, in the same order
            if p.requires_grad:
                grad_slots.append(Slot(s.name, offset, s.numel, s.shape))
                offset += s.numel
        self.grad_slots = grad_slots
        self.grad_numel = offset  # 0: a frozen group, which has no gradient
        self._trainable = [p for p in self.params if p.requires_grad]
        self._host_empty = host_empty
        self._viewed = [p.dtype == dtype for p in self.params]  # a view of the buffer (else a copy, re-packed)
        self.aliased = all(self._viewed)
        # a compute-dtype copy that only the group's update refreshes (`pack(force=True)` after it): a node's shared
        # copy, refreshed by its owner rank (`adopt`), or the copy of masters that live on NVMe (train/offload.py)
        self.packed_by_update = False
        self._written: dict[int, tuple[int, int]] = {}  # slot -> (data_ptr, version) of the master its update copied
        self._ptrs: list[int] = []
        in_place = packed_region(self.params) if self.aliased else None
        if in_place is not None:  # already packed as this group packs them: no copy
            self.buffer = in_place
            self._ptrs = [p.data_ptr() for p in self.params]
        else:
            self.buffer = aligned_empty(self.numel, dtype, host_empty)
            self.pack(force=True)
        self.landing = aligned_empty(self.grad_numel, dtype, host_empty)  # where the d2h writes the gradients
        self.accum: torch.Tensor | None = None  # fp32 sum over micro-batches, made on first use
        self.grad: torch.Tensor | None = None  # the group's gradient: `landing` or `accum`; None = none yet

    @property
    def num_bytes(self) -> int:
        return self.numel * self.buffer.element_size()

    @property
    def grad_bytes(self) -> int:
        """Bytes of the group's gradient as it crosses the link (compute dtype; 0 for a frozen group)."""
        return self.grad_numel * self.buffer.element_size()

    @property
    def trainable_names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.grad_slots)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters that get gradients, in `grad_slots` order."""
        return self._trainable

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """`flat` (a device slot or this buffer) cut into the named parameter tensors."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots}

    def grad_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """`flat` (a gradient slot or buffer) cut into the trainable parameters' gradients, by name."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.grad_slots}

    def _views_moved(self) -> bool:
        """Someone replaced the `.data` of a parameter that is a view of the buffer."""
        return [p.data_ptr() for p, v in zip(self.params, self._viewed, strict=True) if v] != self._ptrs

    def _stale(self) -> bool:
        if self.aliased:  # parameters are views of the buffer unless someone replaced p.data
            return self._views_moved()
        # a compute-dtype copy of the fp32 masters: always refresh (see the module docstring), unless its update
        # does: the node's ranks share it (another rank's write would race the h2d of the ranks streaming it), or
        # the masters are on NVMe between updates
        return not self.packed_by_update

    def pack(self, force: bool = False) -> bool:
        """Bring the buffer up to date with the parameters; returns whether it copied anything. Views of the buffer
        are copied only when forced or moved; copies of other dtypes every time (see the module docstring)."""
        if not force and not self._stale():
            return False
        every = force or self._views_moved()
        with torch.no_grad():
            for i, (s, p, viewed) in enumerate(zip(self.slots, self.params, self._viewed, strict=True)):
                if (viewed and not every) or self._written.get(i) == (p.data_ptr(), p._version):
                    continue
                view = self.buffer[s.offset:s.offset + s.numel].view(s.shape)
                view.copy_(host_value(p))  # (a master still in the model's file is read from it here)
                if viewed:
                    p.data = view  # the parameter *is* the streamed buffer
        self._ptrs = [p.data_ptr() for p, v in zip(self.params, self._viewed, strict=True) if v]
        return True

    def copies(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each trainable fp32 master streamed as a bf16 copy -> its slot of the buffer (contiguous): where an
        update writes the copy in its own pass (`Hybrid8bitAdamW.step_group(copies=...)`); `written` after it."""
        if self.dtype != torch.bfloat16:
            return {}
        return {p: self.buffer[s.offset:s.offset + s.numel].view(s.shape)
                for s, p, viewed in zip(self.slots, self.params, self._viewed, strict=True)
                if not viewed and p.requires_grad and p.dtype == torch.float32}

    def written(self, params: list[torch.nn.Parameter]) -> None:
        """The update just wrote the copies of `params` (keys of `copies`) and left the other masters alone:
        `pack` skips those copies until their masters move or change otherwise."""
        ids = {id(p) for p in params}
        self._written = {i: (p.data_ptr(), p._version) for i, p in enumerate(self.params) if id(p) in ids}

    def adopt(self, buffer: torch.Tensor) -> None:
        """Use `buffer` (this group's packed weights already in it: a node's shared-memory copy) as the host
        buffer from now on; fp32 parameters are re-pointed at it, so the old buffer is freed. A compute-dtype copy
        of fp32 masters is from now on refreshed only by `pack(force=True)`, which its owner calls after each update
        (distributed/shared.py)."""
        if buffer.dtype != self.dtype or buffer.numel() != self.numel:
            raise LazyTrainError(f"{self.name}: a buffer of {buffer.numel()} {buffer.dtype} elements cannot hold "
                                 f"{self.numel} {self.dtype} elements")
        self.buffer = buffer
        self.packed_by_update = not self.aliased
        for s, p, viewed in zip(self.slots, self.params, self._viewed, strict=True):
            if viewed:
                p.data = buffer[s.offset:s.offset + s.numel].view(s.shape)
        self._ptrs = [p.data_ptr() for p, v in zip(self.params, self._viewed, strict=True) if v]

    # ---- gradients ----------------------------------------------------------------------------------
    def land(self, *, first: bool, last: bool, sum_fp32: bool = False, source: torch.Tensor | None = None) -> None:
        """`source` (default `landing`; data parallel: its sum over the ranks, fp32 for a bf16 one) holds one
        micro-batch's gradient: make it the group's gradient in `landing` (`first` and `last`: the step's only
        micro-batch; a bf16 sum is rounded once) or add it into the fp32 `accum` (several micro-batches, or
        `sum_fp32`: more parts will be added to this one, e.g. a tied embedding's)."""
        source = self.landing if source is None else source
        if first and last and not sum_fp32:
            if source is not self.landing:
                self.landing.copy_(source)
            self.grad = self.landing
        else:
            if self.accum is None:
                self.accum = aligned_empty(self.grad_numel, torch.float32, self._host_empty)
            if first:
                self.accum.copy_(source)
            else:
                self.accum.add_(source)
            self.grad = self.accum
        self._link()

    def _link(self) -> None:
        """`p.grad` = a view of the gradient where its dtype is p's (no copy), else None (see `expose`)."""
        assert self.grad is not None
        for s, p in zip(self.grad_slots, self._trainable, strict=True):
            p.grad = self.grad[s.offset:s.offset + s.numel].view(s.shape) if self.grad.dtype == p.dtype else None

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The view of p's gradient in the group's gradient buffer (any dtype); p is trainable."""
        assert self.grad is not None
        s = self.grad_slots[next(i for i, q in enumerate(self._trainable) if q is p)]
        return self.grad[s.offset:s.offset + s.numel].view(s.shape)

    def expose(self, transient: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        """Give every parameter a `.grad` in its own dtype: a view of the gradient where the dtypes agree, else
        the gradient cast into `transient(numel, dtype)` (one buffer for the largest group, reused group after
        group: with one micro-batch, fp32 masters get exactly the fp32 `.grad` autograd would have made)."""
        if self.grad is None:
            return
        self._link()
        cast = [(s, p) for s, p in zip(self.grad_slots, self._trainable, strict=True) if p.grad is None]
        if not cast:
            return
        flat = transient(self.grad_numel, cast[0][1].dtype)
        for s, p in cast:
            p.grad = flat[s.offset:s.offset + s.numel].view(s.shape).copy_(self.grad_of(p))

    def release(self) -> None:
        """Drop the casts `expose` made; views of the kept gradient stay."""
        if self.grad is not None:
            self._link()


def packed_region(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """The flat tensor `params` already lie in, one after the other from a 4 KiB boundary in one storage (as a
    `WeightGroup` packs them), else None."""
    first = params[0]
    storage, base, size = first.untyped_storage(), first.data_ptr(), first.element_size()
    if base % ALIGN_BYTES or first.device.type != "cpu":
        return None
    numel = 0
    for p in params:
        if (p.dtype != first.dtype or not p.is_contiguous() or p.untyped_storage().data_ptr() != storage.data_ptr()
                or p.data_ptr() != base + numel * size):
            return None
        numel += p.numel()
    return torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), (numel,))


def aligned_empty(numel: int, dtype: torch.dtype,
                  host_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> torch.Tensor:
    """A flat host tensor whose first byte sits on a 4 KiB boundary (one large DMA per layer)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = host_empty((numel * size + ALIGN_BYTES,), torch.uint8)
    skip = -raw.data_ptr() % ALIGN_BYTES
    return raw[skip:skip + numel * size].view(dtype)


class ActivationStore:
    """Host buffers (`cpu` tier) and spill files (`nvme` tier) for boundary activations of one step."""

    def __init__(self, nvme_dir: Path, host_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        self.nvme_dir = Path(nvme_dir)
        self._host_empty = host_empty
        self._host: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}  # reused across steps
        self._crc: dict[int, int] = {}
        self._files: dict[int, tuple[int, int]] = {}  # boundary -> (fd of its nameless spill file, bytes)
        self.host_bytes_in_use = 0
        self.peak_host_bytes = 0
        self.nvme_bytes_in_use = 0
        self.peak_nvme_bytes = 0

    def host_buffer(self, boundary: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The host buffer of `boundary` (pinned on CUDA), allocated once and recycled across steps."""
        key = (boundary, tuple(shape), dtype)
        if key not in self._host:
            self._host[key] = self._host_empty(tuple(shape), dtype)
        return self._host[key]

    def note_host(self, num_bytes: int) -> None:
        self.host_bytes_in_use += num_bytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes_in_use)

    def write(self, boundary: int, host: torch.Tensor) -> None:
        """Write `host` to a new spill file for the boundary and remember its CRC32 (runs on the nvme_write link)."""
        data = bytes_view(host.contiguous())
        fd = -1
        try:
            fd = open_spill_file(self.nvme_dir)
            write_all(fd, data, 0)
        except OSError as err:
            if fd >= 0:
                os.close(fd)  # the partial file (disk full) goes with its only reference
            raise io_error(err, self.nvme_dir, "write an NVMe spill file") from None
        self._crc[boundary] = zlib.crc32(data)
        self._files[boundary] = (fd, len(data))
        self.nvme_bytes_in_use += len(data)
        self.peak_nvme_bytes = max(self.peak_nvme_bytes, self.nvme_bytes_in_use)

    def read(self, boundary: int, host: torch.Tensor) -> None:
        """Read the boundary's spill file into `host` and verify its CRC32 (runs on the nvme_read link)."""
        data = bytes_view(host)
        fd, _ = self._files[boundary]
        try:
            n = read_all(fd, data, 0)
        except OSError as err:
            raise io_error(err, self.nvme_dir, "read an NVMe spill file") from None
        if n != len(data) or zlib.crc32(data) != self._crc[boundary]:
            raise LazyTrainError(f"an NVMe spill file in {self.nvme_dir} is corrupt (read {n} of {len(data)} bytes, "
                                 "checksum mismatch); check the disk under nvme_dir")

    def fileno(self, boundary: int) -> int:
        """The open descriptor of the boundary's spill file (it has no name; tests reach the bytes through it)."""
        return self._files[boundary][0]

    def remove(self, boundary: int) -> None:
        entry = self._files.pop(boundary, None)
        if entry is not None:
            fd, num_bytes = entry
            os.close(fd)  # the last reference: the file system frees the blocks
            self.nvme_bytes_in_use -= num_bytes
        self._crc.pop(boundary, None)

    def end_step(self) -> None:
        """Close every spill file of the step (also after an error)."""
        for boundary in list(self._files):
            self.remove(boundary)
        self.nvme_bytes_in_use = 0
        self.host_bytes_in_use = 0

    def __del__(self) -> None:  # an executor dropped mid-step still returns its descriptors
        for fd, _ in getattr(self, "_files", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def open_spill_file(directory: Path) -> int:
    """A read-write file in `directory` that has no name, so nothing is left behind however the process ends.

    Linux O_TMPFILE creates it nameless; where the file system lacks it, a named file is created and unlinked at
    once (`clean_stale_spill_files` removes such a file if the process died in between). files.py's `open_nameless`.
    """
    return open_nameless(directory, SPILL_PREFIX)[0]


def clean_stale_spill_files(directory: Path) -> list[Path]:
    """Remove spill files left in `directory` by processes that no longer exist (pid in the name); returns them.

    Covers named spill files of the fallback in `open_spill_file` and of LazyTrain versions before nameless
    files (`lazytrain-<pid>-...-boundary<i>.bin`). A live process's files are never touched.
    """
    removed = []
    for path in directory.glob(f"{SPILL_PREFIX}*"):
        match = STALE_NAME.match(path.name)
        if match is None or alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass  # another process cleaned it first, or the directory is read-only (refused elsewhere)
    return removed


def spill_dir(parent: Path) -> Path:
    """A new spill directory `lazytrain-nvme-<pid>-<random>` under `parent` (the default nvme_dir), after removing
    those of processes that no longer exist: normal exit removes a device's own, SIGKILL cannot."""
    for path in parent.glob(f"{SPILL_DIR_PREFIX}*"):
        match = STALE_DIR.match(path.name)
        if match is not None and path.is_dir() and not alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SPILL_DIR_PREFIX}{os.getpid()}-", dir=parent))
