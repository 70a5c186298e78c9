"""The model of the machine and the job, in plain numbers (no torch): the bottom layer the planner reads.

  model.py       ModelSpec from a config.json: parameter counts per layer, layer kinds, fingerprint
  families.py    the supported model families (the one list the runtime reads too)
  hardware.py    HardwareSpec: presets, files, this machine; the links and their rates
  workload.py    one step's batch, sequence length, dtype, masking
  topology.py    ranks and nodes: shared host bytes, collective rates
  trainable.py   which parameters train (full, LoRA, freeze): what a frozen base costs
  cost.py        CostModel: every second and byte the planner and the simulator use
  presets/       config.json files of the named models
"""
