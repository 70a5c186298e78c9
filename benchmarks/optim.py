"""Optimizer step throughput on the CPU: Hybrid8bitAdamW vs torch.optim.AdamW (fused, foreach) vs
bitsandbytes AdamW8bit, side by side in one run.

    python benchmarks/optim.py              # ~19 M params, 15 rounds, < 2 minutes on 2 cores
    python benchmarks/optim.py --rounds 5   # quicker
    python benchmarks/optim.py --threads 1  # one core each (less sensitive to other processes)
    python benchmarks/optim.py --shapes qwen2.5-7b-layer --fractions 1 --rounds 9   # one 7B layer: 233 M params, 11 GB
    GOMP_SPINCOUNT=0 python benchmarks/optim.py  # torch's OpenMP workers sleep at once after each op
    python benchmarks/optim.py --kernel 131072 --rounds 300   # the 8-bit kernel alone, one thread, data in L2

Every round times one step of every optimizer in turn, in a shuffled order (interleaved, so load from
other processes hits all of them alike) and the table reports the median over rounds. All optimizers update the
same parameter tensors; before each timed step the gradients are restored from a pristine copy
(untimed), because clip_grad_norm_ and fused AdamW's grad_scale rescale gradients in place.
Prints a markdown table: M params/s (wall clock, median), ratio to fused fp32 AdamW (median of the
per-round ratios), CPU time per parameter (all threads of this process, spin-waiting included),
optimizer-state bytes per parameter.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import numba
import torch

from lazytrain.optim import Hybrid8bitAdamW, per_tensor_sq_norms
from lazytrain.optim.quant import adamw8bit_step_

# Realistic shapes: attention/MLP projections, odd sizes, biases and norms; 19.5 M params.
# (384, 1000) + (4096,) are the 2% slice that eightbit_fraction=0.02 picks.
MIXED_SHAPES = [(4096, 1024)] * 4 + [(1000, 1001), (4097, 333), (384, 1000), (4096,), (1024,), (1024,), (333,)]
# One Qwen2.5-7B decoder layer (233 M params): the tensor sizes the executor's per-layer step really sees.
H, FF, KV = 3584, 18944, 512
QWEN7B_LAYER_SHAPES = [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF), (H,), (KV,), (KV,), (H,), (H,)]
SHAPE_SETS = {"mixed": MIXED_SHAPES, "qwen2.5-7b-layer": QWEN7B_LAYER_SHAPES}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors, per-tensor scalars (step counters) excluded."""
    total = 0
    for st in opt.state.values():
        for val in st.values():
            if isinstance(val, torch.Tensor) and val.numel() > 1:
                total += val.numel() * val.element_size()
    return total


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {text!r}") from None
    if not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"eightbit_fraction values must be in [0, 1], got {text!r}")
    return values


def kernel_only(numel: int, rounds: int, threads: int) -> None:
    """Time `adamw8bit_step_` alone (clip on, all states 8-bit) on one flat tensor: ns/element, min and median.

    The min over many calls on data that fits in L2 is the kernel's compute cost, the figure least
    disturbed by other processes' memory traffic.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    block_size = 256
    nblocks = -(-numel // block_size)
    p, g = torch.randn(numel) * 0.02, torch.randn(numel) * 0.01
    states = [torch.full((numel,), 128, dtype=torch.uint8), torch.zeros(numel, dtype=torch.uint8),
              torch.zeros(nblocks), torch.zeros(nblocks)]
    hparams = dict(block_size=block_size, clip_coef=0.7, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ns = []
    for step in range(1, rounds + 4):
        t0 = time.perf_counter()
        adamw8bit_step_(p, g, *states, step=step, **hparams)
        if step > 3:  # compile / first touches
            ns.append((time.perf_counter() - t0) / numel * 1e9)
    print(f"8-bit kernel alone: {numel} elements, {threads} thread(s), {rounds} calls; {_cpu_name()}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"ns/element: min {min(ns):.3f}, median {statistics.median(ns):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="timed steps per optimizer (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer first")
    ap.add_argument("--threads", type=int, default=0, help="torch (and 8-bit kernel) threads; 0 = torch default")
    ap.add_argument("--fractions", type=_fractions, default=(0.0, 0.02, 1.0),
                    help="eightbit_fraction values of the Hybrid8bitAdamW rows, comma-separated (default 0,0.02,1; "
                    "each fp32-state row holds 8 bytes/param, so '1' keeps the 233 M layer within 24 GB)")
    ap.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="mixed",
                    help="parameter tensors: 'mixed' (19.5 M, odd sizes) or one Qwen2.5-7B layer (233 M)")
    ap.add_argument("--kernel", type=int, default=0, metavar="N",
                    help="instead of the table: time the 8-bit kernel alone on N elements (one thread unless "
                    "--threads), ns/element min and median over --rounds calls")
    args = ap.parse_args()
    if args.kernel > 0:
        kernel_only(args.kernel, args.rounds, args.threads or 1)
        return
    shapes = SHAPE_SETS[args.shapes]
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # also the 8-bit kernel's thread count

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    n = sum(p.numel() for p in params)
    pristine = [torch.randn(s) * 0.01 for s in shapes]  # N(0, 0.01): global norm ~44, so clip 1.0 acts
    for p, g in zip(params, pristine, strict=True):
        p.grad = g.clone()

    def restore_grads() -> None:
        for p, g in zip(params, pristine, strict=True):
            p.grad.copy_(g)

    # ---------------------------------------------------------------- contenders
    rows: list[tuple[str, str, str, torch.optim.Optimizer, Callable[[], None]]] = []

    def add(name: str, share: str, clip: str, opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
        rows.append((name, share, clip, opt, step))

    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    add("torch AdamW fused", "0%", "none", fused, fused.step)
    fused_c = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def fused_clip_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        fused_c.step()

    add("torch AdamW fused", "0%", "clip_grad_norm_", fused_c, fused_clip_step)
    foreach = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    add("torch AdamW foreach", "0%", "none", foreach, foreach.step)

    def norm_now() -> float:  # what the executor accumulates as gradients arrive
        return math.sqrt(float(sum(per_tensor_sq_norms([p.grad]).sum() for p in params)))

    precomputed_norm = norm_now()
    for frac in args.fractions:
        share = f"{frac:.0%}"
        o_clip = Hybrid8bitAdamW(params, lr=1e-4, eightbit_fraction=frac, max_grad_norm=1.0)
        add("Hybrid8bitAdamW", share, "fused, norm inside", o_clip, o_clip.step)
        o_pre = Hybrid8bitAdamW(params, lr=1e-4, eightbit_fraction=frac, max_grad_norm=1.0)

        def pre_step(o: Hybrid8bitAdamW = o_pre) -> None:
            o.step(grad_norm=precomputed_norm)

        add("Hybrid8bitAdamW", share, "fused, norm precomputed", o_pre, pre_step)
        o_none = Hybrid8bitAdamW(params, lr=1e-4, eightbit_fraction=frac, max_grad_norm=None)

        def none_step(o: Hybrid8bitAdamW = o_none) -> None:
            o.step(grad_norm=precomputed_norm)  # finite-check input only; no scaling

        add("Hybrid8bitAdamW", share, "none", o_none, none_step)
    bnb_version = "not installed"
    try:
        # its CPU backend warns at import that an optional 4-bit GEMM kernel is missing; not used here
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        import bitsandbytes as bnb

        bnb_version = bnb.__version__
        b8 = bnb.optim.AdamW8bit(params, lr=1e-4)
        add(f"bitsandbytes {bnb_version} AdamW8bit", "100%", "none", b8, b8.step)
    except Exception as exc:  # noqa: BLE001 - optional comparison: any import/runtime failure skips it
        print(f"(bitsandbytes skipped: {type(exc).__name__}: {exc})")

    # ---------------------------------------------------------------- timing
    times: list[list[float]] = [[] for _ in rows]
    cpu_times: list[list[float]] = [[] for _ in rows]  # CPU seconds of all threads of this process
    shuffle = random.Random(0)
    for r in range(args.warmup + args.rounds):
        for i in shuffle.sample(range(len(rows)), len(rows)):  # a new order each round: no position bias
            step = rows[i][-1]
            restore_grads()
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= args.warmup:
                times[i].append(dt)
                cpu_times[i].append(dc)

    # ---------------------------------------------------------------- report
    med = [statistics.median(t) for t in times]
    # ratio to fused fp32 per round, then the median: both ran within milliseconds of each other, so
    # slow drifts (other tenants' memory traffic) cancel out of the ratio
    ratios = [statistics.median(f / t for f, t in zip(times[0], ts, strict=True)) for ts in times]
    spin = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ} or "libgomp default"
    print(f"\nOpenMP wait: {spin} (torch's OpenMP workers spin after each parallel op; see docs)")
    load_1min = os.getloadavg()[0]
    print(
        f"load average (1 min) at the end: {load_1min:.2f} on {os.cpu_count()} cores (other processes skew timings)"
    )
    print(
        f"{n / 1e6:.1f} M params in {len(shapes)} tensors; {_cpu_name()}, {torch.get_num_threads()} torch threads, "
        f"8-bit kernel on the same OpenMP threads; torch {torch.__version__}, numba {numba.__version__}, "
        f"bitsandbytes {bnb_version}; median of {args.rounds} steps\n"
    )
    print("| optimizer | 8-bit share | clipping | M params/s | vs fused fp32 | CPU ns/param | state bytes/param |")
    print("|---|---|---|---:|---:|---:|---:|")
    for (name, share, clip, opt, _), m, ratio, c in zip(rows, med, ratios, cpu_times, strict=True):
        cpu_ns = statistics.median(c) / n * 1e9
        print(
            f"| {name} | {share} | {clip} | {n / m / 1e6:,.0f} | {ratio:.2f} | {cpu_ns:.2f} "
            f"| {_state_bytes(opt) / n:.3f} |"
        )


if __name__ == "__main__":
    main()
