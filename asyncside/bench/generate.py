"""``asyncside bench generate``: end-to-end generation speed by residency, prefetch on and off.

Everything runs in one process, side by side, in a fixed order, after a warm-up; each figure is
the median over ``--repeats`` rounds. One greedy generation (same prompt, same token count) per
configuration:

- **all-resident**: the plain mlx-lm model through mlx-lm's own ``generate_step`` (the reference
  for tokens and speed), and our async forward over a :class:`ResidentSource` (every expert in
  the pools, lookup = identity; the difference is our forward's own overhead);
- **streaming**: :class:`asyncside.Runtime` with the pools holding 25/50/75% of each layer's
  experts and the predictor ``lookahead`` or ``temporal`` (prefetch on) or ``none`` (prefetch
  off: every miss is a demand read through ``ensure``, still asynchronous, io_uring/threads);
- **sync demand**: the original design's loading (:class:`SyncDemandSource`): no prefetch, and
  a miss is read on the calling thread, one ``pread`` of the whole record into a temporary buffer
  then one ``memcpy`` per segment into its pool row, blocking the event loop. Same Ledger, same
  PoolSet, same resident set and side region as the runtime: only the loading strategy differs.

Page cache: **warm** runs read the whole store once first. **cold** runs read every expert from
the disk: the runtime with ``direct=True`` (O_DIRECT), and, when running as root, the page cache
dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``) before each cold run; the sync baseline
then reads with O_DIRECT too (aligned temporary buffer), so neither path gets a page-cache hit.
The method used is in the JSON (``cold_method``).

Every configuration's tokens are compared with the mlx-lm reference (``tokens_identical``).

Ratios are paired: the mlx-lm reference runs again right before each residency's group in every
round, and a row's ``vs_all_resident`` is the median over rounds of its run's decode speed over
that reference run's (``vs_sync_demand`` likewise over the same round's sync run). The ratio of
the two medians is kept as ``vs_all_resident_of_medians``.

Hit rates: one :class:`RoutingTrace` is recorded (lookahead predictor, all-resident), then every
ledger policy is replayed over it at each residency (same resident set and side rows as the
runtime), demand only and with the recorded lookahead predictions as prefetches, beside Belady's
MIN (the fewest demand reads any policy can do with that side region).

A PNG plot (``--plot``) shows decode tokens/s against residency per mode, warm and cold, with
the all-resident lines, and the policies' hit rates beside Belady's.
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .machine import machine_info

#: a short prompt: decode speed is what residency changes; a long prefill at low residency splits
#: into many capacity groups and would dominate the run time (its cost shows in ``ttft_s``)
DEFAULT_PROMPT = "Only the experts a token needs are read. "
DEFAULT_RESIDENCIES = (0.25, 0.5, 0.75)
#: streaming modes: predictor name, or "sync" for the synchronous demand-loading baseline
MODES = ("lookahead", "temporal", "none", "sync")
MODE_LABELS = {
    "lookahead": "prefetch: lookahead",
    "temporal": "prefetch: temporal",
    "none": "no prefetch (async demand)",
    "sync": "sync demand (original design)",
}
POLICIES = ("lfu", "lru", "oneshot", "aging-lfu")
TARGETS = {"residency": 0.5, "vs_all_resident": 0.8, "vs_sync_demand": 1.5, "policy_vs_belady": 0.9}


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``asyncside bench generate`` (the caller adds ``--json``)."""
    p.add_argument("--model", metavar="STORE_DIR", default=None,
                   help="a converted expert store (default: the embedded Qwen3-MoE model)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model and run for CI smoke tests (about a minute; numbers are noise)")
    p.add_argument("--tokens", metavar="N", type=int, default=None, help="tokens generated per run (default 32)")
    p.add_argument("--repeats", metavar="N", type=int, default=None,
                   help="rounds of every warm configuration; medians are reported (default 3)")
    p.add_argument("--cold-repeats", metavar="N", type=int, default=None,
                   help="rounds of every cold configuration (default 2; 0 skips cold runs)")
    p.add_argument("--residency", metavar="F", type=float, nargs="+", default=None,
                   help="pool budgets as fractions of each layer's experts (default 0.25 0.5 0.75)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help=f"streaming modes to run (default: all of {', '.join(MODES)})")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--policy", default="lfu", help="eviction policy of the streaming runs (default lfu)")
    p.add_argument("--reader", default="auto", choices=["auto", "io_uring", "threads", "aiofiles"],
                   help="read backend of the runtime (default auto)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="cold runs use O_DIRECT only, without dropping the page cache")
    p.add_argument("--plot", metavar="PATH", default="bench-out/generate.png",
                   help="PNG plot path (default bench-out/generate.png; 'none' to skip)")
    p.add_argument("--cache-dir", default=None, help="where the embedded models are built")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for BENCHMARKS.md) instead")


# ---------------------------------------------------------------------------------------------
# The synchronous demand-loading baseline


class SyncDemandSource:
    """The original design's loading, as an ExpertSource over the runtime's Ledger and PoolSet.

    No prefetch (``prefetch`` only counts hints). ``ensure`` reads every missing expert *on the
    calling thread*: one ``pread`` of the whole record into a temporary buffer, then a copy of each
    segment into its pool row (:meth:`PoolSet.row_view`), then publish. It blocks the event loop
    for the whole read, as the seed's consumer blocks on its drain. With ``direct=True`` the blob
    files are opened with O_DIRECT and the temporary buffer is page-aligned.

    Rows are sized exactly like :class:`asyncside.Runtime` (:func:`asyncside.runtime.plan_layer`).
    Leases are released once the computation that read the rows has completed (awaited at the next
    ``ensure``, when the rows might be needed).
    """

    def __init__(self, store: Any, *, resident: float | Mapping[int, Sequence[int]] = 0.25,
                 side_rows: int | None = None, min_side_rows: int = 8, policy: str = "lfu",
                 direct: bool = False, completed: Callable[[Any], Awaitable[None]] | None = None) -> None:
        from ..ledger import Ledger
        from ..pools import PoolSet
        from ..runtime import plan_layer

        if completed is None:
            from ..bridge import completed as bridge_completed

            completed = bridge_completed
        self.store = store
        self.direct = direct
        self._completed = completed
        self._ledgers: dict[int, Any] = {}
        self._pools: dict[int, Any] = {}
        self._tables: dict[int, tuple[int, Any]] = {}
        self._version: dict[int, int] = {}
        self._fds: dict[int, int] = {}
        self._pending: list[tuple[Any, list[tuple[int, int]]]] = []
        self.counts = {"hits": 0, "misses": 0, "fills": 0, "bytes_read": 0, "read_time_s": 0.0,
                       "prefetch_hints": 0, "ensure_calls": 0, "evictions": 0}
        stride = max(s.stride for s in store.layers.values())
        # One temporary record buffer, reused (the seed mallocs one per batch); page-aligned so
        # O_DIRECT accepts it.
        self._buf = mmap.mmap(-1, stride)
        self._resident: dict[int, list[int]] = {}
        try:
            for index, spec in store.layers.items():
                res, side = plan_layer(store, index, resident, side_rows, min_side_rows)
                led = Ledger(spec.n_experts, res, side, policy=policy)
                self._ledgers[index] = led
                self._pools[index] = PoolSet(spec, led.rows)
                self._version[index] = 0
                self._resident[index] = res
                flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
                self._fds[index] = os.open(spec.path, flags)
            for index, res in self._resident.items():
                for row, expert in enumerate(res):
                    self._read_into(index, expert, row)
        except BaseException:
            self.close()
            raise

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if not self._buf.closed:
            self._buf.close()

    async def __aenter__(self) -> SyncDemandSource:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._drain_releases()
        self.close()

    # -- loading -------------------------------------------------------------------------------

    def _read_into(self, layer: int, expert: int, row: int) -> None:
        """pread the whole record into the temporary buffer, then copy each segment to its row."""
        spec = self.store.layer(layer)
        t0 = time.perf_counter()
        view = memoryview(self._buf)[: spec.stride]
        try:
            got = os.preadv(self._fds[layer], [view], expert * spec.stride)
            if got != spec.stride:
                from ..errors import FillError

                raise FillError(layer, expert, row, f"short read: {got} of {spec.stride} bytes from {spec.path}")
            pools = self._pools[layer]
            for seg in spec.segments:
                pools.row_view(seg.key, row)[:] = view[seg.offset: seg.offset + seg.nbytes]
        finally:
            view.release()
        self.counts["read_time_s"] += time.perf_counter() - t0
        self.counts["bytes_read"] += spec.stride

    async def _drain_releases(self) -> None:
        pending, self._pending = self._pending, []
        for x, leases in pending:
            await self._completed(x)
            for layer, lease_id in leases:
                self._ledgers[layer].release(lease_id)

    # -- ExpertSource --------------------------------------------------------------------------

    def pools(self, layer: int) -> dict[str, Any]:
        return self._pools[layer].arrays

    def lookup(self, layer: int) -> Any:
        import mlx.core as mx

        cached = self._tables.get(layer)
        if cached is None or cached[0] != self._version[layer]:
            cached = (self._version[layer], mx.array(self._ledgers[layer].lookup()))
            self._tables[layer] = cached
        return cached[1]

    def prefetch(self, layer: int, ids: Any) -> None:
        self.counts["prefetch_hints"] += 1  # the original design without a predictor: ignored

    async def ensure(self, layer: int, ids: Any) -> None:
        led = self._ledgers[layer]
        wanted = np.unique(np.asarray(ids).reshape(-1).astype(np.int64))
        self.counts["ensure_calls"] += 1
        present = led.lookup()[wanted] >= 0
        counted = False
        while True:
            # The whole batch every round (as the runtime does): the ledger never evicts a member
            # of the batch, so present experts are not evicted to make room for missing ones.
            before = led.stats.get("evictions", 0)
            fills = led.reserve(wanted, demand=True)  # CapacityError: the forward splits the ids
            if not counted:  # counted once the batch fits, as the runtime counts
                counted = True
                self.counts["hits"] += int(present.sum())
                self.counts["misses"] += int((~present).sum())
            self.counts["evictions"] += led.stats.get("evictions", 0) - before
            for f in fills:
                try:
                    self._read_into(layer, f.expert, f.row)
                except BaseException:
                    led.fail(f)
                    raise
                led.publish(f)
                self.counts["fills"] += 1
            if fills:
                self._version[layer] += 1
            if not led.blocked:
                return
            # Rows pinned by leases of computations still running: wait for them, retry.
            if not self._pending:
                from ..errors import CapacityError

                raise CapacityError(f"layer {layer}: experts {led.blocked} blocked with no lease to wait for")
            await self._drain_releases()

    def lease(self, layer: int, experts: Any) -> int:
        return self._ledgers[layer].lease(np.asarray(experts))

    def release_after(self, x: Any, leases: list[tuple[int, int]]) -> None:
        self._pending.append((x, list(leases)))

    def audit(self) -> dict[int, Any]:
        return {layer: led.audit() for layer, led in self._ledgers.items()}

    def stats(self) -> dict[str, Any]:
        out = dict(self.counts)
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 1.0
        out["stall_time_s"] = out["read_time_s"]  # every read blocks the caller
        out["reader"] = "sync pread+memcpy" + (" (O_DIRECT)" if self.direct else "")
        return out


# ---------------------------------------------------------------------------------------------
# Page cache control


def warm_store(store: Any) -> int:
    """Read every blob of ``store`` once (into the page cache); returns bytes read."""
    total = 0
    for spec in store.layers.values():
        with open(spec.path, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                total += len(chunk)
    return total


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when not permitted (not root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def o_direct_works(path: str | os.PathLike[str]) -> bool:
    """Whether an aligned O_DIRECT read of ``path`` succeeds on its filesystem."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        buf.close()
        return False
    try:
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


def _can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


# ---------------------------------------------------------------------------------------------
# Runs


from ..demo import Run, reference_run as _reference_run  # noqa: E402 - one definition of a timed run


def _anyio_run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    import anyio

    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": sys.platform != "win32"})


async def _generate(sm: Any, source: Any, prompt_ids: list[int], tokens: int, predictor: str) -> Run:
    run = Run(start=time.perf_counter())
    async for tok in sm.generate(prompt_ids, max_tokens=tokens, source=source, predictor=predictor):
        run.first_token()
        run.tokens.append(tok)
    run.end = time.perf_counter()
    return run


async def _resident_run(sm: Any, source: Any, prompt_ids: list[int], tokens: int) -> Run:
    return await _generate(sm, source, prompt_ids, tokens, "none")


async def _streaming_run(sm: Any, store: Any, prompt_ids: list[int], tokens: int, mode: str,
                         residency: float, cold: bool, s: Settings) -> Run:
    from ..runtime import Runtime

    if mode == "sync":
        src = SyncDemandSource(store, resident=residency, policy=s.policy, direct=cold and s.direct_ok)
        async with src:
            run = await _generate(sm, src, prompt_ids, tokens, "none")
            run.stats = src.stats()
            run.audit_ok = all(r.ok for r in src.audit().values())
        return run
    direct = True if (cold and s.direct_ok) else None
    async with Runtime(store, resident=residency, policy=s.policy, reader=s.reader, direct=direct) as rt:
        run = await _generate(sm, rt, prompt_ids, tokens, mode)
        await rt.drain()
        run.stats = rt.stats()
        run.audit_ok = all(r.ok for r in rt.audit().values()) and not any(
            rt.ledger(layer).pending() for layer in store.layers)
    return run


@dataclass
class Settings:
    tokens: int
    repeats: int
    cold_repeats: int
    residencies: tuple[float, ...]
    modes: tuple[str, ...]
    policy: str
    reader: str
    direct_ok: bool = True
    drop: bool = True


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(getattr(args, "quick", False))
    tokens = args.tokens if args.tokens is not None else (6 if quick else 32)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    cold_repeats = args.cold_repeats if args.cold_repeats is not None else (1 if quick else 2)
    if args.no_cold:
        cold_repeats = 0
    residencies = tuple(args.residency) if args.residency else ((0.5,) if quick else DEFAULT_RESIDENCIES)
    modes = tuple(args.modes) if args.modes else MODES
    if tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (decode speed needs two tokens), got {tokens}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if cold_repeats < 0:
        raise ValueError(f"--cold-repeats must be >= 0, got {cold_repeats}")
    for r in residencies:
        if not 0.0 < r <= 1.0:
            raise ValueError(f"--residency values must be in (0, 1], got {r}")
    from ..policies import POLICIES as POLICY_NAMES

    if args.policy not in POLICY_NAMES:
        raise ValueError(f"--policy must be one of {sorted(POLICY_NAMES)}, got {args.policy!r}")
    return Settings(tokens=tokens, repeats=repeats, cold_repeats=cold_repeats, residencies=residencies,
                    modes=modes, policy=args.policy, reader=args.reader)


#: the quick model: the embedded architecture, shrunk (2 layers, 32 experts)
def _quick_spec() -> Any:
    from ..models.embedded import EmbeddedSpec

    base = EmbeddedSpec()
    return EmbeddedSpec(
        config={**base.config, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
                "moe_intermediate_size": 128},
        profile_tokens=2,
    )


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _summarise(runs: list[Run], ref_tokens: list[int]) -> dict[str, Any]:
    """Medians over repeats, tokens check, and the runtime counters of the median run."""
    dec = [r.decode_tokens_per_s for r in runs]
    order = sorted(range(len(runs)), key=lambda i: dec[i])
    mid = runs[order[len(order) // 2]]
    out: dict[str, Any] = {
        "repeats": len(runs),
        "decode_tokens_per_s": _median(dec),
        "decode_tokens_per_s_all": dec,
        "tokens_per_s": _median([r.tokens_per_s for r in runs]),
        "ttft_s": _median([r.ttft_s for r in runs]),
        "tokens": len(mid.tokens),
        "tokens_identical": all(r.tokens == ref_tokens for r in runs),
        "audit_clean": all(r.audit_ok for r in runs),
    }
    if mid.stats:
        st = mid.stats
        out.update({
            "hit_rate": float(st.get("hit_rate", float("nan"))),
            "bytes_read": int(st.get("bytes_read", 0)),
            "fills": int(st.get("fills", 0)),
            "evictions": int(st.get("evictions", 0)),
            "stall_time_s": float(st.get("stall_time_s", 0.0)),
            "late": int(st.get("late", 0)),
            "reader": st.get("reader"),
        })
    return out


# ---------------------------------------------------------------------------------------------
# Policies vs Belady


def policy_hit_rates(trace: Any, store: Any, residencies: Sequence[float],
                     policies: Sequence[str] = POLICIES) -> list[dict[str, Any]]:
    """Per residency: each policy's hit rate (demand only, and with the trace's lookahead
    predictions as prefetches) beside Belady's MIN, replayed over the same trace."""
    from ..models.trace import CacheResult, belady, replay_policy
    from ..runtime import plan_layer

    rows = []
    for frac in residencies:
        plans = {layer: plan_layer(store, layer, frac) for layer in trace.layers}
        n_exp = {layer: store.layer(layer).n_experts for layer in trace.layers}
        b = sum((belady(trace.demands(l), plans[l][0], plans[l][1]) for l in trace.layers), start=CacheResult())
        row: dict[str, Any] = {
            "residency": frac,
            "resident_per_layer": len(next(iter(plans.values()))[0]),
            "side_rows": next(iter(plans.values()))[1],
            "belady": b.hit_rate,
            "belady_side_hit_rate": b.side_hit_rate,
            "policies": {},
        }
        for pol in policies:
            for with_pred in (False, True):
                r = sum((replay_policy(trace.demands(l), n_exp[l], plans[l][0], plans[l][1], pol,
                                       predictions=trace.predictions(l) if with_pred else None)
                         for l in trace.layers), start=CacheResult())
                name = pol + ("+lookahead" if with_pred else "")
                row["policies"][name] = {
                    "hit_rate": r.hit_rate,
                    "vs_belady": r.hit_rate / b.hit_rate if b.hit_rate else float("nan"),
                    "demand_reads": r.misses,
                    "prefetch_reads": r.prefetch_reads,
                }
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Machine


# ---------------------------------------------------------------------------------------------
# The bench


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(f"[bench generate] {msg}", file=sys.stderr, flush=True)


def run_generate_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration side by side; print the table unless ``args.json``; return the result."""
    import mlx.core as mx

    from ..models import RoutingTrace, load_reference_model, load_streaming_model
    from ..models.embedded import ensure_embedded_default
    from ..store import ExpertStore

    s = _settings(args)
    verbose = not getattr(args, "json", False)
    started = time.time()
    mach = machine_info()
    if args.model is not None:
        store_dir = pathlib.Path(args.model)
    else:
        spec = _quick_spec() if args.quick else None
        _model_dir, store_dir = ensure_embedded_default(args.cache_dir, spec=spec, progress=verbose)
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    prompt_ids = list(sm.tokenizer.encode(args.prompt))
    eos = set(getattr(sm.tokenizer, "eos_token_ids", ()) or ())
    ref_model, _config = load_reference_model(store_dir)
    resident_src = sm.resident_source()

    # Cold-run method.
    first_blob = next(iter(store.layers.values())).path
    s.direct_ok = o_direct_works(first_blob)
    s.drop = not args.no_drop_caches and _can_drop_caches()
    if s.cold_repeats:
        parts = []
        if s.direct_ok:
            parts.append("O_DIRECT reads (runtime direct=True; sync baseline O_DIRECT pread)")
        if s.drop:
            parts.append("page cache dropped before each cold run (sync; echo 3 > /proc/sys/vm/drop_caches)")
        cold_method = " + ".join(parts) if parts else "unavailable: no O_DIRECT on this filesystem and not root"
        if not parts:
            s.cold_repeats = 0
    else:
        cold_method = "skipped"

    # Warm-up (not timed): compile every path once, fill the page cache.
    _log(verbose, f"model {sm.model_id}: {len(store.layers)} MoE layers x {store.layer(next(iter(store.layers))).n_experts} "
                  f"experts, prompt {len(prompt_ids)} tokens, {s.tokens} generated; warming up")
    warm_bytes = warm_store(store)
    _reference_run(ref_model, prompt_ids, 2, eos)
    _anyio_run(_resident_run, sm, resident_src, prompt_ids, 2)
    for mode in ("lookahead", "sync"):
        if mode in s.modes:
            _anyio_run(_streaming_run, sm, store, prompt_ids, 2, mode, s.residencies[0], False, s)

    ref_runs: list[Run] = []
    res_runs: list[Run] = []
    warm: dict[tuple[float, str], list[Run]] = {(r, m): [] for r in s.residencies for m in s.modes}
    cold: dict[tuple[float, str], list[Run]] = {(r, m): [] for r in s.residencies for m in s.modes}
    # The mlx-lm reference runs again right before each residency's group in every round, and each
    # row's ratio is the median of its per-round ratios to that run: this VM's speed drifts by
    # 10-20% within minutes, and a ratio of medians taken a minute apart carries that drift.
    ref_at: dict[tuple[str, int, float], Run] = {}
    for rep in range(s.repeats):
        _log(verbose, f"warm round {rep + 1}/{s.repeats}")
        res_runs.append(_anyio_run(_resident_run, sm, resident_src, prompt_ids, s.tokens))
        for frac in s.residencies:
            ref_at[("warm", rep, frac)] = _reference_run(ref_model, prompt_ids, s.tokens, eos)
            ref_runs.append(ref_at[("warm", rep, frac)])
            for mode in s.modes:
                warm[(frac, mode)].append(
                    _anyio_run(_streaming_run, sm, store, prompt_ids, s.tokens, mode, frac, False, s))
    ref_tokens = ref_runs[0].tokens
    for rep in range(s.cold_repeats):
        _log(verbose, f"cold round {rep + 1}/{s.cold_repeats} ({cold_method})")
        for frac in s.residencies:
            ref_at[("cold", rep, frac)] = _reference_run(ref_model, prompt_ids, s.tokens, eos)
            for mode in s.modes:
                if s.drop:
                    drop_caches()
                cold[(frac, mode)].append(
                    _anyio_run(_streaming_run, sm, store, prompt_ids, s.tokens, mode, frac, True, s))
    if s.cold_repeats and s.drop:
        warm_store(store)  # leave the machine as we found it, roughly

    # One routing trace (lookahead predictions recorded), policies replayed over it.
    _log(verbose, "recording a routing trace; replaying policies vs Belady")
    trace = RoutingTrace()

    async def record() -> list[int]:
        return [t async for t in sm.generate(prompt_ids, max_tokens=s.tokens, source=resident_src,
                                             predictor="lookahead", trace=trace)]

    trace_tokens = _anyio_run(record)
    policies = policy_hit_rates(trace, store, s.residencies)
    del ref_model
    mx.clear_cache()

    ref = _summarise(ref_runs, ref_tokens)
    res = _summarise(res_runs, ref_tokens)
    rows = []
    for cache_state, table, n in (("warm", warm, s.repeats), ("cold", cold, s.cold_repeats)):
        if not n:
            continue
        for frac in s.residencies:
            for mode in s.modes:
                runs = table[(frac, mode)]
                row = {"cache": cache_state, "residency": frac, "mode": mode, "label": MODE_LABELS[mode],
                       **_summarise(runs, ref_tokens)}
                # Paired: each round's run over the mlx-lm run just before its group (and over the
                # same round's sync run), then the median over rounds.
                refs = [ref_at[(cache_state, i, frac)].decode_tokens_per_s for i in range(len(runs))]
                row["vs_all_resident_per_round"] = [r.decode_tokens_per_s / b if b else 0.0
                                                    for r, b in zip(runs, refs)]
                row["vs_all_resident"] = _median(row["vs_all_resident_per_round"])
                row["vs_all_resident_of_medians"] = row["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
                row["vs_async_resident"] = row["decode_tokens_per_s"] / res["decode_tokens_per_s"]
                row["vs_sync_demand"] = None
                if "sync" in s.modes:
                    syncs = [r.decode_tokens_per_s for r in table[(frac, "sync")]]
                    per = [r.decode_tokens_per_s / b for r, b in zip(runs, syncs) if b]
                    row["vs_sync_demand"] = _median(per) if per else None
                rows.append(row)

    plan = {str(frac): dict(zip(("resident_per_layer", "side_rows"),
                                (lambda p: (len(p[0]), p[1]))(_plan(store, frac))))
            for frac in s.residencies}
    result: dict[str, Any] = {
        "bench": "generate",
        "model": sm.model_id,
        "store": str(store_dir),
        "experts_per_layer": store.layer(next(iter(store.layers))).n_experts,
        "moe_layers": len(store.layers),
        "record_bytes": store.layer(next(iter(store.layers))).stride,
        "store_blob_bytes": sum(sp.blob_bytes for sp in store.layers.values()),
        "prompt_tokens": len(prompt_ids),
        "settings": {"tokens": s.tokens, "repeats": s.repeats, "cold_repeats": s.cold_repeats,
                     "residencies": list(s.residencies), "modes": list(s.modes), "policy": s.policy,
                     "reader": s.reader, "quick": bool(args.quick)},
        "pool_plan": plan,
        "definition": (
            "decode_tokens_per_s = (tokens - 1) / (time of last token - time of first token): the "
            "prompt excluded; tokens_per_s = tokens / whole run (prefill included). Medians over "
            "repeats; each configuration one greedy generation with the same prompt. residency = "
            "pool rows per layer / experts per layer (half of them a rotating side region, at "
            "least 8 rows; the rest the hottest experts by the store's ranking). vs_* ratios are of "
            "decode tokens/s, measured side by side in one process and paired by round: "
            "vs_all_resident is the median over rounds of each run over the mlx-lm run made right "
            "before its residency's group (vs_all_resident_per_round lists them), vs_sync_demand "
            "over the same round's sync run; vs_all_resident_of_medians is the ratio of medians."),
        "warm_method": f"the whole store read once before the runs ({warm_bytes} bytes)",
        "cold_method": cold_method,
        "machine": mach,
        "all_resident": {"mlx_lm": ref, "async_resident": res,
                         "async_overhead_ratio": res["decode_tokens_per_s"] / ref["decode_tokens_per_s"]},
        "rows": rows,
        "policies_vs_belady": policies,
        "trace": {"tokens": len(trace_tokens), "steps": len(trace.steps),
                  "tokens_identical": trace_tokens == ref_tokens},
        "tokens_identical": (ref["tokens_identical"] and res["tokens_identical"]
                             and all(r["tokens_identical"] for r in rows) and trace_tokens == ref_tokens),
    }
    result["targets"] = _targets(result)
    plot = getattr(args, "plot", None)
    if plot and plot != "none":
        try:
            result["plot"] = str(plot_result(result, plot))
        except ImportError as exc:
            result["plot"] = f"not written: {exc}"
    result["seconds"] = round(time.time() - started, 1)
    if getattr(args, "markdown", False):
        print(render_markdown(result))
    elif verbose:
        render_table(result)
    return result


def _plan(store: Any, frac: float) -> tuple[list[int], int]:
    from ..runtime import plan_layer

    return plan_layer(store, next(iter(store.layers)), frac)


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, checked against this run (None where this run lacks the figure)."""
    frac = TARGETS["residency"]

    def row(mode: str) -> dict[str, Any] | None:
        for r in result["rows"]:
            if r["cache"] == "warm" and r["residency"] == frac and r["mode"] == mode:
                return r
        return None

    out: dict[str, Any] = {"definition": (
        f"at {frac:.0%} residency, warm, default predictor (lookahead): decode tok/s >= "
        f"{TARGETS['vs_all_resident']}x all-resident (mlx-lm) and >= {TARGETS['vs_sync_demand']}x sync "
        f"demand loading; default policy (lfu) hit rate >= {TARGETS['policy_vs_belady']:.0%} of Belady's")}
    la = row("lookahead")
    out["vs_all_resident"] = None if la is None else la["vs_all_resident"]
    out["vs_all_resident_met"] = None if la is None else la["vs_all_resident"] >= TARGETS["vs_all_resident"]
    out["vs_sync_demand"] = None if la is None else la["vs_sync_demand"]
    out["vs_sync_demand_met"] = (None if la is None or la["vs_sync_demand"] is None
                                 else la["vs_sync_demand"] >= TARGETS["vs_sync_demand"])
    pol = next((p for p in result["policies_vs_belady"] if p["residency"] == frac), None)
    if pol is not None:
        out["lfu_vs_belady"] = pol["policies"]["lfu"]["vs_belady"]
        out["lfu+lookahead_vs_belady"] = pol["policies"]["lfu+lookahead"]["vs_belady"]
        out["policy_vs_belady_met"] = out["lfu_vs_belady"] >= TARGETS["policy_vs_belady"]
    return out


# ---------------------------------------------------------------------------------------------
# Output


def plot_result(result: dict[str, Any], path: str | os.PathLike[str]) -> pathlib.Path:
    """Decode tokens/s vs residency per mode (warm, cold) beside all-resident; hit rates vs Belady."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    caches = [c for c in ("warm", "cold") if any(r["cache"] == c for r in result["rows"])]
    fig, axes = plt.subplots(1, len(caches) + 1, figsize=(5.2 * (len(caches) + 1), 4.8), dpi=90)
    axes = list(np.atleast_1d(axes))
    colors = {"lookahead": "tab:blue", "temporal": "tab:green", "none": "tab:orange", "sync": "tab:red"}
    ref = result["all_resident"]["mlx_lm"]["decode_tokens_per_s"]
    res = result["all_resident"]["async_resident"]["decode_tokens_per_s"]
    top = max([ref, res] + [r["decode_tokens_per_s"] for r in result["rows"]]) * 1.15
    for ax, cache in zip(axes, caches):
        for mode in result["settings"]["modes"]:
            pts = sorted((r["residency"], r["decode_tokens_per_s"]) for r in result["rows"]
                         if r["cache"] == cache and r["mode"] == mode)
            if pts:
                xs, ys = zip(*pts)
                ax.plot([100 * x for x in xs], ys, marker="o", color=colors[mode], label=MODE_LABELS[mode])
        ax.axhline(ref, color="black", linestyle="--", linewidth=1.2, label="all-resident (mlx-lm)")
        ax.axhline(res, color="grey", linestyle=":", linewidth=1.2, label="all-resident (async forward)")
        ax.set_title(f"{cache} page cache")
        ax.set_xlabel("experts in pools per layer (%)")
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_ylim(0, top)
        ax.set_xticks([100 * x for x in result["settings"]["residencies"]])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    ax = axes[-1]
    pol_rows = result["policies_vs_belady"]
    base = list(dict.fromkeys(n.split("+")[0] for n in (pol_rows[0]["policies"] if pol_rows else {})))
    names = ["belady"] + [n + sfx for n in base for sfx in ("", "+lookahead")]
    width = 0.8 / max(len(names), 1)
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        ys = [p["belady"] if name == "belady" else p["policies"][name]["hit_rate"] for p in pol_rows]
        xs = np.arange(len(pol_rows)) + (i - (len(names) - 1) / 2) * width
        if name == "belady":
            color = "black"
        else:  # one hue per policy: light = demand only, dark = with lookahead prefetch
            j = base.index(name.split("+")[0])
            color = cmap(2 * j + (0 if name.endswith("+lookahead") else 1))
        ax.bar(xs, ys, width, label=name, color=color)
    ax.set_xticks(np.arange(len(pol_rows)))
    ax.set_xticklabels([f"{p['residency']:.0%}" for p in pol_rows])
    lows = [p["belady"] for p in pol_rows] + [v["hit_rate"] for p in pol_rows for v in p["policies"].values()]
    ax.set_ylim(max(0.0, min(lows) - 0.05) if lows else 0.0, 1.0)
    ax.set_title("hit rate over one recorded routing trace")
    ax.set_xlabel("experts in pools per layer")
    ax.legend(fontsize=6.5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"asyncside bench generate — {result['model']}, {result['settings']['tokens']} tokens, "
                 f"{result['machine']['nproc']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def render_table(result: dict[str, Any]) -> None:
    """Print the result as rich tables (stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 160)  # the table is wide; piped output defaults to 80
    ar = result["all_resident"]
    t = Table(title=(f"asyncside bench generate — {result['model']} ({result['moe_layers']} MoE layers x "
                     f"{result['experts_per_layer']} experts, record {result['record_bytes'] / 1024:.0f} KiB), "
                     f"{result['settings']['tokens']} tokens, median of {result['settings']['repeats']} warm / "
                     f"{result['settings']['cold_repeats']} cold"))
    for col, just in (("cache", "left"), ("residency", "right"), ("mode", "left"), ("decode tok/s", "right"),
                      ("tok/s (all)", "right"), ("vs mlx-lm", "right"), ("vs sync", "right"),
                      ("hit rate", "right"), ("MB read", "right"), ("stall ms", "right"), ("tokens =", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for name, r in (("all-resident (mlx-lm)", ar["mlx_lm"]), ("all-resident (async fwd)", ar["async_resident"])):
        t.add_row("-", "100%", name, f"{r['decode_tokens_per_s']:.2f}", f"{r['tokens_per_s']:.2f}",
                  f"{r['decode_tokens_per_s'] / ar['mlx_lm']['decode_tokens_per_s']:.2f}x", "", "", "", "",
                  "yes" if r["tokens_identical"] else "NO")
    for r in result["rows"]:
        t.add_row(r["cache"], f"{r['residency']:.0%}", r["label"], f"{r['decode_tokens_per_s']:.2f}",
                  f"{r['tokens_per_s']:.2f}", f"{r['vs_all_resident']:.2f}x",
                  "" if r["vs_sync_demand"] is None else f"{r['vs_sync_demand']:.2f}x",
                  f"{r.get('hit_rate', float('nan')):.1%}", f"{r.get('bytes_read', 0) / 1e6:.1f}",
                  f"{r.get('stall_time_s', 0.0) * 1e3:.0f}", "yes" if r["tokens_identical"] else "NO")
    console.print(t)
    p = Table(title="hit rate over one recorded routing trace: ledger policies vs Belady's MIN")
    p.add_column("residency")
    p.add_column("resident+side rows", justify="right")
    p.add_column("belady", justify="right")
    names = list(result["policies_vs_belady"][0]["policies"]) if result["policies_vs_belady"] else []
    for n in names:
        p.add_column(n, justify="right")
    for row in result["policies_vs_belady"]:
        p.add_row(f"{row['residency']:.0%}", f"{row['resident_per_layer']}+{row['side_rows']}",
                  f"{row['belady']:.3f}",
                  *[f"{row['policies'][n]['hit_rate']:.3f} ({row['policies'][n]['vs_belady']:.2f})" for n in names])
    console.print(p)
    tg = result["targets"]
    console.print(f"targets: {tg['definition']}")
    console.print(f"  vs all-resident {tg['vs_all_resident']}, met: {tg['vs_all_resident_met']}; "
                  f"vs sync {tg['vs_sync_demand']}, met: {tg['vs_sync_demand_met']}; "
                  f"lfu vs belady {tg.get('lfu_vs_belady')}, met: {tg.get('policy_vs_belady_met')}")
    console.print(f"cold: {result['cold_method']}; plot: {result.get('plot')}; "
                  f"tokens identical everywhere: {result['tokens_identical']}; {result['seconds']} s")


def render_markdown(result: dict[str, Any]) -> str:
    """The result as markdown tables (what BENCHMARKS.md shows)."""
    ar = result["all_resident"]
    ref = ar["mlx_lm"]["decode_tokens_per_s"]
    lines = [
        "| cache | experts in pools | mode | decode tok/s | vs all-resident (mlx-lm) | vs sync demand | "
        "whole-run tok/s | TTFT s | hit rate | MB read | stall ms | tokens identical |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in (("all-resident (mlx-lm generate_step)", ar["mlx_lm"]),
                    ("all-resident (async forward, ResidentSource)", ar["async_resident"])):
        lines.append(f"| - | 100% | {name} | {r['decode_tokens_per_s']:.2f} | "
                     f"{r['decode_tokens_per_s'] / ref:.2f}x | | {r['tokens_per_s']:.2f} | {r['ttft_s']:.2f} | "
                     f"| | | {'yes' if r['tokens_identical'] else 'NO'} |")
    for r in result["rows"]:
        sync = "" if r["vs_sync_demand"] is None else f"{r['vs_sync_demand']:.2f}x"
        lines.append(f"| {r['cache']} | {r['residency']:.0%} | {r['label']} | {r['decode_tokens_per_s']:.2f} | "
                     f"{r['vs_all_resident']:.2f}x | {sync} | {r['tokens_per_s']:.2f} | {r['ttft_s']:.2f} | "
                     f"{r['hit_rate']:.1%} | {r['bytes_read'] / 1e6:.0f} | {r['stall_time_s'] * 1e3:.0f} | "
                     f"{'yes' if r['tokens_identical'] else 'NO'} |")
    pols = result["policies_vs_belady"]
    names = list(pols[0]["policies"]) if pols else []
    lines += ["", "| experts in pools (resident + side rows) | Belady (MIN) | "
              + " | ".join(names) + " |", "| --- | ---: | " + " | ".join("---:" for _ in names) + " |"]
    for p in pols:
        lines.append(f"| {p['residency']:.0%} ({p['resident_per_layer']} + {p['side_rows']}) | {p['belady']:.3f} | "
                     + " | ".join(f"{p['policies'][n]['hit_rate']:.3f} ({p['policies'][n]['vs_belady']:.2f})"
                                  for n in names) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.generate [--json] ...``"""
    from . import bench_main

    return bench_main("generate", argv)


if __name__ == "__main__":
    sys.exit(main())
