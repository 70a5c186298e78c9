"""Layer times measured in isolation: a CostModel whose compute seconds are each layer shape's, timed alone.

What `python benchmarks/calibrate.py --emulated` predicts from, beside the replay of the executor's own step
times (`lazytrain train` calibrates from whole probe steps instead: runtime/probe.py, runtime/calibrate.py).
`profile_layer_times` uses the executor's own layer and head functions (`lazytrain.runtime.hf`) when they
accept the model, else the model's modules directly.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lazytrain.costmodel.cost import HEAD_CHUNK_TOKENS, CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.plan.plan import spec_of
from lazytrain.runtime import hf


def profiled_cost(model: Any, hardware: HardwareSpec, workload: Workload, optimizer: str = "adamw", *,
                  repeats: int = 3, **kwargs: Any) -> CostModel:
    """A CostModel whose forward/backward/head seconds are measured on this machine with `model`.

    `model` is a `transformers` causal LM on the CPU (random weights are fine). One layer of each
    distinct shape is timed (fastest of `repeats`): forward without autograd, and autograd forward +
    backward; the loss head is timed chunked, as the executor runs it. Optimizer seconds come from
    `hardware.host_mem_gbps` (`HardwareSpec.profile()` measures it) and `update_bytes_per_param`.
    """
    spec = spec_of(model)
    cost = CostModel(spec, hardware, workload, optimizer, **kwargs)
    times = profile_layer_times(model, workload, repeats=repeats, head_chunk_tokens=cost.head_chunk_tokens)
    return cost.with_times(forward_s=times["forward_s"], backward_s=times["backward_s"], head_s=times["head_s"])


def profile_layer_times(model: Any, workload: Workload, *, repeats: int = 3,
                        head_chunk_tokens: int = HEAD_CHUNK_TOKENS, warmup_s: float = 0.5) -> dict[str, Any]:
    """Measure forward / autograd forward+backward seconds of each layer shape and of the chunked loss head.

    Uses the executor's own layer and head functions (`lazytrain.runtime.hf`, weights bound to copies as in
    the slots, weight gradients copied into a flat slot) when they accept the model, else the model's modules
    directly. Layers with the same type and parameter count share one measurement (fastest of `repeats`).
    First the first layer and the head run for `warmup_s` untimed: a fresh process's first second of CPU
    compute is 2-3x slow (thread pool start-up, allocator growth), which a per-call warm-up does not absorb.
    Returns {"forward_s": [...L], "backward_s": [...L], "head_s": float}.
    """
    spec = spec_of(model)
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    b, s, h = workload.batch_size, workload.seq_len, spec.hidden_size
    hidden = torch.randn(b, s, h, generator=gen).to(dtype)
    grad = torch.randn(b, s, h, generator=gen).to(dtype)
    labels = torch.randint(0, spec.vocab_size, (b * s,), generator=gen)
    try:
        parts = hf.find_parts(model)
        consts = hf.Rotary(parts, torch.device("cpu")).constants(hidden)
    except Exception:  # noqa: BLE001 - any model the executor cannot take: time its modules directly
        parts = None

    def timed_layer(j: int, layer: Any, repeats: int = repeats) -> tuple[float, float]:
        if parts is not None:
            weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
            slot = torch.empty(sum(w.numel() for w in weights.values()), dtype=dtype)
            grads, offset = {}, 0
            for n, w in weights.items():  # the gradient slot's views, as the executor passes them
                grads[n] = slot[offset:offset + w.numel()].view(w.shape)
                offset += w.numel()

            def fwd() -> None:
                with torch.no_grad():
                    hf.layer_forward(layer, weights, hidden, consts, parts.mask_kinds[j])

            def fwd_bwd() -> None:
                hf.layer_backward(layer, weights, hidden, grad, consts, parts.mask_kinds[j], grads)
        else:
            inner = model.model if hasattr(model, "model") else model
            position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
            rotary = getattr(inner, "rotary_emb", None)
            pos_emb = rotary(hidden, position_ids) if rotary is not None else None

            def call(x: Any) -> Any:
                out = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=pos_emb)
                return out[0] if isinstance(out, tuple) else out

            def fwd() -> None:
                with torch.no_grad():
                    call(hidden)

            def fwd_bwd() -> None:
                call(hidden.detach().requires_grad_(True)).backward(grad)
        times = (_fastest_s(fwd, repeats), _fastest_s(fwd_bwd, repeats))
        layer.zero_grad(set_to_none=True)
        return times

    layers = parts.layers if parts is not None else (model.model if hasattr(model, "model") else model).layers
    _warm_up(lambda: timed_layer(0, layers[0], repeats=1), warmup_s)
    measured: dict[tuple[str, int], tuple[float, float]] = {}
    forward_s, backward_s = [], []
    for j, layer in enumerate(layers):
        key = (spec.layer_types[j], spec.layer_params[j])
        if key not in measured:
            measured[key] = timed_layer(j, layer)
        forward_s.append(measured[key][0])
        backward_s.append(measured[key][1])

    if parts is not None:
        head_weights = {n: p.detach().clone() for n, p in hf.head_named_params(parts)}
        head_grads = {n: torch.zeros_like(w) for n, w in head_weights.items()}
        grad_hidden = torch.empty_like(hidden)
        loss = torch.zeros(())

        def head() -> None:
            hf.head_forward_backward(parts.norm, head_weights, hidden, labels, grad_hidden, head_grads,
                                     head_chunk_tokens, 1.0, loss)
    else:
        norm, lm_head = (model.model if hasattr(model, "model") else model).norm, model.lm_head
        x = hidden.reshape(b * s, -1).clone().requires_grad_(True)

        def head() -> None:
            for start in range(0, b * s, head_chunk_tokens):
                logits = lm_head(norm(x[start:start + head_chunk_tokens])).float()
                torch.nn.functional.cross_entropy(logits, labels[start:start + head_chunk_tokens],
                                                  reduction="sum").backward()

    _warm_up(head, warmup_s / 2)
    head_s = _fastest_s(head, repeats)
    model.zero_grad(set_to_none=True)
    return {"forward_s": forward_s, "backward_s": backward_s, "head_s": head_s}


def _warm_up(fn: Any, seconds: float) -> None:
    start = time.perf_counter()
    while True:
        fn()
        if time.perf_counter() - start >= seconds:
            return


def _fastest_s(fn: Any, repeats: int) -> float:
    """Fastest of `repeats` timed calls after a warm-up: the compute itself, robust to bursts of other jobs on a
    shared machine (a median would take a burst in; on a quiet machine the two agree within a few %)."""
    fn()  # warm-up: allocator, kernels
    samples = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples)
