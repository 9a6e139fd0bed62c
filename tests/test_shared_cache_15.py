"""Several processes, one cache: what a user's machine does with asyncside's on-disk state when more
than one asyncside process works on the same files. Two ``demo``s started at once on a fresh machine
(both build the embedded model), a ``serve`` and a notebook's ``load()`` converting the same model,
a conversion killed with SIGKILL, a cache on a filesystem that takes no locks (Lustre without its
flock option), two ``convert`` commands into one directory.

Every test runs real processes (a child Python each), started together behind a barrier of files;
nothing asserts a duration. A child can be given a filesystem that takes no locks (its ``flock``
fails with ENOSYS, as Lustre's does) and a point at which it kills itself with SIGKILL.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

from asyncside.hub import stores_root
from asyncside.models.convert import STAGING_LOCK
from asyncside.store import ExpertStore

#: a child: ``python -c CHILD SETUP_JSON``; SETUP says what it does (see ``child``)
CHILD = r'''
import errno, fcntl, json, os, pathlib, signal, sys, time
setup = json.loads(sys.argv[1])
if setup.get("no_locks"):
    def flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    fcntl.flock = flock
import asyncside.models.convert as convert
kill_at = setup.get("kill_at")
if kill_at == "layer":  # writing the records: the store's second layer
    real_item = convert._LayerFeed.__getitem__
    handed = []
    def item(self, layer):
        handed.append(layer)
        if len(handed) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_item(self, layer)
    convert._LayerFeed.__getitem__ = item
if kill_at == "written" or setup.get("hold"):  # every file of the store written, not yet renamed
    real_summary = convert._write_summary
    def summary(*args):
        real_summary(*args)
        if kill_at == "written":
            os.kill(os.getpid(), signal.SIGKILL)
        hold = pathlib.Path(setup["hold"])
        pathlib.Path(str(hold) + ".reached").touch()
        while not hold.exists():
            time.sleep(0.01)
    convert._write_summary = summary
if setup.get("barrier"):
    bar = pathlib.Path(setup["barrier"])
    (bar / f"{os.getpid()}").touch()
    while len(list(bar.iterdir())) < setup["parties"]:
        time.sleep(0.005)
what = setup["what"]
if what == "store_for":
    from asyncside.hub import store_for
    print(json.dumps({"store": str(store_for(setup["model"], cache_dir=setup["cache"], progress=False))}))
elif what == "embedded":
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.bench.generate import _quick_spec
    model, store = ensure_embedded_default(setup["cache"], spec=_quick_spec(), progress=True)
    print(json.dumps({"store": str(store)}))
elif what == "convert":
    from asyncside.cli import main
    sys.exit(main(["convert", setup["model"], setup["dest"], "--quiet", *setup.get("args", [])]))
'''


def child(tmp_path: pathlib.Path, **setup: Any) -> subprocess.Popen[str]:
    """A child Python doing ``setup["what"]``: ``store_for`` (of ``model`` into ``cache``),
    ``embedded`` (the quick embedded model into ``cache``) or ``convert`` (the command, ``model``
    into ``dest``); with ``no_locks`` its flock fails as a filesystem without locks makes it,
    with ``kill_at`` ("layer", "written") it kills itself with SIGKILL there, with ``hold`` it
    waits before renaming its store into place until that file exists (having made
    ``hold + ".reached"``), with ``barrier`` it starts with ``parties`` others."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(setup)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def together(tmp_path: pathlib.Path, n: int, **setup: Any) -> list[tuple[int, str, str]]:
    """``n`` children doing the same, started together; (returncode, stdout, stderr) of each."""
    bar = tmp_path / f"barrier-{len(list(tmp_path.glob('barrier-*')))}"
    bar.mkdir()
    procs = [child(tmp_path, barrier=str(bar), parties=n, **setup) for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append((p.returncode, stdout, stderr))
    return out


def leftovers(directory: pathlib.Path) -> list[str]:
    """What ``directory`` holds besides stores, builds and their lock files: temporary and
    staging directories."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))


@pytest.fixture
def model_dir(quick_store: pathlib.Path) -> pathlib.Path:
    return quick_store.parent / "model"


def test_two_processes_converting_one_model_into_one_cache_convert_it_once(model_dir: pathlib.Path,
                                                                            tmp_path: pathlib.Path) -> None:
    """``serve --model DIR`` and a notebook's ``load(DIR)`` started at once on a fresh cache: one
    converts, the other waits for it and takes its store; neither reads a half-written store."""
    cache = tmp_path / "cache"
    runs = together(tmp_path, 2, what="store_for", model=str(model_dir), cache=str(cache))
    assert all(rc == 0 for rc, _, _ in runs), runs
    stores = {json.loads(out)["store"] for _, out, _ in runs}
    assert len(stores) == 1
    ExpertStore.open(stores.pop()).verify()
    assert sum("converting to an expert store" in err for _, _, err in runs) == 1, runs
    assert leftovers(stores_root(cache)) == []


def test_two_first_builds_of_the_embedded_model_at_once_build_it_once(tmp_path: pathlib.Path) -> None:
    """The README's first command run twice at once on a fresh machine: both get the one build."""
    cache = tmp_path / "cache"
    runs = together(tmp_path, 2, what="embedded", cache=str(cache))
    assert all(rc == 0 for rc, _, _ in runs), runs
    stores = {json.loads(out)["store"] for _, out, _ in runs}
    assert len(stores) == 1
    ExpertStore.open(stores.pop()).verify()
    assert leftovers(cache) == []


@pytest.mark.parametrize("what", ["store_for", "embedded"])
def test_a_cache_on_a_filesystem_without_locks_serves_processes_started_at_once(what: str, model_dir: pathlib.Path,
                                                                                tmp_path: pathlib.Path) -> None:
    """A cache on a filesystem that takes no locks (Lustre mounted without its flock option, an HPC
    cluster's home directory: flock fails with ENOSYS) was ``OSError: [Errno 38] Function not
    implemented`` and a traceback for every first use. Processes there go on unlocked: two at once
    may both convert, and each publishes its store by a rename the other's cannot spoil."""
    cache = tmp_path / "cache"
    runs = together(tmp_path, 2, what=what, model=str(model_dir), cache=str(cache), no_locks=True)
    assert all(rc == 0 for rc, _, _ in runs), runs
    assert not any("Traceback" in err for _, _, err in runs), runs
    stores = {json.loads(out)["store"] for _, out, _ in runs}
    assert len(stores) == 1
    ExpertStore.open(stores.pop()).verify()
    assert leftovers(stores_root(cache) if what == "store_for" else cache) == []


def test_a_killed_conversion_on_a_filesystem_without_locks_is_removed_by_the_next(model_dir: pathlib.Path,
                                                                                  tmp_path: pathlib.Path) -> None:
    """Where no lock tells a live conversion's staging directory from a killed one's, the owner
    file it holds does: the next conversion removes the directory of a process of this host that
    is gone (not one, GBs for a large model, per kill), and leaves a live process's alone."""
    cache = tmp_path / "cache"
    killed = child(tmp_path, what="store_for", model=str(model_dir), cache=str(cache), no_locks=True,
                   kill_at="layer")
    killed.communicate(timeout=240)
    assert killed.returncode == -signal.SIGKILL
    root = stores_root(cache)
    [staging] = [p for p in root.iterdir() if ".convert-" in p.name]
    assert (staging / STAGING_LOCK).is_file()
    # A conversion still running in this process (the test's), beside it.
    live = root / (staging.name.rsplit("-", 1)[0] + "-live")
    live.mkdir()
    from asyncside.models.convert import owner_line

    (live / STAGING_LOCK).write_text(owner_line())
    again = child(tmp_path, what="store_for", model=str(model_dir), cache=str(cache), no_locks=True)
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    ExpertStore.open(json.loads(out)["store"]).verify()
    assert leftovers(root) == [live.name]


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_converts_into_one_directory_never_leave_a_traceback_or_take_the_others_store(
        overwrite: bool, model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """``asyncside convert MODEL OUT`` run twice at once (a CI matrix, a script run twice): the one
    that finished second renamed the other's store away without --overwrite, or met it in the
    rename ("Directory not empty" and a traceback). Now without --overwrite it is refused in one
    line once its own store is written, and with --overwrite it replaces the other's."""
    dest = tmp_path / "out"
    hold = tmp_path / "hold"
    args = ["--overwrite"] if overwrite else []
    second = child(tmp_path, what="convert", model=str(model_dir), dest=str(dest), hold=str(hold), args=args)
    reached = pathlib.Path(str(hold) + ".reached")
    while not reached.exists():  # the second has written its store, not yet renamed it into place
        assert second.poll() is None, second.communicate()
        threading.Event().wait(0.02)
    first = child(tmp_path, what="convert", model=str(model_dir), dest=str(dest), args=args)
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    first_manifest = (dest / "manifest.json").stat().st_ino
    hold.touch()
    _, err = second.communicate(timeout=240)
    assert "Traceback" not in err, err
    if overwrite:
        assert second.returncode == 0, err
        assert (dest / "manifest.json").stat().st_ino != first_manifest
    else:
        assert second.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{dest}: already exists: another conversion made it while this one ran" in err, err
        assert (dest / "manifest.json").stat().st_ino == first_manifest
    ExpertStore.open(dest).verify()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("what", ["store_for", "embedded"])
def test_a_process_that_waits_for_another_s_conversion_says_so(what: str, model_dir: pathlib.Path,
                                                              tmp_path: pathlib.Path) -> None:
    """A second ``serve --model ORG/NAME`` (or ``demo``) started while the first converts the model
    (minutes, for a large one) waited without a word, as if hung. It says whose work it waits for."""
    from asyncside.bench.generate import _quick_spec
    from asyncside.hub import _cached_store_name

    cache = tmp_path / "cache"
    if what == "store_for":
        lock = stores_root(cache) / f".{_cached_store_name(str(model_dir), model_dir)}.lock"
        said = f"asyncside: {model_dir}: another process is converting it into "
    else:
        lock = cache / f".embedded-{_quick_spec().key()}.lock"
        said = "asyncside: another process is building the embedded model in "
    lock.parent.mkdir(parents=True)
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the first process holds it while it converts
        waiter = child(tmp_path, what=what, model=str(model_dir), cache=str(cache))
        lines: queue.Queue[str] = queue.Queue()
        assert waiter.stderr is not None
        threading.Thread(target=lambda: [lines.put(line) for line in waiter.stderr], daemon=True).start()
        seen = []
        while not seen or said not in seen[-1]:
            try:
                seen.append(lines.get(timeout=90))
            except queue.Empty:
                waiter.kill()
                pytest.fail(f"the waiting process said nothing of the lock it waits for: {seen}")
        assert waiter.poll() is None
    assert waiter.wait(timeout=240) == 0, seen


@pytest.mark.parametrize("kill_at", ["layer", "written"])
def test_a_conversion_killed_half_way_is_converted_again_and_its_leftovers_removed(
        kill_at: str, model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """``load(DIR)`` killed by the OOM killer while it converts (writing the records, or with every
    file written and the rename to come): the next run never takes the half store, converts again,
    and removes what the killed one left (its lock died with it)."""
    cache = tmp_path / "cache"
    killed = child(tmp_path, what="store_for", model=str(model_dir), cache=str(cache), kill_at=kill_at)
    killed.communicate(timeout=240)
    assert killed.returncode == -signal.SIGKILL
    root = stores_root(cache)
    assert [p.name for p in root.iterdir() if ".convert-" in p.name] != []
    assert not any((p / "manifest.json").exists() for p in root.iterdir())
    again = child(tmp_path, what="store_for", model=str(model_dir), cache=str(cache))
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0 and "converting to an expert store" in err, err
    ExpertStore.open(json.loads(out)["store"]).verify()
    assert leftovers(root) == []


@pytest.fixture
def read_only_cache(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> Any:
    """A cache another user (or machine) filled, mounted read-only here: the quick embedded model
    built and a copy of ``model_dir`` converted into it. Yields (the read-only mount, the
    directory it mounts, which stays writable, the model copy). Needs root and mount permission."""
    import shutil

    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    filled, mount, model = tmp_path / "filled", tmp_path / "mount", tmp_path / "model"
    shutil.copytree(model_dir, model)
    mount.mkdir()
    for run in (child(tmp_path, what="embedded", cache=str(filled)),
                child(tmp_path, what="store_for", model=str(model), cache=str(filled))):
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
    r = subprocess.run(["mount", "--bind", str(filled), str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")
        yield mount, filled, model
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def cli(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncside.cli", *args], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp_path)))


def test_a_read_only_cache_another_filled_is_used_as_it_is(read_only_cache: Any, tmp_path: pathlib.Path) -> None:
    """Loading from a cache on a read-only mount (another machine filled it) makes no lock or
    temporary file: the embedded model and a converted model are taken as they are, and run."""
    mount, filled, model = read_only_cache
    for what in ("embedded", "store_for"):
        run = child(tmp_path, what=what, model=str(model), cache=str(mount))
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
        assert json.loads(out)["store"].startswith(str(mount))
    ran = cli(tmp_path, "demo", "--model", str(model), "--cache-dir", str(mount), "--tokens", "2",
              "--reference", "none", "--json")
    assert ran.returncode == 0, ran.stderr


def test_a_read_only_cache_whose_model_changed_since_says_why_it_would_convert(read_only_cache: Any,
                                                                              tmp_path: pathlib.Path) -> None:
    """A model directory saved again since another machine converted it into a read-only cache:
    the refusal named the lock file it could not make ("cannot build in this cache directory"),
    not why the store the cache holds was not taken. It says what changed, and the way out."""
    mount, _filled, model = read_only_cache
    st = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ran = cli(tmp_path, "demo", "--model", str(model), "--cache-dir", str(mount), "--tokens", "2",
              "--reference", "none")
    assert ran.returncode != 0 and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert f"{model}: config.json changed since its store {mount / 'stores'}" in ran.stderr, ran.stderr
    assert "Read-only file system" in ran.stderr and "--cache-dir DIR" in ran.stderr, ran.stderr


def test_a_read_only_cache_holding_another_s_killed_build_is_one_line(read_only_cache: Any,
                                                                      tmp_path: pathlib.Path) -> None:
    """``asyncside demo`` on a read-only cache without its embedded model, holding the half of a
    build another machine's process was killed in: looking for leftovers to remove opened a lock
    file there, ``OSError: [Errno 30] Read-only file system`` and a traceback. It is the one line
    of a cache that cannot be written, and the leftover is left to its writer."""
    from asyncside.models.embedded import EmbeddedSpec

    mount, filled, _model = read_only_cache
    leftover = filled / f".embedded-{EmbeddedSpec().key()}.tmp-killed"
    (leftover / "model").mkdir(parents=True)
    ran = cli(tmp_path, "demo", "--cache-dir", str(mount), "--tokens", "2", "--reference", "none")
    assert ran.returncode != 0 and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert f"asyncside demo: {mount}/.embedded-" in ran.stderr, ran.stderr
    assert "cannot build in this cache directory: Read-only file system" in ran.stderr, ran.stderr
    assert leftover.is_dir()


def test_a_hub_snapshot_downloaded_again_elsewhere_reuses_the_shared_cache_s_store(model_dir: pathlib.Path,
                                                                                   tmp_path: pathlib.Path) -> None:
    """Machines sharing one asyncside cache (a CI matrix, a cluster's shared mount), each with the
    same Hugging Face snapshot in a cache of its own at the same path: the store was keyed by the
    files' modification times, which each machine's download has its own, so every machine
    converted the model again (minutes to hours, over the store the others serve from; on a
    read-only cache, a refusal). A snapshot's files link to blobs named by their content's hash:
    the same blobs are the same model; another blob is another, whatever the times."""
    import hashlib

    snapshot = tmp_path / "hf" / "models--org--tiny" / "snapshots" / ("c" * 40)
    blobs = tmp_path / "hf" / "models--org--tiny" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in model_dir.iterdir():
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    cache = tmp_path / "cache"

    def first_use() -> str:
        run = child(tmp_path, what="store_for", model=str(snapshot), cache=str(cache))
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
        return err

    assert "converting to an expert store" in first_use()
    for blob in blobs.iterdir():  # the same snapshot as another machine downloaded it
        st = blob.stat()
        os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert "using the store converted on first use" in first_use()
    config = (snapshot / "config.json").read_text()  # a new revision's config
    blob = blobs / hashlib.sha256(config.encode() + b" ").hexdigest()
    blob.write_text(config + " ")
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    assert "config.json changed since its store was converted" in first_use()


def test_the_embedded_model_s_build_killed_half_way_is_built_again_and_its_leftovers_removed(
        tmp_path: pathlib.Path) -> None:
    """``asyncside demo``'s first build of the embedded model killed by the OOM killer while it
    converts: no build is taken from the half, the next run builds it and removes the half."""
    cache = tmp_path / "cache"
    killed = child(tmp_path, what="embedded", cache=str(cache), kill_at="layer")
    killed.communicate(timeout=240)
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in cache.iterdir() if p.name.startswith(".embedded-") and ".tmp-" in p.name] != []
    assert not any(p.name.startswith("embedded-") for p in cache.iterdir())
    again = child(tmp_path, what="embedded", cache=str(cache))
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    ExpertStore.open(json.loads(out)["store"]).verify()
    assert leftovers(cache) == []


def test_two_demos_recording_routing_into_one_file_leave_one_whole_trace(quick_store: pathlib.Path,
                                                                          tmp_path: pathlib.Path) -> None:
    """``asyncside demo --record-routing trace.npz`` run twice at once: each writes its trace
    beside the file and renames it over, so the file is one run's whole trace, never the two
    interleaved, and nothing is left beside it."""
    from asyncside.routing import RoutingTrace

    trace = tmp_path / "trace.npz"
    runs = [subprocess.Popen([sys.executable, "-m", "asyncside.cli", "demo", "--model", str(quick_store),
                              "--tokens", str(tokens), "--reference", "none", "--json",
                              "--record-routing", str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp_path)))
            for tokens in (6, 9)]
    for run in runs:
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
    recorded = RoutingTrace.load(trace)
    assert recorded.meta["source"] == "recorded" and recorded.ids.shape[0] > 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("trace")) == ["trace.npz"]


def test_convert_overwrite_replaces_a_link_to_a_store(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """``asyncside convert MODEL current --overwrite`` where ``current`` is a link to a store (one
    kept per version, the link naming the one in use): the link is replaced by the new store, the
    store it named is left as it was. The rename onto the link is "Not a directory": it is moved
    away first, as a store in its place is."""
    versions = tmp_path / "v1"
    made = cli(tmp_path, "convert", str(model_dir), str(versions), "--quiet")
    assert made.returncode == 0, made.stderr
    link = tmp_path / "current"
    link.symlink_to(versions)
    ran = cli(tmp_path, "convert", str(model_dir), str(link), "--overwrite", "--quiet")
    assert ran.returncode == 0, ran.stderr
    assert not link.is_symlink() and (link / "manifest.json").is_file()
    ExpertStore.open(link).verify()
    ExpertStore.open(versions).verify()
    assert leftovers(tmp_path) == []
