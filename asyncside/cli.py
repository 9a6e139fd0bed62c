"""The ``asyncside`` command (also ``python -m asyncside``): demo, convert, serve, routing, bench.

Each subcommand lives in its own module, and only the subcommand being run is imported (its
options included): ``asyncside --help`` imports no MLX and no mlx-lm, and a broken optional piece
cannot take the other subcommands down.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__
from .argtypes import CommandParser
from .bench import BENCHES, add_bench_arguments, run_bench
from .errors import AsyncsideError, EnvVarError, TraceError
from .native_env import check_env

# command -> (help, module, function adding its options, function running it -> exit status)
_COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": ("streaming generation beside all-resident (the embedded model, or --model)", "asyncside.demo",
             "add_demo_arguments", "demo_main"),
    "convert": ("turn an mlx-lm model (a directory or a Hugging Face repo id) into an expert store",
                "asyncside.models.cli",
                "add_convert_arguments", "convert_main"),
    "serve": ("OpenAI-compatible streaming HTTP server (--pipeline: one rank of a pipeline)", "asyncside.serving.cli",
              "add_serve_arguments", "serve_main"),
    "routing": ("look at, make and widen routing trace files", "asyncside.routing_cli", "add_routing_arguments",
                "routing_main"),
}


def _attr(module: str, name: str) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def _add_options(parser: argparse.ArgumentParser, module: str, add: Callable[[argparse.ArgumentParser], None]) -> None:
    try:
        add(parser)
    except ImportError as exc:  # a missing optional dependency disables this subcommand only
        parser.set_defaults(_unavailable=f"{module}: {exc}")


def _module_options(module: str, add: str, parser: argparse.ArgumentParser) -> None:
    _attr(module, add)(parser)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``asyncside`` command.

    With ``argv``, only the subcommand it names gets its options (importing its module); without,
    every subcommand does (tests, documentation).
    """
    chosen = [a for a in argv if not a.startswith("-")][:2] if argv is not None else None
    parser = CommandParser(
        prog="asyncside",
        description="Stream MoE expert weights from an SSD expert store into MLX pools.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, module, add, _run) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if chosen is None or chosen[:1] == [name]:
            _add_options(p, module, functools.partial(_module_options, module, add))

    bench = sub.add_parser("bench", help="measure the read path, the bridge, generation, serving")
    on_cli = [b for b in BENCHES.values() if b.on_cli]
    kinds = bench.add_subparsers(dest="bench", metavar="{" + ",".join(b.name for b in on_cli) + "}", required=True)
    for b in on_cli:
        p = kinds.add_parser(b.name, help=b.help)
        if chosen is None or chosen == ["bench", b.name]:
            _add_options(p, b.module, functools.partial(add_bench_arguments, b.name))
    return parser


def _bad_input(exc: BaseException) -> bool:
    """Whether ``exc`` refuses something the user named (bad input, exit status 2 as a usage error):
    a routing trace unreadable or not replayable on the model (RoutingReplayError), a bench
    shape or model config that cannot be built (ShapeError), or a server's startup refused by the
    application (ServeError of an AsyncsideError: bench serve's, as ``asyncside serve`` says it).
    Their modules load MLX: looked up only once loaded, as raising them did."""
    forcing = sys.modules.get("asyncside.models.forcing")
    shapes = sys.modules.get("asyncside.bench.shapes")
    background = sys.modules.get("asyncside.serving.background")
    # A server's startup refused by the application (a plan the budget cannot hold, a bad store):
    # `asyncside serve` calls it bad input, and so does a bench that starts one (bench serve).
    refused = (background is not None and isinstance(exc, background.ServeError)
               and isinstance(exc.startup_error, AsyncsideError))
    return (refused or isinstance(exc, TraceError)
            or (forcing is not None and isinstance(exc, forcing.RoutingReplayError))
            or (shapes is not None and isinstance(exc, shapes.ShapeError)))


def _terminated(signum: int, _frame: object) -> None:
    """SIGTERM (``kill``, ``timeout``, a service manager stopping it) or SIGHUP (the terminal or
    ssh session gone) as an exception: the interpreter's default ended the process where it stood,
    so ``bench offload`` left its child generating in its memory cgroup and its temporary directory
    behind, and ``bench generate --load N`` its N busy processes spinning. Raised, the runs' cleanup
    (children ended, cgroups and temporary files removed, runtimes closed) happens as on Ctrl-C;
    a second signal ends the process at once."""
    signal.signal(signum, signal.SIG_DFL)
    raise SystemExit(128 + signum)


#: the signals whose default (the process ends where it stands) :func:`_terminated` replaces
_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _replace_unencodable(stream: Any) -> None:
    """Write what ``stream``'s encoding cannot hold as escapes, as Python's stderr does.

    A stdout of another encoding than UTF-8 (``PYTHONIOENCODING=latin-1``, a legacy locale) ended
    the demo half way with a UnicodeEncodeError and a traceback at the first prompt or generated
    token it could not hold."""
    if getattr(stream, "errors", None) == "strict" and callable(getattr(stream, "reconfigure", None)):
        stream.reconfigure(errors="backslashreplace")


def _command_name(argv: Sequence[str]) -> str:
    words = [a for a in argv[:2] if not a.startswith("-")]
    return " ".join(words[:2] if words[:1] == ["bench"] else words[:1])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncside`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not all(_is_open(fd) for fd in (0, 1, 2)):
        # Started with stdin or stdout closed (``asyncside demo >&-``, a script's ``<&- >&-``): the
        # event loop's first descriptors took their numbers, and libuv, which asserts it never
        # closes one of those, aborted the process (SIGABRT, a core dump). serve does the same.
        from .serving.cli import open_std_fds

        open_std_fds()
    # serve shuts down gracefully on SIGTERM through its own handlers (bench serve's server runs in
    # a thread, with none: the bench ends here as on Ctrl-C, stopping both servers). A signal
    # ignored by the parent (SIG_IGN inherited: nohup's SIGHUP) stays ignored.
    _replace_unencodable(sys.stdout)
    mine = threading.current_thread() is threading.main_thread() and _command_name(args) != "serve"
    previous = {s: signal.signal(s, _terminated) for s in _ENDING
                if mine and signal.getsignal(s) is not signal.SIG_IGN}
    try:
        rc = _main(args)
        sys.stdout.flush()  # a closed pipe is met here, not in the interpreter's own flush at exit
        return rc
    except BrokenPipeError:
        # The reader went away (``asyncside routing info T --json | head``): no traceback, and the
        # interpreter's flush at exit must not meet the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        # Ctrl-C: the runs' cleanup has happened on the way here; a traceback of wherever the
        # interrupt landed (MLX's import, mlx-lm's generate step) said nothing more.
        print(f"asyncside {_command_name(args)}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    # parse_args less its last step: a subcommand whose options could not be added (its module's
    # import failed) says so, not "unrecognized arguments" for the options it would have had.
    try:
        args, extra = parser.parse_known_args(argv)
    except AsyncsideError as exc:  # an option's type imports a module that refused to load (serve --predictor)
        print(f"asyncside {_command_name(argv)}: {exc}", file=sys.stderr)
        return 2
    unavailable = getattr(args, "_unavailable", None)
    if unavailable:
        print(f"asyncside {args.command}: not available: {unavailable}", file=sys.stderr)
        return 2
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    name = f"bench {args.bench}" if args.command == "bench" else args.command  # as argparse names it
    try:
        if args.command != "routing":  # refused before a model loads, not when its runtime starts
            check_env()
        if args.command == "bench":
            return run_bench(args.bench, args)
        _help, module, _add, run = _COMMANDS[args.command]
        return int(_attr(module, run)(args))
    except EnvVarError as exc:  # a bad ASYNCSIDE_* variable: a usage error, as a bad option is
        print(f"asyncside {name}: environment: {exc}", file=sys.stderr)
        return 2
    except AsyncsideError as exc:  # expected (a bad store, a bad file): one line, no traceback
        print(f"asyncside {name}: {exc}", file=sys.stderr)
        return 2 if _bad_input(exc) else 1
    except (ImportError, ValueError) as exc:
        # A bad ASYNCSIDE_* environment variable: the native extension refuses it when it loads, the
        # reader choice when it reads it; both messages start with the variable's name.
        if str(exc).lstrip("$").startswith("ASYNCSIDE_"):
            print(f"asyncside {name}: environment: {exc}", file=sys.stderr)
            return 2
        # A bad combination of options, checked once parsed (bench generate's settings, a shape bench
        # policy's generator cannot make): the message starts with the option's name.
        if isinstance(exc, ValueError) and str(exc).startswith("--"):
            print(f"asyncside {name}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
