"""The true device bytes of a step (runtime/live_bytes.py): every storage on the device, not only the arena's.

The step program's count must be what really lives on the device: a device made with measure_memory=True counts
every storage the step's compute creates, and its working sets are the measured ones, so the program's peak
equals the measured true peak to the byte. The CostModel's formulas (what the planner uses where nothing can be
measured) must never be below the measured working sets."""

from __future__ import annotations

import threading

import pytest
import tiny_models
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, Plan, Workload
from lazytrain.runtime.live_bytes import LiveBytes
from lazytrain.spec.model import ModelSpec


def test_live_bytes_counts_each_storage_once_until_it_is_released() -> None:
    live = LiveBytes()
    w = torch.randn(100, 100, requires_grad=True)  # made outside: not counted
    x = torch.randn(50, 100)
    with live:
        a = torch.randn(1000)  # 4000 B
        view = a[:10]  # a view: nothing new
        a.mul_(2)  # in place: nothing new
        assert live.used_bytes == 4000
        del a
        assert live.used_bytes == 4000  # the view keeps the storage
        del view
        assert live.used_bytes == 0
        live.reset_peak()
        y = torch.tanh(x @ w)  # the product (20000 B) goes, the tanh output (20000 B) is saved for the backward
        assert live.used_bytes == 20000 and live.peak_bytes == 40000
        others: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: others.append(torch.empty(10**6)))  # another thread: not counted
        thread.start()
        thread.join()
        assert live.used_bytes == 20000
        grad_w, = torch.autograd.grad(y.sum(), [w])
        assert live.used_bytes == 20000 + 40000  # y and the weight's gradient; the graph is gone
    del y, grad_w
    assert live.used_bytes == 0


def _resized(model: torch.nn.Module, vocab: int) -> torch.nn.Module:
    """The same family with a larger vocabulary (a loss head larger than a layer: its own slot)."""
    config = model.config
    config.vocab_size = vocab
    torch.manual_seed(0)
    return type(model)(config)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]), attn=st.sampled_from(["eager", "sdpa"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       inner=st.lists(st.sampled_from(["gpu", "cpu", "nvme", "recompute"]), min_size=3, max_size=3),
       batch=st.integers(1, 3), seq_len=st.integers(3, 13), chunk=st.sampled_from([4, 7, 1024]),
       padded=st.booleans(), big_head=st.booleans(), kept=st.sampled_from([0, 0, 1, 2, 4]))
def test_true_peak_equals_the_programs_to_the_byte(kind, attn, dtype, inner, batch, seq_len, chunk, padded,
                                                   big_head, kept) -> None:
    model = tiny_models.make_model(kind, num_layers=4, attn=attn)
    if big_head:
        model = _resized(model, 300)
    gen = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    labels = tiny_models.random_labels(ids, gen)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, seq_len - seq_len // 3:] = 0
        labels = labels.masked_fill(mask == 0, -100)
    tiers = ["gpu", *inner, "gpu"]
    tiers[4 - kept:] = ["gpu"] * (kept + 1)  # kept layers: their boundaries on the device
    ex = Executor(model, Plan.from_tiers(model, tiers, kept_layers=kept), EmulatedDevice(measure_memory=True),
                  compute_dtype=dtype, head_chunk_tokens=chunk)
    ex.forward_backward(ids, labels, attention_mask=mask)
    st_ = ex.last_step
    assert st_.true_peak_device_bytes == st_.predicted_peak_device_bytes == st_.peak_device_bytes, tiers


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 344, 2, 3000, 3, 100, 64), (64, 172, 4, 500, 2, 9, 5)])
def test_working_set_formulas_are_never_below_the_measured(kind, dtype, shape) -> None:
    """The CostModel's working sets (SDPA, what the planner counts) >= the measured ones, and not by much."""
    hidden, inter, heads, vocab, batch, seq_len, chunk = shape
    model = tiny_models.make_model(kind, num_layers=2, attn="sdpa")
    config = model.config
    for key, value in dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                           num_key_value_heads=heads // 2, head_dim=hidden // heads).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = type(model)(config)
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 3), EmulatedDevice(measure_memory=True), compute_dtype=dtype,
                  head_chunk_tokens=chunk)
    working, head = ex.measured_working_bytes(batch, seq_len)
    name = "fp32" if dtype == torch.float32 else "bf16"
    cost = CostModel(ModelSpec.from_config(config), HardwareSpec.load("emulated"), Workload(batch, seq_len, name),
                     head_chunk_tokens=chunk)
    for formula, measured in [*zip(cost.working_bytes, working, strict=True), (cost.head_working_bytes, head)]:
        assert measured <= formula <= 1.2 * measured, (formula, measured)
    graphs = ex.memory_sizes(batch, seq_len).graph_bytes  # a kept layer's graph (Plan.kept_layers), measured
    for formula, measured in zip(cost.graph_bytes, graphs, strict=True):
        assert measured <= formula <= 1.3 * measured, (formula, measured)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, seq_len", [(1, 11), (2, 200)])
def test_working_set_formulas_bound_the_hybrid_and_gpt_oss_families(kind, dtype, batch, seq_len) -> None:
    """Gated DeltaNet (the torch fallback: sequences padded to whole chunks), gated attention, GPT-OSS's eager
    attention with sinks, and their heads: the CostModel's working sets are never below the measured and within
    1.35x of them; MoE layers (every expert's gradient counted at once) within 3x."""
    model = tiny_models.make_model(kind, num_layers=3, attn="eager" if kind == "gpt_oss" else "sdpa")
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(measure_memory=True), compute_dtype=dtype)
    working, head = ex.measured_working_bytes(batch, seq_len)
    name = "fp32" if dtype == torch.float32 else "bf16"
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), Workload(batch, seq_len, name))
    moe = [cost.spec.layer_active_params[j] != cost.spec.layer_params[j] for j in range(3)]
    for j, (formula, measured) in enumerate(zip(cost.working_bytes, working, strict=True)):
        band = 3.0 if moe[j] else 1.35
        assert measured <= formula <= band * measured, (j, cost.spec.layer_types[j], formula, measured)
    assert head <= cost.head_working_bytes <= 1.35 * head, (cost.head_working_bytes, head)
