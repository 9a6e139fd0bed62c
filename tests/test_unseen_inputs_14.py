"""Unseen inputs, round 14: a new user's machine and files, as the Python API and the command line
meet them: where the store lives, the store changing under a running process, and the process
itself (signals, pipes, limits). What is refused is one line naming the file or argument."""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import anyio
import pytest
from _fault_helpers import direct_budget, refuse_o_direct

from asyncside import ExpertStore, Runtime
from asyncside.errors import StoreError
from asyncside.runtime import PlanArgumentError


@pytest.mark.parametrize(("resident", "rows"), [("25%", 8), (" 50% ", 16), ("0.25", 8), ("AUTO", None)])
def test_a_runtime_takes_a_residency_as_the_command_line_writes_it(resident: str, rows: int | None,
                                                                  quick_store: pathlib.Path) -> None:
    """``Runtime(store, resident="25%")`` was refused ("expected a fraction in [0, 1] or 'auto', got
    '25%'") though ``demo --resident 25%`` takes it: a string is read by the one parser the command
    line uses, and what it refuses is refused naming ``resident``."""
    async def go() -> dict[int, int]:
        async with Runtime(ExpertStore.open(quick_store), resident=resident, min_side_rows=1) as rt:
            assert rt.plan is not None
            return dict(rt.plan.rows)

    planned = anyio.run(go)
    if rows is not None:
        assert set(planned.values()) == {rows}
    for bad in ("125%", "x", "", "auto%"):
        with pytest.raises(PlanArgumentError, match=r"^resident: expected a fraction in \[0, 1\], got "):
            Runtime(ExpertStore.open(quick_store), resident=bad)


@pytest.mark.parametrize(("how", "said"), [
    ("budget", "the plan chose O_DIRECT (the store's 2.0 MiB of records, which buffered reads would keep "),
    ("argument", "O_DIRECT was asked for: leave out direct=True (--direct)"),
    ("variable", "O_DIRECT was asked for by $ASYNCSIDE_DIRECT: set it to 0"),
])
def test_a_filesystem_that_refuses_o_direct_says_how_to_read_buffered(how: str, said: str, quick_store: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A store on a filesystem that refuses O_DIRECT (EINVAL when opened: an older tmpfs such as
    /dev/shm, some FUSE mounts) under a budget that made the plan read past the page cache failed
    with "(the filesystem refuses direct I/O; read it buffered)", naming no way to: the plan had
    chosen O_DIRECT itself. The refusal says why the reads were direct and what reads buffered;
    with direct=False the same runtime runs."""
    import asyncside.runtime._plan as plan_mod

    refuse_o_direct(monkeypatch, quick_store)
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)  # the budget is the plan's alone
    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
    store = ExpertStore.open(quick_store)
    least = direct_budget(store)
    kwargs: dict[str, Any] = {"memory": least} if how == "budget" else {"direct": True} if how == "argument" else {}
    if how == "variable":
        monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")

    async def go(**extra: Any) -> bool:
        async with Runtime(ExpertStore.open(quick_store), reader="aiofiles", **{**kwargs, **extra}) as rt:
            assert rt.plan is not None
            return rt.plan.direct

    with pytest.raises(StoreError) as info:
        anyio.run(go)
    assert "cannot open with O_DIRECT" in str(info.value) and said in str(info.value), str(info.value)
    assert anyio.run(functools.partial(go, direct=False)) is False


def _full_disk(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The filesystem fills while a store is written: ``where`` is ``"blob"`` (a layer's blob,
    Python's OSError) or ``"mlx"`` (MLX's own writer, a RuntimeError that names no reason)."""
    import errno

    import mlx.core as mx

    import asyncside.store as store_mod

    if where == "blob":
        real = store_mod._write_layer

        def full(tmp: pathlib.Path, *args: Any, **kwargs: Any) -> Any:
            real(tmp, *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store_mod, "_write_layer", full)
    else:
        def unable(path: str, *args: Any, **kwargs: Any) -> None:
            pathlib.Path(path).write_bytes(b"\0" * 100)  # a part written, as a full disk leaves it
            raise RuntimeError("[write] Unable to write 2912 bytes to file.")

        monkeypatch.setattr(mx, "save_safetensors", unable)


@pytest.mark.parametrize("where", ["blob", "mlx"])
def test_convert_onto_a_full_disk_is_one_line_and_leaves_nothing(where: str, quick_store: pathlib.Path,
                                                                  tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert MODEL DIR`` onto a filesystem that fills while the store is written
    ended in a traceback (``OSError: [Errno 28] No space left on device`` from a blob, or MLX's
    ``RuntimeError: [write] Unable to write 2912 bytes to file.``). It is one line naming the
    store directory, the reason and the space the store takes, exit status 1 (the disk failed,
    not the input), and nothing is left beside it."""
    from tests._cli_support import run_cli

    _full_disk(monkeypatch, where)
    dest = tmp_path / "out" / "store"
    rc, err = run_cli(capsys, "convert", str(quick_store.parent / "model"), str(dest), "--quiet")
    said = "No space left on device (errno 28)" if where == "blob" else "[write] Unable to write 2912 bytes to file;"
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"asyncside convert: {dest}: cannot write the store: {said}") and "free there" in err, err
    assert "the model's weight files (2.0 MiB)" in err and "Traceback" not in err, err
    assert list((tmp_path / "out").iterdir()) == []


def test_building_the_embedded_model_on_a_full_disk_names_the_cache_directory(tmp_path: pathlib.Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --cache-dir DIR`` whose filesystem cannot hold the embedded model ended in
    MLX's ``RuntimeError: [write] Unable to write 159943 bytes to file.`` and a traceback: the
    error names the cache directory, what the build takes, and --cache-dir; no half build is kept."""
    from asyncside.bench import generate as bench
    from asyncside.models.convert import StoreWriteError
    from asyncside.models.embedded import ensure_embedded_default

    _full_disk(monkeypatch, "mlx")
    with pytest.raises(StoreWriteError) as info:
        ensure_embedded_default(tmp_path, spec=bench._quick_spec(), progress=False)
    said = str(info.value)
    assert said.startswith(f"{tmp_path}: cannot write the embedded model and its store: [write] Unable to "), said
    assert "the build takes about " in said and "another --cache-dir" in said, said
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("model", ["embedded", "directory"])
def test_a_cache_directory_the_process_cannot_write_is_one_line(model: str, quick_store: pathlib.Path,
                                                                 tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside demo`` (the embedded model, built on first use) or ``demo --model MODEL_DIR``
    (converted on first use) under a cache it cannot write (a read-only home, another user's
    cache) ended in ``OSError: [Errno 30] Read-only file system`` and a traceback; it is one line
    naming the directory and the ways to give another."""
    import errno

    from tests._cli_support import run_cli

    cache = tmp_path / "home" / ".cache"
    real_mkdir = pathlib.Path.mkdir

    def read_only(self: pathlib.Path, *args: Any, **kwargs: Any) -> None:
        if str(self).startswith(str(cache)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    monkeypatch.delenv("ASYNCSIDE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    argv = ["--model", str(quick_store.parent / "model")] if model == "directory" else []
    rc, err = run_cli(capsys, "demo", "--tokens", "2", "--reference", "none", *argv)
    assert rc in (1, 2) and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"asyncside demo: {cache / 'asyncside'}") and "Read-only file system (errno 30)" in err, err
    assert "--cache-dir DIR" in err and "$ASYNCSIDE_CACHE" in err, err


def test_a_store_says_whether_its_model_directory_changed_since_it_was_converted(quick_store: pathlib.Path,
                                                                                 tmp_path: pathlib.Path) -> None:
    """A model directory converted on first use (``demo --model DIR``, ``load(DIR)``) is cached by
    its path: a model saved again into that directory (fine-tuned, another checkpoint) reused the
    store of the first, and generated the old weights' tokens without a word. A store records its
    source files as converted, and ``source_changed`` names the first that differs (the cache's
    side is helper C's, /tmp/b19/A-hub-stale-store.patch)."""
    import os
    import shutil

    from asyncside.models.convert import convert_model, source_changed

    model = tmp_path / "model"
    shutil.copytree(quick_store.parent / "model", model)
    store = convert_model(model, tmp_path / "store", progress=False)
    assert source_changed(ExpertStore.open(tmp_path / "store"), model) is None
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # saved again
    assert source_changed(store, model) == "model.safetensors changed"
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    (model / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert source_changed(store, model) == "model-00002-of-00002.safetensors was added"
    (model / "model-00002-of-00002.safetensors").unlink()
    (model / "config.json").unlink()
    assert source_changed(store, model) == "config.json is gone"


def test_ctrl_c_ends_a_command_in_one_line_with_status_130(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C during ``asyncside demo`` (or ``bench offload``) printed a KeyboardInterrupt
    traceback of 20 to 80 lines from wherever it landed (MLX's import, mlx-lm's generate step).
    The command's cleanup runs as before; then one line, and status 130 as a shell reports it."""
    from asyncside import demo
    from tests._cli_support import run_cli

    cleaned: list[bool] = []

    def interrupted(args: Any) -> int:
        try:
            raise KeyboardInterrupt
        finally:
            cleaned.append(True)

    monkeypatch.setattr(demo, "demo_main", interrupted)
    try:
        rc, err = run_cli(capsys, "demo", "--tokens", "2")
    except KeyboardInterrupt:  # not let through: pytest would stop the whole run at it
        pytest.fail("the interrupt reached the command's caller, as a traceback")
    assert rc == 130 and err == "asyncside demo: interrupted\n" and cleaned == [True]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_ends_a_command_through_its_cleanup(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM (``kill``, ``timeout``, a service manager) ended ``asyncside bench offload`` where it
    stood: its child went on generating in its memory cgroup, the cgroup and its temporary directory
    were left behind. SIGTERM is now an exit (status 143) that runs the command's cleanup (the
    ``finally`` blocks that end children and remove cgroups and files); the handler is the
    process's own again once the command returns. SIGHUP (the terminal or ssh session gone) alike."""
    import os
    import signal
    import time

    from asyncside import cli, demo

    cleaned: list[bool] = []
    sig = getattr(signal, name)

    def terminated(args: Any) -> int:
        try:
            os.kill(os.getpid(), sig)
            for _ in range(50):
                time.sleep(0.01)  # the handler runs at the next bytecode
            return 0
        finally:
            cleaned.append(True)

    def test_process(signum: int, frame: Any) -> None:  # this test's own: the default would end pytest
        cleaned.append(False)

    monkeypatch.setattr(demo, "demo_main", terminated)
    before = signal.signal(sig, test_process)
    try:
        with pytest.raises(SystemExit) as info:
            cli.main(["demo", "--tokens", "2"])
        assert signal.getsignal(sig) == test_process
    finally:
        signal.signal(sig, before)
    assert info.value.code == 128 + sig and cleaned == [True]


@pytest.mark.parametrize(("limits", "kept"), [((512, 1024), (1024, 1024)), ((4096, 4096), (4096, 4096))])
def test_mlx_lm_is_imported_keeping_the_open_files_limit(limits: tuple[int, int], kept: tuple[int, int]) -> None:
    """mlx-lm sets the open files limit to (2048, 4096) when imported: under a hard limit below
    4096 (``ulimit -n 1024``, some containers) every asyncside command and ``import
    asyncside.models`` failed with "ValueError: not allowed to raise maximum limit", and above it
    the process's limits were lowered. Imported through asyncside, the limit is raised at most to
    the hard limit, never lowered."""
    import resource
    import subprocess
    import sys

    code = ("import resource, asyncside.models; "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < limits[1]:
        pytest.skip("this process's hard limit is below the case's")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits))
    assert out.returncode == 0, out.stderr[-2000:]
    assert tuple(map(int, out.stdout.split())) == kept


def test_convert_shows_a_long_store_path_whole(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert`` printed its store's path cut with an ellipsis where it was longer than
    the table's column (output piped, or an 80-column terminal): "/tmp/.../embedded-db181c7e/mode…",
    the one line a user copies to run the store. The cell folds; the whole path is there."""
    from asyncside import cli

    monkeypatch.setenv("COLUMNS", "80")
    dest = tmp_path / ("d" * 70) / "store"
    assert cli.main(["convert", str(quick_store.parent / "model"), str(dest), "--quiet"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    at = next(i for i, r in enumerate(rows) if r[1].strip() == "store")
    cell = rows[at][2].strip()
    for r in rows[at + 1:]:
        if r[1].strip():
            break
        cell += r[2].strip()
    assert cell == str(dest) and "…" not in out, out


def test_bench_io_refuses_an_out_file_it_cannot_write_before_running(tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside bench io --out DIR/result.json`` into a directory that is missing (or read-only)
    ran the whole bench, then failed with a traceback from open() and its result was lost. The
    file is checked when parsed, as bench policy's --out and demo's --record-routing are."""
    from asyncside.bench import io
    from tests._cli_support import run_cli

    ran: list[bool] = []
    monkeypatch.setattr(io, "run_io_bench", lambda *a, **k: ran.append(True) or {})
    out = tmp_path / "missing" / "result.json"
    rc, err = run_cli(capsys, "bench", "io", "--quick", "--out", str(out))
    assert rc == 2 and f"argument --out: {out}: no such directory {out.parent}" in err and not ran, err


def test_bench_io_says_a_dir_it_cannot_build_in_in_one_line(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside bench io --dir DIR`` where DIR is a file, or on a read-only (or full) filesystem,
    ended in a traceback (FileExistsError from makedirs, OSError from the store's writes). A file
    is a usage error when parsed; a directory the bench cannot write is one line naming it."""
    import errno

    from asyncside.store import ExpertStore
    from tests._cli_support import run_cli

    (tmp_path / "afile").write_text("")
    rc, err = run_cli(capsys, "bench", "io", "--quick", "--no-fio", "--dir", str(tmp_path / "afile"))
    assert rc == 2 and f"argument --dir: {tmp_path / 'afile'}: expected a directory" in err, err

    def read_only(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(ExpertStore, "create", staticmethod(read_only))
    rc, err = run_cli(capsys, "bench", "io", "--quick", "--no-fio", "--dir", str(tmp_path / "stores"))
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"asyncside bench io: --dir {tmp_path / 'stores'}: cannot write the bench's store "), err
    assert "Read-only file system (errno 30)" in err, err


def test_a_trace_that_cannot_be_written_leaves_the_file_that_was_there(tmp_path: pathlib.Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --record-routing T.npz`` (or ``routing preset``) on a filesystem that filled while the
    trace was written said "cannot be written: No space left on device", and left T.npz cut short
    (an empty file), over the trace that was there before. The trace is written beside it and
    renamed over it: a failed write leaves the old trace whole and nothing else; a written one
    keeps the file's mode and, written through a link, the link."""
    import errno
    import os

    import numpy as np

    from asyncside.errors import TraceError
    from asyncside.routing import RoutingTrace, preset

    path = tmp_path / "t.npz"
    first = preset("low", tokens=16, n_layers=2, n_experts=8, top_k=2)
    first.save(path)
    os.chmod(path, 0o640)
    before = path.read_bytes()

    def full(fh: Any, **arrays: Any) -> None:
        fh.write(b"PK\x03\x04 part")
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(np, "savez_compressed", full)
        with pytest.raises(TraceError, match="cannot be written: No space left on device"):
            preset("high", tokens=16, n_layers=2, n_experts=8, top_k=2).save(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]

    link = tmp_path / "link.npz"
    link.symlink_to(path)
    second = preset("high", tokens=16, n_layers=2, n_experts=8, top_k=2)
    second.save(link)
    assert link.is_symlink() and (os.stat(path).st_mode & 0o777) == 0o640
    assert np.array_equal(RoutingTrace.load(path).ids, second.ids)


@pytest.mark.parametrize("model", ["embedded", "directory"])
def test_no_home_directory_is_one_line_naming_the_ways_to_give_a_cache(model: str, quick_store: pathlib.Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A user without $HOME and without a passwd entry (a container run as ``--user 1234``) got
    pathlib's "RuntimeError: Could not determine home directory." and a traceback from ``demo``
    (the embedded model's cache) or ``demo --model MODEL_DIR`` (the converted stores' cache)."""
    from tests._cli_support import run_cli

    def no_home(cls: Any) -> pathlib.Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(pathlib.Path, "home", classmethod(no_home))
    for variable in ("ASYNCSIDE_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(variable, raising=False)
    argv = ["--model", str(quick_store.parent / "model")] if model == "directory" else []
    rc, err = run_cli(capsys, "demo", "--tokens", "2", "--reference", "none", *argv)
    assert rc in (1, 2) and len(err.strip().splitlines()) == 1, err
    assert err.startswith("asyncside demo: no cache directory: $HOME is not set and user "), err
    assert "--cache-dir DIR" in err and "$ASYNCSIDE_CACHE or $XDG_CACHE_HOME" in err, err


def test_a_tokenizer_file_that_is_a_fifo_is_refused_not_waited_on(quick_store: pathlib.Path,
                                                                   tmp_path: pathlib.Path) -> None:
    """A store whose tokenizer.json is a FIFO (a file replaced by ``mkfifo``, a process substitution
    linked there) hung ``demo``, ``serve`` and ``load`` for ever in transformers' read. It is a
    StoreError naming the file, as a blob that is no regular file is."""
    import os
    import shutil
    import threading

    from asyncside.models.tokenizer import load_tokenizer

    store = tmp_path / "store"
    shutil.copytree(quick_store, store)
    (store / "tokenizer.json").unlink()
    os.mkfifo(store / "tokenizer.json")
    said: list[BaseException | None] = []

    def load() -> None:
        try:
            load_tokenizer(store)
            said.append(None)
        except BaseException as exc:
            said.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # let the read that waits for a writer end, then fail
        fd = os.open(store / "tokenizer.json", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(30)
        pytest.fail("load_tokenizer waited on the FIFO")
    assert isinstance(said[0], StoreError), said
    assert str(said[0]) == (f"{store / 'tokenizer.json'}: a tokenizer file that is not a regular file "
                            "(a FIFO, device or directory)")


def test_a_sigterm_the_parent_ignores_stays_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command started with SIGTERM ignored (SIG_IGN inherited, as a supervisor may start it)
    keeps it ignored: the exit on SIGTERM is only where SIGTERM would have ended the process."""
    import signal

    from asyncside import cli, demo

    seen: list[Any] = []
    monkeypatch.setattr(demo, "demo_main", lambda args: seen.append(signal.getsignal(signal.SIGTERM)) or 0)
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert cli.main(["demo", "--tokens", "2"]) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [signal.SIG_IGN]


def test_convert_into_a_mount_point_replaces_what_it_holds(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside convert MODEL /store --overwrite`` where /store is a mount point (a disk mounted
    there, a container's volume) renamed /store away: "OSError: [Errno 16] Device or resource busy"
    and a traceback, and an empty mount point with its lost+found was no empty directory. The store
    is built inside it and replaces what it held (the directory itself stays, lost+found too)."""
    import os

    from asyncside.models.convert import convert_model

    mount = tmp_path / "store"
    (mount / "lost+found").mkdir(parents=True)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(mount) or real(p))
    monkeypatch.setattr(os, "rename", _no_rename_of(mount, os.rename))
    inode = mount.stat().st_ino
    for _ in range(2):  # an empty mount point, then one holding a store
        store = convert_model(quick_store.parent / "model", mount, overwrite=True, progress=False)
        assert store.path == mount and mount.stat().st_ino == inode
    assert sorted(p.name for p in mount.iterdir()) == sorted(["lost+found", *(p.name for p in quick_store.iterdir())])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def _no_rename_of(mount: pathlib.Path, rename: Any) -> Any:
    """os.rename as a mount point meets it: the mount point itself cannot be renamed (EBUSY)."""
    import errno

    def renaming(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(src) == str(mount) or str(dst) == str(mount):
            raise OSError(errno.EBUSY, "Device or resource busy", str(src), None, str(dst))
        rename(src, dst, *args, **kwargs)

    return renaming


def test_a_directory_of_a_quoted_tilde_is_the_home_directorys(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``STORE="~/stores/q"; asyncside convert MODEL "$STORE"`` (the tilde quoted, so the shell
    leaves it) made a directory named ``~`` in the working directory, where ``demo --model
    "$STORE"`` then looked in the home directory and found nothing; ``--cache-dir "~/c"`` and
    ``convert_model(..., "~/s")`` alike, and a file option (``--routing "~/t.npz"``: no such file;
    ``--record-routing``: no such directory). A leading ``~`` is the home directory everywhere."""
    from asyncside import cli
    from asyncside.argtypes import directory, file_name, writable_file
    from asyncside.models.convert import convert_model
    from asyncside.models.embedded import cache_root

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert cli.main(["convert", str(quick_store.parent / "model"), "~/stores/q", "--quiet", "--json"]) == 0
    assert (home / "stores" / "q" / "manifest.json").is_file()
    convert_model(quick_store.parent / "model", "~/s", progress=False)
    assert (home / "s" / "manifest.json").is_file()
    assert directory("~/c") == str(home / "c") and cache_root("~/c") == home / "c"
    assert file_name("~/t.npz") == str(home / "t.npz") == writable_file("~/t.npz")  # --routing, --record-routing
    assert cli.main(["routing", "preset", "low", "~/t.npz", "--layers", "2", "--experts", "8", "--top-k", "2",
                     "--tokens", "16"]) == 0
    assert cli.main(["routing", "info", "~/t.npz", "--no-min"]) == 0 and (home / "t.npz").is_file()
    from asyncside.bench import check_store_dir

    assert check_store_dir("--stores", "~/stores/q") == home / "stores" / "q"  # bench offload, bench generate
    assert list(work.iterdir()) == []
    capsys.readouterr()


@pytest.mark.parametrize(("failure", "said"), [
    ("io_uring_setup failed: Too many open files", "files: raise ulimit -n)"),
    ("io_uring_setup failed: Cannot allocate memory", "older kernels charge io_uring rings to it)"),
    ("io_uring_setup failed: Operation not permitted", "io_uring_setup failed: Operation not permitted;"),
])
def test_a_reader_that_cannot_start_is_one_line_naming_the_way_on(failure: str, said: str,
                                                                  quick_store: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The io_uring reader failing to set up its ring (too few open files allowed, the locked
    memory limit an older kernel charges rings to, io_uring refused by a container's seccomp
    profile) was a RuntimeError traceback from inside the scheduler. It is an AsyncsideError in
    one line: the reason, the limit where one is to blame, and the threads reader as the way on."""
    from asyncside import _native
    from asyncside.errors import AsyncsideError
    from tests._cli_support import run_cli

    def refused(name: str, options: Any) -> Any:
        raise RuntimeError(failure)

    monkeypatch.setattr(_native, "Reader", refused)

    async def go() -> None:
        async with Runtime(ExpertStore.open(quick_store), reader="io_uring"):
            pass

    with pytest.raises(AsyncsideError) as info:
        anyio.run(go)
    assert str(info.value).startswith(f"the io_uring reader cannot start: {failure}") and said in str(info.value)
    assert str(info.value).endswith("the threads reader (--reader threads, reader='threads') reads without io_uring")
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--tokens", "2", "--reference", "none",
                      "--reader", "io_uring")
    assert rc in (1, 2) and err.startswith("asyncside demo: the io_uring reader cannot start: ") and len(
        err.strip().splitlines()) == 1, err


def test_a_command_started_with_stdout_closed_runs(quick_store: pathlib.Path) -> None:
    """``asyncside demo >&-`` (a script or process manager that closes stdout) was aborted by
    libuv, "uv__close: Assertion `fd > STDERR_FILENO' failed" (SIGABRT, a core dump): the event
    loop's first descriptor took number 1. The closed descriptors get the null device first, as
    serve's do; the run ends with status 0."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "asyncside", "demo", "--model", str(quick_store), "--tokens", "2",
                          "--reference", "none", "--quiet"],
                         stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
