"""The one-pass update (optim/quant.py's layouts, optim/chunked.py's cache-sized chunks): bit for bit the two-pass
update it replaced, on every layout, and its bytes per parameter as the cost model states them."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.optim import Hybrid8bitAdamW
from lazytrain.optim.bf16 import rounding_key, stochastic_round_
from lazytrain.optim.chunked import Scratch, step_adamw
from lazytrain.optim.quant import PARALLEL_MIN_NUMEL, adamw8bit_step_

# odd sizes: partial last blocks, a tensor below one block, several threads' work on the largest
SHAPES = [(70_001,), (300, 77), (5,), (4097, 3), (256 * 700 + 17,)]
SEED, LR, WD, STEPS = 7, 3e-3, 0.1, 4


def _two_pass_(p: torch.Tensor, grad: torch.Tensor, st: dict, index: int, step: int, coef: float,
               copy: torch.Tensor | None) -> None:
    """The update as it ran before one pass per layout: the gradient cast to the weights' dtype and into an fp32
    buffer, bf16 weights copied to fp32, the fp32 kernel (8-bit) or torch's fused AdamW (fp32 states) on the copies,
    the weights rounded back stochastically, the streamed copy re-packed."""
    g = grad.to(p.dtype).float().clone()  # torch's fused AdamW writes the clipped gradient back
    w = p.detach().view(-1).float() if p.dtype == torch.bfloat16 else p.detach().view(-1)
    if "qm" in st:
        adamw8bit_step_(w, g, st["qm"], st["qv"], st["absmax_m"], st["absmax_v"], block_size=256, clip_coef=coef,
                        lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WD, step=step)
    else:
        torch._fused_adamw_([w], [g.view(-1)], [st["exp_avg"].view(-1)], [st["exp_avg_sq"].view(-1)], [],
                            [torch.tensor(float(step))], lr=LR, beta1=0.9, beta2=0.999, weight_decay=WD, eps=1e-8,
                            amsgrad=False, maximize=False, grad_scale=torch.tensor(1 / coef), found_inf=None)
    if p.dtype == torch.bfloat16:
        stochastic_round_(p.detach().view(-1), w, rounding_key(SEED, index, step))
    if copy is not None:
        copy.copy_(w.view_as(copy))


@pytest.mark.exactness
@pytest.mark.parametrize("states", ["8-bit", "fp32"])
@pytest.mark.parametrize(("masters", "kept", "copy"), [
    (torch.bfloat16, torch.bfloat16, False), (torch.bfloat16, torch.float32, False),
    (torch.float32, torch.bfloat16, False), (torch.float32, torch.bfloat16, True),
    (torch.float32, torch.float32, True), (torch.float32, torch.float16, False),
])
def test_one_pass_equals_two_pass_bit_for_bit(two_threads, states, masters, kept, copy):
    """4 clipped steps with weight decay on fresh random tensors of odd sizes: weights, the streamed copy and every
    state tensor equal the two-pass update's bit for bit, and the given gradients are left alone."""
    assert max(map(math.prod, SHAPES)) >= PARALLEL_MIN_NUMEL  # the largest runs on both threads
    gen = torch.Generator().manual_seed(1)
    start = [(torch.randn(s, generator=gen) * 0.5).to(masters) for s in SHAPES]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = Hybrid8bitAdamW(params, lr=LR, weight_decay=WD, min_8bit_size=0, seed=SEED,
                          eightbit_fraction=1.0 if states == "8-bit" else 0.0)
    ref = [t.clone() for t in start]
    ref_states = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.dim()}
                  for p in params]
    copies = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in params} if copy else None
    ref_copies = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
    for step in range(1, STEPS + 1):
        grads = [(torch.randn(s, generator=gen) * 0.05).to(kept) for s in SHAPES]
        kept_grads = [g.clone() for g in grads]
        coef = 0.3 + 0.1 * step  # < 1: clipping acts
        opt.step_group(0, coef, grads=dict(zip(params, grads, strict=True)), copies=copies)
        for i, (r, g) in enumerate(zip(ref, grads, strict=True)):
            _two_pass_(r, g, ref_states[i], i, step, coef, ref_copies[i] if copy else None)
        assert all(torch.equal(g, k) for g, k in zip(grads, kept_grads, strict=True))
        assert all(torch.equal(p, r) for p, r in zip(params, ref, strict=True))
        for p, rs in zip(params, ref_states, strict=True):
            assert all(torch.equal(opt.state[p][k], v) for k, v in rs.items())
        if copy:
            assert all(torch.equal(copies[p], c) for p, c in zip(params, ref_copies, strict=True))
    assert not torch.equal(params[0].float(), start[0].float())  # it did train


@pytest.mark.exactness
@pytest.mark.slow
def test_one_pass_equals_two_pass_in_avx2_code():
    """The same in the code an AVX2-only CPU gets (numba and torch both): a fresh process, compiled for haswell."""
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                           "bit_for_bit and 8-bit"], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:]


# ---------------------------------------------------------------- bytes per parameter vs the cost model
TRIAD_NUMEL = 1 << 24  # per array: 64 MiB of fp32, twice the 32 MiB L3 of the largest desktop parts in presets
NUMEL = 1 << 24  # parameters per layout: every tensor far past the last-level cache


def _triad_gbps(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> float:
    """STREAM's triad a = b + 3 c (one vectorized pass on torch's threads), GB/s as STREAM counts it."""
    t0 = time.perf_counter()
    torch.add(b, c, alpha=3.0, out=a)
    return 12 * a.numel() / (time.perf_counter() - t0) / 1e9


@pytest.mark.perf  # a timing: CI's machine is shared, so it runs where asked (pytest -m perf), as a benchmark does
@pytest.mark.parametrize(("optimizer", "dtype", "masters", "accumulation"), [
    ("8bit", "bf16", "bf16", 1),  # bf16 weights and gradient: 10 B/param
    ("8bit", "bf16", "bf16", 2),  # an fp32 sum: 12
    ("8bit", "bf16", "fp32", 1),  # fp32 masters, the bf16 copy written in the same pass: 16
    ("8bit", "fp32", "fp32", 1),  # 16
    ("adamw", "bf16", "fp32", 1),  # torch's AdamW through cache-sized fp32 chunks, re-packed: 32
    ("adamw", "fp32", "fp32", 1),  # clip pass, then torch's fused AdamW: 36
])
def test_update_bytes_per_param_agree_with_measured_time_at_triad_bandwidth(two_threads, optimizer, dtype, masters,
                                                                           accumulation):
    """What the optimizer lane runs per layout (the update, writing the streamed copy or followed by its re-pack),
    timed between triads on the same threads: its seconds x the triad's GB/s are the cost model's bytes within
    25% (where the kernels move their bytes at 70-100% of the triad's rate, which counts its writes once although the
    memory reads each written line first; 25% leaves room for the rest). It measures the machine: on one whose cores
    are shared with other work the compute-heavier update loses more to it than the triad does, and a 2-core Zen 2
    under load does not reach 70% (docs/benchmarks.md#the-host-update-against-a-triad)."""
    gen = torch.Generator().manual_seed(0)
    m_dtype = torch.bfloat16 if masters == "bf16" else torch.float32
    g_dtype = torch.float32 if accumulation > 1 or dtype == "fp32" else torch.bfloat16
    p = torch.nn.Parameter((torch.randn(NUMEL, generator=gen) * 0.02).to(m_dtype))
    grad = (torch.randn(NUMEL, generator=gen) * 0.01).to(g_dtype)
    copy = torch.empty(NUMEL, dtype=torch.bfloat16) if dtype == "bf16" and masters == "fp32" else None
    refresh = copy if optimizer == "adamw" else None  # runtime/store.py's pack after torch's AdamW
    if optimizer == "8bit":
        opt = Hybrid8bitAdamW([p], lr=1e-4)

        def update() -> None:
            opt.step_group(0, 0.5, grads={p: grad}, copies=None if copy is None else {p: copy})
    else:
        opt, scratch = torch.optim.AdamW([p], lr=1e-4, fused=True), Scratch()

        def update() -> None:
            step_adamw(opt, [0], {p: grad}, torch.tensor(0.5), scratch)

    def lane() -> None:
        update()
        if refresh is not None:
            refresh.copy_(p.detach())

    tri = [torch.rand(TRIAD_NUMEL, generator=gen) for _ in range(3)]
    lane()  # first touches of the states
    seconds, gbps = [], []
    for _ in range(5):
        gbps.append(_triad_gbps(*tri))
        t0 = time.perf_counter()
        lane()
        seconds.append(time.perf_counter() - t0)
    gbps.append(_triad_gbps(*tri))
    measured = statistics.median(seconds) * statistics.median(gbps) * 1e9 / NUMEL
    spec = ModelSpec.load("qwen2.5-7b")
    cost = CostModel(spec, HardwareSpec.load("rtx3090"), Workload(1, 16, dtype), optimizer, master_weights=masters,
                     grad_accumulation=accumulation)
    stated = cost.update_bytes_per_param("layer")
    assert measured == pytest.approx(stated, rel=0.25), (measured, stated, statistics.median(gbps))
