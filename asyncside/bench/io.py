"""``asyncside bench io``: read-path throughput per reader, cold and warm, over a queue-depth sweep.

Every figure comes from one run, side by side, on expert stores with the record layouts of real
models (written with :meth:`ExpertStore.create`, so the format is the real one):

- ``qwen3-30b-a3b``: 9 segments (gate/up/down x weight/scales/biases, 4-bit, group 64, hidden
  2048, moe_intermediate 768): 2,654,208-byte records;
- ``deepseek-v3``: the same 9 segments at hidden 7168, moe_intermediate 2048: 24,772,608 bytes.

Per layout, for each reader (io_uring, threads, aiofiles) through the real async path
(:class:`~asyncside.scheduler.Scheduler` on an asyncio loop, random records into ``depth`` pool
rows kept full), in three cache states:

- ``warm``: the pass's records are in the page cache (read just before the pass: a host may run
  DAMON proactive reclaim, which pages out cache left idle for about a second), buffered reads;
- ``cold_direct``: O_DIRECT reads (the page cache is bypassed);
- ``cold_buffered``: buffered reads after evicting the blob from the page cache
  (``posix_fadvise(DONTNEED)`` on the blob; with ``--drop-caches`` as root, also
  ``echo 3 > /proc/sys/vm/drop_caches``) before every pass.

Every pass verifies each record's CRC-32C (the readers' default); at the deepest queue of the warm
and O_DIRECT states each reader also runs with verification off (``<reader> no-verify``),
interleaved with the others, and ``verify_cost`` reports verified / unverified GB/s
(``--no-verify`` turns verification off everywhere). Warm passes of the native readers copy
page-cached records from a mapping of the blob (``ReaderOptions.mapped_reads``); at the deepest warm
queue the same reads also run with preadv only (``<reader> no-map``: verified, and ``threads
no-verify no-map``: the kernel's copy alone), and ``preadv_verify_cost`` / ``mapped_vs_preadv``
compare them.

Beside them, in the same run: for the cold states, fio with io_uring at the same depth and block
size (= the stride; the disk's limit for this access pattern) when fio is installed; the side-region design's read
(one thread, ``pread`` of each whole record into a temp buffer, then one ``memcpy`` per segment; native);
single-thread ``memcpy`` of record-sized blocks (the warm limit) and the same on every CPU. The
loop stall is the largest gap seen by a 1 ms ticker task on the loop while reading.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..argtypes import directory, int_at_least, positive_float, writable_file
from ..errors import os_reason
from . import bench_main, json_ready, median
from .machine import machine_info

GB = 1e9
MODES = ("warm", "cold_direct", "cold_buffered")
READER_NAMES = ("io_uring", "threads", "aiofiles")


@dataclass(frozen=True)
class ModelLayout:
    """Routed-expert shapes of one MoE layer, quantized (uint32-packed weights, bf16 scales/biases)."""

    name: str
    hidden: int
    intermediate: int
    bits: int = 4
    group: int = 64

    def segments(self) -> list[tuple[str, str, tuple[int, ...]]]:
        per = 32 // self.bits
        out: list[tuple[str, str, tuple[int, ...]]] = []
        for proj, (rows, cols) in (("gate_proj", (self.intermediate, self.hidden)),
                                   ("up_proj", (self.intermediate, self.hidden)),
                                   ("down_proj", (self.hidden, self.intermediate))):
            out.append((f"{proj}.weight", "uint32", (rows, cols // per)))
            out.append((f"{proj}.scales", "bfloat16", (rows, cols // self.group)))
            out.append((f"{proj}.biases", "bfloat16", (rows, cols // self.group)))
        return out

    @property
    def record_bytes(self) -> int:
        return sum(int(np.prod(s)) * (4 if d == "uint32" else 2) for _, d, s in self.segments())


LAYOUTS = {
    "qwen3-30b-a3b": ModelLayout("qwen3-30b-a3b", hidden=2048, intermediate=768),
    "deepseek-v3": ModelLayout("deepseek-v3", hidden=7168, intermediate=2048),
}
DEFAULT_DEPTHS = {"qwen3-30b-a3b": [1, 4, 16, 64], "deepseek-v3": [1, 2, 4, 8]}


def add_io_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``asyncside bench io`` (the CLI adds --json)."""
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: tiny store, one depth, one pass (numbers are noise)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {list(LAYOUTS)}")
    parser.add_argument("--readers", default=",".join(READER_NAMES), help="comma list of readers to measure")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)}")
    parser.add_argument("--depths", default=None,
                        help="comma list of queue depths (default per layout: qwen 1,4,16,64; deepseek 1,2,4,8)")
    parser.add_argument("--store-gib", type=positive_float, default=1.0, help="blob size per layout in GiB (default 1)")
    parser.add_argument("--pass-mib", type=positive_float, default=256.0,
                        help="bytes read per measured pass, MiB (default 256)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3,
                        help="passes per cell; the median is reported (default 3)")
    parser.add_argument("--dir", type=directory, default=None,
                        help="where to build the stores (default: a temp dir, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the stores (reuse them with --dir next time)")
    from .._native import ReaderOptions

    d = ReaderOptions()
    # The reader's own limits, checked as parsed: the native reader refused them with a traceback.
    parser.add_argument("--chunk-kib", type=int_at_least(4), default=d.chunk_bytes // 1024,
                        help="largest O_DIRECT read op in KiB (default %(default)s)")
    parser.add_argument("--buffered-chunk-kib", type=int_at_least(1), default=d.buffered_chunk_bytes // 1024,
                        help="largest buffered read op in KiB (default %(default)s)")
    parser.add_argument("--iowq-workers", type=int_at_least(-1), default=d.iowq_max_workers,
                        help="io_uring: io-wq copy threads (default %(default)s: the CPU count; 0: kernel default)")
    parser.add_argument("--worker-nice", type=int, default=d.worker_nice,
                        help="native worker threads run this much nicer than the loop thread (default %(default)s)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="as root, also echo 3 > /proc/sys/vm/drop_caches before cold buffered passes")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even when it is installed")
    parser.add_argument("--no-verify", action="store_true",
                        help="read without checking records' checksums (default: verify, plus a no-verify ablation)")
    # checked when parsed: a directory that is missing or not writable was a traceback after the run,
    # its result lost
    parser.add_argument("--out", type=writable_file, default=None, help="also write the JSON result to this file")
    parser.add_argument("--markdown", action="store_true",
                        help="print Markdown tables (BENCHMARKS.md) instead of rich ones")


# ---- machine ---------------------------------------------------------------------------------


def _machine(store_dir: str) -> dict[str, Any]:
    from ..readers import io_uring_status

    return {**machine_info(store_dir), "io_uring": io_uring_status()[1] or "available"}


# ---- store -----------------------------------------------------------------------------------


def _layer_arrays(layout: ModelLayout, n_experts: int, seed: int) -> dict[str, np.ndarray]:
    """Random-looking bytes (a 16 MiB random block tiled), so nothing on the path can compress them."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=16 << 20, dtype=np.uint8)
    out: dict[str, np.ndarray] = {}
    for i, (key, dtype, shape) in enumerate(layout.segments()):
        np_dtype = np.uint32 if dtype == "uint32" else np.uint16
        arr = np.empty((n_experts, *shape), dtype=np_dtype)
        flat = arr.reshape(-1).view(np.uint8)
        start = (i * 7919) % block.size
        for off in range(0, flat.size, block.size):
            n = min(block.size, flat.size - off)
            src = np.roll(block, -start)[:n] if off == 0 else block[:n]
            flat[off:off + n] = src
        if dtype == "bfloat16":
            import mlx.core as mx

            out[key] = mx.array(arr).view(mx.bfloat16)  # type: ignore[assignment]
        else:
            out[key] = arr
    return out


def _build_store(root: str, layout: ModelLayout, n_experts: int):  # -> ExpertStore
    from ..store import ExpertStore

    path = os.path.join(root, f"{layout.name}-{n_experts}")
    if os.path.exists(os.path.join(path, "manifest.json")):
        store = ExpertStore.open(path)
        spec = store.layer(0)
        if spec.n_experts == n_experts and spec.segments[0].key == "gate_proj.weight" and spec.checksum == "crc32c":
            return store
        shutil.rmtree(path)
    # CRC-32C checksums, as every store gets by default: the readers verify each record they load.
    try:
        os.makedirs(root, exist_ok=True)
        return ExpertStore.create(path, {0: _layer_arrays(layout, n_experts, seed=n_experts)},
                                  metadata={"bench": "io", "layout": layout.name})
    except OSError as exc:  # a read-only or full --dir was a traceback
        from ..errors import AsyncsideError

        raise AsyncsideError(f"--dir {root}: cannot write the bench's store {path}: "
                             f"{os_reason(exc)}") from None


# ---- cache control ---------------------------------------------------------------------------


class CacheControl:
    """Warm a blob into the page cache, or evict it (fadvise; plus drop_caches when asked as root)."""

    def __init__(self, drop_caches: bool) -> None:
        self.drop = drop_caches and os.geteuid() == 0 and os.path.exists("/proc/sys/vm/drop_caches")
        self.method = "posix_fadvise(POSIX_FADV_DONTNEED) on the blob" + (
            " + echo 3 > /proc/sys/vm/drop_caches" if self.drop else "")

    def evict(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if self.drop:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")

    @staticmethod
    def warm(path: str) -> None:
        with open(path, "rb", buffering=0) as fh:
            buf = bytearray(8 << 20)
            while fh.readinto(buf):
                pass

    @staticmethod
    def warm_records(path: str, stride: int, experts: Sequence[int]) -> None:
        """Read exactly these records right before a warm pass: machines with proactive reclaim
        (DAMON pageout) evict page cache left idle for about a second."""
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = bytearray(min(stride, 8 << 20))
            for e in experts:
                off = 0
                while off < stride:
                    n = os.preadv(fd, [memoryview(buf)[: min(len(buf), stride - off)]], e * stride + off)
                    if n <= 0:
                        break
                    off += n
        finally:
            os.close(fd)

    def prepare(self, mode: str, path: str, stride: int, experts: Sequence[int]) -> list[int]:
        """Put the blob in the state a pass of ``mode`` needs; returns ``experts``."""
        if mode == "warm":
            self.warm_records(path, stride, experts)
        else:
            self.evict(path)
        return list(experts)


# ---- measured passes -------------------------------------------------------------------------


class _Fill:
    __slots__ = ("fill_id", "expert", "row")

    def __init__(self, fill_id: int, expert: int, row: int) -> None:
        self.fill_id, self.expert, self.row = fill_id, expert, row


async def _ticker(stop: Any, gaps: list[float]) -> None:
    import anyio

    last = time.perf_counter()
    while not stop.is_set():
        await anyio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _drive(sched: Any, spec: Any, pools: Any, experts: Sequence[int], depth: int) -> None:
    """Keep ``depth`` reads in flight until every expert in ``experts`` has landed, rotating through
    all of the pools' rows (FIFO), so destinations are as cache-cold as a real side region's."""
    import anyio

    todo = deque(experts)
    free = deque(range(pools.rows))
    inflight = [0]
    finished = anyio.Event()
    left = [len(experts)]
    errors: list[BaseException] = []

    def done(h: Any) -> None:
        if h.result_error() is not None and not errors:
            errors.append(h.result_error())
        free.append(h.fill.row)
        inflight[0] -= 1
        left[0] -= 1
        if left[0] == 0:
            finished.set()
        else:
            launch()

    def launch() -> None:
        fills = []
        while free and todo and inflight[0] < depth:
            fills.append(_Fill(len(todo), todo.popleft(), free.popleft()))
            inflight[0] += 1
        if fills:
            for h in sched.submit(spec, pools, fills):
                h.add_done_callback(done)

    launch()
    await finished.wait()
    if errors:
        raise errors[0]


async def _idle_pass(seconds: float) -> float:
    """The loop stall floor: the largest ticker gap with no reads at all (CPU contention, timer slack)."""
    import anyio

    gaps: list[float] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_ticker, stop, gaps)
        await anyio.sleep(seconds)
        stop.set()
    return max(0.0, (max(gaps) - 0.001) * 1e3) if gaps else 0.0


async def _reader_pass(reader: str, options: Any, spec: Any, pools: Any, experts: list[int]) -> dict[str, float]:
    import anyio

    from ..scheduler import Scheduler

    depth = options.queue_depth
    async with Scheduler(reader, options) as sched:
        await sched.prepare(spec, pools)  # the blob is opened before the clock starts
        gaps: list[float] = []
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_ticker, stop, gaps)
            await anyio.sleep(0.003)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            await _drive(sched, spec, pools, experts, depth)
            t1 = time.perf_counter()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            stop.set()
        st = sched.stats()
        counters = st.get("native", {})
    nbytes = len(experts) * sum(s.nbytes for s in spec.segments)
    cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    return {
        "seconds": t1 - t0,
        # Process CPU (every thread, io_uring's io-wq workers included) per GB: what the pass cost,
        # far less sensitive than GB/s to other tenants of a shared machine.
        "cpu_s_per_GB": cpu / (nbytes / GB),
        "bytes": nbytes,
        "GBps": nbytes / (t1 - t0) / GB,
        "loop_stall_ms": max(0.0, (max(gaps) - 0.001) * 1e3) if gaps else 0.0,
        "submit_ms_max": st["submit_s_max"] * 1e3,
        "native_submit_ms_max": counters.get("submit_ns_max", 0) / 1e6,
        "native_reap_ms_max": counters.get("reap_ns_max", 0) / 1e6,
        "ops": counters.get("ops_submitted", 0),
        "mapped_chunks": counters.get("mapped_chunks", 0),
        "fills_direct_rows": counters.get("fills_direct_rows", 0),
        "fills_staged": counters.get("fills_staged", 0),
        "checksums_verified": counters.get("checksums_verified", 0),
        "checksum_GBps": (counters["checksum_bytes"] / counters["checksum_ns"]) if counters.get("checksum_ns") else 0.0,
    }


def _side_region_pass(spec: Any, pools: Any, experts: list[int], rows: int) -> dict[str, float]:
    from .._native import bench as native_bench

    segs = spec.segments
    t0 = time.perf_counter()
    native_bench.side_region_read(str(spec.path), spec.stride, [s.offset for s in segs], [s.nbytes for s in segs],
                                  [pools.arrays[s.key] for s in segs], experts, [i % rows for i in range(len(experts))])
    t1 = time.perf_counter()
    nbytes = len(experts) * sum(s.nbytes for s in segs)
    return {"seconds": t1 - t0, "bytes": nbytes, "GBps": nbytes / (t1 - t0) / GB}


def _small_reads(path: str, stride: int, n_experts: int, repeat: int, batches: int) -> list[dict[str, Any]]:
    """Warm 4 KiB reads, 64 in flight, native readers driven without an event loop: the per-op cost,
    and what registered files/buffers buy (io_uring with and without registration)."""
    import mlx.core as mx

    from .. import _native
    from ..readers import io_uring_status

    pool = mx.zeros((64, 4096), dtype=mx.uint8)
    mx.eval(pool)
    configs = [("threads", "threads", False)]
    if io_uring_status()[0]:
        configs = [("io_uring registered", "io_uring", True), ("io_uring plain", "io_uring", False)] + configs
    rng = random.Random(7)
    rates: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    for _ in range(repeat):
        for label, backend, reg in configs:  # interleaved
            r = _native.Reader(backend, _native.ReaderOptions(register_files=reg, register_buffers=reg))
            lid = r.add_layout(path, stride, n_experts, [0], [4096], [pool])
            t0 = time.perf_counter()
            for _ in range(batches):
                r.submit(lid, list(range(64)), rng.choices(range(n_experts), k=64), list(range(64)))
                got = len(r.reap())
                while got < 64:
                    r.wait(100)
                    got += len(r.reap())
            rates[label].append(64 * batches / (time.perf_counter() - t0))
            r.close()
    return [{"reader": label, "reads_per_s": round(median(v)), "passes": [round(x) for x in v]}
            for label, v in rates.items()]


def _fio_pass(path: str, bs: int, depth: int, io_bytes: int, mode: str) -> dict[str, Any]:
    direct = 1 if mode == "cold_direct" else 0
    invalidate = 1  # cold: fio drops the file's cached pages before reading (as we evict them)
    cmd = ["fio", "--name=asyncside", f"--filename={path}", "--rw=randread", f"--bs={bs}", f"--iodepth={depth}",
           "--ioengine=io_uring", f"--direct={direct}", f"--invalidate={invalidate}", f"--io_size={io_bytes}",
           "--numjobs=1", "--norandommap", "--randrepeat=0", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[:500]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
    return {"GBps": job["bw_bytes"] / GB, "bytes": job["io_bytes"], "seconds": job["runtime"] / 1e3,
            "command": " ".join(cmd)}


# ---- the run ---------------------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    from .._native import ReaderOptions

    d = ReaderOptions()
    quick = bool(getattr(args, "quick", False))
    layouts = [x for x in str(getattr(args, "layouts", ",".join(LAYOUTS))).split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            raise ValueError(f"--layouts: unknown layout {x!r}; known: {list(LAYOUTS)}")
    readers = [x for x in str(getattr(args, "readers", ",".join(READER_NAMES))).split(",") if x]
    for x in readers:
        if x not in READER_NAMES:
            raise ValueError(f"--readers: unknown reader {x!r}; known: {list(READER_NAMES)}")
    modes = [x for x in str(getattr(args, "modes", ",".join(MODES))).split(",") if x]
    for x in modes:
        if x not in MODES:
            raise ValueError(f"--modes: unknown mode {x!r}; known: {list(MODES)}")
    depths_arg = getattr(args, "depths", None)
    depths = {name: ([int(d) for d in depths_arg.split(",")] if depths_arg else list(DEFAULT_DEPTHS[name]))
              for name in layouts}
    if any(d < 1 for ds in depths.values() for d in ds):
        raise ValueError(f"--depths: expected positive integers, got {depths_arg!r}")
    s = {
        "quick": quick,
        "layouts": layouts,
        "readers": readers,
        "modes": modes,
        "depths": depths,
        "store_gib": float(getattr(args, "store_gib", 1.0)),
        "pass_mib": float(getattr(args, "pass_mib", 256.0)),
        "repeat": max(1, int(getattr(args, "repeat", 3))),
        "chunk_bytes": int(getattr(args, "chunk_kib", d.chunk_bytes // 1024)) * 1024,
        "buffered_chunk_bytes": int(getattr(args, "buffered_chunk_kib", d.buffered_chunk_bytes // 1024)) * 1024,
        "iowq_max_workers": int(getattr(args, "iowq_workers", d.iowq_max_workers)),
        "worker_nice": int(getattr(args, "worker_nice", d.worker_nice)),
        "drop_caches": bool(getattr(args, "drop_caches", False)),
        "fio": not bool(getattr(args, "no_fio", False)),
        "verify": not bool(getattr(args, "no_verify", False)),
    }
    if quick:
        s.update(layouts=layouts[:1], store_gib=0.02, pass_mib=16.0, repeat=1,
                 depths={layouts[0]: [min(4, max(depths[layouts[0]]))]})
    return s


def run_io_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; print a table unless ``args.json``; return the result dict."""
    import anyio

    from ..pools import PoolSet
    from ..readers import io_uring_status

    s = _settings(args)
    given: str | None = getattr(args, "dir", None)
    made_root = given is None
    root = tempfile.mkdtemp(prefix="asyncside-bench-io-") if given is None else given
    started = time.time()
    cache = CacheControl(s["drop_caches"])
    have_fio = s["fio"] and shutil.which("fio") is not None
    readers = [r for r in s["readers"] if r != "io_uring" or io_uring_status()[0]]
    skipped = [f"io_uring: {io_uring_status()[1]}"] if len(readers) < len(s["readers"]) else []
    refused = _direct_refused(root) if "cold_direct" in s["modes"] else ""
    if refused:
        # A filesystem without O_DIRECT (ramfs, some FUSE mounts, an older tmpfs): every cold_direct
        # pass failed at its first open, a traceback that lost the other modes' numbers.
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
        where = f"--dir {given}" if given is not None else f"the temporary directory {root}"
        if s["modes"] == ["cold_direct"]:
            raise ValueError(f"--modes: cold_direct reads with O_DIRECT, which the filesystem of {where} "
                             f"refuses ({refused}); pass another --dir")
        s["modes"] = [m for m in s["modes"] if m != "cold_direct"]
        skipped.append(f"cold_direct: the filesystem of {where} refuses O_DIRECT ({refused})")
        print(f"asyncside bench io: skipping cold_direct: the filesystem of {where} refuses O_DIRECT ({refused}); "
              "pass another --dir to measure it", file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "bench": "io",
        "argv": list(sys.argv),
        "settings": s,
        "machine": _machine(root),
        "cold_methods": {"cold_direct": "O_DIRECT (page cache bypassed)", "cold_buffered": cache.method},
        "fio": _fio_version() if have_fio else ("fio not installed" if s["fio"] else "skipped (--no-fio)"),
        "skipped": skipped,
        "layouts": [],
        "checksum": {"crc32c": _native_checksum_impl()},
    }
    try:
        for name in s["layouts"]:
            result["layouts"].append(_bench_layout(LAYOUTS[name], s, root, readers, cache, have_fio, PoolSet, anyio))
        first = result["layouts"][0]
        path0 = os.path.join(root, f"{first['layout']}-{first['experts_in_store']}", "layer-00000.bin")
        CacheControl.warm(path0)
        result["small_reads_4k_warm"] = _small_reads(path0, first["stride"], first["experts_in_store"], s["repeat"],
                                                      20 if s["quick"] else 200)
    finally:
        if made_root and not getattr(args, "keep", False):
            shutil.rmtree(root, ignore_errors=True)
    result["seconds"] = round(time.time() - started, 1)
    result["targets"] = _targets(result)
    out = getattr(args, "out", None)
    if out:
        with open(out, "w") as fh:
            json.dump(json_ready(result), fh, indent=2, allow_nan=False)
    if getattr(args, "markdown", False):
        print(render_io_markdown(result))
    elif not getattr(args, "json", False):
        render_io_table(result)
    return result


def _direct_refused(root: str) -> str:
    """Why a file made under ``root`` cannot be opened with O_DIRECT, or "" where it can."""
    try:
        os.makedirs(root, exist_ok=True)  # --dir may name one the stores' build would make
        fd, probe = tempfile.mkstemp(dir=root, prefix=".asyncside-direct-probe-")
    except OSError:
        return ""  # a directory the bench cannot write: the stores' build says so, naming --dir
    os.close(fd)
    try:
        os.close(os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except OSError as exc:
        return f"{exc.strerror} (errno {exc.errno})"
    finally:
        os.unlink(probe)
    return ""


def _native_checksum_impl() -> str:
    from .. import _native

    return str(_native.checksum_implementation("crc32c"))


def _fio_version() -> str:
    try:
        return subprocess.run(["fio", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "fio (version unknown)"


def _bench_layout(layout: ModelLayout, s: dict[str, Any], root: str, readers: list[str], cache: CacheControl,
                  have_fio: bool, PoolSet: Any, anyio: Any) -> dict[str, Any]:
    from .._native import ReaderOptions
    from .._native import bench as native_bench

    rec = layout.record_bytes
    n_experts = max(4, int(s["store_gib"] * 2**30 // rec))
    store = _build_store(root, layout, n_experts)
    spec = store.layer(0)
    path = str(spec.path)
    per_pass = max(1, min(n_experts, int(s["pass_mib"] * 2**20 // rec)))
    rng = random.Random(1234)
    depths = s["depths"][layout.name]
    out: dict[str, Any] = {
        "layout": layout.name,
        "record_bytes": rec,
        "segments": len(spec.segments),
        "stride": spec.stride,
        "experts_in_store": n_experts,
        "store_bytes": spec.blob_bytes,
        "records_per_pass": per_pass,
        "runs": [],
        "fio": [],
        "idle_stall": [],
    }
    pools_by_rows: dict[int, Any] = {}

    def pools_for(rows: int) -> Any:
        if rows not in pools_by_rows:
            pools_by_rows[rows] = PoolSet(spec, rows)
        return pools_by_rows[rows]

    # One pool set for every pass: at least the deepest queue and at least 128 MiB of rows (more than
    # the last-level cache), so no method writes into cache-hot rows.
    n_rows = max(max(depths), -(-(128 << 20) // rec))
    out["pool_rows"] = n_rows

    def sample() -> list[int]:
        return rng.sample(range(n_experts), per_pass)

    # Limits first: memcpy of record-sized blocks, one thread and every CPU.
    work = min(512 << 20, max(4 * rec, 64 << 20))
    total = per_pass * rec
    out["memcpy_1t_GBps"] = median([total / native_bench.memcpy_seconds(total, rec, work, 1) / GB
                                     for _ in range(s["repeat"])])
    ncpu = os.cpu_count() or 1
    out[f"memcpy_{ncpu}t_GBps"] = median([total / native_bench.memcpy_seconds(total, rec, work, ncpu) / GB
                                           for _ in range(s["repeat"])])

    # The kernel's own page-cache copy (pread of whole records, no second copy, no Python): what a
    # warm read can reach on this machine with 1 and with every CPU.
    if "warm" in s["modes"]:
        for th in sorted({1, ncpu}):
            vals = []
            for _ in range(s["repeat"]):
                ex = cache.prepare("warm", path, spec.stride, sample())
                vals.append(total / native_bench.pread_seconds(path, spec.stride, ex, th) / GB)
            out[f"pread_{th}t_GBps"] = median(vals)

    default_threshold = ReaderOptions().async_threshold
    # The side-region design's read: warm and cold buffered (it never used O_DIRECT).
    side: dict[str, Any] = {}
    for mode in ("warm", "cold_buffered"):
        if mode not in s["modes"] and not (mode == "cold_buffered" and "cold_direct" in s["modes"]):
            continue
        vals = []
        for _ in range(s["repeat"]):
            ex = cache.prepare(mode, path, spec.stride, sample())
            vals.append(_side_region_pass(spec, pools_for(n_rows), ex, n_rows)["GBps"])
        side[mode] = median(vals)
    out["side_region_GBps"] = side

    for mode in s["modes"]:
        direct = mode == "cold_direct"
        for depth in depths:
            pools = pools_for(n_rows)
            # Cells of one (mode, depth) run interleaved, round-robin, so that the noise of a shared
            # machine lands on every method alike.
            methods = _read_methods(readers, mode, depth == max(depths), s["verify"], default_threshold)
            passes: dict[str, list[dict[str, float]]] = {}
            fio_vals: list[float] = []
            fio_cmd = ""
            for _ in range(s["repeat"]):
                for label, reader, threshold, direct_rows, verify_on, mapped in methods:
                    ex = cache.prepare(mode, path, spec.stride, sample())
                    options = ReaderOptions(
                        queue_depth=depth, direct=direct, chunk_bytes=s["chunk_bytes"],
                        buffered_chunk_bytes=s["buffered_chunk_bytes"], async_threshold=threshold,
                        iowq_max_workers=s["iowq_max_workers"], worker_nice=s["worker_nice"], direct_rows=direct_rows,
                        verify=verify_on, mapped_reads=mapped)
                    passes.setdefault(label, []).append(anyio.run(_reader_pass, reader, options, spec, pools, ex))
                if have_fio and mode != "warm":
                    cache.evict(path)
                    r = _fio_pass(path, spec.stride, depth, per_pass * spec.stride, mode)
                    fio_vals.append(r["GBps"])
                    fio_cmd = r["command"]
            for label, ps in passes.items():
                out["runs"].append(_cell(label, mode, depth, ps))
            # Same-duration windows with no reads: what the ticker sees from the machine alone.
            window = median([p["seconds"] for ps in passes.values() for p in ps])
            idle = max(anyio.run(_idle_pass, window) for _ in range(s["repeat"]))
            out["idle_stall"].append({"mode": mode, "depth": depth, "loop_stall_ms": round(idle, 2)})
            if have_fio and mode != "warm":
                out["fio"].append({"mode": mode, "depth": depth, "GBps": median(fio_vals),
                                   "passes_GBps": [round(v, 3) for v in fio_vals], "command": fio_cmd})
    pools_by_rows.clear()
    return out


def _read_methods(readers: list[str], mode: str, deepest: bool, verify: bool,
                  default_threshold: int) -> list[tuple[str, str, int, bool, bool, bool]]:
    """The methods of one (mode, depth) cell, as (label, reader, async_threshold, direct_rows, verify,
    mapped_reads): every reader, plus the ablations at the deepest queue."""
    methods: list[tuple[str, str, int, bool, bool, bool]] = [
        (r, r, default_threshold, True, verify, True) for r in readers]
    if verify and deepest and mode != "cold_buffered":
        # Ablation: the same reads without checksum verification (what it costs).
        methods += [(f"{r} no-verify", r, default_threshold, True, False, True) for r in readers]
    if mode == "warm" and deepest:
        # Ablation: preadv only (the kernel's copy; verified: in windows checksummed as they
        # land), no copy from the blob's mapping.
        native_readers = [r for r in readers if r != "aiofiles"]
        methods += [(f"{r} no-map", r, default_threshold, True, verify, False) for r in native_readers]
        if verify and "threads" in readers:
            methods.append(("threads no-verify no-map", "threads", default_threshold, True, False, False))
    if "io_uring" in readers and deepest and mode != "cold_buffered":
        # Ablation: the same reads without IOSQE_ASYNC: page-cache copies (warm) or page
        # pinning + bio setup (O_DIRECT) then run inside io_uring_enter on the loop thread.
        methods.append(("io_uring no-ASYNC", "io_uring", 1 << 62, True, verify, True))
    if mode == "cold_direct" and "io_uring" in readers and deepest:
        # Ablation: O_DIRECT through staging slots + native scatter instead of into the rows.
        methods.append(("io_uring staged", "io_uring", default_threshold, False, verify, True))
    return methods


def _cell(reader: str, mode: str, depth: int, passes: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "reader": reader,
        "mode": mode,
        "depth": depth,
        "GBps": median([p["GBps"] for p in passes]),
        "passes_GBps": [round(p["GBps"], 3) for p in passes],
        "loop_stall_ms": max(p["loop_stall_ms"] for p in passes),
        "submit_ms_max": round(max(p["submit_ms_max"] for p in passes), 3),
        "native_submit_ms_max": round(max(p["native_submit_ms_max"] for p in passes), 3),
        "native_reap_ms_max": round(max(p["native_reap_ms_max"] for p in passes), 3),
        "ops_per_pass": passes[0]["ops"],
        "mapped_chunks_per_pass": passes[0].get("mapped_chunks", 0),
        "fills_direct_rows": passes[0]["fills_direct_rows"],
        "fills_staged": passes[0]["fills_staged"],
        "checksums_verified": passes[0]["checksums_verified"],
        "cpu_s_per_GB": round(median([p["cpu_s_per_GB"] for p in passes]), 4),
        "checksum_GBps": round(median([p["checksum_GBps"] for p in passes]), 2),
    }


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    """The read path's targets, evaluated on this run: cold >= 95% of fio at equal depth and >= 3x
    the side-region design's read; warm >= 90% of single-thread memcpy."""
    t: dict[str, Any] = {}
    for lay in result["layouts"]:
        fio = {(f["mode"], f["depth"]): f["GBps"] for f in lay["fio"]}
        cells: dict[str, Any] = {}
        for reader in READER_NAMES:
            runs = [r for r in lay["runs"] if r["reader"] == reader]
            if not runs:
                continue
            c: dict[str, Any] = {}
            cold = [r for r in runs if r["mode"] == "cold_direct"]
            if cold and fio:
                ratios = {r["depth"]: r["GBps"] / fio[("cold_direct", r["depth"])]
                          for r in cold if ("cold_direct", r["depth"]) in fio}
                c["cold_direct_vs_fio"] = {d: round(x, 3) for d, x in ratios.items()}
                c["cold_ge_95pct_fio_every_depth"] = bool(ratios) and min(ratios.values()) >= 0.95
            side_cold = lay["side_region_GBps"].get("cold_buffered")
            if cold and side_cold:
                best = max(r["GBps"] for r in cold)
                c["cold_best_vs_side_region"] = round(best / side_cold, 2)
                c["cold_ge_3x_side_region"] = best / side_cold >= 3.0
            for mode in ("warm", "cold_direct"):
                unverified = [r for r in lay["runs"] if r["reader"] == f"{reader} no-verify" and r["mode"] == mode]
                for u in unverified:
                    v = next((r for r in runs if r["mode"] == mode and r["depth"] == u["depth"]), None)
                    if v and u["GBps"]:
                        # Verified / unverified GB/s, same reads, interleaved: 1.0 = free.
                        c.setdefault("verify_cost", {})[f"{mode}@{u['depth']}"] = round(v["GBps"] / u["GBps"], 3)
                        # The same as CPU per GB (unverified / verified): steadier on a busy machine.
                        if v.get("cpu_s_per_GB") and u.get("cpu_s_per_GB"):
                            c.setdefault("verify_cpu_cost", {})[f"{mode}@{u['depth']}"] = round(
                                u["cpu_s_per_GB"] / v["cpu_s_per_GB"], 3)
            no_map = next((r for r in lay["runs"] if r["reader"] == f"{reader} no-map"), None)
            if no_map:
                v = next((r for r in runs if r["mode"] == "warm" and r["depth"] == no_map["depth"]), None)
                if v and no_map["GBps"]:
                    # Verified reads from the mapping / verified preadv reads.
                    c["mapped_vs_preadv"] = {f"warm@{no_map['depth']}": round(v["GBps"] / no_map["GBps"], 3)}
                plain = next((r for r in lay["runs"] if r["reader"] == "threads no-verify no-map"), None)
                if plain and plain["GBps"]:
                    # Against the kernel's copy alone (threads, no checksum, no mapping): what a
                    # verified read costs compared with the plain preadv read, with and without
                    # the mapped path.
                    key = f"warm@{no_map['depth']}"
                    if v:
                        c["verify_cost_vs_plain_preadv"] = {key: round(v["GBps"] / plain["GBps"], 3)}
                    c["preadv_verify_cost"] = {key: round(no_map["GBps"] / plain["GBps"], 3)}
            warm = [r for r in runs if r["mode"] == "warm"]
            if warm:
                best = max(r["GBps"] for r in warm)
                c["warm_best_vs_memcpy_1t"] = round(best / lay["memcpy_1t_GBps"], 3)
                c["warm_ge_90pct_memcpy"] = best / lay["memcpy_1t_GBps"] >= 0.9
                ncpu = result["machine"]["nproc"]
                if lay.get(f"pread_{ncpu}t_GBps"):
                    limit = max(lay["pread_1t_GBps"], lay[f"pread_{ncpu}t_GBps"])
                    c["warm_best_vs_kernel_pread_limit"] = round(best / limit, 3)
                side_warm = lay["side_region_GBps"].get("warm")
                if side_warm:
                    c["warm_best_vs_side_region"] = round(best / side_warm, 2)
            cells[reader] = c
        t[lay["layout"]] = cells
    return t


def render_io_table(result: dict[str, Any]) -> None:
    """Print one rich table per layout (stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    m = result["machine"]
    for lay in result["layouts"]:
        fio = {(f["mode"], f["depth"]): f["GBps"] for f in lay["fio"]}
        names = list(dict.fromkeys(r["reader"] for r in lay["runs"]))
        side = lay["side_region_GBps"]
        mem_all = lay[f"memcpy_{m['nproc']}t_GBps"]
        pread_all = lay.get(f"pread_{m['nproc']}t_GBps", float("nan"))
        t = Table(title=f"bench io: {lay['layout']} ({lay['record_bytes']:,} B records, "
                        f"{lay['segments']} segments), GB/s",
                  caption=f"side-region design's read: warm {side.get('warm', float('nan')):.2f}, "
                          f"cold {side.get('cold_buffered', float('nan')):.2f} GB/s; "
                          f"memcpy 1 thread {lay['memcpy_1t_GBps']:.2f} GB/s, {m['nproc']} threads {mem_all:.2f} GB/s; "
                          f"warm pread (kernel copy, no Python) 1 thread {lay.get('pread_1t_GBps', float('nan')):.2f}, "
                          f"{m['nproc']} threads {pread_all:.2f} GB/s; "
                          "stall: largest gap of a 1 ms ticker on the loop, per reader (idle: same windows, no reads)")
        t.add_column("mode")
        t.add_column("depth", justify="right")
        for n in names:
            t.add_column(n, justify="right")
        t.add_column("fio io_uring", justify="right")
        short = {"io_uring": "uring", "threads": "thr", "aiofiles": "aio", "io_uring no-ASYNC": "no-async",
                 "io_uring staged": "staged", "io_uring no-verify": "uring-nv", "threads no-verify": "thr-nv",
                 "aiofiles no-verify": "aio-nv", "io_uring no-map": "uring-nm", "threads no-map": "thr-nm",
                 "threads no-verify no-map": "thr-nv-nm"}
        t.add_column("loop stall ms " + "/".join(short.get(n, n) for n in names), justify="right")
        keys = list(dict.fromkeys((r["mode"], r["depth"]) for r in lay["runs"]))
        for mode, depth in keys:
            row = [mode, str(depth)]
            stalls = []
            for n in names:
                cell = next((r for r in lay["runs"] if (r["reader"], r["mode"], r["depth"]) == (n, mode, depth)), None)
                row.append(f"{cell['GBps']:.2f}" if cell else "")
                stalls.append(f"{cell['loop_stall_ms']:.1f}" if cell else "-")
            f = fio.get((mode, depth))
            row.append(f"{f:.2f}" if f is not None else "-")
            idle = next((x["loop_stall_ms"] for x in lay.get("idle_stall", [])
                         if (x["mode"], x["depth"]) == (mode, depth)), None)
            row.append("/".join(stalls) + (f" (idle {idle:.1f})" if idle is not None else ""))
            t.add_row(*row)
        console.print(t)
    console.print("warm 4 KiB reads/s (64 in flight, no event loop): " + ", ".join(
        f"{x['reader']} {x['reads_per_s']:,}" for x in result.get("small_reads_4k_warm", [])))
    console.print(json.dumps(result["targets"], indent=1))
    console.print(f"{m['nproc']} CPUs, kernel {m['kernel']}, disk {m['disk']}; cold buffered: "
                  f"{result['cold_methods']['cold_buffered']}; fio: {result['fio']}; {result['seconds']} s")


def render_io_markdown(result: dict[str, Any]) -> str:
    """The result as Markdown tables (what BENCHMARKS.md shows)."""
    m = result["machine"]
    lines: list[str] = []
    for lay in result["layouts"]:
        fio = {(f["mode"], f["depth"]): f["GBps"] for f in lay["fio"]}
        idle = {(x["mode"], x["depth"]): x["loop_stall_ms"] for x in lay.get("idle_stall", [])}
        names = list(dict.fromkeys(r["reader"] for r in lay["runs"]))
        lines.append(f"**{lay['layout']}**: {lay['record_bytes']:,}-byte records of {lay['segments']} segments, "
                     f"{lay['experts_in_store']} records ({lay['store_bytes'] / 2**30:.2f} GiB) in the store, "
                     f"{lay['records_per_pass']} random records per pass, "
                     f"median of {result['settings']['repeat']} passes. GB/s "
                     "(loop stall, ms: largest gap of a 1 ms ticker on the loop during the passes).")
        lines.append("")
        lines.append("| mode | depth | " + " | ".join(names) + " | fio io_uring | idle stall |")
        lines.append("| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: |")
        for mode, depth in dict.fromkeys((r["mode"], r["depth"]) for r in lay["runs"]):
            row = [mode, str(depth)]
            for n in names:
                c = next((r for r in lay["runs"] if (r["reader"], r["mode"], r["depth"]) == (n, mode, depth)), None)
                row.append(f"{c['GBps']:.2f} ({c['loop_stall_ms']:.0f})" if c else "")
            f = fio.get((mode, depth))
            row.append(f"{f:.2f}" if f is not None else "-")
            i = idle.get((mode, depth))
            row.append(f"{i:.0f}" if i is not None else "-")
            lines.append("| " + " | ".join(row) + " |")
        o = lay["side_region_GBps"]
        nproc = m["nproc"]
        lines.append("")
        lines.append("Beside it: the side-region design's read (1 thread, pread whole record + memcpy per segment) "
                     f"warm "
                     f"{o.get('warm', float('nan')):.2f}, cold {o.get('cold_buffered', float('nan')):.2f} GB/s; "
                     f"memcpy of records 1 thread {lay['memcpy_1t_GBps']:.2f}, {nproc} threads "
                     f"{lay[f'memcpy_{nproc}t_GBps']:.2f} GB/s; warm pread of whole records (kernel copy, no Python) "
                     f"1 thread {lay.get('pread_1t_GBps', float('nan')):.2f}, {nproc} threads "
                     f"{lay.get(f'pread_{nproc}t_GBps', float('nan')):.2f} GB/s.")
        lines.append("")
    sm = result.get("small_reads_4k_warm", [])
    if sm:
        lines.append("Warm 4 KiB reads, 64 in flight, native readers without an event loop (reads/s): "
                     + ", ".join(f"{x['reader']} {x['reads_per_s']:,}" for x in sm) + ".")
        lines.append("")
    lines.append("Targets on this run (ratios):")
    lines.append("")
    lines.append("| layout | reader | cold O_DIRECT / fio (per depth) | cold best / side region "
                 "| warm best / memcpy 1t | warm best / kernel pread limit | verified / unverified "
                 "| verified mapped / verified preadv | verified / plain preadv (mapped, preadv) |")
    lines.append("| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |")
    for layout, readers in result["targets"].items():
        for reader, c in readers.items():
            per = ", ".join(f"{d}: {x:.2f}" for d, x in c.get("cold_direct_vs_fio", {}).items())
            vc = ", ".join(f"{k}: {x:.3f}" for k, x in c.get("verify_cost", {}).items())
            mp = ", ".join(f"{k}: {x:.3f}" for k, x in c.get("mapped_vs_preadv", {}).items())
            plain = ", ".join(f"{k}: {x:.3f}, {c.get('preadv_verify_cost', {}).get(k, float('nan')):.3f}"
                              for k, x in c.get("verify_cost_vs_plain_preadv", {}).items())
            lines.append(f"| {layout} | {reader} | {per} | {c.get('cold_best_vs_side_region', float('nan')):.2f} | "
                         f"{c.get('warm_best_vs_memcpy_1t', float('nan')):.2f} | "
                         f"{c.get('warm_best_vs_kernel_pread_limit', float('nan')):.2f} | {vc} | {mp} | {plain} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.io [--json] [--quick] ...``"""
    return bench_main("io", argv)


if __name__ == "__main__":
    sys.exit(main())
