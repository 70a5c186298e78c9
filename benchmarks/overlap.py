"""The overlapped-exact optimizer on the emulated device: how much of the serial optimizer step it hides, and
the simulator's prediction of the measured steps (run by hand; prints medians over side-by-side rounds).

    python benchmarks/overlap.py                      # ~1 minute on 2 cores
    python benchmarks/overlap.py --slow-ms 20 --rounds 9 --threads 1

The host optimizer is made slow relative to compute with a test knob: every group's update (torch's fused AdamW
on that group, as `optimizer_mode: overlap` runs it) sleeps `--slow-ms` first, so the update costs host time
without competing for the two cores (a sleeping update models a host optimizer on cores the compute does not
use; on this machine a real one would also slow the compute, which the simulator does not model). Serial: the
forward+backward, then every group's update, waited for. Overlap: the forward+backward whose optimizer lane
runs the previous step's updates in forward order, each fencing its group's weight h2d. Both models start from
the same weights; the last step's parameters are compared bit for bit. The simulator times the same plan with
the per-layer compute seconds the overlap rounds measured and the per-group update seconds the serial rounds
measured.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from executor import batch_of, build_model, replayed

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, ModelSpec, Plan, Workload
from lazytrain.plan.schedule import update_order
from lazytrain.plan.sim import simulate
from lazytrain.train.optimizer import step_param_groups

INF = float("inf")


def group_stepper(ex: Executor, slow_s: float, seconds: dict[int, list[float]]):
    """update(group): sleep slow_s, then fused AdamW on that executor group alone; its seconds recorded."""
    opt = torch.optim.AdamW([{"params": g} for g in ex.param_groups()], lr=1e-4, fused=True)

    def update(index: int) -> None:
        t0 = time.perf_counter()
        time.sleep(slow_s)
        with ex.group_grads(index):
            step_param_groups(opt, [index])
        for p in opt.param_groups[index]["params"]:
            p.grad = None
        seconds.setdefault(index, []).append(time.perf_counter() - t0)

    return update


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--slow-ms", type=float, default=15.0, help="sleep per group update (the slow host optimizer)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    serial_model = build_model(args.layers, args.hidden, args.vocab)
    overlap_model = copy.deepcopy(serial_model)
    ids, labels = batch_of(args.vocab, args.batch, args.seq)
    tiers = ["gpu"] * (args.layers + 1)
    serial_ex = Executor(serial_model, Plan.from_tiers(serial_model, tiers), EmulatedDevice())
    overlap_ex = Executor(overlap_model, Plan.from_tiers(overlap_model, tiers), EmulatedDevice())
    per_group: dict[int, list[float]] = {}
    serial_update = group_stepper(serial_ex, args.slow_ms / 1e3, per_group)
    overlap_update = group_stepper(overlap_ex, args.slow_ms / 1e3, {})
    order = [serial_ex.group_names().index("embedding" if t < 0 else "head" if t == args.layers else f"layer.{t}")
             for t in update_order(args.layers, serial_ex.parts.tied)]
    rows, stats = [], []
    for r in range(args.rounds + 1):  # round 0 warms up
        t0 = time.perf_counter()
        serial_ex.forward_backward(ids, labels)
        t1 = time.perf_counter()
        for index in order:
            serial_update(index)
        serial_s, serial_opt_s = time.perf_counter() - t0, time.perf_counter() - t1
        t0 = time.perf_counter()
        overlap_ex.forward_backward(ids, labels)  # runs the previous step's update on its optimizer lane
        overlap_ex.defer_update(overlap_update)
        overlap_s = time.perf_counter() - t0
        if r:
            rows.append((serial_s, serial_opt_s, overlap_s))
            stats.append(overlap_ex.last_step)
    overlap_ex.drain()
    same = all(torch.equal(a, b) for a, b in zip(serial_model.parameters(), overlap_model.parameters(), strict=True))

    med = statistics.median
    serial_s, serial_opt_s, overlap_s = (med(c) for c in zip(*rows, strict=True))
    hidden_wall = med((s - o) / opt for s, opt, o in rows)
    spec = ModelSpec.from_config(serial_model.config)
    base = CostModel(spec, HardwareSpec.load("emulated", h2d_gbps=INF, d2h_gbps=INF, nvme_read_gbps=INF,
                                             nvme_write_gbps=INF), Workload(args.batch, args.seq, "fp32"))
    plan = Plan.from_tiers(spec, tiers)
    errors, hidden_lane, updates_s = [], [], []
    for st in stats:  # each measured step replayed: its own compute seconds and its own update seconds
        update = {name.split(" ", 1)[1]: end - start for lane, name, start, end in st.timeline
                  if name.startswith("update ")}
        cost = replayed(base, st)
        cost.optimizer_s = [update[str(j)] for j in range(args.layers)]
        cost.head_optimizer_s = update[str(args.layers)]
        cost.embedding_optimizer_s = update.get("embedding", 0.0)
        errors.append(simulate(plan, cost, optimizer_mode="overlap").step_s / st.wall_s - 1)
        hidden_lane.append(1 - st.stall_s["optimizer"] / sum(update.values()))
        updates_s.append(sum(update.values()))
    print(f"model: llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq "
          f"{args.seq}, fp32, all-gpu plan, unthrottled links; update = {args.slow_ms:g} ms sleep + fused AdamW "
          f"per group; {args.rounds} rounds side by side (medians)")
    print(f"serial step {serial_s:.4f} s (optimizer {serial_opt_s * 1e3:.1f} ms), overlap step {overlap_s:.4f} s; "
          f"forward {med(sum(st.forward_s) for st in stats) * 1e3:.1f} ms, updates {med(updates_s) * 1e3:.1f} ms")
    print(f"hidden, wall clock: {100 * hidden_wall:.0f}% of the serial optimizer time (median of per-round "
          f"(serial - overlap) / serial optimizer; noisy on a shared machine)")
    print(f"hidden, optimizer lane: {100 * med(hidden_lane):.0f}% (1 - compute's wait on the lane / the updates' "
          f"seconds, per overlap step; min {100 * min(hidden_lane):.0f}%)")
    print(f"simulated / measured overlap step - 1 (each step replayed with its own measured times): median "
          f"{100 * med(errors):+.1f}%, range {100 * min(errors):+.1f}% .. {100 * max(errors):+.1f}%")
    print(f"parameters after {args.rounds + 1} steps bit-identical to serial: {same}")


if __name__ == "__main__":
    main()
