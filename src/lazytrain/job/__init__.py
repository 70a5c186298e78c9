"""The job: a JobConfig turned into what the packages below it take, and the `lazytrain plan` command.

  plan_command.py   `lazytrain plan` (`add_arguments`, `run`): the job's plan on its hardware's estimate

`plan/`, `costmodel/` and `runtime/` never see a JobConfig; this package and `train/` read it.
"""
