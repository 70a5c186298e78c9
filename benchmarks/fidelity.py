"""Does the emulated device run what the simulator predicts? Measured steps against the prediction, op by op.

    python benchmarks/fidelity.py default --steps 12     # the default job (`lazytrain train`), ~2 min idle
    python benchmarks/fidelity.py why                    # the issue's three "Why" instances scaled down, ~2 min
    python benchmarks/fidelity.py links --repeats 3 --steps 5   # link rates calibrated by the probe, ~1 min

`default`: the default job built as `lazytrain train` builds it (its data, model, calibration and plan), then
`--steps` training steps (the trainer's own `train_step`, overlap mode), each followed in the same round by one
calibration probe step (the all-`gpu` plan on an uncapped device, as `calibrated_cost` times it), so both see
the same machine. Reported:
- measured step (the trainer's `step_s`) vs the prediction, and the executor's wall time within it;
- sim(run): each step's program replayed by the simulator with every op's own measured seconds (compute ops,
  link jobs, optimizer-lane jobs) against the executor's wall: the program's structure, apart from the cost
  model's seconds (robust to load); its residue (~1%) is the executor's Python between ops, which the
  calibration spreads over the compute ops (runtime/calibrate.py), so the prediction can come closer;
- per op kind, seconds per step: measured in the run, measured in the probe (same rounds), and the cost model's
  (the calibration): where run and probe part, the calibration cannot see it; where probe and model part, the
  calibration missed.

`why`: scaled-down versions of the issue's instances on a 6-layer Llama -- NVMe reloads on a slow NVMe link, a
slow d2h link, a tight cap -- each planned by the MILP on this machine's calibration (the executor's own
per-layer seconds) and run on the throttled emulated device: measured step against the simulated one (sim(cal):
the calibration, timed once before the runs; sim(probe): the same calibration of the probe's steps taken in the
same rounds as the runs, so apart from when the calibration ran; sim(run): the step's own op seconds) and the
arena's peak against the simulated peak; then each
instance's seconds per op kind, measured against the calibrated cost model (where sim(cal) misses).

`links`: the probe's link calibration (runtime/probe.py): the job calibrated as `lazytrain train` does on a
device whose links are unthrottled (config `inf`) or throttled at 11 MB/s where the config says 1 GB/s, then a
plan with cpu and nvme tiers run there: measured step against the prediction, and against the same calibration
with the configured link rates (the prediction before links were measured).

The machine is shared: state the load (printed) beside any figure; the sim(run) columns are the ones load
moves least. `--threads 1` pins torch to one thread (steadier on a loaded machine).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import resource
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, ModelSpec, Plan, Workload
from lazytrain.config import load_job_config
from lazytrain.costmodel.hardware import LINKS, resolve_dtype
from lazytrain.job.resolve import with_math_dataset
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import solve_milp
from lazytrain.plan.schedule import Op, StepProgram
from lazytrain.plan.sim import op_seconds, simulate, step_seconds
from lazytrain.runtime.calibrate import calibrate, probe_steps, rebuilt
from lazytrain.runtime.executor import StepStats
from lazytrain.train.build import build_device, build_executor, build_model, fit_device_cap, model_source
from lazytrain.train.metrics import MetricsLog
from lazytrain.train.planning import plan_run
from lazytrain.train.run_data import load_data
from lazytrain.train.trainer import Trainer

KINDS = ("forward", "recompute", "keep", "head", "backward", "backprop", *LINKS, "update", "land", "embedding")


def kind_of(op: Op) -> str:
    """The row an op's seconds are added to: compute ops by kind, link jobs by lane, optimizer jobs by kind."""
    return op.lane if op.lane in LINKS else op.kind


def measured_seconds(program: StepProgram, stats: StepStats) -> Callable[[Op], float]:
    """`seconds_of(op)` for the simulator: the k-th op of a name in program order takes the k-th measured op of that
    name in the step's timeline (compute ops timed on the compute thread, lane jobs by their events). Stateful:
    one replay per call of this function."""
    measured: dict[str, list[float]] = defaultdict(list)
    for _, name, start, end in sorted(stats.timeline, key=lambda e: e[2]):
        measured[name].append(end - start)
    used: dict[str, int] = defaultdict(int)

    def seconds_of(op: Op) -> float:
        k = used[op.name]
        used[op.name] += 1
        runs = measured.get(op.name, [])
        if k >= len(runs):
            raise SystemExit(f"sim(run): the step's timeline has no measured op {op.name!r} #{k + 1}")
        return runs[k]

    return seconds_of


def by_kind(program: StepProgram, seconds_of: Callable[[Op], float]) -> dict[str, float]:
    """Seconds per op kind (KINDS) of one step of `program`, each op timed by `seconds_of`."""
    out = dict.fromkeys(KINDS, 0.0)
    for op in program.ops:
        kind = kind_of(op)
        if kind in out:
            out[kind] += seconds_of(op)
    return out


def cpu_s() -> float:
    """This process's CPU seconds (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


# =====================================================================================================
# default: the default job
# =====================================================================================================
def part_default(args: argparse.Namespace) -> None:
    out = Path(tempfile.mkdtemp(prefix="fidelity-"))
    job = load_job_config({"output_dir": str(out / "run"), "progress": False, "max_steps": args.steps + 1,
                           **dict(kv.split("=", 1) for kv in args.set)})
    job = replace(job, runtime=replace(job.runtime, dtype=resolve_dtype(job.runtime.dtype, emulated=True)))
    torch.manual_seed(job.runtime.seed)
    job, exact_match_file = with_math_dataset(job, None)  # dataset math: the default job's files
    data = load_data(job, exact_match_file=exact_match_file)
    model = build_model(job, model_source(job, data.vocab_size))
    planned = plan_run(job, model, "cpu", data.probe)
    plan, cost = planned.plan, planned.cost
    device = build_device(job, "cpu", planned.budgets["gpu_mem_cap_bytes"])
    probe_device = build_device(job, "cpu", None)  # as calibrated_cost: its links as the run's
    B, T = job.data.per_device_train_batch_size, job.data.cutoff_len
    try:
        executor = build_executor(model, planned.plan, planned.cost, device, job)
        fit_device_cap(job, plan, executor, device)
        (out / "run").mkdir(parents=True)
        trainer = Trainer(job=job, model=model, executor=executor, planned=planned, batches=data.batches,
                          eval_set=[], out=out / "run", tokenizer=data.tokenizer)
        trainer.metrics = MetricsLog(out / "run")
        keep_all = Plan.from_tiers(model, ["gpu"] * (model.config.num_hidden_layers + 1))
        twin = copy.deepcopy(model)  # the probe's own copy: the run's pending update reads the model's gradients
        probe = Executor(twin, keep_all, probe_device, compute_dtype=executor.compute_dtype)
        print(f"default job: {plan.placement_map()} K={plan.kept_layers}, batch {B} x {T}, "
              f"{job.optim.optimizer_mode} optimizer; predicted {planned.predicted_step_s(1):.3f} s/step; {load()}")
        runs: list[tuple[float, StepStats]] = []
        probes: list[StepStats] = []
        cpu: dict[str, list[float]] = {"run": [], "probe": []}  # process CPU seconds per step: what load moves least
        for step in range(args.steps + 1):  # step 0 warms up
            c0 = cpu_s()
            row = trainer.train_step(step)
            c1 = cpu_s()
            stats = executor.last_step
            probe.forward_backward(*data.probe)
            twin.zero_grad(set_to_none=True)
            if step:
                runs.append((float(row["step_s"]), stats))
                probes.append(probe.last_step)
                cpu["run"].append(c1 - c0)
                cpu["probe"].append(cpu_s() - c1)
        print(f"after the steps: {load()}")
    finally:
        device.close()
        probe_device.close()

    program = executor.program(B, T, masked=job.data.masked, updates=job.optim.optimizer_mode == "overlap")
    step_s = statistics.median(s for s, _ in runs)
    wall_s = statistics.median(st.wall_s for _, st in runs)
    replay_err = [st.wall_s / step_seconds(program, measured_seconds(program, st))[0] - 1 for _, st in runs]
    predicted = planned.predicted_step_s(1)
    print(f"\nmedian of {len(runs)} steps: measured step {step_s:.3f} s (executor {wall_s:.3f} s) vs predicted "
          f"{predicted:.3f} s: {step_s / predicted:.2f}x; sim(run) error median {statistics.median(replay_err):+.1%} "
          f"(range {min(replay_err):+.1%}..{max(replay_err):+.1%})")
    probe_wall = statistics.median(st.wall_s for st in probes)
    print(f"probe step (all gpu, uncapped, same rounds) {probe_wall:.3f} s; simulated on the calibration "
          f"{simulate(keep_all, cost, optimizer_mode='serial').forward_backward_s:.3f} s")
    cpu_ratio = [r / p for r, p in zip(cpu["run"], cpu["probe"], strict=True)]
    print(f"process CPU seconds per step: run {statistics.median(cpu['run']):.3f}, probe "
          f"{statistics.median(cpu['probe']):.3f}; run / probe per round {statistics.median(cpu_ratio):.2f} "
          f"({min(cpu_ratio):.2f}..{max(cpu_ratio):.2f})")

    run_kinds = [by_kind(program, measured_seconds(program, st)) for _, st in runs]
    model_kinds = by_kind(program, lambda op: op_seconds(op, cost))
    # the probe's compute ops, per layer, put in the run's program (its op kinds as the cost model's calibration
    # does: forward/recompute/keep from forward_s, backward from backward_s)
    probe_cost = [cost.with_times(forward_s=st.forward_s, backward_s=st.backward_s, head_s=st.head_s) for st in probes]
    probe_kinds = [by_kind(program, lambda op, c=c: op_seconds(op, c)) for c in probe_cost]
    print(f"\nseconds per step by op kind (medians over {len(runs)} rounds; probe: its compute seconds per layer in "
          "the run's program)")
    print(f"{'kind':<11} {'run':>8} {'probe':>8} {'model':>8} {'run/probe':>9} {'probe/model':>11}")
    for kind in KINDS:
        r = statistics.median(k[kind] for k in run_kinds)
        p = statistics.median(k[kind] for k in probe_kinds)
        m = model_kinds[kind]
        if r == 0 and m == 0:
            continue
        ratio = f"{r / p:9.2f}" if p > 0 and op_lane(kind) == "compute" else f"{'':>9}"
        print(f"{kind:<11} {r:8.3f} {p if op_lane(kind) == 'compute' else float('nan'):8.3f} {m:8.3f} {ratio} "
              + (f"{p / m:11.2f}" if m > 0 and op_lane(kind) == "compute" else ""))
    def per_layer_ms(rows: list[list[float]]) -> list[int]:
        return [round(statistics.median(col) * 1e3) for col in zip(*rows, strict=True)]

    print(f"forward ms per layer: probe {per_layer_ms([s.forward_s for s in probes])}, "
          f"run {per_layer_ms([s.forward_s for _, s in runs])}")
    print(f"backward ms per layer: probe {per_layer_ms([s.backward_s for s in probes])}, "
          f"run {per_layer_ms([s.backward_s for _, s in runs])}")
    print(f"model ms per layer: forward {[round(t * 1e3) for t in cost.forward_s]}, backward "
          f"{[round(t * 1e3) for t in cost.backward_s]}")
    print(f"{load()}; {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")


def op_lane(kind: str) -> str:
    return "compute" if kind in ("forward", "recompute", "keep", "head", "backward", "backprop") else kind


# =====================================================================================================
# why: the instances, scaled down
# =====================================================================================================
def llama(layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                        num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                        num_key_value_heads=hidden // 128, attn_implementation="sdpa"))


def part_why(args: argparse.Namespace) -> None:
    """The issue's instances scaled down (see the module docstring): MILP plans on this machine's calibration, run
    round-robin on the throttled emulated device (forward_backward; the serial optimizer is not run)."""
    L, B, T = 6, args.batch, args.seq
    model = llama(L, args.hidden, args.vocab)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (B, T), generator=g)
    base = CostModel(ModelSpec.from_config(model.config), HardwareSpec.profile(h2d_gbps=1.0, d2h_gbps=1.0,
                     nvme_read_gbps=1.0, nvme_write_gbps=1.0), Workload(B, T, "fp32"))
    keep_all = Plan.from_tiers(model, ["gpu"] * (L + 1))
    probe = Executor(model, keep_all, EmulatedDevice(), cost=base)

    def probe_step() -> StepStats:
        probe.forward_backward(ids, ids)
        model.zero_grad(set_to_none=True)
        return probe.last_step

    calibration = probe_steps(probe_step)  # as calibrated_cost takes them (runtime/calibrate.py)
    cost0 = calibrate(base, calibration)
    A = max(base.boundary_bytes)
    ffwd = statistics.median(cost0.forward_s)
    print(f"Llama {L} layers, hidden {args.hidden}, {base.spec.num_params / 1e6:.1f} M params, batch {B} x {T} fp32; "
          f"one boundary {A / 1e6:.2f} MB; layer forward {ffwd * 1e3:.0f} ms, backward "
          f"{statistics.median(cost0.backward_s) * 1e3:.0f} ms (calibrated); {load()}")
    static = simulate(Plan.from_tiers(model, ["gpu"] + ["recompute"] * (L - 1) + ["gpu"]), cost0,
                      optimizer_mode="serial").peak_bytes["gpu"]
    # link rates scaled so a boundary's transfer costs what it costs against a layer's forward on the 27B / H800
    # instance (a 1.2 GB boundary at 1.5 GB/s d2h is ~1 s against a ~0.3 s forward): slow links, ~3x a forward
    slow_gbps = A / (3 * ffwd) / 1e9
    instances = {  # name: (rates GB/s, budgets)
        # no host budget: what leaves the device goes to NVMe, whose read (half a forward) beats a recompute
        "nvme reloads, slow nvme": (dict(h2d_gbps=A / ffwd / 1e9 * 4, d2h_gbps=A / ffwd / 1e9 * 4,
                                         nvme_read_gbps=2 * A / ffwd / 1e9, nvme_write_gbps=2 * A / ffwd / 1e9),
                                    Budgets(gpu_mem_cap_bytes=static + 2 * A, cpu_act_bytes=0, nvme_act_bytes=4 * A)),
        "slow d2h": (dict(h2d_gbps=A / ffwd / 1e9 * 4, d2h_gbps=slow_gbps),
                     Budgets(gpu_mem_cap_bytes=static + 2 * A, cpu_act_bytes=None, nvme_act_bytes=0)),
        "tight cap": (dict(h2d_gbps=A / ffwd / 1e9 * 2, d2h_gbps=A / ffwd / 1e9 * 2),
                      Budgets(gpu_mem_cap_bytes=static, cpu_act_bytes=None, nvme_act_bytes=0)),
    }
    entries = {}
    for name, (rates, budgets) in instances.items():
        cost = calibrate(rebuilt(base, base.hardware.with_overrides(**rates)), calibration)
        plan = solve_milp(cost, budgets, time_limit_s=60, optimizer_mode="serial")
        device = EmulatedDevice(capacity_bytes=budgets.gpu_mem_cap_bytes, **rates)
        entries[name] = (plan, cost, Executor(model, plan, device, cost=cost), device)
    runs: dict[str, list[StepStats]] = {name: [] for name in entries}
    probe_rounds: list[StepStats] = []  # the calibration's keep-all probe again, in the same rounds as the runs
    for r in range(args.repeats + 1):  # round-robin, so every instance sees the same machine; round 0 warms up
        for name, ex in [*((name, entry[2]) for name, entry in entries.items()), ("probe", probe)]:
            ex.forward_backward(ids, ids)
            model.zero_grad(set_to_none=True)
            if r:
                (probe_rounds if name == "probe" else runs[name]).append(ex.last_step)
    print(f"\n{'instance':<24} {'plan':>9} {'K':>2} {'measured':>8} {'sim(cal)':>8} {'err':>6} {'sim(probe) err':>14} "
          f"{'sim(run) err':>12} {'range':>13} {'peak B':>10} {'sim peak B':>10} {'exposed ms (measured/sim)':>26}")
    for name, (plan, cost, ex, device) in entries.items():
        steps = runs[name]
        program = ex.program(B, T)
        wall = statistics.median(s.wall_s for s in steps)
        sim = simulate(plan, cost, optimizer_mode="serial")
        beside = simulate(plan, calibrate(rebuilt(base, cost.hardware), probe_rounds),
                          optimizer_mode="serial").forward_backward_s
        errors = [s.wall_s / step_seconds(program, measured_seconds(program, s))[0] - 1 for s in steps]
        peaks = {s.peak_device_bytes for s in steps}
        exposed = ", ".join(f"{lane} {statistics.median(s.stall_s[lane] for s in steps) * 1e3:.0f}/"
                            f"{sim.exposed_s[lane] * 1e3:.0f}" for lane in LINKS
                            if sim.exposed_s[lane] > 0 or statistics.median(s.stall_s[lane] for s in steps) > 1e-3)
        print(f"{name:<24} {plan.placement_map():>9} {plan.kept_layers:>2} {wall:8.3f} {sim.forward_backward_s:8.3f} "
              f"{wall / sim.forward_backward_s - 1:+6.1%} {wall / beside - 1:+14.1%} "
              f"{statistics.median(errors):+12.1%} "
              f"{min(errors):+6.1%}..{max(errors):+.1%} {'/'.join(map(str, sorted(peaks))):>10} "
              f"{sim.peak_bytes['gpu']:>10} {exposed or 'none':>26}")
        device.close()
    print("\nseconds per step by op kind, ms: measured (median of the rounds) / cost model (the calibration)")
    for name, (_, cost, ex, _) in entries.items():
        program = ex.program(B, T)
        measured = [by_kind(program, measured_seconds(program, s)) for s in runs[name]]
        modelled = by_kind(program, lambda op, cost=cost: op_seconds(op, cost))
        print(f"{name:<24} " + "  ".join(f"{k} {statistics.median(m[k] for m in measured) * 1e3:.0f}/"
                                         f"{modelled[k] * 1e3:.0f}" for k in KINDS if modelled[k] or measured[0][k]))
    print(f"{load()}; {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.repeats} rounds")


# =====================================================================================================
# links: the probe's link calibration (issue 26 item 14)
# =====================================================================================================
LINK_CASES = {  # name: (model, batch, seq, the config's rate GB/s, the device's rate GB/s or None = unthrottled)
    "unthrottled (config inf)": ("small", 2, 16, math.inf, None),
    "throttled 11 MB/s (config 1 GB/s)": ("debug", 4, 32, 1.0, 0.011),
}


def part_links(args: argparse.Namespace) -> None:
    """Each case `--repeats` times: the job calibrated as `lazytrain train` calibrates it (train/planning.py's
    measured_cost) on a device whose links are unthrottled or throttled at a rate the config does not state, then
    a plan with cpu and nvme tiers run on that device (`--steps` steps after a warm-up): its median step against
    the calibrated prediction and against the calibration with the configured link rates (as before item 14)."""
    from lazytrain.runtime import probe
    from lazytrain.train import planning

    print(f"{'case':<34} {'run':>3} {'measured':>8} {'predicted':>9} {'ratio':>6} {'at config':>9} {'ratio':>7}  "
          f"calibrated GB/s (h2d, d2h, nvme read, write)")
    build, take = planning.build_device, probe.probe_steps
    for name, (model_name, B, T, config_gbps, device_gbps) in LINK_CASES.items():
        rates = {f"{link}_gbps": device_gbps for link in LINKS}
        job = load_job_config({"model": model_name, "corpus": "zen", "batch_size": B, "seq_len": T, "dtype": "fp32",
                               "optimizer_mode": "serial", "eval_batches": 0, "progress": False,
                               **{f"{link}_gbps": config_gbps for link in LINKS}})
        data = load_data(job)
        model = build_model(job, model_source(job, data.vocab_size))
        L = model.config.num_hidden_layers
        plan = Plan.from_tiers(model, ["gpu"] + [("cpu", "nvme")[j % 2] for j in range(L - 1)] + ["gpu"])
        for run in range(args.repeats):
            probed: list[StepStats] = []
            planning.build_device = lambda job, kind, cap, rates=rates: EmulatedDevice(capacity_bytes=cap, **rates)
            probe.probe_steps = lambda step, probed=probed: probed.extend(take(step)) or probed
            try:
                cost = planning.measured_cost(job, model, "cpu", data.probe)
            finally:
                planning.build_device, probe.probe_steps = build, take
            configured = calibrate(rebuilt(cost, cost.hardware.with_overrides(
                **{f"{link}_gbps": config_gbps for link in LINKS})), probed)
            device = EmulatedDevice(**rates)
            executor = Executor(model, plan, device, cost=cost)
            walls = []
            for _ in range(args.steps + 1):
                executor.forward_backward(*data.probe)
                model.zero_grad(set_to_none=True)
                walls.append(executor.last_step.wall_s)
            device.close()
            measured = statistics.median(walls[1:])
            predicted = simulate(plan, cost, optimizer_mode="serial").forward_backward_s
            at_config = simulate(plan, configured, optimizer_mode="serial").forward_backward_s
            gbps = ", ".join(f"{getattr(cost.hardware, f'{link}_gbps'):.3g}" for link in LINKS)
            print(f"{name:<34} {run + 1:>3} {measured:8.3f} {predicted:9.3f} {measured / predicted:5.2f}x "
                  f"{at_config:9.3f} {measured / at_config:6.2f}x  {gbps}  ({load()})")
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"plans with cpu and nvme tiers alternating (the last {plan.placement_map()}); {args.steps} steps a run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["default", "why", "links"])
    parser.add_argument("--steps", type=int, default=12, help="default, links: measured steps (after one warm-up)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="default: job overrides")
    parser.add_argument("--repeats", type=int, default=5, help="why: measured rounds (after one warm-up); links: runs")
    parser.add_argument("--hidden", type=int, default=256, help="why: the Llama's hidden size")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    {"default": part_default, "why": part_why, "links": part_links}[args.part](args)


if __name__ == "__main__":
    main()
