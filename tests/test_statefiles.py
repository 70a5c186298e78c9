"""The optimizer state files (runtime/statefiles.py): random bytes round-trip through the worker threads, alignment
edge cases, the page-cache fallback where O_DIRECT is refused, one-line errors (full, read-only, I/O error), and the
checkpoint copies (safetensors files that `safetensors` itself reads back)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checks import mount_tmpfs, one_line
from safetensors.torch import load_file, save_file

import lazytrain.runtime.files as files_module
from lazytrain.errors import LazyTrainError
from lazytrain.runtime.files import ALIGN_BYTES
from lazytrain.runtime.statefiles import GroupLayout, StateFiles
from lazytrain.runtime.store import aligned_empty


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _random_tensors(gen: torch.Generator, prefix: str, numels: list[int]) -> dict[str, torch.Tensor]:
    """Fresh random tensors of several dtypes (the optimizer's: fp32 moments and absmax, uint8 codes, bf16)."""
    out = {}
    for k, n in enumerate(numels):
        out[f"{prefix}{k}.exp_avg"] = torch.randn(n, generator=gen)
        out[f"{prefix}{k}.qm"] = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        out[f"{prefix}{k}.absmax_m"] = torch.rand(-(-n // 256), generator=gen)
        out[f"{prefix}{k}.master"] = torch.randn(n, generator=gen).bfloat16().view(n, 1)
    return out


def _buffer(layout: GroupLayout) -> torch.Tensor:
    return aligned_empty(layout.padded_data_bytes, torch.uint8, _empty)


def _dir_entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# ---- round trips --------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_bytes", [ALIGN_BYTES, 3 * ALIGN_BYTES, 1 << 20])
def test_random_bytes_round_trip_through_several_groups_in_flight(tmp_path, block_bytes):
    gen = torch.Generator().manual_seed(block_bytes)
    sizes = torch.randint(1, 40_000, (4, 3), generator=gen).tolist()
    groups = {f"layer{j}": _random_tensors(gen, f"{j}.", sizes[j]) for j in range(4)}
    layouts = {g: GroupLayout.of(ts) for g, ts in groups.items()}
    with StateFiles(tmp_path, layouts, queue_depth=3, block_bytes=block_bytes) as files:
        assert files.direct  # ext4 / tmpfs on a recent kernel take O_DIRECT
        for g, ts in groups.items():
            views = layouts[g].views(files.staging(g))
            for name, t in ts.items():
                views[name].copy_(t)
        writes = [files.write(g, files.staging(g)) for g in groups]  # all in flight at once
        for event in reversed(writes):
            event.wait()
        back = {g: _buffer(layouts[g]) for g in groups}
        reads = {g: files.read(g, back[g]) for g in groups}
        for g, ts in groups.items():
            reads[g].wait()
            views = layouts[g].views(back[g])
            for name, t in ts.items():
                assert torch.equal(views[name], t), (g, name)
        assert _dir_entries(tmp_path) == []  # nameless files


def test_alignment_edge_cases(tmp_path):
    cases = {
        "one_byte": GroupLayout([("0.qm", torch.uint8, (1,))]),
        "exact_page": GroupLayout([("0.exp_avg", torch.float32, (1024,))]),  # 4096 bytes of data
        "page_plus_one": GroupLayout([("0.exp_avg", torch.float32, (1024,)), ("0.qm", torch.uint8, (1,))]),
        "empty_tensor": GroupLayout([("0.qm", torch.uint8, (0,)), ("1.qm", torch.uint8, (5,))]),
        # a header past one page: the data starts on a later page
        "long_header": GroupLayout([(f"{i}.exp_avg_sq", torch.float32, (3,)) for i in range(100)]),
        # odd sizes of a small dtype first in the caller's order: stored after the wider ones
        "mixed_order": GroupLayout([("0.qm", torch.uint8, (3,)), ("0.exp_avg", torch.float32, (5,)),
                                    ("0.master", torch.bfloat16, (7,)), ("1.qv", torch.uint8, (9,))]),
    }
    assert cases["exact_page"].padded_data_bytes == ALIGN_BYTES
    assert cases["page_plus_one"].padded_data_bytes == 2 * ALIGN_BYTES
    assert cases["long_header"].data_offset >= 2 * ALIGN_BYTES
    gen = torch.Generator().manual_seed(1)
    with StateFiles(tmp_path, cases, block_bytes=ALIGN_BYTES) as files:
        for g, layout in cases.items():
            assert layout.data_offset % ALIGN_BYTES == 0 and layout.file_bytes % ALIGN_BYTES == 0
            buf = files.staging(g)
            assert buf.data_ptr() % ALIGN_BYTES == 0
            buf.random_(0, 256, generator=gen)
            views = layout.views(buf)
            for name, v in views.items():
                assert v.data_ptr() % v.element_size() == 0, (g, name)
            files.write(g, buf).wait()
            back = _buffer(layout)
            files.read(g, back).wait()
            assert torch.equal(back[:layout.data_bytes], buf[:layout.data_bytes]), g
        layout = cases["page_plus_one"]
        misaligned = aligned_empty(layout.padded_data_bytes + 64, torch.uint8, _empty)[64:]
        with pytest.raises(ValueError, match="boundary"):
            files.write("page_plus_one", misaligned)
        with pytest.raises(ValueError, match="bytes"):
            files.read("page_plus_one", _buffer(layout)[:ALIGN_BYTES])
    with pytest.raises(ValueError, match="unique"):
        GroupLayout([("a", torch.uint8, (1,)), ("a", torch.uint8, (2,))])


# ---- without O_DIRECT or O_TMPFILE ----------------------------------------------------------------------
def _round_trip(files: StateFiles, group: str, gen: torch.Generator) -> None:
    layout = files.layouts[group]
    buf = files.staging(group)
    buf.random_(0, 256, generator=gen)
    files.write(group, buf).wait()
    back = _buffer(layout)
    files.read(group, back).wait()
    assert torch.equal(back, buf)


def test_a_file_system_refusing_o_direct_at_open_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def open_(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(files_module.os, "open", open_)
    layouts = {"g": GroupLayout([("0.exp_avg", torch.float32, (50_000,))])}
    with StateFiles(tmp_path, layouts, block_bytes=8 * ALIGN_BYTES) as files:
        assert not files.direct
        _round_trip(files, "g", torch.Generator().manual_seed(2))


def test_o_direct_refused_at_the_first_io_falls_back_for_every_file(tmp_path, monkeypatch):
    import fcntl

    real_pwrite, real_preadv = os.pwrite, os.preadv

    def refuse_direct(fd: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(files_module.os, "pwrite", lambda fd, b, off: refuse_direct(fd) or real_pwrite(fd, b, off))
    monkeypatch.setattr(files_module.os, "preadv", lambda fd, b, off: refuse_direct(fd) or real_preadv(fd, b, off))
    layouts = {f"g{i}": GroupLayout([("0.qv", torch.uint8, (30_000 + i,))]) for i in range(3)}
    notes: list[str] = []
    dropped: list[tuple[int, int]] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append((offset, length))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(files_module.os, "posix_fadvise", fadvise)
    with StateFiles(tmp_path, layouts, block_bytes=ALIGN_BYTES, note=notes.append) as files:
        assert not files.direct  # the header write at creation found out
        gen = torch.Generator().manual_seed(3)
        for g in layouts:
            dropped.clear()
            _round_trip(files, g, gen)  # one write and one read of the group's data
            blocks = files.layouts[g].padded_data_bytes // ALIGN_BYTES
            assert len(dropped) == 2 * blocks, (len(dropped), blocks)  # reads leave no cached copy either
    assert len(notes) == 1 and "O_DIRECT" in notes[0] and str(tmp_path) in notes[0], notes  # said once, not per file


def _inode(fd: int) -> tuple[int, int] | None:
    """The file behind descriptor `fd`, or None when it is closed (a closed number may already name another file
    that a thread of this process opened: compare the files, not the numbers)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def test_close_surfaces_the_error_of_an_op_nobody_waited_for(tmp_path, monkeypatch):
    """A write-back that failed and was never waited for is lost data: close() says so (one line), after closing
    every file; an error already raised at wait() is not raised twice."""
    layouts = {"g": GroupLayout([("0.exp_avg", torch.float32, (40_000,))]), "h": GroupLayout([("0.qm", torch.uint8,
                                                                                                (9_000,))])}
    real = os.pwrite
    failing: list[int] = []  # the descriptor whose writes fail

    def pwrite(fd, data, offset):
        if fd in failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data, offset)

    monkeypatch.setattr(files_module.os, "pwrite", pwrite)
    files = StateFiles(tmp_path, layouts, block_bytes=ALIGN_BYTES)
    failing[:] = [files._fds["g"]]
    waited = files.write("h", files.staging("h"))
    files.write("g", files.staging("g"))  # fails, never waited for
    waited.wait()
    fds = {fd: _inode(fd) for fd in files._fds.values()}
    with pytest.raises(LazyTrainError, match="I/O error") as err:
        files.close()
    assert "\n" not in str(err.value) and "write an optimizer state file" in str(err.value)
    assert all(_inode(fd) != inode for fd, inode in fds.items())  # every state file closed
    failing.clear()
    files = StateFiles(tmp_path, layouts, block_bytes=ALIGN_BYTES)
    failing[:] = [files._fds["g"]]
    event = files.write("g", files.staging("g"))
    with pytest.raises(LazyTrainError):
        event.wait()
    files.close()  # already said at wait


def test_a_state_file_truncated_under_the_run_is_named_as_such(tmp_path):
    layouts = {"layer3": GroupLayout([("0.exp_avg", torch.float32, (40_000,))])}
    with StateFiles(tmp_path, layouts, block_bytes=ALIGN_BYTES) as files:
        buf = files.staging("layer3")
        files.write("layer3", buf).wait()
        os.truncate(f"/proc/self/fd/{files._fds['layer3']}", ALIGN_BYTES * 3)  # another process, through /proc
        with pytest.raises(LazyTrainError) as err:
            files.read("layer3", buf).wait()
    text = str(err.value)
    assert "\n" not in text and "layer3" in text and "truncated" in text and "I/O error" not in text, text


def test_without_o_tmpfile_a_named_file_is_unlinked_at_once(tmp_path, monkeypatch):
    real_open = os.open

    def open_(path, flags, mode=0o777, **kw):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(files_module.os, "open", open_)
    with StateFiles(tmp_path, {"g": GroupLayout([("0.qm", torch.uint8, (10_000,))])}) as files:
        assert _dir_entries(tmp_path) == []
        _round_trip(files, "g", torch.Generator().manual_seed(4))


# ---- errors -----------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    path = tmp_path / "small"
    if not mount_tmpfs(path, "size=256k"):
        pytest.skip("needs root to mount a small tmpfs")
    yield path
    subprocess.run(["umount", str(path)], capture_output=True)


def test_too_little_room_is_refused_before_anything_is_written(small_disk):
    layouts = {f"layer{j}": GroupLayout([("0.exp_avg", torch.float32, (100_000,))]) for j in range(3)}
    with pytest.raises(LazyTrainError) as err:
        StateFiles(small_disk, layouts)
    msg = str(err.value)
    assert "\n" not in msg and str(small_disk) in msg and "need" in msg and "nvme_dir" in msg, msg
    assert _dir_entries(small_disk) == []


def test_a_disk_filled_between_the_check_and_the_files_is_one_line_and_leaves_nothing(small_disk, monkeypatch):
    import lazytrain.runtime.statefiles as statefiles_module

    layouts = {f"layer{j}": GroupLayout([("0.exp_avg", torch.float32, (30_000,))]) for j in range(3)}  # 3 x 124 KiB
    real = statefiles_module.shutil.disk_usage
    monkeypatch.setattr(statefiles_module.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))
    free = os.statvfs(small_disk).f_bavail
    with pytest.raises(LazyTrainError) as err:
        StateFiles(small_disk, layouts)
    msg = str(err.value)
    assert "\n" not in msg and "No space left on device" in msg and str(small_disk) in msg, msg
    assert _dir_entries(small_disk) == [] and os.statvfs(small_disk).f_bavail == free  # the blocks are back


def test_a_read_only_directory_is_one_line(tmp_path):
    path = tmp_path / "ro"
    if mount_tmpfs(path, "ro,size=64k"):
        try:
            with pytest.raises(LazyTrainError) as err:
                StateFiles(path, {"g": GroupLayout([("0.qm", torch.uint8, (10,))])})
        finally:
            subprocess.run(["umount", str(path)], capture_output=True)
        one_line(str(err.value), "read-only")
    else:
        path.chmod(0o500)
        with pytest.raises(LazyTrainError, match="nvme_dir"):
            StateFiles(path, {"g": GroupLayout([("0.qm", torch.uint8, (10,))])})
    with pytest.raises(LazyTrainError, match="does not exist"):
        StateFiles(tmp_path / "nope", {"g": GroupLayout([("0.qm", torch.uint8, (10,))])})


@pytest.mark.parametrize(("call", "code", "words"), [("pwrite", errno.ENOSPC, "No space left on device"),
                                                     ("pwrite", errno.EIO, "I/O error"),
                                                     ("preadv", errno.EIO, "I/O error")])
def test_errors_on_the_worker_threads_surface_at_wait_as_one_line(tmp_path, monkeypatch, call, code, words):
    layouts = {"g": GroupLayout([("0.exp_avg", torch.float32, (40_000,))])}
    with StateFiles(tmp_path, layouts, block_bytes=ALIGN_BYTES) as files:
        buf = files.staging("g")
        real = getattr(os, call)
        calls = []

        def failing(fd, data, offset):
            calls.append(offset)
            if len(calls) == 5:  # one block of many
                raise OSError(code, os.strerror(code))
            return real(fd, data, offset)

        monkeypatch.setattr(files_module.os, call, failing)
        event = files.write("g", buf) if call == "pwrite" else files.read("g", buf)
        with pytest.raises(LazyTrainError) as err:
            event.wait()
        msg = str(err.value)
        assert "\n" not in msg and words in msg and str(tmp_path) in msg and "nvme_dir" in msg, msg
        assert event.done()  # every block finished before wait raised: none still writes the buffer
        monkeypatch.undo()
        files.write("g", buf).wait()  # the next op works


# ---- checkpoints ----------------------------------------------------------------------------------------
def test_save_and_load_safetensors_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(5)
    tensors = _random_tensors(gen, "", [5000, 333, 70_001])
    layout = GroupLayout.of(tensors)
    state_dir, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    state_dir.mkdir()
    ckpt.mkdir()
    with StateFiles(state_dir, {"layer3": layout}) as files:
        views = layout.views(files.staging("layer3"))
        for name, t in tensors.items():
            views[name].copy_(t)
        files.write("layer3", files.staging("layer3"))  # not waited for: save waits for the group's ops
        size = files.save_safetensors("layer3", ckpt / "layer3.safetensors")
        assert size == layout.safetensors_bytes == (ckpt / "layer3.safetensors").stat().st_size
        loaded = load_file(ckpt / "layer3.safetensors")
        assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())
        states = [n for n in tensors if not n.endswith(".master")]
        files.save_safetensors("layer3", ckpt / "states.safetensors", names=states)
        part = load_file(ckpt / "states.safetensors")
        assert sorted(part) == sorted(states) and all(torch.equal(part[k], tensors[k]) for k in states)
    with StateFiles(state_dir, {"layer3": layout}) as fresh:  # resume: a new run's files
        fresh.load_safetensors("layer3", ckpt / "layer3.safetensors")
        back = _buffer(layout)
        fresh.read("layer3", back).wait()
        assert all(torch.equal(v, tensors[k]) for k, v in layout.views(back).items())
        # a file safetensors wrote itself (another header, another order) loads too
        save_file({k: t.contiguous() for k, t in reversed(list(tensors.items()))}, ckpt / "theirs.safetensors")
        views = layout.views(fresh.staging("layer3"))
        views["0.exp_avg"].zero_()
        fresh.write("layer3", fresh.staging("layer3")).wait()
        fresh.load_safetensors("layer3", ckpt / "theirs.safetensors")
        fresh.read("layer3", back).wait()
        assert all(torch.equal(v, tensors[k]) for k, v in layout.views(back).items())


def test_copies_fall_back_where_copy_file_range_is_refused(tmp_path, monkeypatch):
    def refuse(*args):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(files_module.os, "copy_file_range", refuse)
    monkeypatch.setattr(files_module, "_BOUNCE_BYTES", 3 * ALIGN_BYTES)  # several bounces
    tensors = _random_tensors(torch.Generator().manual_seed(6), "", [9000])
    layout = GroupLayout.of(tensors)
    with StateFiles(tmp_path, {"g": layout}) as files:
        views = layout.views(files.staging("g"))
        for name, t in tensors.items():
            views[name].copy_(t)
        files.write("g", files.staging("g")).wait()
        files.save_safetensors("g", tmp_path / "g.safetensors")
        assert all(torch.equal(load_file(tmp_path / "g.safetensors")[k], t) for k, t in tensors.items())
        views["0.exp_avg"].zero_()
        files.write("g", files.staging("g")).wait()
        files.load_safetensors("g", tmp_path / "g.safetensors")
        back = _buffer(layout)
        files.read("g", back).wait()
        assert torch.equal(layout.views(back)["0.exp_avg"], tensors["0.exp_avg"])


def test_a_checkpoint_that_does_not_match_is_one_line(tmp_path):
    layout = GroupLayout([("0.exp_avg", torch.float32, (10,)), ("0.qm", torch.uint8, (10,))])
    bad = {
        "other_shape": {"0.exp_avg": torch.zeros(11), "0.qm": torch.zeros(10, dtype=torch.uint8)},
        "other_dtype": {"0.exp_avg": torch.zeros(10, dtype=torch.float64), "0.qm": torch.zeros(10, dtype=torch.uint8)},
        "missing": {"0.exp_avg": torch.zeros(10)},
        "extra": {"0.exp_avg": torch.zeros(10), "0.qm": torch.zeros(10, dtype=torch.uint8), "1.qm": torch.zeros(1)},
    }
    for name, tensors in bad.items():
        save_file(tensors, tmp_path / f"{name}.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    (tmp_path / "not_json.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops")
    state_dir = tmp_path / "nvme"
    state_dir.mkdir()
    with StateFiles(state_dir, {"g": layout}) as files:
        for name in [*bad, "garbage", "not_json", "absent"]:
            with pytest.raises(LazyTrainError) as err:
                files.load_safetensors("g", tmp_path / f"{name}.safetensors")
            one_line(str(err.value), "checkpoint")
