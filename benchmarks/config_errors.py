"""Wall time of `lazytrain --help`, `lazytrain train --help`, `lazytrain plan --help` and of a config error.

    python benchmarks/config_errors.py              # 5 runs of each, medians
    python benchmarks/config_errors.py --runs 11 --src /path/to/other/checkout/src   # another tree, same machine

Each run is a fresh `python -m lazytrain ...` process (interpreter start-up included, as a user sees it). The
config error is issue 25's: a LLaMA-Factory-style YAML with three unknown keys and one value of the wrong type
(four `error:` lines, exit 2); a run that does not exit 2 with four lines is reported as a failure. Prints the
CPU, the load average before and after, and per command the median, min and max seconds and whether torch was
imported (`python -X importtime`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

YAML = """\
model_name_or_path: tiny-qwen2
stage: sft
do_train: true
finetuning_type: full
max_samples: 10
lora_rnk_typo: 8
warmup_stepz: 3
use_fancy_kernel: true
learning_rate: fast
"""


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time(argv: list[str], env: dict[str, str], runs: int, expect_errors: int | None) -> tuple[list[float], bool]:
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "lazytrain", *argv], capture_output=True, text=True, env=env)
        seconds.append(time.perf_counter() - t0)
        if expect_errors is None:
            ok = done.returncode == 0
        else:
            ok = done.returncode == 2 and sum(line.startswith("error: ") for line in done.stderr.splitlines()) \
                == expect_errors
        if not ok:
            raise SystemExit(f"{argv}: exit {done.returncode}\n{done.stderr[-2000:]}")
    heavy = subprocess.run([sys.executable, "-X", "importtime", "-m", "lazytrain", *argv], capture_output=True,
                           text=True, env=env).stderr
    torch_imported = any(line.rstrip().endswith("| torch") for line in heavy.splitlines())
    return seconds, torch_imported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--src", default=str(Path(__file__).parent.parent / "src"),
                        help="the lazytrain source tree to time (default: this checkout's)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": args.src}
    print(f"cpu {_cpu()}; python {platform.python_version()}; src {args.src}; runs {args.runs}")
    print(f"load before {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "lf.yaml"
        config.write_text(YAML)
        cases = [("lazytrain --help", ["--help"], None), ("lazytrain train --help", ["train", "--help"], None),
                 ("lazytrain plan --help", ["plan", "--help"], None),
                 ("lazytrain train lf.yaml (4 errors)", ["train", str(config), f"output_dir={tmp}/out"], 4)]
        print(f"{'command':<36} {'median s':>9} {'min s':>7} {'max s':>7}  torch imported")
        for name, argv, errors in cases:
            seconds, torch_imported = _time(argv, env, args.runs, errors)
            print(f"{name:<36} {statistics.median(seconds):9.3f} {min(seconds):7.3f} {max(seconds):7.3f}  "
                  f"{'yes' if torch_imported else 'no'}")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
