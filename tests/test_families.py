"""Every supported family through the executor, exactly (fp32 loss and every gradient vs transformers), under
random plans with every tier; the family table; one-line refusals of what is not supported."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import FAMILIES, VOCAB, assert_matches, make_batch, make_model, pack, reference, unpacked

from lazytrain import EmulatedDevice, Executor, ModelSpec, Plan
from lazytrain.costmodel import families
from lazytrain.errors import LazyTrainError
from lazytrain.runtime import hf

NUM_LAYERS = 6
MIXED = ["gpu", "nvme", "recompute", "cpu", "recompute", "gpu", "gpu"]  # every tier, two recompute segments
INNER = st.lists(st.sampled_from(["gpu", "cpu", "nvme", "recompute"]), min_size=NUM_LAYERS - 1,
                 max_size=NUM_LAYERS - 1)
README = Path(__file__).parents[1] / "README.md"
DOCS = Path(__file__).parents[1] / "docs" / "executor.md"


def run(model: torch.nn.Module, tiers: list[str], ids: torch.Tensor, labels: torch.Tensor, head_chunk_tokens: int = 6,
        **inputs) -> Executor:
    ex = Executor(model, Plan.from_tiers(model, tiers), EmulatedDevice(), head_chunk_tokens=head_chunk_tokens)
    ex.last_loss = ex.forward_backward(ids, labels, **inputs)
    return ex


@pytest.mark.exactness
@pytest.mark.parametrize("kind", FAMILIES)
def test_family_matches_transformers_under_a_mixed_plan(kind: str) -> None:
    """nvme, cpu, two recompute segments; right padding with an attention mask on top."""
    model = make_model(kind)
    ids, labels = make_batch(3, 11, seed=7)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    labels[mask == 0] = -100
    ref_loss, ref_grads = reference(model, input_ids=ids, attention_mask=mask, labels=labels)
    ex = run(model, MIXED, ids, labels, attention_mask=mask)
    assert_matches(model, ex.last_loss, ref_loss, ref_grads)
    assert ex.last_step.peak_device_bytes == ex.last_step.predicted_peak_device_bytes


@pytest.mark.exactness
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inner=INNER, kind=st.sampled_from(FAMILIES), batch=st.sampled_from([1, 2]), seq_len=st.sampled_from([7, 13]))
def test_families_under_random_plans(inner, kind, batch, seq_len) -> None:
    """With the loss head in one piece, as transformers computes it, every plan gives transformers' gradients to
    the last bit (1e-7 leaves room for the tied embedding's two contributions, summed in another order); the
    chunked head (6 tokens, the real setting) splits the head's sums only: its worst gradient is the head's own,
    2e-7 apart (1e-6 here). A gradient that is the residue of terms that cancel (GPT-OSS's router bias) rounds
    further in fp32 alone: it gets a few times that rounding, measured against float64 (`assert_matches`)."""
    model = make_model(kind)
    ids, labels = make_batch(batch, seq_len, seed=seq_len)
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    tiers = ["gpu", *inner, "gpu"]
    chunked = copy.deepcopy(model)
    ex = run(model, tiers, ids, labels, head_chunk_tokens=batch * seq_len)
    assert_matches(model, ex.last_loss, ref_loss, ref_grads, tol=1e-7)
    assert_matches(chunked, run(chunked, tiers, ids, labels).last_loss, ref_loss, ref_grads, tol=1e-6)


@pytest.mark.exactness
@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("tiers", [["gpu"] * 7, ["gpu"] + ["recompute"] * 5 + ["gpu"], ["gpu"] + ["nvme"] * 5 + ["gpu"],
                                   ["gpu", "cpu", "gpu", "cpu", "gpu", "cpu", "gpu"]])
def test_every_plan_shape_for_every_family(kind: str, tiers: list[str]) -> None:
    model = make_model(kind, attn="sdpa" if kind != "gpt_oss" else "eager")
    ids, labels = make_batch(2, 70, seed=3)  # past one Gated DeltaNet chunk of 64 tokens
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    assert_matches(model, run(model, tiers, ids, labels).last_loss, ref_loss, ref_grads, tol=1e-6)


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_packing_equals_the_examples_unpacked(kind: str) -> None:
    """(Not transformers' own packed forward: GPT-OSS builds its masks without position_ids, so there the
    examples of a packed row attend to each other.)"""
    model = make_model(kind)
    gen = torch.Generator().manual_seed(4)
    examples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 7, 4)]
    ref_loss, ref_grads = reference(model, **unpacked(examples))
    ids, labels, positions = pack(examples, 18)
    assert_matches(model, run(model, MIXED, ids, labels, position_ids=positions).last_loss, ref_loss, ref_grads)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_linear_attention_refuses_packed_rows(kind: str) -> None:
    model = make_model(kind)
    ids, labels = make_batch(1, 10)
    ex = Executor(model, Plan.from_tiers(model, MIXED), EmulatedDevice())
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with pytest.raises(LazyTrainError, match="cannot train on packed rows .*; set packing: false"):
        ex.forward_backward(ids, labels, position_ids=packed)
    with pytest.raises(LazyTrainError, match="set packing: false"):
        ex.forward_loss(ids, labels, position_ids=packed)
    assert all(p.grad is None for p in model.parameters()) and ex.device.used_bytes == 0
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)  # one example per row is no packing
    ex.forward_backward(ids, labels, position_ids=torch.arange(10).unsqueeze(0))
    assert_matches(model, float(ex.last_step.loss), ref_loss, ref_grads)


def test_a_multimodal_folder_trains_its_text_tower(tmp_path: Path) -> None:
    """A full Qwen3.5/3.6 checkpoint (vision tower included): AutoModelForCausalLM builds the text tower from the
    folder, its plan (ModelSpec.load of the same folder) is accepted, and the executor is exact on it."""
    text = {**make_model("qwen3_5").config.to_dict(), "architectures": None}
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=text["hidden_size"])
    torch.manual_seed(0)
    tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.model_type == "qwen3_5_text"
    plan = Plan.from_tiers(ModelSpec.load(tmp_path), MIXED)
    ids, labels = make_batch(2, 9)
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    ex = Executor(model, plan, EmulatedDevice())
    assert_matches(model, ex.forward_backward(ids, labels), ref_loss, ref_grads)
    multimodal = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision))
    with pytest.raises(LazyTrainError, match="multimodal: load its text tower with AutoModelForCausalLM"):
        hf.find_parts(multimodal)


def test_an_unsupported_model_gets_the_list_of_families() -> None:
    config = tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB)
    with pytest.raises(LazyTrainError, match=r"not supported; supported: Llama \(llama\), .*GPT-OSS \(gpt_oss\)"):
        Executor(tf.GPT2LMHeadModel(config), Plan.from_tiers(make_model("llama"), MIXED), EmulatedDevice())


def test_the_docs_table_lists_every_family() -> None:
    docs = DOCS.read_text()
    for model_type, family in hf.FAMILIES.items():
        assert f"| {family.name} | `{model_type}` |" in docs, model_type
    assert "docs/executor.md#supported-model-families" in README.read_text()


def test_every_family_is_a_model_spec_family() -> None:
    """The executor's table and the planner's ModelSpec read one list: what one supports, the other does."""
    from lazytrain.costmodel import model as spec_model

    assert hf.FAMILIES is families.FAMILIES and hf.TEXT_TOWERS is families.TEXT_TOWERS
    assert spec_model.SUPPORTED_TYPES == set(hf.FAMILIES) | set(hf.TEXT_TOWERS)
    assert spec_model.DENSE_TYPES | spec_model.HYBRID_TYPES | spec_model.MOE_TYPES == spec_model.SUPPORTED_TYPES


def test_plan_refuses_a_family_train_cannot_run(tmp_path, capsys) -> None:
    """A config.json of a family transformers has but the executor does not run (Qwen3-Next): `lazytrain plan`
    says so in one line, exit 2, rather than planning a job `lazytrain train` refuses."""
    from lazytrain.cli import main
    from lazytrain.costmodel.model import PRESET_DIR

    config = {**json.loads((PRESET_DIR / "tiny-qwen3.6.json").read_text()), "model_type": "qwen3_next"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "qwen3_next" not in families.SUPPORTED_TYPES
    assert main(["plan", "--model", str(tmp_path), "--hardware", "emulated", "--batch-size", "1",
                 "--seq-len", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'qwen3_next' is not supported" in err[0], err
    assert "Qwen3.5 / Qwen3.6 (qwen3_5_text)" in err[0]
