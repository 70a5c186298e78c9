"""The runtime: devices (emulated, CUDA), host stores, the transformers adapter and the plan executor.

  device.py        EmulatedDevice, CudaDevice: the arena and the links
  executor.py      the Executor (Contract 3): what lives across steps; builds each step's program
  step.py          one step in progress: runs the step program's actions on the device
  shapes.py        the bytes one step moves and holds at a batch shape (formulas or measured)
  hf.py            the transformers adapter (layers, rotary, masks, the chunked loss head)
  adapters.py      LoRA adapters (PEFT's arithmetic, names and folder) and freeze tuning on a model
  nf4.py           QLoRA's base: linears as bitsandbytes' NF4 bytes, dequantized in the matmul
  store.py         host and NVMe homes of offloaded boundaries
  files.py         positioned file I/O on nameless files (spills and state files)
  statefiles.py    the optimizer's state files on NVMe, read and written whole
  live_bytes.py    the true device bytes of a step (a measuring device)
  weights.py       safetensors straight into the run's layout (masters bound for NVMe left in the file)
  nvme_probe.py    the disk under nvme_dir timed as the state files use it, remembered
  probe.py         the calibration probe: timed steps of an all-gpu plan
  calibrate.py     measured steps -> a CostModel
  replan.py        re-planning from measured steps while training

Import from the submodules; `lazytrain` re-exports `Executor`, `EmulatedDevice` and `CudaDevice` lazily.
"""
