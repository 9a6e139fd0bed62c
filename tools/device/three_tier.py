"""Three tiers on MLX CUDA under a memory budget: device pools <- pinned host tier <- SSD.

Builds (or reuses) a model shape's expert store, then per synthetic routing locality:

1. the compute limit: all-resident mlx-lm with no memory limit, under the same replayed routing
   (its tokens are the reference the streamed run must match);
2. the disk's random-read bandwidth at the record size (O_DIRECT, ``bench io``'s reader pass; once);
3. the three-tier run: page cache dropped, a child process in a fresh memory cgroup whose
   ``memory.max`` charges the page cache, ``Runtime(store, resident=R, host_tier=T, memory=B)``
   with R the device pools' share of each layer's experts, T a whole number of layers' tiers
   making up the asked share of the store, and B the budget (memory.max itself).

Per run: decode tok/s, hits, the faults the tier served, misses' MB per token (those the tier
did not serve), the disk's MB per token (the process's ``read_bytes``), the I/O limit (bandwidth /
the runtime's store bytes read per token), the compute limit, tok/s over the lower limit, the peak
memory the cgroup charged, and whether the tokens equal the reference's.

Usage (on the GPU machine, after ``tools/device/cuda-run.sh`` built the extension)::

    python3 tools/device/three_tier.py --memory-max 12G --localities middle --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from asyncside.bench.offload import (
    MB,
    TRACE_TOKENS,
    MemoryCgroup,
    _bandwidth,
    _child,
    _phase,
    _read_bytes,
    _rss,
    _store_top_k,
    drop_caches,
    parse_size,
)


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the seconds since the start."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


T0 = time.perf_counter()


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """The three-tier run (in the current process, the cgroup's): its figures."""
    import anyio

    from asyncside.models import load_streaming_model
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    prompt, seconds, max_tokens = list(spec["prompt"]), float(spec["seconds"]), int(spec["tokens"])
    out: dict[str, Any] = {"system": "asyncside-three-tier"}
    t_load = time.perf_counter()
    io0 = _read_bytes()
    _phase("loading")
    store = ExpertStore.open(spec["store"])
    sm = load_streaming_model(spec["store"])
    sm.set_routing(spec["routing"])
    tokens: list[int] = []
    stamps: list[float] = []
    rss_peak = [0]

    def arrived(tok: int) -> bool:
        tokens.append(tok)
        stamps.append(time.perf_counter())
        rss_peak[0] = max(rss_peak[0], _rss())
        return len(tokens) >= max_tokens or stamps[-1] - stamps[0] >= seconds

    async def run() -> tuple[float, int, dict[str, Any]]:
        rt = Runtime(store, resident=float(spec["resident"]), host_tier=int(spec["host_tier"]),
                     memory=int(spec["budget"]), policy=spec["policy"])
        async with rt:
            out["load_s"] = time.perf_counter() - t_load
            out["memory_plan"] = {k: v for k, v in dict(rt.memory).items() if isinstance(v, (int, float, str, bool))}
            plan = rt.plan
            out["plan_text"] = plan.describe() if plan is not None else None
            out["rss_before_generating"] = _rss()
            _phase("generating")
            io1 = _read_bytes()
            t0 = time.perf_counter()
            agen: Any = sm.generate(prompt, max_tokens=max_tokens, source=rt, predictor=spec["predictor"])
            async with contextlib.aclosing(agen):
                async for tok in agen:
                    if arrived(tok):
                        break
            await rt.drain()
            st = {k: v for k, v in dict(rt.stats()).items() if isinstance(v, (int, float, str, bool))}
            rows = {str(layer): int(rt.ledger(layer).rows) for layer in store.layers}
        return t0, io1, {"stats": st, "rows": rows}

    t0, io1, got = anyio.run(run, backend="asyncio")
    out["stats"] = got["stats"]
    out["rows_per_layer"] = got["rows"]
    end = stamps[-1] if stamps else time.perf_counter()
    out["tokens"] = tokens
    out["seconds"] = end - t0
    out["ttft_s"] = stamps[0] - t0 if stamps else None
    # Decode speed: from the first token to the last (the first carries the prompt's faults).
    out["decode_tokens_per_s"] = (len(tokens) - 1) / (end - stamps[0]) if len(tokens) > 1 and end > stamps[0] else 0.0
    out["read_bytes"] = _read_bytes() - io1
    out["read_bytes_loading"] = io1 - io0
    out["rss_peak_sampled"] = rss_peak[0]
    out["rss_end"] = _rss()
    _phase("done")
    return out


def _run_child(spec: dict[str, Any], cgroup: MemoryCgroup, timeout: float) -> dict[str, Any]:
    """:func:`child_main` in a subprocess inside ``cgroup``; its figures, or why it did not finish."""
    cmd = cgroup.wrap([sys.executable, __file__, "--child", json.dumps(spec)])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                          for x in (exc.stdout, exc.stderr))
    res: dict[str, Any] = {"wall_s": time.perf_counter() - t0, "peak_bytes": cgroup.peak(),
                           "oom_kills": cgroup.oom_kills(), "limit_bytes": cgroup.limit,
                           "stderr_tail": stderr.strip().splitlines()[-12:]}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if rc == 0 and lines:
        res.update(json.loads(lines[-1]))
        res["status"] = "ok"
    elif rc is None:
        res["status"] = f"timed out after {timeout:.0f} s"
    elif res["oom_kills"]:
        res["status"] = f"killed by the cgroup's OOM killer (limit {cgroup.limit / MB:.0f} MB)"
    else:
        res["status"] = f"exit status {rc}"
    return res


def _figures(run: dict[str, Any], sh: dict[str, Any], compute: dict[str, Any]) -> None:
    """The derived columns of one run (in place)."""
    toks, ref = run.get("tokens") or [], compute.get("tokens") or []
    n = min(len(toks), len(ref))
    run["tokens_compared"] = n
    run["tokens_match_reference"] = (toks[:n] == ref[:n]) if n else None
    if run.get("status") != "ok" or not toks:
        return
    steps = len(toks)
    st = run["stats"]
    hits, misses = int(st.get("hits", 0)), int(st.get("misses", 0))
    served = int(st.get("tier_faults", 0)) + int(st.get("staged_copies", 0))
    rec = sh["record_bytes"]
    run["hit_rate"] = hits / (hits + misses) if hits + misses else None
    run["tier_served"] = served
    run["miss_mb_per_token"] = misses * rec / steps / MB
    run["disk_miss_mb_per_token"] = max(misses - served, 0) * rec / steps / MB
    run["store_read_mb_per_token"] = int(st.get("bytes_read", 0)) / steps / MB
    run["disk_mb_per_token"] = int(run.get("read_bytes", 0)) / steps / MB
    bw = sh["io"]["GBps"] * 1e9
    per_tok = run["store_read_mb_per_token"] * MB
    run["io_limit_tokens_per_s"] = bw / per_tok if per_tok else None
    run["compute_limit_tokens_per_s"] = compute.get("decode_tokens_per_s")
    limits = [x for x in (run["io_limit_tokens_per_s"], run["compute_limit_tokens_per_s"]) if x]
    run["of_limit"] = run["decode_tokens_per_s"] / min(limits) if limits else None
    run["peak_over_limit"] = run["peak_bytes"] / run["limit_bytes"] if run.get("peak_bytes") else None


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run every locality (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(child_main(json.loads(argv[1]))), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's all)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the shape's own)")
    p.add_argument("--resident", type=float, default=0.10, help="device pools' share of each layer's experts")
    p.add_argument("--tier-share", type=float, default=0.25, help="host tier's share of the store's layers")
    p.add_argument("--memory-max", required=True, help="the cgroup's memory.max, also the runtime's budget")
    p.add_argument("--localities", default="middle")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--policy", default="lrfu")
    p.add_argument("--predictor", default="none")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds before one run is stopped")
    p.add_argument("--build-only", action="store_true", help="build the store, measure the disk, and stop")
    p.add_argument("--json", required=True, help="where the results go (rewritten after every step)")
    args = p.parse_args(argv)

    from asyncside.bench.shapes import ensure_shape
    from asyncside.routing import preset
    from asyncside.store import ExpertStore

    result: dict[str, Any] = {"bench": "three-tier", "settings": vars(args), "runs": []}
    out = pathlib.Path(args.json)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    log(f"shape {args.shape}: building or reusing")
    t = time.perf_counter()
    build = ensure_shape(args.shape, layers=args.layers, vocab=args.vocab, progress=False)
    result["build"] = {k: v for k, v in dict(build).items() if isinstance(v, (int, float, str, bool))}
    result["build"]["seconds_here"] = time.perf_counter() - t
    store_dir = str(build["store"])
    store = ExpertStore.open(store_dir)
    layers = sorted(store.layers)
    first = store.layer(layers[0])
    from asyncside.runtime._plan import tier_bytes

    tier_layers = math.ceil(args.tier_share * len(layers))
    host_tier = sum(tier_bytes(store.layer(i)) for i in layers[:tier_layers])
    sh = {"shape": args.shape, "store": store_dir, "store_bytes": int(result["build"].get("store_bytes", 0)),
          "expert_bytes": sum(sp.blob_bytes for sp in store.layers.values()), "record_bytes": int(first.stride),
          "moe_layers": len(layers), "experts_per_layer": first.n_experts, "top_k": _store_top_k(store_dir),
          "host_tier_bytes": host_tier, "host_tier_layers": tier_layers}
    result["shape"] = sh
    budget = parse_size(args.memory_max)
    result["budget_bytes"] = budget
    result["store_over_budget"] = sh["expert_bytes"] / budget
    log(f"store {store_dir}: {sh['expert_bytes'] / MB:.0f} MB of experts, record {sh['record_bytes']} B; "
        f"budget {budget / MB:.0f} MB ({result['store_over_budget']:.2f}x); tier {host_tier / MB:.0f} MB")
    save()
    io_file = pathlib.Path(store_dir).parent / "three-tier-io.json"  # measured once per store and machine
    if io_file.is_file():
        sh["io"] = json.loads(io_file.read_text())
    else:
        log("random-read bandwidth (O_DIRECT, whole records, the runtime's queue depth)")
        sh["io"] = _bandwidth(store_dir, None)
        io_file.write_text(json.dumps(sh["io"]))
    log(f"  {sh['io']['GBps']:.2f} GB/s (passes {sh['io']['passes']})")
    save()
    if args.build_only:
        return 0
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="three-tier-"))
    prompt = [ord("T")]  # one token: every step routes one token
    for loc in [s.strip() for s in args.localities.split(",") if s.strip()]:
        trace = tmp / f"{loc}.npz"
        preset(loc, tokens=TRACE_TOKENS, n_layers=len(layers), n_experts=first.n_experts, top_k=sh["top_k"],
               seed=1).save(trace)
        base = {"store": store_dir, "prompt": prompt, "seconds": args.seconds, "tokens": args.tokens,
                "policy": args.policy, "predictor": args.predictor, "budget": budget, "routing": str(trace),
                "fraction": args.resident}
        log(f"{loc}: compute limit (all-resident mlx-lm, no memory limit, same routing)")
        compute = _child({**base, "system": "mlx-lm"}, None, args.timeout)
        compute = {k: compute.get(k) for k in ("status", "decode_tokens_per_s", "tokens", "load_s", "wall_s",
                                                "rss_end")}
        log(f"  {compute['status']}: {compute.get('decode_tokens_per_s') or 0:.2f} tok/s")
        dropped = drop_caches()
        log(f"{loc}: three tiers in a cgroup of {budget / MB:.0f} MB (caches dropped: {dropped})")
        with MemoryCgroup(budget, name="asyncside-three-tier") as cg:
            run = _run_child({**base, "resident": args.resident, "host_tier": host_tier}, cg, args.timeout)
        run.update(locality=loc, caches_dropped=dropped, compute=compute)
        _figures(run, sh, compute)
        result["runs"].append(run)
        save()
        log(f"  {run['status']}: {run.get('decode_tokens_per_s') or 0:.2f} tok/s, of limit {run.get('of_limit')}, "
            f"hit {run.get('hit_rate')}, peak {(run.get('peak_bytes') or 0) / MB:.0f} MB, "
            f"match {run.get('tokens_match_reference')}")
        if run["status"] != "ok":
            log("  " + " / ".join(run.get("stderr_tail", [])))
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
