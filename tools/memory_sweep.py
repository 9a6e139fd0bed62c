"""Run ``asyncside demo --memory SIZE`` inside a fresh memory cgroup of SIZE for each budget of a
sweep, and report what the plan chose and the most memory the cgroup charged (BENCHMARKS.md,
"Memory we use": the budget sweep).

Needs root and a memory cgroup hierarchy (v1 or v2, as ``asyncside bench offload`` makes them).
Each run starts after ``sync; echo 3 > /proc/sys/vm/drop_caches`` so every read is charged to it.

    python tools/memory_sweep.py --budgets 300M,400M,500M,700M --tokens 16 [--json] [-- DEMO ARGS]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from asyncside.bench.offload import MemoryCgroup, drop_caches
from asyncside.memory import describe_bytes, parse_size


def run_one(budget: int, tokens: int, extra: list[str], timeout: float) -> dict[str, Any]:
    """One demo run in a cgroup of ``budget`` bytes: its plan's figures, peak charge and outcome."""
    cmd = [sys.executable, "-m", "asyncside", "demo", "--memory", str(budget), "--tokens", str(tokens),
           "--reference", "none", "--json", *extra]
    drop_caches()
    with MemoryCgroup(budget, name="asyncside-sweep") as cg:
        try:
            out = subprocess.run(cg.wrap(cmd), capture_output=True, text=True, timeout=timeout)
            rc: int | str = out.returncode
            stdout, stderr = out.stdout, out.stderr
        except subprocess.TimeoutExpired:
            rc, stdout, stderr = "timeout", "", ""
        peak, kills = cg.peak(), cg.oom_kills()
    row: dict[str, Any] = {"budget": budget, "rc": rc, "peak_bytes": peak, "oom_kills": kills}
    try:
        data = json.loads(stdout)
    except ValueError:
        last = [line for line in stderr.strip().splitlines() if line.strip()]
        row["error"] = last[-1][:300] if last else f"exit {rc}"
        return row
    plan = data.get("memory") or {}
    row.update(headroom_bytes=plan.get("headroom_bytes"), pool_bytes=plan.get("pool_bytes"),
               page_cache_bytes=plan.get("page_cache_bytes"), direct=plan.get("direct"),
               rows=data.get("pool_rows_per_layer"), hit_rate=data.get("hit_rate"),
               peak_rss_bytes=data.get("peak_rss_bytes"), kv_allowance_bytes=plan.get("kv_allowance_bytes"))
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    """The sweep as a markdown table."""
    mib = lambda v: "—" if v is None else f"{v / 2**20:.0f}"  # noqa: E731
    out = ["| budget | outcome | headroom MiB | pools MiB (rows a layer) | page cache MiB | reads | hit rate "
           "| peak charged MiB | peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            what = "killed by the OOM killer" if r["oom_kills"] else f"refused: {r['error']}"
            out.append(f"| {describe_bytes(r['budget'])} | {what} | — | — | — | — | — | {mib(r['peak_bytes'])} | — |")
            continue
        outcome = "ok" if r["rc"] == 0 and not r["oom_kills"] else f"rc {r['rc']}, OOM kills {r['oom_kills']}"
        out.append(f"| {describe_bytes(r['budget'])} | {outcome} | {mib(r['headroom_bytes'])} | "
                   f"{mib(r['pool_bytes'])} ({r['rows']}) | {mib(r['page_cache_bytes'])} | "
                   f"{'O_DIRECT' if r['direct'] else 'buffered'} | {r['hit_rate']:.1%} | {mib(r['peak_bytes'])} | "
                   f"{mib(r['peak_rss_bytes'])} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="300M,400M,500M,700M", help="comma-separated sizes")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("extra", nargs="*", help="more demo arguments (after --)")
    args = p.parse_args()
    rows = []
    for text in args.budgets.split(","):
        row = run_one(parse_size(text), args.tokens, args.extra, args.timeout)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
