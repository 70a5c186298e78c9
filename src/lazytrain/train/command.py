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

from lazytrain.config import add_job_arguments, job_config_from_args
from lazytrain.data.sources import check_names
from lazytrain.train.metrics import resolve_trackers
from lazytrain.train.signals import Interrupted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """0 after a complete run; 130 / 143 after SIGINT / SIGTERM (a checkpoint saved, one line on stderr)."""
    notes: list[str] = []
    job = job_config_from_args(args, notes)
    resolve_trackers(job.metrics.report_to)  # a tracker's missing package: one line, before anything runs
    check_names(job.data.dataset, job.data.eval_dataset, job.data.dataset_dir)  # every dataset name means something
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
