"""A checkpoint is data: nothing in it is executed, every file is checked against its manifest (size and content
hash) before it is read, its values are checked against the run, and whatever is wrong is one line naming the
checkpoint -- never a traceback, never a silent start from scratch. (The layout and exact resume:
test_checkpoint.py.)"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import cli_error
from safetensors.torch import load_file, save_file

from lazytrain.cli import main
from lazytrain.train.checkpoint import MANIFEST, file_hash
from lazytrain.train.rundir import LOCK

ARGV = ["--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32", "--dtype", "fp32",
        "--planner", "megatrain", "--eval-batches", "0", "--no-progress"]
SRC = Path(__file__).parents[1] / "src" / "lazytrain"


class Payload:
    """Unpickling it creates `path`: the proof that a file was executed."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _train(out: Path, *words: str) -> int:
    return main(["train", *ARGV, *words, "--output-dir", str(out)])


def _files(out: Path) -> dict[str, tuple[int, bytes]]:
    """The run's files (not its lock: every run that claims the directory writes its pid there), with contents."""
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir() if p.is_file() and p.name != LOCK}


def _reseal(checkpoint: Path) -> None:
    """Rewrite the manifest to match the files as they are now (what an attacker who edits a checkpoint does)."""
    files = {str(p.relative_to(checkpoint)): {"bytes": p.stat().st_size, "xxh3_128": file_hash(p)}
             for p in sorted(checkpoint.rglob("*")) if p.is_file() and p != checkpoint / MANIFEST}
    (checkpoint / MANIFEST).write_text(json.dumps({"format": 2, "files": files}))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 3-step run with checkpoints at 2 and 3 (bf16 masters off: fp32, so the masters are the shards)."""
    out = tmp_path_factory.mktemp("trust") / "run"
    assert _train(out, "--steps", "3", "save_steps=2") == 0
    return out


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> Path:
    """A 2-step run in bf16 compute: fp32 masters in trainer_state/master.safetensors, the HF folder their bf16
    rounding."""
    out = tmp_path_factory.mktemp("trust-bf16") / "run"
    assert _train(out, "--steps", "2", "--dtype", "bf16") == 0
    assert (out / "checkpoint-2" / "trainer_state" / "master.safetensors").exists()
    return out


def _copy(run: Path, tmp_path: Path, step: int = 3) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(run, out)
    return out / f"checkpoint-{step}"


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_pickle_payload_in_any_file_of_a_checkpoint_is_never_executed(run, tmp_path, capsys, every):
    """Every file of a checkpoint in turn (the manifest included) replaced by a pickle that would create a file
    when unpickled (raw, which torch.load(weights_only=False) also runs; with -m slow torch.save's zip too), the
    manifest resealed to match: resuming from it never runs it. Files the resume reads are refused in one line;
    the others (the HF folder's config files) are not read as pickles either. The default suite covers the files
    the resume reads; -m slow every file. The old format's `state.pt` / `optimizer.pt` are refused unread."""
    names = sorted(str(p.relative_to(run / "checkpoint-3")) for p in (run / "checkpoint-3").rglob("*") if p.is_file())
    assert len(names) > 10 and MANIFEST in names
    marker = tmp_path / "executed"
    payloads = {"pickle": pickle.dumps(Payload(marker))}
    torch.save(Payload(marker), tmp_path / "zip.pt")
    if every:
        payloads["torch.save"] = (tmp_path / "zip.pt").read_bytes()
    else:
        names = [n for n in names if n.startswith("trainer_state/")] + [n for n in names if n.startswith("model-")][:1]
    refused = set()
    for i, name in enumerate(names):
        for kind, payload in payloads.items():
            out = tmp_path / f"{i}-{kind}"
            shutil.copytree(run, out)
            checkpoint = out / "checkpoint-3"
            (checkpoint / name).write_bytes(payload)
            if name != MANIFEST:
                _reseal(checkpoint)
            code = _train(out, "--steps", "3", "resume_from_checkpoint=auto")
            assert not marker.exists(), f"{name} ({kind}) was executed"
            if code == 2:
                cli_error(capsys)
                refused.add(name)
            else:
                assert code == 0, name
            capsys.readouterr()
    assert {n for n in names if n.startswith("trainer_state/") and n != MANIFEST} <= refused
    assert {n for n in names if n.endswith(".safetensors")} <= refused
    # the old format: pickled state.pt / optimizer.pt, refused in one line before anything is read
    old = _copy(run, tmp_path / "old")
    for name in ("state.pt", "optimizer.pt"):
        (old / "trainer_state" / name).write_bytes((tmp_path / "zip.pt").read_bytes())
    shutil.rmtree(old.parent / "checkpoint-2")
    assert _train(old.parent, "--steps", "3", f"resume_from_checkpoint={old}") == 2
    assert "old format (pickled state.pt / optimizer.pt), which cannot be read safely" in cli_error(capsys)
    assert _train(old.parent, "--steps", "3", "resume_from_checkpoint=auto") == 2
    assert "no usable checkpoint" in cli_error(capsys) and not marker.exists()


def test_no_loader_that_can_unpickle_in_the_package():
    """The load paths read safetensors and JSON only: nothing in src/ calls a loader that can run pickled code."""
    found = []
    pattern = re.compile(r"torch\.load\(|pickle\.loads?\(|np\.load\(|numpy\.load\(|allow_pickle|weights_only\s*=\s*"
                         r"False|joblib|dill|cloudpickle|marshal\.loads?\(")
    for path in SRC.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                found.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert found == []


def _header_offset(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize("target", ["weights", "optimizer", "trainer.json", "rng", "data.json", "plan.json"])
def test_same_size_damage_is_caught_by_the_content_hash(run, tmp_path, capsys, target):
    """A byte changed in place (same size: the sizes match) in any file: the named checkpoint is refused naming the
    file; `auto` skips it with a note and resumes from the previous one (never from scratch)."""
    checkpoint = _copy(run, tmp_path)
    path = {"weights": next(checkpoint.glob("model-*.safetensors")), "rng": checkpoint / "trainer_state" /
            "rng.safetensors", "optimizer": checkpoint / "trainer_state" / "optimizer" / "layer1.safetensors"}.get(
        target, checkpoint / "trainer_state" / target)
    data = bytearray(path.read_bytes())
    at = _header_offset(path) + 3 if path.suffix == ".safetensors" else len(data) // 2
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    assert _train(checkpoint.parent, "--steps", "3", f"resume_from_checkpoint={checkpoint}") == 2
    err = cli_error(capsys)
    assert f"{path.relative_to(checkpoint)}'s content differs from the manifest's hash" in err
    assert _train(checkpoint.parent, "--steps", "3", "resume_from_checkpoint=auto") == 0
    printed = capsys.readouterr().out
    assert "skipping" in printed and "checkpoint-2" in printed.split("resume   from")[1].splitlines()[0]


def test_non_finite_weights_are_refused_at_resume(run, tmp_path, capsys):
    """NaN written into a checkpoint's weights (manifest resealed): refused naming the tensor, before a step runs
    or a file is written."""
    checkpoint = _copy(run, tmp_path)
    shard = next(checkpoint.glob("model-*.safetensors"))
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[1] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _reseal(checkpoint)
    before = _files(checkpoint.parent)
    assert _train(checkpoint.parent, "--steps", "4", f"resume_from_checkpoint={checkpoint}") == 2
    err = cli_error(capsys)
    assert f"{name} holds NaN or infinite values" in err and str(checkpoint) in err
    assert _files(checkpoint.parent) == before


@pytest.mark.parametrize("where", ["master.safetensors", "an HF shard that is the masters"])
def test_a_master_of_another_dtype_is_refused_not_cast(run, bf16_run, tmp_path, capsys, where):
    """A master weight turned to fp16 (manifest resealed): in master.safetensors (bf16 compute) or in the HF folder
    of an fp32 run (whose shards are the masters), refused naming the tensor and its dtype; it was cast back
    silently."""
    if where == "master.safetensors":
        checkpoint, words = _copy(bf16_run, tmp_path, step=2), ("--steps", "3", "--dtype", "bf16")
        file = checkpoint / "trainer_state" / "master.safetensors"
    else:
        checkpoint, words = _copy(run, tmp_path), ("--steps", "4")
        file = next(checkpoint.glob("model-*.safetensors"))
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.float16)
    save_file(tensors, str(file), metadata={"format": "pt"})
    _reseal(checkpoint)
    assert _train(checkpoint.parent, *words, f"resume_from_checkpoint={checkpoint}") == 2
    err = cli_error(capsys)
    assert f"{file.name}'s {name} is" in err and "torch.float16, the model's" in err and str(checkpoint) in err


@pytest.mark.parametrize("edit", ["nan", "another finite value"])
def test_an_hf_folder_that_is_not_the_masters_rounding_is_refused(bf16_run, tmp_path, capsys, edit):
    """bf16 compute: the run resumes from master.safetensors, and from_pretrained loads the HF folder beside it. A
    NaN in a shard, or a finite value that is not the master's rounding (masters untouched, manifest resealed), is
    refused naming which file says what; resume said nothing and the exported model was not the run's."""
    checkpoint = _copy(bf16_run, tmp_path, step=2)
    shard = next(checkpoint.glob("model-*.safetensors"))
    tensors = load_file(shard)
    name = sorted(n for n in tensors if tensors[n].dim() == 2)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = float("nan") if edit == "nan" else tensors[name].view(-1)[3] * 2 + 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _reseal(checkpoint)
    before = _files(checkpoint.parent)
    assert _train(checkpoint.parent, "--steps", "3", "--dtype", "bf16", f"resume_from_checkpoint={checkpoint}") == 2
    err = cli_error(capsys)
    assert f"{shard.name}'s {name}" in err and str(checkpoint) in err
    assert ("NaN or infinite" in err) if edit == "nan" else ("not the rounding of master.safetensors'" in err)
    assert _files(checkpoint.parent) == before


@pytest.mark.parametrize("edit", ["a wrong shape", "a foreign key", "a negative step", "rng garbage",
                                  "an unknown optimizer key", "json null"])
def test_hostile_values_with_a_matching_manifest_are_one_line(run, tmp_path, capsys, edit):
    """A checkpoint edited consistently (manifest resealed): values that do not fit the run are one line naming
    the checkpoint, never a traceback."""
    checkpoint = _copy(run, tmp_path)
    state = checkpoint / "trainer_state"
    if edit == "a wrong shape":
        group = state / "optimizer" / "layer0.safetensors"
        tensors = load_file(group)
        key = sorted(tensors)[0]
        tensors[key] = torch.zeros(3)
        save_file(tensors, str(group))
    elif edit == "a foreign key":
        group = state / "optimizer" / "head.safetensors"
        save_file({**load_file(group), "999.exp_avg": torch.zeros(2)}, str(group))
    elif edit == "a negative step":
        doc = json.loads((state / "trainer.json").read_text())
        (state / "trainer.json").write_text(json.dumps({**doc, "step": -4}))
    elif edit == "rng garbage":
        doc = json.loads((state / "rng.json").read_text())
        doc["python"]["state"] = doc["python"]["state"][:10]
        (state / "rng.json").write_text(json.dumps(doc))
    elif edit == "an unknown optimizer key":
        group = state / "optimizer" / "layer0.safetensors"
        tensors = load_file(group)
        key = sorted(tensors)[0]
        save_file({**tensors, key.split(".")[0] + ".momentum_buffer": tensors[key].clone()}, str(group))
    else:
        (state / "optimizer.json").write_text("null")
    _reseal(checkpoint)
    assert _train(checkpoint.parent, "--steps", "4", f"resume_from_checkpoint={checkpoint}") == 2
    assert f"checkpoint {checkpoint} cannot be resumed" in cli_error(capsys)


@pytest.mark.parametrize("consumed", [10**30, 5, "6"])
def test_a_data_position_that_does_not_fit_the_step_is_refused_not_walked_to(run, tmp_path, consumed):
    """data.json's position (a corpus: batches drawn) edited and the manifest resealed: 10**30 made the resume draw
    that many batches; any position but the step's batches (step 3 x 1 micro-batch) is refused in one line, exit 2,
    within seconds (a subprocess, so that a hang fails the test instead of stalling it)."""
    checkpoint = _copy(run, tmp_path)
    (checkpoint / "trainer_state" / "data.json").write_text(json.dumps({"consumed": consumed}))
    _reseal(checkpoint)
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", *ARGV, "--steps", "4",
                           f"resume_from_checkpoint={checkpoint}", "--output-dir", str(checkpoint.parent)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "is not the 3 batches its step drew" in done.stderr, done.stderr


def test_auto_never_starts_over_on_top_of_damaged_checkpoints(run, tmp_path, capsys):
    """Every checkpoint fails its check: `auto` refuses (it deleted metrics.jsonl and started from step 0 before),
    leaving the run's files as they were; with overwrite_output_dir it starts over, as asked."""
    out = _copy(run, tmp_path).parent
    for checkpoint in out.glob("checkpoint-*"):
        shard = next(checkpoint.glob("model-*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    before = _files(out)
    assert _train(out, "--steps", "3", "resume_from_checkpoint=auto") == 2
    err = cli_error(capsys)
    assert "no usable checkpoint" in err and "overwrite_output_dir" in err
    assert _files(out) == before
    # overwrite_output_dir says the run may start over: auto then does, deleting the damaged checkpoints
    assert _train(out, "--steps", "1", "resume_from_checkpoint=auto", "overwrite_output_dir=true") == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]


@pytest.mark.parametrize("refusal", ["optimizer", "world size"])
def test_a_refused_resume_writes_nothing(run, tmp_path, capsys, refusal):
    """A resume refused for another optimizer (it was a KeyError 'eightbit' traceback) or another world size
    leaves plan.json, train_config.json and metrics.jsonl as they were (every refusal comes before the first
    write: the data loader's, for another dataset or seed, too)."""
    out = _copy(run, tmp_path).parent
    words = {"optimizer": ["optimizer=8bit"], "world size": []}[refusal]
    if refusal == "world size":
        doc = json.loads((out / "checkpoint-3" / "trainer_state" / "data.json").read_text())
        (out / "checkpoint-3" / "trainer_state" / "data.json").write_text(json.dumps({**doc, "world_size": 2}))
        _reseal(out / "checkpoint-3")
    before = _files(out)
    assert _train(out, "--steps", "4", "resume_from_checkpoint=auto", *words) == 2
    err = cli_error(capsys)
    assert {"optimizer": "resume with optimizer adamw",
            "world size": "resume with torchrun --nproc_per_node 2"}[refusal] in err
    assert _files(out) == before
