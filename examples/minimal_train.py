"""Train a small causal LM through LazyTrain's public API, in one file: plan its boundaries, stream it, step it.

    python examples/minimal_train.py            # a few seconds on a laptop CPU

What `lazytrain train` does around this (data, calibration, checkpoints, metrics) is in docs/train.md; this
file keeps only the three parts a reader needs to see (docs/architecture.md):

1. a CostModel: the model's shapes (ModelSpec), the machine (HardwareSpec) and the step (Workload);
2. a Plan: where each boundary activation lives -- the MILP under a device memory cap (plan/milp/);
3. an Executor: runs the plan on a device -- here EmulatedDevice, which computes on the CPU, caps the device
   bytes and throttles its links, so the plan's transfers really happen -- and leaves the gradients on the host
   parameters, where any torch optimizer steps them.

The first step's loss and gradients are checked against the model's own forward and backward.
"""

from __future__ import annotations

import torch
import transformers

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, ModelSpec, Plan, Workload
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import solve_milp

BATCH, SEQ_LEN, STEPS = 4, 256, 8
GPU_CAP_BYTES = 8 << 20  # a "device" of 3 MiB: too small to keep every boundary, so the plan offloads some


def tiny_model(seed: int = 0) -> transformers.PreTrainedModel:
    """A 6-layer Llama of width 64, random weights (fp32, on the host: the executor streams it)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                                      attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_config(config)


def plan_for(model: transformers.PreTrainedModel) -> Plan:
    """The fastest placement the cost model knows under the cap (the emulated device's link rates)."""
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"),
                     Workload(batch_size=BATCH, seq_len=SEQ_LEN, dtype="fp32"))
    plan = solve_milp(cost, Budgets(gpu_mem_cap_bytes=GPU_CAP_BYTES, cpu_act_bytes=None))
    print(f"plan     {plan.placement_map()}  (G gpu, C cpu, R recompute; {plan.report.status}, "
          f"{plan.report.seconds:.2f} s to solve)")
    return plan


def check_first_step(model: transformers.PreTrainedModel, executor: Executor, ids: torch.Tensor) -> None:
    """The streamed loss and gradients equal the model's own (fp32: the same arithmetic, rounding aside)."""
    loss = executor.forward_backward(ids, ids)
    streamed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    reference = model(input_ids=ids, labels=ids).loss
    reference.backward()
    # the same ops in another order: fp32 rounding, ~1e-6 relative per op over a few hundred ops
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(streamed[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)
    model.zero_grad(set_to_none=True)
    print(f"check    step 1 loss {loss.item():.4f} = transformers' {reference.item():.4f}, every gradient too")


def main() -> None:
    model = tiny_model()
    plan = plan_for(model)
    device = EmulatedDevice(capacity_bytes=GPU_CAP_BYTES, h2d_gbps=1.0, d2h_gbps=1.0)
    executor = Executor(model, plan, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    # a learnable toy task: each row repeats a random 8-token pattern
    pattern = torch.randint(0, 256, (BATCH, 8), generator=data)
    ids = pattern.repeat(1, SEQ_LEN // 8)
    try:
        check_first_step(model, executor, ids)
        for step in range(1, STEPS + 1):
            loss = executor.forward_backward(ids, ids)  # gradients land in each parameter's .grad
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats = executor.last_step
            print(f"step {step}  loss {loss.item():.4f}  peak device {stats.peak_device_bytes / 2**20:.2f} MiB "
                  f"(cap {GPU_CAP_BYTES / 2**20:.0f} MiB)  {stats.wall_s * 1e3:.0f} ms")
    finally:
        device.close()  # its link threads


if __name__ == "__main__":
    main()
