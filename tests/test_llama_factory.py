"""A LLaMA-Factory `train_full`-style YAML runs as it is on a tiny Qwen2 model folder, with
two datasets of a dataset_info.json (one alpaca, one sharegpt); the result loads with from_pretrained, its
trainer_state.json with transformers' TrainerState, and the evaluation scores every held-out example."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from lazytrain.costmodel.hardware import resolve_dtype
from lazytrain.data.tokenizer import train_bpe_tokenizer

SRC = str(Path(__file__).parent.parent / "src")
RNG = random.Random(20261205)
WORDS = "the cat sat on a mat and the dog ran to see what it was doing while birds sang all day long".split()


def _words(n: int) -> str:
    return " ".join(RNG.choice(WORDS) for _ in range(n))


def _qwen2_dir(path: Path) -> Path:
    """A tiny random Qwen2 saved as HF does, with a BPE tokenizer that has its own (ChatML) chat template."""
    tokenizer = train_bpe_tokenizer([_words(RNG.randrange(5, 15)) for _ in range(200)], vocab_size=300)
    tokenizer.save_pretrained(str(path))
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(RNG.randrange(2**31))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


def _data_dir(path: Path) -> None:
    """LLaMA-Factory's layout: identity-like alpaca rows and a sharegpt conversation file, named in dataset_info."""
    path.mkdir()
    identity = [{"instruction": _words(4), "input": "", "output": _words(6)} for _ in range(30)]
    chats = [{"conversations": [{"from": "human", "value": _words(4)}, {"from": "gpt", "value": _words(5)},
                                {"from": "human", "value": _words(3)}, {"from": "gpt", "value": _words(4)}]}
             for _ in range(30)]
    (path / "identity.json").write_text(json.dumps(identity, indent=2))
    (path / "chats.json").write_text(json.dumps(chats))
    (path / "dataset_info.json").write_text(json.dumps({
        "identity": {"file_name": "identity.json"},
        "chats_demo": {"file_name": "chats.json", "formatting": "sharegpt", "columns": {"messages": "conversations"}},
    }, indent=2))


def test_a_llama_factory_train_full_yaml_runs_as_is(tmp_path):
    model = _qwen2_dir(tmp_path / "Qwen2-tiny")
    _data_dir(tmp_path / "data")
    bf16 = resolve_dtype("auto", emulated=True) == "bf16"  # bf16 where this CPU computes it natively, else none
    out = tmp_path / "saves" / "qwen2-tiny" / "full" / "sft"
    config = {  # examples/train_full/qwen*_full_sft.yaml's keys, LazyTrain's none
        "model_name_or_path": str(model), "trust_remote_code": True,
        "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "identity,chats_demo", "dataset_dir": str(tmp_path / "data"), "template": "qwen",
        "cutoff_len": 64, "max_samples": 25, "overwrite_cache": True, "preprocessing_num_workers": 2,
        "output_dir": str(out), "logging_steps": 2, "save_steps": 3, "plot_loss": True, "overwrite_output_dir": True,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1.0e-4,
        "num_train_epochs": 3.0, "max_steps": 6, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": bf16,
        "ddp_timeout": 180000000, "val_size": 0.1, "per_device_eval_batch_size": 1, "eval_strategy": "steps",
        "eval_steps": 3, "report_to": "none",
    }
    path = tmp_path / "qwen2_full_sft.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", str(path)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = done.stdout
    assert "note     trust_remote_code:" in printed
    assert "template: LLaMA-Factory's qwen template" in printed
    # max_steps wins over num_train_epochs, as in the HF Trainer; steps count from 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4, 6] and "epochs   " not in printed
    assert rows[0]["lr"] > 0 and rows[-1]["lr"] < rows[1]["lr"]  # warm-up over, cosine decaying
    # every held-out example scored: val_size 0.1 of 2 x 25 rows
    held_out = int(printed.split(" held-out examples")[0].rsplit("/ ", 1)[1].replace(",", ""))
    assert held_out == 5
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(r["eval_examples"] == held_out for r in evals)
    assert f"({held_out} examples," in printed
    # the result loads as any HF model does, and its trainer_state.json as the HF Trainer's
    final = out / "checkpoint-6"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final)
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    assert loaded.config.model_type == "qwen2" and tokenizer.chat_template
    state = transformers.TrainerState.load_from_json(str(final / "trainer_state.json"))
    assert state.global_step == 6 and state.max_steps == 6 and state.train_batch_size == 2
    assert state.best_metric == min(r["eval_loss"] for r in evals)
    assert [e["step"] for e in state.log_history if "loss" in e] == [2, 3, 4, 6]
    assert [e["eval_loss"] for e in state.log_history if "eval_loss" in e] == [r["eval_loss"] for r in evals]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert transformers.TrainerState.load_from_json(str(out / "checkpoint-3" / "trainer_state.json")).global_step == 3
    if bf16:
        assert json.loads((out / "train_config.json").read_text())["runtime"]["dtype"] == "bf16"


@pytest.mark.parametrize("extra, needle", [
    ({"finetuning_type": "oft", "oft_rank": 8}, "asks for OFT, which LazyTrain does not do"),
    ({"deepspeed": "examples/deepspeed/ds_z3_config.json"}, "deepspeed = 'examples/deepspeed/ds_z3_config.json'"),
])
def test_what_lazytrain_does_not_do_is_refused_before_anything_runs(tmp_path, extra, needle):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "tiny-qwen2", "stage": "sft", "do_train": True,
                                    "output_dir": str(tmp_path / "out"), **extra}))
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", str(path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC}, timeout=120)
    assert done.returncode == 2 and needle in done.stderr and not (tmp_path / "out").exists()
    assert all(line.startswith("error: ") for line in done.stderr.splitlines())
