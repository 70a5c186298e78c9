"""CostModel: seconds and bytes of every piece of a training step, for one model, machine and workload.

The planner (MILP, rules), the simulator and admission control all ask this one object, so they agree.
Lists are indexed by layer j (0..L-1, layer j maps boundary j -> j+1) or boundary i (0..L).

Time model (per layer, forward, FLOPs over the achieved matmul rate):
    linear   2 * P_active_j * T                     (T = batch * seq tokens; MoE: top-k experts only)
    attention (full, causal)  4 * d_q * T * (seq + 1) / 2        QK^T and AV, half the square (causal);
              sliding window w: the mean of min(t + 1, w) keys instead of (seq + 1) / 2;
              linear (Gated DeltaNet, chunk C = 64; value heads H_v, head dims d_k, d_v; q and k repeated to H_v):
              H_v * T * (C (5 d_k + 3 d_v) + 6 d_k d_v): within a chunk k_beta k^T, q k^T, two triangular
              solves and the attention times the corrected values; across chunks the state reads (q S,
              k_cumdecay S) and its update (k^T v_new). Linear in T: no seq^2 term.
              GQA changes only the k/v projections, already in P_active.
    elementwise (RMSNorms, residual adds, rotary, SiLU*up as `transformers` runs them eagerly):
              bytes moved / `mem_gbps` (see _elementwise_bytes); ignored when mem_gbps is inf.
    backward_s = re-forward with autograd (1x) + backward (2x) = 3 x forward_s.
    QLoRA: each NF4 linear is dequantized in the forward, the re-forward and the backward (runtime/nf4.py): one
              pass each, DEQUANT_BYTES_PER_WEIGHT + the compute dtype's bytes per weight / `mem_gbps`
              (`dequant_s`, added to forward_s, twice to backward_s).
    loss head: forward + backward of final norm + LM head + cross-entropy, 3 x 2 * vocab * hidden * T FLOPs.
`with_times(...)` replaces the FLOP estimate by measured seconds (runtime/calibrate.py: the CPU emulated device
needs them, tiny layers are dominated by overheads, not FLOPs).

Memory model (bytes; see static_host_bytes / static_device_bytes and docs/cost_model.md):
    host:   what the executor and optimizer allocate (what `lazytrain plan` and `lazytrain train` both admit
            by; see host_breakdown): optimizer states (fp32 Adam 8 B/param; 8-bit 2 B/param + fp32 absmax per
            256-element block per state; hybrid8bit = 2% of the parameters in 8 bits) and, per parameter,
            gradient accumulation 1, bf16 compute: fp32 masters 4 + bf16 streamed copy 2 + bf16 gradients
            2 = 8; bf16 masters 2 + 2 = 4; fp32 compute 4 + 4 = 8; plus the update's chunk buffers, a constant
            (<= 40 MiB) whatever the model. Accumulating micro-batches adds an fp32 sum of every streamed
            group's gradient (4 B/param), so the sum is exact. With bf16 masters this is the paper's accounting
            (bf16 weights and gradients): its GPT-OSS-120B admission figures (CPU base 1321 GiB hybrid vs
            683 GiB all 8-bit) within 1%.
    device: 2 weight slots + 2 gradient slots (each the largest layer), the largest working set, 2 boundary-gradient
            buffers (static part); boundary activations come and go, and so do the loss head's own weight and
            gradient slots when it is larger than a layer (head_slot_bytes each: the step program allocates them
            around the windows that use them, and the planner charges them there).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence

from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import HYBRID_TYPES, ModelSpec
from lazytrain.costmodel.trainable import Trainable
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError

# the host optimizers: torch AdamW (fp32 states), Hybrid8bitAdamW (the paper's 2% in 8 bits), all 8-bit states
OPTIMIZERS = ("adamw", "hybrid8bit", "8bit")
FULL = Trainable()  # full training: every parameter trains
HYBRID_8BIT_FRACTION = 0.02  # share of the parameter volume whose Adam states are 8-bit in "hybrid8bit"
# elements per absmax block of the 8-bit states (bitsandbytes' current block size): the optimizer's default
# (optim/hybrid8bit.py block_size) and the cost model's bytes of its absmax
QUANT_BLOCK = 256
UPDATE_CHUNK_NUMEL = 1 << 18  # elements per chunk of a group's update: optim/chunked.py's CHUNK_NUMEL (tested equal)
# Where the optimizer's state (moments, and fp32 masters where a narrower copy streams) lives between updates: in
# host RAM, or in one file per layer group on the NVMe SSD, read into a staging slot before the group's update and
# written back after it (plan/schedule.py's state ops).
OPTIMIZER_OFFLOADS = ("host", "nvme")
STATE_PAGE_BYTES = 4096  # a state file's reads and writes move whole pages: runtime/files.py's ALIGN_BYTES (tested)
STATE_HEADER_BYTES = 1 << 20  # at most, per state file: its safetensors header, padded to a page (runtime/statefiles)
LINEAR_ATTN_CHUNK = 64  # Gated DeltaNet chunk length (transformers' torch_chunk_gated_delta_rule)
# Whose chunked delta rule a linear-attention layer runs: flash-linear-attention's fused kernels (what
# transformers uses on a GPU when `fla` is installed) or transformers' torch fallback (the CPU).
LINEAR_ATTN_KERNELS = ("auto", "fla", "torch")
# The torch fallback's device bytes per padded token and value head, by compute dtype bytes: per position of a
# chunk (C x C blocks), per key and per value head dim (fitted on the emulated device: _layer_working_bytes).
LINEAR_ATTN_TORCH_BYTES = {4: (33, 73, 37), 2: (36, 40, 20)}
# Per routed row of an MoE layer (_mlp_bytes_per_token), in the compute dtype: hidden- and intermediate-wide tensors
# of transformers' grouped_mm experts (Qwen3-MoE, Qwen3.5-MoE), and of GPT-OSS's (biases gathered per row, a clamped
# SwiGLU of seven I-wide steps); the router's fp32 and int64 bytes. Fitted on the emulated device over drawn shapes
# (docs/cost_model.md).
MOE_ROW_HIDDEN, MOE_ROW_INTERMEDIATE = 5, 5
GPT_OSS_ROW_HIDDEN, GPT_OSS_ROW_INTERMEDIATE = 4, 8
ROUTER_ROW_BYTES = 56  # per routed row: top-k value and index, sort, gather and inverse permutation indices
# Eager attention's bytes per batch x heads x seq^2 score (_layer_working_bytes): transformers' eager_attention_forward
# takes its softmax in fp32 whatever the compute dtype (GPT-OSS's, with the sinks, runs in the compute dtype: 3 c).
EAGER_SCORE_BYTES = 12
EAGER_SAVED_BYTES = {4: 4, 2: 6}  # of which saved through the layer's backward: the fp32 probabilities (and bf16 copy)
# An attention layer's backward after its MLP's (_after_mlp_bytes), per token: the post-attention RMSNorm's
# backward holds ~5 fp32 hidden-wide temporaries beside its saved input and the input norm's rows, whatever the
# compute dtype: NORM_BACKWARD_BYTES per hidden element (the (1 + weight) norms of the hybrid families: HYBRID_...);
# the attention's backward, the gradients of q, its output and o_proj's input beside the saved q, k, v:
# ATTN_BACKWARD_Q more d_q-wide rows and two hidden-wide ones in the compute dtype. Fitted on the emulated device
# (largest measured: 24.3-25.1 and 26.6 B per hidden element; tests/test_live_bytes.py, docs/cost_model.md).
NORM_BACKWARD_BYTES, HYBRID_NORM_BACKWARD_BYTES = 26, 28
ATTN_BACKWARD_Q = 3
HEAD_CHUNK_TOKENS = 1024  # tokens per chunk of the loss head (the executor's default too)
LOSS_BYTES = 4  # the step's fp32 loss (runtime/hf.py StepConstants.loss)


def sdpa_gets_mask(kind: str, seq_len: int, window: int | None, masked: bool) -> bool:
    """Whether an SDPA layer of this kind gets a mask tensor: every attention layer of a masked step (padding or
    packing: transformers passes the mask, and runs SDPA's grouped k/v only without one: `use_gqa_in_sdpa`), else
    a sliding window the sequence reaches (transformers skips the mask, for SDPA's is_causal, only while the keys
    stay below the window; masking_utils.sdpa_mask). Linear attention has none."""
    if kind == "linear_attention":
        return False
    return masked or (kind == "sliding_attention" and window is not None and seq_len >= window)


def step_constant_bytes(kinds: Iterable[str], batch: int, seq_len: int, dtype_bytes: int, rotary_dim: int, *,
                        eager: bool, window: int | None, masked: bool) -> int:
    """The device bytes of one step's constants (runtime/hf.py `Rotary.constants`, counted by the executor and the
    CostModel alike): positions and rotary cos/sin (per row when masked), the fp32 loss, and one mask per layer kind:
    eager attention's batch x seq^2 in the compute dtype; SDPA's batch x seq^2 bool when masked, else one seq^2
    bool broadcast over the batch for a window the sequence reaches; linear attention's batch x seq bool padding
    mask when masked. `kinds`: the step's distinct layer kinds."""
    total = (batch if masked else 1) * seq_len * (8 + 2 * rotary_dim * dtype_bytes) + LOSS_BYTES
    for kind in kinds:
        if kind == "linear_attention":
            total += batch * seq_len if masked else 0
        elif eager:
            total += batch * seq_len * seq_len * dtype_bytes
        elif masked:
            total += batch * seq_len * seq_len
        elif sdpa_gets_mask(kind, seq_len, window, masked):
            total += seq_len * seq_len
    return total


MASTER_WEIGHTS = ("fp32", "bf16")  # the dtype of the host weights the optimizer updates


# Device bytes one dequantization moves per weight, as runtime/nf4.py's torch ops run it (one kernel each): the two
# nibbles split (read 0.5 + write 0.5, twice), interleaved (1 + 1), widened to int32 (1 + 4), looked up in the
# table (4 + 4, fp32), scaled by the block's absmax in place (4 + 4); then the cast to the compute dtype (4 read +
# its bytes written; none in fp32). bitsandbytes' fused CUDA kernel would move 0.516 + the dtype's bytes.
DEQUANT_BYTES_PER_WEIGHT = 2 + 2 + 5 + 8 + 8


def _rate(gbps: float) -> float:
    return gbps * 1e9


class CostModel:
    """Per-layer seconds and bytes of one training step (see the module docstring for the formulas)."""

    def __init__(self, spec: ModelSpec, hardware: HardwareSpec, workload: Workload, optimizer: str = "adamw",
                 *, master_weights: str = "fp32", grad_accumulation: int = 1,
                 head_chunk_tokens: int = HEAD_CHUNK_TOKENS, linear_attention_kernel: str = "auto",
                 optimizer_offload: str = "host", trainable: Trainable = FULL) -> None:
        if optimizer not in OPTIMIZERS:
            raise LazyTrainError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)} (--optimizer)")
        if optimizer_offload not in OPTIMIZER_OFFLOADS:
            raise LazyTrainError(f"optimizer_offload {optimizer_offload!r} is not one of "
                                 f"{', '.join(OPTIMIZER_OFFLOADS)} (--optimizer-offload)")
        self.optimizer_offload = optimizer_offload
        if linear_attention_kernel not in LINEAR_ATTN_KERNELS:
            raise LazyTrainError(f"linear_attention_kernel {linear_attention_kernel!r} is not one of "
                                 f"{', '.join(LINEAR_ATTN_KERNELS)}")
        if linear_attention_kernel == "auto":  # the emulated device runs on the CPU: transformers' torch fallback
            linear_attention_kernel = "torch" if hardware.name == "emulated" else "fla"
        self.linear_attention_kernel = linear_attention_kernel
        self.spec, self.hardware, self.workload, self.optimizer = spec, hardware, workload, optimizer
        if master_weights not in MASTER_WEIGHTS:
            raise LazyTrainError(f"master_weights {master_weights!r} is not one of {', '.join(MASTER_WEIGHTS)}")
        if master_weights == "bf16" and workload.dtype != "bf16":
            raise LazyTrainError(f"master_weights bf16 keeps the bf16 streamed weights as the masters, but dtype is "
                                 f"{workload.dtype}; set dtype bf16 or master_weights fp32")
        self.master_weights = master_weights
        self.grad_accumulation = grad_accumulation
        self.num_layers = L = spec.num_layers
        # which parameters train (costmodel/trainable.py): a frozen one streams but has no gradient, master or state
        self.trainable = trainable
        self.adapter_params = trainable.adapter_params(spec)  # LoRA's, streamed with their layer
        self.layer_trainable_params = trainable.layer_trainable_params(spec)
        self.head_trainable_params = spec.head_params if trainable.head_trains() else 0
        self.embedding_trainable_params = spec.embedding_params if trainable.embedding_trains(spec) else 0
        self.quantized_params = trainable.quantized_params(spec)  # QLoRA's NF4 linears, per layer (else 0)
        self.quantized_bytes = trainable.quantized_bytes(spec)
        tokens, dtype_bytes = workload.tokens, workload.dtype_bytes
        self.dtype_bytes = dtype_bytes
        self.head_chunk_tokens = min(head_chunk_tokens, tokens)

        # ---- compute time -----------------------------------------------------------------------
        self.forward_flops = [self._layer_forward_flops(j) for j in range(L)]
        rate = hardware.matmul_flops_per_s
        mem_rate = _rate(hardware.mem_gbps)
        compute_s = [f / rate + self._elementwise_bytes(j) / mem_rate + hardware.layer_overhead_s
                     for j, f in enumerate(self.forward_flops)]
        # QLoRA: one bandwidth-bound pass per NF4 weight and dequantization (0 without QLoRA, or mem_gbps inf)
        self.dequant_bytes_per_weight = DEQUANT_BYTES_PER_WEIGHT + (0 if dtype_bytes == 4 else 4 + dtype_bytes)
        self.dequant_s = [q * self.dequant_bytes_per_weight / mem_rate for q in self.quantized_params]
        self.forward_s = [c + d for c, d in zip(compute_s, self.dequant_s, strict=True)]
        # autograd re-forward (1x) + the input gradient's GEMMs (1x) + the weight gradient's (1x, in proportion to
        # the layer's weights that train: none for a frozen base, its adapters' share with LoRA); QLoRA dequantizes
        # in the re-forward and again in the backward
        self.backward_s = [(2.0 + self._trained_share(j)) * c + 2 * d
                           for j, (c, d) in enumerate(zip(compute_s, self.dequant_s, strict=True))]
        head_matmul = spec.vocab_size * spec.hidden_size
        self.head_flops = 3 * 2 * head_matmul * tokens
        # cross-entropy over fp32 logits: write, softmax read/write, grad write, ~4 passes of 4 bytes
        self.head_s = (self.head_flops / rate + 16 * spec.vocab_size * tokens / mem_rate
                       + 3 * hardware.layer_overhead_s)

        # ---- bytes ------------------------------------------------------------------------------
        act = tokens * spec.hidden_size * dtype_bytes
        self.boundary_bytes = [act] * (L + 1)  # A_i
        # every expert streams, and LoRA's adapters with their layer; QLoRA's linears as their NF4 bytes
        self.param_bytes = [(p + a - qp) * dtype_bytes + qb for p, a, qp, qb in
                            zip(spec.layer_params, self.adapter_params, self.quantized_params, self.quantized_bytes,
                                strict=True)]
        self.grad_bytes = [p * dtype_bytes for p in self.layer_trainable_params]  # a frozen layer's: 0
        self.head_param_bytes = (spec.vocab_size * spec.hidden_size + spec.hidden_size) * dtype_bytes
        # tied heads still send the full LM-head gradient
        self.head_grad_bytes = self.head_param_bytes if self.head_trainable_params else 0
        # landed on the host (op "embedding")
        self.embedding_grad_bytes = self.embedding_trainable_params * dtype_bytes
        self.working_bytes = [self._layer_working_bytes(j) for j in range(L)]
        # a kept layer's graph (Plan.kept_layers): the saved tensors its forward with autograd leaves, less its
        # output -- the working set of the MLP's backward without its weight gradient and the backward's I-wide
        # gradients, plus one h-wide tensor per token (SDPA's and the norms' small saved statistics); bounds the
        # measured graph of every family (tests/test_live_bytes.py)
        mlp_phase = [self._layer_working_bytes(j, mlp_phase=True) for j in range(L)]
        self.graph_bytes = [min(w, w - self._mlp_moment_weight_bytes(j) - tokens * self._mlp_width(j) * dtype_bytes)
                            for j, w in enumerate(mlp_phase)]
        # per chunk row: the logits (compute dtype) and three fp32 rows (log-softmax, its gradient, the logits'
        # gradient), the final norm's fp32 input and output (8 h), the row's loss; the chunk's fp32 loss scalars;
        # the step's shifted labels (int64). Measured on the emulated device (tests/test_live_bytes.py); the LM
        # head's weight gradient is added into its slot chunk by chunk, so no vocab x hidden temporary exists.
        # When the hidden size is near the vocabulary (tiny models) the norm's backward peaks instead: ~8 fp32 chunk x
        # hidden rows. The hybrid families' (1 + weight) and GPT-OSS's RMSNorm keep one more fp32 row in either phase.
        h = spec.hidden_size
        row = max(spec.vocab_size * (dtype_bytes + 12) + 8 * h + 4, 32 * h + 4)
        row += 4 * h if spec.model_type in HYBRID_TYPES or spec.model_type == "gpt_oss" else 0
        self.head_working_bytes = self.head_chunk_tokens * row + 16 + 8 * tokens

        # ---- optimizer time ---------------------------------------------------------------------
        self.optimizer_s = [self._optimizer_seconds(p) for p in self.layer_trainable_params]
        self.head_optimizer_s = self._optimizer_seconds(self.head_trainable_params, "head")
        self.embedding_optimizer_s = self._optimizer_seconds(self.embedding_trainable_params, "embedding")

        # host: adding each landed gradient (compute dtype) into the fp32 .grad, on the optimizer stream
        acc_rate = _rate(hardware.grad_accumulate_gbps)
        self.accumulate_s = [b / acc_rate for b in self.grad_bytes]
        self.head_accumulate_s = self.head_grad_bytes / acc_rate
        self.embedding_accumulate_s = self.embedding_grad_bytes / acc_rate
        self.constant_device_bytes = self._constant_bytes()

        # ---- link rates -------------------------------------------------------------------------
        self.h2d_bytes_per_s = _rate(hardware.h2d_gbps)
        self.d2h_bytes_per_s = _rate(hardware.d2h_gbps)
        # With the state files on NVMe every step reads and writes them, for most of the step beside each other:
        # both NVMe lanes at the disk's mixed rate (HardwareSpec.nvme_mixed_gbps) for the whole step, the one rate
        # the simulator and the MILP both take from here. Activation spills alone write in the forward and read in
        # the backward: their own rates.
        mixed = hardware.nvme_mixed_gbps if optimizer_offload == "nvme" and hardware.nvme_mixed_gbps else math.inf
        self.nvme_read_bytes_per_s = _rate(min(hardware.nvme_read_gbps, mixed))
        self.nvme_write_bytes_per_s = _rate(min(hardware.nvme_write_gbps, mixed))
        # the optimizer's state files on those links (optimizer_offload nvme; HardwareSpec.nvme_state_*_gbps)
        self.state_read_bytes_per_s = _rate(min(hardware.nvme_state_read_gbps or hardware.nvme_read_gbps, mixed))
        self.state_write_bytes_per_s = _rate(min(hardware.nvme_state_write_gbps or hardware.nvme_write_gbps, mixed))

    # ---- FLOPs and bytes of one layer --------------------------------------------------------------
    def _layer_forward_flops(self, j: int) -> float:
        spec, seq, tokens = self.spec, self.workload.seq_len, self.workload.tokens
        linear = 2.0 * spec.layer_active_params[j] * tokens
        kind = spec.layer_types[j]
        d_q = spec.num_attention_heads * spec.head_dim
        if kind == "linear_attention":
            heads, d_k, d_v = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
            mixing = heads * tokens * (LINEAR_ATTN_CHUNK * (5.0 * d_k + 3.0 * d_v) + 6.0 * d_k * d_v)
        else:
            window = spec.sliding_window if kind == "sliding_attention" and spec.sliding_window else seq
            mixing = 4.0 * d_q * tokens * mean_keys_per_query(seq, window)
        return linear + mixing

    def _mlp_width(self, j: int) -> int:
        """Intermediate elements per token of layer j's MLP: the top-k routed experts and the shared one, or the
        dense MLP's."""
        spec = self.spec
        if spec.moe_layers[j]:
            return spec.num_experts_per_tok * spec.expert_intermediate_size + spec.shared_expert_intermediate_size
        return spec.intermediate_size

    def _masked_attention(self, j: int) -> bool:
        """Whether layer j's SDPA gets a mask tensor (`sdpa_gets_mask`)."""
        return sdpa_gets_mask(self.spec.layer_types[j], self.workload.seq_len, self.spec.sliding_window,
                              self.workload.masked)

    def _constant_bytes(self) -> int:
        """Per-step device constants (`step_constant_bytes`; cos/sin as wide as the head, which bounds a partial
        rotary)."""
        spec, workload = self.spec, self.workload
        return step_constant_bytes(set(spec.layer_types), workload.batch_size, workload.seq_len, self.dtype_bytes,
                                   spec.head_dim, eager=spec.eager_attention, window=spec.sliding_window,
                                   masked=workload.masked)

    def _elementwise_bytes(self, j: int) -> float:
        """Forward bytes moved by the memory-bound ops of one layer, as `transformers` runs them eagerly.

        Per token, in bf16 bytes (scaled by dtype_bytes / 2): each RMSNorm upcasts to fp32, squares,
        averages, scales, downcasts and multiplies by its weight (~36 B per element, 2 norms); 2 residual
        adds (6 B each); rotary on q and k (mul, rotate_half's slice/neg/cat, mul, add: ~20 B per element);
        SiLU(gate) * up (10 B per intermediate element); the attention output transpose (4 B per q element).
        """
        spec = self.spec
        q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        if spec.layer_types[j] == "linear_attention":
            q, kv = 2 * q, 0  # gated conv + norm over the value heads instead of rotary; about as much traffic
        per_token = 2 * 36 * spec.hidden_size + 2 * 6 * spec.hidden_size + 20 * (q + kv) + 4 * q
        per_token += 10 * self._mlp_width(j)
        return per_token * self.dtype_bytes / 2 * self.workload.tokens

    def _layer_working_bytes(self, j: int, *, mlp_phase: bool = False) -> int:
        """Layer j's device working set: per token (_working_bytes_per_token), a weight gradient, and what does not
        scale with the tokens, at the larger of two moments: up to the MLP's backward, beside the MLP's own weight
        gradient (_mlp_moment_weight_bytes), and after it (_after_mlp_bytes, with the attention's). `mlp_phase`: the
        first only (what a kept layer's graph is sized from).

        The torch fallback's chunked Gated DeltaNet pads every sequence to whole chunks of C = 64 and holds, per
        padded token and value head, fp32 C x C blocks (the decay, UT system, intra-chunk attention and their
        gradients), d_k- and d_v-wide copies (repeated, normalized, padded, chunked q/k/v, the solves' outputs), and
        a d_k x d_v state per chunk with its gradient: LINEAR_ATTN_TORCH_BYTES, fitted on the emulated device
        (tests/test_live_bytes.py, docs/cost_model.md).

        Attention's seq^2 terms (X = batch x heads x seq^2 scores). Eager attention (transformers'
        eager_attention_forward, on sliding-window layers too): its softmax runs in fp32 whatever the compute dtype;
        the layer peaks either in the MLP's backward, beside the saved fp32 probabilities (and their bf16 copy:
        EAGER_SAVED_BYTES per score), or in the softmax's backward once the MLP's tensors are gone (the
        probabilities, their gradient and the softmax's: EAGER_SCORE_BYTES = 12 per score). GPT-OSS's (no SDPA for
        its sinks) runs its softmax in the compute dtype: max(+ 2 X, - MLP + 3 X) in the compute dtype. SDPA gets a
        mask tensor on every layer of a masked workload (padding, packing), else only on a sliding-window layer whose
        sequence reaches the window (below it transformers passes none and SDPA runs is_causal; `_masked_attention`);
        the step's bool mask is shared by every layer of its kind (a constant: _constant_bytes),
        but each SDPA call converts it to an additive mask in the compute dtype, batch x seq^2 (the bool's
        broadcast over the batch is materialized), and saves it for its backward."""
        spec, workload = self.spec, self.workload
        batch, seq, c = workload.batch_size, workload.seq_len, self.dtype_bytes
        per_token = workload.tokens * self._working_bytes_per_token(j)
        up_to_mlp = per_token + self._mlp_moment_weight_bytes(j)
        working = up_to_mlp if mlp_phase else max(up_to_mlp, self._after_mlp_bytes(j))
        if spec.layer_types[j] == "linear_attention" and self.linear_attention_kernel == "torch":
            per_chunk, per_key, per_value = LINEAR_ATTN_TORCH_BYTES[c]
            padded = batch * -(-seq // LINEAR_ATTN_CHUNK) * LINEAR_ATTN_CHUNK
            d_k, d_v = spec.linear_key_head_dim, spec.linear_value_head_dim
            states = 2 * 4 * d_k * d_v / LINEAR_ATTN_CHUNK
            working += int(padded * spec.linear_num_value_heads
                           * (per_chunk * LINEAR_ATTN_CHUNK + per_key * d_k + per_value * d_v + states))
        if spec.layer_types[j] == "linear_attention":
            return working
        scores = batch * spec.num_attention_heads * seq * seq
        if spec.eager_attention:  # the larger of two moments: the MLP's backward beside the saved probabilities,
            # the softmax's backward once the MLP's tensors are gone
            saved, peak = ((2 * c, 3 * c) if spec.model_type == "gpt_oss"  # GPT-OSS's softmax in the compute dtype
                           else (EAGER_SAVED_BYTES[c], EAGER_SCORE_BYTES))
            mlp = workload.tokens * self._mlp_bytes_per_token(j)
            working = max(working + saved * scores, per_token + self._largest_weight_bytes(j) - mlp + peak * scores)
        elif self._masked_attention(j):  # SDPA's float copy of the bool mask, made per call and saved for its backward
            working += batch * seq * seq * c
        return working

    def _working_bytes_per_token(self, j: int) -> int:
        """Autograd-saved tensors of one layer plus the largest transient of its backward, bytes per token.

        Saved: layer input, norm outputs, residual and one more hidden-wide row (5 h; the fifth measured at
        hidden 32 in bf16), q and attention output (2 d_q), k, v (2 d_kv), and the MLP (_mlp_bytes_per_token).
        Gated attention (the hybrid families' full-attention layers) adds the gate, its sigmoid and the gated output
        (5 d_q). SDPA with a mask tensor, and eager attention, save k and v repeated to every query head in
        place of k and v (2 (d_q - d_kv) more: `repeat_kv`; unmasked SDPA runs grouped). All in the compute dtype.
        Every layer adds the fp32 copies its RMSNorms save (8 h; q/k norms 8 (d_q + d_kv)).
        A linear-attention (Gated DeltaNet) layer with the torch fallback: 24 B per key-dim and 12 B per hidden
        element, its MLP less the backward's 2 I, and the chunked part per padded token (_layer_working_bytes);
        with the fused `fla` kernel 5 h + the same MLP + the conv's input and output (2 conv_dim) + 6 value_dim in the
        compute dtype and per value head C + 2 fp32 (the UT inverse, decay, beta) and the chunk states and their
        gradients its backward recomputes (2 d_k d_v / C): from its saved tensors, not measured here. With the
        layer's largest weight gradient and its seq^2 terms (`_layer_working_bytes`) these bound the working sets
        measured on the emulated device (runtime/live_bytes.py) for every family (tests/test_live_bytes.py,
        docs/cost_model.md).
        """
        spec, c = self.spec, self.dtype_bytes
        h = spec.hidden_size
        q_width, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        norms = 8 * h  # the two RMSNorms' fp32 upcasts autograd saves (measured, as the q/k norms' below)
        mlp = self._mlp_bytes_per_token(j)
        if spec.layer_types[j] == "linear_attention":
            mlp -= 2 * self._mlp_width(j) * c  # its backward peaks elsewhere than in the MLP's gradients
            heads, d_k, d_v = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
            key_dim = spec.linear_num_key_heads * d_k
            value_dim = heads * d_v
            if self.linear_attention_kernel == "torch":  # the chunked part per padded token: _layer_working_bytes
                return mlp + 24 * key_dim + 12 * h
            compute = 5 * h + 2 * (2 * key_dim + value_dim) + 6 * value_dim
            states = heads * d_k * d_v // LINEAR_ATTN_CHUNK
            fp32 = heads * (LINEAR_ATTN_CHUNK + 2) + 2 * states
            return compute * c + mlp + 4 * fp32 + norms
        qk_norms = 8 * (q_width + kv) if spec.qk_norm else 0
        gate = 5 * q_width if spec.model_type in HYBRID_TYPES else 0  # gated attention: the gate, its sigmoid, the
        # gated output (measured: tests/test_live_bytes.py)
        repeated = 2 * (q_width - kv) if spec.eager_attention or self._masked_attention(j) else 0
        return (5 * h + 2 * q_width + 2 * kv + gate + repeated) * c + mlp + norms + qk_norms

    def _after_mlp_bytes(self, j: int) -> int:
        """An attention layer's backward once its MLP's tensors are gone (0 for linear attention): the tokens times
        _working_bytes_per_token with its 5 h compute-dtype rows and MLP replaced by the larger of the
        post-attention RMSNorm's backward (NORM_BACKWARD_BYTES per hidden element in either dtype; no weight gradient
        of size beside it) and the attention's backward (ATTN_BACKWARD_Q d_q-wide and 2 hidden-wide rows in the
        compute dtype, masked SDPA's gradients of k and v repeated to every query head, and an h x d_q weight
        gradient). Above the MLP's moment when the intermediate size (or the experts' routed rows) is narrow against
        the hidden size (dense layers with I below ~1.3 h: 0.64-0.99x of the measured without it), or d_q wide."""
        spec, c, tokens = self.spec, self.dtype_bytes, self.workload.tokens
        if spec.layer_types[j] == "linear_attention":
            return 0
        h, q_width = spec.hidden_size, spec.num_attention_heads * spec.head_dim
        kv = spec.num_key_value_heads * spec.head_dim
        rest = self._working_bytes_per_token(j) - 5 * h * c - self._mlp_bytes_per_token(j)
        norm = HYBRID_NORM_BACKWARD_BYTES if spec.model_type in HYBRID_TYPES else NORM_BACKWARD_BYTES
        # masked SDPA's gradients of k and v repeated to every head (eager attention peaks in its softmax's backward)
        repeated = 2 * (q_width - kv) if self._masked_attention(j) and not spec.eager_attention else 0
        attention = tokens * (ATTN_BACKWARD_Q * q_width + 2 * h + repeated) * c + h * q_width * c
        return tokens * rest + max(tokens * norm * h, attention)

    def _mlp_bytes_per_token(self, j: int) -> int:
        """Layer j's MLP, bytes per token. Dense: gate, up, SiLU(gate), their product (4 I) saved, about two I-wide
        gradients (2 I) in the backward. MoE, as transformers' grouped_mm experts run it (each token's top-k rows
        gathered, sorted by expert, one grouped matmul per projection over all of them): per routed row
        MOE_ROW_HIDDEN hidden-wide tensors (the gathered input, the expert output, its weighted and reordered
        copies, the backward's gradients of them) and MOE_ROW_INTERMEDIATE I_e-wide ones (the gate_up output, SiLU,
        product and their gradients), GPT-OSS's with its clamped SwiGLU and per-row biases; per expert the router's
        logits and fp32 softmax, per routed row its int64 indices (ROUTER_ROW_BYTES); a shared expert as a dense MLP
        of its width, with its sigmoid gate's output (h). The compute dtype but for the router."""
        spec, c = self.spec, self.dtype_bytes
        if not spec.moe_layers[j]:
            return 6 * spec.intermediate_size * c
        k, h = spec.num_experts_per_tok, spec.hidden_size
        row_h, row_i = ((GPT_OSS_ROW_HIDDEN, GPT_OSS_ROW_INTERMEDIATE) if spec.model_type == "gpt_oss"
                        else (MOE_ROW_HIDDEN, MOE_ROW_INTERMEDIATE))
        routed = k * (row_h * h + row_i * spec.expert_intermediate_size) * c
        shared = (6 * spec.shared_expert_intermediate_size + h) * c if spec.shared_expert_intermediate_size else 0
        router = spec.num_experts * (c + 8) + k * ROUTER_ROW_BYTES
        return routed + shared + router

    def _mlp_moment_weight_bytes(self, j: int) -> int:
        """The weight gradient beside the MLP's backward: the MLP's own, not the attention's, whose backward runs
        after it (_after_mlp_bytes counts that one; charged here as well, it overstated the working set of a layer of
        few tokens whose attention is wide against its MLP). A linear-attention layer's bound adds its chunked terms
        to this moment, so its projections' gradient counts here as well."""
        if self.spec.layer_types[j] == "linear_attention":
            return self._largest_weight_bytes(j)
        return self._mlp_weight_bytes(j)

    def _mlp_weight_bytes(self, j: int) -> int:
        """The MLP's largest weight gradient: gate_up, every expert's at once (grouped_mm's weight gradient); with
        QLoRA its largest dequantization (_largest_weight_bytes)."""
        spec = self.spec
        return spec.hidden_size * self._weight_transient_bytes * (2 * spec.num_experts * spec.expert_intermediate_size
                                                       if spec.moe_layers[j] else spec.intermediate_size)

    def _largest_weight_bytes(self, j: int) -> int:
        """The largest single weight gradient of layer j: autograd makes it before adding it into the gradient
        slot (runtime/hf.py layer_backward), so it exists beside the slot for a moment. With QLoRA the largest
        dequantization instead (runtime/nf4.py): int32 indices and fp32 values, then the weight in the compute
        dtype beside the fp32 values (a gate_up pair counted at once, an upper bound)."""
        spec = self.spec
        h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
        if spec.layer_types[j] == "linear_attention":
            key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
            value_dim = spec.linear_num_value_heads * spec.linear_value_head_dim
            return max(self._mlp_weight_bytes(j), h * (2 * key_dim + 2 * value_dim) * self._weight_transient_bytes)
        return max(self._mlp_weight_bytes(j), h * q * self._weight_transient_bytes)

    @property
    def _weight_transient_bytes(self) -> int:
        """Bytes per weight of a weight gradient, or with QLoRA of a dequantization (its transients)."""
        return self.dtype_bytes + (8 if any(self.quantized_params) else 0)

    def update_bytes_per_param(self, group: str = "layer") -> float:
        """Host memory bytes one update of a `group` ("layer", "head", "embedding") reads and writes per parameter,
        clipping on (the default), as the optimizer lane runs it (train/optimizer.py, optim/hybrid8bit.py,
        optim/chunked.py), counted as STREAM counts (each byte read or written once):

            gradient   the kept gradient read once (k B: the compute dtype where it landed, 4 where summed, the
                       masters' for an untied embedding); where it needs a cast it is cast into a chunk that stays
                       in cache (optim/chunked.py), which costs no memory traffic
            8-bit      one fused pass (optim/quant.py): weights read and written in the masters' dtype (2 m), codes
                       read and written (4), two fp32 absmax per block read and written (16/256); the clip scale
                       and the casts happen in registers
            fp32 states  torch's fused AdamW: weights (2 m) and moments (16) read and written; fp32 gradients of
                       fp32 masters are clipped in memory first -- torch's AdamW: a clip pass (4 + 4) before the
                       step; Hybrid8bitAdamW: the step divides them and writes them back (+ 4)
            refresh    bf16 compute, fp32 masters, a streamed group: its bf16 copy written (2) in the update's
                       pass (`Hybrid8bitAdamW.step_group(copies=...)`: its fp32 slice then goes chunk by chunk,
                       so fp32 gradients are not written back); torch's AdamW: re-packed after it (4 + 2)

        The update streams through memory (10 to 50 bytes per parameter, a few operations per byte), so its seconds
        are these bytes over the host's memory bandwidth (`host_mem_gbps`, a STREAM-like triad's rate;
        benchmarks/optim.py measures the kernels against one).
        """
        m = 2 if self.master_weights == "bf16" else 4
        c, spec = self.dtype_bytes, self.spec
        streamed = group != "embedding" or spec.tie_word_embeddings
        summed = self.grad_accumulation > 1 or (group != "layer" and spec.tie_word_embeddings and c < 4)
        kept = m if not streamed else 4 if summed else c
        in_place = kept == 4 and m == 4  # fp32 gradients of fp32 masters: clipped in memory, no chunk
        copied = streamed and c == 2 and m == 4  # a bf16 streamed copy of fp32 masters to refresh
        eight_bit = kept + 2 * m + 4 + 16 / QUANT_BLOCK
        fp32_states = kept + 2 * m + 16
        kernel = {"adamw": fp32_states + (8 if in_place else 0),
                  "8bit": eight_bit,
                  "hybrid8bit": (1 - HYBRID_8BIT_FRACTION) * (fp32_states + (4 if in_place and not copied else 0))
                  + HYBRID_8BIT_FRACTION * eight_bit}[self.optimizer]
        refresh = 0 if not copied else 6 if self.optimizer == "adamw" else 2
        return kernel + refresh

    def _trained_share(self, j: int) -> float:
        """The share of layer j's streamed weights that get a gradient (1 in full training)."""
        streamed = self.spec.layer_params[j] + self.adapter_params[j]
        return self.layer_trainable_params[j] / streamed if streamed else 0.0

    def _optimizer_seconds(self, params: int, group: str = "layer") -> float:
        return params * self.update_bytes_per_param(group) / _rate(self.hardware.host_mem_gbps)

    def update_bytes(self) -> float:
        """Bytes one whole optimizer update moves through host memory (every group; `update_bytes_per_param`)."""
        return (sum(self.layer_trainable_params) * self.update_bytes_per_param("layer")
                + self.head_trainable_params * self.update_bytes_per_param("head")
                + self.embedding_trainable_params * self.update_bytes_per_param("embedding"))

    # ---- static memory ------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """One weight (or gradient) slot: the largest layer or the loss head, in the compute dtype."""
        return max(max(self.param_bytes), self.head_param_bytes)

    @property
    def layer_slot_bytes(self) -> int:
        """One layer weight (or gradient) slot on the device: the largest layer."""
        return max(self.param_bytes)

    @property
    def head_slot_bytes(self) -> int:
        """The loss head's own device slot (weights; another for its gradients) when it is larger than a layer
        slot, else 0 (it streams through the layer slots). Not static: each lives only around the windows that
        use it (plan/schedule.py)."""
        return self.head_param_bytes if self.head_param_bytes > self.layer_slot_bytes else 0

    @property
    def state_bytes_per_param(self) -> float:
        """Adam's two moments per parameter: fp32 8 B; 8-bit 2 B + an fp32 absmax per block per moment."""
        eight_bit = 2.0 + 2 * 4.0 / QUANT_BLOCK
        share = {"adamw": 0.0, "hybrid8bit": HYBRID_8BIT_FRACTION, "8bit": 1.0}[self.optimizer]
        return (1 - share) * 8.0 + share * eight_bit

    @property
    def trainable_params(self) -> int:
        """The parameters that get gradients, masters and optimizer state (every one in full training)."""
        return sum(self.layer_trainable_params) + self.head_trainable_params + self.embedding_trainable_params

    def optimizer_state_bytes(self) -> int:
        """Adam's two moments of every trainable parameter (`state_bytes_per_param`)."""
        return int(round(self.trainable_params * self.state_bytes_per_param))

    @property
    def masters_offloaded(self) -> bool:
        """With optimizer_offload nvme, whether the fp32 masters go to the state files too: when a narrower copy
        streams (bf16 compute, fp32 masters); masters that are the streamed buffers themselves stay in RAM."""
        return self.optimizer_offload == "nvme" and self.master_weights == "fp32" and self.dtype_bytes < 4

    def state_group_bytes(self) -> tuple[int, ...]:
        """The bytes of each layer group's state file (what one state_read or state_write moves) with
        optimizer_offload nvme, at index target + 1 as `sim.update_seconds`: the untied embedding (0 when tied:
        a tied head's group owns it), layers 0..L-1, the head. A group's file holds its Adam moments and, where
        `masters_offloaded`, its fp32 masters -- but not the embedding matrix's, which the forward gathers rows
        from every step and so stays in RAM --, rounded up to whole pages (reads and writes move whole pages).
        Trainable parameters alone (freeze tuning: a frozen layer's group has no file)."""
        spec = self.spec
        masters = 4 if self.masters_offloaded else 0
        tied = spec.tie_word_embeddings
        embedding = 0 if tied else self.embedding_trainable_params * self.state_bytes_per_param
        layers = [p * (self.state_bytes_per_param + masters) for p in self.layer_trainable_params]
        tied_embedding = self.embedding_trainable_params if tied else 0
        head = (self.head_trainable_params + tied_embedding) * self.state_bytes_per_param \
            + self.head_trainable_params * masters  # a tied head's matrix is the embedding's (its master in RAM)
        return tuple(-(-int(math.ceil(b)) // STATE_PAGE_BYTES) * STATE_PAGE_BYTES
                     for b in (embedding, *layers, head))

    @property
    def staging_slot_bytes(self) -> int:
        """One staging slot of optimizer_offload nvme: the largest group's state file bytes (0 with states in RAM)."""
        return max(self.state_group_bytes()) if self.optimizer_offload == "nvme" else 0

    def nvme_state_bytes(self) -> int:
        """The state files on the NVMe SSD with optimizer_offload nvme (0 in RAM): every group's data and a header
        of at most STATE_HEADER_BYTES each."""
        if self.optimizer_offload != "nvme":
            return 0
        return sum(b + STATE_HEADER_BYTES for b in self.state_group_bytes() if b)

    def host_breakdown(self, staging_depth: int = 0) -> dict[str, int]:
        """Static host bytes by kind: what the executor (runtime/store.py, runtime/executor.py) and the optimizer
        allocate on the host; with optimizer_offload nvme, `staging_depth` slots (a plan's, Plan.staging_depth;
        admission counts the least, 1).

        weights          the masters: fp32 (4 B/param), or bf16 (2) that are the streamed buffers themselves;
                         with optimizer_offload nvme and `masters_offloaded` only the embedding matrix's (the
                         forward gathers from it), the rest in the state files; frozen parameters (LoRA's base,
                         freeze tuning) once, in the compute dtype (QLoRA's linears: their NF4 bytes)
        (grads, grad_sum, update_scratch, optimizer_states and staging count the trainable parameters alone)
        streamed_copy    bf16 compute with fp32 masters: the packed bf16 copy each step streams (2 B/param)
        grads            where each streamed group's gradient lands (compute dtype) and stays; an untied
                         embedding's gradient in its masters' dtype
        grad_sum         gradient accumulation > 1 (or a tied head in bf16, whose gradient adds the LM
                         head's and the embedding's): an fp32 sum per group, so the sum is exact
        update_scratch   the update's chunk buffers (optim/chunked.py), used by tensors with fp32 states (the
                         8-bit pass needs none; the small tensors keep fp32 states, so it stays counted): fp32
                         gradient chunks where a gradient is cast (bf16 landing, fp32 masters), and with bf16
                         masters fp32 weight chunks and a bf16 chunk of an fp32 sum; at most UPDATE_CHUNK_NUMEL
                         elements each, whatever the largest group (no transient grows with it)
        optimizer_states Adam's moments (optimizer_state_bytes); 0 with optimizer_offload nvme (in the state files)
        staging          (optimizer_offload nvme only) `staging_depth` slots of `staging_slot_bytes`, the states (and
                         offloaded masters) of that many groups read ahead of their updates (plan/schedule.py)
        """
        spec, c = self.spec, self.dtype_bytes
        m = 2 if self.master_weights == "bf16" else 4
        n = self.trainable_params
        # held once, in the compute dtype (QLoRA's linears as their NF4 bytes)
        frozen = spec.num_params + sum(self.adapter_params) - n - sum(self.quantized_params)
        tied = spec.tie_word_embeddings
        embedding = 0 if tied else self.embedding_trainable_params  # stays on the host, unpacked
        # what trains of each streamed group: layers 0..L-1, the head (with a tied embedding)
        streamed_groups = [*self.layer_trainable_params,
                           self.head_trainable_params + (self.embedding_trainable_params if tied else 0)]
        streamed = sum(streamed_groups)
        accumulating = self.grad_accumulation > 1
        summed = streamed if accumulating else (streamed_groups[-1] if spec.tie_word_embeddings and c < 4 else 0)
        fp32_sum_groups = streamed_groups if accumulating else streamed_groups[-1:] if summed else []
        landing_groups = [] if accumulating else streamed_groups[:-1] if summed else streamed_groups
        # a group is cast when its kept gradient's dtype (c where it lands, 4 where summed) is not the masters'
        casts = (bool(landing_groups) and c != m) or (bool(fp32_sum_groups) and m != 4)
        chunk = min(UPDATE_CHUNK_NUMEL, max(*streamed_groups, embedding))  # a tensor is at most its group
        # fp32 gradient chunks (cast, or a bf16 master's), fp32 weight chunks of bf16 masters, and a bf16 chunk of an
        # fp32 sum they round to first
        grad_chunks = casts or m == 2
        per_element = 4 * grad_chunks + (4 + 2 * bool(fp32_sum_groups) if m == 2 else 0)
        offload = self.optimizer_offload == "nvme"
        return {
            "weights": (m * (self.embedding_trainable_params if self.masters_offloaded else n) + c * frozen
                        + sum(self.quantized_bytes)),
            "streamed_copy": streamed * c if c != m else 0,
            "grads": streamed * c + embedding * m,
            "grad_sum": 4 * summed,
            "update_scratch": per_element * chunk,
            "optimizer_states": 0 if offload else self.optimizer_state_bytes(),
            **({"staging": staging_depth * self.staging_slot_bytes} if offload else {}),
        }

    def static_host_bytes(self, staging_depth: int = 0) -> int:
        """What lives on the host for the whole run (host_breakdown): weights, grads, states, `staging_depth`
        staging slots."""
        return sum(self.host_breakdown(staging_depth).values())

    def device_breakdown(self) -> dict[str, int]:
        return {
            "weight_slots": 2 * self.layer_slot_bytes,
            "grad_slots": 2 * max(*self.grad_bytes, 0 if self.head_slot_bytes else self.head_grad_bytes),
            "working_set": max(max(self.working_bytes), self.head_working_bytes),
            "boundary_grads": 2 * max(self.boundary_bytes),
            "constants": self.constant_device_bytes,
        }

    def static_device_bytes(self) -> int:
        """Weight slots + gradient slots + the largest working set + two boundary-gradient buffers + constants."""
        return sum(self.device_breakdown().values())

    # ---- throughput conventions -----------------------------------------------------------------
    @property
    def step_flops(self) -> float:
        """MegaTrain's convention: 6 * N_params * batch * seq (N = all stored parameters)."""
        return 6.0 * self.spec.num_params * self.workload.tokens

    def tflops(self, step_s: float) -> float:
        return self.step_flops / step_s / 1e12

    def tokens_per_s(self, step_s: float) -> float:
        return self.workload.tokens / step_s

    @property
    def total_optimizer_s(self) -> float:
        return sum(self.optimizer_s) + self.head_optimizer_s + self.embedding_optimizer_s

    # ---- measured overrides ---------------------------------------------------------------------
    def with_times(self, *, forward_s: Sequence[float] | float | None = None,
                   backward_s: Sequence[float] | float | None = None, head_s: float | None = None,
                   optimizer_s: Sequence[float] | float | None = None) -> CostModel:
        """A copy with measured seconds in place of the FLOP estimates (a float applies to every layer)."""
        out = copy.copy(self)
        for name, value in (("forward_s", forward_s), ("backward_s", backward_s), ("optimizer_s", optimizer_s)):
            if value is None:
                continue
            values = [float(value)] * self.num_layers if isinstance(value, int | float) else [float(v) for v in value]
            if len(values) != self.num_layers or any(not math.isfinite(v) or v < 0 for v in values):
                raise LazyTrainError(f"{name}: need {self.num_layers} finite non-negative seconds, got {value!r}")
            setattr(out, name, values)
        if head_s is not None:
            out.head_s = float(head_s)
        return out

    def with_optimizer_offload(self, optimizer_offload: str) -> CostModel:
        """A copy with the optimizer's state in RAM (`host`) or on NVMe (`nvme`): the same seconds, another host
        layout (what `lazytrain plan` compares, and what a refusal suggests)."""
        if optimizer_offload not in OPTIMIZER_OFFLOADS:
            raise LazyTrainError(f"optimizer_offload {optimizer_offload!r} is not one of "
                                 f"{', '.join(OPTIMIZER_OFFLOADS)}")
        out = copy.copy(self)
        out.optimizer_offload = optimizer_offload
        return out

    @property
    def least_staging_depth(self) -> int:
        """The staging slots every plan holds: 1 with the states on NVMe (a plan may take more), 0 in RAM."""
        return 1 if self.optimizer_offload == "nvme" else 0

    def with_device_constants(self, num_bytes: int) -> CostModel:
        """A copy whose per-step device constants are the executor's own count (`Shapes.constant_bytes`:
        padded or packed batches make positions and every mask per row, which the shapes alone do not tell)."""
        out = copy.copy(self)
        out.constant_device_bytes = int(num_bytes)
        return out


def mean_keys_per_query(seq: int, window: int) -> float:
    """Mean number of keys a query attends to under a causal mask limited to `window` keys: mean of min(t+1, w)."""
    w = min(window, seq)
    # sum_{t=0}^{seq-1} min(t+1, w) = w(w+1)/2 + (seq - w) * w
    return (w * (w + 1) / 2 + (seq - w) * w) / seq
