"""optimizer_offload nvme (train/offload.py): the optimizer states, and fp32 masters under bf16 compute, live in
files under nvme_dir and are staged one layer group at a time for its update -- bit for bit the in-RAM run."""

from __future__ import annotations

import gc
import json
import math
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from checks import mount_tmpfs

from lazytrain.config import load_job_config
from lazytrain.runtime import store
from lazytrain.train import offload as offload_module
from lazytrain.train import train
from lazytrain.train import trainer as trainer_module

RNG = random.Random(20261207)
BASE = dict(model="debug", corpus="zen", batch_size=2, seq_len=32, lr=3e-3, warmup_steps=1, planner="megatrain",
            eval_batches=0, progress=False, max_grad_norm=1.0, seed=0, save_steps=0)


def _checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of a checkpoint (the HF folder, master.safetensors, each group's optimizer file: "file:name")
    and its optimizer.json."""
    from safetensors.torch import load_file

    tensors = {f"{f.relative_to(path)}:{k}": v for f in sorted(path.rglob("*.safetensors"))
               if "rng" not in f.name for k, v in load_file(str(f)).items()}
    return tensors, json.loads((path / "trainer_state" / "optimizer.json").read_text())


def _with_depth(mp: pytest.MonkeyPatch, depth: int) -> None:
    """Plans with `depth` staging slots. The planner picks one depth per job (the debug model's: the deepest, L);
    the lean bit-for-bit cases force 1..L so that every slot-reuse pattern of the program runs (D = 1 and 2 chain
    a write, the slot's next read and its update in one window)."""
    from dataclasses import replace

    from lazytrain.train import planning

    real = planning.planner.make_plan

    def make_plan(*args, **kwargs):
        plan = real(*args, **kwargs)
        return replace(plan, optimizer_offload="nvme", staging_depth=depth)

    mp.setattr(planning.planner, "make_plan", make_plan)


def _run(tmp_path, offload: str, *, bad_step: int | None, depth: int | None = None, **values):
    """Train with `values` (nvme: `depth` slots, None = the planner's); on `bad_step` (0-based) layer 1's landed
    gradient holds an inf. Returns the result and its final checkpoint's tensors and optimizer.json."""
    real_land = store.WeightGroup.land
    real_step = trainer_module.Trainer.train_step
    current: dict[str, int | None] = {"step": None}
    lanes: list[str] = []  # the thread of every state read and write

    def land(self, **kwargs):
        if self.name == "layer.1" and current["step"] is not None and current["step"] == bad_step:
            self.landing[RNG.randrange(self.landing.numel())] = math.inf
        return real_land(self, **kwargs)

    def train_step(self, index):
        current["step"] = index
        try:
            return real_step(self, index)
        finally:
            current["step"] = None

    real_read, real_write = offload_module.NvmeStates.read, offload_module.NvmeStates.write

    def read(self, index, slot=None):
        lanes.append(threading.current_thread().name)
        return real_read(self, index, slot)

    def write(self, index):
        lanes.append(threading.current_thread().name)
        return real_write(self, index)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offload_module.NvmeStates, "read", read)
        mp.setattr(offload_module.NvmeStates, "write", write)
        mp.setattr(store.WeightGroup, "land", land)
        mp.setattr(trainer_module.Trainer, "train_step", train_step)
        if offload == "nvme" and depth is not None:
            _with_depth(mp, depth)
        result = train(load_job_config({**BASE, **values, "optimizer_offload": offload,
                                        "output_dir": str(tmp_path / offload)}))
    result.summary["state_io_threads"] = lanes
    plan = json.loads((result.output_dir / "plan.json").read_text())
    assert plan["optimizer_offload"] == offload and (plan["staging_depth"] > 0) == (offload == "nvme"), plan
    return result, _checkpoint(result.output_dir / f"checkpoint-{len(result.losses)}")


def _check_identical(tmp_path, steps: int, bad_step: int | None, depth: int | None = None, **values) -> None:
    values["seed"] = RNG.randrange(1 << 31)  # a fresh model, data order and injected inf per case
    host, host_final = _run(tmp_path, "host", bad_step=bad_step, steps=steps, **values)
    nvme, nvme_final = _run(tmp_path, "nvme", bad_step=bad_step, steps=steps, depth=depth, **values)
    assert nvme.losses == host.losses  # bit for bit (None on the skipped step)
    if bad_step is not None:
        assert nvme.losses[bad_step] is None and nvme.summary["skipped_steps"] == 1
    (nvme_tensors, nvme_doc), (host_tensors, host_doc) = nvme_final, host_final
    assert sorted(nvme_tensors) == sorted(host_tensors) and nvme_doc == host_doc
    for name, t in host_tensors.items():  # the final weights, masters and states, as each run's checkpoint holds them
        assert torch.equal(nvme_tensors[name], t), f"{name} differs"
    # the step program's state ops ran on the NVMe lanes (the rest: the end's drain, on this thread)
    lanes = nvme.summary["state_io_threads"]
    assert "lazytrain-nvme_read" in lanes and "lazytrain-nvme_write" in lanes, set(lanes)


def _tied_model(path) -> str:
    """A Qwen2 config with a tied head (the head group's file holds the embedding's states and master)."""
    from transformers import Qwen2Config

    path.mkdir()
    Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128).save_pretrained(path)
    return str(path)


@pytest.mark.exactness
def test_freeze_tuning_keeps_the_trained_layers_states_on_nvme_bit_for_bit(tmp_path):
    """Freeze tuning: the trained layers' states and fp32 masters in the files, the frozen layers in RAM once in
    bf16 (no master of what never changes, in neither run's checkpoint): the in-RAM run's losses and files."""
    _check_identical(tmp_path, 3, None, dtype="bf16", finetuning_type="freeze", freeze_trainable_layers=1)


@pytest.mark.exactness
@pytest.mark.parametrize("optimizer, dtype, masters, accum, mode, tied, depth", [
    ("adamw", "bf16", "fp32", 1, "overlap", False, 1),
    ("8bit", "bf16", "fp32", 3, "serial", False, 2),
    ("8bit", "bf16", "bf16", 1, "overlap", False, 3),
    ("adamw", "fp32", "fp32", 3, "overlap", False, None),  # the planner's depth
    ("8bit", "bf16", "fp32", 1, "overlap", True, 2),
    ("adamw", "bf16", "fp32", 1, "serial", True, 1),
])
def test_offloaded_states_give_the_in_ram_run_bit_for_bit(tmp_path, optimizer, dtype, masters, accum, mode, tied,
                                                          depth):
    model = {"model": _tied_model(tmp_path / "tied"), "init": "random"} if tied else {}
    _check_identical(tmp_path, 5, 2, optimizer=optimizer, dtype=dtype, master_weights=masters,
                     gradient_accumulation_steps=accum, optimizer_mode=mode, depth=depth, **model)


@pytest.mark.exactness
@pytest.mark.parametrize("optimizer, masters", [("8bit", "fp32"), ("adamw", "fp32"), ("8bit", "bf16")])
def test_a_model_directory_loads_into_the_offloaded_layout_and_trains_as_in_ram(tmp_path, optimizer, masters):
    """Weights from a model directory: with fp32 masters the state files get them from the model's file, never a
    whole fp32 model in RAM (runtime/weights.py's deferred masters), with bf16 ones they are read straight in bf16;
    either way the run is the in-RAM run's bit for bit, and the 8-bit states are 8-bit (a placeholder master is
    not contiguous: the states are made from the real tensor)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(RNG.randrange(1 << 31))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    for p in model.parameters():  # fresh values everywhere (norm gains start at 1)
        p.data.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    # (optimizer.json names each parameter's state kind: 8-bit in both runs, or the docs differ)
    _check_identical(tmp_path, 3, None, optimizer=optimizer, dtype="bf16", master_weights=masters,
                     model=str(tmp_path / "model"), depth=2)


def _cli_run(argv: list[str], out: Path) -> tuple[list[float], tuple[dict[str, torch.Tensor], dict]]:
    from lazytrain.cli import main

    assert main(["train", *argv, f"output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    return losses, _checkpoint(out / f"checkpoint-{len(losses)}")


def _cli_identical(tmp_path, words: list[str], steps: int) -> None:
    """`lazytrain train WORDS --optimizer-offload nvme` and the same job from a YAML file with `optimizer_offload:
    nvme` give `--optimizer-offload host`'s losses and final checkpoint bit for bit: the user's path, nothing
    patched (the planner picks the staging depth)."""
    import yaml

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    words = [*words, f"seed={RNG.randrange(1 << 31)}", f"max_steps={steps}", f"nvme_dir={nvme}", "--no-progress"]
    host = _cli_run([*words, "--optimizer-offload", "host"], tmp_path / "host")
    flag = _cli_run([*words, "--optimizer-offload", "nvme"], tmp_path / "flag")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"optimizer_offload": "nvme", **{k: yaml.safe_load(v) for k, v in
                                                                   (w.split("=", 1) for w in words if "=" in w)}}))
    from_yaml = _cli_run([str(config), "--no-progress"], tmp_path / "yaml")
    for name, (losses, (tensors, doc)) in (("flag", flag), ("yaml", from_yaml)):
        plan = json.loads((tmp_path / name / "plan.json").read_text())
        assert plan["optimizer_offload"] == "nvme" and plan["staging_depth"] >= 1, name
        assert len(losses) == steps and losses == host[0], name
        assert sorted(tensors) == sorted(host[1][0]) and doc == host[1][1], name
        for key, t in host[1][0].items():
            assert torch.equal(tensors[key], t), f"{name}: {key} differs"
    assert list(nvme.iterdir()) == []


@pytest.mark.exactness
def test_the_command_line_and_yaml_with_offload_give_the_in_ram_run(tmp_path):
    _cli_identical(tmp_path, ["model=debug", "dataset=zen", "dtype=bf16", "optimizer=8bit", "cutoff_len=32",
                              "per_device_train_batch_size=2", "gradient_accumulation_steps=3", "max_grad_norm=1.0",
                              "eval_batches=0", "save_steps=0"], 4)


@pytest.mark.slow
def test_the_small_model_from_the_command_line_for_20_steps(tmp_path):
    """The issue's own line: `lazytrain train model=small dataset=zen --optimizer-offload nvme`, 20 steps, with the
    8-bit states and bf16 masters (the most state kinds). The states offloaded are the 12.8 M shape's whatever the
    batch, so 2 x 64 tokens a step, not the default 8 x 256 (three 20-step runs of that took hours on 2 loaded cores,
    8 tokens/s); adamw with fp32 masters is left to the 20-step matrix below and the command-line test above."""
    _cli_identical(tmp_path, ["model=small", "dataset=zen", "dtype=bf16", "optimizer=8bit", "master_weights=bf16",
                              "cutoff_len=64", "per_device_train_batch_size=2", "max_grad_norm=1.0", "eval_batches=0",
                              "save_steps=0"], 20)


@pytest.mark.slow
# adamw with bf16 masters is refused by the config (torch's AdamW rounds to nearest; tests/test_host_layout.py)
@pytest.mark.parametrize("optimizer, masters", [("adamw", "fp32"), ("8bit", "fp32"), ("8bit", "bf16")])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("mode", ["overlap", "serial"])
def test_offloaded_states_give_the_in_ram_run_for_20_steps(tmp_path, optimizer, masters, accum, mode):
    """The issue's matrix, each at the depth the planner picks (no patch), a non-finite step skipped in the middle."""
    _check_identical(tmp_path, 20, 10, optimizer=optimizer, dtype="bf16", master_weights=masters,
                     gradient_accumulation_steps=accum, optimizer_mode=mode)


# ---- host memory ----------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("optimizer", ["8bit", "adamw"])
def test_host_memory_holds_no_state_and_no_master_between_updates(tmp_path, optimizer):
    """The states and fp32 masters leave host memory for real (the process's resident bytes drop by them), and
    an update stages them in the slot only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lazytrain.plan.plan import Plan
    from lazytrain.runtime.device import EmulatedDevice, return_freed_host_memory
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.offload import NvmeStates
    from lazytrain.train.optimizer import build_optimizer, executor_param_groups, group_update

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=16000, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    job = load_job_config({**BASE, "optimizer": optimizer, "dtype": "bf16"})
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 5), EmulatedDevice(nvme_dir=tmp_path),
                  compute_dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    gc.collect()  # what earlier tests left for the collector is freed now, not between the two readings
    return_freed_host_memory()
    before = _rss_bytes()
    nvme = NvmeStates(tmp_path, ex)
    opt = build_optimizer(job, model, nvme)
    groups = executor_param_groups(opt, ex)
    nvme.bind(opt, groups)
    after = _rss_bytes()
    embedding = model.model.embed_tokens.weight
    offloaded = [p for p in model.parameters() if p is not embedding]  # the gather's matrix stays (fp32)
    moved = 4 * sum(p.numel() for p in offloaded)
    assert abs((before - after) - moved) < 0.1 * moved, (before, after, moved)
    assert all(p.untyped_storage().nbytes() <= 4 for p in offloaded)
    assert not [k for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim()]
    assert nvme.file_bytes > moved + (2 if optimizer == "8bit" else 8) * numel

    ids = torch.randint(0, config.vocab_size, (2, 16))
    ex.forward_backward(ids, ids)
    update = group_update(job, opt, ex, groups, ex.last_step.grad_norm, lr=1e-3, nvme=nvme)
    grown = _rss_bytes()
    for index in range(len(groups)):
        update(index)
    assert all(p.untyped_storage().nbytes() <= 4 for p in offloaded)
    assert not [k for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim()]
    assert _rss_bytes() - grown < nvme.slot_bytes + (64 << 20)  # the slot (touched now) and the chunk buffers
    nvme.close()


# ---- faults -------------------------------------------------------------------------------------------------
def _umount(path) -> None:
    import subprocess

    subprocess.run(["umount", str(path)], capture_output=True)


def _main(tmp_path, capsys, *words: str) -> tuple[int, str]:
    from lazytrain.cli import main

    argv = ["train", "model=debug", "dataset=zen", "optimizer_offload=nvme", "dtype=bf16", "cutoff_len=32",
            "per_device_train_batch_size=2", "planner=megatrain", "eval_batches=0", "--no-progress", "max_steps=3",
            f"output_dir={tmp_path / 'run'}", *words]
    code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_a_missing_nvme_dir_is_one_line(tmp_path, capsys):
    code, err = _main(tmp_path, capsys, f"nvme_dir={tmp_path / 'missing'}")
    assert code == 2 and "\n" not in err and "does not exist" in err and "nvme_dir" in err, err


def test_a_read_only_nvme_dir_is_one_line(tmp_path, capsys):
    path = tmp_path / "ro"
    if not mount_tmpfs(path, "ro,size=64k"):
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        code, err = _main(tmp_path, capsys, f"nvme_dir={path}")
    finally:
        _umount(path)
    assert code == 2 and "\n" not in err and "not writable" in err and "nvme_dir" in err, err


def test_a_disk_without_room_for_the_states_is_one_line_before_any_file(tmp_path, capsys):
    import os

    path = tmp_path / "small"
    if not mount_tmpfs(path, "size=1m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        free = os.statvfs(path).f_bavail
        code, err = _main(tmp_path, capsys, f"nvme_dir={path}")
        assert os.listdir(path) == [] and os.statvfs(path).f_bavail == free  # nothing made, nothing left
    finally:
        _umount(path)
    assert code == 2 and "\n" not in err and "optimizer state files need" in err and str(path) in err, err


@pytest.mark.parametrize("optimizer, masters, tied", [("8bit", "fp32", False), ("8bit", "bf16", True),
                                                      ("adamw", "fp32", True)])
def test_the_free_space_check_counts_the_state_files_headers_not_a_mebibyte_each(tmp_path, optimizer, masters,
                                                                                  tied, monkeypatch):
    """Before any state exists the check asks for each file's data and a bound of its header from the group's
    parameters: at least the headers the files get, at most two pages a group more (a fixed 1 MiB a file asked
    for 50 MiB more than a 48-layer model writes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.costmodel.workload import Workload
    from lazytrain.plan.plan import Plan
    from lazytrain.runtime.device import EmulatedDevice
    from lazytrain.runtime.executor import Executor
    from lazytrain.runtime.statefiles import StateFiles
    from lazytrain.train.offload import NvmeStates
    from lazytrain.train.optimizer import build_optimizer

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=RNG.randrange(2, 5),
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    if masters == "bf16":
        model.to(torch.bfloat16)
    L = config.num_hidden_layers
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * (L + 1)), EmulatedDevice(nvme_dir=tmp_path),
                  compute_dtype=torch.bfloat16)
    cost = CostModel(ModelSpec.from_config(config), HardwareSpec.load("emulated"), Workload(1, 16, "bf16"),
                     optimizer, master_weights=masters, optimizer_offload="nvme")
    asked: list[int] = []
    real_check = StateFiles.check_room
    monkeypatch.setattr(StateFiles, "check_room", lambda self, need: (asked.append(need), real_check(self, need)))
    nvme = NvmeStates(tmp_path, ex, group_bytes=cost.state_group_bytes())
    try:
        build_optimizer(load_job_config({**BASE, "optimizer": optimizer, "dtype": "bf16",
                                         "master_weights": masters}), model, nvme)
        headers = sum(layout.data_offset for layout in nvme.files.layouts.values())
        counted = asked[1] - sum(cost.state_group_bytes())  # (asked[0]: StateFiles made empty)
        groups = sum(1 for b in cost.state_group_bytes() if b)
        assert headers <= counted <= headers + 2 * 4096 * groups, (headers, counted, groups)
    finally:
        nvme.close()


# ---- checkpoints and resume -------------------------------------------------------------------------------------
def _train(out: Path, offload: str, **values) -> trainer_module.TrainResult:
    return train(load_job_config({**BASE, **values, "optimizer_offload": offload, "output_dir": str(out)}))


@pytest.mark.exactness
@pytest.mark.parametrize("optimizer, mode", [("8bit", "overlap"), ("adamw", "serial")])
def test_a_checkpoint_resumes_across_optimizer_offload_both_ways(tmp_path, optimizer, mode):
    """A checkpoint of the states in RAM resumes with them on NVMe and the reverse (and NVMe to NVMe): the same
    files (the group files are kernel copies of the state files), the same run as the one never stopped."""
    import shutil

    job = dict(optimizer=optimizer, optimizer_mode=mode, dtype="bf16", steps=6, save_steps=3)
    whole = {kind: _train(tmp_path / kind, kind, **job) for kind in ("host", "nvme")}
    reference = _checkpoint(tmp_path / "host" / "checkpoint-6")
    assert _checkpoint(tmp_path / "nvme" / "checkpoint-3")[1] == _checkpoint(tmp_path / "host" / "checkpoint-3")[1]
    for saved, resumed in (("host", "nvme"), ("nvme", "host"), ("nvme", "nvme")):
        out = tmp_path / f"{saved}-to-{resumed}"
        shutil.copytree(tmp_path / saved / "checkpoint-3", out / "checkpoint-3")
        result = _train(out, resumed, resume_from_checkpoint="auto", **job)
        assert result.losses == whole["host"].losses, (saved, resumed)
        tensors, doc = _checkpoint(out / "checkpoint-6")
        assert sorted(tensors) == sorted(reference[0]) and doc == reference[1]
        for name, t in reference[0].items():
            assert torch.equal(tensors[name], t), f"{saved} -> {resumed}: {name} differs"


# ---- signals: SIGKILL mid-step (mid state write) and mid-save, SIGTERM; nothing left in nvme_dir -------------------
PAUSE_IN_WRITE = """
from lazytrain.train import offload
real_write, writes = offload.NvmeStates.write, []
def write(self, index):
    writes.append(index)
    if at == f"write:{len(writes)}":  # inside the step program's state_write (the nvme_write lane)
        pause()
    return real_write(self, index)
offload.NvmeStates.write = write
"""


def _start(out: Path, nvme: Path, pause_at: str, steps: int, pause_s: float = 30.0):
    import os
    import subprocess
    import sys

    import paused_run

    cli = "from lazytrain.cli import main"
    program = paused_run.PROGRAM.replace(cli, PAUSE_IN_WRITE + cli)
    env = {**os.environ, "MARKER": str(out.parent / f"{out.name}.marker"), "PAUSE_AT": pause_at,
           "PAUSE_S": str(pause_s), "OMP_NUM_THREADS": "1"}
    argv = [*paused_run.ARGV, "--dtype", "bf16", "--optimizer-offload", "nvme", f"nvme_dir={nvme}", "save_steps=2",
            "--steps", str(steps), "--output-dir", str(out)]
    return subprocess.Popen([sys.executable, "-c", program, "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env), out.parent / f"{out.name}.marker"


def _open_files_in(pid: int, directory: Path) -> list[str]:
    import os

    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith(str(directory)):
            links.append(link)
    return links


@pytest.mark.exactness
@pytest.mark.slow  # four runs, three of them subprocesses: ~1 min on a loaded machine
def test_sigkill_mid_state_write_and_mid_save_then_auto_resume_equals_the_run_never_stopped(tmp_path):
    import signal

    import paused_run

    from lazytrain.cli import main

    steps = 6
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    whole = tmp_path / "whole"
    assert main(["train", *paused_run.ARGV, "--dtype", "bf16", "--optimizer-offload", "nvme", f"nvme_dir={nvme}",
                 "save_steps=2", "--steps", str(steps), "--output-dir", str(whole)]) == 0
    reference = _checkpoint(whole / f"checkpoint-{steps}")
    # writes 1-6: step 1's update in step 2's forward, 7-12 step 2's at checkpoint 2, 19-24 step 3's in step 4's
    # forward (the debug model: 6 groups)
    for name, pause_at in (("mid-step", "write:21"), ("mid-save", "save:.tmp-checkpoint-4")):
        out = tmp_path / name
        proc, marker = _start(out, nvme, pause_at, steps)
        try:
            paused_run.wait_for(marker, proc)
            files = _open_files_in(proc.pid, nvme)
            assert files and all("(deleted)" in f for f in files)  # the state files are open, yet nameless
            assert list(nvme.iterdir()) == []
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.wait()
        assert list(nvme.iterdir()) == [] and not (out / "checkpoint-4").exists(), name
        assert main(["train", *paused_run.ARGV, "--dtype", "bf16", "--optimizer-offload", "nvme", f"nvme_dir={nvme}",
                     "save_steps=2", "resume_from_checkpoint=auto", "--steps", str(steps),
                     "--output-dir", str(out)]) == 0
        tensors, doc = _checkpoint(out / f"checkpoint-{steps}")
        assert doc == reference[1] and sorted(tensors) == sorted(reference[0]), name
        for key, t in reference[0].items():
            assert torch.equal(tensors[key], t), f"{name}: {key} differs"
        assert list(nvme.iterdir()) == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_mid_run_leave_nothing_in_nvme_dir(tmp_path, sig):
    import signal

    import paused_run

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    proc, marker = _start(tmp_path / "run", nvme, "write:9", 4, pause_s=3.0)
    try:
        paused_run.wait_for(marker, proc)
        assert _open_files_in(proc.pid, nvme)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode in (130, 143), err[-2000:]  # stopped after the step in flight, its checkpoint saved
    assert "resume_from_checkpoint=auto" in err and list(nvme.iterdir()) == []


NO_TMPFILE = """
import errno, os, signal, sys
real_open = os.open
def no_tmpfile(path, flags, mode=0o777, *, dir_fd=None):
    if flags & os.O_TMPFILE == os.O_TMPFILE:  # a file system without O_TMPFILE
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    return real_open(path, flags, mode, dir_fd=dir_fd)
os.open = no_tmpfile
from lazytrain.runtime import statefiles
real_nameless, made = statefiles.open_nameless, []
def open_nameless(*args, **kwargs):
    made.append(1)
    if os.environ.get("DIE_AT") == str(len(made)):  # killed between the named file's creation and its unlink
        os.unlink = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    return real_nameless(*args, **kwargs)
statefiles.open_nameless = open_nameless
from lazytrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_o_tmpfile_the_next_run_removes_a_state_file_its_killed_predecessor_left(tmp_path):
    """Where the file system lacks O_TMPFILE a state file is created with the pid in its name and unlinked at once;
    a run SIGKILLed in between leaves that one file, the next run in the directory removes it (and, ending
    cleanly, leaves nothing of its own)."""
    import os
    import signal
    import subprocess
    import sys

    import paused_run

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    argv = ["train", *paused_run.ARGV, "--dtype", "bf16", "--optimizer-offload", "nvme", f"nvme_dir={nvme}",
            "--steps", "1"]

    def run(out: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", NO_TMPFILE, *argv, "--output-dir", str(tmp_path / out)],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})

    killed = run("killed", DIE_AT="3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = [p.name for p in nvme.iterdir()]
    assert len(left) == 1 and left[0].startswith("lazytrain-") and left[0].endswith(".spill"), left
    done = run("next")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "offload  optimizer states on" in done.stdout and list(nvme.iterdir()) == []


# ---- a disk that fails or fills up mid-run -------------------------------------------------------------------------
@pytest.mark.exactness
def test_a_state_write_failing_mid_run_stops_in_one_line_and_the_last_checkpoint_resumes_exactly(tmp_path, capsys):
    """ENOSPC (or EIO) on a state file mid-step -- injected: the files are preallocated, so a full disk cannot do it
    -- stops the run in one line naming the intact checkpoint and how to continue; the half-written state dies with
    the process's nameless files, and the checkpoint resumes to the run never stopped."""
    import errno

    import paused_run

    from lazytrain.cli import main
    from lazytrain.runtime import statefiles

    argv = ["train", *paused_run.ARGV, "--dtype", "bf16", "--optimizer-offload", "nvme", "save_steps=2", "--steps",
            "5"]
    assert main([*argv, "--output-dir", str(tmp_path / "whole")]) == 0
    real, writes = statefiles.StateFiles._transfer, []

    def transfer(self, fd, data, offset, write):
        if write:
            writes.append(offset)
            if len(writes) > 30:  # (blocks of step 4's writes: step 3's update)
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, fd, data, offset, write)

    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(statefiles.StateFiles, "_transfer", transfer)
        capsys.readouterr()
        assert main([*argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "No space left on device" in err and "the run stopped after step" in err, err
    assert "checkpoint-2 is intact" in err and "resume_from_checkpoint=auto" in err, err
    assert main([*argv, "resume_from_checkpoint=auto", "--output-dir", str(out)]) == 0
    reference, resumed = _checkpoint(tmp_path / "whole" / "checkpoint-5"), _checkpoint(out / "checkpoint-5")
    assert resumed[1] == reference[1] and all(torch.equal(resumed[0][k], t) for k, t in reference[0].items())


def test_a_disk_filled_up_mid_run_stops_at_the_next_checkpoint_and_keeps_the_last(tmp_path, capsys):
    """nvme_dir and output_dir on one small tmpfs, filled after checkpoint 2: the state files were preallocated, so
    the steps go on; checkpoint 4 cannot be written: one line, checkpoint-2 intact, the run resumes from it once
    there is room."""
    import os

    import paused_run

    from lazytrain.cli import main
    from lazytrain.train.checkpoint import damage_reason

    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "size=16m"):
        pytest.skip("needs root to mount a small tmpfs")
    filler = disk / "filler"
    real_step = trainer_module.Trainer.train_step

    def train_step(self, step):
        if step == 2:  # after checkpoint 2: fill the disk
            with open(filler, "wb") as f:
                f.write(b"\0" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - (16 << 10)))
        return real_step(self, step)

    argv = ["train", *paused_run.ARGV, "--dtype", "bf16", "--optimizer-offload", "nvme", f"nvme_dir={disk}",
            "save_steps=2", "--steps", "5", "--output-dir", str(disk / "run")]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trainer_module.Trainer, "train_step", train_step)
            capsys.readouterr()
            assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "No space left on device" in err and "checkpoint-2 is intact" in err, err
        assert damage_reason(disk / "run" / "checkpoint-2") is None and not (disk / "run" / "checkpoint-4").exists()
        filler.unlink()
        assert main([*argv, "resume_from_checkpoint=auto"]) == 0
        assert damage_reason(disk / "run" / "checkpoint-5") is None
        assert sorted(p.name for p in disk.iterdir()) == ["run"]  # no state or spill file left
    finally:
        _umount(disk)


# ---- the staging slots and the files' lifetime ----------------------------------------------------------
def _small_states(tmp_path, depth: int = 1):
    """A tiny model's executor, optimizer and NvmeStates with `depth` staging slots, one step's gradients landed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lazytrain.plan.plan import Plan
    from lazytrain.runtime.device import EmulatedDevice
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.offload import NvmeStates
    from lazytrain.train.optimizer import build_optimizer, executor_param_groups

    torch.manual_seed(RNG.randrange(1 << 31))
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    job = load_job_config({**BASE, "optimizer": "8bit", "dtype": "bf16"})
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(nvme_dir=tmp_path),
                  compute_dtype=torch.bfloat16)
    nvme = NvmeStates(tmp_path, ex)
    opt = build_optimizer(job, model, nvme)
    groups = executor_param_groups(opt, ex)
    nvme.bind(opt, groups, depth)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    ex.forward_backward(ids, ids)
    return job, ex, nvme, opt, groups


def test_a_staging_slot_is_not_read_into_before_its_write_back(tmp_path):
    """A state_read into a slot whose group's update is not written back yet would drop that update: refused (a
    real check: it holds under python -O), and the update is still there to write."""
    from lazytrain.train.optimizer import group_update

    job, ex, nvme, opt, groups = _small_states(tmp_path, depth=1)
    first, second = 1, 2  # two layer groups, one slot
    nvme.expect_writes([first])  # the program writes it back later: its slot stays dirty until then
    update = group_update(job, opt, ex, groups, ex.last_step.grad_norm, lr=1e-2, nvme=nvme)
    update(first)
    updated = nvme.slots[0].clone()
    with pytest.raises(RuntimeError, match=f"holds group {first}'s update not yet written back"):
        nvme.read(second, slot=0)
    with pytest.raises(RuntimeError, match="not written back"):
        nvme.set_depth(2)
    assert torch.equal(nvme.slots[0], updated)  # nothing overwrote it
    nvme.write(first)
    nvme.read(second, slot=0)  # free again once written back
    nvme.close()


def test_the_state_files_are_closed_when_building_the_optimizer_fails(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lazytrain.plan.plan import Plan
    from lazytrain.runtime.device import EmulatedDevice
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.offload import NvmeStates
    from lazytrain.train.optimizer import build_optimizer

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300))
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(nvme_dir=tmp_path),
                  compute_dtype=torch.bfloat16)
    nvme = NvmeStates(tmp_path, ex)
    job = load_job_config({**BASE, "optimizer": "8bit", "dtype": "bf16"})
    real = offload_module.NvmeStates._move_out
    made = []

    open_fds: list[int] = []

    def move_out(self, optimizer, group):
        if len(made) == 2:  # the third group's file fails, two are open
            open_fds.extend(self.files._fds.values())
            raise OSError(28, "No space left on device")
        made.append(group.name)
        return real(self, optimizer, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offload_module.NvmeStates, "_move_out", move_out)
        with pytest.raises(OSError):
            build_optimizer(job, model, nvme)
    assert len(open_fds) == 2
    for fd in open_fds:  # closed: the kernel freed their blocks
        with pytest.raises(OSError):
            os.fstat(fd)


def _model_dir(path: Path) -> int:
    """A 30 M-parameter Llama directory (bf16 safetensors, fresh random values) at `path`; its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(RNG.randrange(1 << 31))
    config = LlamaConfig(vocab_size=4000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.to(torch.bfloat16).save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _tiny_model_dir(path: Path) -> None:
    """`_model_dir`'s architecture at 0.1 M parameters: what the runtime holds beside it is its fixed cost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def _train_command(model: Path, nvme: Path, out: Path) -> list[str]:
    """`lazytrain train` of `model` with fp32 masters and the states on NVMe, 2 steps (a subprocess: its own peak)."""
    import sys

    nvme.mkdir(exist_ok=True)
    return [sys.executable, "-m", "lazytrain", "train", f"model={model}", "dataset=zen", "cutoff_len=64",
            "per_device_train_batch_size=1", "gpu_mem_cap=200MiB", "dtype=bf16", "optimizer=8bit",
            "master_weights=fp32", "optimizer_offload=nvme", f"nvme_dir={nvme}", "max_steps=2", "eval_batches=0",
            "save_steps=0", "--no-progress", f"output_dir={out}", "overwrite_output_dir=true"]


def _peak_run(model: Path, nvme: Path, out: Path) -> dict[str, float]:
    """Run `_train_command` of `model`; its figures in MiB: the RSS at the start (`baseline`), the peak above it
    (`peak`), admitted and the emulated device's peak, each phase's peak above the start, and the residue = peak -
    admitted - device."""
    import subprocess

    done = subprocess.run(_train_command(model, nvme, out), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    base, mib = summary["baseline_rss_bytes"], 1 << 20
    figures = {"baseline": base / mib, "peak": (summary["peak_rss_bytes"] - base) / mib,
               "admitted": summary["host_admitted_bytes"] / mib,
               "device": max(r.get("peak_device_bytes", 0) for r in rows) / mib,
               **{phase: (v - base) / mib for phase, v in summary["peak_rss_by_phase_bytes"].items()}}
    figures["residue"] = figures["peak"] - figures["admitted"] - figures["device"]
    return {k: round(v, 1) for k, v in figures.items()}


@pytest.mark.slow
def test_loading_and_calibrating_stay_within_the_steps_peak(tmp_path):
    """A sampled-peak check beside the cgroup one below (which needs a cgroup this process may make):
    fp32 masters with the states on NVMe, from a model directory (bf16 safetensors). Loading holds the embedding's
    fp32 master alone (the other masters stay in the file until the state files take them: under half the fp32
    model, where the whole fp32 model and its bf16 copy were held before), and neither the load nor the
    calibration (one layer's states, not every state) rises above the steps' peak. The whole run stays within 1.10x
    of the admitted bytes plus the emulated device's peak, plus the runtime's fixed cost on this machine: what the
    same job of a 0.1 M model holds above admission (the libraries' code its kernels touch, the kernels loaded
    from numba's cache, the machine's profile; 91 MiB on an Emerald Rapids), which no model size changes."""
    num_params = _model_dir(tmp_path / "model")
    run = _peak_run(tmp_path / "model", tmp_path / "nvme", tmp_path / "run")
    assert run["model"] < 0.5 * 4 * num_params / (1 << 20), run
    slack = 32  # MiB between phases and runs: allocator slack, mapped pages of the model file (an MLP matrix: 3 MiB)
    assert max(run["model"], run["plan"], run["build"]) <= run["steps"] + slack, run
    _tiny_model_dir(tmp_path / "tiny")
    fixed = _peak_run(tmp_path / "tiny", tmp_path / "nvme", tmp_path / "tiny_run")
    assert run["peak"] <= 1.10 * (run["admitted"] + run["device"]) + fixed["residue"] + slack, (run, fixed)


def _memory_limited(limit_bytes: int) -> list[str] | None:
    """The command prefix that runs a process in a cgroup v2 of its own with `limit_bytes` of memory and no swap
    (`systemd-run --scope`, as the user or as root), or None where none can be made: no systemd as init, or no
    delegated memory controller. (Not the cgroups of the machine that runs the tests: they are not ours to carve;
    RLIMIT_AS bounds address space, which torch reserves far beyond its resident set, and RLIMIT_RSS is ignored.)"""
    import shutil
    import subprocess

    if shutil.which("systemd-run") is None:
        return None
    for user in (["--user"], []):
        scope = ["systemd-run", *user, "--scope", "--quiet", "-p", "MemorySwapMax=0"]
        try:
            ok = subprocess.run([*scope, "-p", "MemoryMax=64M", "true"], capture_output=True, timeout=60
                                ).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return [*scope, "-p", f"MemoryMax={limit_bytes}", "--"]
    return None


@pytest.mark.slow
def test_a_job_completes_under_a_memory_limit_just_above_its_admission(tmp_path):
    """The issue's test from the outside: the job of the test above, run once to learn its admitted bytes, the
    emulated device's peak (this process's heap on the CPU: GPU memory elsewhere) and the fixed costs (the
    interpreter's, and the runtime's as the test above measures it on a 0.1 M model), then again in a cgroup whose
    memory.max is 1.15x of admitted + device plus the fixed costs: it completes. The same limit at 0.6x is killed
    (the limit bites). Before loading in the run's layout, its fp32 model beside the bf16 copy came to ~1.5x of
    admission at load time. Skipped where no cgroup can be made (this project's CI VMs: no systemd, the memory
    controller not delegated)."""
    import subprocess

    if _memory_limited(1 << 30) is None:
        pytest.skip("no cgroup with a memory limit can be made here (systemd-run --scope failed: no systemd as "
                    "init or no delegated memory controller)")
    _model_dir(tmp_path / "model")
    run = _peak_run(tmp_path / "model", tmp_path / "nvme", tmp_path / "free")
    _tiny_model_dir(tmp_path / "tiny")
    fixed = run["baseline"] + _peak_run(tmp_path / "tiny", tmp_path / "nvme", tmp_path / "tiny_run")["residue"]
    admitted = run["admitted"] + run["device"]
    for factor, completes in ((1.15, True), (0.6, False)):
        limit = int((factor * admitted + fixed) * (1 << 20))
        limited = _memory_limited(limit)
        assert limited is not None
        done = subprocess.run([*limited, *_train_command(tmp_path / "model", tmp_path / "nvme", tmp_path / "cg")],
                              capture_output=True, text=True)
        assert (done.returncode == 0) == completes, (factor, limit, admitted, fixed, done.returncode,
                                                     done.stderr[-2000:])
