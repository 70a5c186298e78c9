"""The cost model's linear-attention (Gated DeltaNet) terms: working set against the bytes autograd really saves,
no seq^2 growth, and the arena's peak equal to the simulator's for every family."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tiny_models import FAMILIES, make_batch, make_model

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, ModelSpec, Plan, Workload
from lazytrain.plan.sim import simulate
from lazytrain.runtime import hf


def saved_bytes(layer: torch.nn.Module, hidden: torch.Tensor, consts: hf.StepConstants, kind: str) -> int:
    """Bytes of every tensor autograd saves in one layer forward (storages once; the weights, which live in the
    weight slot, and the layer input, a boundary, excluded)."""
    weights = {n: p.detach().to(hidden.dtype).requires_grad_() for n, p in layer.named_parameters()}
    x = hidden.detach().requires_grad_()
    excluded = {t.untyped_storage().data_ptr() for t in [x, *weights.values()]}
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []  # alive until counted, so no address is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            seen[ptr] = t.untyped_storage().nbytes()
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = hf.layer_forward(layer, weights, x, consts, kind)
    del out
    held.clear()
    return sum(seen.values())


def hybrid(hidden: int, value_heads: int, head_dim: int) -> torch.nn.Module:
    config = tf.Qwen3_5TextConfig(vocab_size=64, hidden_size=hidden, intermediate_size=3 * hidden,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  linear_num_key_heads=value_heads // 3, linear_num_value_heads=value_heads,
                                  linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                                  layer_types=["linear_attention", "full_attention"], attn_implementation="sdpa")
    return tf.Qwen3_5ForCausalLM(config)


@pytest.mark.parametrize(("hidden", "value_heads", "head_dim", "batch", "seq_len", "dtype"), [
    (128, 6, 32, 2, 256, torch.float32),
    (256, 6, 64, 1, 512, torch.float32),
    (256, 12, 64, 2, 192, torch.bfloat16),
])
def test_linear_attention_working_set_is_what_autograd_saves(hidden, value_heads, head_dim, batch, seq_len,
                                                             dtype) -> None:
    model = hybrid(hidden, value_heads, head_dim)
    parts = hf.find_parts(model)
    x = torch.randn(batch, seq_len, hidden).to(dtype)
    measured = saved_bytes(parts.layers[0], x, hf.Rotary(parts, torch.device("cpu")).constants(x),
                           "linear_attention")
    workload = Workload(batch, seq_len, "bf16" if dtype == torch.bfloat16 else "fp32")
    predicted = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), workload).working_bytes[0]
    assert 0.85 <= predicted / measured <= 1.25, (predicted, measured)


@pytest.mark.parametrize(("hidden", "value_heads", "head_dim", "batch", "seq_len", "dtype"), [
    (128, 6, 32, 2, 256, torch.float32),
    (256, 12, 64, 2, 192, torch.bfloat16),
    (256, 12, 128, 1, 100, torch.bfloat16),
])
def test_linear_attention_working_set_bounds_the_measured_peak(hidden, value_heads, head_dim, batch, seq_len,
                                                                dtype) -> None:
    """The torch fallback's true working set (LiveBytes: its backward's peak, sequences padded to whole chunks)
    at head dims beyond the tiny models': never above the formula, within 1.35x of it."""
    model = hybrid(hidden, value_heads, head_dim)
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 3), EmulatedDevice(measure_memory=True), compute_dtype=dtype)
    measured = ex.shapes.measured_working_bytes(batch, seq_len)[0][0]
    workload = Workload(batch, seq_len, "bf16" if dtype == torch.bfloat16 else "fp32")
    predicted = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), workload).working_bytes[0]
    assert measured <= predicted <= 1.35 * measured, (predicted, measured)


def test_linear_attention_grows_linearly_with_the_sequence() -> None:
    spec = ModelSpec.load("qwen3.6-27b")
    linear = spec.layer_types.index("linear_attention")
    full = spec.layer_types.index("full_attention")
    costs = {s: CostModel(spec, HardwareSpec.load("h800"), Workload(8, s, "bf16")) for s in (1024, 2048, 8192)}
    grown = {s: costs[s].working_bytes[linear] - costs[1024].working_bytes[linear] for s in (2048, 8192)}
    assert grown[8192] == 7 * grown[2048] > 0  # linear in tokens (plus the layer's largest weight gradient)
    assert costs[8192].forward_flops[linear] == 8 * costs[1024].forward_flops[linear]
    mixing = {s: c.forward_flops[full] - 2 * spec.layer_active_params[full] * c.workload.tokens
              for s, c in costs.items()}
    assert mixing[8192] > 60 * mixing[1024]  # full attention: the seq^2 term


@pytest.mark.parametrize("kind", FAMILIES)
def test_arena_peak_equals_the_simulators_to_the_byte(kind: str) -> None:
    model = make_model(kind)
    ids, labels = make_batch(3, 11)
    for tiers in (["gpu"] * 7, ["gpu", "nvme", "recompute", "cpu", "recompute", "gpu", "gpu"]):
        plan = Plan.from_tiers(model, tiers)
        constants = Executor(model, plan, EmulatedDevice()).memory_sizes(3, 11).constant_bytes
        cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"),
                         Workload(3, 11, "fp32")).with_device_constants(constants)
        ex = Executor(model, plan, EmulatedDevice(), cost=cost)
        ex.forward_backward(ids, labels)
        assert ex.last_step.peak_device_bytes == simulate(plan, cost).peak_bytes["gpu"], tiers
        model.zero_grad(set_to_none=True)
