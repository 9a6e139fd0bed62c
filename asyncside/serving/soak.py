"""A soak of `asyncside serve`: many clients for a long time, the server's RSS sampled throughout.

``python -m asyncside.serving.soak --duration 3600 --clients 32`` starts ``asyncside serve`` (the
embedded model unless ``--model``) as a child process on 127.0.0.1, runs ``--clients`` clients
against it for ``--duration`` seconds, and prints one JSON object: the server's RSS over time,
the requests by outcome, and ``growth``: the relative change of the mean RSS from the second
quarter of the sampled run to the last (warm-up is the first quarter, after ``--warmup``
seconds of load that are not sampled). Exit status 1 when ``growth``
exceeds ``--max-growth``.

The clients mix what servers meet: completions and chat, streamed or not, greedy and sampled
(seeded, top-p, penalties), stop sequences, log-probabilities, prompts of several lengths sharing
prefixes (the prompt cache); a third of them disconnect in the middle of a stream.

``--shutdown STREAMS`` measures a graceful shutdown instead: STREAMS streams in flight, SIGTERM,
how each stream ended and how long the server took to exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio

try:
    import httpx
except ImportError:  # the bench extra's: main() says so in one line
    httpx = None  # type: ignore[assignment]

from ..errors import MissingExtraError

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "Write a short poem about the sea. The sea is",
    "List three colors: red, green,",
    "In 1905, a physicist published four papers that changed how we think about space, time and matter. "
    "The first of them explained",
]


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def request_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    """One random request: (path, JSON body)."""
    prompt = rng.choice(PROMPTS) + rng.choice(["", " and then", " because", f" #{rng.randrange(1000)}"])
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(4, 24), "stream": rng.random() < 0.6}
    if rng.random() < 0.5:
        body["temperature"] = 0.7
        body["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.5:
            body["top_p"] = 0.9
        if rng.random() < 0.3:
            body["repetition_penalty"] = 1.1
    if rng.random() < 0.2:
        body["stop"] = ["\n", "."]
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 2
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    if rng.random() < 0.2:
        body["logprobs"] = 2
    return "/v1/completions", body


async def client(url: str, model: str, seed: int, leaves: bool, until: float, counts: dict[str, int]) -> None:
    """One client: requests back to back until ``until``; ``leaves``: it drops streams midway."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < until:
            path, body = request_body(rng, model)
            try:
                if body["stream"]:
                    async with http.stream("POST", path, json=body) as r:
                        chunks = 0
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                chunks += 1
                                if leaves and chunks >= 3 and rng.random() < 0.5:
                                    break  # leaving the block closes the connection mid-stream
                        kind = f"stream_{r.status_code}" if chunks < 3 or not leaves else "stream_left_or_done"
                else:
                    r = await http.post(path, json=body)
                    kind = f"whole_{r.status_code}"
            except httpx.HTTPError as exc:
                kind = f"error_{type(exc).__name__}"
            counts[kind] = counts.get(kind, 0) + 1


async def soak(url: str, pid: int, clients: int, duration: float, sample_every: float,
               warmup: float = 0.0) -> dict[str, Any]:
    """Run the clients for ``warmup + duration`` seconds; RSS is sampled over the last ``duration``."""
    async with httpx.AsyncClient(base_url=url) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
    counts: dict[str, int] = {}
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    until = time.monotonic() + warmup + duration

    async def sampler() -> None:
        await anyio.sleep(warmup)
        nonlocal start
        start = time.monotonic()
        while time.monotonic() < until:
            samples.append((round(time.monotonic() - start, 1), rss_bytes(pid)))
            print(f"{samples[-1][0]:8.1f} s  RSS {samples[-1][1] / 2**20:7.1f} MiB  {sum(counts.values())} requests",
                  file=sys.stderr, flush=True)
            await anyio.sleep(sample_every)

    # At the end every client leaves at once, requests in flight included (as disconnects).
    with anyio.move_on_after(warmup + duration):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            for i in range(clients):
                tg.start_soon(client, url, model, i, i % 3 == 0, until, counts)
    samples.append((round(time.monotonic() - start, 1), rss_bytes(pid)))
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        metrics = (await http.get("/metrics")).text
    bounds = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith(("asyncside_prompt_cache", "asyncside_mlx_", "asyncside_staging"))}
    return {"samples": samples, "requests": counts, "growth": growth(samples), "bounds": bounds}


def quarter_means(samples: list[tuple[float, int]]) -> tuple[float, float]:
    """The mean RSS of the run's second quarter and of its last."""
    end = samples[-1][0]
    q2 = [r for t, r in samples if end / 4 <= t < end / 2]
    q4 = [r for t, r in samples if t >= 3 * end / 4]
    if not q2 or not q4:
        raise ValueError("too few RSS samples for quarters: sample more often or run longer")
    return sum(q2) / len(q2), sum(q4) / len(q4)


def growth(samples: list[tuple[float, int]]) -> float:
    """Relative change of the mean RSS from the second quarter of the run to the last."""
    second, last = quarter_means(samples)
    return last / second - 1.0


def start_server(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``asyncside serve`` as a child process on a free loopback port; returns it and its URL."""
    cmd = [sys.executable, "-m", "asyncside", "serve", "--host", "127.0.0.1", "--port", "0", "--no-access-log",
           *extra]
    log = tempfile.TemporaryFile("w+")  # the server's stderr, read back by the shutdown check
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.stderr_log = log  # type: ignore[attr-defined]
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("asyncside serve: http://"):
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, line.split()[2]


async def shutdown_timing(url: str, proc: subprocess.Popen[str], streams: int, max_tokens: int) -> dict[str, Any]:
    """Start ``streams`` streams, SIGTERM the server once each sent a chunk; how each ended and
    how long the server took to exit."""
    async with httpx.AsyncClient(base_url=url) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
    ends: list[str] = []
    started = 0
    all_started = anyio.Event()

    async def one(i: int) -> None:
        nonlocal started
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True}
        last, counted = "", False
        async with httpx.AsyncClient(base_url=url, timeout=300) as http, \
                http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if not counted:
                    counted, started = True, started + 1
                    if started == streams:
                        all_started.set()
                data = line[len("data: "):]
                if data == "[DONE]":
                    ends.append("finished" if '"finish_reason":"' in last else "error event, then [DONE]"
                                if '"error"' in last else "[DONE] after " + last[:60])
                    return
                last = data
        ends.append("cut without [DONE]")

    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i)
        await all_started.wait()
        t0 = time.monotonic()
        proc.terminate()
    status = await anyio.to_thread.run_sync(proc.wait)
    took = round(time.monotonic() - t0, 2)
    log = proc.stderr_log  # type: ignore[attr-defined]
    log.seek(0)
    text = log.read()
    return {"exit_status": status, "exit_after_s": took, "streams": {e: ends.count(e) for e in sorted(set(ends))},
            "tracebacks_in_log": text.count("Traceback"), "log_lines": len(text.splitlines())}


def main(argv: list[str] | None = None) -> int:
    # (__doc__ is None under python -OO, which strips docstrings)
    p = argparse.ArgumentParser(prog="python -m asyncside.serving.soak",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--shutdown", type=int, default=0, metavar="STREAMS",
                   help="instead of a soak: start STREAMS streams of --shutdown-tokens tokens, SIGTERM the "
                        "server, report how each stream ended and when the server exited")
    p.add_argument("--shutdown-tokens", type=int, default=200)
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of load (default 3600)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of load before sampling starts (default 0: the first quarter is the warm-up)")
    p.add_argument("--max-growth", type=float, default=0.05,
                   help="largest RSS growth from the second quarter to the last (default 0.05)")
    p.add_argument("serve_args", nargs="*", help="more `asyncside serve` options (after --)")
    args = p.parse_args(argv)
    if httpx is None:
        # Imported at the top, without it the soak ended in a ModuleNotFoundError's traceback.
        print(MissingExtraError("httpx", "bench", p.prog), file=sys.stderr)
        return 1
    proc, url = start_server(args.serve_args)
    if args.shutdown:
        try:
            result = anyio.run(shutdown_timing, url, proc, args.shutdown, args.shutdown_tokens)
        finally:
            if proc.poll() is None:
                proc.kill()
        print(json.dumps(result))
        return 0 if result["exit_status"] == 0 else 1
    try:
        out = anyio.run(soak, url, proc.pid, args.clients, args.duration, args.sample_every, args.warmup)
    finally:
        proc.terminate()
        proc.wait(60)
    out["server_exit"] = proc.returncode
    print(json.dumps(out))
    return 0 if out["growth"] <= args.max_growth else 1


if __name__ == "__main__":
    sys.exit(main())
