"""`asyncside bench serve`: N concurrent streaming clients against the server, for a bounded time.

One run measures, side by side:

- ``direct``: the same model, runtime and generation service, driven without HTTP (one
  generation at a time on the server's loop): the single-stream decode rate. With per-step turns
  and no cross-request batching this is the physical ceiling of the server's aggregate rate.
- ``http x1``: one streaming HTTP client (the cost of HTTP + SSE over ``direct``).
- ``http xN``: N concurrent streaming clients (fair sharing; aggregate vs ``direct``).

Each HTTP phase runs for ``--duration`` seconds: every client issues streaming completions back
to back; at the deadline in-flight requests are cancelled (the server sees disconnects) and only
tokens received before the deadline count. Time to first token is measured by the client, from
sending the request to the first content chunk. RSS (VmRSS of this process, which hosts the
server) is read before the model is loaded, once the server is idle, and after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .machine import machine_info

DEFAULT_PROMPT = "Once upon a time"


def read_rss_bytes(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, from /proc (Linux); empty elsewhere."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value, unit = line.split()
                    assert unit == "kB"
                    out[key.rstrip(":")] = int(value) * 1024
    except OSError:
        pass
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))
    return ordered[k]


@dataclass
class PhaseResult:
    name: str
    clients: int
    seconds: float
    requests_done: int = 0       # completed before the deadline
    requests_cut: int = 0        # cancelled at the deadline
    tokens: int = 0              # tokens received before the deadline
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "clients": self.clients,
            "seconds": round(self.seconds, 3),
            "requests_done": self.requests_done,
            "requests_cut": self.requests_cut,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p99_s": percentile(self.ttft, 99),
            "ttft_n": len(self.ttft),
            "errors": self.errors[:5],
            "error_count": len(self.errors),
        }


async def _stream_once(client: Any, url: str, body: dict[str, Any], result: PhaseResult, t0: float) -> None:
    """One streaming completion; the server sends one chunk per generated token."""
    first = True
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            result.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                result.requests_done += 1
                return
            payload = json.loads(data)
            if "error" in payload:
                result.errors.append(str(payload["error"].get("message")))
                return
            if payload.get("usage"):
                continue
            choice = payload["choices"][0]
            if choice.get("finish_reason") is not None:
                continue
            if first:
                result.ttft.append(time.perf_counter() - t0)
                first = False
            result.tokens += 1


async def run_http_phase(base_url: str, model: str, clients: int, seconds: float, max_tokens: int,
                         prompt: str) -> PhaseResult:
    """``clients`` concurrent streaming clients issuing requests back to back for ``seconds``."""
    import httpx

    result = PhaseResult(f"http x{clients}", clients, seconds)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)

    async def client_loop(client: Any) -> None:
        while True:
            t0 = time.perf_counter()
            task = asyncio.ensure_future(_stream_once(client, url, body, result, t0))
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                task.cancel()
                result.requests_cut += 1
                raise

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(client_loop(client)) for _ in range(clients)]
        done, _ = await asyncio.wait(tasks, timeout=seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        result.seconds = time.perf_counter() - start
        for t in done:  # a client loop only ends early by an exception
            if not t.cancelled() and t.exception() is not None:
                result.errors.append(repr(t.exception()))
    # Tokens that arrived after the deadline (while cancelling) are few; count by deadline anyway.
    result.seconds = max(result.seconds, seconds)
    return result


async def run_direct_phase(batcher: Any, seconds: float, max_tokens: int, prompt: str) -> PhaseResult:
    """One generation at a time through the engine, no HTTP; runs on the server loop."""
    import anyio

    result = PhaseResult("direct", 1, seconds)
    ids = list(batcher.tokenizer.encode(prompt))
    start = time.perf_counter()
    deadline = start + seconds
    with anyio.move_on_after(seconds):
        while True:
            t0 = time.perf_counter()
            first, complete = True, False
            gen = batcher.submit(ids, max_tokens)
            try:
                async for _ in gen:
                    if time.perf_counter() > deadline:
                        break
                    if first:
                        result.ttft.append(time.perf_counter() - t0)
                        first = False
                    result.tokens += 1
                else:
                    complete = True
            finally:
                if complete:
                    result.requests_done += 1
                else:
                    result.requests_cut += 1
                gen.cancel()
    result.seconds = max(time.perf_counter() - start, seconds)
    return result


def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``asyncside bench serve`` (the model options are the server's)."""
    from ..serving.cli import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default 4)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase (default 10)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of every request")
    try:
        parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    except argparse.ArgumentError:
        pass  # the CLI already gives every bench a --json


def run_serve_bench(args: argparse.Namespace, *, engine_factory: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Run the three phases and return the results (printed as a table unless ``args.json``)."""
    from ..serving import BackgroundServer, ServeSettings, create_app, engine_factory_from_args

    for name in ("clients", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.duration > 0:
        raise SystemExit(f"--duration must be positive, got {args.duration}")

    rss_before = read_rss_bytes()
    factory = engine_factory or engine_factory_from_args(args)
    settings = ServeSettings(max_tokens_limit=max(512, args.max_tokens))
    app = create_app(factory, settings)
    with BackgroundServer(app) as srv:
        state = app.state.asyncside
        rss_idle = read_rss_bytes()
        model_id = state.model_id
        direct = srv.call(lambda: run_direct_phase(state.batcher, args.duration, args.max_tokens, args.prompt),
                          timeout=args.duration + 120)
        import uvloop

        one = uvloop.run(run_http_phase(srv.url, model_id, 1, args.duration, args.max_tokens, args.prompt))
        many = uvloop.run(run_http_phase(srv.url, model_id, args.clients, args.duration, args.max_tokens,
                                         args.prompt))
        health = srv.call(_health_of(state))
        runtime_stats = srv.call(_stats_of(state))
        engine = dict(state.engine.description)
    rss_after = read_rss_bytes()

    phases = [direct.summary(), one.summary(), many.summary()]
    base = phases[0]["tokens_per_s"] or float("nan")
    for p in phases:
        p["vs_direct"] = p["tokens_per_s"] / base if base == base and base > 0 else None
    out = {
        "bench": "serve",
        "model": model_id,
        "engine": engine,
        "clients": args.clients,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "phases": phases,
        "rss_bytes": {"before_load": rss_before.get("VmRSS"), "server_idle": rss_idle.get("VmRSS"),
                      "after_load": rss_after.get("VmRSS"), "peak": rss_after.get("VmHWM")},
        "audit_ok_after": health[0],
        "audit_problems": health[1],
        "runtime_stats": runtime_stats,
        "machine": machine_info(),
    }
    if not getattr(args, "json", False):  # with --json the CLI prints the returned dict
        print_table(out)
    return out


def _health_of(state: Any) -> Callable[[], Any]:
    async def get() -> tuple[bool, list[str]]:
        audit = state.engine.audit
        return audit() if audit else (True, [])

    return get


def _stats_of(state: Any) -> Callable[[], Any]:
    async def get() -> Any:
        stats = state.engine.stats
        return json.loads(json.dumps(stats(), default=str)) if stats else {}

    return get


def print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    table = Table(title=f"asyncside bench serve: {out['model']}, {out['max_tokens']} tokens/request, "
                        f"{out['duration_s']:g}s per phase")
    for col in ("phase", "clients", "requests", "tokens", "tok/s", "vs direct", "TTFT p50 ms", "TTFT p99 ms", "errors"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for p in out["phases"]:
        table.add_row(
            p["name"], str(p["clients"]), f"{p['requests_done']} +{p['requests_cut']} cut", str(p["tokens"]),
            f"{p['tokens_per_s']:.1f}", "-" if p["vs_direct"] is None else f"{p['vs_direct']:.2f}x",
            ms(p["ttft_p50_s"]), ms(p["ttft_p99_s"]), str(p["error_count"]),
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    rss = out["rss_bytes"]

    def mib(v: int | None) -> str:
        return "-" if v is None else f"{v / 2**20:.0f} MiB"

    console.print(
        f"RSS: before load {mib(rss['before_load'])}, idle server {mib(rss['server_idle'])}, "
        f"after load {mib(rss['after_load'])}, peak {mib(rss['peak'])}; "
        f"ledger audit after: {'clean' if out['audit_ok_after'] else out['audit_problems']}"
    )
