"""`lazytrain plan` end to end: output, plan file, --max-batch, and one-line errors (exit 2) on bad input."""

from __future__ import annotations

import json

import pytest

from lazytrain.cli import main
from lazytrain.plan.plan import Plan
from lazytrain.spec.model import PRESET_DIR, ModelSpec

PAPER = ["plan", "--model", "qwen3.6-27b", "--hardware", "h800", "--batch-size", "72", "--seq-len", "1024",
         "--gpu-mem-cap", "70GB", "--cpu-act-budget", "15GB", "--nvme-act-budget", "32GB"]


def test_paper_instance_prints_the_plan_and_writes_it(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    assert main([*PAPER, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    placement = lines[lines.index(next(line for line in lines if line.startswith("placement"))) + 1]
    assert len(placement) == 65 and set(placement) <= set("GCNR") and placement[0] == placement[-1] == "G"
    assert "counts: gpu" in out and "recomputed boundaries:" in out
    assert "solver: highs optimal" in out and "gap 0" in out
    assert "megatrain K=4" in out and "serial" in out  # the simulated MegaTrain rule beside the plan
    plan = Plan.load(path, spec=ModelSpec.load("qwen3.6-27b"))
    assert plan.placement_map() == placement
    assert plan.prediction is not None and plan.prediction.step_s > 0
    assert plan.report.planner == "milp" and plan.report.status == "optimal"
    assert plan.budgets_bytes["gpu_mem_cap_bytes"] == 70 * 10**9


def test_rule_instead_of_the_milp(capsys) -> None:
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--batch-size", "8",
                 "--rule", "megatrain", "--interval", "3"]) == 0
    out = capsys.readouterr().out
    assert "GRRGRRG" in out and "rule: megatrain K=3" in out


def test_model_from_a_config_path(tmp_path, capsys) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    config = json.loads((PRESET_DIR / "tiny-llama.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config))
    for model in (str(model_dir), str(model_dir / "config.json")):
        assert main(["plan", "--model", model, "--hardware", "emulated", "--batch-size", "2", "--seq-len", "32"]) == 0
        assert "model my-model (4 layers" in capsys.readouterr().out


def test_hardware_from_a_yaml_file(tmp_path, capsys) -> None:
    path = tmp_path / "my-gpu.yaml"
    path.write_text("base: rtx3090\ngpu_mem_bytes: 20GiB\nh2d_gbps: 8\n")
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", str(path), "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "hardware my-gpu" in out and "gpu cap 20 GiB" in out


def test_max_batch_reports_every_planner(capsys) -> None:
    assert main(["plan", "--model", "tiny-llama", "--hardware", "emulated", "--seq-len", "64",
                 "--gpu-mem-cap", "2MiB", "--max-batch"]) == 0
    out = capsys.readouterr().out
    sizes = {line.split()[0]: int(line.split()[-1]) for line in out.splitlines()[1:]}
    assert set(sizes) == {"milp", "megatrain", "keep-all", "recompute-all", "offload-all"}
    assert sizes["milp"] >= max(sizes.values()) and sizes["milp"] >= 1


def test_scip_solver(capsys) -> None:
    pytest.importorskip("pyscipopt")
    assert main(["plan", "--model", "qwen2.5-3b", "--batch-size", "64", "--gpu-mem-cap", "30GB",
                 "--solver", "scip"]) == 0
    assert "solver: scip optimal" in capsys.readouterr().out


BAD = {
    "missing config": ["--model", "/no/such/dir/config.json"],
    "unknown preset": ["--model", "qwen9-999b"],
    "no model": [],
    "unknown hardware": ["--model", "tiny-llama", "--hardware", "tpu-v9"],
    "negative size": ["--model", "tiny-llama", "--gpu-mem-cap=-5GB"],
    "negative size, space-separated": ["--model", "tiny-llama", "--gpu-mem-cap", "-5GB"],
    "unparseable size": ["--model", "tiny-llama", "--cpu-act-budget", "lots"],
    "negative batch": ["--model", "tiny-llama", "--batch-size", "-1"],
    "unparseable batch": ["--model", "tiny-llama", "--batch-size", "many"],
    "zero seq": ["--model", "tiny-llama", "--seq-len", "0"],
    "bad solver": ["--model", "tiny-llama", "--solver", "cplex"],
    "bad rule": ["--model", "tiny-llama", "--rule", "sometimes"],
    "bad gap": ["--model", "tiny-llama", "--mip-gap", "2"],
    "infeasible gpu cap": ["--model", "qwen2.5-7b", "--hardware", "h800", "--gpu-mem-cap", "8GB"],
    "infeasible host": ["--model", "qwen2.5-14b", "--hardware", "h800", "--cpu-mem", "64GB"],
    "infeasible activations": ["--model", "qwen2.5-7b", "--hardware", "h800", "--gpu-mem-cap", "60GB",
                               "--cpu-act-budget", "0", "--max-segment", "1", "--batch-size", "128"],
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_line_and_exit_2(case: str, capsys) -> None:
    argv = ["plan", *BAD[case]]
    if "--batch-size" not in argv:
        argv += ["--batch-size", "16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    if case.startswith("negative size"):
        assert "negative" in err, err


def test_malformed_config_file(tmp_path, capsys) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{ not json")
    not_llm = tmp_path / "config.json"
    not_llm.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    for path in (bad_json, not_llm):
        assert main(["plan", "--model", str(path), "--batch-size", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err


def test_trace_and_timeline_of_the_predicted_program(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    trace, picture = tmp_path / "step.json", tmp_path / "step.png"
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--batch-size", "8", "--gpu-mem-cap", "30GB",
                 "--trace", str(trace), "--timeline", str(picture)]) == 0
    assert f"trace written to {trace}" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "h2d", "d2h", "optimizer"} <= tracks
    ops = [e for e in events if e["ph"] == "X"]
    assert len({e["tid"] for e in ops}) == len(tracks)  # one track per lane, each with its ops
    assert sum(e["name"].startswith("F") and e["cat"] == "compute" for e in ops) == 36  # every layer's forward
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in ops)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
