"""The run's output directory: checked before anything is written, owned by one run at a time, swept of what a dead
run left, and watched while the run writes into it.

One owner: the run holds `fcntl.flock` on `<output_dir>/.lazytrain.lock` (holding its pid) from the moment it
first writes there. The kernel drops the lock when the process ends, however it ends (kill -9 included), so a
lock is never stale; a second run on the same directory is refused in one line naming the holder's pid. With
data parallelism rank 0 holds it for every rank (the others write under `rank-<r>/`).

A run that takes the lock removes the temporary files a dead run left there (a `.tmp-checkpoint-<step>`, an
`.old-checkpoint-<step>`, `.<name>.<pid>.tmp`): no other run can be writing them (each data-parallel rank sweeps
its own `rank-<r>/`).

A directory deleted or replaced while the run writes into it is noticed at the next write (`RunDir.check`): the
run stops with one line instead of writing into a file nobody can see or a directory someone else made.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from datetime import UTC, datetime
from pathlib import Path

from lazytrain.errors import LazyTrainError
from lazytrain.writes import WRITE_ERRORS, WriteFailed, reason, remove

LOCK = ".lazytrain.lock"
PREFIX = "checkpoint-"  # checkpoint-<step>/
RUN_FILES = ("metrics.jsonl", "summary.json", "plan.json", "train_config.json", "loss.png", "step_trace_measured.json",
             "step_trace_predicted.json")
# a dead run's temporaries: checkpoints being written or replaced, files being written (`writes.temporary`),
# and the names older versions used
TEMPORARY = re.compile(r"\.tmp-checkpoint-\d+|\.old-checkpoint-\d+|\..+\.\d+\.tmp|\.write-test|step_trace_.*\.tmp")
CONTINUE = "free disk space (or fix the output_dir), then continue with resume_from_checkpoint=auto"


def default_output_dir() -> Path:
    """`runs/<UTC time>-<pid>`: runs started in the same second get their own directories."""
    return Path("runs") / f"{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def entries(out: Path) -> list[Path]:
    """What a directory holds besides its lock file."""
    return [p for p in out.iterdir() if p.name != LOCK]


def check_output_dir(output_dir: str | None, *, resume: bool, overwrite: bool, default: Path) -> Path:
    """The output directory, checked before anything is read, built or written: an existing non-empty one is
    refused unless the run resumes from it or `overwrite_output_dir` is set, and one that cannot be created or
    written is refused. An existing one is claimed here (`take`): a run going on there refuses this one now."""
    out = Path(output_dir) if output_dir else default
    if out.exists() and not out.is_dir():
        raise LazyTrainError(f"output_dir {out} is not a directory; pass a directory path")
    if out.is_dir() and entries(out) and not resume and not overwrite:
        raise LazyTrainError(f"output_dir {out} already exists and is not empty; set resume_from_checkpoint auto to "
                             "continue its run, overwrite_output_dir true to replace it, or pick a new output_dir")
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "Not a directory" if not existing.is_dir() else "Permission denied"
        raise LazyTrainError(f"output_dir {out} is not writable ({why}: {existing}); pass a writable output_dir")
    if out.is_dir():
        take(out)
    return out


class RunDir:
    """A claimed output directory: the lock's file descriptor and the directory's identity (device, inode)."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self.lock_fd = lock_fd
        st = os.stat(path)
        self.identity = (st.st_dev, st.st_ino)

    def gone(self) -> bool:
        """The directory was deleted or replaced since the claim."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    def check(self) -> None:
        """Before a write: the directory is still the one this run owns."""
        if self.gone():
            raise LazyTrainError(f"output_dir {self.path} was deleted or replaced while the run wrote into it; the "
                                 "run stopped (nothing more is written). Start the run again, or restore the "
                                 "directory and continue with resume_from_checkpoint=auto")

    def release(self) -> None:
        _claimed.pop(self.path.absolute(), None)
        try:
            os.close(self.lock_fd)  # the lock goes with the descriptor
        except OSError:
            pass


_claimed: dict[Path, RunDir] = {}  # this process's claims


def take(out: Path) -> RunDir:
    """Take the output directory (made when missing) for this run, or refuse in one line naming the run that holds
    it; then sweep a dead run's temporaries. Idempotent within a process."""
    key = out.absolute()
    held = _claimed.get(key)
    if held is not None and not held.gone():
        return held
    if held is not None:
        held.release()
    lock = out / LOCK
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except WRITE_ERRORS as err:
        raise LazyTrainError(f"output_dir {out} is not writable ({reason(err)}); pass a writable output_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _read_pid(fd)
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LazyTrainError(f"output_dir {out}: cannot lock {lock} ({reason(err)}); pick another output_dir"
                                 ) from None
        raise LazyTrainError(f"output_dir {out} is in use by another run (pid {holder or '?'} holds {lock}); wait "
                             "for it to end, or pick another output_dir") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as err:
        os.close(fd)
        raise WriteFailed(lock, reason(err), "free disk space and start the run again") from None
    run = _claimed[key] = RunDir(out, fd)
    sweep(out)
    return run


def sweep(out: Path) -> None:
    """Remove the temporaries a dead run left in `out` (the caller holds the lock; a data-parallel rank sweeps its
    own `rank-<r>/`, where the others may be writing already)."""
    for p in out.iterdir():
        if TEMPORARY.fullmatch(p.name):
            remove(p)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def make_output_dir(out: Path, *, overwrite: bool, resume: bool, claim: bool = True) -> None:
    """Claim the output directory (creating it) and, with `overwrite_output_dir`, remove the previous run's
    checkpoints and files first (so `auto` never picks a checkpoint of another run; links are unlinked, never
    followed); other files stay. A fresh run re-checks emptiness under the lock: another run may have started
    there since `check_output_dir`. `claim` False: a data-parallel rank's own `rank-<r>/` (rank 0 holds the
    lock of the whole directory)."""
    if not claim:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except WRITE_ERRORS as err:
            raise WriteFailed(out, reason(err), CONTINUE) from None
        sweep(out)
        return
    take(out)
    if overwrite:
        for old in entries(out):
            if old.name.startswith(PREFIX) or old.name in RUN_FILES:
                remove(old)
    elif not resume and [p for p in entries(out) if not re.fullmatch(r"rank-\d+", p.name)]:  # (this run's ranks')
        raise LazyTrainError(f"output_dir {out} already exists and is not empty; set resume_from_checkpoint auto to "
                             "continue its run, overwrite_output_dir true to replace it, or pick a new output_dir")


def release_all() -> None:
    """The end of a run (however it ended): its directory is free for the next one."""
    for run in list(_claimed.values()):
        run.release()


def check(out: Path) -> None:
    """Before a write into `out`: still the directory this process claimed (a no-op where it claimed none)."""
    run = _claimed.get(out.absolute())
    if run is not None:
        run.check()
