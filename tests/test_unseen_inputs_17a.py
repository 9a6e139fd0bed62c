"""Unseen inputs, round 17a: what a user's process does around asyncside, not their model. A server
that loaded a model and then forks its workers (``os.fork``, multiprocessing's 'fork' start method,
a ``--preload``), Python's own switches (``-X dev``, warnings as errors, our pytest plugin in a
project that turns every warning into an error), the environment a process starts in, and the
threads and event loops the synchronous entry points are called from.

What cannot work says so in one line, at once: never a hang, never a traceback of ours."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

#: a child's script that waits forever is ended past this (SIGALRM), it and every process it forked
HANG_GUARD_S = 120


def _python(code: str, *args: str, env: dict[str, str] | None = None, cwd: pathlib.Path | None = None,
            extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child Python of a session of its own; its result. A child left waiting
    (its own forked children included, whose alarm is their own) is ended with its session."""
    guard = f"import signal; signal.alarm({HANG_GUARD_S})\n"
    proc = subprocess.Popen([sys.executable, *extra, "-c", guard + textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=2 * HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        out, err = "", "timed out"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it forked and left behind
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_FORKED = """
import json, multiprocessing, os, signal, sys
import mlx.core as mx
import mlx_lm
from asyncside.errors import AsyncsideError
from asyncside.facade import load

store = sys.argv[1]
model, tokenizer = load(store, resident=0.25)
before = mlx_lm.generate(model, tokenizer, "hello", max_tokens=3)
on_cpu = mx.default_device() == mx.cpu

def in_child(what):
    try:
        if what == "step" and on_cpu:
            return "ran: " + mlx_lm.generate(model, tokenizer, "hello", max_tokens=3)
        if what == "step":  # mlx-lm's first mx.array crashes a forked child on MLX CUDA: ours first
            return "ran: " + str(model([tokenizer.encode("hello")]).shape)
        if what == "stats":
            return "ran: " + str(model.stats())
        load(store, resident=0.25)
        return "ran: loaded"
    except AsyncsideError as exc:
        return str(exc)

said = {}
for what in ("step", "stats", "load"):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child ends as a script does, through the interpreter's exit (atexit)
        signal.alarm(60)  # its own: a fork clears the parent's
        os.close(r)
        os.write(w, in_child(what).encode())
        sys.exit(0)
    os.close(w)
    text = b""
    while chunk := os.read(r, 65536):
        text += chunk
    said[what] = (text.decode(), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
with multiprocessing.get_context("fork").Pool(1) as pool:
    said["pool"] = (pool.apply_async(in_child, ("step",)).get(timeout=60), 0)
after = mlx_lm.generate(model, tokenizer, "hello", max_tokens=3)
model.close()
print(json.dumps({"said": said, "same": before == after}))
"""


def test_a_model_loaded_before_a_fork_is_refused_in_the_child_at_once(quick_store: pathlib.Path) -> None:
    """A server that loads its model and then forks its workers (``os.fork``, multiprocessing's
    'fork' start method, gunicorn's ``--preload``): the worker's first ``generate`` waited forever
    (the runtime's loop thread, and MLX's threads, stayed in the parent), a ``load()`` of its own
    waited forever in MLX's loader, and a worker that left through ``sys.exit`` waited on the
    parent's runtime at exit. Each is one AsyncsideError saying to load in the workers, at once;
    the worker exits 0, and the parent's model goes on giving the same tokens."""
    out = _python(_FORKED, str(quick_store))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"], result
    for what, (said, status) in result["said"].items():
        assert status == 0, (what, said)
        if what == "load":
            assert said.startswith("this process was forked from process "), (what, said)
        else:
            assert said.startswith("this model was loaded in process "), (what, said)
        assert "Load the model in each worker process" in said and "'spawn'" in said, (what, said)


def test_a_command_run_in_a_deleted_directory_runs(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A shell left in a directory deleted under it (a build tree removed, a temporary directory
    cleaned): every command that imports mlx-lm, and ``import asyncside.models``, ended in a
    traceback, ``FileNotFoundError: [Errno 2] No such file or directory`` naming no file
    (transformers, which mlx-lm imports, resolves a relative path at import). The demo runs, and
    the process is still in the directory it was in."""
    out = _python("""
        import os, sys
        os.mkdir(sys.argv[2]); os.chdir(sys.argv[2]); os.rmdir(sys.argv[2])
        from asyncside.cli import main
        rc = main(["demo", "--model", sys.argv[1], "--tokens", "2", "--reference", "none", "--quiet"])
        try:
            os.getcwd()
        except FileNotFoundError:
            print("still in the deleted directory")
        sys.exit(rc)
    """, str(quick_store), str(tmp_path / "gone"), env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "still in the deleted directory" in out.stdout, out.stdout


def test_load_called_inside_a_trio_run_loads(quick_store: pathlib.Path) -> None:
    """``load()`` called synchronously from code that runs under trio (``trio.run``, anyio's plugin
    on trio, a trio program's set-up) failed: "RuntimeError: must be called from async context",
    from the runtime's task on the facade's asyncio thread, which had inherited the caller's
    context (sniffio's variable there said trio). The model loads and gives the tokens a load
    outside any loop gives."""
    import anyio
    import mlx_lm

    from asyncside.facade import load

    model, tokenizer = load(quick_store, resident=0.25)
    with model:
        expected = mlx_lm.generate(model, tokenizer, "hello", max_tokens=4)

    async def inside() -> str:
        model, tokenizer = load(quick_store, resident=0.25)
        with model:
            return str(mlx_lm.generate(model, tokenizer, "hello", max_tokens=4))

    assert anyio.run(inside, backend="trio") == expected


def test_threads_and_a_running_event_loop_get_the_tokens_of_the_main_thread(quick_store: pathlib.Path) -> None:
    """The synchronous front door as a notebook or a threaded server calls it: ``generate`` on one
    model from several threads at once, a model loaded in a thread and used on another, and
    ``load`` + ``generate`` inside a running asyncio loop (a notebook's cell): each gives the main
    thread's tokens, none waits forever."""
    import asyncio
    import threading

    import mlx_lm

    from asyncside.facade import load

    model, tokenizer = load(quick_store, resident=0.25)
    with model:
        expected = mlx_lm.generate(model, tokenizer, "hello", max_tokens=4)
        got: dict[str, str] = {}

        def generate(name: str, m: Any = model) -> None:
            got[name] = mlx_lm.generate(m, tokenizer, "hello", max_tokens=4)

        threads = [threading.Thread(target=generate, args=(f"thread {i}",)) for i in range(3)]
        loaded: list[Any] = []
        threads.append(threading.Thread(target=lambda: loaded.append(load(quick_store, resident=0.25)[0])))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=HANG_GUARD_S)
        assert not any(t.is_alive() for t in threads)
        with loaded[0]:
            generate("loaded in a thread", loaded[0])

        async def cell() -> str:
            inner, _ = load(quick_store, resident=0.25)
            with inner:
                return str(mlx_lm.generate(inner, tokenizer, "hello", max_tokens=4))

        got["in a running loop"] = asyncio.run(cell())
    assert got == dict.fromkeys(got, expected) and len(got) == 5, got


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_stdout_that_cannot_hold_the_text_shows_escapes(encoding: str, quick_store: pathlib.Path,
                                                        tmp_path: pathlib.Path) -> None:
    """``asyncside demo`` with a stdout of another encoding than UTF-8 (``PYTHONIOENCODING``, a
    legacy locale) ended half way, "UnicodeEncodeError: 'ascii' codec can't encode character" and
    a traceback, at the first character of the prompt or of a generated token it could not hold.
    Those are written as escapes, as Python's stderr writes them, and the run ends with status 0."""
    env = {**os.environ, "PYTHONIOENCODING": encoding, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "asyncside", "demo", "--model", str(quick_store), "--tokens", "2",
                          "--reference", "none", "--prompt", "h\u00e9llo \u2713"], capture_output=True, env=env,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr[-3000:]
    shown = "h\u00e9llo".encode(encoding, errors="backslashreplace") + b" \\u2713"
    assert shown in out.stdout, out.stdout[:2000]


_IN_A_THREAD = """
import sys, threading
import anyio
from asyncside import ExpertStore, Runtime, load_streaming_model

async def main(store):
    sm = load_streaming_model(store)
    async with Runtime(ExpertStore.open(store), resident=0.25) as rt:
        return [t async for t in sm.generate(sm.tokenizer.encode("Hello"), max_tokens=3, source=rt)]

got = []
worker = threading.Thread(target=lambda: got.append(anyio.run(main, sys.argv[1])))
worker.start()
worker.join()
print(len(got[0]))
"""


def test_a_worker_thread_that_ran_a_model_leaves_the_exit_clean(quick_store: pathlib.Path) -> None:
    """The README's loop run in a worker thread (a web app's background thread, a GUI's), the
    thread joined, the script ending: the process aborted at exit, "terminate called without an
    active exception" and status 134 (a core dump), in most runs, once the tokens were out. MLX's
    thread-local state takes the GIL in its destructor, which ran after the thread had left
    Python while the interpreter finalized. Each of several runs exits 0."""
    for _ in range(4):  # the abort is a race: most runs, not all, met it
        out = _python(_IN_A_THREAD, str(quick_store))
        assert out.returncode == 0 and out.stdout.strip() == "3", (out.returncode, out.stderr[-2000:])


_RUNTIME_FORKED = """
import os, sys, signal
import anyio
from asyncside import ExpertStore, Runtime
from asyncside.errors import AsyncsideError
from asyncside.testing import random_layers

store = ExpertStore.create(sys.argv[1], random_layers(2, 8))

async def main():
    async with Runtime(store, resident=0.5) as rt:
        await rt.ensure(0, [0, 1])
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)
            os.close(r)
            try:
                rt.prefetch(0, [5, 6])
                said = "accepted"
            except AsyncsideError as exc:
                said = str(exc)
            os.write(w, said.encode())
            os._exit(0)
        os.close(w)
        text = b""
        while chunk := os.read(r, 65536):
            text += chunk
        os.waitpid(pid, 0)
        print(text.decode())
        with anyio.fail_after(30):
            await rt.ensure(0, [5, 6, 2])
        print("parent audit", all(rep.ok for rep in rt.audit().values()))

anyio.run(main)
"""


def test_a_runtime_used_in_a_forked_child_is_refused_there(tmp_path: pathlib.Path) -> None:
    """An open Runtime in a child forked from its process passed every check (the forking thread's
    id, no running loop): a prefetch went into the parent's reader, whose io_uring ring the child
    shares. It is refused at once, naming the process it was created in; the parent goes on."""
    done = _python(_RUNTIME_FORKED, str(tmp_path / "store"))
    assert done.returncode == 0, done.stderr[-2000:]
    said, audit = done.stdout.strip().splitlines()[-2:]
    assert "this process was forked from it" in said and "enter a Runtime of its own here" in said, said
    assert audit == "parent audit True"
