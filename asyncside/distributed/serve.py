"""``asyncside serve STORE --pipeline [--split a,b]``: the HTTP server over a pipeline of ranks.

Run it on every rank, e.g. ``mlx.launch --hostfile hosts.json -- asyncside serve STORE --pipeline``.
Rank 0 serves HTTP (the usual endpoints) and feeds every request into the pipeline; the other
ranks run their stages until rank 0 shuts down (Ctrl-C / SIGTERM on rank 0 drains the steps in
flight through every rank, then every rank exits 0). A rank that dies or hangs stops the others
with an error naming it (exit status 3).

What the server needs from the pipeline is small: :class:`PipelineModel` gives it ``model_id``,
``tokenizer``, ``config`` and ``generate(prompt_ids, max_tokens=...)``, an async iterator of
token ids per request, driven by :class:`PipelineSteps` (the serving engine's step strategy for
a pipeline, plugged into its one loop). Each request runs ahead in the pipeline's own tasks, so
requests overlap across the stages whatever order the server reads their tokens in.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .rank import EXIT_PEER, check_side_rows, exit_after_peer_loss, exits_on_failure, find_error, layout_problem


class PipelineModel:
    """The served model of rank 0: every request a chain of steps through the pipeline."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        sm = pipeline.sm
        self.model_id: str = sm.model_id
        self.tokenizer = sm.tokenizer
        self.config = sm.config

    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, source: Any = None,
                 predictor: str = "lookahead") -> AsyncIterator[int]:
        """Greedy tokens of one request (``source`` and ``predictor`` are the pipeline's own)."""
        return self.pipeline.generate(list(prompt_ids), max_tokens)


class PipelineSteps:
    """The serving engine's step strategy over a pipeline (rank 0), plugged into the one
    :class:`~asyncside.serving.engine.Batcher`: each request admitted runs ahead as its own chain of
    steps through the ranks (a task of the engine loop), so requests overlap across stages. Greedy
    decoding only: a request asking for anything else is refused when it arrives (400), never
    silently decoded greedily."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def check(self, sampling: Any) -> None:
        from ..serving import protocol as oai

        s = sampling
        plain = (s.greedy and s.top_k in (0, 1) and s.min_p == 0.0 and s.top_p == 1.0 and not s.logit_bias
                 and s.repetition_penalty is None and s.presence_penalty is None
                 and s.frequency_penalty is None and not s.logprobs and not s.top_logprobs)
        if not plain:
            raise oai.RequestError("a pipeline of ranks decodes greedily: leave out temperature, top_p, top_k, "
                                   "min_p, penalties, logit_bias and logprobs", param="temperature")

    def idle(self, batcher: Any) -> bool:
        return batcher.waiting == 0  # requests in flight run in their own tasks

    @property
    def failure(self) -> BaseException | None:
        """Why the pipeline cannot go on (a lost peer): what the engine fails its requests with."""
        return getattr(self.pipeline, "failure", None)

    async def step(self, batcher: Any, tasks: Any) -> None:
        for slot in batcher.take_waiting():
            tasks.start_soon(self._one, batcher, slot)

    async def _one(self, batcher: Any, slot: Any) -> None:
        from ..serving.engine import TokenEvent

        try:
            async for tok in self.pipeline.generate(slot.prompt, slot.max_tokens):
                if slot.cancelled:
                    break
                batcher.emit(slot, TokenEvent(int(tok)))
            batcher.steps += 1
            batcher.finish(slot, None if slot.cancelled else
                           ("length" if slot.generated >= slot.max_tokens else "stop"), keep_cache=False)
        except Exception as exc:
            batcher.fail(slot, exc)


def pipeline_batcher(pipeline: Any, *, max_batch: int, max_queue: int) -> Any:
    """The serving engine over a pipeline: the one Batcher, stepping with :class:`PipelineSteps`."""
    from ..serving.engine import Batcher

    model: Any = PipelineModel(pipeline)  # the parts of a ServedModel the pipeline's steps use
    return Batcher(model, None, max_batch=max_batch, max_queue=max_queue, prompt_cache_size=0,
                   strategy=PipelineSteps(pipeline))


def _audit(problems: list[str]) -> tuple[bool, list[str]]:
    return not problems, problems


def _store_dir(args: argparse.Namespace) -> str:
    if args.store or args.model:
        return str(pathlib.Path(args.store or args.model).absolute())
    from ..models.embedded import ensure_embedded_default

    return str(ensure_embedded_default(args.cache_dir, progress=False)[1])


@contextlib.asynccontextmanager
async def _stage(args: argparse.Namespace, group: Any, plan: Any, sm: Any) -> AsyncIterator[Any]:
    """This rank's Runtime and running pipeline; a lost peer ends the process (status 3)."""
    from ..runtime import Runtime
    from .pipeline import Pipeline

    stage = plan.stage(group.rank)
    rt_cm: Any = (Runtime(sm.store, resident=args.resident, side_rows=args.side_rows, policy=args.policy,
                          reader=args.reader) if stage.moe_layers else contextlib.nullcontext(None))
    try:
        async with rt_cm as rt:
            pipe = Pipeline(group, plan, sm, rt, predictor=args.predictor, peer_timeout_s=args.peer_timeout,
                            start_timeout_s=max(args.join_timeout, 10.0))
            async with pipe.running():
                yield pipe
    except BaseException as exc:
        from .errors import PeerLostError, PeerTimeoutError

        found = find_error(exc, (PeerLostError, PeerTimeoutError))
        if found is not None:
            exit_after_peer_loss(found)
        raise


def serve_pipeline_main(args: argparse.Namespace) -> int:
    """One rank of ``asyncside serve --pipeline``: 0 after a clean shutdown, 3 after a lost peer."""
    import anyio
    import uvloop

    from ..runtime._plan import PlanArgumentError
    from .errors import DistributedError, PeerLostError, PeerTimeoutError
    from .group import LaunchEnv, join
    from .plan import PlanError, parse_split
    from .stage import load_stage_model, plan_for_store

    if not 0.0 <= args.resident <= 1.0:
        raise SystemExit(f"--resident must be a fraction in [0, 1], got {args.resident}")
    store = _store_dir(args)
    try:
        check_side_rows(store, args.side_rows)  # usage errors: said before the launch environment
        problem = layout_problem(store, args.split)
        if problem is not None:
            raise PlanArgumentError(problem)
        env = LaunchEnv.from_environ(args.backend)
        plan = plan_for_store(store, env.size, parse_split(args.split))
        group = join(plan.fingerprint(), env=env, timeout=args.join_timeout)
    except (PeerTimeoutError, PeerLostError) as exc:
        exit_after_peer_loss(exc)
    except (PlanArgumentError, PlanError) as exc:  # the options, not the launch: a usage error's exit status
        print(f"asyncside serve: {exc}", file=sys.stderr)
        return 2
    except (DistributedError, ValueError) as exc:
        print(f"asyncside serve: rank {os.environ.get('MLX_RANK', '?')}: {exc}", file=sys.stderr)
        return 1
    with exits_on_failure(f"asyncside serve: rank {group.rank}"):
        sm = load_stage_model(store, plan, group.rank)
        if group.rank != 0:
            async def stage_only() -> None:
                async with _stage(args, group, plan, sm) as pipe:
                    print(f"asyncside serve: {group.describe(group.rank)} runs layers "
                          f"{pipe.stage.start}..{pipe.stage.stop - 1} of {sm.model_id}", flush=True)
                    await pipe.serve()

            anyio.run(stage_only, backend="asyncio", backend_options={"use_uvloop": True})
            return 0

    from ..audit import audit_problems
    from ..serving.app import create_app
    from ..serving.background import ServeError, serve
    from ..serving.loading import Engine
    from ..serving.settings import settings_from_args

    settings = settings_from_args(args)

    @contextlib.asynccontextmanager
    async def engine() -> AsyncIterator[Engine]:
        async with _stage(args, group, plan, sm) as pipe:
            model = PipelineModel(pipe)
            yield Engine(
                model=model,  # type: ignore[arg-type]  # duck-types the StreamingModel the engine takes
                source=None,
                stats=pipe.stats,
                audit=(lambda: _audit(audit_problems(pipe.source))) if pipe.source is not None else None,
                description={"model": store, "pipeline": plan.to_json(), "backend": group.env.backend,
                             "resident": args.resident, "reader": args.reader, "policy": args.policy},
                batcher=pipeline_batcher(pipe, max_batch=settings.max_batch, max_queue=settings.max_queue),
            )

    app = create_app(engine, settings)

    def ready(url: str) -> None:
        print(f"asyncside serve: {url} model={sm.model_id} pipeline of {group.size} ranks, split "
              f"{','.join(map(str, plan.split))} ({group.env.backend})", flush=True)

    with exits_on_failure("asyncside serve: rank 0"):
        try:
            uvloop.run(serve(app, args.host, args.port, log_level=args.log_level, on_ready=ready))
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after the shutdown
            pass
        except (ServeError, OSError) as exc:
            print(f"asyncside serve: {exc}", file=sys.stderr, flush=True)
            os._exit(1)  # the other ranks see this rank go and stop
    return 0


__all__ = ["EXIT_PEER", "PipelineModel", "PipelineSteps", "pipeline_batcher", "serve_pipeline_main"]
