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
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, Plan, Workload
from lazytrain.costmodel.model import ModelSpec
from lazytrain.runtime.live_bytes import LiveBytes


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
# the head's own gradient slot is held through the recompute window after the head: that window's peak (a
# forward's, counted as the backward's working set before Shapes.forward_working_bytes) was above the true one
@example(kind="llama", attn="eager", dtype=torch.float32, inner=["gpu", "gpu", "recompute"], batch=3, seq_len=9,
         chunk=4, padded=False, big_head=True, kept=0)
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
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 344, 2, 3000, 3, 100, 64), (64, 172, 4, 500, 2, 9, 5),
                                   (64, 172, 4, 500, 3, 4, 5)])
def test_working_set_formulas_are_never_below_the_measured(kind, attn, dtype, shape) -> None:
    """The CostModel's working sets (what the planner counts) >= the measured ones, and not by much: unmasked SDPA
    within 1.2x; eager attention (batch x heads x seq^2 scores) and Mistral's window (sliding_window 5: seq 4 runs
    SDPA unmasked, 9 and 100 with the window's mask) within 1.3x."""
    hidden, inter, heads, vocab, batch, seq_len, chunk = shape
    model = tiny_models.make_model(kind, num_layers=2, attn=attn)
    config = model.config
    for key, value in dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                           num_key_value_heads=heads // 2, head_dim=hidden // heads).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = type(model)(config)
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 3), EmulatedDevice(measure_memory=True), compute_dtype=dtype,
                  head_chunk_tokens=chunk)
    working, head = ex.shapes.measured_working_bytes(batch, seq_len)
    name = "fp32" if dtype == torch.float32 else "bf16"
    cost = CostModel(ModelSpec.from_config(config), HardwareSpec.load("emulated"), Workload(batch, seq_len, name),
                     head_chunk_tokens=chunk)
    band = 1.2 if attn == "sdpa" and not (kind == "mistral" and seq_len >= config.sliding_window) else 1.3
    for formula, measured in zip(cost.working_bytes, working, strict=True):
        assert measured <= formula <= band * measured, (formula, measured)
    assert head <= cost.head_working_bytes <= 1.2 * head, (cost.head_working_bytes, head)
    graphs = ex.memory_sizes(batch, seq_len).graph_bytes  # a kept layer's graph (Plan.kept_layers), measured
    for formula, measured in zip(cost.graph_bytes, graphs, strict=True):
        assert measured <= formula <= 1.3 * measured, (formula, measured)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, seq_len", [(1, 11), (2, 200)])
def test_working_set_formulas_bound_the_hybrid_and_gpt_oss_families(kind, dtype, batch, seq_len) -> None:
    """Gated DeltaNet (the torch fallback: sequences padded to whole chunks), gated attention, GPT-OSS's eager
    attention with sinks, MoE layers, and their heads: the CostModel's working sets are never below the measured
    and within 1.45x of them (MoE layers of the drawn shapes: test_moe_working_sets_bound_the_measured); a kept
    layer's graph formula never below its measured graph (within 2.5x: Gated DeltaNet's chunked backward and the
    MoE terms are sized for the backward's peak, not for what the forward saves)."""
    model = tiny_models.make_model(kind, num_layers=3, attn="eager" if kind == "gpt_oss" else "sdpa")
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(measure_memory=True), compute_dtype=dtype)
    working, head = ex.shapes.measured_working_bytes(batch, seq_len)
    name = "fp32" if dtype == torch.float32 else "bf16"
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), Workload(batch, seq_len, name))
    for j, (formula, measured) in enumerate(zip(cost.working_bytes, working, strict=True)):
        assert measured <= formula <= 1.45 * measured, (j, cost.spec.layer_types[j], formula, measured)
    assert head <= cost.head_working_bytes <= 1.35 * head, (cost.head_working_bytes, head)
    graphs = ex.memory_sizes(batch, seq_len).graph_bytes  # a kept layer's graph (Plan.kept_layers), measured
    for j, (formula, measured) in enumerate(zip(cost.graph_bytes, graphs, strict=True)):
        assert measured <= formula <= 2.5 * measured, (j, cost.spec.layer_types[j], "graph", formula, measured)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["qwen3_moe", "gpt_oss", "qwen3_5_moe"]), hidden=st.sampled_from([32, 64]),
       top_k=st.integers(1, 4), more_experts=st.integers(1, 8), expert_width=st.integers(1, 12),
       shared_width=st.integers(1, 12), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       batch=st.integers(1, 3), seq_len=st.integers(3, 130), seed=st.integers(0, 2**16))
def test_moe_working_sets_bound_the_measured(kind, hidden, top_k, more_experts, expert_width, shared_width, dtype,
                                             batch, seq_len, seed) -> None:
    """MoE layers of drawn widths (experts, top-k, expert and shared-expert widths; multiples of 8: grouped_mm's
    16-byte strides), fresh random weights: the formula (transformers' grouped_mm experts: top-k rows per token at
    the experts' own width, every expert's gate_up gradient at once) is never below the measured working set and
    within 1.7x of it (the most, up to 1.62x, on Qwen3.5-MoE's Gated DeltaNet layers at hidden 64 in fp32, batch 2-3
    of 3-10 tokens: the largest weight gradient and the chunk padding outweigh the tokens); the dense layers beside
    them (Qwen3-MoE's mlp_only_layers) too. A kept layer's graph formula is
    never below its measured graph."""
    experts = top_k + more_experts
    over = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=top_k)
    if kind == "gpt_oss":
        over.update(head_dim=hidden // 4, num_local_experts=experts, intermediate_size=8 * expert_width)
    else:
        over.update(num_experts=experts, moe_intermediate_size=8 * expert_width, intermediate_size=4 * hidden)
    if kind == "qwen3_moe":
        over.update(head_dim=hidden // 4)
    elif kind == "qwen3_5_moe":
        over.update(shared_expert_intermediate_size=8 * shared_width)
    model = tiny_models.make_model(kind, num_layers=3, attn="eager" if kind == "gpt_oss" else "sdpa", seed=seed)
    for key, value in over.items():
        setattr(model.config, key, value)
    torch.manual_seed(seed)
    model = type(model)(model.config)
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(measure_memory=True), compute_dtype=dtype)
    working, _ = ex.shapes.measured_working_bytes(batch, seq_len)
    name = "fp32" if dtype == torch.float32 else "bf16"
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), Workload(batch, seq_len, name))
    assert any(cost.spec.moe_layers)
    for j, (formula, measured) in enumerate(zip(cost.working_bytes, working, strict=True)):
        assert measured <= formula <= 1.7 * measured, (j, cost.spec.moe_layers[j], formula, measured)
    graphs = ex.memory_sizes(batch, seq_len).graph_bytes
    for j, (formula, measured) in enumerate(zip(cost.graph_bytes, graphs, strict=True)):
        assert measured <= formula, (j, cost.spec.moe_layers[j], "graph", formula, measured)


@pytest.mark.parametrize("kind", tiny_models.FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seq_len", [4, 5, 17])
def test_constant_bytes_are_the_executors(kind, attn, seq_len) -> None:
    """The CostModel's per-step constants (positions, rotary, loss, masks) equal what the executor allocates
    (`Rotary.constant_bytes`, checked against the tensors it makes) when the rotary covers the head; above it
    where it covers part (Qwen3.5, GPT-OSS's YaRN): eager masks per kind, SDPA's window mask from the window on."""
    if kind == "gpt_oss" and attn == "sdpa":
        pytest.skip("GPT-OSS has no SDPA")
    model = tiny_models.make_model(kind, num_layers=3, attn=attn)
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(), compute_dtype=torch.bfloat16)
    executor_bytes = ex.rotary.constant_bytes(3, seq_len, 2, False)
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), Workload(3, seq_len, "bf16"))
    spec = cost.spec
    assert spec.eager_attention == (attn == "eager")
    if ex.rotary.rotary_dim == spec.head_dim:
        assert cost.constant_device_bytes == executor_bytes
    else:
        assert executor_bytes < cost.constant_device_bytes <= executor_bytes + 2 * seq_len * spec.head_dim * 2


@pytest.mark.parametrize("kind", tiny_models.FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, seq_len", [(1, 11), (2, 200)])
def test_masked_working_sets_and_constants_bound_the_measured(kind, dtype, batch, seq_len) -> None:
    """A padded (or packed) batch gives every SDPA layer a mask tensor: each call copies it into a batch x seq^2
    additive mask and repeats k/v to every query head. The CostModel of a masked workload is never below the
    measured working sets of such a batch (main's unmasked formula was, by up to 26% at 2 x 200: docs/benchmarks.md)
    and within 1.2x on the dense families, 1.45x on MoE, hybrid and GPT-OSS (the unmasked bands); its constants are
    what the executor allocates for the batch (above it by the partial rotary's cos/sin only)."""
    model = tiny_models.make_model(kind, num_layers=3, attn="eager" if kind == "gpt_oss" else "sdpa")
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(measure_memory=True), compute_dtype=dtype)
    working, _ = ex.shapes.measured_working_bytes(batch, seq_len, masked=True)
    name = "fp32" if dtype == torch.float32 else "bf16"
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"),
                     Workload(batch, seq_len, name, masked=True))
    band = 1.2 if kind in ("llama", "mistral", "qwen2", "qwen3") else 1.45
    for j, (formula, measured) in enumerate(zip(cost.working_bytes, working, strict=True)):
        assert measured <= formula <= band * measured, (j, cost.spec.layer_types[j], formula, measured)
    executor_bytes = ex.memory_sizes(batch, seq_len, masked=True).constant_bytes
    spec = cost.spec
    if ex.rotary.rotary_dim == spec.head_dim:
        assert cost.constant_device_bytes == executor_bytes
    else:
        partial = batch * seq_len * 2 * (spec.head_dim - ex.rotary.rotary_dim) * dtype.itemsize
        assert cost.constant_device_bytes == executor_bytes + partial


Pairs = list[tuple[int, int]]


def _formula_over_measured(kind: str, over: dict, attn: str, dtype: torch.dtype, batch: int, seq_len: int,
                           masked: bool, seed: int = 0) -> tuple[CostModel, Pairs, Pairs]:
    """A 3-layer model of `kind` with `over` set on its config (fresh random weights): per layer (formula, measured)
    of the working set and of a kept layer's graph, measured with `LiveBytes` on the emulated device."""
    model = tiny_models.make_model(kind, num_layers=3, attn=attn, seed=seed)
    for key, value in over.items():
        setattr(model.config, key, value)
    torch.manual_seed(seed)
    model = type(model)(model.config)
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(measure_memory=True), compute_dtype=dtype)
    working, _ = ex.shapes.measured_working_bytes(batch, seq_len, masked=masked)
    graphs = ex.memory_sizes(batch, seq_len, masked=masked).graph_bytes
    name = "fp32" if dtype == torch.float32 else "bf16"
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"),
                     Workload(batch, seq_len, name, masked=masked))
    return cost, list(zip(cost.working_bytes, working, strict=True)), list(zip(cost.graph_bytes, graphs, strict=True))


@pytest.mark.parametrize("kind, over, attn, dtype, batch, seq_len, masked", [
    ("llama", dict(hidden_size=64, intermediate_size=40, head_dim=8), "sdpa", torch.bfloat16, 2, 200, False),  # 0.81x
    ("qwen2", dict(hidden_size=96, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=8),
     "sdpa", torch.bfloat16, 1, 196, False),  # 0.77x
    ("qwen2", dict(hidden_size=64, intermediate_size=8, num_attention_heads=8, num_key_value_heads=4, head_dim=32),
     "sdpa", torch.float32, 2, 40, True),  # 0.77x: d_q 4 h, masked
    ("qwen3", dict(hidden_size=128, intermediate_size=88, head_dim=8), "sdpa", torch.bfloat16, 3, 37, False),  # 0.90x
    ("mistral", dict(hidden_size=32, intermediate_size=8, head_dim=8), "sdpa", torch.bfloat16, 2, 129, False),  # 0.77x
    ("mistral", dict(hidden_size=64, intermediate_size=8, num_attention_heads=16, num_key_value_heads=8, head_dim=32),
     "sdpa", torch.bfloat16, 2, 150, False),  # the window's mask, d_q 8 h: 0.64x (0.92x with the norm's backward alone)
    ("qwen3_moe", dict(hidden_size=64, intermediate_size=8, num_experts=2, num_experts_per_tok=1,
                       moe_intermediate_size=8), "sdpa", torch.bfloat16, 2, 150, False),  # dense layer 0.76x
    ("qwen3_5_moe", dict(hidden_size=64, head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                         shared_expert_intermediate_size=8, linear_num_value_heads=2), "sdpa", torch.bfloat16, 2, 150,
     False),  # gated attention + MoE 0.97x
])
def test_narrow_mlp_and_wide_q_working_sets_bound_the_measured(kind, over, attn, dtype, batch, seq_len,
                                                                masked) -> None:
    """A layer whose MLP (or routed rows) is narrow against the hidden size peaks after its MLP's backward: in the
    post-attention RMSNorm's backward (fp32 hidden-wide temporaries in either dtype), or with d_q wide in the
    attention's backward. Main's formula, which sized the backward by the MLP, read 0.77-0.99x on these shapes
    (docs/benchmarks.md); now never below and within 1.3x."""
    _, working, _ = _formula_over_measured(kind, over, attn, dtype, batch, seq_len, masked)
    for j, (formula, measured) in enumerate(working):
        assert measured <= formula <= 1.3 * measured, (j, formula, measured)


def _check_drawn_dense(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"]), "kind")
    hidden = data.draw(st.sampled_from([32, 64, 96, 128]), "hidden")
    heads = data.draw(st.sampled_from([2, 4, 8, 16]), "heads")
    over = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads // 2,
                head_dim=data.draw(st.sampled_from([8, 16, 24, 32]), "head_dim"),  # d_q 16 .. 512: below and above h
                intermediate_size=8 * data.draw(st.integers(1, 3 * hidden // 8), "intermediate / 8"))  # 8 .. 3 h
    if kind == "qwen3_moe":  # its dense-MLP layer (mlp_only_layers) beside narrow experts
        over.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8 * data.draw(st.integers(1, 4)))
    attn = data.draw(st.sampled_from(["sdpa", "eager"]), "attn")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), "dtype")
    batch, seq_len = data.draw(st.integers(1, 3), "batch"), data.draw(st.integers(3, 160), "seq_len")
    masked = data.draw(st.booleans(), "masked")
    cost, working, graphs = _formula_over_measured(kind, over, attn, dtype, batch, seq_len, masked,
                                                   seed=data.draw(st.integers(0, 2**16), "seed"))
    for j, (formula, measured) in enumerate(working):
        assert measured <= formula <= 1.45 * measured, (j, cost.spec.layer_types[j], formula, measured)
    for j, (formula, measured) in enumerate(graphs):
        assert measured <= formula, (j, "graph", formula, measured)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_dense_working_sets_of_drawn_widths_bound_the_measured(data) -> None:
    """Dense attention layers of drawn shapes (intermediate 8 .. 3 h and d_q 16 .. 512 against hidden 32-128, SDPA
    and eager, both dtypes, masked or not; Qwen3-MoE's dense layer beside top-1 experts): the working-set formula is
    never below the measured and within 1.45x; a kept layer's graph never below its measured graph."""
    _check_drawn_dense(data)


def test_the_mlp_moment_counts_only_the_mlps_weight_gradient() -> None:
    """A Qwen3-MoE layer of 7 tokens whose attention (h x d_q = 96 x 64) is wider than its experts' gate_up (2 x 2 x 8
    rows of 96): the attention's weight gradient is made after the MLP's backward, so the MLP's moment holds only the
    MLP's own. The drawn-widths property found this shape at 1.50x when the MLP's moment charged the attention's too;
    the attention's is counted at its own moment (`_after_mlp_bytes`) and the bound holds with room."""
    over = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80,
                num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
    cost, working, graphs = _formula_over_measured("qwen3_moe", over, "eager", torch.float32, 1, 7, True, seed=37)
    for j, (formula, measured) in enumerate(working):
        assert measured <= formula <= 1.45 * measured, (j, formula, measured)
        if cost.spec.moe_layers[j]:  # the case: the attention's weight gradient outweighs the MLP's
            assert cost._largest_weight_bytes(j) > cost._mlp_moment_weight_bytes(j)
    for j, (formula, measured) in enumerate(graphs):
        assert measured <= formula, (j, "graph", formula, measured)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_dense_working_sets_of_many_drawn_widths_bound_the_measured(data) -> None:
    """The same over 80 drawn shapes (~2 min of CPU)."""
    _check_drawn_dense(data)
