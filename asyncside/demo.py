"""``asyncside demo``: streaming generation with part of the experts resident, beside all-resident.

The demo runs the same greedy generation twice, in one process, one after the other:

1. all-resident: the plain mlx-lm model with every expert in memory (mlx-lm's own
   ``generate_step``): the reference for tokens and for speed;
2. streaming: the same model through asyncside, its pools holding ``--resident`` of each
   layer's experts, the rest read from the expert store while the model computes.

It prints the streamed tokens as they come, then a table of both runs, and exits non-zero when
the tokens differ (they must not).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .memory import host_tier_arg
from .policies import DEFAULT_POLICY
from .policies import POLICIES as POLICY_NAMES

DEFAULT_PROMPT = "Mixture-of-Experts models route every token to a few experts out of many. "

#: said before the embedded model's text: its weights are seeded, so the text is not meant to read well
EMBEDDED_NOTICE = ("note: the embedded model's weights are generated from a seed, so its text reads as noise; "
                   "speed and exactness are the point. On a real model: asyncside demo --model "
                   "mlx-community/Qwen3-30B-A3B-4bit (a Hugging Face repo id or a local directory)")


def _resident(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] or 'auto', got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] or 'auto', got {text!r}")
    return value


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``asyncside demo``."""
    p.add_argument("--model", metavar="STORE|DIR|ORG/NAME", default=None,
                   help="an expert store, an mlx-lm model directory or a Hugging Face repo id (converted on "
                        "first use into the cache directory; default: the embedded Qwen3-MoE model)")
    p.add_argument("--resident", metavar="FRACTION", type=_resident, default=0.25,
                   help="share of each layer's experts the pools hold, or 'auto': sized to the memory "
                        "available (default 0.25)")
    p.add_argument("--tokens", metavar="N", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--reader", default="auto", choices=["auto", "io_uring", "threads", "aiofiles"],
                   help="read backend (default: io_uring where the kernel allows it)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check each record read against its checksum (default: verify)")
    p.add_argument("--host-tier", metavar="SIZE", type=host_tier_arg, default="auto",
                   help="MLX CUDA: pinned host memory for faulted records kept for later faults: auto, a "
                        "size such as 2G, or 0 (default auto)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICY_NAMES),
                   help=f"eviction policy of the dynamic rows (default {DEFAULT_POLICY})")
    p.add_argument("--predictor", default="lookahead", choices=["lookahead", "temporal", "none"],
                   help="expert prediction for prefetch (default lookahead)")
    p.add_argument("--lookahead-extra", metavar="N", type=int, default=0,
                   help="lookahead names N experts beyond the router's k per token (default 0; "
                        "fewer misses, more reads: see BENCHMARKS.md)")
    p.add_argument("--mode", default="auto", choices=["auto", "queued", "per-layer", "whole"],
                   help="how decode steps run (default auto: queued, misses served inside the stream)")
    p.add_argument("--side-rows", type=int, default=None,
                   help="rows of the rotating side region per layer (default: half the budget)")
    p.add_argument("--direct", action="store_true",
                   help="read with O_DIRECT (bypass the page cache: every read hits the disk)")
    p.add_argument("--cache-dir", default=None, help="where the embedded model is built (default ~/.cache/asyncside)")
    p.add_argument("--routing", metavar="FILE", default=None,
                   help="replay a routing trace (.npz, docs/routing-traces.md): every MoE layer of both runs "
                        "routes to the trace's experts instead of its router's top-k")
    p.add_argument("--record-routing", metavar="FILE", default=None,
                   help="write the streaming run's routing (every MoE layer's ids per token) as a routing trace "
                        "(.npz, docs/routing-traces.md)")
    p.add_argument("--quiet", action="store_true", help="do not print tokens as they come")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="N > 1: run the generation as a pipeline of N ranks on this machine (loopback, ring "
                        "backend) beside the one-process run; see docs/distributed.md")
    p.add_argument("--split", default=None, help="with --ranks: decoder layers per rank, e.g. 4,4 (default even)")
    p.add_argument("--join-timeout", type=float, default=60.0, help="with --ranks: seconds for the ranks to meet")
    p.add_argument("--deadline", type=float, default=600.0, help="with --ranks: seconds before every rank is stopped")


@dataclass
class Run:
    """Tokens and timings of one generation run (the demo's and ``bench generate``'s)."""

    tokens: list[int] = field(default_factory=list)
    start: float = 0.0
    first: float = 0.0
    end: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    audit_ok: bool = True

    def first_token(self) -> None:
        """Call as each token arrives, before appending it: stamps the first one."""
        if not self.tokens:
            self.first = time.perf_counter()

    @property
    def tokens_per_s(self) -> float:
        dt = self.end - self.start
        return len(self.tokens) / dt if dt > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # Decode speed excludes the prompt: it is what residency changes most.
        dt = self.end - self.first
        return (len(self.tokens) - 1) / dt if len(self.tokens) > 1 and dt > 0 else 0.0

    @property
    def ttft_s(self) -> float:
        return self.first - self.start

    def figures(self) -> dict[str, float]:
        return {
            "tokens": len(self.tokens),
            "seconds": self.end - self.start,
            "tokens_per_s": self.tokens_per_s,
            "ttft_s": self.ttft_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


def reference_run(model: Any, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> Run:
    """Greedy tokens of the plain mlx-lm model through its own ``generate_step``, timed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from .models.forcing import rewind_reference

    rewind_reference(model)  # a replayed routing starts at position 0 again
    run = Run(start=time.perf_counter())
    for y, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        tok = int(y)
        run.first_token()
        if tok in eos:
            break
        run.tokens.append(tok)
    run.end = time.perf_counter()
    return run


async def _streaming_run(sm: Any, store: Any, prompt_ids: list[int], args: argparse.Namespace,
                         echo: Any, options: Any) -> tuple[Run, dict[str, Any], bool]:
    import anyio

    from .looplag import measure_loop_lag
    from .models.trace import RoutingTrace
    from .runtime import Runtime

    async with Runtime(store, resident=args.resident, side_rows=args.side_rows, policy=args.policy,
                       reader=args.reader, direct=True if args.direct else None,
                       verify=not getattr(args, "no_verify", False),
                       host_tier=getattr(args, "host_tier", "auto")) as rt:
        record = RoutingTrace() if getattr(args, "record_routing", None) else None
        run = Run(start=time.perf_counter())
        async with measure_loop_lag() as lag:
            async for tok in sm.generate(prompt_ids, max_tokens=args.tokens, source=rt, predictor=args.predictor,
                                         options=options, trace=record):
                run.first_token()
                run.tokens.append(tok)
                echo(run.tokens)
        run.end = time.perf_counter()
        await rt.drain()
        audit_ok = all(report.ok for report in rt.audit().values())
        stats: dict[str, Any] = dict(rt.stats())  # the runtime's counters, then the demo's own figures
        layers = list(store.layers)
        stats["pool_rows_per_layer"] = rt.ledger(layers[0]).rows if layers else 0
        stats["experts_per_layer"] = store.layer(layers[0]).n_experts if layers else 0
        stats["loop_lag"] = lag.summary()
        stats["fault_latency"] = rt.fault_latency()
        stats["memory"] = rt.memory
    if record is not None:
        meta = {"model": sm.model_id, "prompt_tokens": len(prompt_ids), "generated_tokens": len(run.tokens)}
        await anyio.to_thread.run_sync(record.to_file_trace(stats["experts_per_layer"], meta).save,
                                       args.record_routing)
    return run, stats, audit_ok


def _echo_to(stream: Any, tokenizer: Any, enabled: bool) -> Any:
    """A callback printing the text of new tokens as they arrive."""
    shown = [""]

    def echo(tokens: list[int]) -> None:
        if not enabled:
            return
        text = tokenizer.decode(tokens)
        if text.startswith(shown[0]):
            stream.write(text[len(shown[0]):])
        else:  # a multi-byte character completed differently: reprint the tail
            stream.write("\r" + text)
        stream.flush()
        shown[0] = text

    return echo


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs; returns every figure as a dict (what ``--json`` prints)."""
    import anyio
    import mlx.core as mx

    from .models import ForwardOptions, load_reference_model, load_streaming_model
    from .models.embedded import ensure_embedded_default
    from .models.forcing import force_reference
    from .store import ExpertStore

    if args.tokens < 1:
        raise SystemExit(f"asyncside demo: --tokens must be >= 1, got {args.tokens}")
    if args.lookahead_extra < 0:
        raise SystemExit(f"asyncside demo: --lookahead-extra must be >= 0, got {args.lookahead_extra}")
    if args.model is None:
        _model_dir, store_dir = ensure_embedded_default(args.cache_dir, progress=not args.json)
    else:
        from .hub import store_for

        store_dir = store_for(args.model, cache_dir=args.cache_dir, progress=not args.json)
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    options = ForwardOptions(mode=args.mode, lookahead_extra=args.lookahead_extra)
    prompt_ids = list(sm.tokenizer.encode(args.prompt))
    eos = set(getattr(sm.tokenizer, "eos_token_ids", ()) or ())

    replay = sm.set_routing(args.routing) if getattr(args, "routing", None) else None
    # All-resident reference first (it also warms MLX's kernels for both runs alike).
    ref_model, _config = load_reference_model(store_dir)
    if replay is not None:
        force_reference(ref_model, sm.arch.block_attr, replay)  # the same routing as the streaming run
    reference_run(ref_model, prompt_ids, 2, eos)  # warm-up, not timed
    ref = reference_run(ref_model, prompt_ids, args.tokens, eos)
    del ref_model
    mx.clear_cache()

    echo = _echo_to(sys.stdout, sm.tokenizer, enabled=not (args.quiet or args.json))
    if args.model is None and not (args.quiet or args.json):
        print(EMBEDDED_NOTICE, flush=True)
    if not (args.quiet or args.json):
        print(f"{args.prompt}", end="", flush=True)
    run, stats, audit_ok = anyio.run(
        _streaming_run, sm, store, prompt_ids, args, echo, options,
        backend="asyncio", backend_options={"use_uvloop": sys.platform != "win32"},
    )
    if not (args.quiet or args.json):
        print(flush=True)

    ref_f, run_f = ref.figures(), run.figures()
    identical = run.tokens == ref.tokens
    counters = sm.forward_with(options).counters
    kinds = {"queued": counters["queued"], "whole": counters["optimistic"],
             "per-layer": counters["per_layer"]}
    # Decode steps are every step but the prefill chunks (per layer, logits unread).
    decode_steps = max(1, len(run.tokens))
    fault_latency = stats.pop("fault_latency")
    result: dict[str, Any] = {
        "model": sm.model_id,
        "store": str(store_dir),
        "note": EMBEDDED_NOTICE if args.model is None else None,
        "prompt_tokens": len(prompt_ids),
        "resident_fraction": stats["memory"]["resident"],
        "memory": stats.pop("memory"),
        "pool_rows_per_layer": stats.pop("pool_rows_per_layer"),
        "experts_per_layer": stats.pop("experts_per_layer"),
        "reader": stats.get("reader"),
        "policy": args.policy,
        "predictor": args.predictor,
        "lookahead_extra": args.lookahead_extra,
        # "queued": one step queued per token, misses served inside the stream (the default);
        # "whole": queued from row snapshots and checked after; "per-layer": each MoE layer's
        # routed ids back on the host before its experts are served
        "mode": args.mode,
        "decode_steps": max(kinds, key=lambda k: kinds[k]) if counters["forwards"] else "none",
        "forward": {k: counters[k] for k in
                    ("forwards", "queued", "per_layer", "fallbacks", "speculated", "speculation_misses",
                     "optimistic", "optimistic_redone")},
        "faults_per_step": stats.get("faults", 0) / decode_steps,
        "fault_latency_p50_ms": fault_latency["p50_s"] * 1e3,
        "fault_latency_p99_ms": fault_latency["p99_s"] * 1e3,
        "direct": bool(args.direct),
        "routing": None if replay is None else {"file": str(args.routing), "tokens": replay.n_tokens,
                                                "meta": replay.trace.meta},
        "tokens_identical": identical,
        "audit_clean": audit_ok,
        "streaming": run_f,
        "all_resident": ref_f,
        "speed_ratio": run_f["tokens_per_s"] / ref_f["tokens_per_s"] if ref_f["tokens_per_s"] else 0.0,
        "decode_speed_ratio": (run_f["decode_tokens_per_s"] / ref_f["decode_tokens_per_s"]
                               if ref_f["decode_tokens_per_s"] else 0.0),
        "hit_rate": stats["hit_rate"],
        "bytes_read": int(stats["bytes_read"]),
        "resident_bytes": int(stats.get("resident_bytes", 0)),
        "stall_time_s": stats["stall_time_s"],
        "loop_lag": stats.pop("loop_lag"),
        "runtime": {k: v for k, v in stats.items()},
        "text": sm.tokenizer.decode(run.tokens),
        "reference_text": sm.tokenizer.decode(ref.tokens),
    }
    return result


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s, r = result["streaming"], result["all_resident"]
    table = Table(title=(f"asyncside demo — {result['model']}, {result['resident_fraction']:.0%} of experts "
                         f"in pools ({result['pool_rows_per_layer']}/{result['experts_per_layer']} rows per layer)"))
    table.add_column("")
    table.add_column("streaming (asyncside)", justify="right")
    table.add_column("all-resident (mlx-lm)", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row("tokens/s (whole run)", f"{s['tokens_per_s']:.2f}", f"{r['tokens_per_s']:.2f}",
                  f"{result['speed_ratio']:.3f}x")
    table.add_row("decode tokens/s", f"{s['decode_tokens_per_s']:.2f}", f"{r['decode_tokens_per_s']:.2f}",
                  f"{result['decode_speed_ratio']:.3f}x")
    table.add_row("time to first token", f"{s['ttft_s'] * 1e3:.0f} ms", f"{r['ttft_s'] * 1e3:.0f} ms", "")
    table.add_row("tokens", str(s["tokens"]), str(r["tokens"]), "")
    rt = result["runtime"]
    table.add_row("hit rate (demand)", f"{result['hit_rate']:.1%}", "100%", "")
    table.add_row("bytes read while generating", f"{result['bytes_read'] / 1e6:.1f} MB", "0", "")
    table.add_row("fills / evictions", f"{int(rt['fills'])} / {int(rt['evictions'])}", "", "")
    table.add_row("stall time (awaiting reads)", f"{result['stall_time_s'] * 1e3:.1f} ms", "0", "")
    mem = result["memory"]
    table.add_row("pools / memory available at start",
                  f"{mem['pool_bytes'] / 2**20:.0f} MiB / {mem['available_bytes'] / 2**30:.1f} GiB", "", "")
    table.add_row("faults per token, p50 / p99 fault time",
                  f"{result['faults_per_step']:.2f}, {result['fault_latency_p50_ms']:.2f} / "
                  f"{result['fault_latency_p99_ms']:.2f} ms", "", "")
    lag = result["loop_lag"]
    table.add_row("event-loop lag, max / p99 (5 ms ticker)", f"{lag['max_ms']:.1f} / {lag['p99_ms']:.1f} ms", "", "")
    table.add_row("reader / policy / predictor",
                  f"{result['reader']} / {result['policy']} / {result['predictor']}"
                  + (f"+{result['lookahead_extra']}" if result["lookahead_extra"] else "")
                  + f" / {result['decode_steps']} steps"
                  + (" / O_DIRECT" if result["direct"] else ""), "", "")
    table.add_row("tokens identical", "yes" if result["tokens_identical"] else "NO", "", "")
    table.add_row("ledger audit", "clean" if result["audit_clean"] else "FAILED", "", "")
    Console(stderr=False).print(table)


def demo_main(args: argparse.Namespace) -> int:
    """Run the demo; 0 when tokens are identical and every ledger audits clean, else 1."""
    if args.ranks != 1:
        from .distributed.demo import ranks_demo_main

        return ranks_demo_main(args)
    from .errors import AsyncsideError

    try:
        result = run_demo(args)
    except AsyncsideError as exc:  # e.g. pools that cannot fit the memory available: say so, no traceback
        print(f"asyncside demo: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _table(result)
        if not result["tokens_identical"]:
            print("asyncside demo: tokens differ from the all-resident run:\n"
                  f"  streaming:    {result['text']!r}\n  all-resident: {result['reference_text']!r}",
                  file=sys.stderr)
    return 0 if result["tokens_identical"] and result["audit_clean"] else 1


if __name__ == "__main__":  # pragma: no cover - `python -m asyncside.demo`
    from .cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
