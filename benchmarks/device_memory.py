"""True device memory vs the step program's count, on the emulated device (issue 10 item 4).

    python benchmarks/device_memory.py                 # 8 layers of the 301.5 M Llama of benchmarks/host.py
    python benchmarks/device_memory.py --layers 20     # the whole 301.5 M model (~3 GB of host memory in fp32)
    python benchmarks/device_memory.py --vocab 4096 --seq 1024   # a small head: the layers' windows peak
    python benchmarks/device_memory.py --families      # every family's working sets: CostModel formula / measured

One step per plan (keep-all, MegaTrain K=4, all-cpu, a mix with nvme) and dtype (fp32, bf16) on
`EmulatedDevice(measure_memory=True)`, which counts every storage the step holds on the device (autograd's
saved tensors and gradients, the head's logits: runtime/live_bytes.py). Per row: the true peak; the program's
peak with the measured working sets (what that device's arena counts: must equal the true peak); the program's
peak with the CostModel's formulas (what `lazytrain plan` predicts where nothing is measured: must not be
below it). Bytes are deterministic: one step each, no timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, Plan, Workload
from lazytrain.costmodel.model import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models  # noqa: E402 - the tests' tiny models of every family

MiB = 2**20


def plans(num_layers: int) -> dict[str, list[str]]:
    L = num_layers
    mix = ["gpu", *(["cpu", "recompute", "nvme", "gpu"] * L)[:L - 1], "gpu"]
    return {"keep-all": ["gpu"] * (L + 1),
            "megatrain K=4": ["gpu" if i % 4 == 0 or i == L else "recompute" for i in range(L + 1)],
            "all-cpu": ["gpu", *["cpu"] * (L - 1), "gpu"],
            "mix": mix}


def family_table(masked: bool = False) -> None:
    """Per family, attention, dtype and batch shape: each layer kind's and the head's CostModel working set over the
    measured, and each layer kind's kept-layer graph (`CostModel.graph_bytes`, Plan.kept_layers) over the measured
    graph. Seq 4 is below the Mistral and GPT-OSS windows (5): SDPA runs unmasked there, above them with the
    window's mask. `masked`: padded batches (an attention mask: every SDPA layer gets a mask tensor)."""
    print("| family | attention | dtype | batch x seq | formula / measured per layer kind and head | graph formula / "
          "measured per layer kind |")
    print("|---|---|---|---|---|---|")
    for kind in tiny_models.FAMILIES:
        for attn in ("eager",) if kind == "gpt_oss" else ("sdpa", "eager"):
            for dtype in (torch.float32, torch.bfloat16):
                for batch, seq in ((2, 4), (1, 11), (2, 64), (2, 200), (1, 300)):
                    model = tiny_models.make_model(kind, num_layers=3, attn=attn)
                    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(measure_memory=True),
                                  compute_dtype=dtype)
                    working, head = ex.shapes.measured_working_bytes(batch, seq, masked=masked)
                    graphs = ex.memory_sizes(batch, seq, masked=masked).graph_bytes
                    name = "fp32" if dtype == torch.float32 else "bf16"
                    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"),
                                     Workload(batch, seq, name, masked=masked))
                    spec, ratios, graph_ratios = cost.spec, {}, {}
                    for j, (formula, measured) in enumerate(zip(cost.working_bytes, working, strict=True)):
                        layer_kind = spec.layer_types[j] + (" moe" if spec.moe_layers[j] else "")
                        ratios.setdefault(layer_kind, formula / measured)
                        graph_ratios.setdefault(layer_kind, cost.graph_bytes[j] / graphs[j])
                    ratios["head"] = cost.head_working_bytes / head
                    print(f"| {kind} | {attn} | {name} | {batch} x {seq} | "
                          + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + " | "
                          + ", ".join(f"{k} {v:.2f}" for k, v in graph_ratios.items()) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--families", action="store_true", help="the working-set formulas of every family instead")
    p.add_argument("--masked", action="store_true", help="with --families: padded batches (an attention mask)")
    args = p.parse_args(argv)
    if args.families:
        family_table(args.masked)
        return
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
    print(f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params ({args.layers} layers), "
          f"batch {args.batch} x {args.seq}")
    print("| plan | dtype | true peak MiB | program (measured working sets) MiB | program (CostModel formulas) MiB | "
          "formulas / true |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for name, tiers in plans(args.layers).items():
            plan = Plan.from_tiers(model, tiers)
            ex = Executor(model, plan, EmulatedDevice(measure_memory=True), compute_dtype=dtype)
            ex.forward_backward(ids, ids.clone())
            stats = ex.last_step
            formulas = Executor(model, plan, EmulatedDevice(), compute_dtype=dtype).predicted_peak_bytes(*ids.shape)
            assert stats.predicted_peak_device_bytes == stats.peak_device_bytes
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {stats.true_peak_device_bytes / MiB:.2f} | "
                  f"{stats.predicted_peak_device_bytes / MiB:.2f} | {formulas / MiB:.2f} | "
                  f"{formulas / stats.true_peak_device_bytes:.3f} |", flush=True)
            model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
