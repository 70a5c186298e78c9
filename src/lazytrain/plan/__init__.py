"""Deciding the placement: the Plan, the step program and its simulator, the MILP and the rules, the dispatcher.

  plan.py        the Plan and the plan file (Contract 1)
  schedule.py    the step program (Contract 2)
  sim.py         the simulator of the step program
  milp/          the MILP: one module per constraint family, the solver drivers (docs/planner.md)
  rules.py       MegaTrain's rule and the fixed plans; any tier list checked and timed
  planner.py     the dispatcher of both commands: budgets, admission, MILP or rule, the time limit
  budgets.py     the device / host / NVMe budgets
  admission.py   refusing what no plan fits
  rank_plan.py   one rank's plan and prediction of a data-parallel job
  cache.py       remembered plans
"""
