"""SIGINT and SIGTERM during a run: finish the current step, save a checkpoint, clean up, exit 130 / 143.

Before the loop (building, planning) a signal stops the run at once, as usual (there is nothing to save yet).
Inside the loop it is recorded and the loop stops after the step in flight (a second one during that step
stops it at once: the previous checkpoint is the last). During the final evaluation it is recorded, the
evaluation stops at its next batch, and the final checkpoint is saved.

A checkpoint being written is finished: a signal during a save is recorded (the run stops once it is in), a
second prints "saving ..., one more signal to abort", and a third abandons it -- cleanly, since the checkpoint is
written under a temporary name that is removed (the previous one stays intact). Removing it, and renaming a
finished one into place, are `critical()`: a signal then waits until they are done, so no `.tmp-checkpoint-*` and
no half-replaced checkpoint is ever left behind.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType

from lazytrain.errors import LazyTrainError

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
ABORT_AFTER = 3  # signals received while a checkpoint is written: the third abandons it


class Interrupted(LazyTrainError):
    """The run was stopped by a signal; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = EXIT_CODES.get(signal.Signals(signum), 128 + signum)


class StopSignals:
    """Context manager: while `deferred`, SIGINT/SIGTERM are recorded in `received` (the first) and `count`;
    otherwise they raise Interrupted at once. Inside `saving()` they are counted and the third raises; inside
    `critical()` they only are counted and act when it ends. The previous handlers come back on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.count = 0
        self.deferred = False
        self.save_depth = 0
        self.critical_depth = 0
        self.pending: int | None = None  # a signal that must act once the critical section ends
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        global _active
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)
        _active = self
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        global _active
        _active = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum
        name = signal.Signals(signum).name
        if self.save_depth and self.count < ABORT_AFTER:
            if self.count == ABORT_AFTER - 1:
                print(f"{name}: saving a checkpoint; one more signal to abort it (the previous one stays intact)",
                      file=sys.stderr, flush=True)
            return  # the save goes on; the run stops once it is in
        if self.deferred and self.count == 1 and not self.save_depth:
            return  # the loop stops after the step in flight
        if self.critical_depth:
            self.pending = signum
            return
        if self.save_depth:  # the save adds what it abandoned
            raise Interrupted(signum, f"{name} ({self.count} signals)")
        raise Interrupted(signum, f"{name}: stopped before a checkpoint could be completed")


_active: StopSignals | None = None  # the run's handler while it is installed


@contextmanager
def saving() -> Iterator[None]:
    """A checkpoint is being written: signals are counted, the third abandons it (a no-op outside a run)."""
    active = _active
    if active is None:
        yield
        return
    active.save_depth += 1
    try:
        yield
    finally:
        active.save_depth -= 1


@contextmanager
def critical() -> Iterator[None]:
    """A block no signal interrupts (removing a temporary checkpoint, renaming a finished one into place): a signal
    that would stop the run is held and acts when the block ends. A no-op outside a run's `StopSignals`."""
    active = _active
    if active is None:
        yield
        return
    active.critical_depth += 1
    try:
        yield
    finally:
        active.critical_depth -= 1
    if not active.critical_depth and active.pending is not None:
        signum, active.pending = active.pending, None
        raise Interrupted(signum, f"{signal.Signals(signum).name} ({active.count} signals)")
