"""optimizer_offload nvme (train/offload.py): the optimizer states, and fp32 masters under bf16 compute, live in
files under nvme_dir and are staged one layer group at a time for its update -- bit for bit the in-RAM run."""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch

from lazytrain.config import load_job_config
from lazytrain.runtime import store
from lazytrain.train import offload as offload_module
from lazytrain.train import train
from lazytrain.train import trainer as trainer_module

RNG = random.Random(20261207)
BASE = dict(model="debug", corpus="zen", batch_size=2, seq_len=32, lr=3e-3, warmup_steps=1, planner="megatrain",
            eval_batches=0, progress=False, max_grad_norm=1.0, seed=0, save_steps=0)


def _final_state(trainer: trainer_module.Trainer) -> dict[str, torch.Tensor]:
    """Every master weight (by parameter name) and optimizer state tensor ("<index>.<key>") at the run's end."""
    out = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    if trainer.nvme is None:
        params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            out.update({f"{i}.{k}": v.clone() for k, v in trainer.optimizer.state[p].items()
                        if isinstance(v, torch.Tensor) and v.dim() > 0})
    else:
        for _, tensors in trainer.nvme.tensors():
            out.update(tensors)  # the offloaded masters replace the placeholders
    return out


def _with_depth(mp: pytest.MonkeyPatch, depth: int) -> None:
    """Plans with `depth` staging slots (until the planners choose it: p24-plan's MILP)."""
    from dataclasses import replace

    from lazytrain.train import planning

    real = planning.planner.make_plan

    def make_plan(*args, **kwargs):
        plan = real(*args, **kwargs)
        return replace(plan, optimizer_offload="nvme", staging_depth=depth)

    mp.setattr(planning.planner, "make_plan", make_plan)


def _run(tmp_path, offload: str, *, bad_step: int | None, depth: int = 2, **values):
    """Train with `values`; on `bad_step` (0-based) layer 1's landed gradient holds an inf. Returns the losses and
    the final masters and states."""
    real_land = store.WeightGroup.land
    real_step = trainer_module.Trainer.train_step
    real_close = trainer_module.Trainer.close
    current: dict[str, int | None] = {"step": None}
    final: dict[str, torch.Tensor] = {}
    lanes: list[str] = []  # the thread of every state read and write

    def land(self, **kwargs):
        if self.name == "layer.1" and current["step"] == bad_step:
            self.landing[RNG.randrange(self.landing.numel())] = math.inf
        return real_land(self, **kwargs)

    def train_step(self, index):
        current["step"] = index
        try:
            return real_step(self, index)
        finally:
            current["step"] = None

    def close(self):
        final.update(_final_state(self))
        real_close(self)

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
        mp.setattr(trainer_module.Trainer, "close", close)
        mp.setattr(trainer_module.Trainer, "save", lambda self: self.executor.drain() or self.out)
        if offload == "nvme":
            _with_depth(mp, depth)
        result = train(load_job_config({**BASE, **values, "optimizer_offload": offload,
                                        "output_dir": str(tmp_path / offload)}))
    result.summary["state_io_threads"] = lanes
    return result, final


def _check_identical(tmp_path, steps: int, bad_step: int | None, depth: int = 2, **values) -> None:
    host, host_final = _run(tmp_path, "host", bad_step=bad_step, steps=steps, **values)
    nvme, nvme_final = _run(tmp_path, "nvme", bad_step=bad_step, steps=steps, depth=depth, **values)
    assert nvme.losses == host.losses  # bit for bit (None on the skipped step)
    if bad_step is not None:
        assert nvme.losses[bad_step] is None and nvme.summary["skipped_steps"] == 1
    assert sorted(nvme_final) == sorted(host_final)
    for name, t in host_final.items():
        assert torch.equal(nvme_final[name], t), f"{name} differs"
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


@pytest.mark.parametrize("optimizer, dtype, masters, accum, mode, tied, depth", [
    ("adamw", "bf16", "fp32", 1, "overlap", False, 1),
    ("8bit", "bf16", "fp32", 3, "serial", False, 2),
    ("8bit", "bf16", "bf16", 1, "overlap", False, 3),
    ("adamw", "fp32", "fp32", 3, "overlap", False, 4),
    ("8bit", "bf16", "fp32", 1, "overlap", True, 2),
    ("adamw", "bf16", "fp32", 1, "serial", True, 1),
])
def test_offloaded_states_give_the_in_ram_run_bit_for_bit(tmp_path, optimizer, dtype, masters, accum, mode, tied,
                                                          depth):
    model = {"model": _tied_model(tmp_path / "tied"), "init": "random"} if tied else {}
    _check_identical(tmp_path, 5, 2, optimizer=optimizer, dtype=dtype, master_weights=masters,
                     gradient_accumulation_steps=accum, optimizer_mode=mode, depth=depth, **model)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "8bit"])
@pytest.mark.parametrize("masters", ["fp32", "bf16"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("mode", ["overlap", "serial"])
def test_offloaded_states_give_the_in_ram_run_for_20_steps(tmp_path, optimizer, masters, accum, mode):
    if masters == "bf16" and optimizer == "adamw":
        pytest.skip("master_weights bf16 needs an 8-bit optimizer")
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
def _mount_tmpfs(path, options: str) -> bool:
    import os
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    return os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                                capture_output=True).returncode == 0


def _umount(path) -> None:
    import subprocess

    subprocess.run(["umount", str(path)], capture_output=True)


def _main(tmp_path, capsys, *words: str) -> tuple[int, str]:
    from lazytrain.cli import main

    argv = ["train", "model=debug", "dataset=zen", "optimizer_offload=nvme", "dtype=bf16", "cutoff_len=32",
            "per_device_train_batch_size=2", "planner=megatrain", "eval_batches=0", "--no-progress", "max_steps=3",
            f"output_dir={tmp_path / 'run'}", *words]
    with pytest.MonkeyPatch.context() as mp:
        _with_depth(mp, 2)
        code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_a_missing_nvme_dir_is_one_line(tmp_path, capsys):
    code, err = _main(tmp_path, capsys, f"nvme_dir={tmp_path / 'missing'}")
    assert code == 2 and "\n" not in err and "does not exist" in err and "nvme_dir" in err, err


def test_a_read_only_nvme_dir_is_one_line(tmp_path, capsys):
    path = tmp_path / "ro"
    if not _mount_tmpfs(path, "ro,size=64k"):
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        code, err = _main(tmp_path, capsys, f"nvme_dir={path}")
    finally:
        _umount(path)
    assert code == 2 and "\n" not in err and "not writable" in err and "nvme_dir" in err, err


def test_a_disk_without_room_for_the_states_is_one_line_before_any_file(tmp_path, capsys):
    import os

    path = tmp_path / "small"
    if not _mount_tmpfs(path, "size=1m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        free = os.statvfs(path).f_bavail
        code, err = _main(tmp_path, capsys, f"nvme_dir={path}")
        assert os.listdir(path) == [] and os.statvfs(path).f_bavail == free  # nothing made, nothing left
    finally:
        _umount(path)
    assert code == 2 and "\n" not in err and "optimizer state files need" in err and str(path) in err, err
