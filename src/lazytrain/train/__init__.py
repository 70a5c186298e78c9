"""`lazytrain train`: train a causal LM with layer streaming under a boundary plan, end to end.

The package, in the order a run uses it (torchtitan's components behind a short composer):
  command.py     the command line (`add_arguments`, `run`): the JobConfig of the job
  build.py       model, device and executor builders
  planning.py    `plan_run`: calibrate on this machine, plan, remember the plan
  optimizer.py   the host optimizer, its learning-rate schedule, the non-finite step policy
  checkpoint.py  the output directory and checkpoints (Contract 5)
  metrics.py     report lines, metrics.jsonl, tensorboard, loss.png
  signals.py     SIGINT / SIGTERM: finish the step, save, exit 130 / 143
  trainer.py     build -> loop -> close, and `train_step`
"""

from lazytrain.train.command import add_arguments, run
from lazytrain.train.trainer import TrainResult, train

__all__ = ["TrainResult", "add_arguments", "run", "train"]
