"""HF's `eval_strategy` / `save_strategy` / `logging_strategy: epoch` and `load_best_model_at_end`, as the HF Trainer's
DefaultFlowCallback and _save_checkpoint decide them: evaluate, save and log at the end of every epoch (an epoch in
optimizer steps as num_train_epochs counts it; with max_steps set, epochs still end every pass, and the last step
evaluates and saves); a run resumed mid-epoch does so at the same steps as the one never stopped; the best checkpoint
survives save_total_limit and is the run's model at the end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from lazytrain.config import load_job_config
from lazytrain.data.tokenizer import train_bpe_tokenizer
from lazytrain.errors import LazyTrainError
from lazytrain.train import train
from lazytrain.train.metrics import read_rows
from lazytrain.train.signals import Interrupted
from lazytrain.train.trainer import Evaluation, Trainer

RNG = random.Random()
WORDS = "the cat sat on a mat and the dog ran to see what it was doing while birds sang all day long".split()
EXAMPLES, HELD_OUT, BATCH, ACCUM = 21, 4, 2, 2
# 17 training examples, one a row: 9 batches a pass (the last runs into the next epoch); 9 // 2 = 4 steps an epoch
STEPS_PER_EPOCH = (EXAMPLES - HELD_OUT + BATCH - 1) // BATCH // ACCUM


def _words(n: int) -> str:
    return " ".join(RNG.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def job_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny random Qwen2 folder with its tokenizer, and an alpaca file."""
    root = tmp_path_factory.mktemp("epochs")
    tokenizer = train_bpe_tokenizer([_words(RNG.randrange(5, 15)) for _ in range(200)], vocab_size=300)
    tokenizer.save_pretrained(str(root / "model"))
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(RNG.randrange(2**31))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "model"))
    rows = [{"instruction": _words(RNG.randrange(2, 6)), "input": "", "output": _words(RNG.randrange(2, 6))}
            for _ in range(EXAMPLES)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), "dataset": str(root / "data.jsonl")}


def _job(files: dict[str, str], out: Path, **keys: object):
    values = dict(model_name_or_path=files["model"], dataset=files["dataset"], val_size=HELD_OUT, cutoff_len=32,
                  per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, learning_rate=1e-3,
                  dtype="fp32", planner="megatrain", progress=False, plot_loss=False, output_dir=str(out),
                  seed=RNG.randrange(1000))
    return load_job_config({**values, **keys})


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("checkpoint-")) for p in out.glob("checkpoint-*"))


EPOCHS = dict(eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch",
              eval_steps=3, save_steps=3, logging_steps=3)  # the *_steps are unused under epoch, as in HF


def test_epoch_strategies_with_max_steps_act_at_each_epochs_end_and_the_last_step(job_files, tmp_path, capsys):
    out = tmp_path / "run"
    result = train(_job(job_files, out, max_steps=10, **EPOCHS))
    e = STEPS_PER_EPOCH
    assert f"epochs   an epoch = {e} optimizer steps" in capsys.readouterr().out
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [e, 2 * e, 10]  # logged at each epoch's end and at the last step
    assert [r["step"] for r in rows if "eval_loss" in r] == [e, 2 * e, 10]
    assert all(r["eval_examples"] == HELD_OUT for r in rows if "eval_loss" in r)
    assert _checkpoints(out) == [e, 2 * e, 10]  # checkpoint-<global_step>
    # the evaluation after training is the last step's (not a second one)
    assert result.summary["eval_loss_after"] == rows[-1]["eval_loss"]


def test_epoch_strategies_with_num_train_epochs(job_files, tmp_path):
    out = tmp_path / "run"
    train(_job(job_files, out, num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch"))
    e = STEPS_PER_EPOCH
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 2 * e + 1))  # logging_steps 1 (steps strategy)
    assert [r["step"] for r in rows if "eval_loss" in r] == [e, 2 * e]
    assert _checkpoints(out) == [e, 2 * e]


def _stop_after(step: int):
    def stop_requested(self: Trainer, signals: object) -> bool:
        return self.state.step == step

    return stop_requested


@pytest.mark.exactness
def test_a_run_resumed_mid_epoch_evaluates_and_saves_at_the_same_steps(job_files, tmp_path, monkeypatch):
    seed, e = RNG.randrange(1000), STEPS_PER_EPOCH
    whole = train(_job(job_files, tmp_path / "whole", max_steps=3 * e - 1, seed=seed, **EPOCHS))
    out = tmp_path / "parts"
    stop_at = e + RNG.randrange(1, e)  # inside the second epoch
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "stop_requested", _stop_after(stop_at))
        with pytest.raises(Interrupted):
            train(_job(job_files, out, max_steps=3 * e - 1, seed=seed, **EPOCHS))
    assert _checkpoints(out) == [e, stop_at]  # the signal's checkpoint mid-epoch
    resumed = train(_job(job_files, out, max_steps=3 * e - 1, seed=seed, resume_from_checkpoint="auto", **EPOCHS))
    expected, got = read_rows(tmp_path / "whole" / "metrics.jsonl"), read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [e, 2 * e, 3 * e - 1]
    for a, b in zip(expected, got, strict=True):  # the same kernels in the same order: bit for bit
        assert (b["loss"], b["eval_loss"]) == (a["loss"], a["eval_loss"])
    assert _checkpoints(out) == [e, stop_at, 2 * e, 3 * e - 1]
    assert resumed.losses == whole.losses


def test_a_text_corpus_has_no_epochs_to_act_on(tmp_path):
    job = load_job_config(dict(model="debug", corpus="zen", batch_size=2, seq_len=16, steps=2, dtype="fp32",
                               planner="megatrain", progress=False, output_dir=str(tmp_path / "run"),
                               eval_strategy="epoch"))
    with pytest.raises(LazyTrainError, match=r"^eval_strategy epoch: dataset zen is a text corpus read in random "
                                             r"windows, with no epochs; set the steps strategy"):
        train(job)
    assert not (tmp_path / "run").exists()


# ---- load_best_model_at_end ---------------------------------------------------------------------------
def _scripted(losses: list[float]):
    """Trainer.evaluate returning `losses` in order (the first: before training)."""
    left = list(losses)

    def evaluate(self: Trainer, stop: object = None) -> Evaluation:
        return Evaluation(left.pop(0), HELD_OUT, 100)

    return evaluate


def test_the_best_checkpoint_is_kept_and_is_the_runs_model_as_the_hf_trainer_decides(job_files, tmp_path,
                                                                                      monkeypatch, capsys):
    """eval every 2 steps, save every 4: the best eval_loss is at step 6, which has no checkpoint; the HF Trainer
    then keeps pointing at checkpoint-4 (the best when saved), and save_total_limit 1 leaves it alone."""
    monkeypatch.setattr(Trainer, "evaluate", _scripted([9.0, 3.0, 2.0, 1.5, 2.5]))
    out = tmp_path / "run"
    result = train(_job(job_files, out, max_steps=8, eval_strategy="steps", eval_steps=2, save_steps=4,
                        save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="eval_loss"))
    assert _checkpoints(out) == [4]
    assert result.best_checkpoint == out / "checkpoint-4"
    assert (result.summary["best_metric"], result.summary["best_global_step"]) == (1.5, 6)
    assert result.summary["best_model_checkpoint"] == str(out / "checkpoint-4")
    printed = capsys.readouterr().out
    assert "best     checkpoint-4: the lowest eval_loss 1.5000 (step 6) is the run's model" in printed
    assert "checkpoint-4/)" in printed.splitlines()[-1]
    state = transformers.TrainerState.load_from_json(str(out / "checkpoint-4" / "trainer_state.json"))
    assert state.best_model_checkpoint == str(out / "checkpoint-4") and state.best_metric == 2.0
    assert transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-4") is not None


def test_the_best_checkpoint_survives_rotation_and_a_resume(job_files, tmp_path, monkeypatch):
    """The same run stopped after step 5 and resumed: the best is read back from the checkpoint's
    trainer_state.json, as the HF Trainer resumes it; save_total_limit 2 keeps the best and the newest."""
    losses = [9.0, 3.0, 2.0, 1.5, 2.5, 2.6]
    out = tmp_path / "run"
    keys = dict(max_steps=10, eval_strategy="steps", eval_steps=2, save_steps=4, save_total_limit=2,
                load_best_model_at_end=True, seed=RNG.randrange(1000))
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "evaluate", _scripted(losses[:3]))
        patch.setattr(Trainer, "stop_requested", _stop_after(5))
        with pytest.raises(Interrupted):
            train(_job(job_files, out, **keys))
    assert _checkpoints(out) == [4, 5]
    monkeypatch.setattr(Trainer, "evaluate", _scripted([2.2, *losses[3:]]))  # the first: at the resume
    result = train(_job(job_files, out, resume_from_checkpoint="auto", **keys))
    # saves at 8 and 10 rotate 5 and 8 away; 4 (the best when saved) stays
    assert _checkpoints(out) == [4, 10]
    assert result.summary["best_model_checkpoint"] == str(out / "checkpoint-4")
    assert (result.summary["best_metric"], result.summary["best_global_step"]) == (1.5, 6)


def test_the_best_checkpoint_read_back_at_resume_is_looked_up_in_the_run_never_followed(tmp_path):
    """trainer_state.json is data: its best_model_checkpoint is matched by name among the run's own complete
    checkpoints (a run directory that moved keeps its best). A path elsewhere, a damaged checkpoint, one after the
    best step, a best step after the checkpoint read, a non-finite metric or a step that is no count are not taken,
    and the metric is forgotten with its checkpoint (a forged best_metric was kept for a checkpoint forgotten)."""
    from lazytrain.train.checkpoint import FORMAT, MANIFEST
    from lazytrain.train.trainer import best_of

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    for folder in (run / "checkpoint-4", run / "checkpoint-8", elsewhere / "model"):
        (folder / MANIFEST).parent.mkdir(parents=True)
        (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": {}}))
    metric = round(RNG.uniform(0.5, 3.0), 4)

    def read(best: object, value: object = metric, step: object = 4) -> tuple[object, object]:
        (run / "checkpoint-8" / "trainer_state.json").write_text(json.dumps(
            {"best_metric": value, "best_global_step": step, "best_model_checkpoint": best}))
        return best_of(run / "checkpoint-8")

    assert read(str(run / "checkpoint-4")) == ((metric, 4), run / "checkpoint-4")
    assert read("/a/run/that/moved/checkpoint-4") == ((metric, 4), run / "checkpoint-4")
    assert read(None, step=6) == ((metric, 6), None)  # the best step was evaluated, not saved: the HF Trainer's state
    assert read(str(run / "checkpoint-4"), step=6) == ((metric, 6), run / "checkpoint-4")  # the best saved before it
    assert read(str(elsewhere / "model")) == (None, None)
    assert read(str(elsewhere / "model" / ".." / ".." / "run" / "checkpoint-9")) == (None, None)
    assert read(str(run / "checkpoint-8"), step=4) == (None, None)  # a checkpoint after its best step
    assert read(None, step=9) == (None, None)  # a best after the checkpoint that records it
    (run / "checkpoint-4" / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": {"model.safetensors": {
        "bytes": 10, "xxh3_128": "0" * 32}}}))  # its weights are missing
    assert read(str(run / "checkpoint-4")) == (None, None)
    for value, step in ((float("nan"), 4), (float("inf"), 4), (True, 4), (metric, -1), (metric, 4.5)):
        assert read(str(run / "checkpoint-8"), value, step) == (None, None)


def test_load_best_model_at_end_without_a_held_out_set_is_one_line(job_files, tmp_path):
    job = _job(job_files, tmp_path / "run", val_size=None, max_steps=2, eval_steps=1, save_steps=1,
               load_best_model_at_end=True)
    with pytest.raises(LazyTrainError, match="^load_best_model_at_end needs a held-out set"):
        train(job)
    assert not (tmp_path / "run").exists()
