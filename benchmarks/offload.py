"""optimizer_offload nvme measured on the emulated device with real files: a scaled-down Llama whose optimizer state
the staging slots cannot hold at once (D slots < L + 2 groups).

    python benchmarks/offload.py memory --nvme-dir /tmp             # the whole run's peak vs admission, 4 layouts
    python benchmarks/offload.py state-ops --runs 3 --nvme-dir /tmp # peak host RSS over the steps, state-op rates
    python benchmarks/offload.py step --runs 3 --nvme-dir /tmp      # lazytrain train: measured vs predicted step

memory: `lazytrain train` of a ~350 M-parameter Llama directory (bf16 safetensors in 3 shards, made once under
--model-dir) for --steps steps, with a final checkpoint, in four layouts: bf16 masters with the states in RAM,
bf16 masters with the states on NVMe, fp32 masters (bf16 compute) with states and masters on NVMe, and the first
under `torchrun --nproc_per_node 2` (the node's weights in shared memory, once). From the outside, a sampler sums
the proportional set size (Pss: a page shared by the ranks counts once in all) of the run's processes every
20 ms from start to exit (the torchrun launcher excluded); from the inside, summary.json's peak RSS (ru_maxrss and
VmRSS sampled by phase) and admitted bytes (the `host:` line; with ranks the node's). The peak less the
interpreter's fixed cost (the RSS when the run starts: python, torch, transformers imported, one per process)
against the admitted bytes plus the emulated device's peak (its memory is this process's heap on the CPU).

state-ops: a fresh process per run builds benchmarks/host.py's model (301.5 M parameters, 22 groups; fp32 masters,
random init), the executor (bf16 compute, every boundary on the device, links unthrottled so the NVMe lanes run
at the directory's own rate), NvmeStates and
8-bit AdamW as `lazytrain train` does, then runs `--steps` serial-mode steps (the updates after the backward, each
group's state read into one of `--depth` slots before its update, written back after, as the step program's ops)
while a thread samples VmRSS every 2 ms. The emulated device's memory is host memory too: each sample subtracts
what its arena counts then (a sample during which a device tensor was made or freed is dropped), and the child
runs with MALLOC_MMAP_THRESHOLD_=65536 so that freed blocks leave the RSS. Reported against
`CostModel.static_host_bytes(D)`, what `lazytrain plan` and `lazytrain train` admit by, above the RSS after
imports, as benchmarks/host.py reports the in-RAM layout: the peak with the device idle (outside the
forward-backward: the updates, the staging and the state ops included), over the steps (with autograd's
transients on the emulated device, which its arena does not count) and over the whole run (model built
included). The same steps time every state_read / state_write op (its bytes over its seconds on its lane),
against the raw sequential rate of the same directory measured in the same process (benchmarks/nvme.py's `Raw`,
one file of the largest group's size): all ops against the raw rate of their direction alone; apart, the ops that
had the disk to themselves (the other lane's ops beside them for at most a tenth of their seconds) against that,
and those that shared it with the other lane's op for more than half their seconds (a group's write beside the
next group's read: the program's two NVMe lanes) against the raw rate of a raw write and a raw read of another
file at once (this VM's disk wrote at 0.46-0.52x of its rate alone beside a read).

step: `lazytrain train` of the same shape saved as a config.json (init random, dataset zen, the MILP's plan and
staging depth under --cpu-mem), `--steps` steps, with optimizer_offload nvme and host; the summary's median step
(the first step excluded) against the prediction printed before the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

CONFIG = dict(model_type="llama", vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)

# memory: benchmarks/host.py's 301.5 M-parameter Llama (the in-RAM layout's measurement), so that the runtime's own
# bytes (torch's, the executor's buffers) weigh as much there as here
MEMORY_CONFIG = dict(CONFIG, vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                     num_attention_heads=16, num_key_value_heads=8)

MEMORY = textwrap.dedent("""
    import json, statistics, sys, threading, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[5])  # benchmarks/ (nvme.py's Raw)
    import torch, transformers
    from nvme import Raw
    from lazytrain import EmulatedDevice, Executor, Plan
    from lazytrain.config import load_job_config
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.costmodel.workload import Workload
    from lazytrain.runtime.files import bytes_view
    from lazytrain.runtime.store import aligned_empty
    from lazytrain.train.offload import NvmeStates
    from lazytrain.train.optimizer import build_optimizer, executor_param_groups, group_update

    config_values, depth, steps, nvme_dir = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    config = transformers.AutoConfig.for_model(**config_values)
    batch, seq = 1, 64
    job = load_job_config({"optimizer": "8bit", "master_weights": "fp32", "dtype": "bf16", "max_grad_norm": 1.0})
    device = EmulatedDevice(nvme_dir=nvme_dir)  # every link unthrottled: the state ops run at the disk's rate

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmRSS"].split()[0]) * 1024

    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)  # modeling code imported before the baseline
    base = status()
    peak = {"host": 0, "idle": 0}
    done, busy = False, True
    def sample():
        while not done:
            device_bytes = device.used_bytes
            rss = status()
            if device.used_bytes == device_bytes:  # no device tensor made or freed while reading the RSS
                peak["host"] = max(peak["host"], rss - base - device_bytes)
                if not busy:  # the device idle: what the arena does not count (autograd's transients) is gone
                    peak["idle"] = max(peak["idle"], rss - base - device_bytes)
            time.sleep(0.002)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    model.model.rotary_emb.__init__(config)
    model.config.use_cache = False
    L = config.num_hidden_layers
    cost = CostModel(ModelSpec.from_config(config), HardwareSpec.load("emulated"), Workload(batch, seq, "bf16"),
                     "8bit", master_weights="fp32", optimizer_offload="nvme")
    plan = Plan.from_tiers(model, ["gpu"] * (L + 1), staging_depth=depth)
    ex = Executor(model, plan, device, compute_dtype=torch.bfloat16, cost=cost)
    nvme = NvmeStates(nvme_dir, ex, group_bytes=cost.state_group_bytes())
    opt = build_optimizer(job, model, nvme)
    groups = executor_param_groups(opt, ex)
    nvme.bind(opt, groups, depth)
    ex.stage_states(nvme, nvme.state_bytes(), serial=True)
    built = peak["host"]
    peak["host"] = 0
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    times, ops = [], []
    group_bytes = nvme.state_bytes()  # executor group index = target + 1
    def timed(kind, real):  # each state op of the program: (kind, bytes, start, end) on its lane
        def op(index, *rest):
            t0 = time.perf_counter()
            real(index, *rest)
            if threading.current_thread().name.startswith("lazytrain-nvme") and group_bytes[index]:
                ops.append((kind, group_bytes[index], t0, time.perf_counter()))
        return op
    nvme.read, nvme.write = timed("state_read", nvme.read), timed("state_write", nvme.write)
    for _ in range(steps):
        t0 = time.perf_counter()
        busy = True
        ex.forward_backward(ids, ids)
        busy = False
        ex.run_updates(group_update(job, opt, ex, groups, ex.last_step.grad_norm, lr=1e-4, nvme=nvme))
        times.append(time.perf_counter() - t0)
    ex.drain()
    stepping, idle = peak["host"], peak["idle"]
    done = True
    thread.join()
    largest = max(nvme.state_bytes())
    buf = aligned_empty(largest, torch.uint8, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    buf.random_(0, 256)
    # each op's rate; apart, those alone on the disk (the other lane's ops beside them for at most a tenth of their
    # seconds) and those sharing it (for more than half)
    rates = {f"{kind}_{how}": [] for kind in ("state_read", "state_write") for how in ("all", "alone", "shared")}
    for kind, num_bytes, t0, t1 in ops:
        shared = sum(max(0.0, min(t1, b) - max(t0, a)) for k, _, a, b in ops if k != kind) / (t1 - t0)
        rates[f"{kind}_all"].append(num_bytes / (t1 - t0) / 1e9)
        if shared <= 0.1 or shared > 0.5:
            rates[f"{kind}_{'shared' if shared > 0.5 else 'alone'}"].append(num_bytes / (t1 - t0) / 1e9)
    # the raw rates: each direction alone, then a write and a read of another file at once (the two lanes' pattern)
    raw, other = Raw(Path(nvme_dir), largest), Raw(Path(nvme_dir), largest)
    back = aligned_empty(largest, torch.uint8, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    other.write(bytes_view(buf))  # (a read of blocks never written returns zeros without the disk)
    raw_times = {"write": [], "read": [], "mixed_write": [], "mixed_read": []}
    def write_timed():
        t0 = time.perf_counter()
        raw.write(bytes_view(buf))
        raw_times["mixed_write"].append(time.perf_counter() - t0)
    for _ in range(5):
        for op in ("write", "read"):
            t0 = time.perf_counter()
            getattr(raw, op)(bytes_view(buf))
            raw_times[op].append(time.perf_counter() - t0)
        writer = threading.Thread(target=write_timed)
        t0 = time.perf_counter()
        writer.start()
        other.read(bytes_view(back))
        raw_times["mixed_read"].append(time.perf_counter() - t0)
        writer.join()
    raw.close()
    other.close()
    nvme.close()
    print(json.dumps({
        "params": sum(p.numel() for p in model.parameters()), "admitted": cost.static_host_bytes(depth),
        "breakdown": cost.host_breakdown(depth), "peak_build": built, "peak_steps": stepping, "peak_idle": idle,
        "groups": len(groups), "file_bytes": nvme.file_bytes, "slot_bytes": nvme.slot_bytes, "step_s": times[1:],
        **{f"{k}_gbps": statistics.median(v) if v else None for k, v in rates.items()},
        **{f"{k}_ops": len(v) for k, v in rates.items()},
        **{f"raw_{k}_gbps": largest / statistics.median(v) / 1e9 for k, v in raw_times.items()}, "direct": raw.direct}))
""")


# memory: a ~350 M-parameter Llama (348.7 M: 24 layers of 11.8 M and untied 32.8 M embedding and head)
WHOLE_CONFIG = dict(MEMORY_CONFIG, num_hidden_layers=24)
LAYOUTS = {  # name: (the job's words, ranks)
    "bf16 masters, states in RAM": (["master_weights=bf16", "optimizer_offload=host"], 1),
    "bf16 masters, states on NVMe": (["master_weights=bf16", "optimizer_offload=nvme"], 1),
    "fp32 masters, states + masters on NVMe": (["master_weights=fp32", "optimizer_offload=nvme"], 1),
    "bf16 masters, states in RAM, torchrun 2 ranks": (["master_weights=bf16", "optimizer_offload=host"], 2),
}


def _model_dir(root: Path) -> Path:
    """The benchmark's model directory, made once (random bf16 weights, seeded, three shards)."""
    path = root / "llama-350m"
    if not (path / "model.safetensors.index.json").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**WHOLE_CONFIG), dtype=torch.bfloat16)
        model.save_pretrained(path, max_shard_size="300MB")
    return path


def _tree_pss(root_pid: int) -> int:
    """Bytes of Pss of `root_pid`'s descendants (not itself: torchrun's launcher, or the benchmark's shell)."""
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                        for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except OSError:
            continue
        todo += children
        for child in children:
            try:
                for line in Path(f"/proc/{child}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
    return total


def memory(args: argparse.Namespace) -> None:
    import threading

    root = Path(args.model_root or tempfile.gettempdir()) / "lazytrain-offload-bench"
    model = _model_dir(root)
    print(f"model {model} (348.7 M params, bf16); {args.steps} steps, batch 1 x 64, gpu_mem_cap {args.gpu_cap}, "
          "8-bit states, a final checkpoint")
    print("| layout | admitted | device peak | fixed cost | peak RSS (summary) | peak Pss (outside) | "
          "(peak - fixed) / (admitted + device) | phase of the peak |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (words, ranks) in LAYOUTS.items():
        if args.layouts and not any(key in name for key in args.layouts):
            continue
        out = root / f"out-{len(name)}-{ranks}"
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
                  if ranks > 1 else [sys.executable])
        command = [*launch, "-m", "lazytrain", "train", f"model={model}", "dataset=zen", "cutoff_len=64",
                   "per_device_train_batch_size=1", f"gpu_mem_cap={args.gpu_cap}", "dtype=bf16", "optimizer=8bit",
                   f"max_steps={args.steps}", "eval_batches=0", f"nvme_dir={args.nvme_dir}", "--no-progress",
                   f"output_dir={out}", "save_steps=0", "overwrite_output_dir=true", "plot_loss=false", *words]
        wrapper = subprocess.Popen(["/bin/sh", "-c", 'exec "$@"', "sh", *command], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        pss, done = [0], threading.Event()
        # the launcher (torchrun) is the wrapper's process itself: its children are the ranks
        thread = threading.Thread(target=_sample_pss, args=(wrapper.pid, ranks > 1, pss, done), daemon=True)
        thread.start()
        output, _ = wrapper.communicate()
        done.set()
        thread.join()
        if wrapper.returncode:
            sys.exit(f"{name}: lazytrain train failed: {output[-3000:]}")
        summaries = [json.loads(p.read_text()) for p in sorted(out.glob("**/summary.json"))]
        main = next(s for s in summaries if "node_host_admitted_bytes" in s or ranks == 1)
        admitted = main.get("node_host_admitted_bytes", main["host_admitted_bytes"])
        rows = [json.loads(line) for p in sorted(out.glob("**/metrics.jsonl")) for line in p.read_text().splitlines()]
        device = ranks * max(r.get("peak_device_bytes", 0) for r in rows)
        fixed = sum(s["baseline_rss_bytes"] for s in summaries)
        peak_rss = sum(s["peak_rss_bytes"] for s in summaries)  # (with ranks: the shared pages once per rank)
        mib = 2 ** 20
        print(f"| {name} | {admitted / mib:.0f} MiB | {device / mib:.0f} MiB | {fixed / mib:.0f} MiB | "
              f"{peak_rss / mib:.0f} MiB | {pss[0] / mib:.0f} MiB | "
              f"{(min(pss[0], peak_rss) - fixed) / (admitted + device):.3f}x (summary "
              f"{(peak_rss - fixed) / (admitted + device):.3f}x) | {main['peak_rss_phase']} |", flush=True)


def _sample_pss(pid: int, children: bool, peak: list[int], done: threading.Event) -> None:
    """peak[0]: the largest Pss of `pid` (or of its descendants), every 20 ms until `done`."""
    while not done.wait(0.02):
        peak[0] = max(peak[0], _tree_pss(pid) if children else _own_pss(pid))


def _own_pss(pid: int) -> int:
    try:
        return next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                    if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def state_ops(args: argparse.Namespace) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path]),
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for _ in range(args.runs):
        done = subprocess.run([sys.executable, "-c", MEMORY, json.dumps(MEMORY_CONFIG), str(args.depth),
                               str(args.steps), args.nvme_dir, str(Path(__file__).parent)], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the measuring process failed: {done.stderr.strip()[-2000:]}")
        out = done.stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    r = rows[0]
    n, admitted = r["params"], r["admitted"]
    med = {k: statistics.median(row[k] for row in rows if row[k] is not None)
           for k in rows[0] if k.endswith("_gbps") or k.startswith("peak_")}
    whole = max(med["peak_build"], med["peak_steps"])
    parts = ", ".join(f"{k} {v / n:.2f}" for k, v in r["breakdown"].items() if v)
    print(f"{n / 1e6:.1f} M params, {r['groups']} groups, {args.depth} slots of {r['slot_bytes'] / 2**20:.1f} MiB, "
          f"state files {r['file_bytes'] / 2**20:.0f} MiB on {args.nvme_dir} (O_DIRECT {r['direct']}); admitted "
          f"{admitted / 2**20:.0f} MiB = {admitted / n:.2f} B/param ({parts})")
    print(f"median of {len(rows)}: peak host RSS with the device idle {med['peak_idle'] / 2**20:.0f} MiB = "
          f"{med['peak_idle'] / admitted:.3f}x, over the steps {med['peak_steps'] / 2**20:.0f} MiB = "
          f"{med['peak_steps'] / admitted:.3f}x, over the whole run {whole / 2**20:.0f} MiB = {whole / admitted:.3f}x; "
          f"step {statistics.median(s for row in rows for s in row['step_s']):.2f} s")
    for how, raw_how, what in (("all", "", "all state ops against the raw rate alone"),
                               ("alone", "", "alone on the disk against the raw rate alone"),
                               ("shared", "mixed_", "beside the other lane's op against the raw rate beside a raw "
                                                    "op of the other direction")):
        line = []
        for kind in ("read", "write"):
            got, raw = med.get(f"state_{kind}_{how}_gbps"), med[f"raw_{raw_how}{kind}_gbps"]
            n_ops = sum(row[f"state_{kind}_{how}_ops"] for row in rows)
            line.append(f"{kind} {got:.2f} GB/s vs raw {raw:.2f} ({got / raw:.2f}x, {n_ops} ops)" if got else
                        f"{kind} no op")
        print(f"state ops, {what}: {', '.join(line)}")


def step(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    root = Path(tempfile.mkdtemp(prefix="lazytrain-offload-bench-"))
    AutoConfig.for_model(**CONFIG).save_pretrained(root / "model")
    for offload in ("nvme", "host"):
        ratios, measured, predicted, depth = [], [], [], None
        for run in range(args.runs):
            out = root / f"{offload}-{run}"
            words = [f"model={root / 'model'}", "init=random", "dataset=zen", "cutoff_len=64",
                     "per_device_train_batch_size=1", "gpu_mem_cap=160MiB", "dtype=bf16", "optimizer=8bit",
                     f"max_steps={args.steps}",
                     "eval_batches=0", f"optimizer_offload={offload}", f"nvme_dir={args.nvme_dir}", "--no-progress",
                     f"output_dir={out}", "save_steps=0", *args.extra]
            done = subprocess.run([sys.executable, "-m", "lazytrain", "train", *words], capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"lazytrain train failed: {done.stderr.strip()[-2000:]}")
            summary = json.loads((out / "summary.json").read_text())
            plan = json.loads((out / "plan.json").read_text())
            depth = plan.get("staging_depth", 0)
            measured.append(summary["median_step_s"])
            predicted.append(summary["predicted_step_s"])
            ratios.append(summary["median_step_s"] / summary["predicted_step_s"])
        print(f"{offload}: staging depth {depth}; median of {args.runs} runs: measured "
              f"{statistics.median(measured):.3f} s, predicted {statistics.median(predicted):.3f} s, "
              f"measured / predicted "
              f"{statistics.median(ratios):.3f} (runs {', '.join(f'{r:.3f}' for r in ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["memory", "state-ops", "step"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--depth", type=int, default=2, help="memory: staging slots")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir())
    parser.add_argument("--model-root", default=None, help="memory: where the model directory is made (once)")
    parser.add_argument("--gpu-cap", default="300MiB", help="memory: the emulated device's memory")
    parser.add_argument("--layouts", nargs="*", default=[], help="memory: only the layouts whose name holds one")
    parser.add_argument("extra", nargs="*", help="step: more key=value words for lazytrain train")
    args = parser.parse_intermixed_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    {"memory": memory, "state-ops": state_ops, "step": step}[args.what](args)


if __name__ == "__main__":
    main()
