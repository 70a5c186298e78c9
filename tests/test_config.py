"""JobConfig: YAML (flat and nested), key=value overrides, flags, one-line errors, one set of defaults."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import fields

import pytest
from checks import one_line

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
    assert set(SECTIONS) == {"model", "finetune", "data", "plan", "runtime", "optim", "checkpoint", "metrics",
                             "parallel"}
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
    with pytest.raises(LazyTrainError, match=r"did you mean 'per_device_eval_batch_size' or 'per_device_train_batch_"):
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
    ({"max_steps": 0}, "max_steps = 0 is invalid: it must be an integer in 1..1000000000 (or -1"),
    ({"adam_beta2": 1.0}, "adam_beta2 = 1.0 is invalid"),
    ({"gpu_mem_cap": "lots"}, "gpu_mem_cap = 'lots': cannot read as a size"),
    ({"gpu_mem_cap": "-5GB"}, "negative"),
    ({"lr": 1, "learning_rate": 2}, "learning_rate is given twice"),
    # the held-out data named twice (LLaMA-Factory refuses it too); the math set brings its own
    ({"dataset": "a.jsonl", "eval_dataset": "b.jsonl", "val_size": 0.1}, "val_size = 0.1 is invalid: it must be unset"),
    ({"val_size": 16}, "or with dataset math"),
])
def test_bad_values_are_one_line(values, needle):
    with pytest.raises(LazyTrainError) as err:
        load_job_config(values)
    one_line(str(err.value), needle)


def test_errors_name_the_key_as_typed():
    with pytest.raises(LazyTrainError, match=r"^--steps '0' is invalid|^--steps 0 is invalid"):
        _parse(["--steps", "0"])
    with pytest.raises(LazyTrainError, match=r"^--gpu-mem-cap 'lots': cannot read as a size"):
        _parse(["--gpu-mem-cap", "lots"])
    with pytest.raises(LazyTrainError, match=r"^lr = 'x': expected a number"):
        _parse(["lr=x"])
    with pytest.raises(LazyTrainError, match=r"^optim.max_steps = -2 is invalid"):
        _parse(["optim.max_steps=-2"])
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

    with pytest.raises(LazyTrainError, match="warmup_ratio = 1.5 is invalid"):
        OptimConfig(warmup_ratio=1.5)
    assert OptimConfig(learning_rate="1e-4").learning_rate == 1e-4


def test_refuse_names_a_key_set_away_from_its_default():
    job = load_job_config({"model": "qwen2.5-7b", "save_steps": 50, "report_to": "tensorboard"})
    assert set(job.changed()) == {"model", "save_steps", "report_to"}
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

    from lazytrain.config import foreign_markdown, markdown_table

    page = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert markdown_table() in page, "regenerate the table in docs/config.md from lazytrain.config.markdown_table()"
    assert foreign_markdown() in page, "regenerate docs/config.md's LLaMA-Factory table from config.foreign_markdown()"


# ---- every problem at once, bounded values, YAML traps (issues 25 and 26) ------------------------------------
def test_every_problem_of_a_config_is_reported_at_once(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("stage: sft\nfoo: 1\nlearning_rate: fast\nbar_baz: 2\nmax_steps: 0\nqux: true\nseed: -3\n")
    with pytest.raises(LazyTrainError) as err:
        load_job_config(path, overrides=["warmup_ratio=2"])
    lines = str(err.value).splitlines()
    assert sorted(lines) == sorted([
        f"config file {path}: unknown key 'foo'; see `lazytrain train --help` or docs/config.md",
        f"config file {path}: unknown key 'bar_baz'; see `lazytrain train --help` or docs/config.md",
        f"config file {path}: unknown key 'qux'; see `lazytrain train --help` or docs/config.md",
        "learning_rate = 'fast': expected a number",
        "max_steps = 0 is invalid: it must be an integer in 1..1000000000 (or -1: num_train_epochs decides)",
        "seed = -3 is invalid: it must be an integer in 0..2**63-1",
        "warmup_ratio = 2.0 is invalid: it must be in [0, 1]",
    ])


def test_duplicate_yaml_keys_are_refused_with_their_lines(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("learning_rate: 1e-5\nmax_steps: 10\nlearning_rate: 2e-5\noptim:\n  adam_beta1: 0.8\n"
                    "  adam_beta1: 0.7\n")
    with pytest.raises(LazyTrainError) as err:
        load_job_config(path)
    assert str(err.value).splitlines() == [
        f"config file {path}: 'learning_rate' is given twice (again at line 3); YAML would keep the last silently: "
        "keep one",
        f"config file {path}: 'adam_beta1' is given twice (again at line 6); YAML would keep the last silently: "
        "keep one"]


@pytest.mark.parametrize("text, needle", [
    ("max_steps: " + "9" * 5001, "max_steps = <an integer of 5001 digits>: out of range; integers must be below 2**63"),
    ("seed: 18446744073709551616", "seed = 18446744073709551616: out of range; integers must be below 2**63"),
    ("seed: 9223372036854775808", "seed = 9223372036854775808: out of range"),
    ("ddp_timeout: " + "1" * 40, "ddp_timeout = <an integer of 40 digits>: out of range"),  # as spelled
    ("num_train_epochs: .inf", "num_train_epochs = inf is invalid: it must be a number in (0, 1000000]"),
    ("num_train_epochs: .nan", "num_train_epochs = nan: not a number"),
    ("num_train_epochs: 1e7", "num_train_epochs = 10000000.0 is invalid"),
    ("max_steps: 10000000000", "max_steps = 10000000000 is invalid"),
    ("gradient_accumulation_steps: 1099511627777", "gradient_accumulation_steps = 1099511627777 is invalid"),
    ("save_steps: 1e30", "save_steps = '1e30': expected an integer"),
    ("learning_rate: 1e400", "learning_rate = inf is invalid: it must be a number > 0"),
    ("gpu_mem_cap: 1e30GB", "gpu_mem_cap = '1e30GB': out of range"),
])
def test_every_count_is_bounded_before_anything_runs(tmp_path, text, needle):
    path = tmp_path / "job.yaml"
    path.write_text(text + "\n")
    with pytest.raises(LazyTrainError) as err:
        load_job_config(path)
    one_line(str(err.value), needle)
    with pytest.raises(LazyTrainError):  # the same as a key=value word
        load_job_config(overrides=[text.replace(": ", "=").replace(".inf", "inf").replace(".nan", "nan")])


def test_a_yaml_the_reader_refuses_is_one_line(tmp_path):
    """PyYAML's reader refuses control characters (a NUL byte) as the loader is built, before parsing starts."""
    path = tmp_path / "job.yaml"
    path.write_bytes(b"learning_rate: 1e-5\nmax_steps: 3\x00\n")
    with pytest.raises(LazyTrainError) as err:
        load_job_config(path)
    assert str(err.value).startswith(f"config file {path}: not valid YAML") and "\n" not in str(err.value)


def test_every_rate_and_size_is_in_a_sane_range_all_refused_at_once(tmp_path):
    """A rate so small a transfer would take longer than time.sleep accepts, one beyond any link, a size beyond any
    machine: each refused by the schema, every one of them in the same error."""
    path = tmp_path / "job.yaml"
    path.write_text("h2d_gbps: 1e-300\nd2h_gbps: 1e300\nnvme_read_gbps: -1\nnvme_write_gbps: 0\n"
                    "gpu_mem_cap_bytes: 9e18\ncpu_mem_bytes: 5000000TB\n")
    with pytest.raises(LazyTrainError) as err:
        load_job_config(path, overrides=["cpu_act_bytes=2000PB"])
    lines = str(err.value).splitlines()
    assert len(lines) == 7, lines
    for key in ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps", "gpu_mem_cap_bytes", "cpu_mem_bytes",
                "cpu_act_bytes"):
        assert sum(line.startswith(key) for line in lines) == 1, (key, lines)
    job = load_job_config(overrides=["h2d_gbps=inf", "d2h_gbps=0.001", "nvme_act_bytes=0", "cpu_mem_bytes=2TB"])
    assert job.runtime.h2d_gbps == math.inf and job.plan.nvme_act_bytes == 0

# ---- LLaMA-Factory and HF Trainer keys ---------------------------------------------------------------------
def test_llama_factory_and_hf_keys_map_onto_ours(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: qwen2.5-7b\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
                    "dataset: identity,alpaca_en_demo\ntemplate: qwen\ncutoff_len: 512\nmax_samples: 100\n"
                    "overwrite_cache: true\npreprocessing_num_workers: 2\noutput_dir: saves/x\nlogging_steps: 5\n"
                    "save_steps: 50\nplot_loss: true\noverwrite_output_dir: true\nper_device_train_batch_size: 2\n"
                    "gradient_accumulation_steps: 4\nlearning_rate: 1.0e-5\nnum_train_epochs: 3.0\n"
                    "lr_scheduler_type: cosine\nwarmup_ratio: 0.1\nbf16: true\nddp_timeout: 180000000\n"
                    "val_size: 0.1\nper_device_eval_batch_size: 1\neval_strategy: steps\neval_steps: 50\n"
                    "report_to: none\nresume_from_checkpoint: true\ntrust_remote_code: true\n"
                    "dataloader_num_workers: 4\nsave_only_model: false\n")
    notes: list[str] = []
    job = load_job_config(path, notes=notes)
    assert job.model.model == "qwen2.5-7b" and job.runtime.dtype == "bf16"
    assert job.data.datasets == ("identity", "alpaca_en_demo") and job.data.template == "qwen"
    assert (job.data.max_samples, job.data.overwrite_cache, job.data.preprocessing_num_workers) == (100, True, 2)
    assert job.parallel.collective_timeout_s == 180000000 and job.checkpoint.resume_from_checkpoint == "auto"
    assert job.metrics.report_to == ("none",) and job.metrics.eval_steps == 50 and job.data.val_size == 0.1
    assert job.optim.max_steps == -1 and job.optim.num_train_epochs == 3.0  # the epochs decide, as in HF
    assert [n.split(":")[0] for n in notes] == ["trust_remote_code", "dataloader_num_workers"]
    # a user's model gets the HF Trainer's defaults where the YAML says nothing
    assert (job.optim.weight_decay, job.optim.adam_beta2, job.optim.warmup_steps) == (0.0, 0.999, 0)


@pytest.mark.parametrize("values, expected", [
    ({"bf16": "true"}, {"dtype": "bf16"}),
    ({"fp16": True}, {"dtype": "fp16"}),
    ({"bf16": False, "fp16": False}, {"dtype": "fp32"}),  # HF computes in fp32 then
    ({"pure_bf16": True, "optimizer": "8bit"}, {"dtype": "bf16", "master_weights": "bf16"}),
    ({"resume_from_checkpoint": False}, {"resume_from_checkpoint": None}),
    ({"resume_from_checkpoint": "runs/x/checkpoint-4"}, {"resume_from_checkpoint": "runs/x/checkpoint-4"}),
    ({"stage": "pt"}, {"dataset_format": "text"}),
    ({"eval_strategy": "no"}, {"eval_batches": 0}),
    ({"evaluation_strategy": "steps", "logging_steps": 7}, {"eval_steps": 7}),
    ({"save_strategy": "no"}, {"save_steps": 0}),
    ({"save_strategy": False, "eval_strategy": False}, {"save_steps": 0, "eval_batches": 0}),  # YAML's unquoted no
    ({"eval_strategy": "epoch", "save_strategy": "epoch", "logging_strategy": "epoch"},  # HF's semantics, ours
     {"eval_strategy": "epoch", "save_strategy": "epoch", "logging_strategy": "epoch"}),
    ({"evaluation_strategy": "epoch"}, {"eval_strategy": "epoch"}),
    ({"load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "eval_strategy": "steps",
      "eval_steps": 5, "save_steps": 10, "save_total_limit": 1}, {"load_best_model_at_end": True}),
    ({"load_best_model_at_end": True, "eval_strategy": "epoch", "save_strategy": "epoch"},
     {"load_best_model_at_end": True}),
    ({"optim": "adamw_torch_fused"}, {"optimizer": "adamw"}),
    ({"optim": "paged_adamw_8bit"}, {"optimizer": "8bit"}),
    ({"auto_find_batch_size": True}, {"per_device_train_batch_size": "auto"}),
    ({"disable_tqdm": True}, {"progress": False}),
    ({"use_cpu": True}, {"device": "cpu"}),
    ({"neat_packing": True, "packing": False}, None),  # two spellings of one key: refused
    ({"report_to": ["wandb", "tensorboard"]}, {"report_to": ("wandb", "tensorboard")}),
    ({"val_size": 0.0}, {"val_size": None}),
    ({"val_size": 25, "dataset": "train.jsonl"}, {"val_size": 25}),
    ({"pissa_iter": None, "create_new_adapter": False, "hub_token": None}, {}),  # off: asks for nothing
    ({"finetuning_type": "lora", "lora_target": ["q_proj", "v_proj"], "quantization_method": "bnb"},
     {"finetuning_type": "lora", "lora_target": "q_proj,v_proj"}),
])
def test_foreign_values(values, expected):
    if expected is None:
        with pytest.raises(LazyTrainError, match="given twice"):
            load_job_config({"model": "qwen2.5-7b", **values})
        return
    flat = load_job_config({"model": "qwen2.5-7b", **values}).flat()
    assert {k: flat[k] for k in expected} == expected


@pytest.mark.parametrize("values, needle", [
    ({"finetuning_type": "oft"}, "finetuning_type = 'oft': expected one of full, lora, freeze"),
    ({"use_dora": True}, "use_dora is not implemented (LoRA trains plain low-rank adapters); remove it"),
    ({"do_train": False}, "`lazytrain train` always trains"),
    ({"quantization_bit": 4}, "quantizes the frozen base of LoRA (QLoRA), not of finetuning_type full"),
    ({"finetuning_type": "lora", "quantization_bit": 8}, "quantization_bit 8: only 4 (QLoRA's NF4 base) is "
                                                         "implemented"),
    ({"deepspeed": "ds.json"}, "deepspeed = 'ds.json' (an HF Trainer key): no such file ds.json"),
    ({"flash_attn": "fa4"}, "flash_attn is auto, sdpa, fa2, fa3 or disabled; LazyTrain runs sdpa"),
    ({"stage": "dpo"}, "stage = 'dpo' asks for DPO, which LazyTrain does not do: LazyTrain trains with the "
                       "language-model loss"),
    ({"fsdp": "full_shard"}, "LazyTrain does not shard with FSDP"),
    ({"save_strategy": "best"}, "save_strategy = 'best' (an HF Trainer key): LazyTrain saves every save_steps"),
    ({"logging_strategy": "no"}, "at the end of every epoch (epoch); set one of them"),
    ({"load_best_model_at_end": True, "eval_steps": 10, "save_steps": 15},
     "load_best_model_at_end needs save_steps to be a multiple of eval_steps, as in the HF Trainer: save_steps 15, "
     "eval_steps 10; set save_steps 20"),
    ({"load_best_model_at_end": True, "eval_strategy": "epoch", "save_steps": 10},
     "load_best_model_at_end needs the save and eval strategies to match, as in the HF Trainer: eval_strategy "
     "epoch, save_strategy steps; set eval_strategy steps with eval_steps"),
    ({"load_best_model_at_end": True, "save_strategy": "epoch"}, "eval_strategy no, save_strategy epoch; set "
                                                                  "eval_strategy epoch"),
    ({"load_best_model_at_end": True, "eval_strategy": "no"}, "eval_strategy no, save_strategy steps"),
    ({"eval_strategy": "steps"}, "needs eval_steps"),
    ({"pissa_iter": 8}, "pissa_iter = 8 asks for PiSSA, which LazyTrain does not do"),
    ({"module_dropout": 0.1}, "module_dropout = 0.1 (a LLaMA-Factory key): a LLaMA-Factory setting LazyTrain does not "
                              "implement"),
    ({"push_to_hub": True}, "nothing leaves this machine"),
    ({"optim": "sgd"}, "LazyTrain's optimizers are adamw"),
    ({"bf16": "maybe"}, "expected true or false"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "expected one of linear, cosine"),
])
def test_foreign_values_lazytrain_does_not_act_on_are_refused_with_why(values, needle):
    with pytest.raises(LazyTrainError) as err:
        load_job_config(values)
    one_line(str(err.value), needle)


def test_keys_of_another_finetuning_type_are_noted_once():
    notes: list[str] = []
    job = load_job_config({"model": "qwen2.5-7b", "finetuning_type": "freeze", "lora_rank": 16,
                           "freeze_trainable_layers": 4}, notes=notes)
    assert job.finetune.freeze_trainable_layers == 4
    assert notes == ["finetuning_type freeze leaves lora_rank unused"]


def test_steps_keys_an_epoch_strategy_leaves_unused_are_noted_once():
    """The HF Trainer ignores eval_steps under eval_strategy epoch silently; LazyTrain says so, once."""
    notes: list[str] = []
    job = load_job_config({"model": "qwen2.5-7b", "eval_strategy": "epoch", "eval_steps": 50,
                           "save_strategy": "epoch", "logging_steps": 5},
                          {"dataloader_num_workers": 4}, {"dataloader_num_workers": 4}, notes=notes)
    assert job.metrics.eval_strategy == "epoch" and job.checkpoint.save_strategy == "epoch"
    assert notes[0] == ("eval_strategy: epoch leaves eval_steps 50 unused (at the end of every epoch instead, as the "
                        "HF Trainer)")
    assert len(notes) == 2 and notes[1].startswith("dataloader_num_workers: accepted") is False
    assert notes[1].startswith("dataloader_num_workers: ")


@pytest.mark.parametrize("key", ["stage", "do_train", "finetuning_type", "deepspeed", "max_samples",
                                 "per_device_eval_batch_size", "bf16"])
def test_keys_users_bring_get_no_wrong_hint(key):
    """The issue's misleading hints (stage -> steps, do_train -> num_train_epochs, ...): each of these is known."""
    try:
        load_job_config({key: "x"})
    except LazyTrainError as err:
        assert "did you mean" not in str(err) and "unknown key" not in str(err), str(err)


def test_unknown_keys_hint_only_close_names():
    with pytest.raises(LazyTrainError) as err:
        load_job_config({"warmup_stesp": 3, "gradient_clipping": 1.0, "learningrate": 1})
    lines = str(err.value).splitlines()
    assert "did you mean 'warmup_steps'?" in lines[0] and "did you mean 'learning_rate'?" in lines[2]
    assert "did you mean" not in lines[1]


def test_the_default_job_keeps_its_values_and_a_users_model_gets_hfs():
    default = load_job_config()
    assert (default.optim.learning_rate, default.optim.max_steps, default.optim.lr_scheduler_type) == (
        3e-3, 120, "cosine_with_min_lr")
    assert default.optim.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and default.metrics.eval_batches == 2
    users = load_job_config({"model": "qwen2.5-7b"})
    assert (users.optim.learning_rate, users.optim.max_steps, users.optim.lr_scheduler_type) == (5e-5, -1, "linear")
    assert (users.optim.weight_decay, users.optim.adam_beta2, users.metrics.eval_batches) == (0.0, 0.999, None)
    # the default job's values give way to the keys they would override
    mine = load_job_config({"num_train_epochs": 2, "warmup_ratio": 0.2, "lr_scheduler_type": "cosine"})
    assert (mine.optim.max_steps, mine.optim.warmup_steps, mine.optim.lr_scheduler_kwargs) == (-1, 0, {})
