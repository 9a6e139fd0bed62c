"""`asyncside serve`: its arguments (checked when parsed) and its entry point.

Importing this module imports nothing heavy, so ``asyncside --help`` stays fast: the model, MLX,
Starlette and uvicorn are imported when the command runs. Names the parser cannot know without
importing them (predictors, policies) are checked by argument types that import them only when
the option is parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, cast

from ..argtypes import directory, int_at_least, policy_name, resident_fraction
from ..memory import host_tier_arg, memory_arg
from ..policies import DEFAULT_POLICY, POLICY_NAMES
from .settings import ServeSettings, settings_from_args

__all__ = ["add_engine_arguments", "add_model_arguments", "add_serve_arguments", "app_from_args",
           "engine_factory_from_args", "run_serve", "serve_main", "settings_from_args"]

READERS = ("auto", "io_uring", "threads", "aiofiles")

#: ``--resident`` without ``--memory`` nor a value given
DEFAULT_RESIDENT = 0.25


class _Given(argparse.Action):
    """Stores the value and notes it was given (``DEST_given``, e.g. ``resident_given``): a default
    is not a choice."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _existing_file(text: str) -> str:
    import os

    # exists, not isfile: a pipe (--routing <(...)) is a trace file too, read once when the engine opens
    if not os.path.exists(text) or os.path.isdir(text):
        what = "is a directory; expected a routing trace file (.npz)" if os.path.isdir(text) else \
            "no such routing trace file"
        raise argparse.ArgumentTypeError(f"{text}: {what}")
    return text


def _size(text: str) -> int:
    """A size as every SIZE option takes it (asyncside.memory.parse_size: units up to T)."""
    from ..memory import parse_size

    try:
        return parse_size(text, what="size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _body_size(text: str) -> int:
    size = _size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, such as 8M, got {text!r}")
    return size


def _size_or_default(text: str) -> int | None:
    return None if text.strip().lower() == "mlx" else _size(text)


def _port(text: str) -> int:
    value = int(int_at_least(0)(text))
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def _host(text: str) -> str:
    """An interface to bind: an empty one (``--host "$HOST"`` of an unset variable) bound every
    interface, 0.0.0.0, without a word. An IPv6 address may be bracketed as in a URL (``[::1]``:
    resolved as a host name, it failed with 'Name or service not known')."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected an interface to bind (127.0.0.1; 0.0.0.0 for every "
                                         f"interface), got {text!r}")
    if text.startswith("[") and text.endswith("]") and ":" in text:
        return text[1:-1]
    return text


def _api_key(text: str) -> str:
    """A key every client must send: an empty one (``--api-key "$KEY"`` of an unset variable) left
    every endpoint open without a word, as if the option were left out."""
    if not text:
        raise argparse.ArgumentTypeError("expected a key, got '' (an empty key would leave every endpoint open; "
                                         "leave --api-key out to serve without one)")
    if not text.isprintable() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("expected a key of printable characters without spaces")
    return text


def _positive_seconds(text: str) -> float | None:
    if text.lower() in ("none", "0", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (or 'none'), got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value:g}")
    return value


def _seconds_at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value:g}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a temperature in [0, 2], got {text!r}") from None
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"expected a temperature in [0, 2], got {value:g}")
    return value


def predictor_name(text: str) -> str:
    """An expert predictor name (``asyncside.models.PREDICTORS``)."""
    from ..models.predict import PREDICTORS

    if text not in PREDICTORS:
        raise argparse.ArgumentTypeError(f"unknown predictor {text!r}; choose from {', '.join(PREDICTORS)}")
    return text


def predictor_routing_problem(args: argparse.Namespace) -> str | None:
    """Why ``--predictor`` cannot serve with the ``--routing`` given (None: it can).

    The ``trace`` predictor prefetches what a replayed routing trace predicted, so it needs
    ``--routing`` with a trace that carries predictions (its ``predicted`` array); checked at start
    (the trace file is read, unless ``args.routing_trace`` holds it read) so that a server never
    starts only to fail every request."""
    if getattr(args, "predictor", None) != "trace":
        return None
    if getattr(args, "pipeline", False):
        return ("--predictor trace is not supported with --pipeline (it replays a routing trace's predictions, "
                "and --routing is not supported there); choose --predictor lookahead, temporal or none")
    routing = getattr(args, "routing", None)
    if routing is None:
        return ("--predictor trace needs --routing TRACE.npz: it prefetches the predictions a replayed routing "
                "trace carries (docs/routing-traces.md); without a trace choose --predictor lookahead, "
                "temporal or none")
    trace = getattr(args, "routing_trace", None)
    if trace is None:
        from ..errors import TraceError
        from ..routing import RoutingTrace

        try:
            trace = RoutingTrace.load(routing)
        except TraceError as exc:
            return f"--routing: {exc}"
    if trace.predicted is None:
        return (f"--predictor trace: the routing trace {routing} carries no predictions (no 'predicted' array; "
                "`asyncside demo --record-routing FILE` with the lookahead predictor records them); "
                "choose --predictor lookahead, temporal or none")
    return None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Which model to serve and how its runtime streams experts (shared with `bench serve`)."""
    parser.add_argument("--model", metavar="STORE|DIR|ORG/NAME", default=None,
                        help="a store written by `asyncside convert`, an mlx-lm model directory or a Hugging Face "
                             "repo id (a model is converted on first use into the cache directory; "
                             "default: the embedded model, built on first run)")
    parser.add_argument("--resident", type=resident_fraction(), default=DEFAULT_RESIDENT, action=_Given,
                        help="fraction of each layer's experts kept in the pools, in [0, 1] (0.25 or 25%%; 0: every "
                             "expert streamed through the least rows), or 'auto': sized to the memory budget "
                             "(default %(default)s, or auto with --memory)")
    parser.set_defaults(resident_given=False)
    parser.add_argument("--memory", metavar="SIZE", type=memory_arg, default=None,
                        help="the memory budget the runtime plans against, e.g. 1.5G (default: what the memory "
                             "cgroup and MemAvailable allow); reads bypass the page cache when the store does "
                             "not fit what is left of it")
    parser.add_argument("--routing", metavar="TRACE.npz", type=_existing_file, default=None,
                        help="replay a routing trace (docs/routing-traces.md): request n replays the trace's "
                             "sequence n mod its sequences from its own first prompt token; the prompt cache is "
                             "off then")
    parser.add_argument("--reader", default="auto", choices=READERS, help="expert read backend (default auto)")
    parser.add_argument("--policy", type=policy_name, default=DEFAULT_POLICY,
                        help=f"eviction policy of the dynamic rows: {', '.join(POLICY_NAMES)} "
                             f"(default {DEFAULT_POLICY})")
    parser.add_argument("--host-tier", type=host_tier_arg, default="auto", metavar="SIZE", action=_Given,
                        help="MLX CUDA: pinned host memory for the host tier of records (each faulted "
                             "record read and verified once, then copied from there): auto (a quarter of "
                             "the memory left beside the pools), a size such as 2G, or 0 for none (default auto)")
    parser.set_defaults(host_tier_given=False)
    parser.add_argument("--predictor", type=predictor_name, default="lookahead",
                        help="expert predictor: lookahead, temporal, none (default lookahead)")
    parser.add_argument("--cache-dir", type=directory, default=None,
                        help="where the embedded model is built and models are converted on first use "
                             "(default: ASYNCSIDE_CACHE or the user cache)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine batches and admits requests (shared with `bench serve`)."""
    d = ServeSettings()
    parser.add_argument("--max-batch", type=int_at_least(1), default=d.max_batch,
                        help=f"requests generating together (default {d.max_batch})")
    parser.add_argument("--max-queue", type=int_at_least(0), default=d.max_queue,
                        help=f"requests waiting for a slot before new ones get 429 (default {d.max_queue})")
    parser.add_argument("--prefill-chunk", type=int_at_least(1), default=d.prefill_chunk,
                        help="prompt tokens prefilled per engine step (default: 16 on the CPU, 512 on a GPU)")
    parser.add_argument("--prompt-cache-size", type=int_at_least(0), default=d.prompt_cache_size,
                        help=f"KV caches kept for prefix reuse, 0 to disable (default {d.prompt_cache_size})")
    parser.add_argument("--prompt-cache-bytes", type=_size, default=d.prompt_cache_bytes, metavar="SIZE",
                        help=f"bytes of KV caches the prompt cache keeps at most, e.g. 256M "
                             f"(default {d.prompt_cache_bytes >> 20}M)")
    parser.add_argument("--mlx-cache-limit", dest="mlx_cache_bytes", type=_size_or_default,
                        default=d.mlx_cache_bytes, metavar="SIZE",
                        help=f"bytes of freed buffers MLX keeps for reuse, e.g. 512M, or 'mlx' for MLX's own "
                             f"default (its memory limit) (default {(d.mlx_cache_bytes or 0) >> 20}M)")
    parser.add_argument("--joint-prefill", action="store_true",
                        help="prefill fresh prompts that arrive together in one forward (faster with many "
                             "clients on a GPU; there a request's low bits then depend on who arrived with it)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `asyncside serve`."""
    d = ServeSettings()
    add_model_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--host", type=_host, default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    parser.add_argument("--max-tokens-limit", type=int_at_least(1), default=d.max_tokens_limit,
                        help=f"largest max_tokens a request may ask for (default {d.max_tokens_limit})")
    parser.add_argument("--request-timeout", type=_positive_seconds, default=d.request_timeout, metavar="SECONDS",
                        help=f"end a request this long after it arrived, queueing included, with 504 "
                             f"('none': never; default {d.request_timeout:g})")
    parser.add_argument("--temp", type=_temperature, default=d.default_temperature,
                        help="sampling temperature of requests that do not give one (default 0: greedy)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="allow cross-origin requests from ORIGIN (repeatable; '*' for any); CORS is off "
                             "without it")
    parser.add_argument("--api-key", type=_api_key, default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                             "$ASYNCSIDE_API_KEY, else none; the variable keeps the key out of the process list)")
    parser.add_argument("--shutdown-grace", type=_seconds_at_least_zero, default=d.shutdown_grace, metavar="SECONDS",
                        help=f"on SIGTERM/SIGINT/SIGHUP, refuse new requests (503) and give those in flight this "
                             f"long to finish before they are ended with an error (default {d.shutdown_grace:g})")
    parser.add_argument("--drain-delay", type=_seconds_at_least_zero, default=d.drain_delay, metavar="SECONDS",
                        help=f"on SIGTERM/SIGINT/SIGHUP, answer /health with 503 but keep taking and serving "
                             f"requests this long before the drain, so that a load balancer's health check sees "
                             f"the instance leave before its connections are refused (default {d.drain_delay:g})")
    parser.add_argument("--max-request-bytes", type=_body_size, default=None, metavar="SIZE",
                        help="largest request body, e.g. 32M (default: room for a prompt of the model's context "
                             "length as token ids, at least 1M and at most 8M); larger bodies get 413")
    parser.add_argument("--keep-alive", type=_seconds_at_least_zero, default=d.keep_alive, metavar="SECONDS",
                        help=f"keep an idle connection open this long between requests; longer than the idle "
                             f"timeout of a proxy in front, which otherwise may reuse a connection just closed "
                             f"(a 502) (default {d.keep_alive:g}; 0 closes each after its answer)")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="do not log one line per request")
    parser.add_argument("--log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_pipeline_serve_arguments(parser)


def add_pipeline_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``--pipeline`` and its options, added to ``asyncside serve``; STORE may be given positionally."""
    from ..distributed.rank import add_stage_arguments

    p.add_argument("store", nargs="?", default=None, metavar="STORE",
                   help="what --model takes (a store, an mlx-lm model directory or a Hugging Face repo id), "
                        "given positionally")
    p.add_argument("--pipeline", action="store_true",
                   help="run as one rank of a pipeline (under mlx.launch); rank 0 serves HTTP")
    add_stage_arguments(p.add_argument_group("pipeline (with --pipeline)"), model_options=False)


#: The options only a rank of a pipeline reads (None unless given), by their destinations.
PIPELINE_ONLY = {"split": "--split", "backend": "--backend", "side_rows": "--side-rows"}


def pipeline_problem(args: argparse.Namespace) -> str | None:
    """Why the ``--pipeline`` options given cannot run together (None: they can): checked before a
    model is converted or loaded and before the ranks meet, so a bad combination is one usage error,
    not a failure of each rank after the launch. ``args.resident`` as typed (before
    :func:`resident_of`)."""
    if not getattr(args, "pipeline", False):
        stray = [option for dest, option in PIPELINE_ONLY.items() if getattr(args, dest, None) is not None]
        if stray:
            return (f"{', '.join(stray)} only {'applies' if len(stray) == 1 else 'apply'} with --pipeline "
                    "(one rank of a pipeline, under mlx.launch); add --pipeline or leave "
                    f"{'it' if len(stray) == 1 else 'them'} out")
        return None
    # The pipeline's ranks plan no memory budget and keep no host tier: taking these would ignore them.
    for option, given in (("--resident auto", args.resident == "auto"), ("--memory", args.memory is not None),
                          ("--routing", args.routing is not None),
                          ("--host-tier", getattr(args, "host_tier_given", False))):
        if given:
            return f"{option} is not supported with --pipeline"
    # A pipeline decodes greedily and prefills its own way: a default temperature would make every
    # request that gives none a 400 ("leave out temperature"); the prefill options would be ignored.
    temp = getattr(args, "temp", 0.0)
    for option, given in ((f"--temp {temp:g}", temp != 0.0),
                          ("--joint-prefill", getattr(args, "joint_prefill", False)),
                          ("--prefill-chunk", getattr(args, "prefill_chunk", None) is not None)):
        if given:
            return f"{option} is not supported with --pipeline (its ranks decode greedily, prefilling their own way)"
    from ..distributed.rank import stage_problem

    return stage_problem(args)


def resident_of(args: argparse.Namespace) -> float | str:
    """``--resident`` as given; else ``auto`` under ``--memory`` (a budget asks the plan to size the
    pools: a fixed share could refuse a budget that smaller pools fit, as demo's does), else the
    default (:data:`DEFAULT_RESIDENT`; ``bench serve``'s own)."""
    resident = cast(float | str, args.resident)
    if getattr(args, "resident_given", True) or getattr(args, "memory", None) is None:
        return resident
    return "auto"


def engine_factory_from_args(args: argparse.Namespace) -> Any:
    """``open_engine`` bound to the model options of ``args`` (``args.routing_trace``, where set,
    the ``--routing`` trace already read)."""
    from .engine import open_engine

    # The trace as read once (a pipe reads once) where the command read it; else its file.
    routing = getattr(args, "routing_trace", None) or getattr(args, "routing", None)
    return lambda: open_engine(args.model, resident=resident_of(args), reader=args.reader, policy=args.policy,
                               cache_dir=args.cache_dir, host_tier=getattr(args, "host_tier", "auto"),
                               memory=getattr(args, "memory", None), routing=routing,
                               routing_source=getattr(args, "routing", None))


def app_from_args(args: argparse.Namespace) -> Any:
    from .app import create_app

    return create_app(engine_factory_from_args(args), settings_from_args(args))


async def run_serve(args: argparse.Namespace) -> None:
    """`asyncside serve` on the running loop; prints one line with the URL once the model is loaded."""
    from .background import serve
    from .batch_caches import unbatched_note

    app = app_from_args(args)
    with contextlib.ExitStack() as logs:
        writers = logs.enter_context(_serve_logging(args))

        def ready(url: str) -> None:
            # uvicorn's handlers exist by now (configured with the server): they write unblocked too.
            logs.enter_context(_unblocked_uvicorn_logs(writers))
            st = app.state.asyncside
            print(f"asyncside serve: {url} model={st.model_id} reader={st.engine.description.get('reader')}",
                  flush=True)
            routing = st.engine.description.get("routing") or {}
            if routing.get("note"):  # a trace of another model's shape: replayed, but not as recorded
                print(f"asyncside serve: routing {routing['file']}: {routing['note']}", flush=True)
            unbatched = None if st.batcher.batched_decode else unbatched_note(st.batcher.model)
            if unbatched is not None:  # its clients' tokens per second do not add up as a batch's would
                print(f"asyncside serve: {unbatched}", flush=True)

        await serve(app, args.host, args.port, log_level=args.log_level, on_ready=ready)


def bound_malloc() -> bool:
    """Make glibc's malloc give large freed blocks back to the system (Linux; no-op elsewhere).

    glibc raises its mmap threshold each time a large mmapped block is freed, after which blocks
    of that size come from its heaps, where freeing them seldom returns memory: a long-running
    server's RSS then keeps the high-water mark of every buffer size it ever met. Setting the
    threshold explicitly (to glibc's own default, 128 KiB) turns that adjustment off. Returns
    whether it was set."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_mmap_threshold = -3
    return bool(mallopt(m_mmap_threshold, 128 * 1024))


class LineWriter:
    """Writes lines to a stream from a thread of its own, so that whoever logs never waits for it.

    A stream that is not read fills (stderr a pipe whose reader stopped reading, a container's log
    driver in blocking mode), and a write to it blocks: written on the event loop's thread, an
    access-log line stalled every request and every probe. Lines are queued (at most ``most``;
    past that they are dropped and counted, and the count is said once the stream takes lines
    again). A stream with a file descriptor is written with ``os.write``: a thread blocked there
    holds no lock of the interpreter's, which the interpreter's exit would otherwise wait for."""

    def __init__(self, stream: Any, most: int = 10_000) -> None:
        import queue
        import threading

        self.stream = stream
        try:
            self.fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # a stream of Python's only (a test's capture)
            self.fd = None
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self.lines: queue.Queue[str | None] = queue.Queue(most)
        self._dropped = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="asyncside-log-writer", daemon=True)
        self.thread.start()

    def put(self, line: str) -> None:
        """Queue ``line`` (newline included); never blocks."""
        import queue

        try:
            self.lines.put_nowait(line)
        except queue.Full:
            with self._lock:
                self._dropped += 1

    def _run(self) -> None:
        import os

        while (line := self.lines.get()) is not None:
            with self._lock:
                dropped, self._dropped = self._dropped, 0
            if dropped:
                line = f"asyncside serve: {dropped} log lines dropped: the log was not read\n" + line
            try:
                if self.fd is None:
                    self.stream.write(line)
                    self.stream.flush()
                    continue
                data = line.encode(self.encoding, "backslashreplace")
                while data:
                    data = data[os.write(self.fd, data):]
            except (OSError, ValueError):  # the reader is gone, or the stream closed: nobody to tell
                pass

    def close(self, wait: float = 2.0) -> None:
        """Write what is queued, waiting ``wait`` seconds at most (a stream nobody reads never takes it)."""
        import queue

        try:
            self.lines.put(None, timeout=wait)
        except queue.Full:
            return
        self.thread.join(wait)


class UnblockedHandler(logging.Handler):
    """A logging handler that formats records and hands the lines to a :class:`LineWriter`."""

    def __init__(self, writer: LineWriter, formatter: logging.Formatter | None = None) -> None:
        super().__init__()
        self.writer = writer
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        self.writer.put(line)


@contextlib.contextmanager
def _unblocked_uvicorn_logs(writers: dict[int, LineWriter]) -> Iterator[None]:
    """uvicorn's own handlers (its warnings about malformed requests, an application's traceback)
    write through ``writers`` (by the stream's id) while the block runs, then are put back.

    uvicorn installs them when the server is configured, after the command's logging is set up;
    each keeps its formatter."""
    swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            writer = writers.get(id(getattr(old, "stream", None)))
            if type(old) is logging.StreamHandler and writer is not None:
                quiet = UnblockedHandler(writer, old.formatter)
                quiet.setLevel(old.level)
                logger.removeHandler(old)
                logger.addHandler(quiet)
                swapped.append((logger, old, quiet))
    try:
        yield
    finally:
        for logger, handler, unblocked in swapped:
            logger.removeHandler(unblocked)
            logger.addHandler(handler)


@contextlib.contextmanager
def _serve_logging(args: argparse.Namespace) -> Iterator[dict[int, LineWriter]]:
    """The server's log lines to stderr while it runs, written by a :class:`LineWriter` (yielded
    with it, by the stream's id). Taken back when it returns: a process that serves more than once
    (tests, an embedding application) would otherwise keep a handler per run, each writing to the
    stderr of its time, which may have been closed since."""
    writer = LineWriter(sys.stderr)
    handler = UnblockedHandler(writer, logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    level = getattr(logging, str(args.log_level).upper(), logging.WARNING)
    base = logging.getLogger("asyncside")
    access = logging.getLogger("asyncside.access")
    before = base.level, access.level
    base.addHandler(handler)
    base.setLevel(level if isinstance(level, int) else logging.WARNING)
    if args.access_log:
        access.setLevel(logging.INFO)
    try:
        yield {id(sys.stderr): writer}
    finally:
        base.removeHandler(handler)
        base.setLevel(before[0])
        access.setLevel(before[1])
        writer.close()


def open_std_fds() -> list[int]:
    """Open the null device on each of stdin, stdout and stderr that is closed; returns those.

    A process manager or a daemonizing script may start the server with them closed: the first
    descriptors the process opened then took their numbers, and libuv, which asserts that it never
    closes one of those, aborted the process (stdout closed: at startup; stdin closed: at
    shutdown)."""
    import os

    opened = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            opened.append(fd)
    # Python left the streams of closed descriptors as None (uvicorn's log formatter asks stdout
    # whether it is a terminal): they write to the null device now.
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, encoding="utf-8", errors="backslashreplace", closefd=False))
    return opened


def serve_main(args: argparse.Namespace) -> int:
    """`asyncside serve`: run the server on a uvloop event loop; 0 on a clean shutdown."""
    open_std_fds()  # before the event loop or a store opens a descriptor
    import uvloop

    from ..errors import AsyncsideError
    from .background import ServeError

    # Before a model is converted or loaded, and before the ranks of a pipeline meet: say so now,
    # not per request or per rank. --resident as typed: --memory alone is refused as --memory there.
    problem = pipeline_problem(args)
    args.resident = resident_of(args)
    if problem is None and getattr(args, "routing", None) is not None:
        # Read once, before a model loads (a bad file is said now); the engine replays what was
        # read: a pipe (--routing <(...)) cannot be read again.
        from ..errors import TraceError
        from ..routing import RoutingTrace

        try:
            args.routing_trace = RoutingTrace.load(args.routing)
        except TraceError as exc:
            problem = f"--routing: {exc}"
    problem = problem or predictor_routing_problem(args)
    if problem is None:
        try:
            settings_from_args(args)
        except ValueError as exc:  # ServeSettings' own checks (an API key from the environment, say)
            problem = str(exc)
    if problem is not None:
        print(f"asyncside serve: error: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "store", None) is not None and args.model is None:
        args.model = args.store
    if args.model is not None:
        # A model directory or a repo id becomes a store (converted on first use, then reused).
        from ..hub import needs_a_tokenizer, store_for

        try:
            args.model = str(store_for(args.model, cache_dir=args.cache_dir,
                                       needs=needs_a_tokenizer("the server encodes prompts and decodes tokens")))
        except AsyncsideError as exc:
            print(f"asyncside serve: error: {exc}", file=sys.stderr)
            return 2
    if getattr(args, "pipeline", False):
        from ..distributed.serve import serve_pipeline_main

        return serve_pipeline_main(args)
    bound_malloc()
    try:
        uvloop.run(run_serve(args))
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a graceful shutdown
        pass
    except (ServeError, OSError) as exc:
        print(f"asyncside serve: {exc}", file=sys.stderr)
        # Bad input (a store, a trace the model cannot replay, pools the budget cannot hold) is a
        # usage error, as in `asyncside demo`; anything else failed while running.
        bad_input = isinstance(exc, ServeError) and isinstance(exc.startup_error, AsyncsideError)
        return 2 if bad_input else 1
    return 0
