"""``asyncside bench offload``: generation from a model larger than memory, each system in a memory cgroup.

For each model shape (built by :mod:`asyncside.bench.shapes`, with fewer layers on a small
machine) and each routing locality (the synthetic presets of :data:`asyncside.routing.LOCALITIES`,
and the user's own routing files given with ``--routing``, each fitted onto the shape by
:func:`fit_routing`; replayed in every MoE layer of every system: :mod:`asyncside.models.forcing`), the same greedy
generation runs in a subprocess per system, each inside a fresh memory cgroup whose limit (the
budget, ``--memory``) charges the page cache too, after the page cache was dropped:

- ``asyncside``: :class:`asyncside.runtime.Runtime` with ``resident="auto", memory=budget`` (it sizes
  its pools to the budget and reads past the page cache when the rest does not fit);
- ``slot-cache``: the baseline (:mod:`asyncside.bench.slot_cache`) with the pool rows asyncside's
  plan chose, reading with O_DIRECT;
- ``mlx-lm``: the all-resident mlx-lm model loaded under the same limit, what a user tries first
  (its tok/s, or that it cannot run and why: the cgroup's OOM killer, at what peak).

The store is at least 4x the budget. Each run generates for ``--seconds`` (or ``--tokens``). Per
run: decode tok/s; hit rate and its fraction of Belady's MIN over the same demands from the same
starting rows, twice: MIN with bypass over every row of each layer (the absolute optimum: it may
decline to cache a miss and evict a pinned expert), and MIN under the ledger's rule (every demanded
expert takes a row, pinned experts stay pinned: :func:`asyncside.policy_replay.belady_no_bypass`),
the most any policy of the run's ledger could hit; misses' MB per token (misses x record size);
disk MB per token (the process's ``read_bytes`` up to the last token); what loading read (the
model and the store, the rows' warm-up, and asyncside's passes measuring its disk's read window,
which its first token waits for); the peak memory the cgroup charged. Per shape: the disk's random-read bandwidth
at the record size and the runtime's queue depth, with O_DIRECT (``bench io``'s reader pass) in
the same run; the I/O limit (that bandwidth / the bytes per token the misses and, under a
predictor, queued steps' prefetches read); the compute limit
(all-resident mlx-lm tok/s with no limit, same routing); and tok/s / min(the two limits) (of the
one measured where the other is not: the column says which).

Memory cgroups: v2 (a directory under the unified hierarchy with the memory controller enabled,
``memory.max``, ``memory.swap.max`` 0) or v1 (``memory/``: ``memory.limit_in_bytes``, and
``memory.memsw.limit_in_bytes`` where swap accounting exists); both charge the page cache. Making
one needs root: where none can be made the bench says why and stops.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from ..argtypes import directory, file_name, int_at_least, policy_name, positive_float, vocab_size
from ..errors import AsyncsideError
from ..memory import memory_arg
from ..policies import DEFAULT_POLICY, POLICY_NAMES
from . import check_store_dir

__all__ = ["CgroupError", "MemoryCgroup", "add_offload_arguments", "main", "run_offload_bench"]

SYSTEMS = ("asyncside", "slot-cache", "mlx-lm")
#: shape:decoder layers of the default run (about 2.3 GB of experts each; a large GPU host runs all 48 / 61)
DEFAULT_SHAPES = ("qwen3-30b-a3b:6", "deepseek-v3-like:3")
LOCALITY_NAMES = ("low", "middle", "high")
#: the store must hold at least this many times the budget
STORE_OVER_BUDGET = 4.0
#: tokens of every synthetic trace (positions past it wrap around)
TRACE_TOKENS = 4096
MB = 1e6
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


class CgroupError(AsyncsideError):
    """No memory cgroup can be made here (the message says why)."""


# ---- memory cgroups ----------------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """Bytes of ``text``: an int, or a number with K/M/G/T (powers of 1024, with or without B or iB),
    e.g. ``800M``, ``1.5G``, ``1536MiB``, ``2GB`` (:func:`asyncside.memory.parse_size`); it must be positive."""
    from ..memory import parse_size as _parse

    value = _parse(text)
    if value <= 0:
        raise ValueError(f"expected a positive size, got {text!r}")
    return value


def cgroup_version(root: pathlib.Path = CGROUP_ROOT) -> int:
    """1 or 2: which memory cgroup hierarchy this machine has mounted (CgroupError if neither)."""
    if (root / "cgroup.controllers").is_file():
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            raise CgroupError(f"{root}: cgroup v2 without the memory controller (cgroup.controllers)")
        return 2
    if (root / "memory" / "memory.limit_in_bytes").is_file():
        return 1
    raise CgroupError(f"{root}: no memory cgroup hierarchy mounted (neither v2 cgroup.controllers "
                      f"nor v1 memory/memory.limit_in_bytes)")


class MemoryCgroup:
    """A fresh memory cgroup limited to ``limit`` bytes (page cache charged); removed on exit.

    ``wrap(cmd)`` is ``cmd`` started inside it; after the process ended, :meth:`peak` is the most
    memory it charged and :meth:`oom_kills` how many processes its OOM killer ended.
    """

    _count = 0

    def __init__(self, limit: int, *, root: pathlib.Path = CGROUP_ROOT, name: str = "asyncside-offload") -> None:
        self.limit = int(limit)
        self.version = cgroup_version(root)
        MemoryCgroup._count += 1
        leaf = f"{name}-{os.getpid()}-{MemoryCgroup._count}"
        self.path = (root / "memory" / leaf) if self.version == 1 else (root / leaf)

    def __enter__(self) -> MemoryCgroup:
        try:
            self.path.mkdir()
        except OSError as exc:
            raise CgroupError(f"cannot create the memory cgroup {self.path}: {exc.strerror} "
                              f"(it needs root and a writable cgroup hierarchy)") from None
        try:
            if self.version == 1:
                self._write("memory.limit_in_bytes", self.limit)
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    self._write("memory.memsw.limit_in_bytes", self.limit)  # no escape into swap
            else:
                if not (self.path / "memory.max").exists():
                    raise CgroupError(f"{self.path}: no memory.max (the parent's cgroup.subtree_control "
                                      f"does not enable +memory)")
                self._write("memory.max", self.limit)
                if (self.path / "memory.swap.max").exists():
                    self._write("memory.swap.max", 0)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _write(self, name: str, value: int | str) -> None:
        try:
            (self.path / name).write_text(f"{value}\n")
        except OSError as exc:
            raise CgroupError(f"cannot write {value} to {self.path / name}: {exc.strerror}") from None

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    @property
    def procs(self) -> pathlib.Path:
        return self.path / "cgroup.procs"

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run by a shell that first moves itself into this cgroup (so every byte it charges counts)."""
        return ["/bin/sh", "-c", f'echo $$ > {shlex.quote(str(self.procs))} && exec "$@"', "sh", *cmd]

    def peak(self) -> int | None:
        """The most memory charged (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``), None if unknown."""
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak").strip()
        return int(text) if text.isdigit() else None

    def oom_kills(self) -> int:
        """Processes its OOM killer ended (v1 ``memory.oom_control``, v2 ``memory.events``)."""
        for line in self._read("memory.oom_control" if self.version == 1 else "memory.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup (its processes must have ended; retried briefly while the kernel lets go)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


#: :func:`check_cgroups`' words for a limit too small for any process (the cgroup itself works)
_OOM_KILLED = "was killed (out of memory)"


def check_cgroups(limit: int) -> tuple[bool, str]:
    """(whether a memory cgroup of ``limit`` bytes can be made and used here, the reason if not)."""
    try:
        with MemoryCgroup(limit) as cg:
            out = subprocess.run(cg.wrap(["/bin/true"]), capture_output=True, text=True, timeout=30)
            if out.returncode == -signal.SIGKILL:  # the cgroup's OOM killer: the limit, not the cgroup
                return False, (f"a process moved into {cg.path} {_OOM_KILLED}: a budget of "
                               f"{limit} bytes does not hold even /bin/true")
            if out.returncode != 0:
                return False, f"cannot move a process into {cg.path}: {out.stderr.strip()}"
        return True, f"cgroup v{cg.version}"
    except CgroupError as exc:
        return False, str(exc)


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); whether it was dropped."""
    from .generate import drop_caches as _drop

    return bool(_drop())


# ---- one run in a child process ----------------------------------------------------------------


def _read_bytes() -> int:
    """This process's ``read_bytes`` (bytes it caused to be read from storage)."""
    from ..memory import proc_self_bytes

    return proc_self_bytes("io", "read_bytes")


def _rss() -> int:
    from ..memory import proc_self_bytes

    return proc_self_bytes("status", "VmRSS")


def _phase(name: str) -> None:
    print(f"PHASE {name} rss={_rss()}", file=sys.stderr, flush=True)


async def generate_measured(rt: Any, sm: Any, layers: Any, prompt: list[int], max_tokens: int, predictor: str,
                            arrived: Any, started: Any = None) -> tuple[float, int, dict[str, Any]]:
    """Generate with the entered runtime ``rt`` until ``arrived(token)`` says stop, in the
    "generating" phase: (the start time, the process's read bytes at the start, ``{"stats": the
    runtime's stats after its reads drained, "rows": rows of each of ``layers``, "warm": the experts
    their rows hold before the first step, "pinned": of those, the pinned ones}``).
    ``started(read_bytes)`` is called once the start is taken, before the first step."""
    _phase("generating")
    io1 = _read_bytes()
    if started is not None:
        started(io1)
    import numpy as np

    # What the rows hold before the first step (the runtime warms them): MIN starts from the same.
    warm = {str(layer): [int(e) for e in np.flatnonzero(rt.ledger(layer).lookup() >= 0)] for layer in layers}
    pinned = {str(layer): [int(e) for e in rt.ledger(layer).resident] for layer in layers}
    t0 = time.perf_counter()
    agen: Any = sm.generate(prompt, max_tokens=max_tokens, source=rt, predictor=predictor)
    async with contextlib.aclosing(agen):
        async for tok in agen:
            if arrived(tok):
                break
    await rt.drain()
    rows = {str(layer): int(rt.ledger(layer).rows) for layer in layers}
    return t0, io1, {"stats": dict(rt.stats()), "rows": rows, "warm": warm, "pinned": pinned}


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one system as ``spec`` says (in the current process, usually a cgroup's); its figures."""
    import mlx.core as mx

    from ..models import load_reference_model, load_streaming_model
    from ..models.forcing import force_reference
    from ..store import ExpertStore

    system, store_dir = spec["system"], spec["store"]
    prompt, seconds, max_tokens = list(spec["prompt"]), float(spec["seconds"]), int(spec["tokens"])
    out: dict[str, Any] = {"system": system}
    t_load = time.perf_counter()
    io0 = _read_bytes()
    _phase("loading")
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    replay = sm.set_routing(spec["routing"]) if spec.get("routing") else None
    tokens: list[int] = []
    stamps: list[float] = []
    stopped: list[int] = []  # the process's read bytes when the last token arrived
    parts: dict[str, int] = {}  # what the system read while loading, besides the model and the store

    def arrived(tok: int) -> bool:
        tokens.append(tok)
        stamps.append(time.perf_counter())
        stop = len(tokens) >= max_tokens or stamps[-1] - stamps[0] >= seconds
        if stop:
            # A run that ends by --seconds has a step queued ahead of its last token (asyncside's
            # queued steps), whose reads go on until the runtime drains: for a token never
            # generated, and counted as no miss. The disk's bytes are the tokens' up to here.
            stopped.append(_read_bytes())
        return stop

    if system == "mlx-lm":
        from mlx_lm.generate import generate_step

        model, _config = load_reference_model(store_dir)
        if replay is not None:
            force_reference(model, sm.arch.block_attr, replay)
        del sm
        out["load_s"] = time.perf_counter() - t_load
        _phase("generating")
        io1 = _read_bytes()
        t0 = time.perf_counter()
        for y, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            if arrived(int(y)):
                break
        out.update(stats={}, rows_per_layer=None)
    elif system == "slot-cache":
        from .slot_cache import SlotCache, slot_generate

        io_enter = _read_bytes()
        with SlotCache(store, float(spec["fraction"]), direct=True) as sc:
            out["load_s"] = time.perf_counter() - t_load
            parts["warm_rows"] = _read_bytes() - io_enter
            # What the slots hold before the first step (it starts as the runtime's rows do): MIN
            # starts from the same, as asyncside's does; from empty rows it is no bound on them.
            out["warm_experts"] = {str(layer): sorted(sc.holds(layer)) for layer in store.layers}
            _phase("generating")
            io1 = _read_bytes()
            t0 = time.perf_counter()
            for tok in slot_generate(sm, sc, prompt, max_tokens=max_tokens):
                if arrived(tok):
                    break
            st = sc.stats()
            out["stats"] = {"hits": int(st["hits"]), "misses": int(st["misses"]), "bytes_read": int(st["bytes_read"])}
            out["rows_per_layer"] = {str(k): int(v) for k, v in st["slots"].items()}
    elif system == "asyncside":
        import anyio

        from ..runtime import Runtime

        async def run() -> tuple[float, int, dict[str, Any]]:
            kwargs: dict[str, Any] = {"resident": "auto", "memory": int(spec["budget"]), "policy": spec["policy"]}
            try:
                rt = Runtime(store, **kwargs)
            except TypeError:  # a runtime without a memory budget: size the pools as the slot cache's
                rt = Runtime(store, resident=float(spec["fraction"]), direct=True, policy=spec["policy"])
            io_enter = _read_bytes()
            async with rt:
                out["load_s"] = time.perf_counter() - t_load
                entry, warm = _read_bytes() - io_enter, int(rt.stats()["warm_bytes"])
                # Entering reads the rows' warm-up and, where the plan reads past the page cache,
                # passes over the store that measure its disk's read window (asyncside/read_window.py)
                parts.update(warm_rows=warm, measuring_the_disk=max(0, entry - warm))
                out["memory_plan"] = {k: v for k, v in dict(rt.memory).items()
                                      if isinstance(v, (int, float, str, bool))}
                # the ordered reads' window and the disk's rates it came from (None: reads buffered)
                out["read_window"] = rt.memory.get("read_window")
                return await generate_measured(rt, sm, store.layers, prompt, max_tokens, spec["predictor"], arrived)

        t0, io1, got = anyio.run(run, backend="asyncio")
        st = got["stats"]
        out["stats"] = {"hits": int(st["hits"]), "misses": int(st["misses"]), "bytes_read": int(st["bytes_read"]),
                        "direct": bool(st.get("direct", False)), "reader": str(st.get("reader", "")),
                        # queued steps' prefetch reads (a predictor under --predictor): read, not misses
                        "prefetch_reads": int(st.get("prefetch_reads", 0)),
                        "prefetch_hits": int(st.get("prefetch_hits", 0))}
        out["rows_per_layer"] = got["rows"]
        out["warm_experts"] = got["warm"]
        out["pinned_experts"] = got.get("pinned", {})  # none named: every row dynamic
    else:
        raise ValueError(f"unknown system {system!r}; known: {list(SYSTEMS)}")
    end = stamps[-1] if stamps else time.perf_counter()
    out["tokens"] = tokens
    out["seconds"] = end - t0
    # Decode speed: from the first token to the last (the first carries the startup).
    out["decode_tokens_per_s"] = (len(tokens) - 1) / (end - stamps[0]) if len(tokens) > 1 and end > stamps[0] else 0.0
    out["read_bytes"] = (stopped[0] if stopped else _read_bytes()) - io1
    out["read_bytes_loading"] = io1 - io0
    # of them: the rows' warm-up, asyncside's measuring of the disk, and the rest (the model, the store)
    out["read_bytes_loading_parts"] = {"model_and_store": io1 - io0 - sum(parts.values()), **parts}
    out["rss_end"] = _rss()
    _phase("done")
    return out


# ---- the parent ---------------------------------------------------------------------------------


def _child(spec: dict[str, Any], cgroup: MemoryCgroup | None, timeout: float, *,
           command: Sequence[str] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one system in a subprocess (inside ``cgroup``); its figures, or why it did not finish.

    ``command``: the child's command before ``--child SPEC`` (default this module's, which runs
    :func:`child_main`; a caller with its own child main passes its own). ``env``: variables set
    in the child's environment on top of this process's.
    """
    head = list(command) if command is not None else [sys.executable, "-m", "asyncside.bench.offload"]
    cmd = [*head, "--child", json.dumps(spec)]
    if cgroup is not None:
        cmd = cgroup.wrap(cmd)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **env} if env else None)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                          for x in (exc.stdout, exc.stderr))
    wall = time.perf_counter() - t0
    phases = [line.split()[1] for line in stderr.splitlines() if line.startswith("PHASE ")]
    res: dict[str, Any] = {"system": spec["system"], "wall_s": wall, "phase": phases[-1] if phases else "starting",
                           "env": dict(env or {}),
                           "stderr_tail": [line for line in stderr.strip().splitlines()
                                           if not line.startswith("PHASE ")][-12:]}
    if cgroup is not None:
        res["peak_bytes"] = cgroup.peak()
        res["oom_kills"] = cgroup.oom_kills()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if rc == 0 and lines:
        res.update(json.loads(lines[-1]))
        res["status"] = "ok"
        return res
    if rc is None:
        res["status"] = f"timed out after {timeout:.0f} s while {res['phase']}"
    elif res.get("oom_kills"):
        res["status"] = (f"killed by the cgroup's OOM killer while {res['phase']} (limit "
                         f"{cgroup.limit / MB:.0f} MB)" if cgroup else "killed")
    else:
        res["status"] = f"exit status {rc} while {res['phase']}" + _error_of(stderr)
    return res


def _error_of(stderr: str) -> str:
    """``": Type: message"``: the error a child's stderr ends with (a traceback's last line, the
    exception's module left out), whole; else its last lines, cut at the end; "" when it said nothing."""
    lines = [line for line in stderr.strip().splitlines() if line.strip() and not line.startswith("PHASE ")]
    if not lines:
        return ""
    last = lines[-1]
    kind, sep, message = last.partition(": ")
    if sep and re.fullmatch(r"[A-Za-z_][\w.]*", kind):
        return f": {kind.rsplit('.', 1)[-1]}: {message}"
    tail = " / ".join(lines[-3:])
    return ": " + (tail if len(tail) <= 400 else tail[:397] + "...")


#: the most the bandwidth probe's rows take, and the most one of its passes reads: a record of many
#: MiB needs few rows to keep the disk busy, and its rows are this (parent) process's, outside any budget
PROBE_POOL_BYTES = 256 << 20
PROBE_PASS_BYTES = 2 << 30


def _bandwidth(store_dir: str, depth: int | None, passes: int = 3, records: int = 192) -> dict[str, Any]:
    """Random O_DIRECT reads of whole records of the store's first layer at the runtime's queue depth:
    ``bench io``'s reader pass, GB/s (median of ``passes``); its rows and each pass's reads bounded
    by :data:`PROBE_POOL_BYTES` and :data:`PROBE_PASS_BYTES` (at least one row and one record a pass)."""
    import random
    import statistics

    import anyio

    from .._native import ReaderOptions
    from ..pools import PoolSet
    from ..store import ExpertStore
    from .io import _reader_pass

    store = ExpertStore.open(store_dir)
    layers = list(store.layers)
    spec = store.layer(layers[0])
    opts = ReaderOptions(direct=True) if depth is None else ReaderOptions(direct=True, queue_depth=depth)
    # Rows of records of many MiB (a wide model's experts) took more than MLX allocates in one
    # array, and the probe ended the bench in an OverflowError before any run.
    rows = max(1, min(max(opts.queue_depth, 32), PROBE_POOL_BYTES // spec.stride))
    records = max(1, min(records, PROBE_PASS_BYTES // spec.stride))
    pools = PoolSet(spec, rows)
    rng = random.Random(7)
    vals = []
    for _ in range(passes):
        experts = [rng.randrange(spec.n_experts) for _ in range(records)]
        vals.append(anyio.run(_reader_pass, "auto", opts, spec, pools, experts)["GBps"])
    return {"GBps": statistics.median(vals), "passes": vals, "record_bytes": int(spec.stride),
            # reads in flight: no more than the rows they land in
            "queue_depth": min(int(opts.queue_depth), rows), "records_per_pass": records}


#: queue depths of :func:`disk_curve` (one synchronous reader up to the runtime's default depth)
DISK_DEPTHS = (1, 4, 8, 64)


def _direct_pass(fds: dict[str, int], picks: list[tuple[str, int]], stride: int, depth: int,
                 deadline: float) -> tuple[int, float]:
    """``picks`` (blob, offset) read whole with O_DIRECT by ``depth`` threads, each one read at a time
    (so ``depth`` reads in flight); stops early at ``deadline`` (perf_counter). (bytes read, seconds).
    A read covers the blocks that hold the record: the record itself in a store of the default
    alignment; in one of a smaller alignment records start and end mid-block, where O_DIRECT
    refuses a read of the record alone. The bytes counted are those the disk read."""
    import mmap
    import threading

    from ..readers import DIRECT_ALIGN

    done = [0] * depth
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, stride + 2 * DIRECT_ALIGN)  # page-aligned, as O_DIRECT needs
        try:
            for path, offset in picks[i::depth]:
                if time.perf_counter() >= deadline:
                    break
                start = offset // DIRECT_ALIGN * DIRECT_ALIGN
                end = offset + stride
                with memoryview(buf)[: -(-end // DIRECT_ALIGN) * DIRECT_ALIGN - start] as view:
                    got = os.preadv(fds[path], [view], start)
                if got < end - start:  # the blob may end short of a block boundary, never before the record's end
                    raise OSError(f"{path}: short O_DIRECT read, {got} of {end - start} bytes at offset {start}")
                done[i] += got
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
        finally:
            buf.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(done), seconds


def disk_curve(store_dir: str, depths: Sequence[int] = DISK_DEPTHS, *, min_bytes: int = 2_000_000_000,
               passes: int = 3, cell_seconds: float = 30.0, seed: int = 7) -> dict[str, Any]:
    """The disk's random-read rate against queue depth: whole records of every layer of the store,
    picked at random, read with O_DIRECT, ``depth`` reads in flight; per depth the median GB/s of
    ``passes`` passes of at least ``min_bytes`` each (a pass stops early once its cell has run
    ``cell_seconds``). ``GBps`` is the best depth's median (the I/O limit's bandwidth)."""
    import random
    import statistics

    from ..store import ExpertStore

    if not getattr(os, "O_DIRECT", 0):
        raise OSError("disk_curve: O_DIRECT is not available on this platform")
    if not depths or any(int(d) < 1 for d in depths):
        raise ValueError(f"disk_curve: depths must be integers >= 1, got {list(depths)}")
    store = ExpertStore.open(store_dir)
    specs = [store.layer(i) for i in sorted(store.layers)]
    stride = specs[0].stride
    if any(sp.stride != stride for sp in specs):
        raise ValueError(f"{store_dir}: disk_curve expects one record size, got {sorted({sp.stride for sp in specs})}")
    records = [(str(sp.path), e * stride) for sp in specs for e in range(sp.n_experts)]
    per_pass = max(1, -(-int(min_bytes) // stride))
    rng = random.Random(seed)
    fds = {str(sp.path): os.open(sp.path, os.O_RDONLY | os.O_DIRECT) for sp in specs}
    cells: list[dict[str, Any]] = []
    try:
        for depth in depths:
            end = time.perf_counter() + cell_seconds
            vals: list[float] = []
            nbytes: list[int] = []
            for _ in range(passes):
                if vals and time.perf_counter() >= end:
                    break
                picks = [records[rng.randrange(len(records))] for _ in range(per_pass)]
                got, sec = _direct_pass(fds, picks, stride, int(depth), end if vals else float("inf"))
                vals.append(got / sec / 1e9 if sec > 0 else 0.0)
                nbytes.append(got)
            cells.append({"depth": int(depth), "GBps": statistics.median(vals), "passes": vals,
                          "bytes_per_pass": nbytes})
    finally:
        for fd in fds.values():
            os.close(fd)
    best = max(cells, key=lambda c: c["GBps"])
    return {"GBps": best["GBps"], "best_depth": best["depth"], "cells": cells, "record_bytes": stride,
            "records": len(records), "min_bytes_per_pass": per_pass * stride,
            "reader": "O_DIRECT preadv, one thread per read in flight"}


def belady_of_run(trace_file: str, store_dir: str, steps: int, rows: dict[str, int],
                  warm: dict[str, list[int]] | None = None,
                  pinned: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Belady's MIN over the demands of ``steps`` decode steps (one token each) of ``trace_file``
    replayed on the store ``store_dir``, with ``rows`` per layer (layer index as a string -> rows,
    pinned ones included), from empty rows or, with ``warm`` (layer -> experts), from the rows the
    run started with (a runtime warms its rows at start: MIN from empty rows is no bound on it).

    The top level is MIN with bypass over every row (a pinned expert evictable too): the absolute
    optimum for that memory. ``"no_bypass"`` is MIN under the ledger's rule from the same rows:
    ``pinned`` (layer -> experts; none: every row dynamic, as the slot cache's) stay, every demanded
    expert takes one of the other rows, a step demanding more than those passes in groups
    (:func:`asyncside.policy_replay.belady_no_bypass`): what the run's own ledger could hit at best."""
    from ..models.forcing import RoutingReplay
    from ..models.trace import CacheResult, belady
    from ..policy_replay import Counts, belady_no_bypass
    from ..routing import RoutingTrace
    from ..store import ExpertStore

    store = ExpertStore.open(store_dir)
    layers = sorted(store.layers)
    first = store.layer(layers[0])
    trace = RoutingTrace.load(trace_file)
    replay = RoutingReplay(trace, moe_layers=layers, n_experts=first.n_experts, top_k=_store_top_k(store_dir))
    total = CacheResult()
    ruled = Counts()
    for layer in layers:
        demands = [row for row in replay.host_ids(layer, 0, steps)]
        start = (warm or {}).get(str(layer), ())
        total = total + belady(demands, [], int(rows[str(layer)]), start)
        fixed = (pinned or {}).get(str(layer), [])
        ruled = ruled + belady_no_bypass(demands, fixed, int(rows[str(layer)]) - len(fixed), start, groups=True)
    return {"hit_rate": total.hit_rate, "accesses": total.accesses, "misses": total.misses,
            "no_bypass": {"hit_rate": ruled.hit_rate, "accesses": ruled.accesses,
                          "misses": ruled.accesses - ruled.hits}}


@functools.lru_cache(maxsize=1)
def process_baseline() -> int:
    """What a run's process holds before its model: the resident size of a fresh interpreter with
    MLX, mlx-lm and the asyncside modules a run imports before it plans (its models and runtime)
    loaded, measured in a child as the runs are children. Not this process's own size: a caller
    that has built shapes (freed memory the allocator keeps) or is a large program itself (a test
    suite, a notebook) would count what no run's process holds, and refuse budgets the runs fit."""
    code = ("import mlx.core, mlx_lm\n"
            "from asyncside import models, runtime\n"
            "from asyncside.memory import proc_self_bytes\n"
            "print(proc_self_bytes('status', 'VmRSS'))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        return int(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        # No child could say (a sandbox without fork): this process's size with those modules
        # loaded, an estimate from above.
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401

        from .. import models, runtime  # noqa: F401
        from ..memory import proc_self_bytes

        return proc_self_bytes("status", "VmRSS")


def least_budget(shape: dict[str, Any]) -> int:
    """About the smallest memory budget asyncside's plan accepts for ``shape`` (a row of the
    bench's shapes): the least pools (the model's top-k rows a layer), the plan's headroom, the
    non-expert weights a run loads, what a run's process holds before its model (the shape's
    ``process_bytes``, from :func:`process_baseline`; else what this process holds now), and the
    margin a refusal's memory= adds (``runtime._plan.NEED_MARGIN``)."""
    from ..memory import MIN_HEADROOM, proc_self_bytes
    from ..models.loading import is_store_dir
    from ..runtime._plan import NEED_MARGIN, plan_headroom
    from ..store import ExpertStore

    pools = shape["moe_layers"] * shape["top_k"] * shape["record_bytes"]
    # The plan's headroom, estimated from the built store's model (runtime._plan.estimate_headroom);
    # before a shape is built (its estimates alone), the fixed figure.
    store = shape.get("store")
    headroom = MIN_HEADROOM
    if isinstance(store, (str, pathlib.Path)) and is_store_dir(pathlib.Path(store)):
        headroom = plan_headroom(ExpertStore.open(store))
    non_expert = max(0, shape["store_bytes"] - shape["expert_bytes"])
    held = shape.get("process_bytes")
    if held is None:
        held = proc_self_bytes("status", "VmRSS")
    # A run's process also holds what loading its model leaves beside the non-expert weights (the
    # tokenizer, MLX's state), which no figure here names: the figure this names is offered as a
    # --memory to try, so it keeps the margin a runtime's refusal keeps for such bytes.
    return int(pools + headroom + non_expert + held + NEED_MARGIN)


#: the prompt of every run: one token, so every step routes one token
PROMPT_TOKENS = 1


def prompt_for(store_dir: str) -> list[int]:
    """The runs' prompt on the store at ``store_dir``: the byte tokenizer's "T", or the model's last
    token id where its vocabulary ends before that (an id past the embedding table reads what lies
    beyond it: asyncside refuses it, mlx-lm and the slot cache computed garbage)."""
    from ..models.streaming import _config_vocab
    from ..runtime._plan import store_config
    from ..store import ExpertStore

    vocab = _config_vocab(store_config(ExpertStore.open(store_dir)) or {})
    token = ord("T")
    return [token if vocab is None or token < vocab else vocab - 1]


def _store_top_k(store_dir: str) -> int:
    """The experts routed per token of the model a store was converted from (what the runtime's
    plan reads: :func:`asyncside.runtime._plan.store_top_k`); StoreError where the store does not say."""
    from ..errors import StoreError
    from ..runtime._plan import store_top_k
    from ..store import ExpertStore

    k = store_top_k(ExpertStore.open(store_dir))
    if k is None:
        raise StoreError(pathlib.Path(store_dir) / "config.json", "the store does not say how many experts its model "
                         "routes per token", "num_experts_per_tok")
    return k


def _dir_bytes(path: str | os.PathLike[str]) -> int:
    return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


# ---- the user's routing traces (--routing FILE) ------------------------------------------------


def distinct_labels(names: Sequence[str], taken: Sequence[str] = ()) -> list[str]:
    """``names`` in order, one repeated or already ``taken`` given ``-2``, ``-3``... (two shapes'
    configs in directories of one name, or one shape listed twice, stay apart in the table and the
    JSON)."""
    used = set(taken)
    out = []
    for name in names:
        label, n = name, 1
        while label in used:
            n += 1
            label = f"{name}-{n}"
        used.add(label)
        out.append(label)
    return out


def routing_labels(paths: Sequence[str], taken: Sequence[str] = ()) -> list[str]:
    """A locality label per routing file: its stem, with ``-2``, ``-3``... where a stem repeats or
    is already ``taken`` (e.g. a preset of the same run)."""
    return distinct_labels([pathlib.Path(path).stem or "routing" for path in paths], taken)


def load_routings(paths: Sequence[str], taken: Sequence[str] = (), sequence: int = 0) -> list[dict[str, Any]]:
    """The user's routing files, loaded and validated before anything is built: per file
    ``{"label", "path", "trace", "sequence"}``, ``sequence`` the one every system replays
    (``--routing-sequence``). A file that cannot be read or is malformed raises
    :class:`asyncside.errors.TraceError` naming the file and the field, one without that sequence a
    ValueError worded as ``demo --routing-sequence`` words it (from the CLI a usage error, exit
    status 2, said as the demo says it)."""
    from ..demo import routing_sequence_problem
    from ..routing import RoutingTrace

    out = []
    for path, label in zip(paths, routing_labels(paths, taken), strict=True):
        trace = RoutingTrace.load(path)
        problem = routing_sequence_problem(path, sequence, trace)
        if problem is not None:
            raise ValueError(problem)
        out.append({"label": label, "path": os.path.abspath(path), "trace": trace, "sequence": int(sequence)})
    return out


def fit_routing(user: dict[str, Any], *, shape: str, moe_layers: int, n_experts: int, top_k: int,
                positions: int, predictor: str) -> tuple[Any, dict[str, Any]]:
    """(the trace every system of ``shape`` replays, what the JSON records of it) for one loaded
    user routing file (:func:`load_routings`).

    Sequence ``user["sequence"]`` (default 0; ``--routing-sequence``) is replayed, as ``demo
    --routing`` replays it, and fitted as every ``--routing`` is
    (:class:`asyncside.models.forcing.RoutingReplay`: as is when of the model's shape, else
    :meth:`asyncside.routing.RoutingTrace.map_to`); ``positions``: the most positions a run routes
    (prompt plus tokens: mlx-lm's, one step ahead; the record's ``positions_routed`` says each
    system's), past the sequence's end they wrap around. A trace of smaller top-k than
    the shape, or ``predictor="trace"`` with a trace that carries no predictions, is refused with
    a :class:`asyncside.models.forcing.RoutingReplayError` naming the file.
    """
    import numpy as np

    from ..models.forcing import RoutingReplay, RoutingReplayError
    from ..routing import RoutingTrace

    trace, path, sequence = user["trace"], user["path"], int(user.get("sequence", 0))
    # A smaller top-k than the shape's is refused by the fit itself (it names `asyncside routing widen`).
    replay = RoutingReplay(trace, moe_layers=range(moe_layers), n_experts=n_experts, top_k=top_k, sequence=sequence,
                           source=f"--routing {path}")
    fitted = replay.fitted
    pred = fitted.sequence_predicted(sequence)
    if predictor == "trace" and pred is None:
        raise RoutingReplayError(f"--routing {path}: --predictor trace replays the trace's own predictions, and "
                                 f"this trace carries none (no 'predicted' array); use --predictor none or temporal")
    # The one sequence alone: every system and Belady's MIN read this file, so they replay the same ids.
    one = RoutingTrace(fitted.sequence(sequence), np.array([replay.n_tokens], dtype=np.int64), fitted.n_experts,
                       fitted.meta, pred)
    info = {"file": path, "label": user["label"], "sequence": sequence, "sequences": trace.n_sequences,
            "sequence_tokens": replay.n_tokens, "positions": int(positions),
            "positions_routed": positions_routed(int(positions)),
            "wraps": int(positions) > replay.n_tokens,
            "source_shape": {"n_layers": trace.n_layers, "n_experts": trace.n_experts, "top_k": trace.top_k},
            "mapped_from": fitted.meta.get("mapped_from") if fitted is not trace else None,
            "predicted": pred is not None}
    return one, info


def fit_routings(user: list[dict[str, Any]], shapes: list[dict[str, Any]], *, positions: int, predictor: str,
                 verbose: bool = False) -> list[dict[str, tuple[Any, dict[str, Any]]]]:
    """Every user routing file fitted onto every shape (:func:`fit_routing`), before any run so that a
    refusal comes first: per shape, in order, label -> (fitted trace, its record); each shape dict
    gets ``"routings"`` (label -> record)."""
    fitted: list[dict[str, tuple[Any, dict[str, Any]]]] = []
    for sh in shapes:
        fitted.append({u["label"]: fit_routing(u, shape=sh["shape"], moe_layers=sh["moe_layers"],
                                               n_experts=sh["experts_per_layer"], top_k=sh["top_k"],
                                               positions=positions, predictor=predictor) for u in user})
        sh["routings"] = {label: info for label, (_t, info) in fitted[-1].items()}
        for info in sh["routings"].values():
            _log(verbose, f"{sh['shape']}: --routing {routing_note(info)}")
    return fitted


def positions_routed(positions: int) -> dict[str, int]:
    """The positions each system routes in a run of ``positions`` prompt tokens plus tokens, at
    most: mlx-lm's ``generate_step`` computes the step after each token before handing it over, so
    it routes them all; asyncside and the slot cache stop at the last token's own step, one fewer."""
    return {"asyncside": positions - 1, "slot-cache": positions - 1, "mlx-lm": positions}


def routing_note(info: dict[str, Any]) -> str:
    """One line on how a user routing file is replayed (for the progress log and the table's title)."""
    src = info["source_shape"]
    parts = [f"{info['label']}: {info['file']} ({_count(src['n_layers'], 'layer')} x "
             f"{_count(src['n_experts'], 'expert')} top-{src['top_k']}, "
             + ("mapped onto the shape" if info["mapped_from"] else "the shape's own") + ")",
             f"sequence {info['sequence']} of {info['sequences']} replayed "
             f"({_count(info['sequence_tokens'], 'token')})"]
    if info["wraps"]:
        routed = info.get("positions_routed") or positions_routed(int(info["positions"]))
        alone = " in mlx-lm alone" if routed["asyncside"] <= info["sequence_tokens"] else ""
        parts.append(f"positions wrap{alone}: a run routes up to {routed['asyncside']} positions in asyncside and "
                     f"the slot cache, {routed['mlx-lm']} in mlx-lm (one step ahead of its tokens)")
    return "; ".join(parts)


def add_offload_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``asyncside bench offload``."""
    p.add_argument("--memory", metavar="SIZE", type=memory_arg, default=None,
                   help="the memory budget of every run, e.g. 600M or 1.5G (default: a quarter of the smallest store)")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"model shapes as NAME:LAYERS or CONFIG.json:LAYERS (a Hugging Face config, its directory or "
                        f"repo id, built as a qwen3_moe of its MoE dimensions), comma-separated "
                        f"(default {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--vocab", type=vocab_size, default=512,
                   help="vocabulary of the built shapes: a number, 'small' (512) or 'full' (the shape's own; "
                        "default 512)")
    p.add_argument("--stores", metavar="DIR", nargs="+", default=None,
                   help="converted expert stores to run instead of building --shapes")
    p.add_argument("--store-ratio", type=positive_float, default=STORE_OVER_BUDGET,
                   help=f"refuse a store smaller than this many budgets (default {STORE_OVER_BUDGET:g}; "
                        f"less only for a quick check of the machinery)")
    p.add_argument("--localities", default=None,
                   help="synthetic routing presets, comma-separated (default low,middle,high; with --routing "
                        "none unless given: '' runs no preset)")
    p.add_argument("--routing", metavar="FILE", type=file_name, action="append", default=None,
                   help="your own routing trace (.npz, docs/routing-traces.md), a locality labelled by the file's "
                        "stem; repeatable. Fitted onto each shape as demo --routing fits it (--routing-sequence's "
                        "sequence; other layers, experts, a larger top-k mapped; a smaller top-k refused); every "
                        "system replays the fitted trace; positions past its end wrap")
    p.add_argument("--routing-sequence", metavar="N", type=int_at_least(0), default=None,
                   help="which sequence of each --routing trace of several every system replays (default 0, the "
                        "first; needs --routing)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="systems, comma-separated (default all three)")
    p.add_argument("--seconds", type=positive_float, default=40.0, help="generation time per run (default 40)")
    # Decode speed is timed from the first token to the last: one token a run times nothing, and its
    # 0.00 tok/s read as a measurement.
    p.add_argument("--tokens", type=int_at_least(2), default=256,
                   help="at most this many tokens per run, at least 2 (default 256)")
    p.add_argument("--policy", type=policy_name, default=DEFAULT_POLICY,
                   help=f"asyncside's eviction policy: {', '.join(POLICY_NAMES)} (default {DEFAULT_POLICY})")
    p.add_argument("--predictor", default="none", choices=["none", "temporal", "lookahead", "trace"],
                   help="asyncside's predictor (default none: the router's lookahead does not know replayed ids; "
                        "trace: the replayed trace's own predictions, for --routing files that carry them)")
    p.add_argument("--cache-dir", type=directory, default=None,
                   help="where the shapes are built (default: $ASYNCSIDE_CACHE, else $XDG_CACHE_HOME/asyncside, "
                        "else ~/.cache/asyncside)")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds before a run is stopped (default 300)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table (for BENCHMARKS.md)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)


def _count(n: int, noun: str) -> str:
    """``n noun``, the noun plural unless ``n`` is one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _mb(n: float) -> str:
    """``n`` bytes in the decimal MB the tables use; a size that is not zero but would read ``0 MB``
    (a small shape's records) in kB, or in bytes below one kB."""
    if not n or abs(n) >= MB / 2:
        return f"{n / MB:.0f} MB"
    return f"{n / 1e3:.0f} kB" if abs(n) >= 1e3 else f"{n:.0f} bytes"


def _loading_note(run: dict[str, Any]) -> str:
    """``; loading read ... MB, ... of them measuring the disk's read window``: where a run's
    runtime measured its disk on entering (reads a user's first token waits for), else ""."""
    measuring = (run.get("read_bytes_loading_parts") or {}).get("measuring_the_disk", 0)
    window = run.get("read_window") or {}
    if not measuring or window.get("source") != "measured":
        return ""
    return (f"; loading read {run['read_bytes_loading'] / MB:.0f} MB, {measuring / MB:.0f} MB of them "
            f"measuring the disk's read window ({window.get('seconds', 0.0):.2f} s)")


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(f"[offload] {msg}", file=sys.stderr, flush=True)


def _replayed(args: argparse.Namespace) -> tuple[list[str], list[dict[str, Any]]]:
    """(the presets to replay, the user's routing files loaded): ``--localities`` defaults to every
    preset without ``--routing`` and to none with it. An unknown preset, or nothing to replay, is a
    ValueError naming the option (a usage error from the CLI)."""
    from ..routing import LOCALITIES

    routing_files = list(getattr(args, "routing", None) or [])
    loc_text = args.localities if args.localities is not None else ("" if routing_files else ",".join(LOCALITY_NAMES))
    localities = [s.strip() for s in loc_text.split(",") if s.strip()]
    for s in localities:
        if s not in LOCALITIES:
            raise ValueError(f"--localities: unknown preset {s!r}; known: {', '.join(LOCALITY_NAMES)}")
    if args.predictor == "trace" and localities:
        raise ValueError("--predictor trace replays a --routing file's own predictions; "
                         f"the presets ({','.join(localities)}) carry none: --localities '' or another predictor")
    if not localities and not routing_files:
        raise ValueError("--localities is empty and no --routing FILE: nothing to replay")
    given = getattr(args, "routing_sequence", None)
    if given is not None and not routing_files:
        from ..demo import routing_sequence_problem

        raise ValueError(routing_sequence_problem(None, given))
    return localities, load_routings(routing_files, taken=localities, sequence=int(given or 0))


def _fewest_layers(s: dict[str, Any], ratio: float, floor: int, own_plan: bool) -> int | None:
    """About the fewest MoE layers of shape ``s`` whose store is ``ratio`` times a budget of at least
    ``floor`` bytes and, with ``own_plan``, of the shape's own smallest plan (which grows by the
    top-k rows and the other weights of every layer); None when no number does (the top-k rows are
    already a ``1/ratio`` share of a layer's experts). The other weights grow by the shape's
    ``layer_other_bytes`` a layer (attention, norms, router) where the row says, else are taken as
    they are now."""
    layers = int(s["moe_layers"])
    per_layer = s["expert_bytes"] / layers
    other = s["store_bytes"] - s["expert_bytes"]
    # A layer's other weights add to the store once, and to the plan's budget (which loads them)
    # ratio times: left out, the count said was refused again with a larger one.
    grows = float(s.get("layer_other_bytes") or 0)
    n = math.ceil((ratio * floor - other + layers * grows) / (per_layer + grows))
    if own_plan:
        rows = s["top_k"] * s["record_bytes"]
        fixed = s["least_budget_bytes"] - layers * (rows + grows)
        gain = per_layer + grows - ratio * (rows + grows)
        if gain <= 0:
            return None
        n = max(n, math.ceil((ratio * fixed - other + layers * grows) / gain))
    return max(1, n)


def _too_small(args: argparse.Namespace, s: dict[str, Any], budget: int, why: str, fewest: int | None) -> str:
    """The refusal of a store less than ``--store-ratio`` budgets, leading with the option to change
    (a usage error) and saying what would pass."""
    ratio = float(args.store_ratio)
    exact = s["store_bytes"] / budget  # the largest ratio this store passes, shown rounded down to 2 digits
    scale = 10 ** (1 - math.floor(math.log10(exact)))
    passes = math.floor(exact * scale) / scale
    lead = f"--stores {s['store']}" if args.stores else f"--shapes {s['spec']}:{s['moe_layers']}"
    # A store's label is its directory's name, which the lead names already (a store in a
    # directory named "store" read "the store store").
    name = "" if args.stores else f" {s['shape']}"
    said = (f"{lead}: the{name} store ({_mb(s['store_bytes'])}) is less than {ratio:g}x the budget "
            f"({budget / MB:.0f} MB{why})")
    layers = int(s["moe_layers"])
    these = "this layer as it is" if layers == 1 else f"these {layers} layers as they are"
    quick = f"--store-ratio {passes:g} or less runs {these} (a quick check of the machinery)"
    smaller = (f"--memory {s['store_bytes'] / ratio / 2**20:.0f}M or less, "
               if args.memory and s["store_bytes"] / ratio >= s["least_budget_bytes"] else "")
    if args.stores:
        return f"{said}: a store of more layers, {smaller}or {quick}"
    if fewest is None:
        return (f"{said}: no number of layers makes it {ratio:g}x, since asyncside's smallest pools, a layer's "
                f"top-{s['top_k']} of {_count(s['experts_per_layer'], 'expert')}, grow with the store; {quick}")
    if s.get("max_layers") and fewest > s["max_layers"]:
        return (f"{said}: about {fewest} MoE layers would be, and the model has "
                f"{_count(s['max_layers'], 'MoE layer')}; {smaller}{quick}")
    return f"{said}: about {fewest} MoE layers are (--shapes {s['spec']}:{fewest}), {smaller}or {quick}"


def choose_budget(args: argparse.Namespace, shapes: list[dict[str, Any]], verbose: bool) -> int:
    """The runs' memory budget: ``--memory``, else the smallest store over ``--store-ratio`` raised
    to asyncside's smallest plan (:func:`least_budget`). A store less than the ratio times the
    budget is a ValueError leading with ``--shapes SPEC:LAYERS`` (or ``--stores DIR``) that says
    about how many layers would pass (each shape gets ``least_budget_bytes``)."""
    smallest = min(s["store_bytes"] for s in shapes)
    ratio = float(args.store_ratio)
    for s in shapes:
        s["least_budget_bytes"] = least_budget(s)
    least = max(s["least_budget_bytes"] for s in shapes)
    # The default: the smallest store over the ratio, but never below what asyncside's plan needs
    # (then the ratio check below says which store is too small for it).
    budget = parse_size(args.memory) if args.memory else max(int(smallest / ratio), least)
    for s in shapes:
        if s["store_bytes"] < ratio * budget:
            raised = not args.memory and budget > int(smallest / ratio)
            setter = max(shapes, key=lambda o: o["least_budget_bytes"])  # one budget for every shape: the largest
            whose = "" if setter is s or len(shapes) == 1 else f" for {setter['shape']}"
            why = "" if not raised else (
                f", raised to asyncside's smallest plan{whose}, about {least / MB:.0f} MB (the model's top-k rows a "
                f"layer, the plan's headroom, the non-expert weights and the process)")
            if args.memory:
                fewest = _fewest_layers(s, ratio, budget, own_plan=False)
            else:  # the default budget: at least every other shape's plan, and this shape's own as it grows
                others = max([o["least_budget_bytes"] for o in shapes if o is not s] + [0])
                fewest = _fewest_layers(s, ratio, others, own_plan=True)
            raise ValueError(_too_small(args, s, budget, why, fewest))
        if budget < s["least_budget_bytes"]:
            _log(verbose, f"warning: the budget ({budget / MB:.0f} MB) is below asyncside's smallest plan for "
                          f"{s['shape']} (about {s['least_budget_bytes'] / MB:.0f} MB): its runs will likely be "
                          f"refused at start")
    from ..memory import available_memory

    room = available_memory()
    if budget > room.available:
        _log(verbose, f"warning: the budget ({budget / MB:.0f} MB) is above what this machine has available "
                      f"({room.available / MB:.0f} MB, {room.source}): the runs are not bounded by it, and "
                      f"asyncside's plan takes {room.available / MB:.0f} MB")
    return budget


def _layer_other_bytes(spec: Any) -> int:
    """The bytes besides the experts that one more MoE layer adds to the store of the shape built
    from ``spec`` (its attention, norms and router), by :func:`asyncside.bench.shapes.estimate_bytes`."""
    import dataclasses

    from .shapes import estimate_bytes

    def other(n: int) -> int:
        return estimate_bytes(dataclasses.replace(spec, config={**spec.config, "num_hidden_layers": n}))["non_expert"]

    return other(1) - other(0)


def _estimated_shape(args: argparse.Namespace, typed: str, layers: int | None, held: int) -> dict[str, Any]:
    """The row :func:`choose_budget` takes for shape ``typed`` of ``layers`` MoE layers (None: all),
    from its build's estimates (:func:`asyncside.bench.shapes.estimate_bytes`), before it is built;
    ``held``: what a run's process holds before its model (:func:`process_baseline`)."""
    from .shapes import ShapeError, describe_shape, estimate_bytes, shape_spec

    src = describe_shape(typed)
    most = src.config["num_hidden_layers"]
    if layers is not None and layers > most:  # shape_spec would name --layers, which this command has not
        raise ShapeError(f"--shapes {typed}:{layers}: {src.name} has {_count(most, 'MoE layer')}; LAYERS must be "
                         f"in [1, {most}] (or left out: every layer)")
    spec = shape_spec(typed, layers=layers, vocab=args.vocab)
    est, cfg = estimate_bytes(spec), spec.config
    return {"shape": src.name, "spec": typed, "max_layers": most, "moe_layers": cfg["num_hidden_layers"],
            "top_k": cfg["num_experts_per_tok"], "experts_per_layer": cfg["num_experts"], "record_bytes": est["record"],
            "store_bytes": est["experts"] + est["non_expert"], "expert_bytes": est["experts"],
            "layer_other_bytes": _layer_other_bytes(spec), "store": typed, "process_bytes": held}


def _refuse_before_building(args: argparse.Namespace, planned: Sequence[tuple[str, int | None]],
                            user: list[dict[str, Any]], held: int) -> None:
    """The ``--store-ratio`` check of :func:`choose_budget` on the builds' estimates
    (:func:`asyncside.bench.shapes.estimate_bytes`), before anything is built: a shape whose
    estimate fails it even at nine tenths of the ratio is refused as its built store would be
    (minutes of building later). A closer call is left to the check of the built stores. The
    ``user`` routing files are fitted onto the shapes' dimensions too (:func:`fit_routings`: a
    trace of smaller top-k is refused now, not after the build)."""
    estimated = [_estimated_shape(args, typed, layers, held) for typed, layers in planned]
    fit_routings(user, estimated, positions=1 + int(args.tokens), predictor=args.predictor)
    lenient = argparse.Namespace(**{**vars(args), "store_ratio": 0.9 * float(args.store_ratio)})
    try:
        choose_budget(lenient, estimated, False)
    except ValueError:
        choose_budget(args, estimated, False)  # refuses at the ratio asked, with its figures
    if args.memory:
        for s in estimated:
            _refuse_a_budget_no_run_holds(parse_size(args.memory), s, float(args.store_ratio))


def _refuse_a_budget_no_run_holds(budget: int, s: dict[str, Any], ratio: float = 0.0) -> None:
    """A ValueError leading with ``--memory`` where ``budget`` is below what every system's run of
    shape ``s`` (an estimated row, or a ``--stores`` row: no ``spec``) holds at the least: the
    model's top-k rows of every layer (the slot cache's fewest slots, asyncside's fewest rows), the
    non-expert weights and the process. Each run would be refused or killed by the OOM killer, after
    minutes of building the shape, or of runs that measure nothing. What it offers instead passes
    ``--store-ratio`` ``ratio`` too, or says which ratio it needs."""
    rows = s["moe_layers"] * s["top_k"] * s["record_bytes"]
    other = max(0, s["store_bytes"] - s["expert_bytes"])
    least = rows + other + s["process_bytes"]
    if budget >= least:
        return
    layers = "its MoE layer's" if s["moe_layers"] == 1 else f"its {s['moe_layers']} MoE layers'"
    plan = least_budget(s)
    # Each layer fewer takes its top-k records and its other weights off asyncside's smallest plan.
    per_layer = s["top_k"] * s["record_bytes"] + s.get("layer_other_bytes", 0)
    fewer = s["moe_layers"] - -(-(plan - budget) // per_layer)
    # What is offered must pass the store-ratio check that follows this one: a fewer-layer store
    # less than the ratio times the budget, or a store less than the ratio times the plan, was
    # offered and then refused by that check.
    per_layer_store = s["expert_bytes"] / s["moe_layers"] + s.get("layer_other_bytes", 0)
    fewer_ok = fewer >= 1 and s["store_bytes"] - (s["moe_layers"] - fewer) * per_layer_store >= ratio * budget
    if s.get("spec") is None:  # a converted store: no fewer layers to offer, and nothing is built
        what, fits, done = f"the store {s['store']}", "", "nothing was run"
    else:
        what, done = f"--shapes {s['spec']}:{s['moe_layers']}", "nothing was built"
        fits = f", or --shapes {s['spec']}:{fewer} (whose smallest plan fits)" if fewer_ok else ""
    asked = -(-plan // 2**20)
    offer = f"--memory {asked}M or more"
    if s["store_bytes"] < ratio * (asked << 20):
        exact = s["store_bytes"] / (asked << 20)
        passes = math.floor(exact * 100) / 100
        layers_of = "this layer" if s["moe_layers"] == 1 else f"these {s['moe_layers']} layers"
        offer = (f"--memory {asked}M with --store-ratio {passes:g} or less runs {layers_of} (its store is "
                 f"{passes:g}x that budget, less than --store-ratio {ratio:g}; a quick check of the machinery)")
        if s.get("spec") is not None and s["top_k"] * ratio >= s["experts_per_layer"]:
            offer += (f"; no number of layers makes the store {ratio:g}x a budget that holds a run, since "
                      f"asyncside's smallest pools, a layer's top-{s['top_k']} of "
                      f"{_count(s['experts_per_layer'], 'expert')}, grow with the store")
    raise ValueError(
        f"--memory {_budget_text(budget)} holds no run of {what}: {layers} "
        f"top-{s['top_k']} experts alone are {_mb(rows)} (records of {_mb(s['record_bytes'])}), and a "
        f"run also holds {_mb(other)} of other weights and about {_mb(s['process_bytes'])} of process "
        f"({_mb(least)} in all); asyncside's smallest plan is about {_mb(plan)}: {offer}{fits} ({done})")


def _runs_cgroup(args: argparse.Namespace, budget: int, shapes: list[dict[str, Any]]) -> str:
    """The memory cgroup the runs get (:func:`check_cgroups` at ``budget``): a ValueError leading
    with ``--memory`` where the cgroup works but kills any process under that budget, CgroupError
    where none can be made."""
    ok, why = check_cgroups(budget)
    if not ok and args.memory and _OOM_KILLED in why:  # the cgroup works: the budget is at fault
        raise ValueError(f"--memory {budget} bytes is too small for any run: {why}; asyncside's smallest plan "
                         f"here is about {max(s['least_budget_bytes'] for s in shapes) / MB:.0f} MB")
    if not ok:
        raise CgroupError(f"asyncside bench offload needs a memory cgroup that charges the page cache: {why}")
    return why


def arm_traces(sh: dict[str, Any], localities: Sequence[str], fitted: dict[str, tuple[Any, dict[str, Any]]],
               tmp: pathlib.Path) -> dict[str, str]:
    """Per locality of shape ``sh``, the routing file every arm replays, written under ``tmp``: each
    preset of ``localities``, and each user trace as :func:`fit_routings` fitted it (label ->
    (trace, record)), the one sequence ``--routing-sequence`` picked, of the shape's own dimensions:
    every child replays its sequence 0 as is, so the arms and Belady's MIN see the same ids."""
    from ..routing import preset

    traces = {}
    for loc in localities:
        path = tmp / f"{sh['shape']}-{loc}.npz"
        preset(loc, tokens=TRACE_TOKENS, n_layers=sh["moe_layers"], n_experts=sh["experts_per_layer"],
               top_k=sh["top_k"], seed=1).save(path)
        traces[loc] = str(path)
    for label, (trace, _info) in fitted.items():
        path = tmp / f"{sh['shape']}-routing-{len(traces)}.npz"
        trace.save(path)
        traces[label] = str(path)
    return traces


def rows_fraction(rows: dict[str, int], n_experts: int) -> float:
    """The residency the slot cache is given for asyncside's ``rows`` a layer (layer -> rows) of
    ``n_experts``: their share of the experts, taken down to the largest fraction whose rows
    (:func:`asyncside.memory.layer_rows`, ``ceil(fraction x experts)``) are no more than asked. The
    share itself can round up past it (31 of 60 experts came out 32 slots a layer)."""
    from ..memory import layer_rows

    most = max(rows.values())
    fraction = sum(rows.values()) / (n_experts * len(rows))
    while fraction > 0 and layer_rows(n_experts, fraction, min_side_rows=1) > most:
        fraction = math.nextafter(fraction, 0.0)
    return fraction


def arm_spec(base: dict[str, Any], system: str, routing: str, fraction: float | None = None) -> dict[str, Any]:
    """What one arm's child runs (``--child SPEC``, :func:`child_main`): ``base`` (the shape's store,
    prompt and settings), the ``system``, the ``routing`` file it replays (:func:`arm_traces`) and,
    where given, the slot cache's ``fraction``."""
    spec = {**base, "system": system, "routing": routing}
    if fraction is not None:
        spec["fraction"] = fraction
    return spec


def run_offload_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape x locality x system (see the module docstring); prints the table unless ``args.json``."""
    from ..store import ExpertStore
    from .machine import machine_info
    from .shapes import describe_shape, ensure_shape, parse_shape_list, shape_spec

    verbose = not getattr(args, "quiet", False)  # progress goes to stderr, beside --json's stdout too
    started = time.time()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    # asyncside's run first, whatever the order given: the slot cache gets the rows its plan chose,
    # which a slot cache run before it would not know (it ran on a guess at another cache size).
    systems = [s for s in SYSTEMS if s in systems]
    localities, user = _replayed(args)  # a bad routing file stops here, before anything is built
    if args.stores:
        args.stores = [str(check_store_dir("--stores", d)) for d in args.stores]
    held = process_baseline()  # before anything is built
    shapes: list[dict[str, Any]] = []
    builds: list[tuple[str, str | None, int | None, Any]] = []
    if args.stores:
        builds += [(pathlib.Path(d).name, None, None, {"store": pathlib.Path(d), "store_bytes": _dir_bytes(d)})
                   for d in args.stores]
    else:
        planned = parse_shape_list(args.shapes)
        _refuse_before_building(args, planned, user, held)
        # Whether a memory cgroup can be made at all, before minutes of building: the budget is
        # known only once the stores are (checked again with it below).
        ok, why = check_cgroups(1 << 30)
        if not ok:
            raise CgroupError(f"asyncside bench offload needs a memory cgroup that charges the page cache: {why} "
                              "(nothing was built)")
        for typed, layers in planned:  # a name or a config.json path
            _log(verbose, f"shape {typed} ({_count(layers, 'layer') if layers else 'all layers'}): building or reusing")
            build = ensure_shape(typed, layers=layers, vocab=args.vocab, cache_dir=args.cache_dir,
                                 progress=verbose and not getattr(args, "json", False))
            build["max_layers"] = describe_shape(typed).config["num_hidden_layers"]
            builds.append((build["shape"], typed, layers, build))
    labels = distinct_labels([name for name, _typed, _layers, _build in builds])
    for label, (_name, typed_as, layers, build) in zip(labels, builds, strict=True):
        store = ExpertStore.open(build["store"])
        expert_bytes = sum(sp.blob_bytes for sp in store.layers.values())
        first = store.layer(next(iter(store.layers)))
        shapes.append({"shape": label, "spec": typed_as, "max_layers": build.get("max_layers"), "layers": layers,
                       "store": str(build["store"]), "expert_bytes": expert_bytes,
                       "source": build.get("source"), "built_as": build.get("built_as"), "note": build.get("note"),
                       "store_bytes": int(build["store_bytes"]), "record_bytes": first.stride,
                       "moe_layers": len(store.layers), "experts_per_layer": first.n_experts,
                       "top_k": _store_top_k(str(build["store"])), "process_bytes": held})
        if typed_as is not None:  # a built shape: what another layer of it would add besides experts
            shapes[-1]["layer_other_bytes"] = _layer_other_bytes(shape_spec(typed_as, layers=layers, vocab=args.vocab))
    budget = choose_budget(args, shapes, verbose)
    if args.memory and args.stores:  # built shapes were checked on their estimates, before building
        for sh in shapes:
            _refuse_a_budget_no_run_holds(budget, sh, float(args.store_ratio))
    for sh in shapes:
        sh["prompt"] = prompt_for(sh["store"])
    fitted = fit_routings(user, shapes, positions=PROMPT_TOKENS + int(args.tokens), predictor=args.predictor,
                          verbose=verbose)
    why = _runs_cgroup(args, budget, shapes)
    _log(verbose, f"budget {_budget_text(budget)} in a {why}; page cache dropped before every run")
    result: dict[str, Any] = {"bench": "offload", "machine": machine_info(), "budget_bytes": budget, "cgroup": why,
                              "settings": {k: getattr(args, k, None) for k in (
                                  "seconds", "tokens", "policy", "predictor", "vocab", "shapes", "localities",
                                  "systems", "routing", "routing_sequence")},
                              "shapes": shapes, "runs": []}
    result["settings"]["localities"] = ",".join(localities)
    result["settings"]["routing_sequence"] = int(args.routing_sequence or 0) if user else None  # the one replayed
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="asyncside-offload-"))
    try:
        for sh, fitted_here in zip(shapes, fitted, strict=True):
            traces = arm_traces(sh, localities, fitted_here, tmp)
            base = {"store": sh["store"], "prompt": sh["prompt"], "seconds": args.seconds, "tokens": args.tokens,
                    "policy": args.policy, "predictor": args.predictor, "budget": budget,
                    # Until asyncside's run says its rows; a fraction, whatever the budget over the store.
                    "fraction": min(1.0, max(0.01, (budget * 0.5) / sh["expert_bytes"]))}
            _log(verbose, f"{sh['shape']}: random-read bandwidth (O_DIRECT, record {sh['record_bytes'] / MB:.2f} MB)")
            sh["io"] = _bandwidth(sh["store"], None)
            sh["compute"] = {}
            for loc in traces:
                _log(verbose, f"{sh['shape']} / {loc}: compute limit (all-resident mlx-lm, no memory limit)")
                compute = _child(arm_spec(base, "mlx-lm", traces[loc]), None, args.timeout)
                sh["compute"][loc] = {k: compute.get(k) for k in ("status", "decode_tokens_per_s", "tokens", "load_s")}
                fraction = base["fraction"]
                for system in systems:
                    drop_caches()
                    _log(verbose, f"{sh['shape']} / {loc} / {system}")
                    spec = arm_spec(base, system, traces[loc], fraction)
                    with MemoryCgroup(budget) as cg:
                        run = _child(spec, cg, args.timeout)
                    if system == "asyncside" and run.get("rows_per_layer"):
                        # The slot cache gets the rows asyncside's plan chose for this budget.
                        rows = run["rows_per_layer"]
                        fraction = rows_fraction(rows, sh["experts_per_layer"])
                    run.update(shape=sh["shape"], locality=loc)
                    if loc in sh["routings"]:
                        run["routing"] = sh["routings"][loc]
                    _figures(run, sh, traces[loc], compute)
                    result["runs"].append(run)
                    speed = run.get("decode_tokens_per_s", 0)
                    _log(verbose, f"  {run['status']}: {speed:.2f} tok/s{_loading_note(run)}")
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    result["tokens_identical"] = tokens_identical(result["runs"])
    result["seconds"] = round(time.time() - started, 1)
    if not getattr(args, "json", False):
        if getattr(args, "markdown", False):
            print(render_markdown(result))
        else:
            render_table(result)
    return result


def tokens_identical(runs: list[dict[str, Any]]) -> bool:
    """Whether every run's tokens equal the all-resident reference's: none differs, and every run
    of asyncside compared some. A run of mlx-lm or the slot cache may end before its first token
    (killed by the budget: what the bench is there to show), but one of asyncside that did (a
    crash, a timeout before decoding) compared nothing, and is not counted as equal."""
    return all(r.get("tokens_match_reference") is not False for r in runs) and all(
        r.get("tokens_match_reference") is True for r in runs if r.get("system") == "asyncside")


def _figures(run: dict[str, Any], sh: dict[str, Any], trace_file: str, compute: dict[str, Any]) -> None:
    """The derived columns of one run (in place)."""
    toks = run.get("tokens") or []
    ref = compute.get("tokens") or []
    n = min(len(toks), len(ref))
    run["tokens_match_reference"] = (toks[:n] == ref[:n]) if n else None
    run["n_tokens"] = len(toks)
    if run.get("status") != "ok" or not toks:
        return
    steps = len(toks)
    st = run.get("stats") or {}
    if run.get("rows_per_layer"):
        hits, misses = st.get("hits", 0), st.get("misses", 0)
        run["hit_rate"] = hits / (hits + misses) if hits + misses else None
        run["belady"] = belady_of_run(trace_file, sh["store"], steps, run["rows_per_layer"], run.get("warm_experts"),
                                      run.get("pinned_experts"))
        mn = run["belady"]["hit_rate"]
        run["of_min"] = run["hit_rate"] / mn if run["hit_rate"] is not None and mn else None
        # the same against MIN under the ledger's rule (no bypass, pinned rows kept)
        ruled = (run["belady"].get("no_bypass") or {}).get("hit_rate")
        run["of_min_no_bypass"] = run["hit_rate"] / ruled if run["hit_rate"] is not None and ruled else None
        run["miss_mb_per_token"] = misses * sh["record_bytes"] / steps / MB
        # What the disk must give a token: the misses' records and the prefetches' (right or wrong)
        run["prefetch_mb_per_token"] = st.get("prefetch_reads", 0) * sh["record_bytes"] / steps / MB
        need = run["miss_mb_per_token"] + run["prefetch_mb_per_token"]
        bw = sh["io"]["GBps"] * 1e9
        run["io_limit_tokens_per_s"] = bw / (need * MB) if need else None
    run["disk_mb_per_token"] = run.get("read_bytes", 0) / steps / MB
    run["compute_limit_tokens_per_s"] = compute.get("decode_tokens_per_s")
    known = {name: x for name, x in (("compute limit", run["compute_limit_tokens_per_s"]),
                                     ("I/O limit", run.get("io_limit_tokens_per_s"))) if x}
    run["of_limit"] = run["decode_tokens_per_s"] / min(known.values()) if known else None
    # what of_limit is held to: both limits' min, or the one of them that was measured
    run["of_limit_against"] = (None if not known else "min(compute, I/O limit)" if len(known) == 2
                               else next(iter(known)))


def _f(v: Any, spec: str, suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


#: "of MIN (bypass)": of MIN with bypass over every row; "of MIN (no bypass)": of MIN under the
#: ledger's rule (belady_of_run), the run's own ceiling.
COLUMNS = ["shape", "locality", "system", "tok/s", "hit rate", "of MIN (bypass)", "of MIN (no bypass)", "miss MB/tok",
           "disk MB/tok", "peak MB", "I/O limit", "compute limit", "of limit", "status"]


def _of_what(r: dict[str, Any]) -> str:
    """What the "of limit" cell is held to where it is not min(compute, I/O limit): the one
    limit that was measured."""
    against = r.get("of_limit_against")
    return f" (of the {against}; the other not measured)" if r.get("of_limit") is not None and against in (
        "compute limit", "I/O limit") else ""


def _row(r: dict[str, Any]) -> list[str]:
    return [r["shape"], r["locality"], r["system"], _f(r.get("decode_tokens_per_s"), ".2f"),
            _f(r.get("hit_rate"), ".1%"), _f(r.get("of_min"), ".2f", "x"), _f(r.get("of_min_no_bypass"), ".2f", "x"),
            _f(r.get("miss_mb_per_token"), ".1f"),
            _f(r.get("disk_mb_per_token"), ".1f"), _f((r.get("peak_bytes") or 0) / MB or None, ".0f"),
            _f(r.get("io_limit_tokens_per_s"), ".2f"), _f(r.get("compute_limit_tokens_per_s"), ".2f"),
            _f(r.get("of_limit"), ".2f", "x") + _of_what(r),
            r["status"] if r["status"] == "ok" or len(r["status"]) < 90 else r["status"][:87] + "..."]


def _title(result: dict[str, Any]) -> str:
    shapes = "; ".join(f"{s['shape']} {_count(s['moe_layers'], 'layer')} x {_count(s['experts_per_layer'], 'expert')} "
                       f"top-{s['top_k']}, "
                       f"store {s['store_bytes'] / MB:.0f} MB, disk {s['io']['GBps']:.2f} GB/s at "
                       f"{s['record_bytes'] / MB:.2f} MB x depth {s['io']['queue_depth']}"
                       + (f" (not represented: {s['note']})" if s.get("note") else "") for s in result["shapes"])
    notes = "".join(f"; routing {routing_note(info)}" for s in result["shapes"]
                    for info in s.get("routings", {}).values())
    return f"bench offload: budget {_budget_text(result['budget_bytes'])} ({result['cgroup']}); {shapes}{notes}"


def _budget_text(budget: int) -> str:
    """The budget as --memory reads it (binary: 700M is 700 MiB, what asyncside's plan and its
    refusals say) beside the decimal MB the tables use."""
    if budget < 2**20:  # a budget below a MiB read "0 MiB (0 MB)"
        return f"{budget} bytes"
    return f"{budget / 2**20:.0f} MiB ({budget / MB:.0f} MB)"


def render_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=_title(result))
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("shape", "locality", "system", "status") else "right")
    for r in result["runs"]:
        table.add_row(*_row(r))
    Console().print(table)


def render_markdown(result: dict[str, Any]) -> str:
    lines = [_title(result), "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in result["runs"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.offload``; with ``--child SPEC`` one run (JSON on stdout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(child_main(json.loads(argv[1]))), flush=True)
        return 0
    from ..cli import main as cli_main

    return cli_main(["bench", "offload", *argv])  # refusals as `asyncside bench offload` says them


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
