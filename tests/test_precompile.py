"""The host kernels compiled by a child process (optim/precompile.py): the run loads them from numba's cache and does
not keep the compiler's memory."""

import os
import subprocess
import sys

import pytest

LOAD_ALL = """
from lazytrain.optim import bf16, precompile, quant
from lazytrain.runtime import nf4
from lazytrain.train.peak import rss_bytes
from lazytrain.train.trainer import KERNEL_MODULES
precompile.start(KERNEL_MODULES)
before = rss_bytes()
quant._kernels(); bf16._kernel(); nf4._kernel(bf16=True); nf4._kernel(bf16=False)
print(rss_bytes() - before)
"""


@pytest.mark.slow
def test_a_cold_cache_is_filled_by_the_child_and_the_run_only_loads(tmp_path):
    """With an empty cache, the child started with the trainer's KERNEL_MODULES fills it with every kernel: the
    kernels then cost the run what loading them costs (44 MiB measured), not what compiling them costs (~250 MiB
    that stay resident: tested against that, half way)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", LOAD_ALL], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    grown = int(done.stdout.split()[-1])
    assert grown < 125 << 20, grown
    indexes = sorted(p.name.split("-")[0] for p in tmp_path.rglob("*.nbi"))
    assert indexes == ["bf16._round_kernel", "nf4._nf4_kernel_bf16", "nf4._nf4_kernel_fp32",
                       "quant._adamw8bit_kernel", "quant._sq_sum_kernel"], indexes
