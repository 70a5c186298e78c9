"""Checkpoints (Contract 5, docs/architecture.md): data, not code; written whole or not at all; checked before
they are read; resumed exactly.

    output_dir/checkpoint-<step>/
        config.json, generation_config.json        the model, in the compute dtype, that
        model-0000k-of-0000n.safetensors + index    AutoModelForCausalLM.from_pretrained loads
        tokenizer files (with the chat template)    when the run has an HF tokenizer
        trainer_state.json                          HF-readable (train/hf_state.py writes its content)
        trainer_state/
            trainer.json              step, schedule position, skip counters, losses so far
            data.json                 the data loader's position (and the world size it counts in)
            rng.json, rng.safetensors Python's and numpy's RNG states; torch's (and CUDA's) as uint8 tensors
            master.safetensors        fp32 master weights (only when they are not the compute dtype)
            optimizer.json            optimizer kind, param groups, per-parameter scalars (state_data.py)
            optimizer/<group>.safetensors   one file per layer group (embedding, layer<j>, head): that group's state
                                      tensors, `<param index>.<state key>`, written by the rank that steps it
            plan.json                 the plan the run executed
            manifest.json             every file: its size and xxh3-128 content hash; written last

Nothing is read with pickle: tensors are safetensors, the rest JSON, and every value is checked against the run
before it is used (state_data.py). A checkpoint of the old format (pickled `state.pt` / `optimizer.pt`) cannot
be read safely and is refused in one line.

A checkpoint is written under a temporary name (`.tmp-checkpoint-<step>`), every file and directory fsynced, the
manifest written last, and only then renamed into place, so a crash, a full disk or a signal never leaves a
half-written `checkpoint-<step>`, and the previous checkpoint stays intact; any write error is one line saying
which checkpoint is intact and how to continue (writes.py). A checkpoint is resumed only when every file matches
its manifest (size and hash) and its weights are finite; `resume_from_checkpoint: auto` takes the newest such
checkpoint (one that is not is skipped with a one-line note) and refuses when checkpoints exist but none is
usable (it never starts the run over on top of them); a named checkpoint that does not match is a one-line error.

Data parallel (`ranks`): rank 0 writes everything but the optimizer groups' files, and each rank of node 0 writes
the files of the groups it steps into the same temporary directory at the same time, so no rank ever holds
another's states (the ranks of other nodes hold the same states as node 0's). Rank 0 writes the manifest and
renames only once every rank said its part is in: a rank lost or failing mid-write leaves no `checkpoint-<step>`.
Resuming, each rank reads the files of its own groups, whatever the number of ranks that wrote them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from lazytrain import jsonio
from lazytrain.distributed.batches import check_batches_drawn, check_world_size
from lazytrain.distributed.ranks import RankLost
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan
from lazytrain.runtime.adapters import lora_settings, peft_config, peft_tensors
from lazytrain.train import rundir, state_data
from lazytrain.train.metrics import say
from lazytrain.train.rundir import PREFIX, RUN_FILES  # noqa: F401  (the output directory's names, re-exported)
from lazytrain.train.signals import Interrupted, critical
from lazytrain.writes import WRITE_ERRORS, WriteFailed, fsync_dir, reason, remove

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lazytrain.distributed.ranks import Ranks
    from lazytrain.train.offload import NvmeStates

STATE_DIR = "trainer_state"
HF_STATE_FILE = "trainer_state.json"  # the HF Trainer's view of the run, beside the exact state (train/hf_state.py)
MANIFEST = f"{STATE_DIR}/manifest.json"
FORMAT = 2  # 1: pickled state.pt / optimizer.pt (refused)
LEGACY = ("state.pt", "optimizer.pt")
SHARD_BYTES = 2 << 30  # the HF folder's shard size: 2 GiB (the model is always written with an index)
HASH_CHUNK_BYTES = 8 << 20
READ_ERRORS = (OSError, ValueError, KeyError, TypeError, SafetensorError, RuntimeError, OverflowError,
               state_data.BadState)  # (ValueError: UnicodeDecodeError, JSONDecodeError too)


@dataclass
class TrainerState:
    """What a resumed run needs besides weights and optimizer states (JSON-able; `trainer.json`)."""

    step: int = 0  # optimizer steps taken (skipped non-finite steps included): the next step's index
    applied_steps: int = 0  # steps whose update was applied: the learning-rate schedule's position
    skipped_steps: int = 0  # non-finite steps skipped so far
    consecutive_skips: int = 0
    losses: list[float | None] = field(default_factory=list)  # per step (None: non-finite, skipped)
    step_times_s: list[float] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: object) -> TrainerState:
        """trainer.json, checked: the counters are non-negative integers, the lists numbers (or null)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            raise state_data.BadState(f"trainer.json does not hold the keys {', '.join(names)}")
        for key in names[:4]:
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 0:
                raise state_data.BadState(f"trainer.json's {key} is not a non-negative integer")
        for key in names[4:]:
            if not isinstance(data[key], list) or not all(
                    v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in data[key]):
                raise state_data.BadState(f"trainer.json's {key} is not a list of numbers")
        return cls(**data)


# =====================================================================================================
# finding a checkpoint to resume from
# =====================================================================================================
def checkpoint_step(path: Path) -> int | None:
    m = re.fullmatch(rf"{PREFIX}(\d+)", path.name)
    return int(m.group(1)) if m else None


def checkpoints(out: Path) -> list[Path]:
    """`checkpoint-<step>` directories of a run, oldest first (complete or not)."""
    found = [p for p in out.glob(f"{PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def _manifest(path: Path) -> dict[str, dict[str, Any]] | str:
    """The manifest's files, or why there is none to trust."""
    if any((path / STATE_DIR / name).exists() for name in LEGACY):
        return ("it is in the old format (pickled state.pt / optimizer.pt), which cannot be read safely; start the "
                "run over (overwrite_output_dir true) or resume from a checkpoint of this version")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        ok = manifest.get("format") == FORMAT and isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("xxh3_128"), str)
            for v in files.values())
    except READ_ERRORS:
        return f"no readable {MANIFEST}"
    if not ok:
        return f"{MANIFEST} is not a manifest of this version"
    for name in files:  # every name stays inside the checkpoint
        if name.startswith("/") or ".." in Path(name).parts:
            return f"{MANIFEST} names a file outside the checkpoint ({name[:60]})"
    return files


def incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint (no manifest, a missing or truncated file), by sizes alone, or None."""
    files = _manifest(path)
    if isinstance(files, str):
        return files
    for name, entry in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != entry["bytes"]:
            return f"{name} has {actual} bytes, the manifest says {entry['bytes']} (truncated)"
    return None


def damage_reason(path: Path) -> str | None:
    """`incomplete_reason`, then every file's content hash against the manifest; None when all match."""
    why = incomplete_reason(path)
    if why is not None:
        return why
    files = _manifest(path)
    assert isinstance(files, dict)
    for name, entry in files.items():
        try:
            digest = file_hash(path / name)
        except OSError as err:
            return f"{name} cannot be read ({reason(err)})"
        if digest != entry["xxh3_128"]:
            return f"{name}'s content differs from the manifest's hash (changed or damaged)"
    return None


def resume_checkpoint(resume_from: str | None, out: Path, *, overwrite: bool = False) -> Path | None:
    """The checkpoint to resume from: None (a fresh run: `auto` in a directory without checkpoints), the newest
    intact one in `out` (`auto`; a damaged one is skipped with a note; none intact is refused, unless `overwrite`:
    the run then starts over, its old checkpoints deleted), or the named one (refused when damaged)."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        found = checkpoints(out)
        reasons = []
        for path in reversed(found):
            why = damage_reason(path)
            if why is None:
                return path
            say(f"note     skipping {path}: not a usable checkpoint ({why})")
            reasons.append(f"{path.name}: {why}")
        if found and overwrite:
            say(f"note     no usable checkpoint in {out}: starting over (overwrite_output_dir)")
        elif found:
            raise LazyTrainError(f"resume_from_checkpoint auto: no usable checkpoint in {out} ({reasons[0]}); name "
                                 "another with resume_from_checkpoint, or start the run over with "
                                 "overwrite_output_dir true (its checkpoints and metrics are then deleted)")
        return None
    path = Path(resume_from)
    if not path.is_dir():
        raise LazyTrainError(f"resume_from_checkpoint {path}: no such directory; name a checkpoint-<step> directory "
                             "or use auto")
    why = damage_reason(path)
    if why is not None:
        raise LazyTrainError(f"resume_from_checkpoint {path} is not a complete checkpoint ({why}); name another "
                             "one or use auto (the newest complete one)")
    return path


def file_hash(path: Path) -> str:
    """xxh3-128 of a file's bytes (hex): ~10 GB/s, so the disk, not the hash, sets the time."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


# =====================================================================================================
# saving
# =====================================================================================================
def save_checkpoint(out: Path, state: TrainerState, *, model: PreTrainedModel, compute_dtype: torch.dtype,
                    optimizer: torch.optim.Optimizer, optimizer_kind: str, data_state: dict[str, object],
                    plan: Plan, tokenizer: PreTrainedTokenizerBase | None = None,
                    save_total_limit: int | None = None, ranks: Ranks | None = None,
                    owned: set[int] | None = None, hf_state: Mapping[str, object] | None = None,
                    nvme: NvmeStates | None = None, keep: Path | None = None) -> Path:
    """Write `checkpoint-<state.step>` whole (temporary name, fsync, manifest, rename) and keep the newest
    `save_total_limit`. A failure (a full disk, a read-only or vanished directory, a third signal) removes the
    partial copy and leaves every earlier checkpoint as it was, in one line. With `ranks` a collective (module
    docstring; `owned`: the id()s of the parameters this rank steps): `out` is rank 0's, the others learn the
    temporary directory from it; returns the checkpoint's path on every rank. `hf_state`: the content of
    trainer_state.json, the HF Trainer's view of the run (train/hf_state.py; rank 0's). `nvme`: the optimizer's
    states (and masters) in files (optimizer_offload nvme): each group's file and master.safetensors are copies of
    them (train/offload.py), the HF folder the streamed copies of the offloaded masters. `keep`: a checkpoint
    save_total_limit never removes (load_best_model_at_end's best)."""
    main = ranks is None or ranks.is_main
    tmp = out / f".tmp-{PREFIX}{state.step}"
    error: LazyTrainError | None = None
    if ranks is not None:  # every rank finished the step (a lost rank stops it before a byte is written)
        ranks.barrier(f"the start of checkpoint {state.step}")
    if main:
        try:
            rundir.check(out)
            remove(tmp)
            (tmp / STATE_DIR / "optimizer").mkdir(parents=True)
        except (*WRITE_ERRORS, WriteFailed) as err:
            error = _cannot_write(out, state.step, err)
            _discard(tmp)
        except LazyTrainError as err:
            error = err
    if ranks is not None:
        where = ranks.broadcast_object(None if error else str(tmp), f"the start of checkpoint {state.step}")
        if where is None:
            raise error or LazyTrainError(f"rank 0 could not start checkpoint {state.step} (its line says why)")
        tmp = Path(where)
    elif error is not None:
        raise error
    try:
        scalars: object = {}
        try:
            scalars = _write_optimizer_groups(tmp / STATE_DIR, optimizer, ranks, owned, nvme)
        except (*WRITE_ERRORS, WriteFailed) as err:
            error = _cannot_write(tmp.parent, state.step, err)
        if ranks is not None:  # rank 0 writes optimizer.json with every group's scalars, from their owners (every
            # rank takes part, its write failed or not: the agreement below stops them all)
            scalars = ranks.gather_to_main(scalars, f"writing checkpoint {state.step} (the optimizer scalars)")
        try:
            if main and error is None:
                if lora_settings(model) is not None:  # the adapters alone: the base is the model's own folder
                    _write_adapter(tmp, model, compute_dtype)
                else:
                    with nvme.streamed_weights() if nvme is not None else nullcontext():
                        _write_model(tmp, model, compute_dtype)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                _write_trainer_state(tmp, state, model=model, compute_dtype=compute_dtype, data_state=data_state,
                                     plan=plan, optimizer_doc=state_data.optimizer_json(optimizer, optimizer_kind,
                                                                                         _merged(scalars)),
                                     hf_state=hf_state, nvme=nvme)
        except (*WRITE_ERRORS, WriteFailed) as err:
            error = _cannot_write(tmp.parent, state.step, err)
        if ranks is None:
            if error is not None:
                raise error
            return _finish(out, tmp, state.step, save_total_limit, keep)
        if not ranks.agree(error is None, f"writing checkpoint {state.step}"):  # every part is in, or none counts
            raise error or LazyTrainError(f"checkpoint {state.step} abandoned: another rank could not write its part "
                                          "(its line says why)")
        return Path(ranks.decided_by_main(lambda: str(_finish(out, tmp, state.step, save_total_limit, keep)),
                                          f"the end of checkpoint {state.step}"))
    except Interrupted as stop:  # the third signal during the save
        if main:
            _discard(tmp)
        raise Interrupted(stop.signum, f"{stop}: checkpoint {state.step} abandoned, nothing of it kept"
                          f"{_intact(out, state.step)}; continue with resume_from_checkpoint=auto") from None
    except (LazyTrainError, RankLost):  # (RankLost: a rank died mid-write) nothing of this checkpoint stays
        if main:
            _discard(tmp)
        raise


def _merged(scalars: object) -> dict[int, dict[str, Any]]:
    """One process's scalars, or every rank's (gathered, a list) in one mapping."""
    if isinstance(scalars, dict):
        return scalars
    out: dict[int, dict[str, Any]] = {}
    for part in scalars or []:
        out.update(part or {})
    return out


def _write_optimizer_groups(state_dir: Path, optimizer: torch.optim.Optimizer, ranks: Ranks | None,
                            owned: set[int] | None, nvme: NvmeStates | None = None) -> dict[int, dict[str, Any]]:
    """This rank's layer groups' files (every group without ranks; node 0's owners with them); returns the scalars
    of the parameters whose files it wrote."""
    scalars: dict[int, dict[str, Any]] = {}
    if ranks is not None and ranks.rank >= ranks.local_world_size:  # node 0 writes; the others hold the same
        return scalars
    params = state_data.params_by_index(optimizer)
    for name, indices in state_data.group_params(optimizer).items():
        if owned is not None and not all(id(params[i]) in owned for i in indices):
            continue
        tensors, group_scalars = state_data.split_states(optimizer, indices)
        path = state_dir / "optimizer" / f"{name}.safetensors"
        if nvme is not None and name in nvme.groups:  # (its tensors are in its file, none in `tensors`)
            nvme.save_group(name, path)
        else:
            save_file({k: _unshared(v) for k, v in tensors.items()}, str(path))
        scalars.update(group_scalars)
    return scalars


def _finish(out: Path, tmp: Path, step: int, save_total_limit: int | None, keep: Path | None = None) -> Path:
    """Manifest (every file is in), fsync, rename into place; then keep the newest `save_total_limit`, and `keep`
    besides them (the HF Trainer's rotation: the newest and the best are never removed)."""
    final = out / f"{PREFIX}{step}"
    try:
        _write_manifest(tmp)
        fsync_dir(tmp)
        with critical():  # a signal waits: the rename pair below never stops halfway
            rundir.check(out)
            if final.exists() or final.is_symlink():  # the same step again (a resumed run saved it): replace whole
                old = out / f".old-{PREFIX}{step}"
                remove(old)
                os.rename(final, old)
                os.rename(tmp, final)
                remove(old)
            else:
                os.rename(tmp, final)
            fsync_dir(out)
    except (*WRITE_ERRORS, WriteFailed) as err:
        raise _cannot_write(out, step, err) from None
    if save_total_limit is not None:
        rotate(out, save_total_limit, keep)
    return final


def rotate(out: Path, save_total_limit: int, keep: Path | None = None) -> None:
    """Remove the oldest complete checkpoints until `save_total_limit` are left, never the newest nor `keep`."""
    complete = [p for p in checkpoints(out) if incomplete_reason(p) is None]
    protected = set(complete[-1:]) | {p for p in complete if keep is not None and p.name == keep.name}
    excess = len(complete) - max(save_total_limit, len(protected))
    for old in complete:
        if excess <= 0:
            break
        if old not in protected:
            with critical():
                remove(old)
            excess -= 1


def keep_best_only(out: Path, best: Path) -> None:
    """save_total_limit 1 with load_best_model_at_end at the end of the run: the best checkpoint alone stays (the HF
    Trainer's _finalize_training removes the newest when it is not the best)."""
    for path in checkpoints(out):
        if path.name != best.name and incomplete_reason(path) is None:
            with critical():
                remove(path)


def _discard(tmp: Path) -> None:
    with critical():  # a further signal cannot leave half of it behind
        remove(tmp)


def stopped(out: Path, steps: int) -> str:
    """What a run that stops after `steps` steps says after its error: which checkpoint is intact, how to go on."""
    complete = [p.name for p in checkpoints(out) if incomplete_reason(p) is None]
    if not complete:
        return f"the run stopped after step {steps}, before its first checkpoint: start it again"
    return f"the run stopped after step {steps}; {complete[-1]} is intact: continue with resume_from_checkpoint=auto"


def _intact(out: Path, step: int) -> str:
    previous = [p.name for p in checkpoints(out) if p.name != f"{PREFIX}{step}" and incomplete_reason(p) is None]
    return f"; {previous[-1]} is intact" if previous else "; no earlier checkpoint"


def _cannot_write(out: Path, step: int, err: BaseException) -> WriteFailed:
    return WriteFailed(out / f"{PREFIX}{step}", reason(err),
                       f"the run stopped{_intact(out, step).replace('; ', ', ', 1)}; {rundir.CONTINUE}")


def _write_model(path: Path, model: PreTrainedModel, compute_dtype: torch.dtype) -> None:
    """The HF folder in the compute dtype, sharded with an index (config and generation config included), as
    save_pretrained lays it out (its tensor names and order, shard names, index; a tied weight once) but written
    shard by shard: each tensor is cast when its shard is written, so a save holds one shard's casts (and, for a
    model whose saved names differ from its own, as MoE experts, one layer's), never a cast copy of the whole model
    beside fp32 masters."""
    state = model.state_dict()
    total_bytes = sum(t.numel() for t in state.values()) * compute_dtype.itemsize  # a tied weight counted twice
    shard_bytes = min(SHARD_BYTES, max(1, total_bytes // 2 + 1))  # at least two shards: always an index
    sources = remove_tied_weights_from_state_dict({k: _unshared(v) for k, v in state.items()}, model)
    layout = revert_weight_conversion(model, {k: _meta(v, compute_dtype) for k, v in sources.items()})
    groups = _conversion_groups(model, sources, compute_dtype, layout)
    split = split_state_dict_into_shards_factory(  # sized by their own bytes: a meta view's storage is its base's
        layout, get_storage_size=lambda t: t.numel() * t.element_size(),
        filename_pattern="model{suffix}.safetensors", max_shard_size=shard_bytes)
    held: tuple[str | None, dict[str, torch.Tensor]] = (None, {})  # the converted group shards take tensors from
    for file, names in split.filename_to_tensors.items():
        shard = {}
        for name in names:
            group = groups.get(name)
            if group is None:  # saved under its own name: cast alone
                shard[name] = _unshared(sources[name].to(compute_dtype))
                continue
            if held[0] != group[0]:
                held = (group[0], {})  # the previous group's tensors go before this one's are made
                held = (group[0], revert_weight_conversion(
                    model, {k: sources[k].to(compute_dtype) for k in group[1]}))
            shard[name] = _unshared(held[1][name])
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
    index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
             "weight_map": split.tensor_to_filename}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    if model.can_generate():
        model.generation_config.save_pretrained(path)
    # config.json names the dtype of the weights beside it
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = str(compute_dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _meta(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t`'s shape in `dtype`, without its bytes: what the layout (names, sizes, shards) is planned from."""
    return torch.empty(t.shape, dtype=dtype, device="meta")


def _conversion_groups(model: PreTrainedModel, sources: dict[str, torch.Tensor], compute_dtype: torch.dtype,
                       layout: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[str]]]:
    """For each saved name that is not a parameter's own (transformers converts some on save, as fused MoE experts
    into one tensor per expert): the layer it is made from and that layer's parameter names. A conversion is
    reverted one layer at a time, so only one layer's converted tensors are held."""
    if layout.keys() == sources.keys():
        return {}
    by_layer: dict[str, list[str]] = {}
    for name in sources:
        match = re.match(r".*?\.layers\.\d+\.", name)
        by_layer.setdefault(match.group(0) if match else name, []).append(name)
    groups: dict[str, tuple[str, list[str]]] = {}
    for layer, names in by_layer.items():
        reverted = revert_weight_conversion(model, {k: _meta(sources[k], compute_dtype) for k in names})
        if reverted.keys() != set(names):
            groups.update((k, (layer, names)) for k in reverted)
    if not layout.keys() <= {*groups, *sources}:  # a conversion across layers: revert the model at once
        return dict.fromkeys(layout, ("", list(sources)))
    return groups


def _write_adapter(path: Path, model: PreTrainedModel, compute_dtype: torch.dtype) -> None:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors in the compute dtype) that
    `PeftModel.from_pretrained(base, path)` loads; its base is the model's own folder (base_model_name_or_path)."""
    tensors = {k: _unshared(v.to(compute_dtype)) for k, v in peft_tensors(model).items()}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(model, getattr(model.config, "_name_or_path", None) or None)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_trainer_state(path: Path, state: TrainerState, *, model: PreTrainedModel, compute_dtype: torch.dtype,
                         data_state: dict[str, object], plan: Plan, optimizer_doc: dict[str, Any],
                         hf_state: Mapping[str, object] | None, nvme: NvmeStates | None = None) -> None:
    """trainer_state.json and everything in trainer_state/ but the optimizer groups' files and the manifest."""
    state_dir = path / STATE_DIR
    if nvme is not None and nvme.offloaded_masters:  # the masters in the state files: copied from there
        nvme.save_masters(state_dir / "master.safetensors", model)
    elif any(p.dtype != compute_dtype or not p.requires_grad for p in model.parameters()):
        # the HF folder holds rounded copies (or a LoRA checkpoint only the adapters): keep the masters of what
        # trains (bf16 master weights of a full run are the HF folder's tensors themselves; frozen ones never change)
        save_file({k: _unshared(v) for k, v in dict(model.named_parameters()).items() if v.requires_grad},
                  str(state_dir / "master.safetensors"))
    rng_doc, rng_tensors = state_data.rng_states()
    save_file(rng_tensors, str(state_dir / "rng.safetensors"))
    for name, value in (("rng.json", rng_doc), ("data.json", data_state), ("trainer.json", asdict(state)),
                        ("optimizer.json", optimizer_doc)):
        (state_dir / name).write_text(jsonio.dumps(value, indent=1) + "\n")
    plan.save(state_dir / "plan.json")
    if hf_state is not None:
        (path / HF_STATE_FILE).write_text(jsonio.dumps(hf_state, indent=2) + "\n")


def _unshared(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, not copied, as a tensor with a storage of its own (through DLPack). The executor packs each
    layer's parameters in one buffer (with ranks, the node's shared mapping), and safetensors and save_pretrained
    refuse tensors that share a storage; a clone of every tensor would hold the model's size once more while the
    checkpoint is written (4 B/param on rank 0 in fp32)."""
    return torch.from_dlpack(t.detach().contiguous())


def _write_manifest(path: Path) -> None:
    """Every file's size and content hash (read back once, fsynced on the way), then the manifest itself."""
    files = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[str(p.relative_to(path))] = {"bytes": p.stat().st_size, "xxh3_128": file_hash(p)}
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(d)
    manifest = path / MANIFEST
    with open(manifest, "w") as f:
        f.write(json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


# =====================================================================================================
# loading
# =====================================================================================================
@dataclass
class Saved:
    """A checkpoint's JSON parts, read and checked (before anything of the run is touched or written)."""

    path: Path
    state: TrainerState
    data: dict[str, object]
    optimizer: dict[str, Any]
    rng: dict[str, Any]


def read_checkpoint(path: Path, *, optimizer_kind: str, world_size: int, batches_per_step: int) -> Saved:
    """The JSON parts of checkpoint `path` (its files already matched the manifest), checked against what the run
    can resume: its world size, optimizer and (a corpus's) data position, `batches_per_step` (micro-batches) a step.
    One line naming the checkpoint when they do not fit."""
    state_dir = path / STATE_DIR
    try:
        docs = {name: json.loads((state_dir / f"{name}.json").read_text())
                for name in ("trainer", "data", "optimizer", "rng")}
        saved = Saved(path, TrainerState.from_json(docs["trainer"]), docs["data"], docs["optimizer"], docs["rng"])
        if not isinstance(saved.data, dict) or not isinstance(saved.rng, dict) or not isinstance(saved.optimizer,
                                                                                                   dict):
            raise state_data.BadState("data.json, rng.json and optimizer.json must each hold a mapping")
        if saved.optimizer.get("kind") != optimizer_kind:
            raise state_data.BadState(f"it was written with optimizer {saved.optimizer.get('kind')!r} and this run "
                                       f"has {optimizer_kind!r}; resume with optimizer {saved.optimizer.get('kind')}")
        check_world_size(saved.data, world_size)
        check_batches_drawn(saved.data, saved.state.step * batches_per_step)
    except READ_ERRORS as err:
        raise _unreadable(path, err) from None
    return saved


def load_checkpoint(saved: Saved, *, model: PreTrainedModel, optimizer: torch.optim.Optimizer, optimizer_kind: str,
                    owned: set[int] | None = None, nvme: NvmeStates | None = None
                    ) -> tuple[TrainerState, dict[str, object]]:
    """Put a checkpoint's master weights into `model` (in place: the executor's buffers stay the parameters), its
    optimizer states into `optimizer` (with `owned`: the files of this rank's groups only) and restore the RNG
    states; every tensor is checked (shape, finite) before it is used. Returns the trainer state and data state.
    `nvme` (optimizer_offload nvme): the groups' states and the offloaded masters are copied into its files
    instead (train/offload.py; a checkpoint of either kind of run)."""
    path, state_dir = saved.path, saved.path / STATE_DIR
    try:
        _load_weights(path, model, skip=set() if nvme is None else nvme.offloaded_masters)
        params = state_data.params_by_index(optimizer)
        tensors: dict[str, torch.Tensor] = {}
        for name, indices in state_data.group_params(optimizer).items():
            if (owned is None or all(id(params[i]) in owned for i in indices)) and (nvme is None or
                                                                                   name not in nvme.groups):
                tensors.update(_into_held_states(optimizer, params, load_file(
                    str(state_dir / "optimizer" / f"{name}.safetensors"))))
        state_data.load_optimizer(optimizer, optimizer_kind, saved.optimizer, tensors)
        if nvme is not None:
            nvme.load(path)
        state_data.set_rng_states(saved.rng, load_file(str(state_dir / "rng.safetensors")))
    except READ_ERRORS as err:
        raise _unreadable(path, err) from None
    return saved.state, saved.data


def _into_held_states(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], loaded: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """A group file's tensors copied into the states the optimizer already holds (8bit and hybrid8bit make theirs
    when built), so that a resume holds the states once plus one group file, not twice; one that fits no held state
    (AdamW's lazy moments; a wrong shape or dtype, which load_optimizer refuses) stays as loaded."""
    out = {}
    for name, t in loaded.items():
        head, _, key = name.partition(".")
        p = params[int(head)] if head.isdigit() and int(head) < len(params) else None
        held = optimizer.state.get(p, {}).get(key) if p is not None else None
        if isinstance(held, torch.Tensor) and held.shape == t.shape and held.dtype == t.dtype:
            out[name] = held.copy_(t)
        else:
            out[name] = t
    return out


def _load_weights(path: Path, model: PreTrainedModel, skip: set[str]) -> None:
    """The masters (or the HF folder's tensors where they are the masters) into the parameters, each checked (shape,
    dtype: never cast; finite); but those in `skip` (offloaded masters: train/offload.py loads them into their
    files). With master.safetensors the run resumes from it, and the HF folder beside it, which from_pretrained
    loads, must be the masters' rounding: finite, and bit for bit what rounding them gives."""
    master = path / STATE_DIR / "master.safetensors"
    shards = sorted(path.glob("*.safetensors"))
    # frozen parameters are the model's own (they never change): only what trains is in a checkpoint
    params = {n: p for n, p in model.named_parameters() if n not in skip and p.requires_grad}
    loaded: set[str] = set()
    with torch.no_grad():
        for file in [master] if master.exists() else shards:
            for name, t in _tensors(file, params):
                p = params[name]
                if t.shape != p.shape or t.dtype != p.dtype:
                    raise state_data.BadState(f"{file.name}'s {name} is {tuple(t.shape)} {t.dtype}, the model's "
                                               f"{tuple(p.shape)} {p.dtype} (a damaged or edited checkpoint)")
                p.copy_(t)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise state_data.BadState(f"it has no weights for {missing[0]} (and {len(missing) - 1} more); it was "
                                       "saved from another model: resume with the run's own model")
        if master.exists():
            for file in shards:
                for name, t in _tensors(file, params):
                    if t.shape != params[name].shape or not torch.equal(t, params[name].to(t.dtype)):
                        raise state_data.BadState(
                            f"{file.name}'s {name} is not the rounding of master.safetensors' {name} to {t.dtype}: "
                            "the HF folder (what from_pretrained loads) and the masters (what the run resumes "
                            "from) differ; the checkpoint is damaged: resume from another one")


def _tensors(file: Path, params: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file that name a parameter in `params`, each checked finite (every tensor is
    read: a non-finite one that is no parameter, a buffer, is refused too)."""
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
            t = f.get_tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise state_data.BadState(f"{file.name}'s {name} holds NaN or infinite values (a diverged or "
                                           "damaged checkpoint)")
            if name in params:
                yield name, t


def _unreadable(path: Path, err: BaseException) -> LazyTrainError:
    if isinstance(err, LazyTrainError) and not isinstance(err, state_data.BadState):
        return err
    why = str(err) if isinstance(err, state_data.BadState) else f"{type(err).__name__}: {reason(err)}"
    return LazyTrainError(f"checkpoint {path} cannot be resumed: {why}")

