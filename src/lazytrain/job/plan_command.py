"""`lazytrain plan`: solve the boundary placement for a job (model, machine, workload) and print it.

    lazytrain plan CONFIG.yaml [key=value ...] [--json plan.json] [--max-batch]
    lazytrain plan --model qwen3.6-27b --hardware h800 --batch-size 72 --seq-len 1024 \\
        --gpu-mem-cap 70GB --cpu-act-budget 15GB --nvme-act-budget 32GB [--rule megatrain --interval 4]

The job is the same JobConfig `lazytrain train` reads, with the same defaults (lazytrain/config/schema.py): with no
arguments it plans the default training job. Prints a one-row placement map (G gpu, C cpu, N nvme, R recompute
per boundary), counts per tier, the recomputed boundaries, the solver's status / time / gap, and the
simulator's prediction for the plan beside the MegaTrain rule. `time_limit_s` bounds the whole planning (model
and cost building included); `--json` is checked before any work.

    lazytrain plan CONFIG.yaml --world-size 16 --nodes 2

plans one rank of a data-parallel run (costmodel/topology.py): each rank gets 1/g of its node's NVMe rate and, unless
cpu_act_bytes is set, 1/g of the host room its node has left once the shared weights and optimizer are counted;
then the step with the gradients summed over the ranks, tokens/s of all ranks, PCIe bytes per rank and host bytes
per node.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from lazytrain.config import JobConfig, add_job_arguments, job_config_from_args
from lazytrain.errors import LazyTrainError
from lazytrain.job.batch import global_batch, largest_feasible_batch, resolve_batch
from lazytrain.job.inputs import adapter_states_in_ram, model_spec, rank_inputs, resolve_hardware
from lazytrain.jsonio import check_writable
from lazytrain.paths import ram_backed
from lazytrain.plan.admission import check_nvme_space, host_line, host_need, nvme_need, nvme_write_bytes, wear_line
from lazytrain.plan.milp import instance_from_cost, milp_step_s
from lazytrain.plan.planner import Deadline, make_plan
from lazytrain.plan.rank_plan import predict_ranks
from lazytrain.plan.rules import RULES, make_rule_plan
from lazytrain.plan.sim import SimResult, simulate
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.costmodel.topology import Topology
    from lazytrain.plan.admission import Admission
    from lazytrain.plan.plan import Plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    a = parser.add_argument_group("plan command").add_argument
    a("--json", metavar="PATH", help="write the plan file (Contract 1 in docs/architecture.md) here; the path is "
                                           "checked before solving")
    a("--max-batch", action="store_true", help="report the largest feasible batch for the MILP and each rule "
      "(per_device_train_batch_size: auto plans at the largest batch instead)")
    a("--timeline", metavar="PNG", help="draw the predicted step program, lane by lane, to this picture")
    a("--trace", metavar="JSON", help="write the predicted step program as Chrome-trace JSON (one track per lane; "
                                      "open in ui.perfetto.dev or chrome://tracing)")


def run(args: argparse.Namespace) -> int:
    notes: list[str] = []
    job = job_config_from_args(args, notes)
    for note in notes:  # the lines `lazytrain train` prints for the same keys
        print(f"note     {note}", flush=True)
    if job.plan.plan_file is not None:
        raise LazyTrainError("plan_file (--plan) names a plan for `lazytrain train` to run; `lazytrain plan` makes "
                             "one: drop it, or use --json to write the new plan")
    for flag, path in (("--json", args.json), ("--trace", args.trace), ("--timeline", args.timeline)):
        if path:
            check_writable(path, flag)
    job, note = adapter_states_in_ram(job)
    if note:
        print(note)
    with Deadline(job.plan.time_limit_s) as deadline:  # from here on, planning counts against the limit
        spec = model_spec(job.model.model)
        hardware = resolve_hardware(job.runtime)
        if args.max_batch:
            _print_max_batch(job, spec, hardware, deadline)
            return 0
        job, note = resolve_batch(job, deadline=deadline)
        if note:
            print(note)
        topology, cost, admission, budgets = rank_inputs(job, spec, hardware, job.data.per_device_train_batch_size)
        if job.runtime.nvme_dir is not None and Path(job.runtime.nvme_dir).is_dir():  # its SSD is here: must fit
            check_nvme_space(cost, budgets.nvme_act_bytes, job.runtime.nvme_dir)  # (else: planned for elsewhere)
        plan = make_plan(job.plan, cost, budgets, deadline=deadline, optimizer_mode=job.optim.optimizer_mode,
                         topology=topology)
        in_ram = _in_ram(job, spec, hardware, deadline) if cost.optimizer_offload == "nvme" else None
    own, milp_s = _print_plan(job, cost, admission, plan, topology)
    _print_wear(job, cost, plan, own.step_s)
    if in_ram is not None:
        _print_offload(job, cost, plan, own, in_ram)
    if topology.parallel:
        _print_ranks(job, cost, plan, topology)
    if args.json:
        plan.with_prediction(replace(own.to_prediction(), milp_step_s=milp_s)).save(args.json)
        print(f"plan written to {args.json}")
    if args.trace:
        from lazytrain.viz import write_trace

        print(f"trace written to {write_trace(own.events, args.trace, process=f'{cost.spec.name} predicted step')}")
    if args.timeline:
        from lazytrain.viz import plot_timeline

        print(f"timeline written to {plot_timeline(own, args.timeline)}")
    return 0


def _print_max_batch(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, deadline: Deadline) -> None:
    """The largest batch per rank for the MILP and each rule, with the global batch it gives."""
    world = job.parallel.world_size
    ranks = f", {world} ranks on {job.parallel.nodes} node(s): per rank" if world > 1 else ""
    print(f"largest feasible batch: model {spec.name}, hardware {hardware.name}, seq {job.data.cutoff_len}, "
          f"optimizer {job.optim.optimizer}{ranks}")
    milp, why = largest_feasible_batch(job, spec, hardware, "milp", deadline=deadline)
    if milp == 0:  # the MILP fits whenever a rule does: nothing fits
        raise LazyTrainError(f"no batch fits, not even 1: {why}")
    sizes = {"milp": milp}
    for rule in RULES:
        name = f"megatrain K={job.plan.interval}" if rule == "megatrain" else rule
        sizes[name] = largest_feasible_batch(job, spec, hardware, rule, deadline=deadline)[0]
    for name, batch in sizes.items():
        total = global_batch(job, batch)
        print(f"  {name:<16} {batch}" + (f"   global batch {total}" if total != str(batch) else ""))


# ---- the optimizer's state on NVMe ----------------------------------------------------------------------
IN_RAM_HOST_BYTES = 1 << 40  # the host memory the in-RAM comparison assumes at least (1 TiB)


def _in_ram(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, deadline: Deadline
            ) -> tuple[SimResult, Plan, int, int | None]:
    """The same job with the optimizer's state in RAM and at least IN_RAM_HOST_BYTES of host memory: its
    prediction, plan, host need, and the host limit it would have had (None: not checked)."""
    ram = replace(job, runtime=replace(job.runtime, optimizer_offload="host"))
    limit = job.plan.cpu_mem_bytes if job.plan.cpu_mem_bytes is not None else hardware.host_mem_bytes
    big = replace(ram, plan=replace(ram.plan, cpu_mem_bytes=max(limit or 0, IN_RAM_HOST_BYTES)))
    topology, cost, _, budgets = rank_inputs(big, spec, hardware, job.data.per_device_train_batch_size)
    plan = make_plan(big.plan, cost, budgets, deadline=deadline, optimizer_mode=job.optim.optimizer_mode,
                     topology=topology)
    return simulate(plan, cost, optimizer_mode=job.optim.optimizer_mode, topology=topology), plan, \
        host_need(cost)[0], limit


def _print_wear(job: JobConfig, cost: CostModel, plan: Plan, step_s: float) -> None:
    """What the run writes to nvme_dir per step and per day (and the days to the drive's rating), and a note when
    nvme_dir is in RAM, as `lazytrain train` says them."""
    line = wear_line(nvme_write_bytes(cost, plan.boundaries("nvme"), job.optim.gradient_accumulation_steps),
                     step_s, job.runtime.nvme_tbw)
    if line is None:
        return
    print(line)
    if job.runtime.nvme_dir is not None and (kind := ram_backed(job.runtime.nvme_dir)) is not None:
        print(f"note     nvme_dir {job.runtime.nvme_dir} is on {kind}, which is RAM: what the run writes there is "
              "host memory; set nvme_dir to a directory on an SSD")


def _print_offload(job: JobConfig, cost: CostModel, plan: Plan, own: SimResult,
                   in_ram: tuple[SimResult, Plan, int, int | None]) -> None:
    """Where the optimizer's state lives, bytes per parameter on each side, the step beside the same job's with the
    state in RAM, and whether offload is what makes the job fit."""
    n, D = cost.spec.num_params, plan.staging_depth
    ram, ram_plan, ram_need, limit = in_ram
    host = host_need(cost, D)[0]
    files = sum(1 for b in cost.state_group_bytes() if b)
    where = job.runtime.nvme_dir or "nvme_dir (a temporary directory)"
    masters = " and fp32 masters (but the embedding's)" if cost.masters_offloaded else ""
    print(f"optimizer state on nvme: {cost.optimizer} states{masters}, {format_bytes(cost.nvme_state_bytes())} in "
          f"{files} files under {where}; staged through {D} host slot(s) of {format_bytes(cost.staging_slot_bytes)}")
    need, detail = nvme_need(cost, plan.budgets_bytes.get("nvme_act_bytes"))
    checked = job.runtime.nvme_dir is not None and Path(job.runtime.nvme_dir).is_dir()
    print(f"  nvme: needs {format_bytes(need)} ({detail}); " + (
        f"{job.runtime.nvme_dir} has room" if checked else
        "`lazytrain train` checks its nvme_dir's free space before it writes anything"))
    steps = plan.report.options.get("staging_steps", [])
    if len(steps) > 1:
        print("  staging depth: " + ", ".join(f"{d} slot(s) {s:.3f} s" for d, s in steps) + f"; planned with {D}")
    staging = cost.host_breakdown(D)["staging"]
    print(f"  bytes per parameter: host {(host - staging) / n:.2f} + staging {staging / n:.2f} = {host / n:.2f}, "
          f"nvme {sum(cost.state_group_bytes()) / n:.2f} (with the state in RAM: host {ram_need / n:.2f})")
    fits = limit is None or ram_need <= limit
    why = ("offload is not needed to fit: with the state in RAM it needs " + format_bytes(ram_need)
           + (f" of {format_bytes(limit)}" if limit is not None else "")) if fits else (
        f"offload is what makes this job fit: with the state in RAM it needs {format_bytes(ram_need)} of host "
        f"memory, {format_bytes(limit)} here")
    print(f"  step: {own.step_s:.3f} s with the state on nvme vs {ram.step_s:.3f} s in RAM with "
          f"{format_bytes(max(limit or 0, IN_RAM_HOST_BYTES))} of host memory ({own.step_s / ram.step_s:.3f}x; "
          f"{ram_plan.counts()['cpu']} cpu boundaries there, {plan.counts()['cpu']} here); {why}")


# ---- data parallelism -----------------------------------------------------------------------------------
def _print_ranks(job: JobConfig, cost: CostModel, plan: Plan, topology: Topology) -> None:
    """The step of one rank with the sums over the ranks, and what each rank and each node holds."""
    hw, g = cost.hardware, topology.local_ranks
    p = predict_ranks(plan, cost, topology, optimizer_mode=job.optim.optimizer_mode)
    where = "a reduce to the owner in the node" + (", an all-reduce among the nodes' owners" if topology.nodes > 1
                                                   else "")
    print(f"data parallel: {topology.world_size} ranks on {topology.nodes} node(s), {g} per node; gradients summed "
          f"on the host after the d2h ({where}, fp32); links {hw.intra_node_gbps:g} GB/s in a node, "
          f"{hw.inter_node_gbps:g} GB/s between nodes")
    print(f"  step {p.step.step_s:.3f} s (this rank alone {p.alone.step_s:.3f} s), the sums {p.reduce_s:.3f} s on the "
          f"optimizer lane (exposed with it: {p.step.exposed_s['optimizer']:.3f} s); "
          f"{p.tokens_per_s:,.0f} tok/s over {topology.world_size} ranks "
          f"({p.tokens_per_s / p.alone.tokens_per_s:.2f}x one rank alone)")
    print(f"  per rank and step: PCIe h2d {format_bytes(p.step.link_bytes['h2d'])}, "
          f"d2h {format_bytes(p.step.link_bytes['d2h'])}; the sums move {format_bytes(p.intra_node_bytes)} in the "
          f"node, {format_bytes(p.inter_node_bytes)} across nodes; device peak "
          f"{format_bytes(p.step.peak_bytes['gpu'])}")
    limit = hw.host_mem_bytes if job.plan.cpu_mem_bytes is None else job.plan.cpu_mem_bytes
    over = f" of {format_bytes(limit)}" + ("  OVER THE NODE'S HOST MEMORY" if p.host["node"] > limit else "") \
        if limit is not None else ""
    shared = f"shared {format_bytes(p.host['shared'])} (weights once, optimizer states sharded over the ranks)"
    print(f"  host per node {format_bytes(p.host['node'])}{over} = {shared} + {g} x "
          f"{format_bytes(p.host['per_rank'])} per rank (gradients, offloaded activations)")


# ---- output -------------------------------------------------------------------------------------------
def _ranges(boundaries: list[int]) -> str:
    if not boundaries:
        return "none"
    parts, start = [], boundaries[0]
    for prev, cur in zip(boundaries, [*boundaries[1:], None], strict=True):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def _prediction_rows(job: JobConfig, cost: CostModel, plan: Plan, topology: Topology
                     ) -> tuple[list[tuple[str, str, SimResult]], SimResult]:
    mode, interval = job.optim.optimizer_mode, job.plan.interval
    own = simulate(plan, cost, optimizer_mode=mode, topology=topology)
    name = plan.report.planner + (f" K={plan.report.options.get('interval')}" if plan.report.planner == "megatrain"
                                  else "")
    # serial vs overlapped-exact (both clip), the plan's and MegaTrain's rule's, like for like
    rows = [(name, mode, own)] + [(name, other, simulate(plan, cost, optimizer_mode=other, topology=topology))
                                  for other in ("overlap", "serial") if other != mode]
    rule = make_rule_plan("megatrain", cost.spec, interval=interval, workload=cost.workload)
    rule = replace(rule, optimizer_offload=plan.optimizer_offload, staging_depth=plan.staging_depth)
    if plan.tiers != rule.tiers:
        rows += [(f"megatrain K={interval}", other, simulate(rule, cost, optimizer_mode=other, topology=topology))
                 for other in ("overlap", "serial")]
    return rows, own


def _print_trainable(cost: CostModel, host_bytes: int) -> None:
    """What a frozen base changes: the trainable share, the host bytes per base parameter, and the backward without
    the base's weight gradients (no GEMMs for them, no d2h, no host update)."""
    spec, t = cost.spec, cost.trainable
    what = f"LoRA rank {t.rank} on {','.join(t.targets)}" if t.kind == "lora" else f"freeze ({t.layers} layers)"
    adapters = sum(cost.adapter_params)
    base = spec.num_params
    sent = sum(cost.grad_bytes) + cost.head_grad_bytes + cost.embedding_grad_bytes
    full_sent = sum(cost.param_bytes) + cost.head_param_bytes + spec.embedding_params * cost.dtype_bytes
    quantized = sum(cost.quantized_params)
    frozen = (f"frozen: the layers' linears NF4 {sum(cost.quantized_bytes) / quantized:.3f} B, the rest "
              f"{cost.dtype_bytes} B" if quantized else f"frozen: {cost.dtype_bytes} B")
    print(f"trainable: {what}: {cost.trainable_params / 1e6:.1f} M of {(base + adapters) / 1e9:.2f} B params "
          f"({cost.trainable_params / (base + adapters):.2%}); host {host_bytes / base:.2f} B per base parameter "
          f"({frozen}, no master, gradient or state)")
    print(f"  backward: {sum(cost.backward_s) / sum(cost.forward_s):.2f} x forward (full training 3.00: no weight "
          f"gradient of a frozen weight); gradients d2h {format_bytes(sent)} per step (full "
          f"{format_bytes(full_sent)}); host update {cost.total_optimizer_s:.3f} s")
    if quantized:
        print(f"  dequantization: {sum(cost.dequant_s):.3f} s a pass over the NF4 linears on the device "
              f"({cost.dequant_bytes_per_weight} B per weight at {cost.hardware.mem_gbps:g} GB/s), 3 passes a "
              "micro-batch (forward, re-forward, backward; 2 for a kept layer)")


def _print_plan(job: JobConfig, cost: CostModel, admission: Admission, plan: Plan, topology: Topology
                ) -> tuple[SimResult, float | None]:
    spec, hw, wl = cost.spec, cost.hardware, cost.workload
    print(f"model {spec.name} ({spec.num_layers} layers, {spec.num_params / 1e9:.2f} B params), hardware {hw.name}, "
          f"batch {wl.batch_size} x seq {wl.seq_len} ({wl.dtype}"
          f"{'; masks of padded or packed batches counted' if wl.masked else ''}), optimizer {job.optim.optimizer}")
    # `lazytrain train` prints the same line, against the memory available when it starts
    print(host_line(cost, plan.staging_depth, admission.host_limit_bytes, "no --cpu-mem"))
    if not cost.trainable.full:
        _print_trainable(cost, host_need(cost, plan.staging_depth)[0])
    cpu_act = plan.budgets_bytes.get("cpu_act_bytes", admission.cpu_act_bytes)  # a plan's staging takes its share
    cpu = "unlimited" if cpu_act is None else format_bytes(cpu_act)
    nvme = "unlimited" if admission.nvme_act_bytes is None else format_bytes(admission.nvme_act_bytes)
    print(f"budgets: gpu cap {format_bytes(admission.gpu_mem_cap_bytes)} = static "
          f"{format_bytes(cost.static_device_bytes())} + activations {format_bytes(admission.gpu_act_bytes)}; "
          f"cpu act {cpu}; nvme act {nvme}; boundary {format_bytes(max(cost.boundary_bytes))}")
    print(f"placement (boundaries 0..{plan.num_layers}; G gpu, C cpu, N nvme, R recompute, K gpu and its layer's "
          "graph kept):")
    print(plan.placement_map())
    counts = plan.counts()
    print("counts: " + ", ".join(f"{tier} {n}" for tier, n in counts.items()))
    if plan.kept_layers:
        L, K = plan.num_layers, plan.kept_layers
        kept_bytes = sum(cost.graph_bytes[j] + cost.param_bytes[j] for j in range(L - K, L))
        print(f"kept layers: {K} ({L - K}..{L - 1}): graphs and weights {format_bytes(kept_bytes)} on the device "
              "from their forward to their backward (no re-forward, no second weight h2d)")
    print(f"recomputed boundaries: {_ranges(plan.boundaries('recompute'))}")
    r = plan.report
    if r.planner == "milp":
        print(f"solver: {r.solver} {r.status} in {r.seconds:.2f} s, gap {r.gap:.2g}, "
              f"objective {r.objective:.3f} s ({r.num_variables} variables, {r.num_constraints} constraints, "
              f"max segment {r.options['max_segment']})")
    else:
        print(f"rule: {r.planner}{' K=' + str(r.options['interval']) if 'interval' in r.options else ''}, "
              f"MILP objective of its tiers {r.objective:.3f} s")
    rows, own = _prediction_rows(job, cost, plan, topology)
    if r.planner == "milp" and r.options.get("optimizer_mode") == job.optim.optimizer_mode:
        milp_s = r.options["step_s"]  # the solve's own: a second MILP build would run past --time-limit
    else:
        milp_s = milp_step_s(plan.tiers, instance_from_cost(cost, admission, optimizer_mode=job.optim.optimizer_mode,
                                                            topology=topology, staging_depth=plan.staging_depth),
                             plan.kept_layers)
    if milp_s is None:
        print(f"step: simulated {own.step_s:.3f} s (the MILP does not place the last segment's start on nvme)")
    else:
        print(f"step: MILP {milp_s:.3f} s, simulated {own.step_s:.3f} s "
              f"({100 * (milp_s - own.step_s) / own.step_s:+.2f}%)")
    print("prediction (simulator" + (f", one rank of {topology.world_size}, the sums over the ranks in its step):"
                                     if topology.parallel else "):"))
    print(f"  {'plan':<16} {'optimizer':<9} {'step s':>8} {'TFLOPS':>7} {'tok/s':>8} {'peak gpu':>10}  exposed")
    for name, mode, res in rows:
        exposed = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in res.exposed_s.items() if v > 5e-4) or "none"
        over = "  OVER THE GPU CAP" if res.peak_bytes["gpu"] > admission.gpu_mem_cap_bytes else ""
        print(f"  {name:<16} {mode:<9} {res.step_s:>8.3f} {res.tflops:>7.1f} {res.tokens_per_s:>8.0f} "
              f"{format_bytes(res.peak_bytes['gpu']):>10}  {exposed}{over}")
    return own, milp_s
