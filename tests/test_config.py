"""JobConfig: YAML (flat and nested), key=value overrides, flags, one-line errors, one set of defaults."""

from __future__ import annotations

import argparse
import random
from dataclasses import fields

import pytest

from lazytrain.config import (
    ALIASES,
    KEYS,
    SECTIONS,
    JobConfig,
    add_job_arguments,
    field_docs,
    job_config_from_args,
    job_config_from_dict,
    load_job_config,
)
from lazytrain.errors import LazyTrainError

RNG = random.Random(20261203)


def _parse(argv: list[str]) -> JobConfig:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    return job_config_from_args(parser.parse_intermixed_args(argv))


def test_every_key_has_a_docstring_and_a_section():
    docs = field_docs()
    assert set(docs) == set(KEYS)
    assert all(len(text) > 15 for text in docs.values())
    assert len(KEYS) == len(set(KEYS))  # a key lives in exactly one section
    assert set(SECTIONS) == {"model", "data", "plan", "runtime", "optim", "checkpoint", "metrics", "parallel"}
    assert all(alias not in KEYS and target in KEYS for alias, target in ALIASES.items())


def test_issue_keys_are_accepted():
    for key in ("model", "dataset", "dataset_format", "template", "train_on_prompt", "cutoff_len", "packing",
                "val_size", "eval_steps", "output_dir", "overwrite_output_dir", "max_steps", "num_train_epochs",
                "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type",
                "warmup_ratio", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "seed",
                "save_steps", "save_total_limit", "resume_from_checkpoint", "logging_steps", "report_to", "device",
                "planner", "optimizer", "optimizer_mode", "nvme_dir", "dtype", "replan", "gpu_mem_cap_bytes",
                "cpu_act_bytes", "nvme_act_bytes", "h2d_gbps"):
        assert key in KEYS, key


def test_flat_and_nested_yaml_give_the_same_job(tmp_path):
    lr = RNG.choice([1e-5, 2e-5, 3e-4])
    steps = RNG.randint(2, 500)
    flat = tmp_path / "flat.yaml"
    flat.write_text(f"model: qwen2.5-7b\nlearning_rate: {lr:.0e}\nmax_steps: {steps}\ngpu_mem_cap: 22GB\n"
                    "per_device_train_batch_size: auto\nreplan: off\nresume_from_checkpoint: auto\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text(f"model: {{model: qwen2.5-7b}}\noptim:\n  learning_rate: {lr!r}\n  max_steps: {steps}\n"
                      "plan:\n  gpu_mem_cap_bytes: 22000000000\n  replan: false\n"
                      "data: {per_device_train_batch_size: auto}\ncheckpoint: {resume_from_checkpoint: auto}\n")
    a, b = load_job_config(flat), load_job_config(nested)
    assert a == b
    assert a.optim.learning_rate == pytest.approx(lr) and isinstance(a.optim.learning_rate, float)  # "1e-05"
    assert a.optim.max_steps == steps and a.plan.gpu_mem_cap_bytes == 22 * 10**9
    assert a.data.per_device_train_batch_size == "auto" and a.plan.replan is False
    assert job_config_from_dict(a.to_dict()) == a  # train_config.json reads back
    assert job_config_from_dict(a.flat()) == a


def test_overrides_then_flags_win_over_the_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("learning_rate: 1e-5\nmax_steps: 10\nseq_len: 512\noptimizer: hybrid8bit\n")
    job = load_job_config(path, overrides=["optim.learning_rate=2e-5", "max_steps=20"])
    assert (job.optim.learning_rate, job.optim.max_steps, job.data.cutoff_len) == (2e-5, 20, 512)
    job = _parse([str(path), "max_steps=20", "--steps", "30", "--lr", "4e-5", "--no-progress"])
    assert (job.optim.learning_rate, job.optim.max_steps, job.runtime.progress) == (4e-5, 30, False)
    assert job.optim.optimizer == "hybrid8bit"


def test_old_flags_map_onto_fields():
    job = _parse(["--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32", "--grad-accum", "2",
                  "--gpu-mem-cap", "64MiB", "--cpu-act-budget", "1GB", "--nvme-act-budget", "0", "--cpu-mem", "2TB",
                  "--rule", "megatrain", "--interval", "3", "--time-limit", "5", "--mip-gap", "0.01",
                  "--plan", "p.json", "--optimizer", "fp32", "--eval-batches", "0"])
    assert job.model.model == "debug" and job.data.dataset == "zen"
    assert job.data.per_device_train_batch_size == 4 and job.data.cutoff_len == 32
    assert job.optim.gradient_accumulation_steps == 2 and job.optim.optimizer == "adamw"
    assert job.plan.gpu_mem_cap_bytes == 64 * 2**20 and job.plan.cpu_act_bytes == 10**9
    assert job.plan.nvme_act_bytes == 0 and job.plan.cpu_mem_bytes == 2 * 10**12
    assert (job.plan.planner, job.plan.interval, job.plan.time_limit_s) == ("megatrain", 3, 5.0)
    assert job.plan.mip_rel_gap == 0.01 and job.plan.plan_file == "p.json" and job.metrics.eval_batches == 0
    assert _parse(["--packing"]).data.packing is True  # a bare boolean flag means true
    assert _parse(["--packing", "false"]).data.packing is False


def test_unknown_key_names_the_nearest(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("learning_rte: 1e-5\n")
    with pytest.raises(LazyTrainError, match=r"unknown key 'learning_rte'; did you mean 'learning_rate'\?$"):
        load_job_config(path)
    with pytest.raises(LazyTrainError, match=r"did you mean 'per_device_train_batch_size'"):
        load_job_config(overrides=["per_device_batch_size=4"])
    with pytest.raises(LazyTrainError, match=r"unknown section 'optm'; did you mean 'optim'"):
        load_job_config({"optm.learning_rate": 1})
    with pytest.raises(LazyTrainError, match=r"belongs to section 'optim'"):
        load_job_config({"data": {"learning_rate": 1}})


@pytest.mark.parametrize("values, needle", [
    ({"max_steps": "ten"}, "max_steps = 'ten': expected an integer"),
    ({"learning_rate": "fast"}, "learning_rate = 'fast': expected a number"),
    ({"packing": "maybe"}, "packing = 'maybe': expected true/false"),
    ({"optimizer": "sgd"}, "optimizer = 'sgd': expected one of adamw, hybrid8bit, 8bit"),
    ({"per_device_train_batch_size": "big"}, "expected an integer or one of auto"),
    ({"model": 7}, "model = 7: expected a string"),
    ({"max_steps": True}, "max_steps = True: expected an integer"),
    ({"max_steps": 0}, "max_steps = 0 is invalid: it must be an integer >= 1"),
    ({"adam_beta2": 1.0}, "adam_beta2 = 1.0 is invalid"),
    ({"gpu_mem_cap": "lots"}, "gpu_mem_cap = 'lots': cannot read as a size"),
    ({"gpu_mem_cap": "-5GB"}, "negative"),
    ({"lr": 1, "learning_rate": 2}, "learning_rate is given twice"),
])
def test_bad_values_are_one_line(values, needle):
    with pytest.raises(LazyTrainError) as err:
        load_job_config(values)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_errors_name_the_key_as_typed():
    with pytest.raises(LazyTrainError, match=r"^--steps '0' is invalid|^--steps 0 is invalid"):
        _parse(["--steps", "0"])
    with pytest.raises(LazyTrainError, match=r"^--gpu-mem-cap 'lots': cannot read as a size"):
        _parse(["--gpu-mem-cap", "lots"])
    with pytest.raises(LazyTrainError, match=r"^lr = 'x': expected a number"):
        _parse(["lr=x"])
    with pytest.raises(LazyTrainError, match=r"^optim.max_steps = -1 is invalid"):
        _parse(["optim.max_steps=-1"])
    with pytest.raises(LazyTrainError, match=r"given twice"):
        _parse(["--lr", "1e-5", "--learning-rate", "2e-5"])


def test_malformed_yaml_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("learning_rate: [1e-5\n")
    with pytest.raises(LazyTrainError, match="not valid YAML at line"):
        load_job_config(path)
    path.write_text("- a list\n")
    with pytest.raises(LazyTrainError, match="expected a mapping"):
        load_job_config(path)
    with pytest.raises(LazyTrainError, match="cannot read it"):
        load_job_config(tmp_path / "missing.yaml")
    with pytest.raises(LazyTrainError, match="expected key=value"):
        load_job_config(overrides=["=3"])


def test_code_construction_is_checked_too():
    from lazytrain.config import OptimConfig

    with pytest.raises(LazyTrainError, match="min_lr_ratio = 1.5 is invalid"):
        OptimConfig(min_lr_ratio=1.5)
    assert OptimConfig(learning_rate="1e-4").learning_rate == 1e-4


def test_refuse_names_a_key_set_away_from_its_default():
    job = load_job_config({"save_steps": 50, "report_to": "tensorboard"})
    assert set(job.changed()) == {"save_steps", "report_to"}
    job.refuse(["packing"], "train")  # at its default: fine
    with pytest.raises(LazyTrainError, match=r"^save_steps = 50: not supported by `lazytrain train` yet"):
        job.refuse(["packing", "save_steps", "report_to"], "train")


def test_every_field_has_a_flag():
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    dests = {a.dest for a in parser._actions}
    for section in SECTIONS.values():
        for f in fields(section):
            assert f"job.--{f.name.replace('_', '-')}" in dests


def test_docs_list_every_key():
    from pathlib import Path

    from lazytrain.config import markdown_table

    page = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert markdown_table() in page, "regenerate the table in docs/config.md from lazytrain.config.markdown_table()"
