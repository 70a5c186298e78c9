"""The executor's input interface: padding, packing, the step's token count and forward-only evaluation,
each checked against the model's own transformers forward/backward (loss and every gradient) under random plans."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import (
    VOCAB,
    Gradients,
    assert_matches,
    make_batch,
    make_model,
    num_label_tokens,
    pack,
    reference,
    unpacked,
)

from lazytrain import EmulatedDevice, Executor, Plan
from lazytrain.errors import LazyTrainError

NUM_LAYERS = 6
KINDS = ["llama", "qwen2", "qwen3", "mistral"]
# a tier list for the inner boundaries 1..L-1; 0 and L are always gpu
INNER = st.lists(st.sampled_from(["gpu", "cpu", "nvme", "recompute"]), min_size=NUM_LAYERS - 1,
                 max_size=NUM_LAYERS - 1)
FEW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def executor(model: torch.nn.Module, inner: list[str], **kwargs) -> Executor:
    return Executor(model, Plan.from_tiers(model, ["gpu", *inner, "gpu"]), EmulatedDevice(), **kwargs)


def right_padding(batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """A (B, S) 1/0 mask: each row keeps a random prefix of at least 2 tokens; one row is unpadded."""
    keep = torch.randint(2, seq_len + 1, (batch,), generator=gen)
    keep[0] = seq_len
    return (torch.arange(seq_len).unsqueeze(0) < keep.unsqueeze(1)).long()


# ---- gradient accumulation: the step's token count normalizes every micro-batch -------------------------
@pytest.mark.exactness
@FEW
@given(inner=INNER, kind=st.sampled_from(KINDS), seed=st.integers(0, 1000))
def test_four_micro_batches_of_two_equal_one_of_eight(inner, kind, seed) -> None:
    model = make_model(kind)
    ids, labels = make_batch(8, 9, seed=seed)
    labels[2:4, :6] = -100  # uneven: one micro-batch has far fewer labels than the others
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    whole = copy.deepcopy(model)
    executor(whole, inner, head_chunk_tokens=5).forward_backward(ids, labels)
    ex = executor(model, inner, head_chunk_tokens=5)
    n = num_label_tokens(labels)
    losses = [ex.forward_backward(ids[i:i + 2], labels[i:i + 2], num_tokens=n, last_micro_batch=i == 6)
              for i in range(0, 8, 2)]
    # fp32 sums in another order: 2e-6 (16 fp32 ulps) of a gradient's size; one that is the small residue of terms
    # that cancel (Qwen2's k_proj bias: the bias's part the softmax cannot see) gets 4x its own fp32 rounding, which
    # `reference` measured against float64 (the one-batch executor's rounds as transformers' does)
    assert_matches(model, sum(float(v) for v in losses), ref_loss, ref_grads, tol=2e-6)
    whole_grads = Gradients((n, p.grad) for n, p in whole.named_parameters())
    whole_grads.rounding, whole_grads.loss_rounding = ref_grads.rounding, ref_grads.loss_rounding
    assert_matches(model, sum(float(v) for v in losses), ref_loss, whole_grads, tol=2e-6)


@pytest.mark.exactness
def test_a_micro_batch_without_labels_adds_nothing() -> None:
    model = make_model("llama")
    ids, labels = make_batch(4, 7)
    labels[2:] = -100
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    ex = executor(model, ["cpu", "recompute", "nvme", "gpu", "recompute"])
    n = num_label_tokens(labels)
    first = ex.forward_backward(ids[:2], labels[:2], num_tokens=n, last_micro_batch=False)
    second = ex.forward_backward(ids[2:], labels[2:], num_tokens=n)
    assert float(second) == 0.0
    assert_matches(model, float(first) + float(second), ref_loss, ref_grads, tol=1e-6)


# ---- padding: right padding with an attention mask, as transformers takes it --------------------------
@pytest.mark.exactness
@FEW
@given(inner=INNER, kind=st.sampled_from(KINDS), attn=st.sampled_from(["eager", "sdpa"]), seed=st.integers(0, 1000))
def test_padding_matches_transformers_with_attention_mask(inner, kind, attn, seed) -> None:
    model = make_model(kind, attn=attn)
    gen = torch.Generator().manual_seed(seed)
    ids, labels = make_batch(3, 11, seed=seed)
    mask = right_padding(3, 11, gen)
    labels[mask == 0] = -100
    ids[mask == 0] = 0  # what a pad token is does not matter
    ref_loss, ref_grads = reference(model, input_ids=ids, attention_mask=mask, labels=labels)
    ex = executor(model, inner, head_chunk_tokens=4)
    loss = ex.forward_backward(ids, labels, attention_mask=mask)
    assert_matches(model, loss, ref_loss, ref_grads, tol=1e-5)
    stats = ex.last_step
    assert stats.peak_device_bytes == stats.predicted_peak_device_bytes == ex.predicted_peak_bytes(3, 11, masked=True)


# ---- packing: examples concatenated in a row, positions restarting, no attention across them -----------
@pytest.mark.exactness
@FEW
@given(inner=INNER, kind=st.sampled_from(KINDS), attn=st.sampled_from(["eager", "sdpa"]), seed=st.integers(0, 1000))
def test_a_packed_row_of_three_equals_the_three_unpacked(inner, kind, attn, seed) -> None:
    model = make_model(kind, attn=attn)
    gen = torch.Generator().manual_seed(seed)
    examples = [torch.randint(0, VOCAB, (int(n),), generator=gen) for n in torch.randint(3, 8, (3,), generator=gen)]
    ref_loss, ref_grads = reference(model, **unpacked(examples))
    ids, labels, positions = pack(examples, 24)
    ex = executor(model, inner, head_chunk_tokens=5)
    loss = ex.forward_backward(ids, labels, position_ids=positions)
    assert_matches(model, loss, ref_loss, ref_grads, tol=1e-5)
    assert ex.last_step.peak_device_bytes == ex.predicted_peak_bytes(1, 24, masked=True)


@pytest.mark.exactness
def test_packed_rows_match_transformers_packed_forward() -> None:
    """Two packed rows (different example boundaries per row) against transformers' own packed-sequence path."""
    model = make_model("mistral", attn="sdpa")  # sliding window: the window counts within an example
    gen = torch.Generator().manual_seed(5)
    rows = [pack([torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths], 20)
            for lengths in ([7, 9, 2], [12, 6])]
    ids, labels, positions = (torch.cat(parts) for parts in zip(*rows, strict=True))
    # use_cache=False: with a cache transformers does not look for packed sequences in position_ids
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    ex = executor(model, ["nvme", "recompute", "cpu", "recompute", "gpu"])
    assert_matches(model, ex.forward_backward(ids, labels, position_ids=positions), ref_loss, ref_grads, tol=1e-5)


# ---- forward-only evaluation ------------------------------------------------------------------------------
@pytest.mark.exactness
@FEW
@given(inner=INNER, kind=st.sampled_from(KINDS), padded=st.booleans(), seed=st.integers(0, 1000))
def test_forward_loss_equals_transformers_loss(inner, kind, padded, seed) -> None:
    model = make_model(kind)
    ids, labels = make_batch(3, 11, seed=seed)
    inputs = dict(input_ids=ids, labels=labels)
    if padded:
        inputs["attention_mask"] = right_padding(3, 11, torch.Generator().manual_seed(seed))
        labels[inputs["attention_mask"] == 0] = -100
    with torch.no_grad():
        ref_loss = float(copy.deepcopy(model)(**inputs).loss)
    plan = Plan.from_tiers(model, ["gpu", *inner, "gpu"])
    cap = Executor(model, plan, EmulatedDevice()).predicted_peak_bytes(3, 11, masked=padded)
    ex = Executor(model, plan, EmulatedDevice(capacity_bytes=cap))  # evaluation fits where training does
    loss_sum, count = ex.forward_loss(ids, labels, attention_mask=inputs.get("attention_mask"))
    assert count == num_label_tokens(labels)
    assert abs(loss_sum / count - ref_loss) <= 1e-5 * ref_loss
    assert all(p.grad is None for p in model.parameters()) and ex.last_step is None
    assert ex.device.used_bytes == 0


@pytest.mark.exactness
def test_forward_loss_on_packed_rows_equals_the_examples_unpacked() -> None:
    model = make_model("qwen3")
    gen = torch.Generator().manual_seed(2)
    examples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 8, 4)]
    with torch.no_grad():
        ref_loss = float(copy.deepcopy(model)(**unpacked(examples)).loss)
    ids, labels, positions = pack(examples, 20)
    ex = executor(model, ["cpu"] * (NUM_LAYERS - 1))
    loss_sum, count = ex.forward_loss(ids, labels, position_ids=positions)
    assert count == sum(len(e) - 1 for e in examples)
    assert abs(loss_sum / count - ref_loss) <= 1e-5 * ref_loss


# ---- the device constants are what the planner counts ------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("inputs", ["plain", "padding", "packing"])
def test_constant_bytes_are_the_tensors_built(kind: str, attn: str, inputs: str) -> None:
    model = make_model(kind, attn=attn)
    ex = executor(model, ["gpu"] * (NUM_LAYERS - 1))
    gen = torch.Generator().manual_seed(0)
    for seq_len in (4, 11):  # below and past Mistral's window of 5
        mask = right_padding(3, seq_len, gen) if inputs == "padding" else None
        positions = torch.tensor([[0, 1, 2, 0] * 3])[:, :seq_len].expand(3, -1) if inputs == "packing" else None
        boundary0 = torch.randn(3, seq_len, 32)
        built = ex.rotary.constants(boundary0, mask, positions).num_bytes
        assert built == ex.memory_sizes(3, seq_len, masked=inputs != "plain").constant_bytes, seq_len


# ---- bad inputs: one line each, nothing run -------------------------------------------------------------
def test_bad_inputs_are_refused() -> None:
    model = make_model("llama")
    ids, labels = make_batch(2, 7)
    ex = executor(model, ["gpu"] * (NUM_LAYERS - 1))
    with pytest.raises(LazyTrainError, match="num_tokens must be a positive int"):
        ex.forward_backward(ids, labels, num_tokens=0)
    with pytest.raises(LazyTrainError, match="attention_mask must hold only 1"):
        ex.forward_backward(ids, labels, attention_mask=torch.full_like(ids, 2))
    with pytest.raises(LazyTrainError, match=r"position_ids must be \(batch, seq_len\)"):
        ex.forward_loss(ids, labels, position_ids=torch.arange(7).unsqueeze(0))
    assert all(p.grad is None for p in model.parameters()) and ex.device.used_bytes == 0
