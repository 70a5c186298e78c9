"""`lazytrain train [CONFIG.yaml ...] [key=value ...] [--flags]`: the command line of the training job.

Every key of the one schema (`lazytrain.config.JobConfig`) is a YAML key, a `key=value` word and a flag; the
flags of the job before the schema (`--steps`, `--lr`, `--batch-size`, ...) are aliases of their keys, and
LLaMA-Factory / HF Trainer keys are mapped or refused (config/foreign.py). The whole config is read and checked
here, before the trainer (and with it torch and transformers) is imported: a config error costs well under a
second and names every problem at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from lazytrain.config import JobConfig, add_job_arguments, job_config_from_args
from lazytrain.config.schema import names_in
from lazytrain.config.values import raise_all
from lazytrain.costmodel.model import BUILT_IN_SHAPES
from lazytrain.data.sources import check_names
from lazytrain.data.templates import check_template
from lazytrain.errors import LazyTrainError
from lazytrain.train.metrics import resolve_trackers
from lazytrain.train.rundir import entries
from lazytrain.train.signals import Interrupted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """0 after a complete run; 130 / 143 after SIGINT / SIGTERM (a checkpoint saved, one line on stderr)."""
    notes: list[str] = []
    job = job_config_from_args(args, notes)
    first_pass(job)
    # the job is sound: now the heavy imports (torch, transformers, datasets)
    from lazytrain.train.trainer import train

    if os.environ.get("RANK", "0") == "0":  # rank 0 alone prints (torchrun sets RANK)
        for note in notes:
            print(f"note     {note}", flush=True)
    try:
        train(job)
    except Interrupted as stop:
        print(f"interrupted: {stop}", file=sys.stderr)
        return stop.exit_code
    return 0


def first_pass(job: JobConfig) -> None:
    """Everything about the job that can be checked without loading anything heavy, every problem at once: the
    data (names, files, columns, mixing weights), the template, the trackers' packages, the output directory."""
    d = job.data
    checks: list[Callable[[], object]] = [lambda: resolve_trackers(job.metrics.report_to)]
    if d.dataset == "math" and job.model.model not in BUILT_IN_SHAPES:
        checks.append(_no_dataset(job.model.model))
    else:
        checks.append(lambda: check_names(d.dataset, d.eval_dataset, d.dataset_dir))
    if d.template is not None:
        checks.append(lambda: check_template(d.template))
    if d.interleave_probs is not None and len(d.interleave_probs) != len(names_in(d.dataset)):
        checks.append(_fail(f"interleave_probs has {len(d.interleave_probs)} weights for {len(names_in(d.dataset))} "
                            "datasets; give one per dataset"))
    out = Path(job.checkpoint.output_dir) if job.checkpoint.output_dir else None
    if out is not None and out.is_dir() and entries(out) and job.checkpoint.resume_from_checkpoint is None \
            and not job.checkpoint.overwrite_output_dir:
        checks.append(_fail(f"output_dir {out} already exists and is not empty; set resume_from_checkpoint auto to "
                            "continue its run, overwrite_output_dir true to replace it, or pick a new output_dir"))
    problems = []
    for check in checks:
        try:
            check()
        except LazyTrainError as err:
            problems.append(err)
    raise_all(problems)


def _no_dataset(model: str) -> Callable[[], None]:
    return _fail(f"dataset is math (the default when dataset is not set: the built-in set of the built-in model "
                 f"shapes); model {model} needs its own data: set dataset to a file, a name in dataset_dir's "
                 "dataset_info.json or an HF dataset id")


def _fail(message: str) -> Callable[[], None]:
    def check() -> None:
        raise LazyTrainError(message)

    return check
