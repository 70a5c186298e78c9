"""LLaMA-Factory's own example YAMLs, run as shipped from a folder laid out as LF's repository.

tests/data/lf_repo holds a few of LF's `examples/` YAMLs and DeepSpeed JSONs unchanged, and its `data/` demo files
cut to a few rows (identity, alpaca_en_demo, c4_demo, wiki_demo; LF's dataset_info.json entries for them and for
two datasets LazyTrain refuses). Each YAML runs with `model_name_or_path` pointed at a tiny local Qwen2, and
`max_steps` and `output_dir` set for a short run, from the folder as LF's users run `llamafactory-cli train
examples/...` (the `deepspeed:` path is relative to it). What LazyTrain does not do is refused in one line naming it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from lazytrain.config import load_job_config
from lazytrain.data.loader import Example
from lazytrain.data.sft import group_texts
from lazytrain.data.sources import resolve
from lazytrain.data.tokenizer import train_bpe_tokenizer
from lazytrain.errors import LazyTrainError
from lazytrain.train.metrics import plot_losses

SRC = str(Path(__file__).parent.parent / "src")
LF_REPO = Path(__file__).parent / "data" / "lf_repo"
RNG = random.Random(34)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A copy of the LF-style folder with a tiny Qwen2 (ChatML specials, no BOS) in models/."""
    root = tmp_path_factory.mktemp("lf") / "LLaMA-Factory"
    shutil.copytree(LF_REPO, root)
    rows = json.loads((root / "data" / "alpaca_en_demo.json").read_text())
    tokenizer = train_bpe_tokenizer([r["instruction"] + " " + r["output"] for r in rows], vocab_size=600)
    model = root / "models" / "qwen-tiny"
    tokenizer.save_pretrained(str(model))
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(RNG.randrange(2**31))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(model))
    return root


def _run(repo: Path, example: str, drop: tuple[str, ...] = (), *words: str) -> subprocess.CompletedProcess:
    """`lazytrain train` on LF's YAML with only the model, output_dir and max_steps changed (and `drop`ped keys)."""
    config = yaml.safe_load((repo / example).read_text())
    config = {k: v for k, v in config.items() if k not in drop}
    out = repo / "saves" / example.replace("/", "_")
    config.update(model_name_or_path="models/qwen-tiny", output_dir=str(out), max_steps=2)
    path = repo / (example + ".test.yaml")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lazytrain", "train", str(path.relative_to(repo)), "--no-progress",
                           *words], capture_output=True, text=True, env=env, timeout=600, cwd=repo)


def test_train_full_qwen3_runs_as_shipped(repo):
    done = _run(repo, "examples/train_full/qwen3_full_sft.yaml", (), "logging_steps=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "note     deepspeed: ZeRO stage 3 needs nothing here" in out
    assert "template: LLaMA-Factory's qwen3_nothink template" in out
    # LF's first example, printed as LF prints it: identity's first row through qwen3_nothink
    assert ("inputs:\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello! I am {{name}}, an AI assistant "
            "developed by {{author}}. How can I assist you today?<|im_end|>\n\nlabels:\nHello! I am {{name}}") in out
    logged = [json.loads(line.replace("'", '"')) for line in out.splitlines() if line.startswith("{'loss'")]
    assert [set(d) for d in logged] == [{"loss", "grad_norm", "learning_rate", "epoch"}] * 2
    assert float(logged[0]["learning_rate"]) == 0.0  # warm-up from 0, as the HF Trainer logs step 1's rate
    final = repo / "saves" / "examples_train_full_qwen3_full_sft.yaml" / "checkpoint-2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    assert tokenizer.eos_token == "<|im_end|>"  # replace_eos, saved with the model
    # plot_loss: true (with the viz extra; without it one line says how to get the plot)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (final.parent / "loss.png").exists() == has_matplotlib
    assert ("plot_loss: no loss.png, matplotlib is not installed" in out) != has_matplotlib


def test_plot_loss_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    assert not plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert "pip install 'lazytrain[viz]'" in capsys.readouterr().out and not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("example", ["examples/train_lora/qwen3_lora_pretrain.yaml",
                                     "examples/train_lora/qwen3_lora_sft.yaml"])
def test_lora_examples_run_as_shipped(repo, example):
    """LoRA rank 8 on every linear: stage pt on c4_demo's text, stage sft on identity + alpaca_en_demo; the
    checkpoint is a PEFT adapter folder."""
    done = _run(repo, example)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = repo / "saves" / example.replace("/", "_") / "checkpoint-2"
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16, "LORA")
    assert (final / "adapter_model.safetensors").is_file() and not list(final.glob("model*.safetensors"))


def test_the_qlora_example_runs_as_shipped(repo):
    """QLoRA (quantization_bit 4, bnb): the base's linears held and streamed as NF4, the checkpoint a PEFT adapter
    folder of the rank-8 adapters alone."""
    example = "examples/train_qlora/qwen3_lora_sft_otfq.yaml"
    done = _run(repo, example)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # 2 layers x 7 linears of the tiny Qwen2 (hidden 32, kv 16, intermediate 64)
    weights = 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64)
    assert f"base     quantization_bit 4: the decoder layers' 14 frozen linears ({weights:,} weights)" in done.stdout
    final = repo / "saves" / example.replace("/", "_") / "checkpoint-2"
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16, "LORA")
    assert (final / "adapter_model.safetensors").is_file() and not list(final.glob("model*.safetensors"))


@pytest.mark.slow  # 2 steps of 8 x 2048 tokens
def test_pretraining_on_lfs_c4_demo(repo):
    """qwen3_lora_pretrain.yaml with its LoRA keys left out (the LoRA issue's): stage pt on c4_demo's text."""
    done = _run(repo, "examples/train_lora/qwen3_lora_pretrain.yaml", ("finetuning_type", "lora_rank", "lora_target"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # packing on, as LF's pt: the 6 documents end to end in blocks of cutoff_len 2048, none cut
    line = next(line for line in done.stdout.splitlines() if line.startswith("dataset  c4_demo (text: "))
    blocks = int(line.split("(text: ")[1].split(" train")[0])
    assert blocks >= 1 and "0 truncated to cutoff_len" in line
    assert f", {blocks * 2048:,} train tokens" in line


def test_group_texts_lays_documents_end_to_end_in_blocks():
    docs = [[RNG.randrange(1000) for _ in range(RNG.randrange(1, 30))] for _ in range(20)]
    examples = [Example(d, d) for d in docs]
    whole = [t for d in docs for t in d]
    blocks = group_texts(examples, 16)
    assert len(blocks) == len(whole) // 16
    assert [t for b in blocks for t in b.input_ids] == whole[:len(blocks) * 16]
    assert all(b.labels == b.input_ids and len(b.input_ids) == 16 for b in blocks)


@pytest.mark.parametrize("example, line", [
    ("examples/extras/galore/llama3_full_sft.yaml", "use_galore = True asks for GaLore, which LazyTrain does not do"),
    ("examples/extras/mod/llama3_full_sft.yaml", "mixture_of_depths = 'convert' asks for mixture of depths"),
    ("examples/train_lora/qwen3_lora_dpo.yaml", "stage = 'dpo' asks for DPO, which LazyTrain does not do"),
])
def test_what_lazytrain_does_not_do_is_one_line(repo, example, line):
    done = _run(repo, example)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and line in done.stderr, done.stderr


def test_deepspeed_offload_and_removal(repo, monkeypatch):
    monkeypatch.chdir(repo)
    base = {"model": "qwen2.5-7b"}
    notes: list[str] = []
    job = load_job_config({**base, "deepspeed": "examples/deepspeed/ds_z3_offload_config.json"}, notes=notes)
    assert job.runtime.optimizer_offload == "host"  # offload_optimizer cpu: LazyTrain's default
    assert "offload_param cpu" in notes[0] and "ZeRO stage 3" in notes[0]
    nvme = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme"}}}
    Path("nvme.json").write_text(json.dumps(nvme))
    job = load_job_config({**base, "deepspeed": "nvme.json"})
    assert (job.runtime.optimizer_offload, job.runtime.nvme_dir) == ("nvme", "/mnt/nvme")
    notes = []
    job = load_job_config({**base, "deepspeed": "nvme.json"}, overrides=["deepspeed=null"], notes=notes)
    assert (job.runtime.optimizer_offload, job.runtime.nvme_dir, notes) == ("host", None, [])
    Path("broken.json").write_text("{not json")
    for path, needle in (("missing.json", "no such file missing.json"), ("broken.json", "cannot be read as JSON")):
        with pytest.raises(LazyTrainError, match=needle):
            load_job_config({**base, "deepspeed": path})


def test_every_first_pass_problem_at_once(repo):
    """A dataset name that is not there, an unknown template and mismatched interleave_probs: one pass, before
    anything heavy is loaded."""
    path = repo / "bad.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "models/qwen-tiny", "dataset": "identity,nope",
                                    "template": "qwen4", "interleave_probs": "0.5,0.3,0.2",
                                    "mix_strategy": "interleave_under", "output_dir": "saves/bad"}))
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", "bad.yaml"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=repo)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 3, done.stderr
    assert "dataset nope: no such file" in lines[0] and "template 'qwen4'" in lines[1] and "3 weights for 2" in lines[2]
    path.write_text(yaml.safe_dump({"model_name_or_path": "models/qwen-tiny", "output_dir": "saves/bad"}))
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", "bad.yaml"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=repo)
    assert done.returncode == 2 and "dataset is math (the default when dataset is not set" in done.stderr
    path.write_text(yaml.safe_dump({"model_name_or_path": "models/qwen-tiny", "dataset": "someone/not-downloaded",
                                    "output_dir": "saves/bad"}))
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", "bad.yaml"], capture_output=True, text=True,
                          env={**env, "HF_HOME": str(repo / "empty-hf-home")}, timeout=120, cwd=repo)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "dataset someone/not-downloaded is not in the local HF datasets cache" in done.stderr


def test_a_remote_dataset_dir_is_its_snapshot_in_the_hub_cache(tmp_path, monkeypatch):
    """LF's `dataset_dir: REMOTE:llamafactory/demo_data` (qwen3_lora_sft_ray.yaml) reads the local hub cache only."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(LazyTrainError, match="llamafactory/demo_data is not in the local HF hub cache"):
        resolve(("identity",), "REMOTE:llamafactory/demo_data")
    snapshot = tmp_path / "hub" / "datasets--llamafactory--demo_data" / "snapshots" / "0123abc"
    shutil.copytree(LF_REPO / "data", snapshot)
    [source] = resolve(("identity",), "REMOTE:llamafactory/demo_data")
    assert source.path == snapshot / "identity.json"
