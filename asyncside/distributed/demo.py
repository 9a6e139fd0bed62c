"""``asyncside demo --ranks N``: the demo's generation split over N ranks on this machine.

Runs the same greedy generation twice: in this process with one Runtime over the whole store,
then as a pipeline of N ranks (subprocesses over loopback, the ring backend; each rank its own
stage of layers and its own Runtime over its part of the store), and reports whether the tokens
are identical (exit status 1 if not, or if a rank failed).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

from .launcher import LocalLaunch, python_argv


async def _single(store_dir: str, prompt_ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from ..models import load_streaming_model
    from ..runtime import Runtime
    from .rank import pool_bytes

    sm = load_streaming_model(store_dir)
    tokens: list[int] = []
    async with Runtime(sm.store, resident=args.resident, side_rows=args.side_rows, policy=args.policy,
                       reader=args.reader) as rt:
        async for _ in sm.generate(prompt_ids, max_tokens=2, source=rt, predictor=args.predictor):
            pass  # warm-up, untimed (the ranks do the same)
        t0 = time.perf_counter()
        first = 0.0
        async for tok in sm.generate(prompt_ids, max_tokens=args.tokens, source=rt, predictor=args.predictor):
            if not tokens:
                first = time.perf_counter() - t0
            tokens.append(tok)
        seconds = time.perf_counter() - t0
        stats = rt.stats()
        pools = pool_bytes(rt)
        held = _pools_held(sm.store, {i: rt.ledger(i).rows for i in sm.store.layers}, rt.memory)
    return {"tokens": tokens, "seconds": seconds, "ttft_s": first,
            "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0, "pool_bytes": pools,
            "hit_rate": stats["hit_rate"], "bytes_read": int(stats["bytes_read"]), "pools": held}


def _pools_held(store: Any, rows: dict[int, int], memory: dict[str, Any]) -> dict[str, Any]:
    """What the pools hold, as the one-process demo reports it: rows per layer over experts, and from
    the runtime's plan (``memory``) the fraction of every layer's experts and where the plan raised
    the rows above ``--resident``, what was asked and why (every rank sizes its layers' pools by the
    same rule)."""
    from ..pools_note import cli_rows_raised

    layers = list(rows)
    return {"pool_rows_per_layer": rows[layers[0]] if layers else 0,
            "experts_per_layer": store.layer(layers[0]).n_experts if layers else 0,
            "pools_fraction": memory.get("pools_fraction"),
            "rows_raised": cli_rows_raised(memory.get("rows_raised"))}


def run_ranks_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs; every figure as a dict (what ``--json`` prints)."""
    import anyio
    from mlx_lm.utils import load_config

    from ..models.embedded import ensure_embedded_default
    from ..models.tokenizer import load_tokenizer
    from ..pools_note import side_rows_refused
    from ..store import ExpertStore
    from .plan import PlanError, parse_split
    from .stage import plan_for_store

    if args.ranks < 2:
        raise SystemExit(f"asyncside demo: --ranks must be >= 2 for a pipeline, got {args.ranks}")
    if args.tokens < 1:
        raise SystemExit(f"asyncside demo: --tokens must be >= 1, got {args.tokens}")
    if getattr(args, "memory", None) is not None or not isinstance(args.resident, float):
        # The ranks take no budget: one given here would bound neither the ranks nor the one-process run.
        from ..memory import describe_bytes

        memory = getattr(args, "memory", None)
        given = f"--memory ({describe_bytes(memory)})" if memory is not None else "--resident auto"
        raise ValueError(f"{given} with --ranks {args.ranks}: a memory budget sizes the pools of one process, and "
                         "every rank holds --resident FRACTION of its own layers' experts: give a fraction such "
                         "as --resident 0.25 and no --memory")
    if args.model is None:
        _model_dir, store_path = ensure_embedded_default(args.cache_dir, progress=not args.json)
    else:
        store_path = pathlib.Path(args.model)
    store_dir = str(store_path.absolute())
    side_rows_refused(ExpertStore.open(store_dir), args.side_rows)  # the one-process run and every rank's
    try:
        plan = plan_for_store(store_dir, args.ranks, parse_split(args.split))  # before anything starts
    except PlanError as exc:
        raise SystemExit(f"asyncside demo: {exc}") from None
    tokenizer = load_tokenizer(pathlib.Path(store_dir), load_config(pathlib.Path(store_dir)))
    if tokenizer is None:
        raise SystemExit(f"asyncside demo: {store_dir} holds no tokenizer files (the demo encodes a text prompt)")
    prompt_ids = list(tokenizer.encode(args.prompt))

    single = anyio.run(_single, store_dir, prompt_ids, args, backend="asyncio",
                       backend_options={"use_uvloop": sys.platform != "win32"})

    with tempfile.TemporaryDirectory(prefix="asyncside-demo-ranks-") as out:
        rank_args = [store_dir, "--prompt-ids", ",".join(map(str, prompt_ids)), "--tokens", str(args.tokens),
                     "--resident", str(args.resident), "--policy", args.policy, "--reader", args.reader,
                     "--predictor", args.predictor, "--split", ",".join(map(str, plan.split)), "--warmup", "2",
                     "--join-timeout", str(args.join_timeout), "--out", out]
        if args.side_rows is not None:
            rank_args += ["--side-rows", str(args.side_rows)]
        with LocalLaunch([python_argv(*rank_args)] * args.ranks) as launch:
            res = launch.wait(args.deadline)
        reports = []
        for r in range(args.ranks):
            path = pathlib.Path(out) / f"rank{r}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else None)

    r0 = reports[0] or {}
    tokens = (r0.get("tokens") or [[]])[0]
    per_rank: list[dict[str, Any]] = []
    for r, rep in enumerate(reports):
        if rep is None:
            per_rank.append({"rank": r, "status": res.ranks[r].returncode, "stderr": res.ranks[r].stderr[-2000:]})
            continue
        rt = rep["stats"].get("runtime", {})
        b = rep["stats"]["boundary"]
        per_rank.append({
            "rank": r, "status": res.ranks[r].returncode, "layers": [rep["stage"]["start"], rep["stage"]["stop"]],
            "moe_layers": rep["stage"]["moe_layers"], "pool_bytes": rep["pool_bytes"],
            "max_rss_bytes": rep["max_rss_bytes"], "hit_rate": rt.get("hit_rate"), "bytes_read": rt.get("bytes_read"),
            "messages_sent": b["sent"], "messages_received": b["received"], "bytes_sent": b["bytes_sent"],
            "predictions_sent": rep["stats"]["predictions_sent"],
            "predictions_received": rep["stats"]["predictions_received"],
        })
    identical = res.ok and tokens == single["tokens"]
    return {
        "ranks": args.ranks,
        "backend": "ring",
        "transport": "loopback (127.0.0.1), one process per rank",
        "store": store_dir,
        "split": list(plan.split),
        "stages": [s.to_json() for s in plan.stages],
        "resident_fraction": args.resident,
        # what the pools hold, of every layer's experts (more than asked where rows_raised says why)
        **single.pop("pools"),
        "prompt_tokens": len(prompt_ids),
        "tokens_identical": identical,
        "launch": {"returncode": res.returncode, "reason": res.reason, "seconds": res.seconds},
        "single_process": {k: v for k, v in single.items() if k != "tokens"},
        "pipeline": {"tokens_per_s": r0.get("tokens_per_s", 0.0), "seconds": r0.get("seconds", 0.0),
                     "ttft_s": (r0.get("ttft_s") or [0.0])[0], "join_s": r0.get("join_s")},
        "per_rank": per_rank,
        "text": tokenizer.decode(tokens),
        "reference_text": tokenizer.decode(single["tokens"]),
    }


def title(result: dict[str, Any]) -> str:
    """The table's title: the split, what the pools hold (as the one-process demo's title says it)
    and the transport."""
    from ..pools_note import rows_note

    held = result.get("pools_fraction", result["resident_fraction"])
    rows = f" ({rows_note(result)})" if "pool_rows_per_layer" in result else ""
    return (f"asyncside demo --ranks {result['ranks']} — split {result['split']}, {held:.0%} of experts in "
            f"pools{rows}, {result['transport']}")


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s, p = result["single_process"], result["pipeline"]
    table = Table(title=title(result))
    table.add_column("")
    table.add_column("pipeline", justify="right")
    table.add_column("one process", justify="right")
    table.add_row("tokens/s (one request)", f"{p['tokens_per_s']:.2f}", f"{s['tokens_per_s']:.2f}")
    table.add_row("time to first token", f"{p['ttft_s'] * 1e3:.0f} ms", f"{s['ttft_s'] * 1e3:.0f} ms")
    for r in result["per_rank"]:
        if "layers" in r:
            table.add_row(f"rank {r['rank']}: layers {r['layers'][0]}..{r['layers'][1] - 1}, pools",
                          f"{r['pool_bytes'] / 1e6:.1f} MB", f"{s['pool_bytes'] / 1e6:.1f} MB (all layers)")
        else:
            table.add_row(f"rank {r['rank']}", f"FAILED (status {r['status']})", "")
    table.add_row("tokens identical", "yes" if result["tokens_identical"] else "NO", "")
    Console().print(table)


def ranks_demo_main(args: argparse.Namespace) -> int:
    """Run the demo over ``args.ranks`` ranks; 0 when every rank succeeded and the tokens are identical."""
    from ..errors import AsyncsideError

    try:
        result = run_ranks_demo(args)
    except AsyncsideError as exc:  # refused as the one-process demo refuses it (a plan that cannot be)
        print(f"asyncside demo: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _table(result)
        if result["launch"]["returncode"] != 0:
            print(f"asyncside demo: the pipeline failed: {result['launch']['reason']}", file=sys.stderr)
            for r in result["per_rank"]:
                if r.get("stderr"):
                    print(f"--- rank {r['rank']}:\n{r['stderr']}", file=sys.stderr)
        elif not result["tokens_identical"]:
            print("asyncside demo: tokens differ from the one-process run:\n"
                  f"  pipeline:    {result['text']!r}\n  one process: {result['reference_text']!r}", file=sys.stderr)
    if result["launch"]["returncode"] != 0:
        return result["launch"]["returncode"]
    return 0 if result["tokens_identical"] else 1
