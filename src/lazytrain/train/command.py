"""`lazytrain train [CONFIG.yaml ...] [key=value ...] [--flags]`: the command line of the training job.

Every key of the one schema (`lazytrain.config.JobConfig`) is a YAML key, a `key=value` word and a flag; the
flags of the job before the schema (`--steps`, `--lr`, `--batch-size`, ...) are aliases of their keys.
"""

from __future__ import annotations

import argparse
import sys

from lazytrain.config import add_job_arguments, job_config_from_args
from lazytrain.train.signals import Interrupted
from lazytrain.train.trainer import train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """0 after a complete run; 130 / 143 after SIGINT / SIGTERM (a checkpoint saved, one line on stderr)."""
    try:
        train(job_config_from_args(args))
    except Interrupted as stop:
        print(f"interrupted: {stop}", file=sys.stderr)
        return stop.exit_code
    return 0
