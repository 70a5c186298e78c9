"""`lazytrain train`: train a causal LM with layer streaming under a boundary plan, end to end.

The package, in the order a run uses it (torchtitan's components behind a short composer):
  train_command.py  the command line (`add_arguments`, `run`): the JobConfig of the job
  trainer.py        build -> loop -> close, and `train_step` (the job resolved first: job/resolve.py)
  rundir.py         the output directory: checked, locked to one run, swept of a dead run's files
  run_data.py       the run's data (from data/): loader, held-out batches, tokenizer, probe batch
  build.py          model, device and executor builders
  planning.py       `plan_run`: calibrate on this machine, plan, remember the plan
  optimizer.py      the host optimizer, its learning-rate schedule, the non-finite step policy
  offload.py        optimizer_offload nvme: the optimizer's states and masters in state files
  checkpoint.py     checkpoints: written whole, checked, resumed (Contract 5, docs/architecture.md)
  state_data.py     optimizer, data-position and RNG states as data (safetensors + JSON), checked on the way back
  hf_state.py       trainer_state.json as the HF Trainer writes it
  metrics.py        report lines, metrics.jsonl, trackers, loss.png
  peak.py           the whole process's peak RSS by phase, beside what admission counted
  signals.py        SIGINT / SIGTERM: finish the step, save, exit 130 / 143
  export.py         `lazytrain export`: a checkpoint (LoRA merged into its base) as an HF model folder
"""

from importlib import import_module
from typing import Any

# Imported on first use: `lazytrain train`'s command line (train_command.py) reads and checks the whole config before
# torch and transformers are imported by the trainer.
_EXPORTS = {"TrainResult": "lazytrain.train.trainer", "train": "lazytrain.train.trainer",
            "add_arguments": "lazytrain.train.train_command", "run": "lazytrain.train.train_command"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lazytrain.train' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
