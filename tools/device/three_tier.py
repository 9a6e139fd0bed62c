"""Three tiers on MLX CUDA under a memory budget (device pools <- pinned host tier <- SSD), beside the slot cache.

Builds (or reuses) a model shape's expert store, measures the disk, then per routing locality (a
synthetic preset, or a user's own trace given with ``--routing FILE``, fitted onto the shape by
bench offload's :func:`~asyncside.bench.offload.fit_routings`) runs these arms, each in its own
child process:

1. ``compute``: the compute limit, all-resident mlx-lm with no memory limit under the same
   replayed routing (its tokens are the reference every other arm must match). All localities'
   compute runs go first, in one process, while the freshly built store is still in the page cache;
2. ``asyncside``: page cache dropped, a child in a fresh memory cgroup whose limit (``memory.max``
   or v1 ``memory.limit_in_bytes``) charges the page cache,
   ``Runtime(store, resident=R, host_tier=T, memory=B)`` with R the pools' share of each layer's
   experts (or ``auto``), T a whole number of layers' tiers making up ``--tier-share`` of the
   store's layers (0: no host tier), B the budget (the cgroup's limit itself); the fault path's
   read chunk at its default;
3. ``asyncside-whole``: the same with ``ASYNCSIDE_FAULT_READ_CHUNK=0`` in the child's environment
   (each fault one read of the whole record);
4. ``slot-cache``: the synchronous baseline (:mod:`asyncside.bench.slot_cache`, O_DIRECT) with the
   rows per layer the ``asyncside`` arm's plan chose, in the same kind of cgroup, as
   ``asyncside bench offload`` runs it (its child and cgroup loop are reused here).

The disk: random whole records of every layer, O_DIRECT, at queue depths 1, 4, 8 and 64
(:func:`asyncside.bench.offload.disk_curve`: at least ``--disk-bytes`` a pass, median of
``--disk-passes``); the best depth's rate is the I/O limit's bandwidth.

Per run: decode tok/s (first token to last), pool hits and their fraction of Belady's MIN (with
bypass, from empty rows, over the same demands and rows per layer), the misses the host tier served,
misses' MB per token (those the tier did not serve), the store bytes the arm read per token, the disk's MB
per token (the process's ``read_bytes``) and its ratio to the misses' bytes that reach the disk,
the I/O limit (bandwidth / store bytes read per token), the compute limit, tok/s over the lower
limit, tok/s over the slot cache's in the same locality, the peak memory the cgroup charged and
its share of the limit, and whether the tokens equal the reference's.

``--deadline`` (seconds since the epoch) bounds the whole call: a run that cannot finish before it
is skipped and says so; the JSON is rewritten after every step and the markdown table printed at
the end (``--markdown-from FILE`` prints the table of a results file, e.g. after a kill).

Usage (on the GPU machine, after ``tools/device/cuda-run.sh`` built the extension)::

    python3 tools/device/three_tier.py --memory-max 4200M --tier-share 0 --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

from asyncside.bench.offload import (
    DISK_DEPTHS,
    MB,
    TRACE_TOKENS,
    MemoryCgroup,
    _child,
    _phase,
    _read_bytes,
    _rss,
    _store_top_k,
    belady_of_run,
    check_cgroups,
    disk_curve,
    drop_caches,
    fit_routings,
    generate_measured,
    load_routings,
    parse_size,
    routing_note,
)

#: the arms that run in a memory cgroup, in the order they run per locality
ARMS = ("asyncside", "asyncside-whole", "slot-cache")
#: each arm's environment on top of the parent's
ARM_ENV: dict[str, dict[str, str]] = {"asyncside": {}, "asyncside-whole": {"ASYNCSIDE_FAULT_READ_CHUNK": "0"},
                                      "slot-cache": {}}
#: a run is not started with less than this many seconds left before ``--deadline``
MIN_RUN_S = 25.0
LOCALITY_ORDER = ("low", "middle", "high")

T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the seconds since the start."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def compute_main(spec: dict[str, Any]) -> dict[str, Any]:
    """The compute limits of every locality in one process (the model loaded once): per locality
    (``spec["routings"]``: name -> trace file), all-resident mlx-lm's greedy tokens under that
    routing and its decode tok/s, as bench offload's ``mlx-lm`` child measures them."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from asyncside.models import load_reference_model, load_streaming_model
    from asyncside.models.forcing import force_reference, rewind_reference

    prompt, seconds, max_tokens = list(spec["prompt"]), float(spec["seconds"]), int(spec["tokens"])
    t_load = time.perf_counter()
    _phase("loading")
    sm = load_streaming_model(spec["store"])
    model, _config = load_reference_model(spec["store"])
    out: dict[str, Any] = {"system": "mlx-lm", "load_s": time.perf_counter() - t_load, "localities": {}}
    for loc, trace in spec["routings"].items():
        replay = sm.set_routing(trace)
        if replay is None:
            raise ValueError(f"{trace}: no routing replay for locality {loc!r}")
        force_reference(model, sm.arch.block_attr, replay)  # re-wraps: one replay at a time
        rewind_reference(model)
        _phase(f"generating-{loc}")
        tokens: list[int] = []
        stamps: list[float] = []
        t0 = time.perf_counter()
        for y, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            tokens.append(int(y))
            stamps.append(time.perf_counter())
            if len(tokens) >= max_tokens or stamps[-1] - stamps[0] >= seconds:
                break
        end = stamps[-1] if stamps else time.perf_counter()
        out["localities"][loc] = {
            "status": "ok", "tokens": tokens, "seconds": end - t0,
            "decode_tokens_per_s": (len(tokens) - 1) / (end - stamps[0]) if len(tokens) > 1 and end > stamps[0]
            else 0.0}
    _phase("done")
    return out


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """The asyncside arm (in the current process, the cgroup's): its figures."""
    if spec.get("system") == "compute":
        return compute_main(spec)
    import anyio

    from asyncside.errors import AsyncsideError
    from asyncside.models import load_streaming_model
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    prompt, seconds, max_tokens = list(spec["prompt"]), float(spec["seconds"]), int(spec["tokens"])
    out: dict[str, Any] = {"system": "asyncside-three-tier",
                           "fault_read_chunk_env": os.environ.get("ASYNCSIDE_FAULT_READ_CHUNK")}
    try:
        from asyncside import _native

        out["fault_read_chunk"] = int(_native.fault_read_chunk()) if hasattr(_native, "fault_read_chunk") else None
    except Exception as exc:  # a bad ASYNCSIDE_FAULT_READ_CHUNK: the run fails below, naming it
        out["fault_read_chunk"] = f"error: {exc}"
    t_load = time.perf_counter()
    io0 = _read_bytes()
    _phase("loading")
    store = ExpertStore.open(spec["store"])
    sm = load_streaming_model(spec["store"])
    sm.set_routing(spec["routing"])
    tokens: list[int] = []
    stamps: list[float] = []
    rss_peak = [0]

    marks: dict[str, Any] = {}  # the read counters at the first token (what the first step read)

    def arrived(tok: int) -> bool:
        tokens.append(tok)
        stamps.append(time.perf_counter())
        rss_peak[0] = max(rss_peak[0], _rss())
        if len(tokens) == 1 and "rt" in marks:
            marks["first_token"] = {"read_bytes": _read_bytes() - marks["io1"],
                                    "bytes_read": int(dict(marks["rt"].stats()).get("bytes_read", 0))}
        if len(tokens) >= max_tokens:
            out["stopped_by"] = "tokens"
            return True
        # Stopped by the clock, the step queued after this token reads its misses until the
        # runtime drains (for a token never generated; the runtime's counters leave them out):
        # the disk's bytes are the tokens' up to here.
        out["stopped_by"] = "seconds" if stamps[-1] - stamps[0] >= seconds else "tokens"
        if out["stopped_by"] == "seconds":
            marks["stopped_read_bytes"] = _read_bytes()
        return out["stopped_by"] == "seconds"

    asked = spec["resident"] if spec["resident"] == "auto" else float(spec["resident"])
    # The plan refuses pools that do not fit what the budget leaves after what the process holds:
    # then the arm runs at resident="auto" (the pools sized to that room) and says so.
    candidates: list[float | str] = [asked]
    if asked != "auto" and spec.get("fallback_auto", True):
        candidates.append("auto")
    out["plan_refused"] = []

    async def run() -> tuple[float, int, dict[str, Any]]:
        async with contextlib.AsyncExitStack() as stack:
            for resident in candidates:
                out["rss_before_runtime"] = _rss()  # what the plan subtracts from the budget
                rt = Runtime(store, resident=resident, host_tier=int(spec["host_tier"]), memory=int(spec["budget"]),
                             policy=spec["policy"])
                try:
                    await stack.enter_async_context(rt)
                except AsyncsideError as exc:
                    if resident == candidates[-1] or "memory budget" not in str(exc):
                        raise
                    out["plan_refused"].append(f"resident={resident}: {exc}")
                    log(f"plan refused resident={resident}: {exc}")
                    continue
                out["resident_used"] = resident
                break
            out["load_s"] = time.perf_counter() - t_load
            out["memory_plan"] = {k: v for k, v in dict(rt.memory).items() if isinstance(v, (int, float, str, bool))}
            plan = rt.plan
            out["plan_text"] = plan.describe() if plan is not None else None
            out["rss_before_generating"] = _rss()
            return await generate_measured(rt, sm, store.layers, prompt, max_tokens, spec["predictor"], arrived,
                                           started=lambda io1: marks.update(rt=rt, io1=io1))

    t0, io1, got = anyio.run(run, backend="asyncio")
    out["stats"] = {k: v for k, v in got["stats"].items() if isinstance(v, (int, float, str, bool))}
    out["rows_per_layer"] = got["rows"]
    end = stamps[-1] if stamps else time.perf_counter()
    out["tokens"] = tokens
    out["seconds"] = end - t0
    out["ttft_s"] = stamps[0] - t0 if stamps else None
    # Decode speed: from the first token to the last (the first carries the prompt's faults).
    out["decode_tokens_per_s"] = (len(tokens) - 1) / (end - stamps[0]) if len(tokens) > 1 and end > stamps[0] else 0.0
    out["read_bytes"] = marks.get("stopped_read_bytes", _read_bytes()) - io1
    out["read_bytes_loading"] = io1 - io0
    out["first_token_reads"] = marks.get("first_token")
    out["rss_peak_sampled"] = rss_peak[0]
    out["rss_end"] = _rss()
    _phase("done")
    return out


def _figures(run: dict[str, Any], sh: dict[str, Any], compute: dict[str, Any]) -> None:
    """The derived columns of one run (in place); ``vs_slot_cache`` is set by :func:`_vs_slot_cache`."""
    toks, ref = run.get("tokens") or [], compute.get("tokens") or []
    n = min(len(toks), len(ref))
    run["tokens_compared"] = n
    run["tokens_match_reference"] = (toks[:n] == ref[:n]) if n else None
    if run.get("peak_bytes") and run.get("limit_bytes"):
        run["peak_over_limit"] = run["peak_bytes"] / run["limit_bytes"]
    if run.get("status") != "ok" or not toks:
        return
    steps = len(toks)
    st = run.get("stats") or {}
    hits, misses = int(st.get("hits", 0)), int(st.get("misses", 0))
    served = int(st.get("tier_faults", 0)) + int(st.get("staged_copies", 0))
    rec = sh["record_bytes"]
    run["hit_rate"] = hits / (hits + misses) if hits + misses else None
    run["tier_served"] = served
    run["tier_served_share"] = served / misses if misses else None
    run["miss_mb_per_token"] = misses * rec / steps / MB
    run["disk_miss_mb_per_token"] = max(misses - served, 0) * rec / steps / MB
    run["store_read_mb_per_token"] = int(st.get("bytes_read", 0)) / steps / MB
    run["disk_mb_per_token"] = int(run.get("read_bytes", 0)) / steps / MB
    run["disk_over_misses"] = (run["disk_mb_per_token"] / run["disk_miss_mb_per_token"]
                               if run["disk_miss_mb_per_token"] else None)
    run["disk_gbps_drawn"] = run["decode_tokens_per_s"] * run["disk_mb_per_token"] * MB / 1e9
    bw = sh["io"]["GBps"] * 1e9
    per_tok = run["store_read_mb_per_token"] * MB
    run["io_limit_tokens_per_s"] = bw / per_tok if per_tok else None
    run["compute_limit_tokens_per_s"] = compute.get("decode_tokens_per_s")
    limits = [x for x in (run["io_limit_tokens_per_s"], run["compute_limit_tokens_per_s"]) if x]
    run["of_limit"] = run["decode_tokens_per_s"] / min(limits) if limits else None


def _vs_slot_cache(runs: list[dict[str, Any]]) -> None:
    """Each ok run's tok/s over the slot cache's in the same locality (in place)."""
    slot = {r["locality"]: r.get("decode_tokens_per_s") for r in runs
            if r.get("arm") == "slot-cache" and r.get("status") == "ok"}
    for r in runs:
        base = slot.get(r["locality"])
        ok = r.get("status") == "ok" and base
        r["vs_slot_cache"] = r["decode_tokens_per_s"] / base if ok else None


def _f(v: Any, spec: str, suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


COLUMNS = ["locality", "arm", "rows/layer", "decode tok/s", "compute limit", "I/O limit", "of min(limits)",
           "vs slot cache", "pool hits", "of MIN", "misses the tier served", "misses' MB/tok (to disk)",
           "disk MB/tok (x to-disk misses)", "disk GB/s drawn", "peak charged MB (of limit)", "tokens = mlx-lm",
           "status"]


def _row(r: dict[str, Any]) -> list[str]:
    n, match = r.get("tokens_compared") or 0, r.get("tokens_match_reference")
    tokens = "—" if match is None else f"{n}/{n}" if match else f"differ (of {n})"
    status = str(r.get("status", "?"))
    rows = sorted(set((r.get("rows_per_layer") or {}).values()))
    return [r["locality"], r["arm"], "—" if not rows else str(rows[0]) if len(rows) == 1 else f"{rows[0]}-{rows[-1]}",
            _f(r.get("decode_tokens_per_s"), ".2f"),
            _f(r.get("compute_limit_tokens_per_s"), ".2f"), _f(r.get("io_limit_tokens_per_s"), ".2f"),
            _f(r.get("of_limit"), ".2f", "x"), _f(r.get("vs_slot_cache"), ".2f", "x"), _f(r.get("hit_rate"), ".1%"),
            _f(r.get("of_min"), ".2f", "x"), _f(r.get("tier_served_share"), ".1%"),
            f"{_f(r.get('miss_mb_per_token'), '.1f')} ({_f(r.get('disk_miss_mb_per_token'), '.1f')})",
            f"{_f(r.get('disk_mb_per_token'), '.1f')} ({_f(r.get('disk_over_misses'), '.4f', 'x')})",
            _f(r.get("disk_gbps_drawn"), ".2f"),
            f"{_f((r.get('peak_bytes') or 0) / MB or None, ',.0f')} ({_f(r.get('peak_over_limit'), '.2f')})",
            tokens, status if len(status) < 90 else status[:87] + "..."]


def render_markdown(result: dict[str, Any]) -> str:
    """The results as a markdown table under a few lines of settings (for BENCHMARKS.md)."""
    sh = result.get("shape") or {}
    io = sh.get("io") or {}
    curve = ", ".join(f"depth {c['depth']} {c['GBps']:.2f}" for c in io.get("cells", []))
    planned = [r for r in result.get("runs", []) if r.get("plan_text")]
    lines = [
        f"three tiers: {sh.get('shape')} {sh.get('moe_layers')} layers x {sh.get('experts_per_layer')} experts "
        f"top-{sh.get('top_k')}, {sh.get('expert_bytes', 0) / MB:,.0f} MB of experts (records "
        f"{sh.get('record_bytes', 0) / MB:.2f} MB); limit {result.get('budget_bytes', 0) / MB:,.0f} MB "
        f"({result.get('cgroup', '?')}), store / limit {result.get('store_over_budget', 0):.2f}x; "
        f"resident {result.get('settings', {}).get('resident')}, host tier {sh.get('host_tier_layers')} layers "
        f"({sh.get('host_tier_bytes', 0) / MB:,.0f} MB)",
        f"disk (O_DIRECT random whole records, GB/s, median of passes >= "
        f"{io.get('min_bytes_per_pass', 0) / 1e9:.1f} GB): {curve or '—'}; I/O limit at "
        f"{io.get('GBps', 0):.2f} GB/s (depth {io.get('best_depth')})",
    ]
    lines += [f"routing {routing_note(info)}" for info in (sh.get("routings") or {}).values()]
    if planned:
        # One plan for all: the runs differ only in what the process held when the runtime started.
        held = [r["rss_before_runtime"] / MB for r in planned if r.get("rss_before_runtime")]
        lines.append(f"plan ({planned[0]['locality']} / {planned[0]['arm']}): "
                     + planned[0]["plan_text"].replace("\n", "; ")
                     + (f"; held before the runtime {min(held):,.0f}-{max(held):,.0f} MB" if held else ""))
    refused = [r for r in result.get("runs", []) if r.get("plan_refused")]
    if refused:
        lines.append(f"refused in {len(refused)} runs, which ran at resident=auto: {refused[0]['plan_refused'][0]}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in result.get("runs", [])]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (see the module docstring); a bad value exits with a usage error naming it."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b",
                   help="a shape name of asyncside.bench.shapes, or a Hugging Face config.json (its directory, or a "
                        "repo id): "
                        "its MoE dimensions built as a qwen3_moe (docs/models.md, 'Bench model shapes')")
    p.add_argument("--layers", type=int, default=None, help="MoE decoder layers (default: the shape's all)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the shape's own)")
    p.add_argument("--cache-dir", default=None, help="where the shape is built (default ~/.cache/asyncside)")
    p.add_argument("--resident", default="0.10", help="device pools' share of each layer's experts, or auto")
    p.add_argument("--no-fallback", action="store_true",
                   help="fail an asyncside arm whose plan refuses --resident (default: run it at resident=auto)")
    p.add_argument("--tier-share", type=float, default=0.0, help="host tier's share of the store's layers (0: none)")
    p.add_argument("--memory-max", required=True, help="the cgroup's limit, also the runtime's budget (e.g. 4200M)")
    p.add_argument("--localities", default=None,
                   help="synthetic routing presets, comma-separated (default low,middle,high; with --routing none "
                        "unless given)")
    p.add_argument("--routing", metavar="FILE", action="append", default=None,
                   help="your own routing trace (.npz), a locality labelled by its stem; repeatable; fitted onto "
                        "the shape as bench offload --routing fits it")
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"arms in a cgroup, comma-separated (default {','.join(ARMS)})")
    p.add_argument("--tokens", type=int, default=24, help="at most this many tokens a run")
    p.add_argument("--seconds", type=float, default=20.0, help="at most this many seconds of decoding a run")
    p.add_argument("--policy", default="lrfu")
    p.add_argument("--predictor", default="none")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds before one run is stopped")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds since the epoch the whole call must end by (0: none)")
    p.add_argument("--disk-bytes", default="2G", help="bytes of each disk pass, at least (default 2G)")
    p.add_argument("--disk-depths", default=",".join(str(d) for d in DISK_DEPTHS))
    p.add_argument("--disk-passes", type=int, default=3)
    p.add_argument("--disk-cell-seconds", type=float, default=15.0,
                   help="a depth's further passes stop after this many seconds (its first always completes)")
    p.add_argument("--build-only", action="store_true", help="build the store, measure the disk, and stop")
    p.add_argument("--json", required=True, help="where the results go (rewritten after every step)")
    args = p.parse_args(argv)
    if args.resident != "auto":
        try:
            value = float(args.resident)
        except ValueError:
            p.error(f"--resident: expected a fraction in (0, 1] or auto, got {args.resident!r}")
        if not 0.0 < value <= 1.0:
            p.error(f"--resident: expected a fraction in (0, 1] or auto, got {args.resident!r}")
    if not 0.0 <= args.tier_share <= 1.0:
        p.error(f"--tier-share: expected a share in [0, 1], got {args.tier_share}")
    for name in ("memory_max", "disk_bytes"):
        try:
            setattr(args, name + "_bytes", parse_size(getattr(args, name)))
        except ValueError as exc:
            p.error(f"--{name.replace('_', '-')}: {exc}")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            p.error(f"--arms: unknown arm {a!r}; known: {', '.join(ARMS)}")
    args.arm_list = arms
    from asyncside.errors import TraceError
    from asyncside.routing import LOCALITIES

    files = list(args.routing or [])
    text = args.localities if args.localities is not None else ("" if files else ",".join(LOCALITY_ORDER))
    locs = [s.strip() for s in text.split(",") if s.strip()]
    for s in locs:
        if s not in LOCALITIES:
            p.error(f"--localities: unknown preset {s!r}; known: {', '.join(sorted(LOCALITIES))}")
    args.locality_list = locs
    if not locs and not files:
        p.error("nothing to replay: --localities is empty and no --routing FILE")
    if args.predictor == "trace" and locs:
        p.error(f"--predictor trace replays a --routing file's own predictions; the presets ({','.join(locs)}) "
                "carry none: --localities '' or another predictor")
    try:
        args.user_routings = load_routings(files, taken=locs)  # before the store is built: a bad file first
    except TraceError as exc:
        p.error(f"--routing: {exc}")
    try:
        args.depth_list = [int(d) for d in args.disk_depths.split(",") if d.strip()]
    except ValueError:
        p.error(f"--disk-depths: expected integers separated by commas, got {args.disk_depths!r}")
    if not args.depth_list or min(args.depth_list) < 1:
        p.error(f"--disk-depths: expected depths >= 1, got {args.disk_depths!r}")
    if args.disk_passes < 1:
        p.error(f"--disk-passes: expected >= 1, got {args.disk_passes}")
    return args


def arm_spec(arm: str, base: dict[str, Any], resident: str, host_tier: int, slot_fraction: float) -> tuple[
        dict[str, Any], dict[str, str], list[str] | None]:
    """(the child's spec, its environment on top of the parent's, its command or None for bench
    offload's child) of one arm."""
    if arm == "slot-cache":
        return {**base, "system": "slot-cache", "fraction": slot_fraction}, dict(ARM_ENV[arm]), None
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {list(ARMS)}")
    spec = {**base, "system": arm, "resident": resident, "host_tier": host_tier}
    return spec, dict(ARM_ENV[arm]), [sys.executable, str(pathlib.Path(__file__).resolve())]


def write_traces(tmp: pathlib.Path, presets: list[str], fitted: dict[str, tuple[Any, dict[str, Any]]],
                 sh: dict[str, Any]) -> dict[str, pathlib.Path]:
    """Locality -> the trace file every arm replays: each preset made for the shape ``sh``, then each
    user routing file as fitted onto it (bench offload's :func:`fit_routings`)."""
    from asyncside.routing import preset

    traces: dict[str, pathlib.Path] = {}
    for loc in presets:
        traces[loc] = tmp / f"{loc}.npz"
        preset(loc, tokens=TRACE_TOKENS, n_layers=sh["moe_layers"], n_experts=sh["experts_per_layer"],
               top_k=sh["top_k"], seed=1).save(traces[loc])
    for label, (fit, _info) in fitted.items():
        traces[label] = tmp / f"routing-{len(traces)}.npz"
        fit.save(traces[label])  # the fitted trace, the shape's own: every arm replays it as is
    return traces


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run every locality (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(child_main(json.loads(argv[1]))), flush=True)
        return 0
    if argv[:1] == ["--markdown-from"]:
        if len(argv) != 2:
            raise SystemExit("usage: three_tier.py --markdown-from RESULTS.json")
        print(render_markdown(json.loads(pathlib.Path(argv[1]).read_text())))
        return 0
    args = parse_args(argv)

    from asyncside.bench.shapes import ensure_shape
    from asyncside.models.forcing import RoutingReplayError
    from asyncside.runtime._plan import tier_bytes
    from asyncside.store import ExpertStore

    def left() -> float:
        return args.deadline - time.time() if args.deadline else math.inf

    settings = {k: v for k, v in vars(args).items()
                if k != "user_routings" and isinstance(v, (int, float, str, bool, list, type(None)))}
    result: dict[str, Any] = {"bench": "three-tier", "settings": settings, "runs": [], "compute": {}}
    out = pathlib.Path(args.json)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    budget = int(args.memory_max_bytes)
    ok, why = check_cgroups(budget)
    if not ok and not args.build_only:
        raise SystemExit(f"three_tier.py needs a memory cgroup that charges the page cache: {why}")
    result["cgroup"] = why
    log(f"shape {args.shape}: building or reusing")
    t = time.perf_counter()
    build = ensure_shape(args.shape, layers=args.layers, vocab=args.vocab, cache_dir=args.cache_dir, progress=False)
    result["build"] = {k: v for k, v in dict(build).items() if isinstance(v, (int, float, str, bool))}
    result["build"]["seconds_here"] = time.perf_counter() - t
    store_dir = str(build["store"])
    store = ExpertStore.open(store_dir)
    layers = sorted(store.layers)
    first = store.layer(layers[0])
    tier_layers = math.ceil(args.tier_share * len(layers))
    host_tier = sum(tier_bytes(store.layer(i)) for i in layers[:tier_layers])
    sh: dict[str, Any] = {
        "shape": args.shape, "store": store_dir, "store_bytes": int(result["build"].get("store_bytes", 0)),
        "expert_bytes": sum(sp.blob_bytes for sp in store.layers.values()), "record_bytes": int(first.stride),
        "moe_layers": len(layers), "experts_per_layer": first.n_experts, "top_k": _store_top_k(store_dir),
        "host_tier_bytes": host_tier, "host_tier_layers": tier_layers}
    result["shape"] = sh
    result["budget_bytes"] = budget
    result["store_over_budget"] = sh["expert_bytes"] / budget
    log(f"store {store_dir}: {sh['expert_bytes'] / MB:.0f} MB of experts, record {sh['record_bytes']} B; "
        f"limit {budget / MB:.0f} MB ({result['store_over_budget']:.2f}x, {why}); tier {host_tier / MB:.0f} MB")
    save()
    # Measured once per store, machine and settings: a second call on a warm machine reuses it.
    disk_key = {"depths": args.depth_list, "min_bytes": int(args.disk_bytes_bytes), "passes": args.disk_passes,
                "cell_seconds": args.disk_cell_seconds}
    io_file = pathlib.Path(store_dir).parent / "three-tier-disk.json"
    cached = json.loads(io_file.read_text()) if io_file.is_file() else {}
    if cached.get("key") == disk_key:
        sh["io"] = cached["io"]
        sh["io"]["reused"] = True
    else:
        t = time.perf_counter()
        os.sync()  # a store just built is still being written back: not beside the measurement
        log(f"disk: written back in {time.perf_counter() - t:.1f} s; O_DIRECT random whole records, depths "
            f"{args.depth_list}, >= {args.disk_bytes} a pass")
        sh["io"] = disk_curve(store_dir, args.depth_list, min_bytes=int(args.disk_bytes_bytes),
                              passes=args.disk_passes, cell_seconds=args.disk_cell_seconds)
        io_file.write_text(json.dumps({"key": disk_key, "io": sh["io"]}))
    log("  " + ", ".join(f"depth {c['depth']}: {c['GBps']:.2f} GB/s" for c in sh["io"]["cells"]))
    save()
    try:
        fitted = fit_routings(args.user_routings, [sh], positions=1 + int(args.tokens), predictor=args.predictor,
                              verbose=True)[0]  # each file's fit logged: mapped or not, wrapping
    except RoutingReplayError as exc:
        print(f"three_tier.py: {exc}", file=sys.stderr)
        return 2
    save()
    if args.build_only:
        print(render_markdown(result))
        return 0
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="three-tier-"))
    prompt = [ord("T")]  # one token: every step routes one token
    bases: dict[str, dict[str, Any]] = {}
    try:
        traces = write_traces(tmp, args.locality_list, fitted, sh)
        replayed = list(traces)
        for loc, trace in traces.items():
            bases[loc] = {"store": store_dir, "prompt": prompt, "seconds": args.seconds, "tokens": args.tokens,
                          "policy": args.policy, "predictor": args.predictor, "budget": budget,
                          "routing": str(trace), "fallback_auto": not args.no_fallback,
                          "fraction": float(args.resident) if args.resident != "auto" else 0.1}
        # The compute limits first, in one process: the freshly built store is still in the page cache.
        log(f"compute limits of {', '.join(replayed)} (all-resident mlx-lm, no memory limit, same routing)")
        first_loc = replayed[0]
        compute_spec = {**bases[first_loc], "system": "compute",
                        "routings": {loc: bases[loc]["routing"] for loc in replayed}}
        got = _child(compute_spec, None, min(args.timeout, left() - 5),
                     command=[sys.executable, str(pathlib.Path(__file__).resolve())])
        for loc in replayed:
            one = (got.get("localities") or {}).get(loc) or {"status": got["status"]}
            one.update(load_s=got.get("load_s"), wall_s=got.get("wall_s"))
            result["compute"][loc] = one
            log(f"  {loc}: {one['status']}: {one.get('decode_tokens_per_s') or 0:.2f} tok/s")
        save()
        for loc in replayed:
            compute = result["compute"][loc]
            slot_fraction = bases[loc]["fraction"]
            for arm in args.arm_list:
                spec, env, command = arm_spec(arm, bases[loc], args.resident, host_tier, slot_fraction)
                if left() < MIN_RUN_S:
                    run: dict[str, Any] = {"status": f"skipped: {left():.0f} s left before --deadline"}
                else:
                    dropped = drop_caches()
                    log(f"{loc} / {arm}: in a cgroup of {budget / MB:.0f} MB (caches dropped: {dropped}, env {env})")
                    with MemoryCgroup(budget, name="asyncside-three-tier") as cg:
                        run = _child(spec, cg, min(args.timeout, left() - 5), command=command, env=env)
                    run.update(caches_dropped=dropped, limit_bytes=budget)
                run.update(locality=loc, arm=arm)
                run["routing"] = sh["routings"].get(loc)  # a --routing file's record; None for a preset
                if arm == "asyncside" and run.get("rows_per_layer"):
                    # The slot cache gets the rows the asyncside arm's plan chose for this budget
                    # (half a row under them: layer_rows rounds the fraction's rows up).
                    rows = statistics.median(run["rows_per_layer"].values())
                    slot_fraction = (rows - 0.5) / sh["experts_per_layer"]
                _figures(run, sh, compute)
                if run.get("hit_rate") is not None and run.get("rows_per_layer"):
                    # MIN from the rows the run started with (asyncside warms its rows at start)
                    run["belady"] = belady_of_run(str(traces[loc]), store_dir, len(run["tokens"]),
                                                  run["rows_per_layer"], run.get("warm_experts"))
                    mn = run["belady"]["hit_rate"]
                    run["of_min"] = run["hit_rate"] / mn if mn else None
                result["runs"].append(run)
                _vs_slot_cache(result["runs"])
                save()
                if run["status"].startswith("skipped"):
                    log(f"  {run['status']}")
                    continue
                log(f"  {run['status']}: {run.get('decode_tokens_per_s') or 0:.2f} tok/s, of limit "
                    f"{run.get('of_limit')}, hit {run.get('hit_rate')}, peak {(run.get('peak_bytes') or 0) / MB:.0f} "
                    f"MB, match {run.get('tokens_match_reference')}")
                if run["status"] != "ok":
                    log("  " + " / ".join(run.get("stderr_tail", [])[-6:]))
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    ok_runs = [r for r in result["runs"] if r.get("status") == "ok"]
    result["tokens_identical"] = all(r.get("tokens_match_reference") is not False for r in ok_runs)
    result["rows_per_layer_median"] = {r["locality"] + "/" + r["arm"]: statistics.median(r["rows_per_layer"].values())
                                       for r in ok_runs if r.get("rows_per_layer")}
    save()
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
