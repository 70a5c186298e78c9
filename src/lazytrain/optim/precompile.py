"""The host's compiled kernels, compiled by a child process into numba's disk cache.

A process that compiles numba code once keeps ~250 MiB of compiler state resident for good (Emerald Rapids: 306 ->
553 MiB for the 8-bit step's kernels, and `malloc_trim` gives back 33 MiB): on a small model more than the run's
whole admission, and nothing admission can count. So a run starts a child that compiles every kernel into numba's
cache and exits, its memory with it, while the run reads its data and loads its model; each kernel's factory waits
for the child and then loads the kernel from the cache (+44 MiB). Where the child fails or numba can write no cache,
the factory compiles the kernel in this process, as it would without the child.
"""

from __future__ import annotations

import atexit
import importlib
import subprocess
import sys
from collections.abc import Sequence
from types import ModuleType

CHILD_TIMEOUT_S = 600  # a cold compile of every kernel: ~20 s of one core
_child: subprocess.Popen | None = None
_started = False


def start(modules: Sequence[ModuleType]) -> None:
    """Start the child, which calls each of `modules`' `compile_kernels()` (once per process: after the first run,
    this process has its kernels)."""
    global _child, _started
    if _started:
        return
    _started = True
    names = [m.__name__ for m in modules]
    try:  # -P: the working directory is not put on the child's path (a user's folder is data, not imported)
        _child = subprocess.Popen([sys.executable, "-P", "-m", __name__, *names], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:  # no interpreter to start (an embedded one), no processes left: the factories compile here
        return
    atexit.register(_stop)


def wait() -> None:
    """Before a factory compiles or loads its kernel: let the child put it in the cache first."""
    global _child
    if _child is None:
        return
    try:
        _child.wait(CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _child.kill()
    _child = None


def _stop() -> None:
    """A run that ends before it needs the kernels does not leave the child compiling behind it."""
    if _child is not None and _child.poll() is None:
        _child.kill()


if __name__ == "__main__":
    for name in sys.argv[1:]:
        importlib.import_module(name).compile_kernels()
