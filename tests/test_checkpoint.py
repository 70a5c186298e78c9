"""Checkpoints (Contract 5, docs/architecture.md): the layout, exact resume (also after SIGKILL), truncated
checkpoints, rotation, a failed save that leaves the previous checkpoint intact, and the output-directory rules."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors import SafetensorError, safe_open
from tiny_models import make_model

from lazytrain.cli import main
from lazytrain.config import load_job_config
from lazytrain.train import checkpoint as checkpoint_module
from lazytrain.train import train
from lazytrain.train.checkpoint import incomplete_reason
from lazytrain.train.metrics import read_rows

RNG = random.Random(20261203)
# fp32 and a rule plan: the executor is exact and no solver is involved, so runs compare to 1e-6.
BASE = dict(model="debug", corpus="zen", batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, dtype="fp32",
            planner="megatrain", eval_batches=0, progress=False)
ARGV = ["--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32", "--dtype", "fp32",
        "--planner", "megatrain", "--eval-batches", "0", "--no-progress"]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_rows(out / "metrics.jsonl")}


def _run(**values: object):
    return train(load_job_config({**BASE, **values}))


def test_checkpoint_layout_and_what_from_pretrained_loads(tmp_path):
    seed = RNG.randrange(1000)
    result = _run(steps=3, save_steps=2, dtype="bf16", seed=seed, output_dir=str(tmp_path / "run"))
    ck = tmp_path / "run" / "checkpoint-3"
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {"checkpoint-2", "checkpoint-3", "metrics.jsonl",
                                                               "summary.json", "plan.json"}
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded
    assert (ck / "generation_config.json").exists()
    state = ck / "trainer_state"
    assert {p.name for p in state.iterdir()} == {"master.safetensors", "optimizer.json", "optimizer", "rng.json",
                                                 "rng.safetensors", "data.json", "trainer.json", "plan.json",
                                                 "manifest.json"}
    # one optimizer file per layer group, its tensors named <param index>.<state key>
    assert sorted(p.name for p in (state / "optimizer").iterdir()) == sorted(
        f"{g}.safetensors" for g in ["embedding", "layer0", "layer1", "layer2", "layer3", "head"])
    with safe_open(str(state / "optimizer" / "layer0.safetensors"), framework="pt") as f:
        assert all(re.fullmatch(r"\d+\.(exp_avg|exp_avg_sq)", k) for k in f.keys()) and len(list(f.keys())) > 0
    optimizer = json.loads((state / "optimizer.json").read_text())
    assert optimizer["kind"] == "adamw" and all(s["step"] == {"dtype": "float32", "value": 3.0}
                                                for s in optimizer["scalars"].values())
    assert json.loads((state / "trainer.json").read_text())["step"] == 3
    assert json.loads((ck / "trainer_state.json").read_text())["global_step"] == 3
    manifest = json.loads((state / "manifest.json").read_text())["files"]
    assert set(manifest) == {str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file()} - {
        "trainer_state/manifest.json"}
    assert all(len(entry["xxh3_128"]) == 32 for entry in manifest.values())
    assert incomplete_reason(ck) is None
    # the HF folder is in the compute dtype and loads; the masters are the trainer's fp32 weights
    loaded = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype="auto")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    trained = dict(result.model.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, trained[name].to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.exactness
def test_exported_fp32_checkpoint_gives_the_trainers_logits(tmp_path):
    result = _run(steps=2, output_dir=str(tmp_path / "run"), seed=RNG.randrange(1000))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2")
    gen = torch.Generator().manual_seed(RNG.randrange(2**31))
    ids = torch.randint(0, 256, (2, RNG.randrange(5, 30)), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, result.model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.exactness
@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("8bit", marks=pytest.mark.slow)])
def test_resume_continues_exactly(tmp_path, optimizer):
    """Stop after 3 of 6 steps (a checkpoint at 3), resume with auto: every later loss equals the uninterrupted
    run's; the resumed run's metrics.jsonl holds every step once."""
    whole = _run(steps=6, optimizer=optimizer, output_dir=str(tmp_path / "whole"))
    out = tmp_path / "parts"
    _run(steps=6, optimizer=optimizer, save_steps=3, output_dir=str(out))
    shutil.rmtree(out / "checkpoint-6")  # as if the run had died after step 3's checkpoint
    resumed = _run(steps=6, optimizer=optimizer, save_steps=3, output_dir=str(out), resume_from_checkpoint="auto")
    # the same kernels on the same numbers in the same order as the run never stopped: equal, not close
    assert resumed.losses == whole.losses
    assert list(_losses(out)) == list(range(1, 7))  # steps count from 1
    assert [_losses(out)[s] for s in range(1, 7)] == whole.losses
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(b, a)


def test_a_resume_loads_the_states_into_those_the_optimizer_holds(tmp_path, monkeypatch):
    """8-bit states exist from the optimizer's making: a resume copies each group file into them (the states once
    plus one file in memory) instead of holding every loaded state beside them until load_state_dict swaps; and
    the resumed step is the uninterrupted one's."""
    from lazytrain.train import state_data

    whole = _run(steps=3, optimizer="8bit", output_dir=str(tmp_path / "whole"))
    out = tmp_path / "parts"
    _run(steps=3, optimizer="8bit", save_steps=2, output_dir=str(out))
    shutil.rmtree(out / "checkpoint-3")
    real, given = state_data.load_optimizer, []

    def load_optimizer(opt, kind, saved, tensors):
        held = {t.data_ptr() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0}
        given.extend(t.data_ptr() in held for t in tensors.values() if t.dim() > 0)
        return real(opt, kind, saved, tensors)

    monkeypatch.setattr(state_data, "load_optimizer", load_optimizer)
    resumed = _run(steps=3, optimizer="8bit", save_steps=2, output_dir=str(out), resume_from_checkpoint="auto")
    assert given and all(given), f"{given.count(False)} of {len(given)} loaded states are second copies"
    assert resumed.losses == pytest.approx(whole.losses, rel=0, abs=1e-6)


@pytest.mark.exactness
def test_two_identical_runs_write_identical_checkpoints(tmp_path):
    """Every generator a checkpoint saves (Python's `random`, numpy's global one, torch's) is seeded from `seed`:
    two runs of one job write the same tensors (weights, masters, optimizer states), data position and RNG files,
    byte for byte. Python's and numpy's were saved but never seeded, so rng.json differed from run to run (and
    from what the previous run in this process left behind)."""
    seed = RNG.randrange(1000)
    for k, name in enumerate(("a", "b")):
        random.seed(k)  # whatever state they were in before a run (a fresh process: from os.urandom) must not show
        np.random.seed(k)
        _run(steps=2, dtype="bf16", seed=seed, output_dir=str(tmp_path / name))
    a, b = tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2"
    compared = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.suffix == ".safetensors" or p.name in (
        "data.json", "rng.json"))
    assert {"trainer_state/rng.json", "trainer_state/rng.safetensors", "trainer_state/data.json",
            "trainer_state/master.safetensors"} <= set(compared) and len(compared) > 6
    assert [n for n in compared if (a / n).read_bytes() != (b / n).read_bytes()] == []


@pytest.mark.exactness
@pytest.mark.slow  # three runs, one a subprocess: ~20 s on 2 idle cores, ~60 s on a loaded machine
def test_sigkill_after_the_first_checkpoint_then_auto_resume_gives_the_same_losses(tmp_path):
    steps = 12
    whole = tmp_path / "whole"
    assert main(["train", *ARGV, "--steps", str(steps), "--output-dir", str(whole)]) == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-c", "import sys; from lazytrain.cli import main; sys.exit(main(sys.argv[1:]))",
           "train", "save_steps=2", *ARGV, "--steps", str(steps), "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-2").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (out / f"checkpoint-{steps}").exists()
    assert main(["train", "save_steps=2", "resume_from_checkpoint=auto", *ARGV, "--steps", str(steps),
                 "--output-dir", str(out)]) == 0
    expected, got = _losses(whole), _losses(out)
    assert list(got) == list(range(1, steps + 1))  # steps count from 1
    assert got == expected  # bit for bit: the resumed process runs the same kernels in the same order


def test_a_truncated_checkpoint_is_skipped_by_auto_and_refused_by_name(tmp_path, capsys):
    out = tmp_path / "run"
    _run(steps=4, save_steps=2, output_dir=str(out))
    shard = sorted((out / "checkpoint-4").glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    capsys.readouterr()
    assert main(["train", "resume_from_checkpoint=auto", *ARGV, "--steps", "4", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    note = [line for line in printed.splitlines() if "skipping" in line]
    assert len(note) == 1 and "checkpoint-4" in note[0] and "truncated" in note[0]
    assert "resume   from" in printed and "checkpoint-2" in printed
    assert incomplete_reason(out / "checkpoint-4") is None  # written again, whole

    with open(shard, "r+b") as f:
        f.truncate(10)
    assert main(["train", f"resume_from_checkpoint={out / 'checkpoint-4'}", *ARGV, "--steps", "4",
                 "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: resume_from_checkpoint ") and "\n" not in err and "not a complete checkpoint" in err


def test_save_total_limit_keeps_the_newest(tmp_path):
    out = tmp_path / "run"
    _run(steps=5, save_steps=1, save_total_limit=2, output_dir=str(out))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    assert not list(out.glob(".tmp-*"))


FULL_DISK = {  # what each writer raises on a full disk
    "OSError": OSError(28, "No space left on device"),
    "SafetensorError": SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                                       "\"No space left on device\" })"),
    "RuntimeError": RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: No space left "
                                 "on device"),
}


@pytest.mark.parametrize("error", list(FULL_DISK))
def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, capsys, error):
    """Whatever the writer raises on a full disk, the run stops in one line naming the intact checkpoint and how to
    continue, with no temporary left; `auto` then resumes from the intact one."""
    out = tmp_path / "run"
    real_save = checkpoint_module.save_file

    def full_disk(tensors, path, *args, **kwargs):
        if "checkpoint-4" in str(path) and "layer1" in str(path):
            raise FULL_DISK[error]
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_file", full_disk)
    assert main(["train", *ARGV, "--steps", "4", "save_steps=2", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.fullmatch(
        r"error: cannot write .*checkpoint-4 \(No space left on device\); the run stopped, checkpoint-2 is intact; "
        r"free disk space .*, then continue with resume_from_checkpoint=auto", err), err
    assert incomplete_reason(out / "checkpoint-2") is None
    assert not (out / "checkpoint-4").exists() and not list(out.glob(".*tmp*"))
    monkeypatch.undo()
    assert main(["train", *ARGV, "--steps", "4", "save_steps=2", "resume_from_checkpoint=auto",
                 "--output-dir", str(out)]) == 0
    assert "resume   from" in capsys.readouterr().out and incomplete_reason(out / "checkpoint-4") is None


def test_a_non_empty_output_dir_is_refused_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["train", *ARGV, "--steps", "1", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: output_dir ") and "\n" not in err and "overwrite_output_dir" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert main(["train", "overwrite_output_dir=true", *ARGV, "--steps", "1", "--output-dir", str(out)]) == 0
    assert (out / "checkpoint-1").is_dir() and (out / "notes.txt").read_text() == "mine"


def test_resume_from_a_named_missing_checkpoint_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "checkpoint-3"
    assert main(["train", f"resume_from_checkpoint={missing}", *ARGV, "--steps", "1",
                 "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no such directory" in err and "\n" not in err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3_moe"])  # qwen2: a tied head; qwen3_moe: experts saved
def test_a_save_holds_one_shard_of_casts_not_the_model(tmp_path, kind, monkeypatch):  # one tensor each
    """With fp32 masters the HF folder is bf16: each shard's tensors are cast when it is written, so while a shard
    is written the bf16 tensors alive are that shard's (and, where the saved names are converted, one layer's),
    never a bf16 copy of the whole model. Counted at every write: the distinct bf16 buffers in memory that Python
    can reach."""
    import gc
    import warnings

    model = make_model(kind, num_layers=6, seed=RNG.randrange(1000))
    total_bytes = sum(p.numel() for p in model.parameters()) * 2
    monkeypatch.setattr(checkpoint_module, "SHARD_BYTES", total_bytes // 6)  # about six shards
    layer_bytes = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers) * 2
    # a converted layer is held as its casts and the tensors reverted from them: twice its bytes at most
    held_bytes = 2 * layer_bytes if kind == "qwen3_moe" else 0
    writes = []
    real_save = checkpoint_module.save_file

    def bf16_buffers() -> dict[int, int]:
        with warnings.catch_warnings():  # (isinstance on every object reaches deprecated torch aliases)
            warnings.simplefilter("ignore", FutureWarning)
            return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
                    if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu"}

    # bf16 tensors other tests left alive in this process are not the save's: only buffers made since count
    before = bf16_buffers()

    def counting_save(tensors, filename, metadata=None):
        alive = {ptr: size for ptr, size in bf16_buffers().items() if ptr not in before}
        writes.append((sum(t.numel() * 2 for t in tensors.values()), sum(alive.values())))
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint_module, "save_file", counting_save)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", counting_save)
    checkpoint_module._write_model(tmp_path, model, torch.bfloat16)
    monkeypatch.undo()
    assert len(writes) >= 4
    for shard_bytes, alive_bytes in writes:
        assert alive_bytes <= shard_bytes + held_bytes < total_bytes
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a tied head (the export keeps one copy)
def test_the_export_writes_packed_parameters_without_a_copy(tmp_path, kind, monkeypatch):
    """The executor (and, with ranks, the node's shared mapping) packs a layer's parameters in one buffer, which
    safetensors refuses to write as it is: the export aliases each parameter instead of cloning the model (a clone
    held 4 B/param more on rank 0 while the checkpoint was written) and writes the parameters' values."""
    model = make_model(kind, num_layers=2, seed=RNG.randrange(1000))
    params = list(model.parameters())
    packed = torch.empty(sum(p.numel() for p in params))
    offset = 0
    with torch.no_grad():
        for p in params:  # every parameter a view of one buffer, as `WeightGroup` packs a layer's
            p.data = packed[offset:offset + p.numel()].view_as(p).copy_(p)
            offset += p.numel()
    clones = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(t.shape) or real_clone(t, *a, **k))
    checkpoint_module._write_model(tmp_path, model, torch.float32)
    monkeypatch.undo()
    assert clones == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)
