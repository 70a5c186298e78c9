"""`lazytrain train` with LoRA and freeze tuning on a tiny HF model folder: the checkpoint is a PEFT adapter folder
that `PeftModel.from_pretrained` loads, a resumed run continues bit for bit, `adapter_name_or_path` starts from an
adapter, and `lazytrain export` merges it into an HF folder whose logits are PEFT's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from test_finetune import _model_dir, _rows, _write_jsonl

from lazytrain.cli import main
from lazytrain.train.metrics import read_rows

peft = pytest.importorskip("peft")
JOB = dict(max_steps=3, per_device_train_batch_size=2, cutoff_len=48, dtype="fp32", planner="megatrain",
           learning_rate=1e-2, warmup_steps=0, progress=False, eval_batches=0, finetuning_type="lora", lora_rank=4,
           lora_target="all")


def _job(tmp_path: Path, family: str = "llama", **keys: object) -> tuple[Path, Path]:
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        _model_dir(model_dir, family)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        _write_jsonl(data, _rows("alpaca", 24))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**JOB, "model": str(model_dir), "dataset": str(data),
                                    "output_dir": str(tmp_path / "run"), **keys}))
    return path, model_dir


def _peft_logits(model_dir: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_run_writes_an_adapter_peft_loads_and_export_merges_it(tmp_path):
    config, model_dir = _job(tmp_path)
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    final = max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    assert not list(final.glob("model*.safetensors"))  # the base is not copied
    losses = [r["loss"] for r in read_rows(run / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0]  # the adapters learned something
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    with_adapter = _peft_logits(model_dir, final, ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, with_adapter)  # B moved off zero: the adapter acts
    assert main(["export", str(final), str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
    # fp32: W + s B A merged vs computed apart differ by a few ulps per product; 1e-4 relative is far above them
    assert float((logits - with_adapter).norm() / with_adapter.norm()) < 1e-4
    transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert main(["export", str(final), str(tmp_path / "bf16")]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.exactness
@pytest.mark.parametrize(("optimizer", "quantization_bit"), [("adamw", None), ("8bit", None), ("adamw", 4)])
def test_lora_resume_is_bit_for_bit(tmp_path, optimizer, quantization_bit):
    """(quantization_bit 4: QLoRA's NF4 base, its bytes streamed as bf16 elements)"""
    config, _ = _job(tmp_path, max_steps=4, save_steps=2, dtype="bf16", optimizer=optimizer,
                     quantization_bit=quantization_bit)
    assert main(["train", str(config)]) == 0
    whole = tmp_path / "run"
    straight = (whole / "checkpoint-4" / "adapter_model.safetensors").read_bytes()
    masters = (whole / "checkpoint-4" / "trainer_state" / "master.safetensors").read_bytes()
    (whole / "checkpoint-4").rename(tmp_path / "first-4")
    assert main(["train", str(config), "resume_from_checkpoint=auto"]) == 0
    assert (whole / "checkpoint-4" / "adapter_model.safetensors").read_bytes() == straight
    assert (whole / "checkpoint-4" / "trainer_state" / "master.safetensors").read_bytes() == masters


def test_adapter_name_or_path_starts_from_an_adapter(tmp_path, capsys):
    config, model_dir = _job(tmp_path, max_steps=1)
    assert main(["train", str(config)]) == 0
    adapter = tmp_path / "run" / "checkpoint-1"
    config2, _ = _job(tmp_path, max_steps=1, learning_rate=1e-12, output_dir=str(tmp_path / "again"),
                      adapter_name_or_path=str(adapter), lora_rank=2)  # its own rank (4) wins, as PEFT's
    assert main(["train", str(config2)]) == 0
    again = tmp_path / "again" / "checkpoint-1"
    ids = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(5))
    # Adam moves each weight by ~lr = 1e-12, far below an fp32 ulp of weights ~0.1 (6e-9): the adapter comes back
    # as it went in, to rounding; a fresh one (B = 0) would give the base's logits, not these
    start, after = _peft_logits(model_dir, adapter, ids), _peft_logits(model_dir, again, ids)
    assert float((after - start).norm() / start.norm()) < 1e-6
    assert main(["train", str(config2), "adapter_name_or_path=" + str(tmp_path), "overwrite_output_dir=true"]) == 2
    assert "not a PEFT adapter folder" in capsys.readouterr().err


def test_freeze_tuning_trains_the_last_layer_only(tmp_path):
    config, model_dir = _job(tmp_path, finetuning_type="freeze", freeze_trainable_layers=1)
    assert main(["train", str(config)]) == 0
    final = max((tmp_path / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    before = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    after = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.layers.1.") for k in changed)


def test_lora_with_optimizer_offload_nvme_keeps_the_adapter_states_in_ram(tmp_path, capsys):
    config, _ = _job(tmp_path, max_steps=2, optimizer_offload="nvme", nvme_dir=str(tmp_path), dtype="bf16")
    assert main(["train", str(config)]) == 0
    assert "the adapters' optimizer states stay in RAM (they are small); optimizer_offload nvme -> host" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["optimizer_offload"] == "host"
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors")
    assert adapter and all(bool(torch.isfinite(t).all()) for t in adapter.values())


# Data parallel: 2 ranks of 1 row each against one process of 2 rows, clipping on (the norms are ~0.2-0.5), gradient
# accumulation 2. The ranks sum each row's gradient apart and then over the ranks, one process in one GEMM: ~1e-7
# relative noise in every gradient. Adam's step is lr-sized whatever |g| where |g| >> adam_epsilon, so the noise
# moves it by ~1e-7 x lr there; epsilon 1e-6 bounds the step of a near-zero gradient element by |g| / 1e-6 x lr, so
# noise of 1e-13 there (1e-7 of |g| ~1e-6) moves it by 1e-7 x lr too: far below atol 1e-6 after 4 steps of lr 1e-3.
PARALLEL = dict(max_steps=4, gradient_accumulation_steps=2, max_grad_norm=0.1, learning_rate=1e-3,
                adam_epsilon=1e-6)
PARALLEL_CASES = {"lora": {}, "freeze": dict(finetuning_type="freeze", freeze_trainable_layers=1),
                  "qlora": dict(quantization_bit=4)}


def _final_tensors(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    final = max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return {k: v for f in sorted(final.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.exactness
@pytest.mark.parametrize("case", ["lora", "freeze", pytest.param("qlora", marks=pytest.mark.slow)])
def test_two_ranks_train_as_one_process_with_the_global_batch(tmp_path, case):
    """torchrun, 2 ranks: the adapters' (freeze tuning: the trained layer's) gradients are summed into their
    owners like any layer group's; QLoRA's second rank quantizes nothing (it maps rank 0's NF4 bytes)."""
    from test_parallel import _torchrun

    config, model_dir = _job(tmp_path, **PARALLEL, **PARALLEL_CASES[case], save_steps=2)
    proc = _torchrun(config, tmp_path / "two", "per_device_train_batch_size=1")
    output = "".join(proc.communicate(timeout=900))
    assert proc.returncode == 0, output[-3000:]
    if case == "lora":  # resumed from checkpoint-2 on 2 ranks: the run never stopped, bit for bit
        shutil.copytree(tmp_path / "two" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
        proc = _torchrun(config, tmp_path / "resumed", "per_device_train_batch_size=1", "resume_from_checkpoint=auto")
        output = "".join(proc.communicate(timeout=900))
        assert proc.returncode == 0, output[-3000:]
        for part in ("adapter_model.safetensors", "trainer_state/master.safetensors"):
            assert (tmp_path / "resumed" / "checkpoint-4" / part).read_bytes() == \
                (tmp_path / "two" / "checkpoint-4" / part).read_bytes(), part
    assert main(["train", str(config), f"output_dir={tmp_path / 'one'}", "per_device_train_batch_size=2"]) == 0
    rows_one, rows_two = read_rows(tmp_path / "one" / "metrics.jsonl"), read_rows(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows_two] == [1, 2, 3, 4]
    for a, b in zip(rows_one, rows_two, strict=True):
        assert b["tokens"] == a["tokens"] and b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6) and a["grad_norm"] > PARALLEL["max_grad_norm"]
    one, two = _final_tensors(tmp_path / "one"), _final_tensors(tmp_path / "two")
    assert two.keys() == one.keys() and one
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=0, atol=1e-6)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    trained = [k for k in one if k.endswith("lora_B.weight") or "layers.1." in k and "norm" not in k]
    assert trained and all(not torch.equal(one[k], base.get(k, torch.zeros_like(one[k]))) for k in trained)
