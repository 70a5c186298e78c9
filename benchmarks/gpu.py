"""The GPU check, one command: exactness on CUDA, then the MILP plan vs the MegaTrain rule under one cap.

    python benchmarks/gpu.py [--out benchmarks/gpu-results.json] [--gpu-mem-cap 40GB] [--models qwen2.5-3b,qwen2.5-7b]

1. The exact-gradient tests on CUDA (`pytest -m cuda tests/test_executor_cuda.py`): pass/fail and seconds.
2. For random-init Qwen2.5-3B and 7B shapes (no downloads: the presets' configs, weights drawn in place), bf16
   compute with fp32 master weights and Hybrid8bitAdamW (8-bit states, clipping at 1.0), batch `--batch-size`
   x `--seq-len`, device arena capped at `--gpu-mem-cap`:
   the MILP plan and the MegaTrain rule (every 4th boundary), each run `--steps` steps after one warm-up.
   Per plan: measured step seconds (forward_backward + the serial host optimizer step; median), TFLOPS in
   MegaTrain's 6 x params x tokens accounting, the simulator's predicted step (the hardware preset's cost
   model, and the same calibrated from the warm-up step: `runtime.calibrate`), the predicted device peak
   (the step program's alloc/free count) vs the arena's measured peak and the step's true peak (torch's
   max_memory_allocated over the step: every tensor on the device, autograd's included).
Writes one JSON. Sized for < 8 minutes on one H100/H200 (most of it drawing 7B random weights and the host
optimizer). Without CUDA it refuses in one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.optim import Hybrid8bitAdamW
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import solve_milp
from lazytrain.plan.rules import make_rule_plan
from lazytrain.plan.sim import simulate
from lazytrain.runtime.calibrate import calibrate
from lazytrain.runtime.device import CudaDevice
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.weights import built_spec, meta_model, resolve_model
from lazytrain.units import parse_bytes

ROOT = Path(__file__).resolve().parent.parent


def exactness_tests() -> dict[str, object]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_executor_cuda.py"],
                          cwd=ROOT, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return {"passed": proc.returncode == 0, "summary": tail[0], "seconds": round(time.perf_counter() - t0, 1)}


def random_model(name: str) -> tuple[torch.nn.Module, ModelSpec]:
    """The preset's model as transformers builds it (checked against its ModelSpec), weights drawn in place
    (N(0, 0.02), norms 1): no download and no slow per-module init."""
    source = resolve_model(name)
    source.config.use_cache = False
    meta = meta_model(source.config)
    spec = built_spec(source.config, meta)
    model = meta.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives a tied head its own storage: share the embedding again
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in pname else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for module in model.modules():  # rotary inv_freq: recomputed from the config (to_empty left it empty)
            if hasattr(module, "rope_init_fn") and hasattr(module, "inv_freq"):
                inv_freq, scaling = module.rope_init_fn(module.config, torch.device("cpu"))
                module.inv_freq.copy_(inv_freq)
                module.attention_scaling = scaling
    return model.train(), spec


def measure(model: torch.nn.Module, plan, cost: CostModel, cap_bytes: int, ids: torch.Tensor, steps: int,
            optimizer: torch.optim.Optimizer) -> dict[str, object]:
    device = CudaDevice(capacity_bytes=cap_bytes)
    ex = Executor(model, plan, device, compute_dtype=torch.bfloat16, cost=cost)
    walls, stats = [], []
    for _ in range(steps + 1):  # the first step warms up kernels, pinned pools and the optimizer's states
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        ex.forward_backward(ids, ids.clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        walls.append(time.perf_counter() - t0)
        stats.append(ex.last_step)
    step_s = statistics.median(walls[1:])
    calibrated = calibrate(cost, stats[:1], scale_flops=True)
    tokens = ids.numel()
    return {
        "tiers": plan.placement_map(),
        "step_s": round(step_s, 4),
        "tflops": round(6 * cost.spec.num_params * tokens / step_s / 1e12, 2),
        "predicted_step_s": round(simulate(plan, cost, optimizer_mode="serial").step_s, 4),
        "predicted_step_s_calibrated": round(simulate(plan, calibrated, optimizer_mode="serial").step_s, 4),
        "forward_backward_s": round(statistics.median(s.wall_s for s in stats[1:]), 4),
        "stall_s": {k: round(v, 4) for k, v in stats[-1].stall_s.items()},
        "predicted_peak_bytes": stats[-1].predicted_peak_device_bytes,
        "arena_peak_bytes": stats[-1].peak_device_bytes,
        # the true peak of the step (CudaDevice.true_peak_bytes: max_memory_allocated since the step began, less
        # what was allocated then); the program's count must not be below it (tests/test_live_bytes.py on the CPU)
        "true_peak_bytes": stats[-1].true_peak_device_bytes,
        "true_over_predicted": round(stats[-1].true_peak_device_bytes / stats[-1].predicted_peak_device_bytes, 4),
        "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu-results.json"))
    p.add_argument("--models", default="qwen2.5-3b,qwen2.5-7b")
    p.add_argument("--gpu-mem-cap", default="40GB")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--skip-tests", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    hardware = HardwareSpec.load("h200" if "H200" in name else "h100")
    cap = parse_bytes(args.gpu_mem_cap)
    result: dict[str, object] = {"gpu": name, "cpu": platform.processor() or platform.machine(),
                                 "torch": torch.__version__, "cap_bytes": cap, "batch_size": args.batch_size,
                                 "seq_len": args.seq_len, "hardware_preset": hardware.name}
    t_start = time.perf_counter()
    if not args.skip_tests:
        result["exactness"] = exactness_tests()
        print(f"exactness on CUDA: {result['exactness']}", flush=True)
    for model_name in args.models.split(","):
        model, spec = random_model(model_name)
        workload = Workload(args.batch_size, args.seq_len, "bf16")
        cost = CostModel(spec, hardware, workload, "8bit")
        budgets = Budgets(gpu_mem_cap_bytes=cap, cpu_act_bytes=None, nvme_act_bytes=0)
        t0 = time.perf_counter()
        milp = solve_milp(cost, budgets)
        solve_s = time.perf_counter() - t0
        optimizer = Hybrid8bitAdamW(model.parameters(), lr=1e-5)  # 8-bit states: 7B fits a 128 GiB host
        ids = torch.randint(0, spec.vocab_size, (args.batch_size, args.seq_len))
        rows = {}
        for label, plan in (("milp", milp), ("megatrain", make_rule_plan("megatrain", spec, workload=workload))):
            try:
                rows[label] = measure(model, plan, cost, cap, ids, args.steps, optimizer)
            except (LazyTrainError, torch.OutOfMemoryError) as err:
                rows[label] = {"tiers": plan.placement_map(), "error": str(err).splitlines()[0]}
            print(f"{model_name} {label}: {rows[label]}", flush=True)
        result[model_name] = {"params": spec.num_params, "milp_solve_s": round(solve_s, 3), **rows}
        del model, optimizer
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.out} ({result['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
