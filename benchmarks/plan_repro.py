"""Plan reproducibility: run the default job's planning path (what `lazytrain train` does up to its `plan` line:
data, model, calibration on the emulated device, MILP) N times, each in a fresh process, and count distinct plans.

    python benchmarks/plan_repro.py --runs 10                   # the default job
    python benchmarks/plan_repro.py --runs 10 model=debug       # key=value overrides of the job

Each run prints its plan, the predicted step, and the calibrated figures that feed the MILP (summed forward and
backward seconds, head, optimizer rate), so the spread of the calibration run to run is visible beside the plans.
LAZYTRAIN_CACHE is honoured (the default job's model directory and the remembered plans live there).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time


def once(overrides: list[str]) -> dict[str, object]:
    from dataclasses import replace

    from lazytrain.config import load_job_config
    from lazytrain.costmodel.hardware import resolve_dtype
    from lazytrain.job.batch import resolve_batch
    from lazytrain.job.resolve import with_math_dataset
    from lazytrain.train.build import build_model, model_source
    from lazytrain.train.planning import plan_run
    from lazytrain.train.run_data import load_data

    job = load_job_config(overrides=overrides)
    job = replace(job, runtime=replace(job.runtime, dtype=resolve_dtype(job.runtime.dtype, emulated=True)))
    job, _ = resolve_batch(job)
    job, _ = with_math_dataset(job, None)  # dataset math: the default job's files
    data = load_data(job)
    model = build_model(job, model_source(job, data.vocab_size))
    planned = plan_run(job, model, "cpu", data.probe)
    cost = planned.cost
    return dict(plan=planned.plan.placement_map(), how=planned.how, step_s=planned.sim.step_s,
                forward_s=sum(cost.forward_s), backward_s=sum(cost.backward_s), head_s=cost.head_s,
                host_mem_gbps=cost.hardware.host_mem_gbps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--once", action="store_true", help="one run in this process, JSON on stdout")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the job")
    args = parser.parse_args()
    if args.once:
        print(json.dumps(once(args.overrides)))
        return
    plans: collections.Counter[str] = collections.Counter()
    for i in range(args.runs):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--once", *args.overrides], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"run {i}: exit {out.returncode}\n{out.stderr[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        plans[r["plan"]] += 1
        print(f"run {i + 1:2d}  {r['plan']}  predicted {r['step_s']:.3f} s  fwd {r['forward_s']:.4f} s  "
              f"bwd {r['backward_s']:.4f} s  head {r['head_s']:.4f} s  host {r['host_mem_gbps']:.3g} "
              f"GB/s  ({r['how']}; {time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{args.runs} runs -> {len(plans)} distinct plans: "
          + ", ".join(f"{p} x{n}" for p, n in plans.most_common()))


if __name__ == "__main__":
    main()
