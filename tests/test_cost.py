"""CostModel: FLOP formulas (causal attention, GQA, sliding window, linear attention, MoE), bytes, memory modes."""

from __future__ import annotations

import math
import random

import pytest

from lazytrain.costmodel.cost import (
    STATE_HEADER_BYTES,
    STATE_PAGE_BYTES,
    UPDATE_CHUNK_NUMEL,
    CostModel,
    mean_keys_per_query,
)
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError

RNG = random.Random(20261202)
FLOP_ONLY = HardwareSpec.load("h800", mem_gbps=math.inf)  # time = FLOPs / rate exactly


def _dense(**over) -> ModelSpec:
    heads = RNG.choice([4, 8])
    cfg = {"model_type": "llama", "hidden_size": heads * RNG.choice([16, 32]), "num_attention_heads": heads,
           "num_key_value_heads": RNG.choice([1, 2, heads]), "intermediate_size": RNG.randrange(64, 300),
           "num_hidden_layers": RNG.randrange(2, 6), "vocab_size": RNG.randrange(500, 2000), **over}
    return ModelSpec.from_config(cfg, name="dense")


def test_dense_forward_time_is_linear_plus_causal_attention_flops_over_the_rate() -> None:
    spec = _dense()
    wl = Workload(RNG.randrange(1, 9), RNG.randrange(16, 600))
    cost = CostModel(spec, FLOP_ONLY, wl)
    T, s = wl.tokens, wl.seq_len
    d_q = spec.num_attention_heads * spec.head_dim
    # causal: query t sees t+1 keys; QK^T and AV are 2 FLOPs per multiply-add each
    attention = 2 * 2 * d_q * wl.batch_size * sum(t + 1 for t in range(s))
    flops = 2 * spec.layer_params[0] * T + attention
    assert cost.forward_s[0] == pytest.approx(flops / (FLOP_ONLY.matmul_tflops * 1e12), rel=1e-12)
    assert cost.backward_s == pytest.approx([3 * f for f in cost.forward_s])
    assert cost.head_s == pytest.approx(6 * spec.vocab_size * spec.hidden_size * T / FLOP_ONLY.matmul_flops_per_s,
                                        rel=1e-12)


def test_gqa_changes_only_the_projection_flops() -> None:
    base = _dense(num_key_value_heads=None)
    gqa = _dense(**{k: getattr(base, k) for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                                                    "vocab_size")}, num_hidden_layers=base.num_layers,
                 num_key_value_heads=1)
    wl = Workload(2, 128)
    full, grouped = CostModel(base, FLOP_ONLY, wl), CostModel(gqa, FLOP_ONLY, wl)
    saved = 2 * (base.layer_params[0] - gqa.layer_params[0]) * wl.tokens
    assert saved > 0
    assert (full.forward_flops[0] - grouped.forward_flops[0]) == pytest.approx(saved)


@pytest.mark.parametrize("trial", range(5))
def test_mean_keys_per_query_matches_brute_force(trial: int) -> None:
    seq, window = RNG.randrange(1, 400), RNG.randrange(1, 500)
    assert mean_keys_per_query(seq, window) == pytest.approx(sum(min(t + 1, window) for t in range(seq)) / seq)


def test_sliding_linear_and_moe_layers() -> None:
    spec = ModelSpec.load("tiny-gpt-oss")
    assert "sliding_attention" in spec.layer_types and spec.sliding_window and spec.is_moe
    wl = Workload(2, 4 * spec.sliding_window)
    cost = CostModel(spec, FLOP_ONLY, wl)
    for j, kind in enumerate(spec.layer_types):
        linear = 2 * spec.layer_active_params[j] * wl.tokens
        keys = (wl.seq_len + 1) / 2  # causal
        if kind == "sliding_attention":
            keys = mean_keys_per_query(wl.seq_len, spec.sliding_window)
        assert cost.forward_flops[j] == pytest.approx(linear + 4 * spec.num_attention_heads * spec.head_dim
                                                      * wl.tokens * keys)
        # MoE: every expert streams and is updated, only the top-k are computed
        assert cost.param_bytes[j] == spec.layer_params[j] * 2
        assert spec.layer_active_params[j] < spec.layer_params[j]
    hybrid = ModelSpec.load("tiny-qwen3.6")
    assert {"linear_attention", "full_attention"} <= set(hybrid.layer_types)
    short, long = (CostModel(hybrid, FLOP_ONLY, Workload(1, s)) for s in (64, 256))
    for j, kind in enumerate(hybrid.layer_types):
        ratio = long.forward_flops[j] / short.forward_flops[j]
        if kind == "linear_attention":
            assert ratio == pytest.approx(4.0)  # no seq^2 term
        else:
            assert ratio > 4.0


def test_bytes_follow_shapes_and_dtype() -> None:
    spec = _dense()
    for dtype, size in (("bf16", 2), ("fp32", 4)):
        wl = Workload(RNG.randrange(1, 5), RNG.randrange(8, 64), dtype)
        cost = CostModel(spec, FLOP_ONLY, wl)
        assert cost.boundary_bytes == [wl.tokens * spec.hidden_size * size] * (spec.num_layers + 1)
        assert cost.param_bytes == [p * size for p in spec.layer_params] == cost.grad_bytes
        assert cost.head_param_bytes == (spec.vocab_size + 1) * spec.hidden_size * size
        assert cost.slot_bytes == max(max(cost.param_bytes), cost.head_param_bytes)
        assert all(w > 0 for w in cost.working_bytes)
    with pytest.raises(LazyTrainError, match="optimizer 'adam16'"):
        CostModel(spec, FLOP_ONLY, Workload(1, 8), "adam16")


def test_optimizer_modes_change_states_and_time() -> None:
    spec = _dense()
    hw = HardwareSpec.load("h800", host_mem_gbps=RNG.uniform(20, 400))
    wl = Workload(1, 16)
    fp32, hybrid, q8 = (CostModel(spec, hw, wl, mode) for mode in ("adamw", "hybrid8bit", "8bit"))
    n = spec.num_params
    assert fp32.optimizer_state_bytes() == 8 * n
    assert q8.optimizer_state_bytes() == round(n * (2 + 8 / 256))
    assert fp32.optimizer_state_bytes() > hybrid.optimizer_state_bytes() > q8.optimizer_state_bytes()
    assert hybrid.optimizer_state_bytes() == round(n * (0.98 * 8 + 0.02 * (2 + 8 / 256)))
    assert fp32.total_optimizer_s > hybrid.total_optimizer_s > q8.total_optimizer_s  # fewer bytes per parameter
    assert fp32.static_host_bytes() - q8.static_host_bytes() == 8 * n - q8.optimizer_state_bytes()
    executor = CostModel(spec, hw, Workload(1, 16, "bf16"))
    streamed = n - (0 if spec.tie_word_embeddings else spec.embedding_params)
    embedding = n - streamed
    # the update's chunks (optim/chunked.py): a tensor is at most its group, a chunk at most UPDATE_CHUNK_NUMEL
    chunk = min(UPDATE_CHUNK_NUMEL, max(*spec.streamed_group_params, embedding))
    # fp32 masters, a bf16 copy and bf16 gradients of every streamed group (the untied embedding's gradient in
    # fp32), fp32 chunks of the cast gradient: 8 B/param + states + a constant
    assert executor.static_host_bytes() == (4 * n + 2 * streamed + 2 * streamed + 4 * embedding + 4 * chunk
                                            + fp32.optimizer_state_bytes())
    bf16_masters = CostModel(spec, hw, Workload(1, 16, "bf16"), "8bit",
                             master_weights="bf16")  # the bf16 weights are streamed; bf16 gradients; fp32 chunks
    assert bf16_masters.static_host_bytes() == 2 * n + 2 * n + 8 * chunk + q8.optimizer_state_bytes()
    accumulating = CostModel(spec, hw, Workload(1, 16, "bf16"), grad_accumulation=4)
    # fp32 sums of fp32 masters: nothing to cast (torch's AdamW clips them in place)
    assert accumulating.static_host_bytes() == executor.static_host_bytes() + 4 * streamed - 4 * chunk
    big = ModelSpec.load("qwen2.5-7b")  # no transient the size of the largest group: 7B at 10.03 / 6.03 B/param
    for masters, per_param in (("fp32", 10.031), ("bf16", 6.032)):
        layout = CostModel(big, hw, Workload(1, 16, "bf16"), "8bit", master_weights=masters)
        assert layout.static_host_bytes() / big.num_params == pytest.approx(per_param, abs=1e-3)
        assert layout.host_breakdown()["update_scratch"] <= 8 * UPDATE_CHUNK_NUMEL


def test_optimizer_state_on_nvme_leaves_the_host_about_4_bytes_per_parameter() -> None:
    """optimizer_offload nvme: the state files hold each group's moments and, with fp32 masters of a bf16 compute,
    its masters but the embedding matrix's; the host keeps the streamed weights, the gradients and D staging slots
    of the largest file (at most 4.3 B/param + staging with bf16 compute)."""
    from lazytrain.runtime.files import ALIGN_BYTES

    assert STATE_PAGE_BYTES == ALIGN_BYTES
    big, hw = ModelSpec.load("qwen2.5-14b"), HardwareSpec.load("rtx3090")
    n, L, emb = big.num_params, big.num_layers, big.embedding_params
    for masters in ("bf16", "fp32"):
        ram = CostModel(big, hw, Workload(4, 1024, "bf16"), "8bit", master_weights=masters)
        nvme = CostModel(big, hw, Workload(4, 1024, "bf16"), "8bit", master_weights=masters,
                         optimizer_offload="nvme")
        files = nvme.state_group_bytes()
        per_param = 2 + 8 / 256 + (4 if masters == "fp32" else 0)
        assert len(files) == L + 2 and all(f % STATE_PAGE_BYTES == 0 for f in files)
        assert files[1] == pytest.approx(big.layer_params[0] * per_param, abs=STATE_PAGE_BYTES)
        assert files[0] == pytest.approx(emb * (2 + 8 / 256), abs=STATE_PAGE_BYTES)  # the embedding's master in RAM
        assert nvme.staging_slot_bytes == max(files) and ram.staging_slot_bytes == 0
        assert nvme.nvme_state_bytes() == sum(files) + (L + 2) * STATE_HEADER_BYTES and ram.nvme_state_bytes() == 0
        host, host3 = nvme.host_breakdown(), nvme.host_breakdown(staging_depth=3)
        assert host["optimizer_states"] == 0 and host3["staging"] == 3 * max(files)
        assert {**host3, "staging": 0} == host
        assert host["weights"] == (4 * emb if masters == "fp32" else 2 * n)
        assert sum(host.values()) / n <= 4.3
        assert ram.static_host_bytes() - nvme.static_host_bytes() == pytest.approx(
            ram.optimizer_state_bytes() + (4 * (n - emb) if masters == "fp32" else 0))
    tied = CostModel(ModelSpec.load("qwen2.5-3b"), hw, Workload(1, 16, "bf16"), "adamw", optimizer_offload="nvme")
    assert tied.spec.tie_word_embeddings and tied.state_group_bytes()[0] == 0  # the head's group owns it
    spec = tied.spec  # the tied head's file: the norm's and the shared matrix's moments, the norm's master only
    assert tied.state_group_bytes()[-1] == pytest.approx(8 * (spec.hidden_size + spec.embedding_params)
                                                         + 4 * spec.hidden_size, abs=STATE_PAGE_BYTES)
    fp32 = CostModel(spec, hw, Workload(1, 16, "fp32"), "adamw", optimizer_offload="nvme")
    assert not fp32.masters_offloaded and fp32.host_breakdown()["weights"] == 4 * spec.num_params  # streamed
    with pytest.raises(LazyTrainError, match="optimizer_offload 'disk'"):
        CostModel(spec, hw, Workload(1, 16), optimizer_offload="disk")


@pytest.mark.parametrize(("optimizer", "dtype", "masters", "accumulation", "layer_bytes"), [
    ("adamw", "bf16", "fp32", 1, 2 + 8 + 16 + 6),  # bf16 gradient cast in a cached chunk, fused AdamW, copy refreshed
    ("adamw", "fp32", "fp32", 1, 8 + 28),  # clip in place, fused AdamW
    ("8bit", "bf16", "fp32", 1, 2 + 8 + 4 + 1 / 16 + 2),  # one pass: gradient, weights, codes (+ absmax), copy
    ("8bit", "bf16", "fp32", 3, 4 + 8 + 4 + 1 / 16 + 2),  # an fp32 sum
    ("8bit", "bf16", "bf16", 1, 2 + 4 + 4 + 1 / 16),  # one pass over bf16 gradient, bf16 weights, codes; no copy
    ("8bit", "bf16", "bf16", 3, 4 + 4 + 4 + 1 / 16),  # the fp32 sum rounded to bf16 in registers
    ("hybrid8bit", "bf16", "fp32", 1, 0.98 * (2 + 8 + 16) + 0.02 * (2 + 8 + 4 + 1 / 16) + 2),  # copy in the pass
    ("hybrid8bit", "bf16", "fp32", 3, 0.98 * (4 + 8 + 16) + 0.02 * (4 + 8 + 4 + 1 / 16) + 2),  # fp32 sum chunked
])
def test_update_seconds_are_its_bytes_over_host_bandwidth(optimizer, dtype, masters, accumulation, layer_bytes):
    """One rate for all is gone: each update's seconds are the bytes it moves per parameter (by optimizer, master
    and compute dtype) over the host's memory bandwidth."""
    gbps = RNG.uniform(20, 400)
    spec = ModelSpec.load("qwen2.5-7b")  # untied: the embedding's gradient is in the masters' dtype, not streamed
    cost = CostModel(spec, HardwareSpec.load("rtx3090", host_mem_gbps=gbps), Workload(1, 16, dtype), optimizer,
                     master_weights=masters, grad_accumulation=accumulation)
    assert cost.update_bytes_per_param("layer") == pytest.approx(layer_bytes)
    assert cost.optimizer_s[0] == pytest.approx(spec.layer_params[0] * layer_bytes / (gbps * 1e9))
    embedding = cost.update_bytes_per_param("embedding")
    assert embedding > 0 and cost.embedding_optimizer_s == pytest.approx(
        spec.embedding_params * embedding / (gbps * 1e9))
    assert cost.total_optimizer_s == pytest.approx(cost.update_bytes() / (gbps * 1e9))


def test_throughput_conventions() -> None:
    spec = _dense()
    wl = Workload(3, 50)
    cost = CostModel(spec, FLOP_ONLY, wl)
    step_s = RNG.uniform(0.5, 5)
    assert cost.tflops(step_s) == pytest.approx(6 * spec.num_params * 150 / step_s / 1e12)
    assert cost.tokens_per_s(step_s) == pytest.approx(150 / step_s)


def test_with_times_overrides_and_validates() -> None:
    spec = _dense()
    cost = CostModel(spec, FLOP_ONLY, Workload(1, 8))
    times = [RNG.uniform(0.1, 1) for _ in range(spec.num_layers)]
    measured = cost.with_times(forward_s=times, backward_s=0.5, head_s=0.25)
    assert measured.forward_s == times and measured.backward_s == [0.5] * spec.num_layers
    assert measured.head_s == 0.25 and cost.head_s != 0.25  # the original is untouched
    with pytest.raises(LazyTrainError, match="forward_s"):
        cost.with_times(forward_s=times[:-1])
    with pytest.raises(LazyTrainError, match="backward_s"):
        cost.with_times(backward_s=[-1.0] * spec.num_layers)


def test_windows_attention_and_expert_widths_are_read_from_the_config() -> None:
    """What the working sets depend on, read as `transformers` configs set it: Mistral's window (4096 when the key
    is absent, none when null), Qwen2's only with use_sliding_window from max_window_layers on; the attention
    implementation (eager: seq^2 scores; not a shape, so not in the fingerprint); the experts' own width."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 100,
            "intermediate_size": 160}
    mistral = ModelSpec.from_config({**base, "model_type": "mistral"})
    assert (mistral.sliding_window, set(mistral.layer_types)) == (4096, {"sliding_attention"})
    unwindowed = ModelSpec.from_config({**base, "model_type": "mistral", "sliding_window": None})
    assert (unwindowed.sliding_window, set(unwindowed.layer_types)) == (None, {"full_attention"})
    qwen2 = {**base, "model_type": "qwen2", "sliding_window": 64, "max_window_layers": 2}
    assert set(ModelSpec.from_config(qwen2).layer_types) == {"full_attention"}
    assert ModelSpec.from_config({**qwen2, "use_sliding_window": True}).layer_types == (
        "full_attention", "full_attention", "sliding_attention", "sliding_attention")
    eager = ModelSpec.from_config({**base, "model_type": "llama", "attn_implementation": "eager"})
    sdpa = ModelSpec.from_config({**base, "model_type": "llama"})
    assert eager.eager_attention and not sdpa.eager_attention and eager.fingerprint() == sdpa.fingerprint()
    moe = ModelSpec.from_config({**base, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 24, "mlp_only_layers": [1]})
    assert (moe.expert_intermediate_size, moe.moe_layers) == (24, (True, False, True, True))


def test_working_sets_grow_with_the_window_mask_eager_scores_and_the_experts() -> None:
    """Mistral's SDPA holds a batch x seq^2 mask in the compute dtype only from the window on; eager attention
    holds seq^2 scores at any length; an MoE layer's working set follows the experts' width and top-k, not the
    dense intermediate_size."""
    base = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 160, "sliding_window": 32}
    hw = HardwareSpec.load("emulated")
    windowed, full = ModelSpec.from_config(base), ModelSpec.from_config({**base, "sliding_window": None})
    for seq, masked in ((31, False), (32, True), (100, True)):
        wl = Workload(3, seq, "bf16")
        extra = CostModel(windowed, hw, wl).working_bytes[0] - CostModel(full, hw, wl).working_bytes[0]
        # the additive mask, and k and v repeated to the 4 query heads in place of the 2 key/value heads
        assert extra == (3 * seq * seq * 2 + wl.tokens * 2 * 32 * 2 if masked else 0), seq
    eager = ModelSpec.from_config({**base, "sliding_window": None, "attn_implementation": "eager"})
    for seq in (8, 100):
        assert CostModel(eager, hw, Workload(3, seq)).working_bytes[0] >= CostModel(
            full, hw, Workload(3, seq)).working_bytes[0] + 4 * 3 * 4 * seq * seq
    moe = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "vocab_size": 100, "intermediate_size": 4096, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}
    wide = {**moe, "moe_intermediate_size": 64}
    wl = Workload(2, 50)
    narrow_bytes = CostModel(ModelSpec.from_config(moe), hw, wl).working_bytes[0]
    wide_bytes = CostModel(ModelSpec.from_config(wide), hw, wl).working_bytes[0]
    dense_bytes = CostModel(ModelSpec.from_config({**moe, "mlp_only_layers": [0]}), hw, wl).working_bytes[0]
    assert narrow_bytes < wide_bytes < dense_bytes  # intermediate_size (4096) is the dense layer's, not an expert's


def test_a_masked_workload_counts_each_sdpa_layers_mask_and_repeated_kv() -> None:
    """Padding or packing gives every SDPA layer a batch x seq^2 additive mask and k/v repeated to every query head
    (2 (d_q - d_kv) per token): exactly that much more per attention layer, none on a linear-attention layer; the
    positions and cos/sin become per row and each kind's mask a batch x seq^2 bool (runtime/hf.py Rotary)."""
    spec = _dense(num_key_value_heads=1)
    batch, seq = RNG.randrange(1, 5), RNG.randrange(16, 300)
    for dtype, c in (("fp32", 4), ("bf16", 2)):
        plain = CostModel(spec, FLOP_ONLY, Workload(batch, seq, dtype))
        masked = CostModel(spec, FLOP_ONLY, Workload(batch, seq, dtype, masked=True))
        q, kv = spec.num_attention_heads * spec.head_dim, spec.head_dim
        for a, b in zip(plain.working_bytes, masked.working_bytes, strict=True):
            assert b - a == batch * seq * (seq + 2 * (q - kv)) * c
        assert (masked.constant_device_bytes - plain.constant_device_bytes
                == (batch - 1) * seq * (8 + 2 * spec.head_dim * c) + batch * seq * seq)
    hybrid = ModelSpec.load("qwen3.6-27b")
    plain, masked = (CostModel(hybrid, FLOP_ONLY, Workload(2, 128, masked=m)) for m in (False, True))
    for kind, a, b in zip(hybrid.layer_types, plain.working_bytes, masked.working_bytes, strict=True):
        assert (b > a) == (kind != "linear_attention"), kind


def test_plan_and_train_count_masks_for_sft_data_not_for_a_corpus() -> None:
    """`lazytrain plan` sizes the job `lazytrain train` runs: an SFT dataset's batches are masked (padding or
    packing), a byte-level corpus's are not (train/run_data.py)."""
    from lazytrain.config import CORPORA, DataConfig

    assert DataConfig().masked and DataConfig(dataset="sft.jsonl").masked
    assert not any(DataConfig(dataset=name).masked for name in (*CORPORA, "book.txt"))
