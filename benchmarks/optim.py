"""Optimizer step throughput on the CPU: Hybrid8bitAdamW vs torch.optim.AdamW (fused, foreach) vs
bitsandbytes AdamW8bit, side by side in one run.

    python benchmarks/optim.py              # ~19 M params, 15 rounds, < 2 minutes on 2 cores
    python benchmarks/optim.py --rounds 5   # quicker
    python benchmarks/optim.py --threads 1  # one core each (less sensitive to other processes)
    python benchmarks/optim.py --shapes qwen2.5-7b-layer --fractions 1 --rounds 9   # one 7B layer: 233 M params, 11 GB
    GOMP_SPINCOUNT=0 python benchmarks/optim.py  # torch's OpenMP workers sleep at once after each op
    python benchmarks/optim.py --kernel 131072 --rounds 300   # the 8-bit kernel alone, one thread, data in L2
    python benchmarks/optim.py --shapes flat16m --fractions 1 --isas native,avx2 --runs 7   # both ISAs, 7 runs each
    python benchmarks/optim.py --layouts --threads 2 --isas native,avx2 --runs 3   # the update's layouts vs a triad

`--layouts` times the update as the executor runs it, one layout at a time (bf16 or fp32 masters, 8-bit or fp32
states, the kept bf16 gradient or an fp32 sum, the streamed bf16 copy written in the same pass), on one Qwen2.5-7B
layer's tensors (233 M params), against a STREAM-like triad (a = b + s c over three 256 MiB fp32 arrays, far past
the last-level cache, on the same torch threads) timed before and after every update, and prints per layout the
bytes its tensors move per parameter (each read or written once, as STREAM counts), its rate and the median of
its per-update shares of the adjacent triads' rate (`--threads 1`: one core each, less exposed to other processes).

`--isas` runs the table in fresh processes, alternating the instruction sets run by run (native, avx2, native,
...): `avx2` compiles the 8-bit kernels for an AVX2-only CPU (NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx2) and
makes torch pick its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), so an AVX-512 machine measures both side by side;
`znver3` is the same with the code an AMD Zen 3 gets (exact roots, optim/quant.py). It prints each run's ratios
and their medians.

Every round times one step of every optimizer in turn, in a shuffled order (interleaved, so load from
other processes hits all of them alike) and the table reports the median over rounds. All optimizers update the
same parameter tensors; before each timed step the gradients are restored from a pristine copy
(untimed), because clip_grad_norm_ and fused AdamW's grad_scale rescale gradients in place.
Prints a markdown table: M params/s (wall clock, median), ratio to fused fp32 AdamW without clipping and to
the like-for-like fused fp32 step (the same clipping: `clip_grad_norm_` for the norm computed inside,
`clip_grads_with_norm_` for the norm handed in; medians of the per-round ratios), CPU time per parameter (all
threads of this process, spin-waiting included), optimizer-state bytes per parameter.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

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
SHAPE_SETS = {"mixed": MIXED_SHAPES, "qwen2.5-7b-layer": QWEN7B_LAYER_SHAPES, "flat16m": [(4096, 4096)]}
#: Environment of each instruction set for `--isas` (set before numba and torch load).
ISA_ENV = {
    "native": {},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2", "ATEN_CPU_CAPABILITY": "avx2"},
    "znver3": {"NUMBA_CPU_NAME": "znver3", "NUMBA_CPU_FEATURES": "+avx2", "ATEN_CPU_CAPABILITY": "avx2"},
}
#: Clipping forms: (torch's fused fp32 step, Hybrid8bitAdamW's) of each like-for-like pair.
NONE, INSIDE, HANDED_IN = "none", "norm inside", "norm handed in"


def _cpu_name() -> str:
    """The model name with its family and model numbers (a VM's "AMD EPYC" alone names no generation)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in info:
        return platform.processor() or "unknown CPU"
    return f"{info['model name']} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


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


@dataclass
class Layout:
    """One way the update's tensors are kept (train/optimizer.py, runtime/store.py)."""

    name: str
    masters: torch.dtype
    grad: torch.dtype  # the kept gradient: bf16 where it landed, fp32 where micro-batches were summed
    eightbit: bool
    copy: bool  # fp32 masters with bf16 compute: the streamed bf16 copy, written in the same pass


LAYOUTS = [
    Layout("bf16 masters + 8-bit", torch.bfloat16, torch.bfloat16, True, False),
    Layout("bf16 masters + 8-bit, fp32 sum", torch.bfloat16, torch.float32, True, False),
    Layout("fp32 masters + 8-bit + bf16 copy", torch.float32, torch.bfloat16, True, True),
    Layout("fp32 masters + fp32 states + bf16 copy", torch.float32, torch.bfloat16, False, True),
]
TRIAD_NUMEL = 1 << 26  # per array: 256 MiB of fp32, 8 x a 32 MiB L3


def triad_seconds(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> float:
    """One STREAM triad a = b + 3 c (torch's add with alpha: one vectorized pass on torch's threads)."""
    t0 = time.perf_counter()
    torch.add(b, c, alpha=3.0, out=a)
    return time.perf_counter() - t0


def layouts(args: argparse.Namespace) -> list[str]:
    """Time each layout's update between two triads; print and return one line per layout.

    Each update's rate is divided by the mean rate of the triads just before and just after it (a few hundred ms
    apart, so other processes' load hits both alike), and the line gives the median of these per-update ratios
    (their range in brackets) beside the medians of the rates.
    """
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shapes = QWEN7B_LAYER_SHAPES
    gen = torch.Generator().manual_seed(0)
    tri = [torch.rand(TRIAD_NUMEL, generator=gen) for _ in range(3)]
    triad_bytes = 3 * 4 * TRIAD_NUMEL
    lines, loads = [], [os.getloadavg()[0]]
    for lay in LAYOUTS:
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(lay.masters)) for s in shapes]
        grads = {p: (torch.randn(p.shape, generator=gen) * 0.01).to(lay.grad) for p in params}
        copies = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in params} if lay.copy else None
        opt = Hybrid8bitAdamW(params, lr=1e-4, eightbit_fraction=1.0 if lay.eightbit else 0.0)
        n = sum(p.numel() for p in params)
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        moved = sum(2 * nbytes(p) + nbytes(grads[p]) + (nbytes(copies[p]) if copies else 0)
                    + sum(2 * nbytes(v) for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim())
                    for p in params)  # weights and states read and written, gradient read, copy written
        times, triad_gbps = [], [triad_bytes / triad_seconds(*tri) / 1e9]
        for r in range(args.warmup + args.rounds):
            t0 = time.perf_counter()
            opt.step_group(0, 0.5, grads=grads, copies=copies)  # clipping on, as every step with a max norm
            dt = time.perf_counter() - t0
            triad_gbps.append(triad_bytes / triad_seconds(*tri) / 1e9)
            if r >= args.warmup:
                times.append(dt)
            else:
                triad_gbps = triad_gbps[-1:]  # warm-up rounds keep only the triad after them
        pairs = zip(times, triad_gbps[:-1], triad_gbps[1:], strict=True)  # each update and the triads around it
        ratios = [moved / t / 1e9 / ((a + b) / 2) for t, a, b in pairs]
        t = statistics.median(times)
        lines.append(f"layout {lay.name}: {moved / n:.2f} B/param, {n / t / 1e9:.2f} Gparams/s, {moved / t / 1e9:.1f} "
                     f"GB/s = {100 * statistics.median(ratios):.0f}% of triad {statistics.median(triad_gbps):.1f} "
                     f"GB/s (per update {100 * min(ratios):.0f}-{100 * max(ratios):.0f}%)")
        print(lines[-1], flush=True)
        loads.append(os.getloadavg()[0])
        del params, grads, copies, opt
    print(f"{sum(map(math.prod, shapes)) / 1e6:.0f} M params (one Qwen2.5-7B layer), {torch.get_num_threads()} "
          f"threads, {args.rounds} updates per layout, each between two triads; {_cpu_name()}, numba CPU "
          f"{numba.config.CPU_NAME or 'host'}, torch {torch.backends.cpu.get_cpu_capability()}; "
          f"load average {min(loads):.1f}-{max(loads):.1f}", flush=True)
    return lines


@dataclass
class Row:
    name: str
    share: str  # 8-bit share of the parameters
    clip: str  # NONE, INSIDE or HANDED_IN
    opt: torch.optim.Optimizer
    step: Callable[[], None]


def contenders(params: list[torch.nn.Parameter], fractions: tuple[float, ...]) -> tuple[list[Row], str]:
    """Fused fp32 AdamW in the three clipping forms, foreach, Hybrid8bitAdamW per 8-bit share in the three forms,
    bitsandbytes where installed; and bitsandbytes' version."""
    rows: list[Row] = []

    def norm_now() -> float:  # what the executor accumulates as gradients arrive
        return math.sqrt(float(sum(per_tensor_sq_norms([p.grad]).sum() for p in params)))

    precomputed_norm = norm_now()
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    rows.append(Row("torch AdamW fused", "0%", NONE, fused, fused.step))
    fused_in = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def fused_inside() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        fused_in.step()

    rows.append(Row("torch AdamW fused + clip_grad_norm_", "0%", INSIDE, fused_in, fused_inside))
    fused_handed = torch.optim.AdamW(params, lr=1e-4, fused=True)
    norm_tensor = torch.tensor(precomputed_norm)

    def fused_handed_in() -> None:
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm_tensor, foreach=True)
        fused_handed.step()

    rows.append(Row("torch AdamW fused + clip_grads_with_norm_", "0%", HANDED_IN, fused_handed, fused_handed_in))
    foreach = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    rows.append(Row("torch AdamW foreach", "0%", NONE, foreach, foreach.step))
    for frac in fractions:
        share = f"{frac:.0%}"
        o_in = Hybrid8bitAdamW(params, lr=1e-4, eightbit_fraction=frac, max_grad_norm=1.0)
        rows.append(Row("Hybrid8bitAdamW", share, INSIDE, o_in, o_in.step))
        for clip, max_norm in ((HANDED_IN, 1.0), (NONE, None)):
            o = Hybrid8bitAdamW(params, lr=1e-4, eightbit_fraction=frac, max_grad_norm=max_norm)
            # with clipping off the norm is the finite check's input only
            rows.append(Row("Hybrid8bitAdamW", share, clip, o, lambda o=o: o.step(grad_norm=precomputed_norm)))
    bnb_version = "not installed"
    try:
        # its CPU backend warns at import that an optional 4-bit GEMM kernel is missing; not used here
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        import bitsandbytes as bnb

        bnb_version = bnb.__version__
        b8 = bnb.optim.AdamW8bit(params, lr=1e-4)
        rows.append(Row(f"bitsandbytes {bnb_version} AdamW8bit", "100%", NONE, b8, b8.step))
    except Exception as exc:  # noqa: BLE001 - optional comparison: any import/runtime failure skips it
        print(f"(bitsandbytes skipped: {type(exc).__name__}: {exc})")
    return rows, bnb_version


def table(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Time every contender in interleaved rounds, print the table, return {row label: figures}."""
    shapes = SHAPE_SETS[args.shapes]
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # also the 8-bit kernel's thread count
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    n = sum(p.numel() for p in params)
    pristine = [torch.randn(s) * 0.01 for s in shapes]  # N(0, 0.01): global norm ~44, so clip 1.0 acts
    for p, g in zip(params, pristine, strict=True):
        p.grad = g.clone()
    rows, bnb_version = contenders(params, args.fractions)

    times: list[list[float]] = [[] for _ in rows]
    cpu_times: list[list[float]] = [[] for _ in rows]  # CPU seconds of all threads of this process
    shuffle = random.Random(0)
    for r in range(args.warmup + args.rounds):
        for i in shuffle.sample(range(len(rows)), len(rows)):  # a new order each round: no position bias
            for p, g in zip(params, pristine, strict=True):  # clipping rescales gradients in place
                p.grad.copy_(g)
            c0, t0 = time.process_time(), time.perf_counter()
            rows[i].step()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= args.warmup:
                times[i].append(dt)
                cpu_times[i].append(dc)

    # ratios per round, then the median: both steps ran within milliseconds of each other, so slow drifts (other
    # tenants' memory traffic) cancel out of the ratio
    def ratio(base: list[float], ts: list[float]) -> float:
        return statistics.median(b / t for b, t in zip(base, ts, strict=True))

    peer = {r.clip: times[k] for k, r in enumerate(rows[:3])}  # torch fused in the three forms
    spin = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ} or "libgomp default"
    print(f"\nOpenMP wait: {spin} (torch's OpenMP workers spin after each parallel op; see docs)")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{n / 1e6:.1f} M params in {len(shapes)} tensors; {_cpu_name()}, {torch.get_num_threads()} torch threads, "
          f"8-bit kernel on the same OpenMP threads; torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), numba {numba.__version__} "
          f"(CPU {numba.config.CPU_NAME or 'host'}), bitsandbytes {bnb_version}; "
          f"median of {args.rounds} steps\n")
    print("| optimizer | 8-bit share | clipping | M params/s | vs fused fp32 | vs fused fp32, same clipping "
          "| CPU ns/param | state bytes/param |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    out = {}
    for row, ts, cs in zip(rows, times, cpu_times, strict=True):
        figures = {"mparams_per_s": n / statistics.median(ts) / 1e6, "vs_fused": ratio(times[0], ts),
                   "vs_same_clip": ratio(peer[row.clip], ts), "cpu_ns": statistics.median(cs) / n * 1e9}
        out[f"{row.name} | {row.share} | {row.clip}"] = figures
        print(f"| {row.name} | {row.share} | {row.clip} | {figures['mparams_per_s']:,.0f} | {figures['vs_fused']:.2f} "
              f"| {figures['vs_same_clip']:.2f} | {figures['cpu_ns']:.2f} | {_state_bytes(row.opt) / n:.3f} |")
    return out


def compare_isas(args: argparse.Namespace) -> None:
    """`--runs` runs per instruction set, alternating, each a fresh process; per-run ratios and medians."""
    isas = args.isas.split(",")
    unknown = sorted(set(isas) - set(ISA_ENV))
    if unknown:
        raise SystemExit(f"--isas: unknown {unknown}; known: {', '.join(ISA_ENV)}")
    keep = ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--threads", str(args.threads),
            "--fractions", ",".join(map(str, args.fractions)), "--shapes", args.shapes]
    if args.layouts:
        compare_layouts(args, isas, keep)
        return
    results: dict[str, list[dict[str, dict[str, float]]]] = {isa: [] for isa in isas}
    loads = []
    for run in range(args.runs):
        for isa in isas:
            loads.append(os.getloadavg()[0])
            done = subprocess.run([sys.executable, __file__, *keep, "--json"], env={**os.environ, **ISA_ENV[isa]},
                                  capture_output=True, text=True, check=True)
            results[isa].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"run {run + 1} {isa} done (load {loads[-1]:.1f})", file=sys.stderr, flush=True)
    print(f"{args.runs} runs per ISA, alternating; load average at the starts {min(loads):.1f}-{max(loads):.1f}; "
          f"{_cpu_name()}\n")
    print("| ISA | row | vs fused fp32, per run | median | vs same clipping, per run | median |")
    print("|---|---|---|---:|---|---:|")
    for isa in isas:
        for label in results[isa][0]:
            if label.startswith("torch") or "bitsandbytes" in label:
                continue
            a = [r[label]["vs_fused"] for r in results[isa]]
            b = [r[label]["vs_same_clip"] for r in results[isa]]
            print(f"| {isa} | {label} | {', '.join(f'{x:.2f}' for x in a)} | **{statistics.median(a):.2f}** "
                  f"| {', '.join(f'{x:.2f}' for x in b)} | **{statistics.median(b):.2f}** |")


def compare_layouts(args: argparse.Namespace, isas: list[str], keep: list[str]) -> None:
    """`--layouts` with `--isas`: each ISA --runs times in fresh processes, alternating; every run's lines."""
    for run in range(args.runs):
        for isa in isas:
            load = os.getloadavg()[0]
            done = subprocess.run([sys.executable, __file__, *keep, "--layouts"], env={**os.environ, **ISA_ENV[isa]},
                                  capture_output=True, text=True, check=True)
            print(f"-- run {run + 1}, {isa} (load average at the start {load:.2f})")
            print(done.stdout.strip(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="timed steps per optimizer (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer first")
    ap.add_argument("--threads", type=int, default=0, help="torch (and 8-bit kernel) threads; 0 = torch default")
    ap.add_argument("--fractions", type=_fractions, default=(0.0, 0.02, 1.0),
                    help="eightbit_fraction values of the Hybrid8bitAdamW rows, comma-separated (default 0,0.02,1; "
                    "each fp32-state row holds 8 bytes/param, so '1' keeps the 233 M layer within 24 GB)")
    ap.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="mixed",
                    help="parameter tensors: 'mixed' (19.5 M, odd sizes), one Qwen2.5-7B layer (233 M), or one "
                    "4096 x 4096 tensor ('flat16m', 16.8 M)")
    ap.add_argument("--kernel", type=int, default=0, metavar="N",
                    help="instead of the table: time the 8-bit kernel alone on N elements (one thread unless "
                    "--threads), ns/element min and median over --rounds calls")
    ap.add_argument("--isas", default="", help="comma-separated instruction sets (native, avx2, znver3) to run "
                    "side by side, each --runs times in fresh processes")
    ap.add_argument("--runs", type=int, default=7, help="runs per instruction set with --isas")
    ap.add_argument("--layouts", action="store_true", help="instead of the table: the update's layouts on one 7B "
                    "layer against a triad in the same run (with --isas: side by side)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # --isas' child processes
    args = ap.parse_args()
    if args.isas:
        compare_isas(args)
    elif args.layouts:
        layouts(args)
    elif args.kernel > 0:
        kernel_only(args.kernel, args.rounds, args.threads or 1)
    else:
        out = table(args)
        if args.json:
            print(json.dumps(out))


if __name__ == "__main__":
    main()
