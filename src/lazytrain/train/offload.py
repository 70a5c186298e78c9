"""The optimizer's state on the NVMe SSD (`optimizer_offload: nvme`): every layer group's state tensors
and, where the streamed weights are a compute-dtype copy, its fp32 master weights live in a file, and host memory
holds them only while the group is updated.

One StateFiles file (runtime/statefiles.py) per checkpoint group -- a param group `name`: embedding, layer<j>, head
-- holding, by the checkpoint's names, each parameter's state tensors `"<param index>.<state key>"` (torch AdamW's
exp_avg / exp_avg_sq, Hybrid8bitAdamW's 8-bit codes and absmax or fp32 moments) and, with fp32 masters under bf16
compute, the master itself under its parameter name -- but the embedding matrix's, which the forward gathers rows
from every step (and, with ranks, every rank from the node's shared copy): it stays in host memory, as the cost
model counts it (CostModel.masters_offloaded). Between updates none of them is in host memory: the tensor keys
are absent from `optimizer.state[p]` (the step counter and flags stay, they are scalars), and an offloaded
master's `p.data` is a NaN placeholder of its shape that holds 4 bytes (a read gives NaN, a write raises), while
the executor streams the group's compute-dtype copy, which only the update refreshes (`WeightGroup.
packed_by_update`).

An update of executor group g (`staged(update)`): its files are read into a staging slot (a reused, aligned host
buffer sized for the largest group), the states and masters become views of the slot, the optimizer steps them in
place exactly as it steps tensors of its own (optim/chunked.py's chunks are slices of the views), the streamed
copy is refreshed from the staged masters, the views go, and the slot is written back. Bit for bit the in-RAM
optimizer: the same kernels on the same bytes, only where the bytes live differs.

The optimizer is built group by group (`build`): a group's states are created (Hybrid8bitAdamW makes them as a
param group is added; AdamW's lazy zeros are made here), copied into its file and dropped before the next group's
exist, so host memory never holds more than one group's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.plan.schedule import update_order
from lazytrain.runtime.device import return_freed_host_memory
from lazytrain.runtime.files import ALIGN_BYTES
from lazytrain.runtime.statefiles import GroupLayout, StateFiles, header_bytes_bound, safetensors_names
from lazytrain.runtime.store import aligned_empty
from lazytrain.runtime.weights import deferred, host_value, placeholder, settle
from lazytrain.train.metrics import say

if TYPE_CHECKING:
    from lazytrain.runtime.executor import Executor, GroupUpdate

ParamGroup = dict[str, object]
MASTER_FILE = "master.safetensors"  # the checkpoint's fp32 masters (train/checkpoint.py's name)
# the most and the longest-named state tensors a parameter has here (8-bit: qv, absmax_m, absmax_v; AdamW's two)
STATE_KEYS_BOUND = ("exp_avg_sq", "absmax_m", "absmax_v")


def _plain_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@dataclass
class FileGroup:
    """One checkpoint group's file: its parameters (torch's numbering), their state keys in the file, and the
    parameter names of its offloaded masters."""

    name: str
    params: dict[int, torch.nn.Parameter]
    keys: dict[int, list[str]] = field(default_factory=dict)
    masters: dict[int, str] = field(default_factory=dict)

    def state_names(self) -> list[str]:
        """The tensors of its optimizer/<name>.safetensors (masters excluded)."""
        return [f"{i}.{key}" for i, keys in self.keys.items() for key in keys]


class NvmeStates:
    """The optimizer states (and offloaded masters) of `executor`'s model in `directory`; see the module docstring.

    Usage: `states = NvmeStates(dir, executor)`; `opt = states.build(make, groups)` (instead of `make(groups)`);
    `states.bind(opt, executor_groups)`; each group update wrapped in `states.staged(update)`; `states.close()`."""

    def __init__(self, directory: str | Path, executor: Executor, *, owned: set[int] | None = None,
                 masters: bool = True, group_bytes: tuple[int, ...] = ()) -> None:
        """`owned`: the executor groups this rank steps (data parallel; None: all): only theirs get files, and the
        states of the others are dropped as they are made. `masters`: offload fp32 masters of a bf16 stream (with
        ranks they stay in the node's shared memory, which every rank maps: distributed/shared.py).
        `group_bytes`: the cost model's bytes of each group's file (CostModel.state_group_bytes, at target + 1):
        the disk must have room for this rank's before the first file is made (one line naming the need)."""
        self.executor = executor
        self.compute_dtype = executor.compute_dtype
        self.masters = masters
        self._owner = {id(p): i for i, params in enumerate(executor.param_groups()) for p in params}
        self._owned = owned
        self.files = StateFiles(directory, {}, host_empty=executor.device.host_empty, note=say)
        self.groups: dict[str, FileGroup] = {}
        self._names = {id(p): n for n, p in executor.model.named_parameters()}
        self._gathered = executor.parts.embedding.weight  # its master stays in RAM (module docstring)
        L, params = executor.parts.num_layers, executor.param_groups()
        mine = [(executor.index_of(t), b) for t, b in zip(range(-1, L + 1), group_bytes, strict=False)
                if b and (owned is None or executor.index_of(t) in owned)]
        count = sum(len(ps) for ps in params)
        self.files.check_room(sum(b + self._headers_bound(params[i], count, b) for i, b in mine))
        self._targets: list[list[str]] = []  # executor group index -> its checkpoint groups
        self.slots: list[torch.Tensor] = []  # the staging slots (`bind`)
        self._lock = threading.Lock()  # reads, updates and writes run on three lanes' threads
        self._staged: dict[int, int] = {}  # executor group -> the slot a read filled, until its update
        self._dirty: dict[int, int] = {}  # executor group -> the slot its update left, until written back
        self._expected: set[int] = set()  # groups the running program writes back (state_write ops)
        # the streamed copies stop following the (soon absent) masters: each update refreshes its group's
        for index in range(len(executor.param_groups())):
            group = executor.group_at(index)
            if masters and group is not None and not group.aliased:
                group.packed_by_update = True

    def _headers_bound(self, params: list[torch.nn.Parameter], count: int, data_bytes: int) -> int:
        """At least the headers of an executor group's files, from its parameters before any state exists: each
        with STATE_KEYS_BOUND's states (names as long as the longest index's) and its master where it goes to the
        file; a page more for a tied head's second file (the embedding's param group)."""
        digits = len(str(count))
        names = [f"{k:0{digits}d}.{key}" for k in range(len(params)) for key in STATE_KEYS_BOUND]
        names += [self._names[id(p)] for p in params
                  if self.masters and p.dtype != self.compute_dtype and p is not self._gathered]
        return header_bytes_bound([p.shape for p in params], names, data_bytes) + ALIGN_BYTES

    # ---- building ---------------------------------------------------------------------------------
    def build(self, make: Callable[[list[ParamGroup]], torch.optim.Optimizer], groups: list[ParamGroup]
              ) -> torch.optim.Optimizer:
        """`make(groups)`, one checkpoint group at a time: after each group's param groups are added, its states
        (and masters) move into its file."""
        try:
            return self._build(make, groups)
        except BaseException:
            self.close()  # no state file outlives a build that failed (the trainer never got the object to close)
            raise

    def _build(self, make: Callable[[list[ParamGroup]], torch.optim.Optimizer], groups: list[ParamGroup]
               ) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer | None = None
        index = 0
        for name, named in groupby(groups, key=lambda g: str(g["name"])):
            params: dict[int, torch.nn.Parameter] = {}
            for group in named:
                for p in group["params"]:  # type: ignore[union-attr]
                    if deferred(p):  # a master still in the model's file: real for its states' making, then moved
                        p.data = host_value(p)
                        settle(p)
                if optimizer is None:
                    optimizer = make([group])
                else:
                    optimizer.add_param_group(group)
                for p in group["params"]:  # type: ignore[union-attr]
                    params[index] = p
                    index += 1
            assert optimizer is not None
            self._move_out(optimizer, FileGroup(name, params))
        assert optimizer is not None, "an optimizer needs parameters"
        return_freed_host_memory()  # the heap pages of the states and masters that left
        return optimizer

    def _move_out(self, optimizer: torch.optim.Optimizer, group: FileGroup) -> None:
        """Create the group's file from its states (AdamW's lazy zeros made here, as torch makes them) and masters,
        then drop them from host memory."""
        if self._owned is not None and not all(self._owner[id(p)] in self._owned for p in group.params.values()):
            for p in group.params.values():  # another rank's: no file here, and none of its states
                state = optimizer.state[p]
                for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]:
                    del state[key]
            return
        tensors: dict[str, torch.Tensor] = {}
        for i, p in group.params.items():
            state = optimizer.state[p]
            if not state and isinstance(optimizer, torch.optim.AdamW):  # torch's lazy state (optim/chunked.py)
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            group.keys[i] = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            tensors.update({f"{i}.{k}": state[k] for k in group.keys[i]})
            if self.masters and p.dtype != self.compute_dtype and p is not self._gathered:  # fp32 masters of a
                # bf16 stream
                group.masters[i] = self._names[id(p)]
                tensors[group.masters[i]] = p.detach()
        layout = GroupLayout.of(tensors)
        self.files.add(group.name, layout)
        slot = aligned_empty(layout.padded_data_bytes, torch.uint8, _plain_empty)
        views = layout.views(slot)
        for name, t in tensors.items():
            views[name].copy_(t)
        self.files.write(group.name, slot).wait()
        self.groups[group.name] = group
        self._detach(optimizer, [group.name])

    def bind(self, optimizer: torch.optim.Optimizer, executor_groups: list[list[int]], depth: int = 1) -> None:
        """`executor_groups`: for each executor group, the optimizer's param groups holding its parameters
        (train/optimizer.py's executor_param_groups); `depth` staging slots, each sized for the largest group
        (the plan's staging depth: how many groups' states are staged at once)."""
        self.optimizer = optimizer
        # (with ranks, another rank's groups have no file here: their ops are no-ops on this rank)
        self._targets = [[n for n in dict.fromkeys(str(optimizer.param_groups[k]["name"]) for k in ks)
                          if n in self.groups] for ks in executor_groups]
        self.slot_bytes = max(self.staged_bytes(i) for i in range(len(self._targets)))
        self.set_depth(depth)

    def set_depth(self, depth: int) -> None:
        """`depth` staging slots (a plan's staging_depth; between steps: nothing is staged across a change)."""
        with self._lock:
            self._staged.clear()
            if self._dirty:  # its slot would be freed with the update in it
                raise RuntimeError(f"staging depth changed while group {min(self._dirty)}'s update is not written back")
        self.slots = [aligned_empty(self.slot_bytes, torch.uint8, self.executor.device.host_empty)
                      for _ in range(max(1, depth))]
        parts = self.executor.parts
        order = [self.executor.index_of(t) for t in update_order(parts.num_layers, parts.tied)]
        self._default_slot = {index: k % len(self.slots) for k, index in enumerate(order)}  # StateSchedule's

    def state_bytes(self) -> tuple[int, ...]:
        """Each group's bytes in a slot (what a state_read / state_write moves) at target + 1, as
        Shapes.state_bytes: the untied embedding (0 when tied), layers 0..L-1, the head."""
        parts, index_of = self.executor.parts, self.executor.index_of
        return (0 if parts.tied else self.staged_bytes(index_of(-1)),
                *(self.staged_bytes(index_of(t)) for t in range(parts.num_layers + 1)))

    def staged_bytes(self, index: int) -> int:
        """Bytes executor group `index`'s files take in a staging slot (what its read and write move)."""
        return sum(self.files.layouts[n].padded_data_bytes for n in self._targets[index])

    @property
    def file_bytes(self) -> int:
        return self.files.total_bytes

    # ---- the lane's ops and an update ----------------------------------------------------------------
    def read(self, index: int, slot: int | None = None) -> None:
        """Read executor group `index`'s files into staging slot `slot` (default: its place in the update order,
        modulo the depth); blocks (a job of the nvme_read lane, or the update's own read)."""
        slot = self._default_slot[index] if slot is None else slot
        with self._lock:  # the slot's previous group is not staged any more
            unwritten = [i for i, s in self._dirty.items() if s == slot]
            if unwritten:  # a program that reads into a slot before its write-back would lose an update
                raise RuntimeError(f"state read of group {index} into staging slot {slot}, which holds group "
                                   f"{unwritten[0]}'s update not yet written back")
            self._staged = {i: s for i, s in self._staged.items() if s != slot}
        regions = self._regions(index, self.slots[slot])
        for event in [self.files.read(name, region) for name, region in regions]:
            event.wait()
        with self._lock:
            self._staged[index] = slot

    def write(self, index: int) -> None:
        """Write executor group `index`'s updated slot back to its files; blocks (a job of the nvme_write lane,
        or the update's own write)."""
        with self._lock:
            slot = self._dirty.pop(index, None)
        if slot is None:  # (another rank's group)
            return
        regions = self._regions(index, self.slots[slot])
        for event in [self.files.write(name, region) for name, region in regions]:
            event.wait()

    def expect_writes(self, indices: Iterable[int]) -> None:
        """The groups whose write-back the running step program does (state_write ops); every other update
        writes its slot back itself."""
        with self._lock:
            self._expected = set(indices)

    def abandon(self) -> None:
        """After an error in a step: forget what is staged (an update may have stopped halfway: the run stops,
        its last checkpoint is what counts)."""
        with self._lock:
            self._staged.clear()
            self._dirty.clear()
            self._expected = set()

    def staged(self, update: GroupUpdate) -> GroupUpdate:
        """`update(index)` run on executor group `index`'s states and masters: those a state_read staged, else
        read now; written back by the program's state_write, else now."""

        def run(index: int) -> None:
            with self._lock:
                slot = self._staged.pop(index, None)
            if slot is None:
                self.read(index)
                with self._lock:
                    slot = self._staged.pop(index)
            regions = self._regions(index, self.slots[slot])
            self._attach(regions)
            try:
                update(index)
                self._refresh(index)
            finally:
                self._detach(self.optimizer, [name for name, _ in regions])
            with self._lock:
                self._dirty[index] = slot
                later = index in self._expected
            if not later:
                self.write(index)

        return run

    def _regions(self, index: int, slot: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Each of the group's files' place in `slot` (4 KiB-aligned: padded sizes are multiples of 4 KiB)."""
        out, offset = [], 0
        for name in self._targets[index]:
            size = self.files.layouts[name].padded_data_bytes
            out.append((name, slot[offset:offset + size]))
            offset += size
        return out

    def _attach(self, regions: list[tuple[str, torch.Tensor]], states: bool = True) -> None:
        """The staged bytes become the optimizer's state tensors (unless not `states`) and the masters' data."""
        for name, region in regions:
            group, views = self.groups[name], self.files.layouts[name].views(region)
            for i, keys in group.keys.items() if states else ():
                state = self.optimizer.state[group.params[i]]
                for key in keys:
                    state[key] = views[f"{i}.{key}"]
            for i, pname in group.masters.items():
                group.params[i].data = views[pname]

    def _detach(self, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
        for name in names:
            group = self.groups[name]
            for i, keys in group.keys.items():
                state = optimizer.state[group.params[i]]
                for key in keys:
                    state.pop(key, None)
            for i in group.masters:
                p = group.params[i]
                p.data = placeholder(p)

    def _refresh(self, index: int) -> None:
        """The streamed compute-dtype copy of a group whose masters are staged, from them."""
        group = self.executor.group_at(index)
        if group is not None and group.packed_by_update and any(self.groups[n].masters for n in self._targets[index]):
            group.pack(force=True)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_group(self, name: str, path: Path) -> None:
        """A checkpoint's optimizer/<name>.safetensors: the group's state tensors copied out of its file inside the
        kernel (os.copy_file_range, nothing through host memory); the same bytes, names and layout as a checkpoint
        written from the states in RAM, so either kind of run resumes from it. Raises OSError (the checkpoint's
        write path makes its one line)."""
        self.files.save_safetensors(name, path, self.groups[name].state_names())

    @property
    def offloaded_masters(self) -> set[str]:
        """The parameter names whose fp32 masters live in the files."""
        return {m for g in self.groups.values() for m in g.masters.values()}

    def save_masters(self, path: Path, model: torch.nn.Module) -> None:
        """A checkpoint's master.safetensors: the offloaded masters copied out of the files inside the kernel and
        the others that train (the embedding matrix's) from host memory; a frozen parameter never changes, it is the
        model's own (as in RAM). Raises OSError."""
        offloaded = self.offloaded_masters
        host = {n: p for n, p in model.named_parameters() if n not in offloaded and p.requires_grad}
        self.files.save_combined(path, [(name, list(g.masters.values())) for name, g in self.groups.items()
                                        if g.masters], host=host)

    def load(self, path: Path) -> None:
        """Resume from checkpoint `path`: its optimizer/<group>.safetensors and its masters (master.safetensors, or
        the HF folder's tensors where it has none: its masters were the compute dtype) copied into the files inside
        the kernel, every name, dtype and shape checked; then each group staged once: its float tensors checked
        finite and its streamed copy refreshed from the loaded masters. A checkpoint written from the states in RAM
        has the same files, so it resumes here too."""
        state_dir = path / "trainer_state"
        for name, group in self.groups.items():
            self.files.load_safetensors(name, state_dir / "optimizer" / f"{name}.safetensors", group.state_names())
        masters = [m for g in self.groups.values() for m in g.masters.values()]
        if masters:
            sources = [state_dir / MASTER_FILE] if (state_dir / MASTER_FILE).exists() else \
                sorted(path.glob("*.safetensors"))
            loaded: set[str] = set()
            for source in sources:
                held = safetensors_names(source)
                for name, group in self.groups.items():
                    names = [m for m in group.masters.values() if m in held]
                    if names:
                        self.files.load_safetensors(name, source, names, others=True)
                        loaded.update(names)
            missing = sorted(set(masters) - loaded)
            if missing:
                raise LazyTrainError(f"checkpoint {path} has no weights for {missing[0]} (and {len(missing) - 1} "
                                     "more); resume with the run's own model")
        for index in range(len(self._targets)):
            self._check_and_refresh(path, index)

    def _check_and_refresh(self, path: Path, index: int) -> None:
        regions = self._regions(index, self.slots[0])
        for event in [self.files.read(name, region) for name, region in regions]:
            event.wait()
        for name, region in regions:
            for tensor_name, t in self.files.layouts[name].views(region).items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise LazyTrainError(f"checkpoint {path} cannot be resumed: {tensor_name} holds NaN or infinite "
                                         "values (a diverged or damaged checkpoint)")
        self._attach(regions, states=False)
        try:
            self._refresh(index)
        finally:
            self._detach(self.optimizer, [name for name, _ in regions])

    @contextmanager
    def streamed_weights(self) -> Iterator[None]:
        """While inside, each offloaded master's `p.data` is its streamed compute-dtype copy (the masters rounded,
        what a checkpoint's HF folder holds), so `model.state_dict()` reads real weights; placeholders again
        after."""
        copies = self._streamed_copies()
        try:
            for p, view in copies:
                p.data = view
            yield
        finally:
            for p, _ in copies:
                p.data = placeholder(p, torch.float32)  # (offloaded masters are fp32)

    def _streamed_copies(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        offloaded = {id(group.params[i]) for group in self.groups.values() for i in group.masters}
        out = []
        for group in [*self.executor.layer_groups, self.executor.head_group]:
            views = group.views(group.buffer)
            out += [(p, views[s.name]) for s, p in zip(group.slots, group.params, strict=True) if id(p) in offloaded]
        return out

    # ---- whole-state views (tests, conversions) ---------------------------------------------------
    def tensors(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Each file's tensors by name, copied out one group at a time (tests; small models)."""
        for name, layout in self.files.layouts.items():
            slot = aligned_empty(layout.padded_data_bytes, torch.uint8, _plain_empty)
            self.files.read(name, slot).wait()
            yield name, {k: v.clone() for k, v in layout.views(slot).items()}

    def close(self) -> None:
        """Close the files (the kernel frees their blocks; nothing stays in the directory)."""
        self.files.close()
        self.slots = []
