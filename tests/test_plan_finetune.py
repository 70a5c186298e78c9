"""Planning LoRA and freeze tuning: the cost model of a frozen base (no weight-gradient GEMMs, gradient d2h or host
update for it; the host holds it once in the compute dtype) and `lazytrain plan` on it."""

from __future__ import annotations

import re

import pytest

from lazytrain.cli import main
from lazytrain.costmodel.cost import DEQUANT_BYTES_PER_WEIGHT, CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.trainable import Trainable
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.rules import make_rule_plan
from lazytrain.plan.schedule import Shapes, build_program
from lazytrain.plan.sim import simulate

JOB_70B = ["plan", "model=llama-3.1-70b", "hardware=rtx3090", "cutoff_len=1024", "per_device_train_batch_size=4",
           "gpu_mem_cap=22GB", "cpu_mem=192GiB"]
LORA = ["finetuning_type=lora", "lora_rank=16", "lora_target=all"]


def cost(trainable: Trainable, model: str = "qwen2.5-14b") -> CostModel:
    return CostModel(ModelSpec.load(model), HardwareSpec.load("rtx3090"), Workload(4, 1024, "bf16"),
                     trainable=trainable)


def test_a_frozen_base_has_no_gradient_state_or_update() -> None:
    full, lora = cost(Trainable()), cost(Trainable("lora", rank=16))
    spec = full.spec
    # llama-style layer, rank 16: q, o (h -> h), k, v (h -> kv), gate, up (h -> I), down (I -> h)
    h, kv, inter = spec.hidden_size, spec.num_key_value_heads * spec.head_dim, spec.intermediate_size
    assert lora.adapter_params[0] == 16 * (2 * 2 * h + 2 * (h + kv) + 3 * (h + inter))
    assert lora.grad_bytes == [a * 2 for a in lora.adapter_params] and lora.head_grad_bytes == 0
    assert lora.param_bytes[0] == full.param_bytes[0] + 2 * lora.adapter_params[0]  # adapters stream too
    assert [b / f for b, f in zip(lora.backward_s, lora.forward_s, strict=True)] == pytest.approx(
        [2.0 + a / (p + a) for a, p in zip(lora.adapter_params, spec.layer_params, strict=True)])
    host = lora.host_breakdown()
    base = spec.num_params
    # frozen: 2 B (bf16) per base parameter; the adapters: fp32 masters, bf16 copy and gradient, Adam's 8 B
    assert host["weights"] == 2 * base + 4 * lora.trainable_params
    assert host["optimizer_states"] == 8 * lora.trainable_params and host["grads"] == 2 * lora.trainable_params
    freeze = cost(Trainable("freeze", layers=2))
    assert freeze.grad_bytes[:-2] == [0] * (spec.num_layers - 2) and freeze.grad_bytes[-2:] == full.grad_bytes[-2:]
    program = build_program(["gpu"] * (spec.num_layers + 1), Shapes.from_cost(freeze))
    assert {op.target for op in program.ops if op.kind in ("grads", "land")} == {spec.num_layers - 2,
                                                                                 spec.num_layers - 1}
    assert not [op for op in program.ops if op.kind in ("grad0", "embedding")]


def _step_s(out: str) -> float:
    return float(re.search(r"step: MILP ([\d.]+) s", out).group(1))


def test_70b_lora_fits_one_3090_where_full_training_does_not(capsys) -> None:
    assert main([*JOB_70B, *LORA]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host: .* fits 192 GiB", out) and "trainable: LoRA rank 16 on all" in out
    assert "backward: 2.00 x forward (full training 3.00" in out
    assert main([*JOB_70B[:-1], "cpu_mem=64GiB", *LORA]) == 2  # the bf16 base alone is 131 GiB
    assert "host memory: needs" in capsys.readouterr().err
    assert main(JOB_70B) == 2
    assert "host memory: needs 1.03 TiB" in capsys.readouterr().err


def test_14b_lora_step_is_at_most_0_8_of_full(capsys) -> None:
    job = ["plan", "model=qwen2.5-14b", "hardware=rtx3090", "cutoff_len=1024", "per_device_train_batch_size=4"]
    assert main(job) == 0
    full = _step_s(capsys.readouterr().out)
    assert main([*job, *LORA]) == 0
    out = capsys.readouterr().out
    assert _step_s(out) <= 0.8 * full, (_step_s(out), full)
    assert "gradients d2h" in out and "host update" in out  # the reason, in plan's breakdown


def test_qlora_holds_and_streams_the_base_linears_as_nf4() -> None:
    lora, qlora = cost(Trainable("lora", rank=16)), cost(Trainable("lora", rank=16, quantized=True))
    spec = lora.spec
    h, kv, inter = spec.hidden_size, spec.num_key_value_heads * spec.head_dim, spec.intermediate_size
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]  # q k v o gate up down
    n = sum(i * o for i, o in linears)
    assert qlora.quantized_params[0] == n
    # per linear of w weights: w/2 B of indices, w/64 B of absmax codes, 4 B per 256 absmaxes, a 4 B offset
    per_linear = [i * o // 2 + i * o // 64 + 4 * -(-(i * o // 64) // 256) + 4 for i, o in linears]
    assert qlora.quantized_bytes[0] == sum(-(-b // 4) * 4 for b in per_linear)
    assert 0.515 < qlora.quantized_bytes[0] / n < 0.517  # 0.5 + 1/64 + 1/4096, and the padding
    assert qlora.param_bytes[0] == lora.param_bytes[0] - 2 * n + qlora.quantized_bytes[0]  # what crosses the link
    host, qhost = lora.host_breakdown(), qlora.host_breakdown()
    assert qhost["weights"] == host["weights"] - 2 * sum(qlora.quantized_params) + sum(qlora.quantized_bytes)
    assert qlora.grad_bytes == lora.grad_bytes and qhost["optimizer_states"] == host["optimizer_states"]
    with pytest.raises(LazyTrainError, match="set finetuning_type lora"):
        Trainable("full", quantized=True)


def test_70b_qlora_fits_one_3090_with_64_gib_of_host_memory(capsys) -> None:
    assert main([*JOB_70B[:-1], "cpu_mem=64GiB", *LORA, "quantization_bit=4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host: .* fits 64 GiB", out)
    assert "the layers' linears NF4 0.516 B" in out
    assert main([*JOB_70B[:-1], "cpu_mem=64GiB", *LORA, "quantization_bit=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "quantization_bit 8: only 4 (QLoRA's NF4 base) is implemented" in err


def test_qlora_prices_each_dequantization_on_the_device(capsys) -> None:
    """One bandwidth-bound pass per NF4 weight in the forward, and two in the backward (re-forward, backward):
    DEQUANT_BYTES_PER_WEIGHT + the bf16 cast's 4 + 2 bytes per weight over the device's memory rate."""
    lora, qlora = cost(Trainable("lora", rank=16)), cost(Trainable("lora", rank=16, quantized=True))
    rate = qlora.hardware.mem_gbps * 1e9
    dequant = [q * (DEQUANT_BYTES_PER_WEIGHT + 6) / rate for q in qlora.quantized_params]
    assert min(dequant) > 0
    assert qlora.forward_s == pytest.approx([f + d for f, d in zip(lora.forward_s, dequant, strict=True)])
    assert qlora.backward_s == pytest.approx([b + 2 * d for b, d in zip(lora.backward_s, dequant, strict=True)])
    # the same plan simulated on both: the step grows by the passes (3 per layer, none kept, one micro-batch)
    plan = make_rule_plan("megatrain", lora.spec, interval=1, workload=lora.workload)
    grown = simulate(plan, qlora).step_s - simulate(plan, lora).step_s
    assert grown == pytest.approx(3 * sum(dequant), rel=0.05), (grown, 3 * sum(dequant))
    job = ["plan", "model=qwen2.5-14b", "hardware=rtx3090", "cutoff_len=1024", "per_device_train_batch_size=4", *LORA]
    assert main([*job, "quantization_bit=4"]) == 0
    assert re.search(r"dequantization: [\d.]+ s a pass over the NF4 linears on the device \(31 B per weight",
                     capsys.readouterr().out)


def test_on_nvme_freeze_tuning_files_its_trained_layers_alone_and_lora_keeps_its_states_in_ram(capsys) -> None:
    freeze = CostModel(ModelSpec.load("qwen2.5-14b"), HardwareSpec.load("rtx3090"), Workload(4, 1024, "bf16"),
                       optimizer_offload="nvme", trainable=Trainable("freeze", layers=2))
    groups, L = freeze.state_group_bytes(), freeze.num_layers  # (embedding, layers 0..L-1, head)
    assert groups[:L - 1] == (0,) * (L - 1) and groups[-1] == 0  # the frozen embedding, layers and head: no file
    per_param = freeze.state_bytes_per_param + 4  # Adam's moments and the fp32 master (bf16 compute)
    assert groups[L - 1:L + 1] == tuple(-(-p * int(per_param) // 4096) * 4096 for p in freeze.spec.layer_params[-2:])
    assert main(["plan", "model=qwen2.5-14b", "hardware=rtx3090", "cutoff_len=1024", "per_device_train_batch_size=4",
                 *LORA, "optimizer_offload=nvme"]) == 0
    out = capsys.readouterr().out
    assert "the adapters' optimizer states stay in RAM (they are small); optimizer_offload nvme -> host" in out
    assert "staging" not in out.split("\n")[2]  # the host line: no staging slots
