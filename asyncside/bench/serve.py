"""`asyncside bench serve`: concurrent streaming clients against `asyncside serve` and, in the same run
on the same model, against ``mlx_lm.server`` (every expert resident, its batching on).

For each server and each client count (``--clients``, default 1, 8 and 32) one phase runs for
``--duration`` seconds: every client issues streaming completions back to back, its prompts cycling
through ``--prompt-lengths`` (tokens); in the phase with the most clients (or those of
``--long-prompt-clients``) client 0 first sends one ``--long-prompt``-token prompt, so the others share the
server with a long prefill. Both servers run at once and their phases alternate (asyncside's then
mlx_lm.server's at each client count, the long-prompt phase last, so no other phase shares a server
still busy with it): a ratio compares two phases minutes apart, not two halves of a run on a host
whose speed drifts. Every prompt starts with the request's own number, so no two requests share a
cacheable prefix. At the deadline the requests still running are cancelled (the servers see
disconnects); tokens received before it count. A client refused with 429 (more clients than
``--max-batch`` and ``--max-queue`` take) waits the ``Retry-After`` it was given before its next
request, as OpenAI's clients do; refusals are counted apart (``requests_refused``), not as errors.
Each phase follows ``--warmup`` seconds of the same load, not measured (repeated until a request
has completed: a server still on its first request is not warm), and the next phase starts only once
the server is idle again (asyncside's engine has no request left; mlx_lm.server, which finishes the
requests of clients that left, has stopped using the CPU).

Reported per phase: aggregate tokens/s (all tokens / phase time), per-stream tokens/s (median over
requests of (tokens - 1) / (last - first token time)), time to first token and inter-token latency
(p50 / p99, measured by the client, over the short-prompt requests; the long prompt's time to first
token is reported alone), and each asyncside phase's aggregate over mlx_lm.server's with the same
clients. Both servers decode greedily with ``max_tokens`` tokens per request. RSS of this process
(which hosts the asyncside server) is read before the model is loaded, with the server idle, and at
the end; the ledgers must audit clean at the end.

Under a memory budget (``--memory SIZE``, the Runtime's, with ``--resident auto`` sizing the pools
to it) and a routing trace every request replays (``--routing FILE``; request n replays the trace's
sequence n mod S, docs/routing-traces.md) each asyncside phase also reports its hit rate, the bytes
the process read from the disk per token (``/proc/self/io``), the misses' bytes per token, and the
peak RSS over the phase (VmHWM, reset before it where the kernel allows, else since start). Client
counts may repeat (``--clients 1,8,1,8``: two rounds); each phase's ``vs_round_single`` is its
aggregate over the latest one-client phase of the same server before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..argtypes import int_at_least, nonnegative_float, positive_float, positive_ints
from ..errors import AsyncsideError
from ..memory import describe_bytes
from . import require_extra
from .machine import machine_info

#: the long prompt's tokens when ``--long-prompt`` is not given (fewer where the model's context is shorter)
LONG_PROMPT = 2000
PASSAGE = ("The quick brown fox jumps over the lazy dog while experts stream in from the disk; "
           "a Mixture-of-Experts model routes every token to a few experts out of many. ")


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


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: ``/proc/self/clear_refs``); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))
    return ordered[k]


@dataclass
class RequestRecord:
    """One streamed request as the client saw it."""

    long: bool
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    done: bool = False
    error: str | None = None
    #: seconds the server said to wait (its ``Retry-After``) when it refused the request with 429
    refused: float | None = None

    def chunk(self, at: float, n: int = 1) -> None:
        self.token_times.append(at)
        self.tokens += n


@dataclass
class PhaseResult:
    server: str
    clients: int
    seconds: float
    records: list[RequestRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        short = [r for r in self.records if not r.long]
        long = [r for r in self.records if r.long]
        ttft = [r.token_times[0] - r.sent for r in short if r.token_times]
        gaps = [b - a for r in short for a, b in zip(r.token_times, r.token_times[1:])]
        rates = [(len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])
                 for r in self.records if len(r.token_times) >= 2 and r.token_times[-1] > r.token_times[0]]
        tokens = sum(r.tokens for r in self.records)
        errors = self.errors + [r.error for r in self.records if r.error]
        refused = sum(1 for r in self.records if r.refused is not None)
        return {
            "server": self.server,
            "clients": self.clients,
            "seconds": round(self.seconds, 3),
            "requests_done": sum(1 for r in self.records if r.done),
            "requests_cut": sum(1 for r in self.records if not r.done and not r.error and r.refused is None),
            "requests_refused": refused,
            "tokens": tokens,
            "tokens_per_s": tokens / self.seconds if self.seconds > 0 else 0.0,
            "per_stream_tokens_per_s_p50": percentile(rates, 50),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "ttft_n": len(ttft),
            "itl_p50_s": percentile(gaps, 50),
            "itl_p99_s": percentile(gaps, 99),
            "long_prompt_ttft_s": (long[0].token_times[0] - long[0].sent) if long and long[0].token_times else None,
            "long_prompt_sent": bool(long),
            "errors": errors[:5],
            "error_count": len(errors),
        }


def prompt_of(tokenizer: Any, n_tokens: int, number: int) -> str:
    """A prompt of about ``n_tokens`` tokens starting with the request's own number."""
    head = f"#{number}: "
    reps = 1 + n_tokens // max(1, len(tokenizer.encode(PASSAGE)))
    ids = list(tokenizer.encode(head + PASSAGE * reps))
    return str(tokenizer.decode(ids[:n_tokens]))


def _retry_after(value: str | None) -> float:
    """Seconds a 429's ``Retry-After`` asks for (delta-seconds; one second where it is missing or
    not a number, the least the server ever says)."""
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        return 1.0
    return seconds if math.isfinite(seconds) and seconds > 0 else 1.0


async def _stream_once(client: Any, url: str, body: dict[str, Any], rec: RequestRecord) -> None:
    """One streaming completion; content chunks are timed, the final usage gives the token count."""
    rec.sent = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code == 429:  # the queue is full: the client waits as told, as OpenAI's clients do
            await resp.aread()
            rec.refused = _retry_after(resp.headers.get("retry-after"))
            return
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                rec.done = True
                return
            payload = json.loads(data)
            if "error" in payload:
                rec.error = str(payload["error"].get("message") if isinstance(payload["error"], dict)
                                else payload["error"])
                return
            usage = payload.get("usage")
            choices = payload.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                rec.chunk(time.perf_counter())
            if usage and usage.get("completion_tokens") is not None:
                # A server may send several tokens in one chunk: the usage has the true count.
                rec.tokens = int(usage["completion_tokens"])


async def run_phase(server: str, base_url: str, model: str, clients: int, seconds: float, max_tokens: int,
                    prompts: Callable[[int, int], tuple[str, bool]]) -> PhaseResult:
    """``clients`` streaming clients issuing requests back to back for ``seconds``.

    ``prompts(client, n)`` gives client ``client``'s ``n``-th prompt and whether it is the long one.
    """
    httpx = require_extra("httpx", "asyncside bench serve")
    result = PhaseResult(server, clients, seconds)
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)

    async def client_loop(http: Any, c: int) -> None:
        n = 0
        while True:
            prompt, long = prompts(c, n)
            n += 1
            rec = RequestRecord(long)
            result.records.append(rec)
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            await _stream_once(http, url, body, rec)
            if rec.refused is not None:
                # Asking again at once would have the phase measure a flood of refusals, answered by
                # the server this process hosts, instead of the requests it serves.
                await asyncio.sleep(rec.refused)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as http:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(client_loop(http, c)) for c in range(clients)]
        for t in tasks:
            t.add_done_callback(_retrieved)
        done, _ = await asyncio.wait(tasks, timeout=seconds)
        # The tokens counted are those received until now: the clients' teardown after it (hundreds
        # of streams take seconds to close in httpx's pool) is no part of the phase.
        result.seconds = max(time.perf_counter() - start, seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:  # a client loop only ends early by an exception
            if not t.cancelled() and t.exception() is not None:
                result.errors.append(repr(t.exception()))
    return result


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a finished client's exception as seen: a signal's SystemExit or KeyboardInterrupt (the
    handlers of ``asyncside.cli``) raised inside a client's task ends the run, which says so itself,
    and asyncio would otherwise print the task's traceback as never retrieved."""
    if not task.cancelled():
        task.exception()


def warm_up(server: str, base_url: str, model: str, clients: int, seconds: float, max_tokens: int,
            prompts: Callable[[int, int], tuple[str, bool]], *, limit: float = 120.0) -> int:
    """Run ``seconds`` of the phase's load, untimed, again until some request completed (at most
    ``limit`` seconds in all): on a busy machine, or on a GPU compiling kernels for a new shape, a
    server's first requests can take longer than the warm-up, and the timed phase would then
    measure the warm-up's work. Each round that completed nothing is followed by one twice as
    long: a request that takes longer than a round (a long prompt's prefill on a slow CPU) was cut
    at every round of a fixed length, and the warm-up ran until its limit (then the server still
    owed the cut requests' work). Returns how many warm-up rounds ran."""
    import uvloop

    started, rounds = time.perf_counter(), 0
    while True:
        length = seconds * 2**rounds
        rounds += 1
        res = uvloop.run(run_phase(server, base_url, model, clients, length, max_tokens, prompts))
        if any(r.done for r in res.records) or time.perf_counter() - started >= limit:
            return rounds


def wait_quiet(pid: int, *, busy: float = 0.2, interval: float = 0.5, timeout: float = 120.0) -> float:
    """Wait until process ``pid`` uses less than ``busy`` of one core over ``interval`` (at most
    ``timeout`` seconds); returns the wait.

    mlx_lm.server finishes the requests whose clients left: at the end of a phase (or of its
    warm-up) it still owes their tokens, and the next phase would be measured against that
    backlog. Its CPU time says when it is done (it idles at ~0% between requests).
    """
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    start = time.perf_counter()
    last = cpu()
    while time.perf_counter() - start < timeout:
        time.sleep(interval)
        now = cpu()
        if now - last < busy * interval:
            break
        last = now
    return time.perf_counter() - start


def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``asyncside bench serve`` (the model and engine options are the server's)."""
    from ..serving.cli import add_engine_arguments, add_model_arguments

    add_model_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(resident=0.5)
    parser.add_argument("--clients", type=positive_ints, default=[1, 8, 32],
                        help="client counts, one phase each (default 1,8,32)")
    parser.add_argument("--duration", type=positive_float, default=60.0, help="seconds per phase (default 60)")
    parser.add_argument("--warmup", type=nonnegative_float, default=10.0,
                        help="seconds of the same load before each phase, not measured (default 10; 0: none), "
                             "repeated until a request has completed. A GPU compiles kernels for each new shape "
                             "on first use, and MLX keeps them on disk: without a warm-up the server run first "
                             "pays for both")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=32, help="tokens per request (default 32)")
    parser.add_argument("--prompt-lengths", type=positive_ints, default=[8, 32, 128],
                        help="prompt lengths in tokens that each client cycles through (default 8,32,128)")
    parser.add_argument("--long-prompt", type=int_at_least(0), default=None,
                        help=f"tokens of the one long prompt client 0 sends first (default {LONG_PROMPT}, or as "
                             f"many as the model's context leaves beside --max-tokens where that is fewer; 0: none)")
    parser.add_argument("--long-prompt-clients", type=positive_ints, default=None, metavar="N,...",
                        help="the phases (client counts) that include the long prompt (default: the largest "
                             "client count, when it is more than 1)")
    parser.add_argument("--no-mlx-lm", dest="mlx_lm", action="store_false",
                        help="skip the mlx_lm.server phases")
    parser.add_argument("--mlx-lm-model", metavar="DIR", default=None,
                        help="the mlx-lm model directory for mlx_lm.server (default: the embedded model's)")
    try:
        parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    except argparse.ArgumentError:
        pass  # the CLI already gives every bench a --json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: What mlx_lm.server logs when its model did not load: the thread that loads it, then generates, died;
#: the process lives on and its /health answers 503 for good.
LOAD_FAILED = "mlx_lm.server generation thread died:"


#: the request that tells mlx_lm.server serves (its /health does not wait for its model), and how
#: long one try of it may take before the log is read again
READY_PROBE: dict[str, Any] = {"prompt": "ready", "max_tokens": 1, "temperature": 0.0}
READY_PROBE_S = 10.0


class MlxLmServerError(AsyncsideError):
    """mlx_lm.server did not come up for ``model_dir``: ``error`` is its own error line (the
    exception that ended its model's load, or the last line it printed before it exited)."""

    def __init__(self, model_dir: str, error: str, log: pathlib.Path) -> None:
        super().__init__(f"mlx_lm.server could not serve {model_dir}: {error} (its log: {log})")
        self.model_dir, self.error, self.log = model_dir, error, log


def load_error(log_text: str) -> str | None:
    """The error line in mlx_lm.server's log ``log_text`` where its model did not load
    (``FileNotFoundError: No safetensors found in DIR``), None where it logged no such failure."""
    lines = log_text.splitlines()
    at = next((i for i in reversed(range(len(lines))) if LOAD_FAILED in lines[i]), None)
    if at is None:
        return None
    message = lines[at].split(LOAD_FAILED, 1)[1].strip()
    # The traceback follows: its exception's line is "Type: message", after its cause's where one is chained.
    return next((line for line in lines[at + 1:] if not line[:1].isspace() and line.endswith(f": {message}")),
                message or lines[at].strip())


def _last_line(log_text: str) -> str:
    return next((line.strip() for line in reversed(log_text.splitlines()) if line.strip()), "it printed nothing")


def _interrupted(exc_type: type[BaseException]) -> bool:
    """Whether an exception is the user stopping the run: Ctrl-C, or SIGTERM and SIGHUP as
    ``asyncside.cli.main`` raises them (SystemExit)."""
    return issubclass(exc_type, (KeyboardInterrupt, SystemExit))


class MlxLmServer:
    """``python -m mlx_lm.server`` on a free port, as a child process; its output goes to a log in
    $TMPDIR, removed when it is stopped unless it says why the server failed."""

    def __init__(self, model_dir: str, *, startup_timeout: float = 600.0) -> None:
        self.model_dir = model_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"asyncside-bench-mlx-lm-{self.port}.log"

    def __enter__(self) -> MlxLmServer:
        """Start the server and wait until it answers a one-token completion (its model loaded);
        :class:`MlxLmServerError` (the server
        stopped) as soon as it exits, logs that its model did not load, or the startup timeout passes."""
        httpx = require_extra("httpx", "asyncside bench serve")
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlx_lm.server", "--model", self.model_dir, "--host", "127.0.0.1",
                 "--port", str(self.port), "--log-level", "WARNING", "--temp", "0.0"],
                stdout=fh, stderr=subprocess.STDOUT)
        try:
            return self._wait_ready(httpx)
        except BaseException as exc:
            # Interrupted while it loads (Ctrl-C, SIGTERM): no __exit__ runs for a context not entered.
            self._stop()
            if _interrupted(type(exc)):
                self.log.unlink(missing_ok=True)
            raise

    def _wait_ready(self, httpx: Any) -> MlxLmServer:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            # Read before polling: a server that logged its failure and then exited is told by its log.
            failed = load_error(self._log_text())
            if failed is None and self.proc.poll() is not None:
                failed = f"it exited with status {self.proc.returncode}: {_last_line(self._log_text())}"
            if failed is None and time.monotonic() > deadline:
                failed = f"it did not answer within {self.startup_timeout:g}s"
            if failed is not None:
                self._stop()
                raise MlxLmServerError(self.model_dir, failed, self.log)
            try:
                # mlx_lm.server loads its model in its generation thread and answers /health with
                # 200 while that thread lives, loading included: a request answered is the sign it
                # serves. Without it the first clients' requests would wait for the load, timed.
                if (httpx.get(self.url + "/health", timeout=2).status_code == 200
                        and httpx.post(self.url + "/v1/completions", timeout=READY_PROBE_S,
                                       json=READY_PROBE).status_code == 200):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def _log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is started by entering the context"
        return self.proc.pid

    def rss(self) -> dict[str, int]:
        return read_rss_bytes(self.proc.pid) if self.proc is not None else {}

    def __exit__(self, exc_type: type[BaseException] | None = None, *exc: object) -> None:
        """Stop the server; its log is removed unless the block ended in an error (the log is then
        what says why). A server that never came up keeps its log: the error names it. A run the
        user interrupted (Ctrl-C, SIGTERM, SIGHUP) removes it: it says only that the server was
        stopped."""
        self._stop()
        if exc_type is None or _interrupted(exc_type):
            self.log.unlink(missing_ok=True)

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _check(args: argparse.Namespace) -> None:
    """What the options' argparse types cannot check, before a server starts (a combination of
    options, the trace file's contents): a ValueError leading with the option (the command line's
    usage error, exit status 2) for a bad one. The ``--routing`` trace is read once, into
    ``args.routing_trace``, which the engine replays (a pipe such as ``<(...)`` reads once)."""
    from ..serving.cli import predictor_routing_problem

    if getattr(args, "routing", None) is not None and getattr(args, "routing_trace", None) is None:
        from ..routing import RoutingTrace

        args.routing_trace = RoutingTrace.load(args.routing)
    problem = predictor_routing_problem(args)  # what `asyncside serve` refuses at start, refused here too
    if problem is not None:
        raise ValueError(problem)
    model_dir = getattr(args, "mlx_lm_model", None)
    if getattr(args, "mlx_lm", False) and model_dir is not None:
        # mlx_lm.server starts without its model and answers 503 until it loads: a directory it
        # cannot load would keep the bench waiting for its startup timeout, saying nothing.
        if not os.path.isdir(model_dir):
            raise ValueError(f"--mlx-lm-model {model_dir}: no such directory (an mlx-lm model directory; --no-mlx-lm "
                             "skips mlx_lm.server)")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ValueError(f"--mlx-lm-model {model_dir}: no config.json there, so no mlx-lm model directory "
                             "(--no-mlx-lm skips mlx_lm.server)")
    named = getattr(args, "long_prompt_clients", None)
    if named is not None:
        # A phase named here but not run would send the long prompt nowhere, and the table would not say.
        missing = sorted(set(named) - set(args.clients))
        if missing:
            raise ValueError(f"--long-prompt-clients {','.join(map(str, named))}: no phase of "
                             f"{','.join(map(str, missing))} clients (--clients {','.join(map(str, args.clients))})")
        if args.long_prompt == 0:
            raise ValueError(f"--long-prompt-clients {','.join(map(str, named))} with --long-prompt 0: no long "
                             "prompt to send (leave one of them out)")


def _longest_prompt(context: int | None, admission: Any, max_tokens: int) -> int | None:
    """The longest prompt the server admits beside ``max_tokens`` generated tokens: within the
    model's context and, under a memory budget, the KV allowance (``admission``, the engine's
    :class:`~asyncside.serving.kv_budget.KVAdmission`); at most 0 where no prompt is admitted;
    None where nothing bounds it."""
    longest = None if context is None else context - max_tokens
    if admission is None or getattr(admission, "allowance", None) is None or (longest is not None and longest < 1):
        return longest

    def fits(n: int) -> bool:
        return admission.refusal(n, max_tokens) is None

    if not fits(1):
        return 0
    # A request's worst case grows with its prompt (up to a sliding window's): the largest that fits.
    top = longest if longest is not None else 1 << 30
    low, high = 1, top
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _fit_long_prompt(args: argparse.Namespace, context: int | None, sent: bool,
                     admission: Any = None) -> tuple[int, str | None]:
    """(the long prompt's tokens, a note where the default was cut): ``--long-prompt`` as given, else
    the default, cut to what the model's context leaves beside ``--max-tokens`` (and, under a
    memory budget, to what the KV allowance admits) where a phase sends it. An explicit
    ``--long-prompt`` the server would refuse is left for :func:`_check_context` to refuse."""
    if args.long_prompt is not None:
        return args.long_prompt, None
    longest = _longest_prompt(context, admission, args.max_tokens)
    if not sent or longest is None or LONG_PROMPT <= longest or longest < 1:
        return LONG_PROMPT, None  # nothing fits beside --max-tokens: _check_context refuses it
    if context is not None and longest == context - args.max_tokens:
        why = f"the model's context is {context} tokens, --max-tokens {args.max_tokens} of them generated"
    else:
        why = (f"the KV cache of its tokens and --max-tokens {args.max_tokens} must fit the KV allowance of "
               f"{describe_bytes(admission.allowance)} under the memory budget")
    return longest, f"the long prompt is {longest} tokens, not the default {LONG_PROMPT}: {why} (--long-prompt sets it)"


def _check_context(args: argparse.Namespace, context: int | None, long_prompts: Sequence[int],
                   admission: Any = None) -> None:
    """Refuse prompts that the server would refuse, every one of them: a prompt length, or the long
    prompt of a phase that sends it, plus ``--max-tokens`` past the model's context
    (``context_length_exceeded``) or, under a memory budget, whose KV cache may not fit the
    allowance (``kv_budget_exceeded``). Such a run measured nothing and said so only in its
    phases' errors."""
    longest = _longest_prompt(context, admission, args.max_tokens)
    if longest is None:
        return
    over_context = context is not None and longest == context - args.max_tokens
    allowance = "" if over_context else (f"the KV allowance of {describe_bytes(admission.allowance)} under the memory "
                                         f"budget ({admission.budget})")
    if longest < 1:
        # No prompt fits beside --max-tokens: "at most N prompt tokens" would have been N <= 0.
        if over_context:
            raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's context of "
                             f"{context} tokens (every request is refused); ask for at most "
                             f"{longest + args.max_tokens - 1}")
        most = admission.most_tokens(1, args.max_tokens)  # --max-tokens itself where not one token fits
        advice = f"ask for at most {most}" if most < args.max_tokens else "give a larger --memory"
        raise ValueError(f"--max-tokens {args.max_tokens}: a request's KV cache may not fit {allowance} even with a "
                         f"one-token prompt (every request is refused); {advice}")
    why = (f"past the model's context of {context} tokens" if over_context
           else f"their KV caches may not fit {allowance}")
    over = [f"--prompt-lengths {n}" for n in sorted(set(args.prompt_lengths)) if n > longest]
    if any(n > longest for n in long_prompts):
        over.append(f"--long-prompt {args.long_prompt}")
    if over:
        raise ValueError(f"{', '.join(over)} with --max-tokens {args.max_tokens}: {why} (every such request is "
                         f"refused); ask for at most {longest} prompt tokens")


def _prompts(tokenizer: Any, lengths: Sequence[int], long: int,
             counter: Iterator[int]) -> Callable[[int, int], tuple[str, bool]]:
    """Client ``c``'s ``n``-th prompt (``long`` tokens for client 0's first when ``long`` > 0),
    numbered from ``counter`` (shared by every phase of a run: no two requests share a prefix)."""

    def prompt(client: int, n: int) -> tuple[str, bool]:
        number = next(counter)
        if client == 0 and n == 0 and long > 0:
            return prompt_of(tokenizer, long, number), True
        return prompt_of(tokenizer, lengths[(client + n) % len(lengths)], number), False

    return prompt


def run_serve_bench(args: argparse.Namespace, *, engine_factory: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Run every phase on both servers and return the results (printed as a table unless ``args.json``).

    From the command line, SIGTERM and SIGHUP end it as Ctrl-C does (``asyncside.cli.main``), so
    both servers stop: its server runs in a thread, where no handler of serve's own is installed."""
    import uvloop

    from ..serving import BackgroundServer, create_app, engine_factory_from_args
    from ..serving.cli import settings_from_args

    _check(args)
    # Before any server starts: the clients need httpx, which only the bench extra installs.
    require_extra("httpx", "asyncside bench serve")
    rss_before = read_rss_bytes()
    factory = engine_factory or engine_factory_from_args(args)
    settings = settings_from_args(args)
    from dataclasses import replace

    settings = replace(settings, max_tokens_limit=max(settings.max_tokens_limit, args.max_tokens), access_log=False)
    app = create_app(factory, settings)
    phases: list[dict[str, Any]] = []
    with_long = args.long_prompt_clients if args.long_prompt_clients is not None else (
        [max(args.clients)] if max(args.clients) > 1 else [])

    long_prompt = LONG_PROMPT if args.long_prompt is None else args.long_prompt

    def long_at(clients: int) -> int:
        return long_prompt if clients in with_long else 0

    numbers = itertools.count()
    mlx_lm: dict[str, Any] = {"ran": False}
    model_dir = None
    if args.mlx_lm:
        model_dir = args.mlx_lm_model or _embedded_model_dir(args)
        if model_dir is None:
            mlx_lm["skipped"] = "no mlx-lm model directory: pass --mlx-lm-model for a converted --model"

    # Both servers up at once, their phases alternating (asyncside's at 1 client, then
    # mlx_lm.server's, then 8 clients...): this host's speed drifts by tens of percent within a
    # run, and each ratio compares two phases measured minutes apart at most, never one server's
    # whole run against the other's. The idle server computes nothing meanwhile.
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(BackgroundServer(app))
        state = app.state.asyncside
        admission = state.batcher.kv_admission
        long_prompt, long_note = _fit_long_prompt(args, state.context_length,
                                                  any(c in with_long for c in args.clients), admission)
        if long_note is not None:
            print(f"note: {long_note}", file=sys.stderr, flush=True)
        _check_context(args, state.context_length, [long_at(c) for c in args.clients], admission)
        rss_idle = read_rss_bytes()
        model_id = state.model_id
        tokenizer = state.batcher.tokenizer
        engine = dict(state.engine.description)
        engine["prefill_chunk"] = state.batcher.prefill_chunk
        engine["max_batch"] = state.batcher.max_batch
        engine["max_active_by_rows"] = admission.max_active if admission is not None else None
        engine["joint_prefill"] = state.batcher.joint_prefill
        try:
            ml = stack.enter_context(MlxLmServer(model_dir)) if model_dir is not None else None
        except MlxLmServerError as exc:
            if args.mlx_lm_model is None:
                raise
            raise ValueError(f"--mlx-lm-model {model_dir}: mlx_lm.server could not load it: {exc.error} (its log: "
                             f"{exc.log}; --no-mlx-lm skips mlx_lm.server)") from None
        rss_ml_idle = ml.rss() if ml is not None else {}
        from ..memory import proc_self_bytes

        for clients in args.clients:
            warmed = 0
            if args.warmup > 0:  # the same load, untimed: kernels compiled, pools warm (see --warmup)
                warmed = warm_up("asyncside", srv.url, model_id, clients, args.warmup, args.max_tokens,
                                 _prompts(tokenizer, args.prompt_lengths, long_at(clients), numbers))
                srv.call(_idle_of(state), timeout=args.warmup * 10 + 600)
            prompts = _prompts(tokenizer, args.prompt_lengths, long_at(clients), numbers)
            peak_reset = reset_peak_rss()
            before = srv.call(_counters_of(state))
            disk_before = proc_self_bytes("io", "read_bytes")
            res = uvloop.run(run_phase("asyncside", srv.url, model_id, clients, args.duration, args.max_tokens,
                                       prompts))
            srv.call(_idle_of(state), timeout=args.duration * 10 + 600)
            spent = _spent(before, srv.call(_counters_of(state)))
            spent["disk_read_bytes"] = float(proc_self_bytes("io", "read_bytes") - disk_before)
            phases.append(res.summary() | {"warmup_rounds": warmed, "engine": spent,
                                           "peak_rss_bytes": proc_self_bytes("status", "VmHWM"),
                                           "peak_rss_since": "phase" if peak_reset else "start",
                                           "concurrency": srv.call(_concurrency_of(state))}
                          | _io_per_token(spent))
            if ml is None:
                continue
            warmed = 0
            if args.warmup > 0:
                warmed = warm_up("mlx_lm.server", ml.url, "default_model", clients, args.warmup,
                                 args.max_tokens,
                                 _prompts(tokenizer, args.prompt_lengths, long_at(clients), numbers))
                wait_quiet(ml.pid)  # the warm-up's cut requests finish first
            prompts = _prompts(tokenizer, args.prompt_lengths, long_at(clients), numbers)
            res = uvloop.run(run_phase("mlx_lm.server", ml.url, "default_model", clients, args.duration,
                                       args.max_tokens, prompts))
            summary = res.summary() | {"warmup_rounds": warmed}
            phases.append(summary)
            summary["settled_s"] = wait_quiet(ml.pid)
        health = srv.call(_health_of(state))
        runtime_stats = srv.call(_stats_of(state))
        if ml is not None:
            mlx_lm = {"ran": True, "model_dir": model_dir, "rss_idle": rss_ml_idle.get("VmRSS"),
                      "rss_peak": ml.rss().get("VmHWM")}
    rss_after = read_rss_bytes()
    for order, p in enumerate(phases):
        p["order"] = order  # when it ran (the list below is grouped by server)
    phases.sort(key=lambda p: (p["server"] != "asyncside", p["order"]))

    base = {p["clients"]: p["tokens_per_s"] for p in phases if p["server"] == "mlx_lm.server"}
    single = next((p["tokens_per_s"] for p in phases if p["server"] == "asyncside" and p["clients"] == 1), None)
    latest_single: dict[str, float] = {}
    for p in sorted(phases, key=lambda p: p["order"]):
        if p["clients"] == 1:
            latest_single[p["server"]] = p["tokens_per_s"]
        one = latest_single.get(p["server"])
        p["vs_round_single"] = p["tokens_per_s"] / one if one else None
    for p in phases:
        b = base.get(p["clients"])
        p["vs_mlx_lm"] = p["tokens_per_s"] / b if b else None
        p["vs_own_single"] = p["tokens_per_s"] / single if single and p["server"] == "asyncside" else None
    out = {
        "bench": "serve",
        "model": model_id,
        "engine": engine,
        "clients": args.clients,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "max_tokens": args.max_tokens,
        "prompt_lengths": args.prompt_lengths,
        "long_prompt": long_prompt,
        "long_prompt_note": long_note,
        "long_prompt_clients": with_long,
        "memory_budget_bytes": getattr(args, "memory", None),
        "routing": engine.get("routing"),
        "plan": engine.get("plan"),
        "phases": phases,
        "mlx_lm": mlx_lm,
        "rss_bytes": {"before_load": rss_before.get("VmRSS"), "server_idle": rss_idle.get("VmRSS"),
                      "after_load": rss_after.get("VmRSS"), "peak": rss_after.get("VmHWM")},
        "audit_ok_after": health[0],
        "audit_problems": health[1],
        "runtime_stats": runtime_stats,
        "machine": machine_info(),
    }
    if not getattr(args, "json", False):  # with --json the CLI prints the returned dict
        print_table(out)
    for p in phases:  # such a run fails (asyncside.bench.BENCHES): say why
        if p["server"] == "asyncside" and not p.get("requests_done"):
            errors = p.get("errors") or []
            print(f"asyncside bench serve: the {p['clients']}-client phase finished no request in {p['seconds']} s"
                  + (f"; first error: {errors[0]}" if errors else " (a longer --duration?)"), file=sys.stderr)
    return out


def _io_per_token(spent: dict[str, float]) -> dict[str, float | None]:
    """A phase's hit rate, and the disk's and the misses' bytes per generated token (MB)."""
    tokens = spent.get("tokens", 0.0)
    hits, misses = spent.get("hits"), spent.get("misses")
    looked = (hits or 0.0) + (misses or 0.0)
    return {
        "hit_rate": (hits or 0.0) / looked if looked else None,
        "disk_mb_per_token": spent["disk_read_bytes"] / 1e6 / tokens if tokens else None,
        "read_mb_per_token": spent["bytes_read"] / 1e6 / tokens if tokens and "bytes_read" in spent else None,
    }


def _embedded_model_dir(args: argparse.Namespace) -> str | None:
    if args.model is not None:
        return None
    from ..models.embedded import ensure_embedded_default

    return str(ensure_embedded_default(args.cache_dir)[0])


def _idle_of(state: Any) -> Callable[[], Any]:
    async def wait() -> None:
        import anyio

        # The engine has no idle event to wait on: the bench polls it between phases.
        while state.batcher.active or state.batcher.waiting:  # noqa: ASYNC110
            await anyio.sleep(0.05)

    return wait


def _health_of(state: Any) -> Callable[[], Any]:
    async def get() -> tuple[bool, list[str]]:
        audit = state.engine.audit
        return audit() if audit else (True, [])

    return get


#: The engine's counters a phase reports (what they gained over it, the phase's stragglers included).
ENGINE_COUNTERS = ("steps", "tokens", "prefill_chunks", "prefill_joined", "prefill_tokens", "prefill_seconds",
                   "launch_seconds", "wait_seconds")
#: The expert source's counters a phase reports, the same way.
SOURCE_COUNTERS = ("hits", "misses", "fills", "bytes_read", "faults", "fault_time_s")


def _counters_of(state: Any) -> Callable[[], Any]:
    async def get() -> dict[str, float]:
        b = state.batcher
        out = {k: float(getattr(b, k, 0) or 0) for k in ENGINE_COUNTERS}
        stats = state.engine.stats() if state.engine.stats else {}
        for k in SOURCE_COUNTERS:
            v = stats.get(k) if isinstance(stats, dict) else None
            if isinstance(v, (int, float)):
                out[k] = float(v)
        return out

    return get


def _concurrency_of(state: Any) -> Callable[[], Any]:
    """The engine's concurrency tuner after a phase (None: no rows' bound): the limit it chose and
    the tokens per second it measured at each level (:mod:`asyncside.serving.concurrency`)."""
    async def get() -> dict[str, Any] | None:
        admission = state.batcher.kv_admission
        tuner = admission.tuner if admission is not None else None
        return tuner.snapshot() if tuner is not None else None

    return get


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter gained between two readings (the ones present in both)."""
    return {k: round(after[k] - before[k], 6) for k in after if k in before}


def _stats_of(state: Any) -> Callable[[], Any]:
    async def get() -> Any:
        stats = state.engine.stats
        return json.loads(json.dumps(stats(), default=str)) if stats else {}

    return get


def print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    def num(v: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    e = out["engine"]
    table = Table(title=f"asyncside bench serve: {out['model']}, resident {e.get('resident')}, "
                        f"{out['max_tokens']} tokens/request, prompts {out['prompt_lengths']} (+ one "
                        f"{out['long_prompt']} with {out['long_prompt_clients']} clients), "
                        f"{out['duration_s']:g}s per phase")
    cols = ("server", "clients", "requests", "tokens", "tok/s", "vs mlx_lm", "vs 1 client", "per-stream tok/s",
            "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "long TTFT s", "hits", "disk MB/tok",
            "peak RSS MiB", "errors")
    for col in cols:
        table.add_column(col, justify="left" if col == "server" else "right")
    for p in out["phases"]:
        long = "-" if not p["long_prompt_sent"] else (
            "not reached" if p["long_prompt_ttft_s"] is None else f"{p['long_prompt_ttft_s']:.1f}")
        table.add_row(
            p["server"], str(p["clients"]), f"{p['requests_done']} +{p['requests_cut']} cut"
            + (f" +{p['requests_refused']} 429" if p.get("requests_refused") else ""), str(p["tokens"]),
            f"{p['tokens_per_s']:.2f}", num(p["vs_mlx_lm"], "{:.2f}x"), num(p.get("vs_round_single"), "{:.2f}x"),
            num(p["per_stream_tokens_per_s_p50"]),
            ms(p["ttft_p50_s"]), ms(p["ttft_p99_s"]), ms(p["itl_p50_s"]), ms(p["itl_p99_s"]), long,
            num(p.get("hit_rate"), "{:.1%}"), num(p.get("disk_mb_per_token"), "{:.1f}"),
            num(None if p.get("peak_rss_bytes") is None else p["peak_rss_bytes"] / 2**20, "{:.0f}"),
            str(p["error_count"]),
        )
    console = Console(width=max(Console().width, 200))
    if out.get("plan"):
        console.print(out["plan"])
    if out.get("routing"):
        r = out["routing"]
        console.print(f"routing replay: {r['file']} ({r['sequences']} sequence(s); request n replays sequence "
                      f"n mod {r['sequences']})")
    console.print(table)
    rss = out["rss_bytes"]

    def mib(v: int | None) -> str:
        return "-" if v is None else f"{v / 2**20:.0f} MiB"

    ml = out["mlx_lm"]
    console.print(
        f"RSS: before load {mib(rss['before_load'])}, idle server {mib(rss['server_idle'])}, "
        f"after load {mib(rss['after_load'])}, peak {mib(rss['peak'])}"
        + (f"; mlx_lm.server idle {mib(ml.get('rss_idle'))}, peak {mib(ml.get('rss_peak'))}" if ml.get("ran") else "")
        + f"; ledger audit after: {'clean' if out['audit_ok_after'] else out['audit_problems']}"
    )
    spent = [p for p in out["phases"] if p.get("engine")]
    if spent:
        where = Table(title="asyncside: where each phase's engine time went (seconds, phase and its stragglers)")
        for col in ("clients", "decode steps", "tokens/step", "launch s", "wait s", "prefill chunks",
                    "prefill tokens", "prefill s", "faults", "fault time s", "GB read"):
            where.add_column(col, justify="right")
        for p in spent:
            e = p["engine"]
            steps = e.get("steps", 0.0)
            where.add_row(
                str(p["clients"]), f"{steps:.0f}", num(e.get("tokens", 0.0) / steps if steps else None, "{:.1f}"),
                num(e.get("launch_seconds")), num(e.get("wait_seconds")), f"{e.get('prefill_chunks', 0):.0f}",
                f"{e.get('prefill_tokens', 0):.0f}", num(e.get("prefill_seconds")), f"{e.get('faults', 0):.0f}",
                num(e.get("fault_time_s")), num(e.get("bytes_read", 0.0) / 1e9),
            )
        console.print(where)
