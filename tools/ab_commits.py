"""Paired before/after benchmark of two commits: ``bench generate`` and ``bench serve``, rounds interleaved.

    python tools/ab_commits.py 6662851 75449fb --out /tmp/ab --rounds 3 --serve-rounds 2
    python tools/ab_commits.py BEFORE AFTER --out /tmp/ab --summarize     # the table of runs already made

Each commit is checked out into its own git worktree (``--workdir``, default /tmp) and installed,
not editable, into its own venv with the ``bench`` extra, pinned to the versions of the venv that runs
this script (``pip freeze``), so that only the package's code differs; ``--before-venv`` /
``--after-venv`` reuse venvs already built. Round i runs ``bench generate`` before, then after, then
``bench serve`` before, then after, the order reversed in every second round, each process from an
empty directory (so that the installed package is imported), its load average recorded before it
starts. The summary gives, per round, after/before of asyncside's figures and of mlx-lm's (the
all-resident reference each run measures beside its own, which shows how much the machine moved
between the two processes of a round), then the median and the range of the per-round ratios.
``--resume`` keeps the runs already recorded in ``--out`` and makes only the missing ones (more rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GENERATE_ARGS = "--residency 0.25 0.5 --no-cold --repeats 1 --tokens 64 --plot none"
SERVE_ARGS = "--resident 0.5 --clients 1,8 --long-prompt 0 --duration 30"
REPO = Path(__file__).resolve().parent.parent


def _sh(cmd: list[str], **kw: Any) -> str:
    out: str = subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout
    return out.strip()


def build(commit: str, workdir: Path) -> Path:
    """Worktree and venv for ``commit`` (reused when present); returns the venv."""
    sha = _sh(["git", "-C", str(REPO), "rev-parse", "--short", commit])
    tree, venv = workdir / f"ab-{sha}", workdir / f"ab-{sha}-venv"
    if not tree.exists():
        _sh(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha])
    if not (venv / "bin" / "asyncside").exists():
        # The runner's own versions, so that only asyncside differs between the two venvs.
        frozen = [line for line in _sh([sys.executable, "-m", "pip", "freeze"]).splitlines()
                  if "==" in line and not line.lower().startswith("asyncside")]
        constraints = workdir / f"ab-{sha}-constraints.txt"
        constraints.write_text("\n".join(frozen) + "\n")
        _sh([sys.executable, "-m", "venv", str(venv)])
        print(f"building {sha} into {venv} ...", file=sys.stderr, flush=True)
        _sh([str(venv / "bin" / "pip"), "install", "-q", "-c", str(constraints), f"{tree}[bench]"])
    return venv


def run_one(venv: Path, bench: str, args: str, out: Path, cwd: Path) -> dict[str, Any]:
    """One ``asyncside bench`` process; its JSON goes to ``out``, stderr beside it."""
    where = _sh([str(venv / "bin" / "python"), "-c", "import asyncside; print(asyncside.__file__)"], cwd=cwd)
    if not where.startswith(str(venv)):
        raise SystemExit(f"{venv}: imports asyncside from {where}, not from the venv")
    load = os.getloadavg()
    t0 = time.monotonic()
    with out.open("w") as fo, out.with_suffix(".err").open("w") as fe:
        rc = subprocess.run([str(venv / "bin" / "asyncside"), "bench", bench, *args.split(), "--json"],
                            cwd=cwd, stdout=fo, stderr=fe, check=False).returncode
    if rc != 0:
        raise SystemExit(f"{out}: asyncside bench {bench} exited {rc} (see {out.with_suffix('.err')})")
    return {"file": out.name, "loadavg_before": list(load), "wall_s": round(time.monotonic() - t0, 1)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _spread(xs: list[float | None]) -> dict[str, float | None]:
    vals = [x for x in xs if x is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _generate_rows(path: Path) -> dict[float, dict[str, dict[str, Any]]]:
    rows: dict[float, dict[str, dict[str, Any]]] = {}
    for r in json.loads(path.read_text())["rows"]:
        if r["cache"] == "warm" and r["system"] in ("mlx-lm", "asyncside", "slot-cache"):
            rows.setdefault(r["residency"], {}).setdefault(r["system"], r)
    return rows


def _serve_phases(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    return {(p["server"], p["clients"]): p for p in json.loads(path.read_text())["phases"]}


def _pairs(runs: list[dict[str, Any]], bench: str) -> list[tuple[int, tuple[dict[str, Any], dict[str, Any]]]]:
    """The rounds of ``bench`` with both a before and an after run (an interrupted round is left out)."""
    by = {(r["round"], r["side"]): {**r, "position": i} for i, r in enumerate(runs) if r["bench"] == bench}
    return [(rnd, (by[rnd, "before"], by[rnd, "after"])) for rnd in sorted({k[0] for k in by})
            if (rnd, "before") in by and (rnd, "after") in by]


def summarize(out: Path) -> dict[str, Any]:
    """Per-round after/before ratios and their medians from the runs recorded in ``out/runs.json``."""
    runs = json.loads((out / "runs.json").read_text())
    gen: dict[str, Any] = {}
    for rnd, (b, a) in _pairs(runs, "generate"):
        rb, ra = _generate_rows(out / b["file"]), _generate_rows(out / a["file"])
        for res in sorted(rb):
            entry = gen.setdefault(str(res), {"rounds": []})
            row: dict[str, Any] = {"round": rnd, "first": "before" if b["position"] < a["position"] else "after",
                                   "load_before": b["loadavg_before"][0], "load_after": a["loadavg_before"][0]}
            for side, rows in (("before", rb[res]), ("after", ra[res])):
                for system in ("asyncside", "mlx-lm", "slot-cache"):
                    row[f"{side}_{system}_tok_s"] = rows[system]["decode_tokens_per_s"]
                    row[f"{side}_{system}_ttft_s"] = rows[system]["ttft_s"]
                row[f"{side}_tokens_identical"] = rows["asyncside"].get("tokens_identical")
            for system in ("asyncside", "mlx-lm", "slot-cache"):
                row[f"{system}_tok_s_ratio"] = _ratio(row[f"after_{system}_tok_s"], row[f"before_{system}_tok_s"])
                row[f"{system}_ttft_ratio"] = _ratio(row[f"after_{system}_ttft_s"], row[f"before_{system}_ttft_s"])
            for side in ("before", "after"):
                row[f"{side}_vs_mlx_lm"] = _ratio(row[f"{side}_asyncside_tok_s"], row[f"{side}_mlx-lm_tok_s"])
                row[f"{side}_ttft_vs_mlx_lm"] = _ratio(row[f"{side}_asyncside_ttft_s"], row[f"{side}_mlx-lm_ttft_s"])
            # Each side against the mlx-lm run of its own process: what is left of the machine's drift
            # between the two processes of a round.
            row["vs_mlx_lm_ratio"] = _ratio(row["after_vs_mlx_lm"], row["before_vs_mlx_lm"])
            row["ttft_vs_mlx_lm_ratio"] = _ratio(row["after_ttft_vs_mlx_lm"], row["before_ttft_vs_mlx_lm"])
            entry["rounds"].append(row)
        for key in ("asyncside_tok_s_ratio", "asyncside_ttft_ratio", "mlx-lm_tok_s_ratio", "mlx-lm_ttft_ratio",
                    "slot-cache_tok_s_ratio", "before_vs_mlx_lm", "after_vs_mlx_lm", "vs_mlx_lm_ratio",
                    "ttft_vs_mlx_lm_ratio"):
            for res_entry in gen.values():
                res_entry[key] = _spread([r.get(key) for r in res_entry["rounds"]])
    serve: dict[str, Any] = {}
    for rnd, (b, a) in _pairs(runs, "serve"):
        pb, pa = _serve_phases(out / b["file"]), _serve_phases(out / a["file"])
        for phase in sorted(pb):
            server, clients = phase
            entry = serve.setdefault(f"{server}/{clients}", {"rounds": []})
            entry["rounds"].append({
                "round": rnd, "first": "before" if b["position"] < a["position"] else "after",
                "load_before": b["loadavg_before"][0], "load_after": a["loadavg_before"][0],
                "before_tok_s": pb[phase]["tokens_per_s"], "after_tok_s": pa[phase]["tokens_per_s"],
                "ratio": _ratio(pa[phase]["tokens_per_s"], pb[phase]["tokens_per_s"]),
                "before_errors": pb[phase].get("error_count"), "after_errors": pa[phase].get("error_count"),
                "before_ttft_p50_s": pb[phase].get("ttft_p50_s"), "after_ttft_p50_s": pa[phase].get("ttft_p50_s"),
            })
        for entry in serve.values():
            entry["ratio"] = _spread([r["ratio"] for r in entry["rounds"]])
    return {"generate": gen, "serve": serve}


def main() -> None:
    """Build both commits, run the interleaved rounds (unless ``--summarize``), write ``summary.json``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--out", type=Path, required=True, help="directory for every run's JSON and the summary")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--before-venv", type=Path, help="a venv with BEFORE installed (skips building it)")
    p.add_argument("--after-venv", type=Path, help="a venv with AFTER installed (skips building it)")
    p.add_argument("--rounds", type=int, default=3, help="bench generate rounds (default 3)")
    p.add_argument("--serve-rounds", type=int, default=2, help="bench serve rounds (default 2; 0 skips)")
    p.add_argument("--generate-args", default=GENERATE_ARGS, help=f"default: {GENERATE_ARGS!r}")
    p.add_argument("--serve-args", default=SERVE_ARGS, help=f"default: {SERVE_ARGS!r}")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs recorded in --out/runs.json and make only the missing ones (more rounds)")
    p.add_argument("--summarize", action="store_true", help="only summarize the runs already in --out")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        venvs = {"before": args.before_venv or build(args.before, args.workdir),
                 "after": args.after_venv or build(args.after, args.workdir)}
        commits = {s: _sh(["git", "-C", str(REPO), "rev-parse", "--short", c])
                   for s, c in (("before", args.before), ("after", args.after))}
        recorded = args.out / "runs.json"
        runs: list[dict[str, Any]] = json.loads(recorded.read_text()) if args.resume and recorded.exists() else []
        done = {(r["bench"], r["side"], r["round"]) for r in runs}
        with tempfile.TemporaryDirectory() as neutral:
            for rnd in range(max(args.rounds, args.serve_rounds)):
                for bench, n, bench_args in (("generate", args.rounds, args.generate_args),
                                             ("serve", args.serve_rounds, args.serve_args)):
                    if rnd >= n:
                        continue
                    # The order alternates by round: the second process of a round can find the machine
                    # warmer or quieter than the first, and that must not read as the code's doing.
                    for side in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
                        if (bench, side, rnd + 1) in done:
                            continue
                        out = args.out / f"{bench}-{side}-{rnd + 1}.json"
                        print(f"round {rnd + 1}: {bench} {side} ({commits[side]}), load {os.getloadavg()[0]:.2f}",
                              file=sys.stderr, flush=True)
                        rec = run_one(venvs[side], bench, bench_args, out, Path(neutral))
                        runs.append({"bench": bench, "side": side, "commit": commits[side], "round": rnd + 1,
                                     "args": bench_args, **rec})
                        recorded.write_text(json.dumps(runs, indent=1) + "\n")
    summary = summarize(args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for res, e in summary["generate"].items():
        print(f"generate {res}: asyncside decode after/before {e['asyncside_tok_s_ratio']}, "
              f"TTFT {e['asyncside_ttft_ratio']}; mlx-lm decode {e['mlx-lm_tok_s_ratio']}")
    for key, e in summary["serve"].items():
        print(f"serve {key}: tok/s after/before {e['ratio']}")


if __name__ == "__main__":
    main()
