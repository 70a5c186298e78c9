"""The output directory (train/rundir.py): one run owns it at a time (an OS lock that dies with its process), default
directories are unique, a dead run's temporaries are swept, a directory deleted mid-run stops the run in one line,
overwrite never follows a link, and metrics.jsonl cut short by a kill resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from checks import cli_error
from paused_run import ARGV, start, wait_for

from lazytrain.cli import main
from lazytrain.data.default_job_files import prepare_default_job
from lazytrain.train.checkpoint import incomplete_reason
from lazytrain.train.rundir import LOCK


def _train(out: Path, *words: str) -> int:
    return main(["train", *ARGV, *words, "--output-dir", str(out)])


def test_a_second_run_on_a_held_output_dir_is_refused_naming_the_holder(tmp_path, capsys):
    """While a run trains in a directory, a second run there -- a resume, a fresh one with overwrite, one that
    would make it -- is refused in one line naming the first's pid, and touches nothing; after kill -9 of the
    first (its lock goes with it: never stale) the directory is free and `auto` resumes."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    proc = start(out, marker, "step:4", "--steps", "6", "save_steps=2", pause_s=120)
    try:
        wait_for(marker, proc)
        before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK}
        for words in (["resume_from_checkpoint=auto"], ["overwrite_output_dir=true"]):
            assert _train(out, "--steps", "6", *words) == 2
            err = cli_error(capsys)
            assert f"output_dir {out} is in use by another run (pid {proc.pid} holds" in err, err
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK} == before
    finally:
        proc.kill()
        proc.communicate()
    assert _train(out, "--steps", "6", "save_steps=2", "resume_from_checkpoint=auto") == 0
    assert incomplete_reason(out / "checkpoint-6") is None


def test_default_output_dirs_are_unique_within_a_second(tmp_path):
    """Two runs started in the same second without output_dir get their own `runs/<time>-<pid>`."""
    code = "from lazytrain.train.rundir import default_output_dir; print(default_output_dir())"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    names = [p.communicate()[0].strip() for p in procs]
    assert names[0] != names[1] and all(n.startswith("runs/") and n.endswith(f"-{p.pid}") for n, p in
                                        zip(names, procs, strict=True))


def test_a_dead_runs_temporaries_are_swept_by_the_next_run(tmp_path):
    """A killed run's `.tmp-checkpoint-N`, `.old-checkpoint-N`, `.<file>.<pid>.tmp` and the old `.write-test` and
    `step_trace_*.json.tmp` are removed by the next run that takes the directory."""
    out = tmp_path / "run"
    assert _train(out, "--steps", "2") == 0
    litter = [out / ".tmp-checkpoint-4", out / ".old-checkpoint-2", out / ".plan.json.12345.tmp",
              out / ".write-test", out / "step_trace_measured.json.tmp"]
    litter[0].mkdir()
    (litter[0] / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
    litter[1].mkdir()
    for path in litter[2:]:
        path.write_text("half")
    assert _train(out, "--steps", "3", "resume_from_checkpoint=auto") == 0
    assert [p for p in litter if p.exists()] == []


def test_a_killed_default_job_preparation_leaves_nothing_behind(tmp_path):
    """A default-job folder staged by a process that died is removed by the next preparation; a live one's stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    staged = [tmp_path / f".job.tmp-{dead.pid}", tmp_path / f".job.tmp-{os.getppid()}"]
    for path in staged:
        (path / "model").mkdir(parents=True)
    prepare_default_job(tmp_path / "job", shapes=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                      num_attention_heads=2, num_key_value_heads=2),
                        num_train=20, num_heldout=4)
    assert not staged[0].exists() and staged[1].exists()
    assert (tmp_path / "job" / "recipe.json").exists()


def test_an_output_dir_deleted_mid_run_stops_it_in_one_line(tmp_path):
    """`rm -rf output_dir` while the run trains: its next write says so and the run stops (it wrote on into an
    unlinked metrics file and re-created the directory for its checkpoint); nothing is re-created."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    proc = start(out, marker, "step:3", "--steps", "6", "save_steps=2", pause_s=2)
    wait_for(marker, proc)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "was deleted or replaced while the run wrote into it" in lines[0], err[-2000:]
    assert not out.exists()


def test_overwrite_unlinks_a_symlinked_checkpoint_and_never_follows_it(tmp_path, capsys):
    """overwrite_output_dir with a `checkpoint-*` that is a link to a directory elsewhere: the link goes, the
    directory it pointed to stays whole (it was a traceback: rmtree refuses links)."""
    out, elsewhere = tmp_path / "run", tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    out.mkdir()
    (out / "checkpoint-9").symlink_to(elsewhere, target_is_directory=True)
    (out / "metrics.jsonl").symlink_to(elsewhere / "keep.txt")
    assert _train(out, "--steps", "1", "overwrite_output_dir=true") == 0
    assert (elsewhere / "keep.txt").read_text() == "mine"
    assert not (out / "checkpoint-9").exists() and not (out / "metrics.jsonl").is_symlink()


def test_a_metrics_line_cut_by_a_kill_is_dropped_at_resume(tmp_path, capsys):
    """A run killed mid-write leaves half a JSON line in metrics.jsonl: the resume drops it with a note (it was a
    JSONDecodeError traceback) and the file holds every step once."""
    out = tmp_path / "run"
    assert _train(out, "--steps", "4", "save_steps=2") == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()  # killed while it wrote step 3's row
    (out / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    shutil.rmtree(out / "checkpoint-4")
    capsys.readouterr()
    assert _train(out, "--steps", "4", "save_steps=2", "resume_from_checkpoint=auto") == 0
    assert "dropped 1 line(s) that are not JSON rows" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
