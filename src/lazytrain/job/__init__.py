"""The job: a JobConfig turned into what the packages below it take, and the `lazytrain plan` command.

  inputs.py         the JobConfig turned into dtype, hardware, model spec, workload, cost model, topology
  batch.py          the largest batch the planner admits (`auto`), the global batch of a step
  resolve.py        `lazytrain train`'s job resolved once: every derived value, the effective config
  plan_command.py   `lazytrain plan` (`add_arguments`, `run`): the job's plan on its hardware's estimate

`plan/`, `costmodel/` and `runtime/` never see a JobConfig; this package and `train/` read it.
"""
