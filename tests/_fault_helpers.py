"""Helpers for the fault tests: a hang guard, descriptor counting, ledger checks; a bare native fault
table over a small store and a tiny converted model (tests/test_queued.py, tests/test_streamed_faults.py)."""

from __future__ import annotations

import contextlib
import errno
import gc
import mmap
import os
import pathlib
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside import ExpertStore, _native
from asyncside.models import convert_model
from asyncside.pools import PoolSet

from _models_support import tiny_model


@contextlib.contextmanager
def native_read_settings_kept() -> Iterator[None]:
    """Put the process-wide fault-read settings back as they were: the chunk, the window (chosen
    for the process or not: a runtime that follows measures its disk when it was not), io_uring
    and reads in place (the test hooks)."""
    chunk, window, chosen = _native.fault_read_chunk(), _native.fault_read_window(), _native.fault_read_window_chosen()
    try:
        yield
    finally:
        _native.set_fault_read_chunk(chunk)
        if chosen:
            _native.set_fault_read_window(window)
        else:
            _native.testing.reset_fault_read_window()
        _native.testing.set_fault_read_uring(True)
        _native.testing.set_direct_in_place(True)


LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


def run_guarded(fn: Callable[..., Any], *args: Any, loop: tuple[str, dict[str, Any]], limit_s: float | None = None) -> Any:
    """``anyio.run(fn, *args)`` on ``loop`` in a daemon thread; fails the test if it never returns.

    A hang inside a shielded scope cannot be cancelled from the loop itself, so the test would
    hang with it; here the test fails instead, with the stuck thread's stack. ``limit_s`` (default
    $ASYNCSIDE_HANG_LIMIT_S, else 600) is only a hang detector, generous because a loaded CI
    machine is slow: never a performance assertion.
    """
    if limit_s is None:
        limit_s = float(os.environ.get("ASYNCSIDE_HANG_LIMIT_S", "600"))
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = anyio.run(fn, *args, backend=loop[0], backend_options=loop[1])
        except BaseException as exc:  # re-raised on the test's thread
            out["error"] = exc

    t = threading.Thread(target=target, name="guarded loop", daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        frame = sys._current_frames().get(t.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
        pytest.fail(f"the loop did not return within {limit_s:.0f} s (hung); its thread:\n{stack}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def direct_file(tmp_path: pathlib.Path, nbytes: int) -> pathlib.Path:
    """A file of ``nbytes`` random bytes; skips where its file system refuses O_DIRECT."""
    path = tmp_path / "blob.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip("this file system refuses O_DIRECT")
        raise
    return path


def cached_bytes(path: pathlib.Path) -> int:
    """Bytes of the file ``path`` in the page cache (mincore over a read-only mapping)."""
    from asyncside.memory import cached_pages

    pages = cached_pages(path)
    assert pages is not None, f"{path}: cannot tell its cached pages (mincore)"
    return sum(pages) * mmap.PAGESIZE


def direct_budget(store: ExpertStore, resident: float = 0.25) -> int:
    """A memory budget of ``store``'s pools at ``resident``, the plan's headroom and 1 MiB of page
    cache, which cannot hold the store's records outside the pools: the plan reads past the page
    cache (O_DIRECT), whatever the model's estimated headroom."""
    from asyncside.memory import pool_bytes
    from asyncside.runtime._plan import plan_headroom

    return pool_bytes(store, resident) + plan_headroom(store) + (1 << 20)


def open_fds() -> set[int]:
    """This process's open descriptors (Linux: /proc/self/fd), after a collection."""
    gc.collect()
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:  # the listdir's own descriptor, closed by now
            continue
        fds.add(fd)
    return fds


def describe_fds(fds: set[int]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(f"{fd} -> ?")
    return out


def assert_ledgers_clean(rt: Any) -> None:
    """Every ledger audits clean, nothing FILLING, and every LIVE row is listed in lookup()."""
    for layer, report in rt.audit().items():
        assert report.ok, (layer, report.problems)
        ledger = rt.ledger(layer)
        assert not ledger.pending(), (layer, ledger.pending())
        table = np.array(rt.lookup(layer))
        assert np.array_equal(table, ledger.lookup()), (layer, "lookup() is stale")


def fault_table(tmp_path: pathlib.Path, rows: int = 4, tag: bool = True) -> tuple[ExpertStore, PoolSet, Any]:
    """A one-layer store of 16 experts, host pools of ``rows`` rows and a native FaultTable over them
    (every expert absent). The segments: a uint32 weight, float16 scales and, with ``tag``, a
    one-byte uint8 segment (segments of several sizes and alignments in one record)."""
    rng = np.random.default_rng(0)
    arrays = {
        "w.weight": rng.integers(0, 2**32, size=(16, 5, 7), dtype=np.uint32),
        "w.scales": rng.standard_normal((16, 3)).astype(np.float16),
    }
    if tag:
        arrays["tag"] = rng.integers(0, 255, size=(16, 1), dtype=np.uint8)
    store = ExpertStore.create(tmp_path / "s", {0: arrays})
    spec = store.layer(0)
    pools = PoolSet(spec, rows, device=False)
    table = _native.FaultTable(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                               [s.offset for s in spec.segments], [s.nbytes for s in spec.segments],
                               os.open(spec.path, os.O_RDONLY), str(spec.path), spec.stride)
    table.sync(np.full(spec.n_experts, -1, dtype=np.int32))
    return store, pools, table


def direct_fault_table(tmp_path: pathlib.Path, layout: str, block: int = 4096,
                       seed: int = 1) -> tuple[ExpertStore, PoolSet, Any]:
    """A one-layer store of 16 experts of two segments, ``2 * width`` and ``width`` bytes ("blocks":
    ``width = block``, whole 4 KiB blocks end to end, read in place; "odd": a width off the block
    grid, read through the aligned buffer), host pools of 4 rows and an O_DIRECT fault table over
    them, every expert absent and rows 0-3 lent. Skips where the platform or file system has no O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    rng = np.random.default_rng(seed)
    width = block if layout == "blocks" else block - 96 * (block // 4096)
    store = ExpertStore.create(tmp_path / "s", {0: {
        "a": rng.integers(0, 255, size=(16, 2 * width), dtype=np.uint8),
        "b": rng.integers(0, 255, size=(16, width), dtype=np.uint8),
    }})
    spec = store.layer(0)
    pools = PoolSet(spec, 4, device=False)
    try:
        fd = os.open(spec.path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    table = _native.FaultTable(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                               [s.offset for s in spec.segments], [s.nbytes for s in spec.segments],
                               fd, str(spec.path), spec.stride)
    table.sync(np.full(spec.n_experts, -1, dtype=np.int32))
    table.set_direct(True)
    table.lend([0, 1, 2, 3])
    return store, pools, table


def eval_failed_step(node: mx.array) -> list[Any]:
    """Evaluate a fault node whose fault fails and return the rows it gave (row 0 where a fault
    failed). The node completes: a failed fault goes to the table's log, never thrown on MLX's
    stream thread, so MLX keeps no failure for a later call to raise (synchronize would)."""
    mx.eval(node)
    mx.synchronize(mx.default_stream(mx.cpu))
    return np.array(node).tolist()


def drain_events(table: Any) -> np.ndarray:
    """The table's fault log since the last drain: one row of six int64 fields per event."""
    return np.frombuffer(table.drain()[0], dtype=np.int64).reshape(-1, 6)


def assert_rows_hold(store: ExpertStore, pools: PoolSet, table: Any, experts: list[int]) -> None:
    """Each of ``experts`` is mapped to a row of ``pools`` that holds its record's bytes (layer 0)."""
    now = np.array(table.table())
    for e in experts:
        r = int(now[e])
        assert r >= 0, e
        for key, want in store.read_expert(0, e).items():
            assert bytes(pools.row_view(key, r)) == bytes(memoryview(want).cast("B")), (e, key)


def model_store(tmp: pathlib.Path, model_type: str, quantize: dict | None) -> tuple[pathlib.Path, Any, list[int]]:
    """A tiny mlx-lm model of ``model_type`` converted into a store under ``tmp`` (a quarter of each
    layer resident): the store's path, the model, and a fixed 12-token prompt."""
    model, config = tiny_model(model_type, quantize=quantize)
    save_model(tmp / "model", model)
    save_config(dict(config), tmp / "model" / "config.json")
    convert_model(tmp / "model", tmp / "store", resident_fraction=0.25, progress=False)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, config["vocab_size"], 12)]
    return tmp / "store", model, prompt


def direct_decode(store_dir: pathlib.Path, prompt: list[int], max_tokens: int, *, streamed: bool,
                  read_window: int | None = None, plans: list[Any] | None = None) -> list[int]:
    """Greedy queued decode of ``store_dir`` past the page cache (O_DIRECT: the caller sets
    ASYNCSIDE_DIRECT), nothing resident, streamed or resolved switches, the runtime given
    ``read_window``: the tokens, after the ledgers audited clean (the runtime's plan appended to
    ``plans``). Skips where the file system refuses O_DIRECT."""
    from asyncside.bridge import completed
    from asyncside.models import ForwardOptions, load_streaming_model
    from asyncside.models.forward import StepMode
    from asyncside.runtime import Runtime

    options = ForwardOptions(mode=StepMode.QUEUED, streamed_switch=streamed)
    sm = load_streaming_model(store_dir, completed=completed, options=options)
    k = int(sm.forward.walk.top_k)

    async def main() -> list[int]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k, read_window=read_window) as rt:
            if not rt.memory["direct"]:
                pytest.skip("this file system refuses O_DIRECT")
            if plans is not None:
                plans.append(rt.plan)
            tokens = [t async for t in sm.generate(prompt, max_tokens=max_tokens, source=rt)]
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
            return tokens

    return anyio.run(main)


def import_native_with(variable: str, value: str, expression: str) -> Any:
    """A fresh interpreter that imports the extension with ``variable=value`` in its environment and
    prints ``expression`` (of ``_native``): its completed process (stdout, stderr, returncode)."""
    import subprocess

    env = dict(os.environ, **{variable: value})
    return subprocess.run([sys.executable, "-c", f"from asyncside import _native; print({expression})"],
                          env=env, capture_output=True, text=True, timeout=300)


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch, under: pathlib.Path) -> None:
    """Opens of files under ``under`` with O_DIRECT fail with EINVAL, as ramfs and some FUSE mounts
    (and tmpfs before Linux 6.6) answer them."""
    import errno

    real = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0) and str(under) in str(path):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def deny_open(monkeypatch: pytest.MonkeyPatch, locked: str) -> None:
    """Python's ``open`` of the file ``locked`` fails with EACCES, as a file of another user (mode
    0600) answers; every other file opens."""
    import builtins
    import errno

    real_open = builtins.open

    def denying(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denying)
