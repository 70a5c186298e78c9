"""The output directory and checkpoints (Contract 5, docs/architecture.md): written whole or not at all, resumed
exactly.

    output_dir/checkpoint-<step>/
        config.json, generation_config.json        the model, in the compute dtype, that
        model-0000k-of-0000n.safetensors + index    AutoModelForCausalLM.from_pretrained loads
        tokenizer files (with the chat template)    when the run has an HF tokenizer
        trainer_state/
            master.safetensors    fp32 master weights (only when they are not the compute dtype)
            optimizer.pt          each optimizer's state_dict, as stored (8-bit codes and absmax scales);
                                  data parallel with g ranks per node: optimizer-<l>-of-<g>.pt, local rank l's
            state.pt              RNG states and the data loader's state
            trainer.json          step, schedule position, skip counters, losses so far (readable)
            plan.json             the plan the run executed
            manifest.json         every file of the checkpoint with its size, written last

A checkpoint is written under a temporary name (`.tmp-checkpoint-<step>`), every file and directory is
fsynced, and only then renamed into place, so a crash or a full disk never leaves a half-written
`checkpoint-<step>`, and the previous checkpoint stays intact. `resume_from_checkpoint: auto` takes the newest
checkpoint whose manifest matches its files (a truncated one is skipped with a one-line note); a named
checkpoint that does not match is a one-line error.

Data parallel (`ranks`): rank 0 writes everything but the other ranks' optimizer states, and each rank of node 0
writes its own states' shard into the same temporary directory at the same time, so no rank ever holds another's
states (the ranks of other nodes hold the same states as node 0's). Rank 0 writes the manifest and renames only
once every rank said its part is in: a rank lost or failing mid-write leaves no `checkpoint-<step>`. Resuming,
each rank reads its own shard.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from lazytrain.distributed.batches import check_world_size
from lazytrain.distributed.ranks import RankLost
from lazytrain.errors import LazyTrainError
from lazytrain.jsonio import dumps
from lazytrain.plan.plan import Plan
from lazytrain.train.metrics import say

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lazytrain.distributed.ranks import Ranks

PREFIX = "checkpoint-"
STATE_DIR = "trainer_state"
HF_STATE_FILE = "trainer_state.json"  # the HF Trainer's view of the run, beside the exact state (train/hf_state.py)
MANIFEST = f"{STATE_DIR}/manifest.json"
SHARD_BYTES = 2 << 30  # the HF folder's shard size: 2 GiB (the model is always written with an index)
RUN_FILES = ("metrics.jsonl", "summary.json", "plan.json", "train_config.json", "loss.png")


@dataclass
class TrainerState:
    """What a resumed run needs besides weights and optimizer states (JSON-able; `trainer.json`)."""

    step: int = 0  # optimizer steps taken (skipped non-finite steps included): the next step's index
    applied_steps: int = 0  # steps whose update was applied: the learning-rate schedule's position
    skipped_steps: int = 0  # non-finite steps skipped so far
    consecutive_skips: int = 0
    losses: list[float | None] = field(default_factory=list)  # per step (None: non-finite, skipped)
    step_times_s: list[float] = field(default_factory=list)


# =====================================================================================================
# the output directory
# =====================================================================================================
def check_output_dir(output_dir: str | None, *, resume: bool, overwrite: bool, default: Path) -> Path:
    """The output directory, checked before anything is read, built or written (nothing is written here): an
    existing non-empty one is refused unless the run resumes from it or `overwrite_output_dir` is set, and one
    that cannot be created or written is refused."""
    out = Path(output_dir) if output_dir else default
    if out.exists() and not out.is_dir():
        raise LazyTrainError(f"output_dir {out} is not a directory; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not resume and not overwrite:
        raise LazyTrainError(f"output_dir {out} already exists and is not empty; set resume_from_checkpoint auto to "
                             "continue its run, overwrite_output_dir true to replace it, or pick a new output_dir")
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "Not a directory" if not existing.is_dir() else "Permission denied"
        raise LazyTrainError(f"output_dir {out} is not writable ({why}: {existing}); pass a writable output_dir")
    return out


def make_output_dir(out: Path, *, overwrite: bool) -> None:
    """Create the output directory; with `overwrite_output_dir` a previous run's checkpoints and files go first
    (so `auto` can never pick a checkpoint of another run); other files stay."""
    if overwrite and out.is_dir():
        for old in out.iterdir():
            if old.name.startswith((PREFIX, f".tmp-{PREFIX}")) and old.is_dir():
                shutil.rmtree(old)
            elif old.name in RUN_FILES:
                old.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise LazyTrainError(f"output_dir {out} is not writable ({err.strerror}); pass a writable output_dir"
                             ) from None


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


def incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint (a missing manifest, a missing or truncated file), or None."""
    manifest = path / MANIFEST
    try:
        sizes: dict[str, int] = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return f"no readable {MANIFEST}"
    for name, size in sizes.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated)"
    return None


def resume_checkpoint(resume_from: str | None, out: Path) -> Path | None:
    """The checkpoint to resume from: None (a fresh run), the newest complete one in `out` (`auto`; a
    truncated one is skipped with a note), or the named one (refused when incomplete)."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        for path in reversed(checkpoints(out)):
            reason = incomplete_reason(path)
            if reason is None:
                return path
            say(f"note     skipping {path}: incomplete checkpoint ({reason})")
        return None
    path = Path(resume_from)
    if not path.is_dir():
        raise LazyTrainError(f"resume_from_checkpoint {path}: no such directory; name a checkpoint-<step> directory "
                             "or use auto")
    reason = incomplete_reason(path)
    if reason is not None:
        raise LazyTrainError(f"resume_from_checkpoint {path} is not a complete checkpoint ({reason}); name another "
                             "one or use auto (the newest complete one)")
    return path


# =====================================================================================================
# saving
# =====================================================================================================
def save_checkpoint(out: Path, state: TrainerState, *, model: PreTrainedModel, compute_dtype: torch.dtype,
                    optimizers: list[torch.optim.Optimizer], data_state: dict[str, object], plan: Plan,
                    tokenizer: PreTrainedTokenizerBase | None = None, save_total_limit: int | None = None,
                    ranks: Ranks | None = None, hf_state: Mapping[str, object] | None = None) -> Path:
    """Write `checkpoint-<state.step>` whole (temporary name, fsync, rename) and keep the newest
    `save_total_limit`. A failure (a full disk, a read-only directory) removes the partial copy and leaves
    every earlier checkpoint as it was. With `ranks` a collective (module docstring): `out` is rank 0's, the
    others learn the temporary directory from it; returns the checkpoint's path on every rank. `hf_state`: the
    content of trainer_state.json, the HF Trainer's view of the run (train/hf_state.py; rank 0's)."""
    main = ranks is None or ranks.is_main
    tmp = out / f".tmp-{PREFIX}{state.step}"
    error: LazyTrainError | None = None
    if ranks is not None:  # every rank finished the step (a lost rank stops it before a byte is written)
        ranks.barrier(f"the start of checkpoint {state.step}")
    if main:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / STATE_DIR).mkdir(parents=True)
        except OSError as err:
            error = _cannot_write(out, state.step, err)
            shutil.rmtree(tmp, ignore_errors=True)
    if ranks is not None:
        where = ranks.broadcast_object(None if error else str(tmp), f"the start of checkpoint {state.step}")
        if where is None:
            raise error or LazyTrainError(f"rank 0 could not start checkpoint {state.step} (its line says why)")
        tmp = Path(where)
    elif error is not None:
        raise error
    try:
        try:
            if main:
                _write_model(tmp, model, compute_dtype)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if hf_state is not None:
                    (tmp / HF_STATE_FILE).write_text(dumps(hf_state, indent=2) + "\n")
                _write_trainer_state(tmp / STATE_DIR, state, model=model, compute_dtype=compute_dtype,
                                     data_state=data_state, plan=plan)
            shard, shards = (0, 1) if ranks is None else (ranks.local_rank, ranks.local_world_size)
            if ranks is None or ranks.rank < ranks.local_world_size:  # node 0's ranks: one owner per parameter
                torch.save([opt.state_dict() for opt in optimizers], tmp / STATE_DIR / optimizer_file(shard, shards))
        except OSError as err:
            error = _cannot_write(tmp.parent, state.step, err)
        if ranks is None:
            if error is not None:
                raise error
            return _finish(out, tmp, state.step, save_total_limit)
        if not ranks.agree(error is None, f"writing checkpoint {state.step}"):  # every shard is in, or none counts
            raise error or LazyTrainError(f"checkpoint {state.step} abandoned: another rank could not write its part "
                                          "(its line says why)")
        return Path(ranks.decided_by_main(lambda: str(_finish(out, tmp, state.step, save_total_limit)),
                                          f"the end of checkpoint {state.step}"))
    except (LazyTrainError, RankLost):  # (RankLost: a rank died mid-write) nothing of this checkpoint stays
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def optimizer_file(shard: int, shards: int) -> str:
    """The optimizer states' file in trainer_state/: one process's (or one rank per node's) whole states, or local
    rank `shard`'s of `shards` (its own parameters' states; the others' only as the rank keeps them)."""
    return "optimizer.pt" if shards == 1 else f"optimizer-{shard}-of-{shards}.pt"


def _finish(out: Path, tmp: Path, step: int, save_total_limit: int | None) -> Path:
    """Manifest (every file is in), fsync, rename into place; then keep the newest `save_total_limit`."""
    final = out / f"{PREFIX}{step}"
    try:
        _write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():  # the same step again (a resumed run that saved it before): replace it whole
            old = out / f".old-{PREFIX}{step}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(out)
    except OSError as err:
        raise _cannot_write(out, step, err) from None
    if save_total_limit is not None:
        complete = [p for p in checkpoints(out) if incomplete_reason(p) is None]
        for old in complete[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _cannot_write(out: Path, step: int, err: OSError) -> LazyTrainError:
    final = out / f"{PREFIX}{step}"
    previous = [p.name for p in checkpoints(out) if p != final and incomplete_reason(p) is None]
    kept = f"; {previous[-1]} is intact" if previous else ""
    return LazyTrainError(f"cannot write checkpoint {final} ({err.strerror or err}){kept}; free disk space or check "
                          "the output_dir's permissions")


def _write_model(path: Path, model: PreTrainedModel, compute_dtype: torch.dtype) -> None:
    """The HF folder in the compute dtype, sharded with an index (config and generation config included)."""
    state = {k: unshared(v.to(compute_dtype)) for k, v in model.state_dict().items()}
    total_bytes = sum(t.numel() * t.element_size() for t in state.values())
    shard_bytes = min(SHARD_BYTES, max(1, total_bytes // 2 + 1))  # at least two shards: always an index
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its progress bar is noise under ours
    try:
        model.save_pretrained(path, state_dict=state, max_shard_size=shard_bytes)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    # config.json names the dtype of the weights beside it (save_pretrained writes the fp32 masters' dtype)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = str(compute_dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_trainer_state(path: Path, state: TrainerState, *, model: PreTrainedModel, compute_dtype: torch.dtype,
                         data_state: dict[str, object], plan: Plan) -> None:
    """Everything in trainer_state/ but the optimizer states (`optimizer_file`) and the manifest."""
    if any(p.dtype != compute_dtype for p in model.parameters()):  # the HF folder holds rounded copies: keep the
        # fp32 masters (bf16 master weights are the HF folder's tensors themselves)
        masters = {k: unshared(v) for k, v in _unique_state(model).items()}
        save_file(masters, str(path / "master.safetensors"))
    torch.save({"data": data_state, "rng": rng_states()}, path / "state.pt")
    (path / "trainer.json").write_text(json.dumps(asdict(state), indent=1) + "\n")
    plan.save(path / "plan.json")


def unshared(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, not copied, as a tensor with a storage of its own (through DLPack). The executor packs each
    layer's parameters in one buffer (with ranks, the node's shared mapping), and safetensors and save_pretrained
    refuse tensors that share a storage; a clone of every tensor would hold the model's size once more while the
    checkpoint is written (4 B/param on rank 0 in fp32)."""
    return torch.from_dlpack(t.detach().contiguous())


def _write_manifest(path: Path) -> None:
    files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        _fsync_dir(d)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unique_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Parameters by name, each tensor once (a tied LM head is its embedding)."""
    return dict(model.named_parameters())


# =====================================================================================================
# loading
# =====================================================================================================
def load_checkpoint(path: Path, *, model: PreTrainedModel, compute_dtype: torch.dtype,
                    optimizers: list[torch.optim.Optimizer], ranks: Ranks | None = None
                    ) -> tuple[TrainerState, dict[str, object]]:
    """Put a checkpoint's master weights into `model` (in place: the executor's buffers stay the parameters)
    and its states into `optimizers` (with `ranks`: this rank's shard); restore the RNG states. A checkpoint of
    another world size is refused before anything is loaded. Returns the trainer state and the data state."""
    state_dir = path / STATE_DIR
    extra = torch.load(state_dir / "state.pt", weights_only=False)
    check_world_size(extra["data"], 1 if ranks is None else ranks.world_size)
    saved = torch.load(state_dir / _optimizer_file_of(path, ranks), weights_only=False)
    params = _unique_state(model)
    master = state_dir / "master.safetensors"
    files = [master] if master.exists() else sorted(path.glob("*.safetensors"))
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    if name in params:
                        params[name].copy_(f.get_tensor(name))
                        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise LazyTrainError(f"checkpoint {path} has no weights for {missing[0]} (and {len(missing) - 1} more); it "
                             "was saved from another model: resume with the run's own model")
    if len(saved) != len(optimizers):
        raise LazyTrainError(f"checkpoint {path} holds {len(saved)} optimizer states but this run has "
                             f"{len(optimizers)}; resume with the same optimizer and optimizer_mode")
    try:
        for opt, sd in zip(optimizers, saved, strict=True):
            opt.load_state_dict(sd)
    except (ValueError, KeyError, RuntimeError) as err:
        raise LazyTrainError(f"checkpoint {path}: its optimizer states do not fit this run's optimizer ({err}); "
                             "resume with the same optimizer") from None
    set_rng_states(extra["rng"])
    state = TrainerState(**json.loads((state_dir / "trainer.json").read_text()))
    return state, extra["data"]


def _optimizer_file_of(path: Path, ranks: Ranks | None) -> str:
    """This rank's optimizer file in checkpoint `path`: its shard, or the whole states (one process's, one rank per
    node's: every rank then drops the states of parameters it does not step); refused in one line when the
    checkpoint was sharded over another number of ranks per node."""
    whole = optimizer_file(0, 1)
    if ranks is None or (path / STATE_DIR / whole).exists():
        return whole
    mine = optimizer_file(ranks.local_rank, ranks.local_world_size)
    if not (path / STATE_DIR / mine).exists():
        shards = sorted(p.name for p in (path / STATE_DIR).glob("optimizer-*-of-*.pt"))
        saved = shards[0].removesuffix(".pt").rsplit("-", 1)[1] if shards else "?"
        raise LazyTrainError(f"checkpoint {path} holds the optimizer states of {saved} ranks per node and this run "
                             f"has {ranks.local_world_size}; resume with torchrun --nproc_per_node {saved}")
    return mine


def rng_states() -> dict[str, object]:
    states: dict[str, object] = {"python": random.getstate(), "numpy": np.random.get_state(),
                                 "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, object]) -> None:
    random.setstate(states["python"])  # type: ignore[arg-type]
    np.random.set_state(states["numpy"])  # type: ignore[arg-type]
    torch.set_rng_state(states["torch"])  # type: ignore[arg-type]
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])  # type: ignore[arg-type]
