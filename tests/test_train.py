"""`lazytrain train` end to end on the tiny debug model: metrics, checkpoint, argument errors, golden losses.

Regenerate the golden file (only after a deliberate change of the training math) with
`python tests/test_train.py --regen`.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from lazytrain.cli import main
from lazytrain.errors import LazyTrainError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lazytrain.config import JobConfig, load_job_config  # noqa: E402  (after the importorskip guards)
from lazytrain.train import train  # noqa: E402
from lazytrain.train.metrics import read_rows  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "train_loss.json"
RNG = random.Random(20261202)
# A few seconds per run on 2 cores: 4 layers of width 64, the Zen of Python as corpus.
TINY = ["--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1",
        "--no-progress"]
# The golden run: fp32 so that the executor is exact, a rule plan so that no solver is involved.
GOLDEN_CONFIG = dict(model="debug", corpus="zen", steps=6, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2,
                     dtype="fp32", planner="megatrain", eval_batches=0, seed=0, progress=False)


def job(**values) -> JobConfig:
    """A JobConfig from flat keys (old spellings such as `steps`, `lr` included)."""
    return load_job_config(values)


def test_cli_run_writes_metrics_plan_and_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "3", "--output-dir", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]  # steps count from 1, as the HF Trainer's global_step
    for r in rows:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["predicted_step_s"] > 0 and set(r["stall_s"]) >= {"h2d", "d2h"}
        assert r["peak_device_bytes"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["placement_map"] in printed  # the placement map is printed before training
    assert summary["first_loss"] == rows[0]["loss"] and summary["last_loss"] == rows[-1]["loss"]
    from lazytrain.plan.plan import Plan, spec_of

    model = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-3")
    assert Plan.load(out / "plan.json", spec_of(model)).placement_map() == summary["placement_map"]
    # admission's `host:` line, as `lazytrain plan` prints it, and the whole process's peak beside it
    from lazytrain.units import format_bytes

    host = [line for line in printed.splitlines() if line.startswith("host: ")]
    assert len(host) == 1 and host[0].startswith(f"host: {format_bytes(summary['host_admitted_bytes'])} ("), host
    assert summary["peak_rss_bytes"] > summary["baseline_rss_bytes"] > 0, summary
    assert summary["peak_rss_phase"] in summary["peak_rss_by_phase_bytes"], summary
    assert (out / "checkpoint-3" / "model.safetensors.index.json").exists()  # sharded, with its index


@pytest.mark.exactness
def test_checkpoint_gives_the_trained_models_logits(tmp_path):
    result = train(job(**{**GOLDEN_CONFIG, "steps": 2, "planner": "auto", "output_dir": str(tmp_path / "run")}))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(result.output_dir / "checkpoint-2")
    gen = torch.Generator().manual_seed(RNG.randrange(2**31))
    ids = torch.randint(0, 256, (2, RNG.randrange(5, 30)), generator=gen)
    with torch.no_grad():
        expected = result.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # and training really changed the weights (a checkpoint of the initial model would not pass this)
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config)
    assert not torch.equal(fresh.lm_head.weight, loaded.lm_head.weight)


def test_a_checkpoint_as_model_continues_from_its_weights(tmp_path, capsys):
    first = train(job(**{**GOLDEN_CONFIG, "steps": 2, "eval_batches": 1, "output_dir": str(tmp_path / "a")}))
    checkpoint = first.output_dir / "checkpoint-2"
    second = train(job(**{**GOLDEN_CONFIG, "steps": 1, "eval_batches": 1, "model": str(checkpoint),
                                  "output_dir": str(tmp_path / "b")}))
    assert f"weights from {checkpoint}" in capsys.readouterr().out
    assert second.summary["eval_loss_before"] == pytest.approx(first.summary["eval_loss_after"], rel=1e-6)
    assert second.summary["eval_loss_before"] < first.summary["eval_loss_before"] - 0.1  # not a fresh init


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "0"], "--steps 0"),  # errors name the key as typed
    (["--batch-size", "-2"], "--batch-size -2"),
    (["--lr", "0"], "--lr 0"),
    (["--gpu-mem-cap", "lots"], "--gpu-mem-cap"),
    (["--corpus", "/nonexistent/corpus.txt"], "--corpus"),
    (["--model", "/nonexistent/config.json"], "'/nonexistent/config.json': no such file"),
    (["--seq-len", "100000"], "100000"),
    (["--nvme-dir", "/nonexistent/nvme"], "/nonexistent/nvme"),
    (["--plan", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
    (["--optimizer-mode", "lazy"], "--optimizer-mode 'lazy'"),
    (["num_train_epochs=2"], "num_train_epochs"),
    (["learning_rat=1e-3"], "did you mean 'learning_rate'"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out), *TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err
    assert not (out / "metrics.jsonl").exists()


def test_unwritable_output_dir_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["train", "--output-dir", str(blocker / "run"), *TINY]) == 2
    captured = capsys.readouterr()
    assert "output_dir" in captured.err and "\n" not in captured.err.strip()
    assert "model" not in captured.out  # nothing was built


def test_a_model_over_the_available_host_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    import lazytrain.costmodel.hardware as hardware
    from lazytrain.train.build import check_host_fits

    cfg = job(**{**GOLDEN_CONFIG, "dtype": "bf16", "optimizer": RNG.choice(["adamw", "hybrid8bit"])})
    config = transformers.AutoConfig.for_model("llama", vocab_size=259, hidden_size=64, intermediate_size=160,
                                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    from lazytrain import CostModel, HardwareSpec, ModelSpec, Workload

    spec = ModelSpec.from_config(config)
    need = CostModel(spec, HardwareSpec.load("emulated"), Workload(4, 32, "bf16"),
                     cfg.optim.optimizer).static_host_bytes()
    monkeypatch.setattr(hardware, "available_host_memory_bytes", lambda: need)
    check_host_fits(cfg, spec)  # exactly enough
    short = RNG.randint(1, need // 2)
    monkeypatch.setattr(hardware, "available_host_memory_bytes", lambda: need - short)
    with pytest.raises(LazyTrainError, match=r"^host memory: needs .* streamed copy .*short by"):
        check_host_fits(cfg, spec)

    built = []
    import lazytrain.train.build as build_module

    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: built.append(a))  # only the meta model is built
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out), *TINY, "--dtype", "bf16", "--optimizer", cfg.optim.optimizer]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: host memory: ") and "\n" not in err and "available memory" in err
    assert not built and not (out / "metrics.jsonl").exists()


def test_eager_attention_masks_are_planned_for(tmp_path):
    """Eager attention puts batch x seq^2 masks on the device: the cost model the MILP plans with counts
    them, so the plan fits the cap it was solved under, by the executor's own replay of its allocations."""
    from lazytrain.train.build import build_device, build_executor, build_model, model_source, pick_device_kind
    from lazytrain.train.planning import plan_run

    config = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path / "eager")
    saved = tmp_path / "eager" / "config.json"  # transformers does not save the choice itself
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "attn_implementation": "eager"}))
    cfg = job(**{**GOLDEN_CONFIG, "model": str(saved), "dtype": "bf16", "planner": "milp"})
    model = build_model(cfg, model_source(cfg, 259))
    assert model.config._attn_implementation == "eager"
    generator = torch.Generator().manual_seed(RNG.randrange(2**31))
    batch, seq_len = cfg.data.per_device_train_batch_size, cfg.data.cutoff_len
    ids = torch.randint(0, 256, (batch, seq_len), generator=generator)
    kind = pick_device_kind("cpu")
    planned = plan_run(cfg, model, kind, (ids, ids.clone()))
    ex = build_executor(model, planned.plan, planned.cost, build_device(cfg, kind, None), cfg)
    masks = batch * seq_len**2 * 2  # one causal mask, bf16
    assert planned.cost.constant_device_bytes == ex.memory_sizes(batch, seq_len).constant_bytes
    assert planned.cost.constant_device_bytes > masks
    assert ex.predicted_peak_bytes(batch, seq_len) <= planned.budgets["gpu_mem_cap_bytes"]


def test_the_optimizer_is_calibrated_while_the_probe_device_lives(monkeypatch):
    """The serial optimizer's calibration steps run with the probe device's link threads alive, as the run's own
    are while it trains: with them (and their OpenMP teams) gone, libgomp spins at every barrier, and on a shared
    machine the optimizer step measured 50x slower than it runs (docs/benchmarks.md)."""
    from lazytrain.train import planning
    from lazytrain.train.build import build_model, model_source
    from lazytrain.train.run_data import load_data

    cfg = job(**GOLDEN_CONFIG, optimizer_mode="serial")
    data = load_data(cfg)
    model = build_model(cfg, model_source(cfg, data.vocab_size))
    alive = []
    step = planning.optimizer_step

    def timed(job_, optimizer, executor, **kwargs):
        alive.append(all(link._thread.is_alive() for link in executor.device.links.values()))
        return step(job_, optimizer, executor, **kwargs)

    monkeypatch.setattr(planning, "optimizer_step", timed)
    devices = []
    build = planning.build_device
    monkeypatch.setattr(planning, "build_device", lambda *a, **k: devices.append(build(*a, **k)) or devices[-1])
    cost = planning.measured_cost(cfg, model, "cpu", data.probe)
    assert alive == [True] * 5 and cost.hardware.host_mem_gbps > 0
    for link in devices[0].links.values():  # closed once calibrated
        link._thread.join(timeout=60)
        assert not link._thread.is_alive()


@pytest.mark.parametrize("masters, offload, world", [("fp32", "nvme", 1), ("bf16", "nvme", 1), ("bf16", "host", 2)])
def test_with_the_states_on_nvme_the_calibration_holds_one_layers_states(monkeypatch, tmp_path, masters, offload,
                                                                         world):
    """The run's states never sit in host memory together (on NVMe; or sharded over ranks): its calibration steps
    the largest layer's alone (its fp32 masters read from the model's file for it, the others left there), and the
    update's seconds are the measured ones scaled to the whole model by its share of the parameters."""
    import statistics

    from lazytrain.runtime import probe
    from lazytrain.runtime.calibrate import QUANTUM
    from lazytrain.runtime.weights import held_elsewhere
    from lazytrain.train import planning
    from lazytrain.train.build import build_model, model_source
    from lazytrain.train.run_data import load_data

    torch.manual_seed(RNG.randrange(1 << 31))
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=RNG.choice([96, 128]),
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    saved = transformers.LlamaForCausalLM(config)
    for p in saved.parameters():
        p.data.normal_(0, 0.05)
    saved.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    # (world 2: the states sharded over the ranks, rank 0 calibrating for all: the job as torchrun's ranks resolve it)
    cfg = job(**{**GOLDEN_CONFIG, "model": str(tmp_path / "model"), "dtype": "bf16"}, master_weights=masters,
              optimizer="8bit", optimizer_offload=offload, nvme_dir=str(tmp_path), world_size=world)
    data = load_data(cfg)
    model = build_model(cfg, model_source(cfg, data.vocab_size))
    built, probed = [], []
    make = planning.build_optimizer
    monkeypatch.setattr(planning, "build_optimizer", lambda *a, **k: built.append(make(*a, **k)) or built[-1])
    take = probe.probe_steps
    monkeypatch.setattr(probe, "probe_steps", lambda step: probed.extend(take(step)) or probed)
    cost = planning.measured_cost(cfg, model, "cpu", data.probe)
    layer = list(model.model.layers[0].parameters())  # (the layers are alike: the first is the largest)
    assert [p for g in built[0].param_groups for p in g["params"]] == layer
    updates = sorted(sum(end - start for lane, name, start, end in s.timeline
                         if lane == "optimizer" and name.startswith("update ")) for s in probed)
    share = sum(p.numel() for p in layer) / sum(p.numel() for p in model.parameters())
    assert cost.total_optimizer_s == pytest.approx(statistics.median(updates) / share, rel=QUANTUM)
    # fp32 masters bound for the state files are still only in the model's file, the stepped layer's included
    assert [held_elsewhere(p) for p in model.parameters()] == [masters == "fp32" and offload == "nvme" and p is not
                                                               model.model.embed_tokens.weight
                                                               for p in model.parameters()]


@pytest.mark.parametrize("optimizer", ["adamw", "hybrid8bit"])
def test_the_overlapped_update_is_calibrated_on_the_probes_optimizer_lane(monkeypatch, optimizer):
    """Overlap mode times the update where the run runs it: each probe step runs the last one's update on its
    optimizer lane under its forward. The calibrated optimizer's seconds are those measured there, no serial step
    runs, and the weights do not move (learning rate 0, weight decay on)."""
    import statistics

    from lazytrain.runtime import probe
    from lazytrain.runtime.calibrate import QUANTUM
    from lazytrain.train import planning
    from lazytrain.train.build import build_model, model_source
    from lazytrain.train.run_data import load_data

    cfg = job(**GOLDEN_CONFIG, optimizer=optimizer, weight_decay=0.1)
    assert cfg.optim.optimizer_mode == "overlap"
    data = load_data(cfg)
    model = build_model(cfg, model_source(cfg, data.vocab_size))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    probed = []
    take = probe.probe_steps
    monkeypatch.setattr(probe, "probe_steps", lambda step: probed.extend(take(step)) or probed)
    monkeypatch.setattr(planning, "optimizer_step", lambda *a, **k: pytest.fail("a serial optimizer step ran"))
    cost = planning.measured_cost(cfg, model, "cpu", data.probe)
    updates = sorted(sum(end - start for lane, name, start, end in s.timeline
                         if lane == "optimizer" and name.startswith("update ")) for s in probed)
    assert len(probed) >= 3 and updates[0] > 0  # every measured step ran an update (the warm-up's came first)
    assert cost.total_optimizer_s == pytest.approx(statistics.median(updates), rel=QUANTUM)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_a_plan_for_another_model_is_refused(tmp_path, capsys):
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.plan.plan import Plan

    other = ModelSpec.load("tiny-llama")
    plan_file = tmp_path / "other.json"
    Plan.from_tiers(other, ["gpu"] * (other.num_layers + 1)).save(plan_file)
    assert main(["train", "--output-dir", str(tmp_path / "run"), "--plan", str(plan_file), *TINY]) == 2
    assert "plan was made for model" in capsys.readouterr().err


def test_a_saved_plan_of_this_model_is_used(tmp_path, capsys):
    first = tmp_path / "first"
    assert main(["train", "--steps", "1", "--output-dir", str(first), "--planner", "recompute-all", *TINY]) == 0
    capsys.readouterr()
    second = tmp_path / "second"
    assert main(["train", "--steps", "1", "--output-dir", str(second), "--plan", str(first / "plan.json"),
                 *TINY]) == 0
    assert "GRRRG" in capsys.readouterr().out
    assert json.loads((second / "summary.json").read_text())["placement_map"] == "GRRRG"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    assert main(["train", "--device", "cuda", "--output-dir", str(tmp_path / "run"), *TINY]) == 2
    assert "device cuda" in capsys.readouterr().err


@pytest.mark.exactness
def test_losses_match_the_golden_file(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert golden["config"] == GOLDEN_CONFIG, "the golden config changed: regenerate the file (see module docstring)"
    result = train(job(**GOLDEN_CONFIG, output_dir=str(tmp_path / "run")))
    # another CPU sums in another order: the forward's fp32 rounding is ~1e-6 of the loss, and AdamW moves an element
    # whose gradient is rounding noise by up to lr either way, which moves the loss at second order only (that
    # gradient is ~0); 2e-4 + 2e-4 x 5.6 = 1.3e-3 is 1/600 of the six steps' drop (0.78) and far above both
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(golden["losses"]), rtol=2e-4, atol=2e-4,
        msg=lambda m: f"{m}\nlosses {result.losses} differ from {GOLDEN} (made with torch {golden['torch']}, "
                      f"transformers {golden['transformers']}); if the training math changed on purpose, "
                      "regenerate it: python tests/test_train.py --regen")
    assert result.losses[-1] < result.losses[0] - 0.1


@pytest.mark.exactness
def test_bf16_streaming_tracks_the_fp32_golden_curve(tmp_path):
    """bf16 compute with fp32 master weights learns like fp32: the streamed bf16 weights follow every update."""
    golden = json.loads(GOLDEN.read_text())
    result = train(job(**{**GOLDEN_CONFIG, "dtype": "bf16"}, output_dir=str(tmp_path / "run")))
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(golden["losses"]), rtol=0, atol=0.05)


@pytest.mark.parametrize("optimizer, lo, hi", [("adamw", 8.0, 8.0), ("hybrid8bit", 7.5, 8.0), ("8bit", 2.0, 3.5)])
def test_optimizer_choice_sets_the_state_bytes(optimizer, lo, hi):
    """--optimizer 8bit keeps the states of every tensor of 4096+ elements in 8 bits; hybrid8bit the paper's 2%."""
    from lazytrain.train.build import build_model, model_source
    from lazytrain.train.optimizer import build_optimizer

    cfg = job(**{**GOLDEN_CONFIG, "optimizer": optimizer})
    model = build_model(cfg, model_source(cfg, 259))
    opt = build_optimizer(cfg, model)
    n = sum(p.numel() for p in model.parameters())
    if optimizer == "adamw":
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()  # torch allocates AdamW's states at the first step
        state_bytes = sum(s[k].numel() * s[k].element_size() for s in opt.state.values()
                          for k in ("exp_avg", "exp_avg_sq"))
    else:
        state_bytes = opt.state_bytes()
    assert lo <= state_bytes / n <= hi


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run_uses_the_gpu(tmp_path, capsys):
    assert main(["train", "--steps", "3", "--device", "auto", "--output-dir", str(tmp_path / "run"), *TINY]) == 0
    assert "CudaDevice" in capsys.readouterr().out
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)


if __name__ == "__main__" and sys.argv[1:] == ["--regen"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        losses = train(job(**GOLDEN_CONFIG, output_dir=tmp)).losses
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"config": GOLDEN_CONFIG, "torch": torch.__version__,
                                  "transformers": transformers.__version__, "losses": losses}, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {losses}")


@pytest.mark.parametrize("name, kwargs", [
    ("linear", {}), ("cosine", {}), ("cosine_with_restarts", {"num_cycles": 2}), ("polynomial", {"power": 2.0}),
    ("constant", {}), ("constant_with_warmup", {}), ("inverse_sqrt", {}), ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 3}),
])
def test_every_schedule_is_transformers_own(name, kwargs):
    """The learning rate of every update equals what transformers.get_scheduler gives a real optimizer, stepped as
    the HF Trainer steps it (the rate of update k is the scheduler's after k steps)."""
    from lazytrain.train.optimizer import Schedule

    steps, warmup = RNG.randrange(8, 30), RNG.choice([0, 3, 0.2])
    job = load_job_config(dict(model="qwen2.5-7b", max_steps=steps, learning_rate=2e-4, warmup_steps=warmup,
                               lr_scheduler_type=name, lr_scheduler_kwargs=kwargs))
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=2e-4)
    warmup_count = math.ceil(warmup * steps) if isinstance(warmup, float) else warmup
    scheduler = transformers.get_scheduler(name, optimizer, num_warmup_steps=warmup_count, num_training_steps=steps,
                                           scheduler_specific_kwargs=kwargs)
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    schedule = Schedule(job)
    assert [schedule.lr_at(k) for k in range(steps)] == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_bad_schedule_arguments_are_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out), *TINY, "--steps", "2", "lr_scheduler_type=linear",
                 "lr_scheduler_kwargs={num_cycles: 2}"]) == 2  # linear takes no num_cycles (cosine would)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: lr_scheduler_type linear with lr_scheduler_kwargs {'num_cycles': 2}: ") and \
        "\n" not in err, err
    assert not out.exists()


def test_eval_scores_the_whole_held_out_split_unless_capped_and_says_when_it_cuts(tmp_path, capsys):
    base = {**GOLDEN_CONFIG, "steps": 2, "seq_len": 8, "batch_size": 2, "output_dir": str(tmp_path / "a")}
    whole = train(job(**{**base, "eval_batches": None}))
    windows = whole.summary["eval_examples"]
    from lazytrain.data.corpus import ByteTokenizer, TokenData

    held_out = len(TokenData.from_corpus("zen", ByteTokenizer()).val)
    assert windows == math.ceil(held_out / 8) and "eval_batches" not in capsys.readouterr().out
    capped = train(job(**{**base, "eval_batches": 1, "output_dir": str(tmp_path / "b")}))
    assert capped.summary["eval_examples"] == 2  # one batch of 2 windows
    assert f"eval     eval_batches 1 scores 2 of the {windows} held-out windows of 8 tokens" in capsys.readouterr().out


def test_a_resumed_runs_summary_counts_its_own_steps(tmp_path):
    """The resumed process ran steps 3 and 4 only: its "time in the steps" and medians are theirs."""
    base = {**GOLDEN_CONFIG, "steps": 4, "save_steps": 2, "output_dir": str(tmp_path / "run")}
    first = train(job(**base))
    import shutil

    shutil.rmtree(first.output_dir / "checkpoint-4")
    resumed = train(job(**base, resume_from_checkpoint="auto"))
    assert first.summary["steps_this_run"] == 4 and resumed.summary["steps_this_run"] == 2
    # its time in the steps is the sum of the two steps it logged (the last rows of steps 3 and 4), not of four
    rows = {r["step"]: r for r in map(json.loads, (resumed.output_dir / "metrics.jsonl").read_text().splitlines())
            if "step_s" in r}
    assert resumed.summary["total_train_s"] == pytest.approx(rows[3]["step_s"] + rows[4]["step_s"], rel=1e-12)
    state = transformers.TrainerState.load_from_json(str(resumed.output_dir / "checkpoint-4" / "trainer_state.json"))
    assert state.global_step == 4 and [e["step"] for e in state.log_history] == [1, 2, 3, 4]  # across the resume


def test_a_failed_run_stops_its_peak_rss_sampler(tmp_path):
    """The sampler thread of the run's peak RSS ends with the run, also when the run fails (it read
    /proc/self/status every 5 ms for the life of the process after a failed in-process run)."""
    (tmp_path / "data.jsonl").write_text("this is no JSON line\n")
    golden = {k: v for k, v in GOLDEN_CONFIG.items() if k != "corpus"}
    failing = job(**{**golden, "dataset": str(tmp_path / "data.jsonl"), "output_dir": str(tmp_path / "run")})
    with pytest.raises(LazyTrainError, match="data.jsonl"):  # read in the run, after the sampler started
        train(failing)
    import threading

    assert [t for t in threading.enumerate() if t.name == "lazytrain-peak-rss"] == []
