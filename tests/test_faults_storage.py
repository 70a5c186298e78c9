"""Storage failure paths: NVMe spill files and plan files under a full disk, a read-only directory, deletion
mid-run, SIGKILL and SIGTERM. Each is a one-line error (exit 2 from the CLI) or cannot happen, and nothing is
left behind.

A full or read-only disk is a real tmpfs mounted for the test where root may mount one; elsewhere a patched
write (ENOSPC) and a directory without write permission stand in.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checks import mount_tmpfs, one_line

import lazytrain.runtime.store as store_module
from lazytrain.cli import main
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan
from lazytrain.runtime.device import EmulatedDevice, check_nvme_dir
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.store import ActivationStore, clean_stale_spill_files

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_batch, make_model  # noqa: E402

MIX_NVME = ["gpu", "nvme", "recompute", "cpu", "nvme", "nvme", "gpu"]  # 6 layers


def _unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture
def full_disk(tmp_path, monkeypatch) -> Iterator[Path]:
    """A directory on a 64 KiB file system (a real tmpfs, or a patched pwrite that fails past 64 KiB)."""
    path = tmp_path / "small"
    if mount_tmpfs(path, "size=64k"):
        yield path
        _unmount(path)
        return
    real = os.pwrite

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if offset + len(data) > 64 * 1024:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(store_module.os, "pwrite", pwrite)
    yield path


@pytest.fixture
def read_only_dir(tmp_path) -> Iterator[Path]:
    """A read-only directory: a tmpfs mounted ro where root may, else one without write permission."""
    path = tmp_path / "ro"
    if mount_tmpfs(path, "ro,size=64k"):
        yield path
        _unmount(path)
        return
    path.chmod(0o500)
    yield path
    path.chmod(0o700)


def _free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _open_spill_files(pid: int, directory: Path) -> list[str]:
    """Descriptors of process `pid` open on files in `directory` (nameless spill files show as 'dir/#ino (deleted)'
    or 'dir/name (deleted)')."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory.resolve()) + "/"):
            links.append(target)
    return links


# ---- a full disk -----------------------------------------------------------------------------------
def test_a_full_disk_while_spilling_is_one_line_and_leaves_no_partial_file(full_disk):
    store = ActivationStore(full_disk, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    free = _free_bytes(full_disk)
    store.write(0, torch.randn(1024))  # 4 KiB fits
    with pytest.raises(LazyTrainError) as err:
        store.write(1, torch.randn(64 * 1024))  # 256 KiB does not
    one_line(str(err.value), "No space left on device")
    assert 1 not in store._files and list(full_disk.iterdir()) == []
    store.end_step()
    assert _free_bytes(full_disk) == free  # the partial file's blocks are back


def test_a_disk_filled_by_someone_else_mid_step_fails_the_step_cleanly(full_disk, monkeypatch):
    """The free-space check passed, then the disk filled up: the step fails in one line and the next step runs."""
    import lazytrain.runtime.executor as executor_module

    model = make_model("llama")
    ids, labels = make_batch(3, 11)
    ex = Executor(model, Plan.from_tiers(model, MIX_NVME), EmulatedDevice(nvme_dir=full_disk))
    monkeypatch.setattr(executor_module, "check_nvme_space", lambda path, need: None)
    filler = full_disk / "filler"
    with open(filler, "wb") as f:  # leave less than one boundary (3 x 11 x 32 fp32 = 4224 bytes)
        try:
            f.write(b"\0" * (_free_bytes(full_disk) - 2048 if os.path.ismount(full_disk) else 62 * 1024))
        except OSError:
            pass
    if not os.path.ismount(full_disk):  # patched pwrite: the spill offsets stay small, so shrink the limit
        monkeypatch.setattr(store_module.os, "pwrite", lambda fd, data, offset: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(LazyTrainError, match="No space left on device") as err:
        ex.forward_backward(ids, labels)
    one_line(str(err.value))
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"] and ex.device.used_bytes == 0
    filler.unlink()
    monkeypatch.undo()
    ex.forward_backward(ids, labels)  # nothing of the failed step is in the way


# ---- read-only directories --------------------------------------------------------------------------
def test_a_read_only_nvme_dir_is_one_line(read_only_dir, tmp_path, capsys):
    with pytest.raises(LazyTrainError, match="is not writable") as err:
        check_nvme_dir(read_only_dir)
    one_line(str(err.value))
    out = tmp_path / "run"
    assert main(["train", "--model", "debug", "--corpus", "zen", "--batch-size", "2", "--seq-len", "16", "--steps",
                 "1", "--eval-batches", "0", "--no-progress", "--device", "cpu", "--nvme-dir", str(read_only_dir),
                 "--output-dir", str(out)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: NVMe directory") and stderr.count("\n") == 1, stderr
    assert not (out / "metrics.jsonl").exists()


def test_plan_save_into_a_read_only_dir_is_one_line_and_leaves_nothing(read_only_dir):
    model = make_model("llama")
    plan = Plan.from_tiers(model, MIX_NVME)
    with pytest.raises(LazyTrainError, match=r"cannot write .*plan\.json \(") as err:
        plan.save(read_only_dir / "plan.json")
    one_line(str(err.value))
    assert list(read_only_dir.iterdir()) == []


def test_plan_save_on_a_full_disk_keeps_the_previous_file_and_no_tmp(tmp_path, monkeypatch):
    model = make_model("llama")
    path = tmp_path / "plan.json"
    Plan.from_tiers(model, ["gpu"] * 7).save(path)
    before = path.read_text()

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(LazyTrainError, match="No space left on device"):
        Plan.from_tiers(model, MIX_NVME).save(path)
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    monkeypatch.undo()
    Plan.from_tiers(model, MIX_NVME).save(path)
    assert Plan.load(path).tiers == tuple(MIX_NVME)


def test_plan_cli_json_on_a_full_disk_is_one_line(full_disk, capsys):
    if not os.path.ismount(full_disk):
        pytest.skip("needs a real small file system")
    (full_disk / "filler").write_bytes(b"\0" * (_free_bytes(full_disk)))
    target = full_disk / "plan.json"
    assert main(["plan", "--model", "tiny-llama", "--hardware", "emulated", "--batch-size", "2", "--seq-len", "32",
                 "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write ") and "plan.json (" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


# ---- deletion mid-run: spill files have no name ------------------------------------------------------
def test_emptying_the_nvme_dir_mid_step_changes_nothing(tmp_path, monkeypatch):
    model = make_model("qwen2")
    ids, labels = make_batch(3, 11)
    reference = Executor(model, Plan.from_tiers(model, ["gpu"] * 7), EmulatedDevice())
    ref_loss = reference.forward_backward(ids, labels)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    ex = Executor(model, Plan.from_tiers(model, MIX_NVME), EmulatedDevice(nvme_dir=tmp_path))
    real_read = ActivationStore.read
    seen = []

    def read_after_rm(self, boundary, host):  # `rm -f nvme_dir/*` just before every reload
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        for p in tmp_path.iterdir():
            p.unlink()
        return real_read(self, boundary, host)

    monkeypatch.setattr(ActivationStore, "read", read_after_rm)
    loss = ex.forward_backward(ids, labels)
    assert len(seen) == 3 and all(names == [] for names in seen)  # three nvme boundaries, never a name to delete
    assert ex.last_step.peak_nvme_bytes == 3 * 3 * 11 * 32 * 4
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


# ---- SIGKILL and SIGTERM with spill files open ---------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from tiny_models import make_batch, make_model
    from lazytrain import EmulatedDevice, Executor, Plan
    model = make_model("llama")
    ids, labels = make_batch(3, 11)
    device = EmulatedDevice(nvme_dir={nvme!r}, nvme_read_gbps=1e-6)  # reloads crawl: files stay open
    Executor(model, Plan.from_tiers(model, {tiers!r}), device).forward_backward(ids, labels)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_spill_file_outlives_a_killed_run(tmp_path, sig):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    script = CHILD.format(tests=str(Path(__file__).parent), nvme=str(nvme), tiers=MIX_NVME)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240  # importing torch on a loaded machine takes a while
        while len(_open_spill_files(child.pid, nvme)) < 3:  # every nvme boundary spilled, none read back yet
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never spilled"
            time.sleep(0.05)
        assert all("(deleted)" in link for link in _open_spill_files(child.pid, nvme))
        assert list(nvme.iterdir()) == []  # open, yet nameless
        child.send_signal(sig)
        assert child.wait(timeout=30) == -sig
    finally:
        child.kill()
        child.wait()
    assert list(nvme.iterdir()) == []
    check_nvme_dir(nvme)  # the next run in that directory starts clean


def test_stale_named_spill_files_of_dead_processes_are_removed_at_start(tmp_path):
    """Named spill files (the fallback where O_TMPFILE is missing, and older LazyTrain versions) carry their pid."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f"lazytrain-{dead.pid}-1a2b-boundary3.bin", tmp_path / f"lazytrain-{dead.pid}-9f.spill"]
    alive = tmp_path / f"lazytrain-{os.getpid()}-77.spill"
    other = tmp_path / "lazytrain-notes.txt"
    for path in [*stale, alive, other]:
        path.write_bytes(b"x")
    check_nvme_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])
    assert clean_stale_spill_files(tmp_path) == []


def test_the_named_fallback_is_unlinked_at_once(tmp_path, monkeypatch):
    """Where the file system lacks O_TMPFILE, the spill file is created with its pid in the name and unlinked."""
    real_open = os.open

    def no_tmpfile(path, flags, mode=0o777):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, flags, mode)

    monkeypatch.setattr(store_module.os, "open", no_tmpfile)
    store = ActivationStore(tmp_path, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    x = torch.randn(5, 7)
    store.write(2, x)
    assert list(tmp_path.iterdir()) == []
    assert f"lazytrain-{os.getpid()}-" in os.readlink(f"/proc/self/fd/{store.fileno(2)}")
    back = torch.empty_like(x)
    store.read(2, back)
    assert torch.equal(back, x)
    store.end_step()


def test_default_spill_dirs_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """The default nvme_dir carries the pid: a run killed with SIGKILL leaves it, the next device removes it."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"lazytrain-nvme-{dead.pid}-x1y2"
    live = tmp_path / f"lazytrain-nvme-{os.getppid()}-abcd"
    for path in (stale, live):
        path.mkdir()
        (path / "leftover").write_bytes(b"x")
    device = EmulatedDevice()
    assert device.nvme_dir.parent == tmp_path and device.nvme_dir.name.startswith(f"lazytrain-nvme-{os.getpid()}-")
    assert not stale.exists() and live.exists()
    device.close()
