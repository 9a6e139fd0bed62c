"""Unseen inputs, round 18: the store's disk and filesystem as a user's machine has them, larger than
memory: filesystems that refuse O_DIRECT, stores of another alignment, files changed or failing
under a running runtime, and a store written onto a filesystem that fills or a run cut short."""

from __future__ import annotations

import errno
import os
import pathlib
from typing import Any

import pytest
from _fault_helpers import deny_open, refuse_o_direct

from asyncside import ExpertStore


def test_the_demos_disk_probe_on_a_filesystem_without_o_direct_measures_nothing(
        quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --model STORE --memory 400M`` with the store on ramfs (no O_DIRECT) ended in
    ``OSError: [Errno 22] Invalid argument`` and a traceback from the disk probe, though the plan
    read the store buffered. The probe measures nothing ("the disk probe read nothing") and the
    demo runs; no file is left open."""
    from _fault_helpers import describe_fds, open_fds

    from asyncside.demo import probe_disk

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    store = ExpertStore.open(quick_store)
    refuse_o_direct(monkeypatch, quick_store)
    before = open_fds()
    got = probe_disk(store, seconds=0.05)
    assert got["bytes_per_s"] == 0.0 and got["record_bytes"] == max(s.stride for s in store.layers.values())
    leaked = open_fds() - before
    assert not leaked, describe_fds(leaked)


def test_bench_io_on_a_filesystem_without_o_direct_skips_cold_direct_and_says_so(
        ramfs: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside bench io --dir DIR`` with DIR on ramfs (or any filesystem without O_DIRECT) ended
    in a traceback (``OSError: [Errno 22] cannot open with O_DIRECT``) at the first cold_direct
    pass, the warm and buffered numbers lost. cold_direct is skipped, said on stderr and in the
    result's "skipped"; asked for alone it is a usage error naming --modes and --dir."""
    import json

    from asyncside import cli
    from tests._cli_support import run_cli

    argv = ["bench", "io", "--quick", "--json", "--no-fio", "--readers", "threads", "--dir", str(ramfs)]
    assert cli.main([*argv, "--modes", "warm,cold_direct"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    (lay,) = result["layouts"]
    assert {c["mode"] for c in lay["runs"]} == {"warm"}, lay["runs"]
    said = f"cold_direct: the filesystem of --dir {ramfs} refuses O_DIRECT (Invalid argument (errno 22))"
    assert said in result["skipped"] and said in err and "Traceback" not in err, (result["skipped"], err)
    rc, err = run_cli(capsys, *argv, "--modes", "cold_direct")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--modes: cold_direct reads with O_DIRECT, which the filesystem of --dir" in err and "another --dir" in err


def test_a_store_of_a_small_alignment_is_read_past_the_page_cache_by_the_slot_cache_and_the_probe(
        tmp_path: pathlib.Path) -> None:
    """A store written with ``alignment=64`` (the format allows any power of two; the runtime's
    readers stage such records) has records that start mid-block. The slot cache that the demo
    checks a direct run's tokens against (``--reference slot-cache``) read them with O_DIRECT at
    the record's own offset: ``OSError: [Errno 22] Invalid argument``; the demo's disk probe read
    nothing. Both read the blocks that hold the record now: the rows hold the store's bytes."""
    import numpy as np

    from asyncside.bench.slot_cache import SlotCache
    from asyncside.demo import probe_disk
    from asyncside.testing import random_layers

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    segments = {"w1": ((3, 7), "float32"), "w2": ((5,), "float16"), "s": ((1,), "uint8")}
    store = ExpertStore.create(tmp_path / "store", random_layers(1, 16, segments, seed=3), alignment=64)
    spec = store.layer(0)
    assert spec.stride % 512, spec.stride  # records start inside a disk block
    try:
        os.close(os.open(spec.path, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: {exc}")
    with SlotCache(store, 0.25, side_rows=4, direct=True) as direct, \
            SlotCache(store, 0.25, side_rows=4, direct=False) as buffered:
        for expert in range(spec.n_experts):
            for cache in (direct, buffered):
                cache.ensure(0, np.array([expert]))
            for seg in spec.segments:
                got = [bytes(c.layers[0].pools.row_view(seg.key, int(c.layers[0].slot_of[expert])))
                       for c in (direct, buffered)]
                assert got[0] == got[1], (expert, seg.key)
    assert probe_disk(store, seconds=0.05)["bytes_per_s"] > 0


@pytest.mark.parametrize("fails", ["open", "read"])
def test_a_blob_the_reference_cannot_read_is_one_line_naming_layer_and_expert(
        fails: str, quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --model STORE`` where a blob belongs to another user (mode 0600) or the disk
    answers EIO: the runtime's open said "layer 1: cannot open the blob for reading: Permission
    denied", but the all-resident reference, loaded first, ended in a bare ``PermissionError`` /
    ``OSError`` traceback from ``ExpertStore.read_record``. It is a StoreError naming the file, the
    layer, the expert and the reason, with its errno (the demo's one line)."""
    from asyncside.errors import StoreError

    store = ExpertStore.open(quick_store)
    blob = str(store.layer(1).path)
    real_open, real_pread = os.open, os.pread
    code = errno.EACCES if fails == "open" else errno.EIO

    def denied(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path) == blob:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    def failing(fd: int, n: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}") == blob:
            raise OSError(errno.EIO, "Input/output error")
        return real_pread(fd, n, offset)

    if fails == "open":
        monkeypatch.setattr(os, "open", denied)
    else:
        if not os.path.exists("/proc/self/fd"):
            pytest.skip("no /proc/self/fd to tell the blob's descriptor")
        monkeypatch.setattr(os, "pread", failing)
    store.read_expert(0, 3)  # the other layer reads
    with pytest.raises(StoreError) as info:
        store.read_expert(1, 3)
    said = str(info.value)
    assert info.value.errno == code and said.startswith(f"{blob}: layer 1: cannot read expert 3: "), said
    assert f"(errno {code})" in said and "\n" not in said, said


_KILLED_BUILD = """
import os, signal, sys
from collections.abc import Mapping
from asyncside import ExpertStore
from asyncside.testing import random_layers

class Killed(Mapping):
    # The second layer is never given: the process is killed while the store is half written.
    def __init__(self):
        self.data = random_layers(2, 8)
    def __getitem__(self, key):
        if key == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[key]
    def __iter__(self):
        return iter(self.data)
    def __len__(self):
        return len(self.data)

ExpertStore.create(sys.argv[1], Killed())
"""


def test_a_store_build_that_was_killed_leaves_nothing_the_next_build_keeps(tmp_path: pathlib.Path) -> None:
    """``ExpertStore.create(DIR, layers)`` killed while it wrote (SIGKILL, the OOM killer, a power
    cut) left ``.DIR.tmp-*`` beside DIR, hidden and as large as what it had written, and every run
    after it kept it: on a disk sized for the store the next build ran out of space. The next build
    removes what a killed one left; a build still running (its directory locked) is left alone."""
    import subprocess
    import sys

    from asyncside.testing import random_layers

    fcntl = pytest.importorskip("fcntl")

    dest = tmp_path / "st"
    run = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(dest)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == -9, run.stderr[-2000:]
    (left,) = tmp_path.glob(".st.tmp-*")
    assert any(left.iterdir()) and not dest.exists()
    live = tmp_path / ".st.tmp-live"  # another process's build, running: its directory is locked
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        store = ExpertStore.create(dest, random_layers(2, 8))
        assert store.layer(1).n_experts == 8
        assert not left.exists() and live.is_dir()
    finally:
        os.close(fd)
    ExpertStore.create(dest, random_layers(2, 8, seed=1), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["st"]


@pytest.mark.parametrize("how", ["read-only", "not-ours"])
def test_convert_overwrite_of_a_store_it_cannot_move_is_one_line(
        how: str, quick_store: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert MODEL DIR --overwrite`` where DIR is a store made read-only (mode 0555)
    or another user's in a sticky directory such as /tmp: the whole model was converted, then the
    move of the old store ended in ``PermissionError: [Errno 13] Permission denied`` and a traceback,
    the new store thrown away. A directory it may not write is refused before converting; a move
    the filesystem refuses is one line; the old store stays and nothing is left beside it."""
    import shutil

    from tests._cli_support import run_cli

    dest = tmp_path / "out" / "st"
    shutil.copytree(quick_store, dest)
    before = sorted(p.name for p in dest.iterdir())
    if how == "read-only":
        real_access = os.access

        def access(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
            return False if str(path) == str(dest) and mode & os.W_OK else real_access(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
        said = "cannot be replaced: this process may not write to the directory (mode "
    else:
        real_rename = os.rename

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if str(src) == str(dest):
                raise PermissionError(errno.EPERM, "Operation not permitted", str(src), str(dst))
            real_rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "rename", rename)
        said = "cannot be replaced: Operation not permitted (errno 1); convert into another directory"
    rc, err = run_cli(capsys, "convert", str(quick_store.parent / "model"), str(dest), "--overwrite", "--quiet")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{dest}: {said}" in err, err
    assert sorted(p.name for p in dest.iterdir()) == before and [p.name for p in dest.parent.iterdir()] == ["st"]


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_convert_of_a_model_file_it_cannot_read_names_that_file_before_converting(
        name: str, quick_store: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert MODEL DIR`` where a file of MODEL belongs to another user (mode 0600):
    unreadable weights were a ``PermissionError`` traceback; an unreadable tokenizer file failed the
    conversion at its very end as "DIR: cannot write the store: Permission denied ... 52 GiB free
    there", blaming the store's disk. Either is one line naming the model's file, before converting."""
    from tests._cli_support import run_cli

    model = quick_store.parent / "model"
    locked = str(model / name)
    deny_open(monkeypatch, locked)
    dest = tmp_path / "out" / "st"
    rc, err = run_cli(capsys, "convert", str(model), str(dest), "--quiet")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{locked}: cannot read it: Permission denied (errno 13)" in err and "free there" not in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was made


@pytest.mark.parametrize("name", ["manifest.json", "config.json"])
def test_a_store_file_it_cannot_read_is_one_line_naming_it(name: str, quick_store: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --model STORE`` (or ``asyncside.load``) where the store's manifest or its
    config.json belongs to another user (mode 0600): ``PermissionError: [Errno 13]`` and a
    traceback from ExpertStore.open or from mlx-lm's loader. It is a StoreError naming the file,
    the reason and its errno."""
    from asyncside.errors import StoreError
    from asyncside.models import load_streaming_model

    locked = str(quick_store / name)
    deny_open(monkeypatch, locked)
    with pytest.raises(StoreError) as info:
        load_streaming_model(quick_store)
    said = str(info.value)
    assert said.startswith(f"{locked}: ") and said.endswith("cannot read the manifest: Permission denied (errno 13)"
                                                            if name == "manifest.json" else
                                                            "cannot read it: Permission denied (errno 13)"), said
    assert info.value.errno == errno.EACCES


def test_create_overwrite_of_a_store_it_cannot_move_is_a_store_error_leaving_nothing(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ExpertStore.create(DIR, layers, overwrite=True)`` where DIR cannot be moved away (a store
    made read-only, another user's in a sticky directory) raised a bare ``PermissionError`` naming
    a hidden ``.DIR.old-*`` directory, which stayed beside the store. It is a StoreError naming DIR;
    the old store is whole and nothing is left beside it."""
    from asyncside.errors import StoreError
    from asyncside.testing import random_layers

    dest = tmp_path / "st"
    ExpertStore.create(dest, random_layers(2, 8))
    real_rename = os.rename

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(src) == str(dest):
            raise PermissionError(errno.EACCES, "Permission denied", str(src), str(dst))
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(StoreError) as info:
        ExpertStore.create(dest, random_layers(2, 8, seed=1), overwrite=True)
    assert str(info.value) == f"{dest}: cannot be replaced: Permission denied (errno 13)" and info.value.errno == 13
    assert [p.name for p in tmp_path.iterdir()] == ["st"]
    ExpertStore.open(dest, verify="full")


def test_a_full_check_of_a_store_on_a_failing_disk_names_the_blob_and_where(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ExpertStore.open(DIR, verify="full")`` (or ``store.verify()``), what a user runs to check a
    store on a disk they doubt: a read that failed with EIO was a bare ``OSError: [Errno 5]``
    naming no file. It is a StoreError naming the blob, the layer and the records it read."""
    from asyncside.errors import StoreError
    from asyncside.testing import random_layers

    dest = tmp_path / "st"
    store = ExpertStore.create(dest, random_layers(2, 8))
    blob = str(store.layer(1).path)
    real_pread = os.pread

    def failing(fd: int, n: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}") == blob:
            raise OSError(errno.EIO, "Input/output error")
        return real_pread(fd, n, offset)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("no /proc/self/fd to tell the blob's descriptor")
    monkeypatch.setattr(os, "pread", failing)
    with pytest.raises(StoreError) as info:
        ExpertStore.open(dest, verify="full")
    said = str(info.value)
    assert said.startswith(f"{blob}: layer 1: cannot read experts [0, 8) (bytes [0, ") and info.value.errno == errno.EIO
    assert said.endswith("Input/output error (errno 5)"), said


@pytest.mark.parametrize("how", ["link-loop", "no-permission"])
def test_a_blob_the_store_cannot_look_at_is_refused_naming_it(how: str, tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``ExpertStore.open(DIR)`` where a blob is a link to itself (a dedup script gone wrong) or
    cannot be looked at (EACCES from stat): ``RuntimeError: Symlink loop from ...`` or a bare
    PermissionError traceback. It is a StoreError naming the blob and the manifest field."""
    from asyncside.errors import StoreError
    from asyncside.testing import random_layers

    dest = tmp_path / "st"
    blob = ExpertStore.create(dest, random_layers(2, 8)).layer(1).path
    if how == "link-loop":
        blob.unlink()
        blob.symlink_to(blob.name)
    else:
        real_stat = os.stat

        def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path) == str(blob):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(StoreError) as info:
        ExpertStore.open(dest)
    said = str(info.value)
    assert "[layers[1].file]" in said and blob.name in said, said
    if how == "link-loop":
        assert "cannot be resolved" in said, said
    else:
        assert said == f"{blob} [layers[1].file]: cannot look at the blob: Permission denied (errno 13)", said
