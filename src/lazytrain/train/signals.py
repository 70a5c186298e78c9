"""SIGINT and SIGTERM during a run: finish the current step, save a checkpoint, clean up, exit 130 / 143.

Before the loop (building, planning) a signal stops the run at once, as usual (there is nothing to save yet);
inside the loop it is recorded and the loop stops after the step in flight. A second signal while the
checkpoint is being written stops that too: the checkpoint is written under a temporary name, so the previous
one stays intact.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType

from lazytrain.errors import LazyTrainError

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(LazyTrainError):
    """The run was stopped by a signal; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = EXIT_CODES.get(signal.Signals(signum), 128 + signum)


class StopSignals:
    """Context manager: while `deferred`, SIGINT/SIGTERM are recorded in `received`; otherwise they raise
    Interrupted at once. The previous handlers come back on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.deferred = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.deferred and self.received is None:
            self.received = signum  # the loop stops after the step in flight
            return
        name = signal.Signals(signum).name
        raise Interrupted(signum, f"{name}: stopped before a checkpoint could be completed")
