"""One rank of a generation job: ``python -m asyncside.distributed STORE [options]``.

Run by the loopback launcher (demo, bench, tests) or by ``mlx.launch``. Every rank forms the
group, loads its stage and opens its Runtime; rank 0 then runs the job (``--requests`` concurrent
greedy generations of ``--tokens`` tokens) and every rank writes what it measured to
``--out DIR/rank<r>.json`` (rank 0 adds the tokens; the last rank with ``--keep-logits`` writes
every logits array to ``DIR/logits.npz``).

Exit status: 0 done; 1 the job failed; 2 a usage error (an option, a path that is no expert store,
a --split that does not fit the model or the ranks: one line); 3 a peer was lost or never came up
(the message on stderr names it). After a lost peer the process ends at once (``os._exit``): a transfer with the dead
peer can never complete, and MLX would wait for it at interpreter exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import resource
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from ..argtypes import int_at_least, policy_name, resident_fraction
from ..native_env import READERS
from ..policies import POLICY_NAMES
from .errors import DistributedError, PeerLostError, PeerTimeoutError

EXIT_PEER = 3


def exit_after_peer_loss(exc: BaseException, *, prefix: str = "asyncside") -> NoReturn:
    """Report a lost (or missing) peer on stderr and end the process with status 3, skipping teardown."""
    sys.stdout.flush()
    print(f"{prefix}: {exc}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER)


@contextlib.contextmanager
def exits_on_failure(prefix: str) -> Iterator[None]:
    """Once the group exists, a failure ends the process at once: status 3 for a lost or missing
    peer, 1 otherwise (the traceback printed). A normal interpreter exit could wait forever on a
    transfer that will never complete."""
    try:
        yield
    except BaseException as exc:  # every failure ends the process here
        found = find_error(exc, (PeerLostError, PeerTimeoutError))
        if found is not None:
            exit_after_peer_loss(found)
        sys.stdout.flush()
        if isinstance(exc, KeyboardInterrupt):
            print(f"{prefix}: interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        traceback.print_exception(exc)
        print(f"{prefix}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)


def find_error(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` inside ``exc`` (exception groups searched depth-first)."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = find_error(sub, kinds)
            if found is not None:
                return found
    return None


def add_stage_arguments(p: Any, *, model_options: bool = True) -> None:
    """Options every rank of a pipeline job takes (shared with ``serve --pipeline``, whose own
    options already cover the Runtime's: ``model_options=False`` leaves those out)."""
    p.add_argument("--split", default=None, help="decoder layers per rank, e.g. 2,1 (default: even)")
    p.add_argument("--backend", default=None, choices=["ring", "nccl", "jaccl", "jaccl-ring", "mpi"],
                   help="MLX distributed backend (default: from the launch environment)")
    if model_options:
        p.add_argument("--resident", type=resident_fraction(allow_auto=False), default=0.25,
                       help="share of each layer's experts in the pools, in [0, 1] (default 0.25)")
        p.add_argument("--policy", type=policy_name, default="lfu",
                       help=f"side-region eviction policy: {', '.join(POLICY_NAMES)} (default lfu)")
        p.add_argument("--reader", default="auto", choices=["auto", *READERS], help="read backend (default auto)")
        p.add_argument("--predictor", default="lookahead", choices=["lookahead", "temporal", "none"])
    p.add_argument("--side-rows", type=int, default=None, help="rows of the rotating side region per layer")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="seconds to wait for the other ranks to come up (default 60)")
    p.add_argument("--peer-timeout", type=float, default=4.0,
                   help="seconds of silence after which a peer counts as hung (default 4)")


def stage_problem(args: argparse.Namespace) -> str | None:
    """Why the stage options of :func:`add_stage_arguments` cannot run (None: they can): a split
    that does not parse or gives a rank no layer, negative side rows, a timeout that is not a finite
    number of seconds > 0. Checked before the ranks meet, by each rank and by ``serve --pipeline``."""
    from .plan import PlanError, parse_split

    try:
        split = parse_split(args.split)
    except PlanError as exc:
        return str(exc)
    if split is not None and min(split) < 1:
        return f"--split {args.split}: expected a count >= 1 of decoder layers for each rank"
    if args.side_rows is not None and args.side_rows < 0:
        return f"--side-rows {args.side_rows}: expected a number of rows >= 0"
    for option, seconds in (("--join-timeout", args.join_timeout), ("--peer-timeout", args.peer_timeout)):
        if not 0 < seconds < float("inf"):  # NaN fails this too
            return f"{option} {seconds:g}: expected a finite number of seconds > 0"
    return None


def check_side_rows(store_dir: str | pathlib.Path, side_rows: int | None) -> None:
    """A ValueError naming ``--side-rows`` where it is more dynamic rows than a layer of the store at
    ``store_dir`` has experts (the most it can be, and why): said by each rank before the ranks
    meet, not by the runtime of some after they have."""
    if side_rows is None:
        return
    from ..runtime._plan import PlanArgumentError, side_rows_problem
    from ..store import ExpertStore

    store = ExpertStore.open(store_dir)
    problem = side_rows_problem(store, list(store.layers), side_rows, name="--side-rows ")
    if problem is not None:
        raise PlanArgumentError(problem)


def layout_problem(store_dir: str | pathlib.Path, split: str | None) -> str | None:
    """Why the store at ``store_dir`` and ``--split`` cannot make a pipeline whatever the ranks
    (None: they can): a path that is no expert store of the converter's, or a split whose counts do
    not sum to the model's decoder layers. Said by each rank and by ``serve --pipeline`` before the
    launch environment is looked for (a split of the wrong rank count needs it: said after)."""
    from .plan import PlanError, parse_split
    from .stage import model_layout

    try:
        n_layers, _moe = model_layout(store_dir)
        counts = parse_split(split)
    except (PlanError, ValueError) as exc:  # StoreError is a ValueError
        return str(exc)
    if counts is not None and sum(counts) != n_layers:
        return (f"--split {split}: the counts must sum to the model's {n_layers} decoder layers "
                f"(they sum to {sum(counts)})")
    return None


def prompt_problem(store_dir: str | pathlib.Path, prompt_ids: str | None, prompt: str | None) -> str | None:
    """Why ``--prompt-ids`` / ``--prompt`` cannot be a prompt of the model at ``store_dir`` (None:
    they can): a piece that is no integer, an id outside the model's vocabulary (rank 0 read past
    its embedding and was killed by SIGSEGV, its peers left with a lost link), or an empty prompt
    (an empty ``--prompt`` ran the default one). Said by each rank before the ranks meet."""
    if prompt_ids is None:
        return "--prompt is empty: give the text to generate from" if prompt == "" else None
    ids = []
    for piece in (t.strip() for t in prompt_ids.split(",")):
        if not piece:
            continue
        try:
            ids.append(int(piece))
        except ValueError:
            return f"--prompt-ids {prompt_ids}: expected comma-separated token ids, got {piece!r}"
    if not ids:
        return f"--prompt-ids {prompt_ids!r}: no token ids (comma-separated, such as 1,2,3)"
    from .stage import load_config

    config = load_config(pathlib.Path(store_dir))
    text = config.get("text_config")
    vocab = (text if isinstance(text, dict) and text.get("vocab_size") is not None else config).get("vocab_size")
    bad = next((t for t in ids if t < 0 or (isinstance(vocab, int) and t >= vocab)), None)
    if bad is not None:
        upper = vocab if isinstance(vocab, int) else "..."
        return f"--prompt-ids: token id {bad} is outside the model's vocabulary [0, {upper})"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m asyncside.distributed",
                                description="one rank of a pipelined generation job")
    p.add_argument("store", help="converted expert store directory")
    add_stage_arguments(p)
    p.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
    p.add_argument("--prompt", default=None, help="prompt text (when --prompt-ids is not given)")
    p.add_argument("--tokens", type=int_at_least(1), default=16, help="tokens per request")
    p.add_argument("--requests", type=int_at_least(1), default=1,
                   help="concurrent requests (prompt rotated by i tokens)")
    p.add_argument("--warmup", type=int_at_least(0), default=0, help="tokens of one untimed request first")
    p.add_argument("--keep-logits", action="store_true", help="last rank: write every logits array")
    p.add_argument("--echo", action="store_true", help="rank 0: print each token id on stdout as it comes")
    p.add_argument("--ping", type=int_at_least(0), default=0, metavar="N",
                   help="rank 0: N boundary round trips of one decode step's messages, no compute")
    p.add_argument("--out", default=None, help="directory for rank<r>.json")
    p.add_argument("--single", action="store_true",
                   help="no pipeline: run the job in this one process over the whole store (writes single.json)")
    return p


def _prompts(args: argparse.Namespace, sm: Any) -> list[list[int]]:
    if args.prompt_ids is not None:  # checked by prompt_problem before the ranks met
        base = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    else:
        base = list(sm.tokenizer.encode(args.prompt or "Mixture-of-Experts models route every token."))
    if not base:
        raise SystemExit("the prompt is empty")
    return [base[i % len(base):] + base[:i % len(base)] for i in range(args.requests)]


def _schedstats() -> list[tuple[int, str, int, int]] | None:
    """(tid, name, ns on a CPU, ns runnable but waiting) of each live thread of this process
    (Linux schedstat), or None where /proc cannot tell; a thread that ends meanwhile is left out."""
    try:
        tasks = sorted(os.listdir("/proc/self/task"), key=int)
    except (OSError, ValueError):
        return None
    out = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/self/task/{task}/schedstat") as fh:
                run_ns, wait_ns = (int(v) for v in fh.read().split()[:2])
        except (OSError, ValueError):
            continue
        out.append((int(task), name, run_ns, wait_ns))
    return out


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but not running (Linux schedstat), or None.

    Tells a busy machine (other processes on this core) from a rank waiting for work."""
    stats = _schedstats()
    return None if stats is None else sum(wait for _, _, _, wait in stats) / 1e9


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's live threads (Linux schedstat), or {} where /proc cannot tell.

    Named threads by name, digits at the end folded (io_uring's workers count as one); threads
    that kept the process's name (MLX's and the ring's threads are unnamed) as ``main`` (the
    process's first thread) and ``thread-<tid>``."""
    out: dict[str, float] = {}
    stats = _schedstats()
    if not stats:
        return out
    own = next((name for tid, name, _, _ in stats if tid == os.getpid()), None)
    for tid, name, run_ns, _ in stats:
        if name == own:
            name = "main" if tid == os.getpid() else f"thread-{tid}"
        else:
            name = name.rstrip("0123456789-") or "?"
        out[name] = out.get(name, 0.0) + run_ns / 1e9
    return out


def _thread_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each thread name spent between two :func:`thread_cpu_s` (threads that ended in
    between are missing: what they spent is lost, not negative)."""
    return {k: round(max(0.0, v - before.get(k, 0.0)), 4) for k, v in sorted(after.items(), key=lambda kv: -kv[1])}


def pool_bytes(source: Any) -> int:
    """Bytes of every pool array of a Runtime (0 for None)."""
    if source is None:
        return 0
    return int(sum(a.nbytes for layer in source.store.layers for a in source.pools(layer).values()))


async def _ping(pipe: Any, sm: Any, n: int) -> dict[str, Any]:
    """``n`` boundary round trips of one decode step's messages (predicted ids, a hidden state, a token)."""
    import mlx.core as mx

    dtype = getattr(getattr(sm.arch.embedding(sm.model), "weight", None), "dtype", mx.float32)
    if dtype not in (mx.float32, mx.float16, mx.bfloat16):  # a quantized embedding's packed weight
        dtype = mx.bfloat16
    hidden = mx.zeros((1, 1, int(sm.config.get("hidden_size", 64))), dtype=dtype)
    pred = mx.zeros((1, 1, 8), dtype=mx.int32)
    mx.eval(hidden, pred)
    for _ in range(max(5, n // 10)):
        await pipe.ping(hidden, predicted=pred)
    times = sorted([await pipe.ping(hidden, predicted=pred) for _ in range(n)])
    out = {"median": times[len(times) // 2], "p10": times[len(times) // 10], "p90": times[(9 * len(times)) // 10],
           "n": len(times), "hidden_bytes": hidden.nbytes}
    if pipe.group.size == 2 and pipe.group.env.backend != "nccl":
        raw = sorted(await pipe.ping_raw(hidden, n))
        out.update({"raw_median": raw[len(raw) // 2], "raw_p10": raw[len(raw) // 10],
                    "raw_p90": raw[(9 * len(raw)) // 10]})
    return out


async def _generate_all(gen: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """An untimed warm-up request, then every prompt at once; tokens and aggregate speed."""
    import anyio

    if args.warmup:
        async for _ in gen(prompts[0], args.warmup):
            pass
    tokens: list[list[int]] = [[] for _ in prompts]
    firsts: list[float] = [0.0] * len(prompts)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async for tok in gen(prompts[i], args.tokens):
            if not tokens[i]:
                firsts[i] = time.perf_counter() - t0
            tokens[i].append(tok)
            if args.echo:
                print(f"token {i} {tok}", flush=True)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    elapsed = time.perf_counter() - t0
    n = sum(len(t) for t in tokens)
    return {"prompts": prompts, "tokens": tokens, "seconds": elapsed,
            "tokens_per_s": n / elapsed if elapsed > 0 else 0.0, "ttft_s": firsts}


async def _single_job(args: argparse.Namespace, sm: Any) -> dict[str, Any]:
    """The same job in this one process, one Runtime over the whole store (the baseline)."""
    from ..runtime import Runtime

    async with Runtime(sm.store, resident=args.resident, side_rows=args.side_rows, policy=args.policy,
                       reader=args.reader) as rt:
        cpu0, wall0, wait0, threads0 = time.process_time(), time.perf_counter(), runqueue_wait_s(), thread_cpu_s()
        result = await _generate_all(
            lambda p, n: sm.generate(p, max_tokens=n, source=rt, predictor=args.predictor), _prompts(args, sm), args)
        wait1 = runqueue_wait_s()
        result["pipeline_threads_cpu_s"] = _thread_delta(threads0, thread_cpu_s())
        result["pipeline_cpu_s"], result["pipeline_wall_s"] = time.process_time() - cpu0, time.perf_counter() - wall0
        result["pipeline_runqueue_wait_s"] = None if wait0 is None or wait1 is None else wait1 - wait0
        result.update({"rank": None, "stats": {"runtime": rt.stats()}, "pool_bytes": pool_bytes(rt)})
    return result


async def _job(args: argparse.Namespace, group: Any, plan: Any, sm: Any) -> dict[str, Any]:
    from ..runtime import Runtime
    from .pipeline import Pipeline

    stage = plan.stage(group.rank)
    result: dict[str, Any] = {"rank": group.rank, "stage": stage.to_json(), "backend": group.env.backend}
    rt_cm: Any = (Runtime(sm.store, resident=args.resident, side_rows=args.side_rows, policy=args.policy,
                          reader=args.reader) if stage.moe_layers else contextlib.nullcontext(None))
    async with rt_cm as rt:
        pipe = Pipeline(group, plan, sm, rt, predictor=args.predictor, keep_logits=args.keep_logits,
                        peer_timeout_s=args.peer_timeout, start_timeout_s=max(args.join_timeout, 10.0))
        cpu0, wall0, wait0, threads0 = time.process_time(), time.perf_counter(), runqueue_wait_s(), thread_cpu_s()
        async with pipe.running():
            if group.rank == 0:
                prompts = _prompts(args, sm)
                if args.ping:
                    result["ping_s"] = await _ping(pipe, sm, args.ping)
                result.update(await _generate_all(lambda p, n: pipe.generate(p, n), prompts, args))
            else:
                await pipe.serve()
        # CPU time against wall time while the pipeline ran: how busy this rank's core was
        result["pipeline_cpu_s"], result["pipeline_wall_s"] = time.process_time() - cpu0, time.perf_counter() - wall0
        wait1 = runqueue_wait_s()
        result["pipeline_runqueue_wait_s"] = None if wait0 is None or wait1 is None else wait1 - wait0
        result["pipeline_threads_cpu_s"] = _thread_delta(threads0, thread_cpu_s())
        result["stats"] = pipe.stats()
        result["pool_bytes"] = pool_bytes(rt)
        if pipe.kept_logits:
            import numpy as np

            assert args.out is not None
            # (Any values: numpy's stub types savez's **arrays together with its allow_pickle flag)
            arrays: dict[str, Any] = {f"r{rid}_{i}": a for rid, arrs in pipe.kept_logits.items()
                                      for i, a in enumerate(arrs)}
            np.savez(pathlib.Path(args.out) / "logits.npz", **arrays)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = stage_problem(args)
    if problem is not None:
        parser.error(problem)
    import anyio

    from .group import LaunchEnv, join
    from .plan import PlanError, parse_split
    from .stage import load_stage_model, plan_for_store

    problem = "--keep-logits needs --out (the directory its logits.npz goes to)" if (
        args.keep_logits and not args.out) else None
    try:  # --single too: before the launch environment, a model or the ranks
        if problem is None:
            check_side_rows(args.store, args.side_rows)
            # (--single plans no stages: its --split is not looked at)
            problem = layout_problem(args.store, None if args.single else args.split)
        if problem is None:
            problem = prompt_problem(args.store, args.prompt_ids, args.prompt)
    except ValueError as exc:  # PlanArgumentError, or a store that cannot be opened
        problem = str(exc)
    if problem is not None:  # a usage error: the exit status argparse gives one
        print(f"asyncside rank {os.environ.get('MLX_RANK', '?')}: {problem}", file=sys.stderr, flush=True)
        return 2
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.single:
        from ..models import load_streaming_model

        result = anyio.run(_single_job, args, load_streaming_model(args.store), backend="asyncio",
                           backend_options={"use_uvloop": True})
        result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if args.out:
            (pathlib.Path(args.out) / "single.json").write_text(json.dumps(result, default=str))
        return 0
    started = time.perf_counter()
    try:
        env = LaunchEnv.from_environ(args.backend)
        plan = plan_for_store(args.store, env.size, parse_split(args.split))
        group = join(plan.fingerprint(), env=env, timeout=args.join_timeout)
    except (PeerTimeoutError, PeerLostError) as exc:
        exit_after_peer_loss(exc)
    except PlanError as exc:  # a --split of another rank count than the launch's: a usage error too
        print(f"asyncside rank {os.environ.get('MLX_RANK', '?')}: {exc}", file=sys.stderr, flush=True)
        return 2
    except (DistributedError, ValueError) as exc:
        print(f"asyncside rank {os.environ.get('MLX_RANK', '?')}: {exc}", file=sys.stderr, flush=True)
        return 1
    joined = time.perf_counter()
    with exits_on_failure(f"asyncside rank {group.rank}"):
        sm = load_stage_model(args.store, plan, group.rank)
        result = anyio.run(_job, args, group, plan, sm, backend="asyncio",
                           backend_options={"use_uvloop": True})
    result["join_s"] = joined - started
    result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.out:
        (pathlib.Path(args.out) / f"rank{group.rank}.json").write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
