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
import dataclasses
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

from .argtypes import Once, directory, file_name, int_at_least, resident_fraction, writable_file
from .errors import AsyncsideError, StoreError
from .memory import SIZE_UNITS, describe_bytes, host_tier_arg, memory_arg, proc_self_bytes, release_freed_heap
from .policies import DEFAULT_POLICY
from .policies import POLICIES as POLICY_NAMES
from .pools_note import cli_rows_raised, rows_note, side_rows_refused

DEFAULT_PROMPT = "Mixture-of-Experts models route every token to a few experts out of many. "

#: said before the embedded model's text: its weights are seeded, so the text is not meant to read well
EMBEDDED_NOTICE = ("note: the embedded model's weights are generated from a seed, so its text reads as noise; "
                   "speed and exactness are the point. On a real model: asyncside demo --model "
                   "mlx-community/Qwen3-30B-A3B-4bit (a Hugging Face repo id or a local directory)")


#: An argparse type: an integer >= 1.
positive_int = int_at_least(1)
#: An argparse type: an integer >= 0.
count_arg = int_at_least(0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


#: the pools' share of each layer's experts when neither --resident nor --memory is given
DEFAULT_RESIDENT = 0.25


def resident_of(args: argparse.Namespace) -> float | str:
    """``--resident`` as given; else ``auto`` under ``--memory`` (a budget asks the plan to size the
    pools, and a fixed share could refuse a budget that smaller pools fit), else the default share."""
    given = getattr(args, "resident", None)
    if given is not None:
        return cast(float | str, given)
    return "auto" if getattr(args, "memory", None) is not None else DEFAULT_RESIDENT


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``asyncside demo``."""
    p.add_argument("--model", metavar="STORE|DIR|ORG/NAME", default=None,
                   help="an expert store, an mlx-lm model directory or a Hugging Face repo id (converted on "
                        "first use into the cache directory; default: the embedded Qwen3-MoE model)")
    p.add_argument("--resident", metavar="FRACTION", type=resident_fraction(), default=None,
                   help="share of each layer's experts the pools hold, in [0, 1] (0.25 or 25%%; 0: every expert "
                        "streamed through the least rows), or 'auto': sized to the memory available (default "
                        f"{DEFAULT_RESIDENT}, or auto with --memory)")
    p.add_argument("--memory", metavar="SIZE", type=memory_arg, default=None,
                   help="the memory budget the runtime plans against, e.g. 1.5G (default: what the memory "
                        "cgroup and MemAvailable allow); the plan is printed, and reads bypass the page cache "
                        "when the store does not fit what the budget leaves for it; " + SIZE_UNITS)
    p.add_argument("--reference", default="auto", choices=["auto", "all-resident", "slot-cache", "none"],
                   help="what the tokens are checked against: mlx-lm with every expert in memory, or the "
                        "slot cache (a plain synchronous reader, bounded memory); auto: all-resident when the "
                        "model fits the budget, else the slot cache")
    p.add_argument("--tokens", metavar="N", type=positive_int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--reader", default="auto", choices=["auto", "io_uring", "threads", "aiofiles"],
                   help="read backend (default: io_uring where the kernel allows it)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check each record read against its checksum (default: verify)")
    p.add_argument("--host-tier", metavar="SIZE", type=host_tier_arg, default="auto",
                   help="MLX CUDA: pinned host memory for faulted records kept for later faults: auto, a "
                        "size such as 2G, or 0 (default auto)")
    # Lower-cased as Runtime and the benches take a policy's name (LRU is lru).
    p.add_argument("--policy", default=DEFAULT_POLICY, type=str.lower, choices=sorted(POLICY_NAMES),
                   help=f"eviction policy of the dynamic rows (default {DEFAULT_POLICY})")
    p.add_argument("--predictor", default=None, choices=["lookahead", "temporal", "trace", "none"],
                   help="expert prediction for prefetch (default lookahead; with --routing: trace, the trace's own "
                        "predictions, when it carries them, else temporal); its precision and recall are reported")
    p.add_argument("--lookahead-extra", metavar="N", type=count_arg, default=0,
                   help="lookahead names N experts beyond the router's k per token (default 0; "
                        "fewer misses, more reads: see BENCHMARKS.md)")
    p.add_argument("--mode", default="auto", choices=["auto", "queued", "per-layer", "whole"],
                   help="how decode steps run (default auto: queued, misses served inside the stream)")
    p.add_argument("--side-rows", metavar="N", type=count_arg, default=None,
                   help="of each layer's pool rows, N are managed by the eviction policy and the rest hold the "
                        "store's hottest experts, pinned (default: every row managed, none pinned)")
    p.add_argument("--direct", action="store_true",
                   help="read with O_DIRECT (bypass the page cache: every read hits the disk)")
    p.add_argument("--cache-dir", type=directory, metavar="DIR", default=None,
                   help="where the embedded model is built and --model converted on first use (default: "
                        "$ASYNCSIDE_CACHE, else $XDG_CACHE_HOME/asyncside, else ~/.cache/asyncside)")
    p.add_argument("--streamed-switch", default="auto", choices=["auto", "on", "off"],
                   help="decode steps start a layer's misses' reads at once and compute its experts as they land "
                        "(CPU, host pools); auto: where the memory plan reads past the page cache")
    p.add_argument("--routing", metavar="FILE", type=file_name, action=Once, default=None,
                   help="replay a routing trace (.npz, docs/routing-traces.md): every MoE layer of both runs "
                        "routes to the trace's experts instead of its router's top-k")
    p.add_argument("--routing-sequence", metavar="N", type=count_arg, default=None,
                   help="which sequence of a --routing trace of several to replay (default 0, the first; "
                        "needs --routing)")
    p.add_argument("--rows-profile", metavar="FILE", type=file_name, action=Once, default=None,
                   help="split the pools' rows between layers by this routing trace's miss curves (a trace "
                        "of the model's shape; record or generate it from another sequence than --routing's)")
    p.add_argument("--record-routing", metavar="FILE", type=writable_file, action=Once, default=None,
                   help="write the streaming run's routing (every MoE layer's ids per token) as a routing trace "
                        "(.npz, docs/routing-traces.md)")
    p.add_argument("--quiet", action="store_true", help="do not print tokens as they come")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                   help="N > 1: run the generation as a pipeline of N ranks on this machine (loopback, ring "
                        "backend) beside the one-process run; the ranks take --resident, --side-rows, --policy, "
                        "--reader and --predictor, and refuse one-process options; see docs/distributed.md")
    p.add_argument("--split", default=None, help="with --ranks: decoder layers per rank, e.g. 4,4 (default even)")
    p.add_argument("--join-timeout", metavar="SECONDS", type=_seconds, default=60.0,
                   help="with --ranks: seconds for the ranks to meet (default 60)")
    p.add_argument("--deadline", metavar="SECONDS", type=_seconds, default=600.0,
                   help="with --ranks: seconds before every rank is stopped (default 600)")


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


def prompt_tokens(tokenizer: Any, prompt: str, store: Any = None) -> list[int]:
    """``--prompt`` encoded by ``tokenizer``; a ValueError naming the option where it encodes to no
    tokens (generation needs a token to start from; a tokenizer without BOS encodes "" to none), an
    AsyncsideError naming ``store`` where the model has no tokenizer at all."""
    if tokenizer is None:
        raise StoreError(store or "the model", "holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model or asyncside_tokenizer.json): --prompt cannot be encoded; convert a "
                         "model directory that has them")
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise ValueError(f"--prompt {prompt!r} encodes to no tokens; give a prompt of at least one token")
    return ids


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


def as_tokens_option(exc: AsyncsideError, tokens: int) -> AsyncsideError:
    """``exc`` in the command line's words: the model's refusal of a generation its KV allowance
    cannot hold names the API's ``max_tokens=``, which the demo takes as ``--tokens``."""
    api = f"max_tokens={tokens} "
    text = str(exc)
    return AsyncsideError(f"--tokens {tokens} {text[len(api):]}") if text.startswith(api) else exc


def demo_runtime(store: Any, args: argparse.Namespace) -> Any:
    """The streaming run's Runtime (not entered) as the demo's options ask for it."""
    from .runtime import Runtime

    return Runtime(store, resident=args.resident, side_rows=args.side_rows, policy=args.policy,
                   reader=args.reader, direct=True if args.direct else None,
                   verify=not getattr(args, "no_verify", False), memory=getattr(args, "memory", None),
                   host_tier=getattr(args, "host_tier", "auto"), rows_profile=getattr(args, "rows_profile", None))


def refuse_early(sm: Any, runtime: Any, prompt_ids: list[int], args: argparse.Namespace,
                 reference_keeps: int = 0) -> None:
    """Under ``--memory``, what the streaming run would refuse (pools that cannot fit, a generation
    whose KV cache passes the plan's allowance) refused before the reference run, which may take
    minutes: an AsyncsideError in the command line's words. The plan made now counts the
    ``reference_keeps`` bytes (:func:`reference_keeps`) as held already, so a memory= it names
    still fits once the reference has run."""
    if getattr(args, "memory", None) is None:
        return
    try:
        sm.kv_need(runtime.plan_now(grows_by=reference_keeps), len(prompt_ids), args.tokens)
    except AsyncsideError as exc:
        raise as_tokens_option(exc, args.tokens) from None


async def _streaming_run(sm: Any, store: Any, runtime: Any, prompt_ids: list[int], args: argparse.Namespace,
                         echo: Any, options: Any) -> tuple[Run, dict[str, Any], bool]:
    import anyio

    from .looplag import measure_loop_lag
    from .models.predict import PredictionQuality
    from .models.trace import RoutingTrace

    async with runtime as rt:
        if rt.plan is not None and not (args.quiet or args.json):
            print(rt.plan.describe(), flush=True)
            print(f"{args.prompt}", end="", flush=True)
        record = RoutingTrace() if getattr(args, "record_routing", None) else None
        counted = dict(sm.forward_with(options).counters)  # the predictions of this run alone, below
        disk_before = disk_read_bytes()
        run = Run(start=time.perf_counter())
        async with measure_loop_lag() as lag:
            try:
                async for tok in sm.generate(prompt_ids, max_tokens=args.tokens, source=rt,
                                             predictor=args.predictor, options=options, trace=record):
                    first_token = not run.tokens
                    run.first_token()
                    run.tokens.append(tok)
                    echo(run.tokens)
                    if first_token:  # what the prompt read, apart from what decoding reads
                        at_first = await counts_at_rest(rt)
            except AsyncsideError as exc:
                if rt.plan is not None and not (args.quiet or args.json):
                    print(flush=True)  # the prompt echoed above: the refusal on a line of its own
                raise as_tokens_option(exc, args.tokens) from None
        run.end = time.perf_counter()
        await rt.drain()
        audit_ok = all(report.ok for report in rt.audit().values())
        stats: dict[str, Any] = dict(rt.stats())  # the runtime's counters, then the demo's own figures
        layers = list(store.layers)
        stats["pool_rows_per_layer"] = rt.ledger(layers[0]).rows if layers else 0
        split = rt.plan is not None and rt.plan.split is not None
        stats["pool_rows_split"] = [rt.ledger(i).rows for i in layers] if split else None
        stats["experts_per_layer"] = store.layer(layers[0]).n_experts if layers else 0
        stats["pools_fraction"] = rt.memory.get("pools_fraction")
        stats["rows_raised"] = None if split else cli_rows_raised(rt.memory.get("rows_raised"))
        stats["loop_lag"] = lag.summary()
        stats["fault_latency"] = rt.fault_latency()
        stats["memory"] = rt.memory
        stats["peak_rss_bytes"] = peak_rss_bytes()
        stats["disk_read_bytes"] = disk_read_bytes() - disk_before
        if run.tokens:
            stats["decode_bytes_read"] = int(stats["bytes_read"]) - at_first[0]
            stats["decode_disk_read_bytes"] = disk_read_bytes() - at_first[1]
            # Queued steps queue the next step before its token is awaited: the first decode step,
            # queued before the first token arrived, was counted at rest on the prompt's side. The
            # steps the counts cover: their demands over a step's (each MoE layer routes top-k
            # distinct experts a token).
            from .runtime._plan import store_top_k

            per_step = len(store.layers) * (store_top_k(store) or 0)
            demands = int(stats["hits"]) + int(stats["misses"]) - at_first[2]
            stats["decode_demands"] = demands
            stats["decode_steps_counted"] = demands / per_step if per_step and demands else None
        stats["prediction"] = PredictionQuality.from_counters(sm.forward_with(options).counters, counted).as_dict()
    if record is not None:
        meta = {"model": sm.model_id, "prompt_tokens": len(prompt_ids), "generated_tokens": len(run.tokens)}
        await anyio.to_thread.run_sync(record.to_file_trace(stats["experts_per_layer"], meta).save,
                                       args.record_routing)
    return run, stats, audit_ok


async def counts_at_rest(rt: Any) -> tuple[int, int, int]:
    """The runtime's bytes read, the process's disk bytes and the runtime's demands (hits and
    misses), taken once no read is in flight: every queued step computed, its reads published and
    its faults applied. The disk counts a read when it is submitted and the runtime when it lands,
    so the two taken while the step queued ahead of the first token still read would cut decoding
    at different points (its reads on the prompt's side of one, on decoding's of the other)."""
    await rt.quiesce()
    await rt.drain()
    st = rt.stats()
    return int(st["bytes_read"]), disk_read_bytes(), int(st["hits"]) + int(st["misses"])


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), 0 where /proc does not say."""
    return proc_self_bytes("status", "VmHWM")


def disk_read_bytes() -> int:
    """Bytes this process has read from storage so far (/proc/self/io read_bytes: what reached
    the block layer, page-cache hits excluded), 0 where /proc does not say."""
    return proc_self_bytes("io", "read_bytes")


def reference_model_bytes(store: Any) -> int:
    """The all-resident model's bytes: every expert record and the non-expert weights."""
    model_bytes = sum(store.layer(i).blob_bytes for i in store.layers)
    try:
        model_bytes += sum(f.stat().st_size for f in store.path.glob("*.safetensors"))
    except OSError:
        pass
    return int(model_bytes)


def reference_keeps(store: Any, reference: str) -> int:
    """What ``reference`` leaves in the process until the streaming run plans: the all-resident
    model's weights (:func:`reference_model_bytes`: freed after its run, their pages stay in the
    process's heap), nothing for the slot cache (it runs after the streaming run) or none."""
    return reference_model_bytes(store) if reference == "all-resident" else 0


def choose_reference(store: Any, asked: str, memory: int | None, resident: float | str | None = None
                     ) -> tuple[str, str]:
    """Which run checks the tokens, and why: the all-resident model when it fits the budget (its
    experts and non-expert weights in at most half of it), else the slot cache. The streaming run
    must fit too after the reference ran: what the process holds now, plus the model (the process
    keeps its pages after the reference, :func:`reference_keeps`), plus the pools (a fractional
    ``resident``'s, else the smallest the plan may choose), the runtime's headroom and the margin a
    refusal's memory= leaves. Under a ``memory`` budget that is checked whatever ``resident`` is:
    the reference must not take the process past the budget."""
    from .memory import available_memory, describe_bytes, pool_bytes, proc_self_bytes
    from .runtime._plan import NEED_MARGIN, min_rows, plan_headroom

    if asked != "auto":
        return asked, "asked for"
    model_bytes = reference_model_bytes(store)
    budget = available_memory().available if memory is None else min(memory, available_memory().available)
    if model_bytes <= budget // 2:
        if isinstance(resident, float) or memory is not None:
            pools = pool_bytes(store, resident if isinstance(resident, float) else 0.0, min_rows=min_rows(store))
            # The reference's run also leaves its code (the modules it imports, the kernels MLX
            # compiles), which no figure names: the margin a refusal's memory= adds is kept for it
            # (a memory= named without the model leaves no room for the model beside that margin).
            after = proc_self_bytes("status", "VmRSS") + model_bytes + pools + plan_headroom(store) + NEED_MARGIN
            if after > budget:
                # Rounded up to a whole MiB: a need a few bytes past the budget read as the budget's
                # own figure, as if it fitted.
                return "slot-cache", (f"the model's {describe_bytes(model_bytes)} fit half of the "
                                      f"{describe_bytes(budget)} budget, but with them held the streaming run "
                                      f"would need {describe_bytes(-(-after // (1 << 20)) << 20)}: checked against "
                                      "a plain synchronous reader instead")
        return "all-resident", f"the model's {describe_bytes(model_bytes)} fit the budget"
    return "slot-cache", (f"the model's {describe_bytes(model_bytes)} do not fit half of the "
                          f"{describe_bytes(budget)} budget: checked against a plain synchronous reader instead")


def slot_cache_run(sm: Any, store: Any, prompt_ids: list[int], max_tokens: int, eos: set[int],
                   memory: dict[str, Any], side_rows: int | None = None) -> Run:
    """Greedy tokens of the slot cache (the same routing replay, pools of the runtime's size, one
    synchronous read at a time, past the page cache when the runtime's plan was): bounded memory.
    ``side_rows``: the runtime's (``--side-rows``), which sizes its rows beside the fraction."""
    from .bench.slot_cache import SlotCache, slot_generate

    fraction = memory.get("resident")
    with SlotCache(store, fraction if isinstance(fraction, float) else 0.25, side_rows=side_rows,
                   direct=bool(memory.get("direct"))) as sc:
        run = Run(start=time.perf_counter())
        for tok in slot_generate(sm, sc, prompt_ids, max_tokens=max_tokens, eos_token_ids=eos):
            run.first_token()
            run.tokens.append(tok)
        run.end = time.perf_counter()
        run.stats = sc.stats()
    return run


def probe_disk(store: Any, seconds: float = 0.5) -> dict[str, float]:
    """The store's random-read bandwidth at its record size, one O_DIRECT read at a time (what a
    fault does), for about ``seconds``: the disk's limit the I/O-bound figures are held to."""
    import mmap
    import os
    import random

    layers = list(store.layers)
    stride = max(store.layer(i).stride for i in layers)
    buf = mmap.mmap(-1, -(-stride // 4096) * 4096 + 2 * 4096)
    rng = random.Random(0)
    done = 0
    t0 = time.perf_counter()
    fds: dict[int, int] = {}
    try:
        # Opened inside the try: a filesystem that refuses O_DIRECT (ramfs, some FUSE mounts) leaves
        # the probe without a figure, as a failed read does, while the plan may well read buffered.
        for i in layers:
            fds[i] = os.open(store.layer(i).path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        while time.perf_counter() - t0 < seconds:
            i = rng.choice(layers)
            spec = store.layer(i)
            e = rng.randrange(spec.n_experts)
            # The blocks that hold the record: in a store of a smaller alignment it starts mid-block,
            # where O_DIRECT refuses the read.
            start = e * spec.stride // 4096 * 4096
            end = -(-(e + 1) * spec.stride // 4096) * 4096
            done += min(os.preadv(fds[i], [memoryview(buf)[: end - start]], start), spec.stride)  # the record's bytes
    except OSError:
        return {"bytes_per_s": 0.0, "record_bytes": float(stride)}
    finally:
        for fd in fds.values():
            os.close(fd)
        buf.close()
    return {"bytes_per_s": done / max(time.perf_counter() - t0, 1e-9), "record_bytes": float(stride)}


def limits(run: Run, stats: dict[str, Any], disk: dict[str, float] | None, ref: Run | None) -> dict[str, Any]:
    """The two limits a streamed decode is held to and where its time went: the I/O limit (the
    disk's bandwidth over the misses' bytes per token), the compute limit (all-resident tok/s, when
    it ran), and the decode's time split into reads the model waited for and the rest."""
    # Decoding's misses per decode token (the prompt's reads are its own: they bound the first token).
    decode_tokens = stats.get("decode_steps_counted") or len(run.tokens) - 1
    if decode_tokens > 0 and "decode_bytes_read" in stats:
        miss_bytes = float(stats["decode_bytes_read"]) / decode_tokens
    else:
        miss_bytes = float(stats.get("bytes_read", 0)) / max(1, len(run.tokens))
    io_limit = (disk["bytes_per_s"] / miss_bytes) if disk and miss_bytes > 0 and disk["bytes_per_s"] > 0 else None
    compute = ref.decode_tokens_per_s if ref is not None else None
    known = {name: x for name, x in (("compute limit", compute), ("I/O limit", io_limit)) if x}
    bound = min(known.values()) if known else None
    seconds = max(run.end - run.start, 1e-9)
    # The stream's own reads, the fill path's stalls, and waits for streamed reads: the time the
    # model waited for the disk (a streamed read's own time overlaps compute and is not counted).
    waited = (float(stats.get("stall_time_s", 0.0)) + float(stats.get("fault_time_s", 0.0))
              + float(stats.get("read_wait_s", 0.0)))
    return {
        "miss_bytes_per_token": miss_bytes,
        # the decode steps the read counters cover, and what they read (miss_bytes_per_token's terms)
        "decode_steps": decode_tokens,
        "decode_demands": stats.get("decode_demands"),  # distinct experts routed in them, all layers
        "decode_bytes_read": stats.get("decode_bytes_read"),
        "disk_bytes_per_s": disk["bytes_per_s"] if disk else None,
        "io_limit_tokens_per_s": io_limit,
        "compute_limit_tokens_per_s": compute,
        "of_limit": (run.decode_tokens_per_s / bound) if bound else None,
        # what of_limit is held to: both limits' min, or the one of them that was measured
        "of_limit_against": (None if not known else "min(compute, I/O limit)" if len(known) == 2
                             else next(iter(known))),
        "read_wait_s": waited,
        "other_s": max(0.0, seconds - waited),
    }


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
    args.resident = resident_of(args)
    import anyio
    import mlx.core as mx

    from .models import ForwardOptions, load_reference_model, load_streaming_model
    from .models.embedded import ensure_embedded_default
    from .models.forcing import force_reference
    from .models.forward import StepMode
    from .models.predict import choose_predictor
    from .store import ExpertStore

    if args.tokens < 1:
        raise SystemExit(f"asyncside demo: --tokens must be >= 1, got {args.tokens}")
    if args.lookahead_extra < 0:
        raise SystemExit(f"asyncside demo: --lookahead-extra must be >= 0, got {args.lookahead_extra}")
    if args.model is None:
        _model_dir, store_dir = ensure_embedded_default(args.cache_dir, progress=not args.json)
    else:
        from .hub import needs_a_tokenizer, store_for

        store_dir = store_for(args.model, cache_dir=args.cache_dir, progress=not args.json,
                              needs=needs_a_tokenizer("--prompt cannot be encoded"))
    store = ExpertStore.open(store_dir)
    side_rows_refused(store, getattr(args, "side_rows", None))  # before a model loads or the reference runs
    sm = load_streaming_model(store_dir)
    streamed = {"auto": None, "on": True, "off": False}[getattr(args, "streamed_switch", "auto")]
    options = ForwardOptions(mode=args.mode, lookahead_extra=args.lookahead_extra, streamed_switch=streamed)
    prompt_ids = prompt_tokens(sm.tokenizer, args.prompt, store_dir)
    eos = set(getattr(sm.tokenizer, "eos_token_ids", ()) or ())

    # The trace demo_main read (a pipe such as <(...) reads once), else the file.
    replay = (sm.set_routing(getattr(args, "routing_trace", None) or args.routing,
                             sequence=getattr(args, "routing_sequence", None) or 0, source=str(args.routing))
              if getattr(args, "routing", None) else None)
    args.predictor, note = choose_predictor(args.predictor, replay)
    notes = [note] if note else []
    if replay is not None:  # which sequence, how short, whether mapped: a trace of another shape says so
        notes.insert(0, f"routing {replay.describe()['note']}")
    if getattr(args, "record_routing", None) and args.predictor in ("lookahead", "trace") and args.mode == "auto":
        # Queued steps do not run the predictor: per-layer steps record its prediction of every layer.
        options = dataclasses.replace(options, mode=StepMode.PER_LAYER)
        notes.append(f"--record-routing: the streaming run goes per layer, so the file carries the "
                     f"{args.predictor} predictor's predictions")
    if not (args.quiet or args.json):
        for line in notes:
            print(f"note: {line}", flush=True)
    runtime = demo_runtime(store, args)
    # The reference first: what it leaves in the process counts in the plan made before it runs.
    reference, why = choose_reference(store, getattr(args, "reference", "auto"), getattr(args, "memory", None),
                                      getattr(args, "resident", None))
    refuse_early(sm, runtime, prompt_ids, args, reference_keeps(store, reference))
    ref: Run | None = None
    if reference == "all-resident":
        # First (it also warms MLX's kernels for both runs alike).
        ref_model, _config = load_reference_model(store_dir)
        if replay is not None:
            force_reference(ref_model, sm.arch.block_attr, replay)  # the same routing as the streaming run
        reference_run(ref_model, prompt_ids, 2, eos)  # warm-up, not timed
        ref = reference_run(ref_model, prompt_ids, args.tokens, eos)
        del ref_model
        mx.clear_cache()
        release_freed_heap()  # its freed weights would stay in the process, charged to the budget
    if not (args.quiet or args.json):
        print(f"reference: {reference} ({why})", flush=True)
    disk = probe_disk(store) if getattr(args, "memory", None) is not None else None

    echo = _echo_to(sys.stdout, sm.tokenizer, enabled=not (args.quiet or args.json))
    if args.model is None and not (args.quiet or args.json):
        print(EMBEDDED_NOTICE, flush=True)
    run, stats, audit_ok = anyio.run(
        _streaming_run, sm, store, runtime, prompt_ids, args, echo, options,
        backend="asyncio", backend_options={"use_uvloop": sys.platform != "win32"},
    )
    if not (args.quiet or args.json):
        print(flush=True)
    if reference == "slot-cache":
        # The streaming run's pools are done with (its figures are in stats): freed before the slot
        # cache builds its own, which choose_reference counts as nothing beside them.
        del runtime
        gc.collect()  # the runtime's task group and scheduler hold it in reference cycles
        mx.clear_cache()
        release_freed_heap()
        ref = slot_cache_run(sm, store, prompt_ids, args.tokens, eos, stats["memory"],
                             side_rows=getattr(args, "side_rows", None))

    run_f = run.figures()
    ref_f = ref.figures() if ref is not None else {k: 0.0 for k in run_f}
    identical: bool | None = run.tokens == ref.tokens if ref is not None else None
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
        # what the pools hold, of every layer's experts (more than asked where rows_raised says why)
        "pools_fraction": stats.pop("pools_fraction"),
        "rows_raised": stats.pop("rows_raised"),
        "memory": stats.pop("memory"),
        "pool_rows_per_layer": stats.pop("pool_rows_per_layer"),
        "pool_rows_split": stats.pop("pool_rows_split", None),  # per layer, when a rows profile split them
        "experts_per_layer": stats.pop("experts_per_layer"),
        "reader": stats.get("reader"),
        "policy": args.policy,
        "predictor": args.predictor,
        "predictor_notes": notes,
        # precision = predicted ids the layer then routed / predicted ids; recall = routed ids that
        # were predicted / routed ids; distinct ids per (token, MoE layer), over the steps that ran
        # the predictor (per-layer steps, and queued steps while they prefetch)
        "prediction": stats.pop("prediction"),
        # queued steps' prefetches: records read, of them routed (hits they brought), failed reads
        "prefetch": {"reads": stats.get("prefetch_reads", 0), "routed": stats.get("prefetch_hits", 0),
                     "failed": stats.get("prefetch_failures", 0)},
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
        "direct": bool(stats.get("direct", args.direct)),
        "reference": reference,
        "reference_why": why,
        "peak_rss_bytes": stats.pop("peak_rss_bytes"),
        "disk_read_bytes": stats.pop("disk_read_bytes"),
        # decoding alone (after the first token): what the process read from the disk against the
        # bytes of the records it missed (1.0: every byte read was a miss's)
        "decode_disk_over_misses": (stats["decode_disk_read_bytes"] / stats["decode_bytes_read"]
                                    if stats.get("decode_bytes_read") else None),
        "limits": limits(run, stats, disk, ref if reference == "all-resident" else None),
        "routing": None if replay is None else {"file": str(args.routing), "tokens": replay.n_tokens,
                                                "meta": replay.trace.meta, **replay.describe()},
        "tokens_identical": identical,
        "audit_clean": audit_ok,
        "streaming": run_f,
        # The reference's figures under the name of the run that made them (null: that one did not
        # run; "reference" says which did)
        "all_resident": ref_f if reference == "all-resident" else None,
        "slot_cache": ref_f if reference == "slot-cache" else None,
        # The slot cache's demand reads (the all-resident reference reads nothing; none: no run)
        "reference_reads": ({k: ref.stats[k] for k in ("hit_rate", "bytes_read", "stall_time_s")}
                            if reference == "slot-cache" and ref is not None and ref.stats else None),
        # null where no reference ran (or it timed nothing): there is no ratio, not a ratio of 0
        "speed_ratio": run_f["tokens_per_s"] / ref_f["tokens_per_s"] if ref_f["tokens_per_s"] else None,
        "decode_speed_ratio": (run_f["decode_tokens_per_s"] / ref_f["decode_tokens_per_s"]
                               if ref_f["decode_tokens_per_s"] else None),
        "hit_rate": stats["hit_rate"],
        "bytes_read": int(stats["bytes_read"]),
        "resident_bytes": int(stats.get("resident_bytes", 0)),
        "stall_time_s": stats["stall_time_s"],
        "loop_lag": stats.pop("loop_lag"),
        "runtime": {k: v for k, v in stats.items()},
        "text": sm.tokenizer.decode(run.tokens),
        "reference_text": sm.tokenizer.decode(ref.tokens) if ref is not None else None,
    }
    return result


def of_limit_label(result: dict[str, Any]) -> str:
    """What a demo ``result``'s ``limits.of_limit`` is held to, in the table's words: both limits'
    min, or the one measured and why the other was not."""
    lim = result["limits"]
    against = lim.get("of_limit_against") or "min(compute, I/O limit)"
    if against == "I/O limit":
        ran = {"slot-cache": "the reference was the slot cache", "none": "no reference ran"}.get(
            result["reference"], "no all-resident run")
        return f"the I/O limit (compute limit not measured: {ran})"
    if against == "compute limit":
        disk = lim.get("disk_bytes_per_s")
        why = ("the disk is probed under --memory only" if disk is None
               else "the disk probe read nothing" if not disk else "no misses while decoding")
        return f"the compute limit (I/O limit not measured: {why})"
    return against


def reference_figures(result: dict[str, Any]) -> dict[str, Any] | None:
    """The figures of the reference run of a demo ``result`` (under ``all_resident`` or
    ``slot_cache``, as ``result["reference"]`` names it); None when no reference ran."""
    key = {"all-resident": "all_resident", "slot-cache": "slot_cache"}.get(result["reference"])
    return result.get(key) if key else None


def title(result: dict[str, Any]) -> str:
    """The table's title: the model, and what its pools hold."""
    held = result.get("pools_fraction")
    held = result["resident_fraction"] if held is None else held
    return f"asyncside demo — {result['model']}, {held:.0%} of experts in pools ({rows_note(result)})"


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result["streaming"]
    r = reference_figures(result) or {k: 0.0 for k in s}
    table = Table(title=title(result))
    table.add_column("")
    table.add_column("streaming (asyncside)", justify="right")
    table.add_column({"all-resident": "all-resident (mlx-lm)", "slot-cache": "slot cache (reference)",
                      "none": "no reference"}[result["reference"]], justify="right")
    table.add_column("ratio", justify="right")
    # --reference none ran no reference: its figures are placeholders (zeros), shown as dashes
    ran = result["reference"] != "none"

    def ref(text: str) -> str:
        return text if ran else "—"

    def ratio(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}x"

    table.add_row("tokens/s (whole run)", f"{s['tokens_per_s']:.2f}", ref(f"{r['tokens_per_s']:.2f}"),
                  ratio(result["speed_ratio"]))
    table.add_row("decode tokens/s", f"{s['decode_tokens_per_s']:.2f}", ref(f"{r['decode_tokens_per_s']:.2f}"),
                  ratio(result["decode_speed_ratio"]))
    table.add_row("time to first token", f"{s['ttft_s'] * 1e3:.0f} ms", ref(f"{r['ttft_s'] * 1e3:.0f} ms"), "")
    table.add_row("tokens", str(s["tokens"]), ref(str(r["tokens"])), "")
    rt = result["runtime"]
    # All-resident reads nothing; the slot cache reads its misses, one at a time
    reads = result.get("reference_reads")
    if result["reference"] == "all-resident":
        ref_hits, ref_bytes, ref_stall = "100%", "0", "0"
    elif reads:
        ref_hits = f"{reads['hit_rate']:.1%}"
        ref_bytes, ref_stall = f"{reads['bytes_read'] / 1e6:.1f} MB", f"{reads['stall_time_s'] * 1e3:.1f} ms"
    else:
        ref_hits = ref_bytes = ref_stall = ""
    table.add_row("hit rate (demand)", f"{result['hit_rate']:.1%}", ref_hits, "")
    table.add_row("bytes read while generating", f"{result['bytes_read'] / 1e6:.1f} MB", ref(ref_bytes), "")
    table.add_row("fills / evictions", f"{int(rt['fills'])} / {int(rt['evictions'])}", "", "")
    table.add_row("stall time (awaiting reads)", f"{result['stall_time_s'] * 1e3:.1f} ms", ref(ref_stall), "")
    mem = result["memory"]
    table.add_row("pools / memory budget (page cache left)",
                  f"{describe_bytes(mem['pool_bytes'])} / {describe_bytes(mem['budget_bytes'])} "
                  f"({describe_bytes(mem['page_cache_bytes'])})", "", "")
    table.add_row("peak RSS", f"{result['peak_rss_bytes'] / 2**20:.0f} MiB", "", "")
    table.add_row("read from the disk while generating (process)", f"{result['disk_read_bytes'] / 1e6:.1f} MB", "", "")
    if result.get("decode_disk_over_misses") is not None:
        table.add_row("decoding: disk bytes / misses' bytes", f"{result['decode_disk_over_misses']:.3f}x", "", "")
    lim = result["limits"]
    if lim["io_limit_tokens_per_s"] is not None:
        table.add_row("disk (O_DIRECT, one record at a time) / misses per decode token",
                      f"{lim['disk_bytes_per_s'] / 1e9:.2f} GB/s / {lim['miss_bytes_per_token'] / 1e6:.1f} MB", "", "")
        table.add_row("I/O limit (disk / misses per token)", f"{lim['io_limit_tokens_per_s']:.2f} tok/s", "", "")
    if lim["of_limit"] is not None:
        table.add_row(f"decode tokens/s of {of_limit_label(result)}", f"{lim['of_limit']:.2f}x", "", "")
    table.add_row("time waiting for reads / the rest",
                  f"{lim['read_wait_s']:.2f} s / {lim['other_s']:.2f} s", "", "")
    table.add_row("faults per token, p50 / p99 fault time",
                  f"{result['faults_per_step']:.2f}, {result['fault_latency_p50_ms']:.2f} / "
                  f"{result['fault_latency_p99_ms']:.2f} ms", "", "")
    lag = result["loop_lag"]
    table.add_row("event-loop lag, max / p99 (5 ms ticker)", f"{lag['max_ms']:.1f} / {lag['p99_ms']:.1f} ms", "", "")
    pq = result["prediction"]
    table.add_row("predictions: precision / recall",
                  f"{pq['precision']:.1%} / {pq['recall']:.1%} over {pq['token_layers']} token-layers"
                  if pq["token_layers"] else "none counted (no step ran the predictor)", "", "")
    pf = result["prefetch"]
    if pf["reads"] or pf["failed"]:
        table.add_row("prefetched in queued steps: records / routed",
                      f"{pf['reads']} / {pf['routed']} ({pf['routed'] / max(pf['reads'], 1):.0%})"
                      + (f", {pf['failed']} failed" if pf["failed"] else ""), "", "")
    table.add_row("reader / policy / predictor",
                  f"{result['reader']} / {result['policy']} / {result['predictor']}"
                  + (f"+{result['lookahead_extra']}" if result["lookahead_extra"] else "")
                  + f" / {result['decode_steps']} steps"
                  + (" / O_DIRECT" if result["direct"] else ""), "", "")
    same = result["tokens_identical"]
    table.add_row("tokens identical", "not checked" if same is None else ("yes" if same else "NO"), "", "")
    table.add_row("ledger audit", "clean" if result["audit_clean"] else "FAILED", "", "")
    Console(stderr=False).print(table)


def ranks_problem(args: argparse.Namespace) -> str | None:
    """Why the options given beside ``--ranks N`` cannot run as asked (None: they can): the ranks
    take only the pools' share, side rows, policy, reader and predictor, and step per layer; an
    option they would ignore is named, with why, rather than dropped."""
    mode, switch = getattr(args, "mode", "auto"), getattr(args, "streamed_switch", "auto")
    reference, extra = getattr(args, "reference", "auto"), getattr(args, "lookahead_extra", 0)
    per_layer = "each rank's stage steps its layers one at a time, handing the activations on"
    ignored = [
        (mode != "auto", f"--mode {mode}", f"{per_layer}, whatever the mode"),
        (switch != "auto", f"--streamed-switch {switch}", f"{per_layer}, and the streamed switch is a queued step's"),
        (bool(getattr(args, "direct", False)), "--direct",
         "the ranks' runtimes read as the memory plan chooses and take no O_DIRECT"),
        (reference != "auto", f"--reference {reference}",
         "the pipeline's tokens are checked against the one-process streaming run, not another reference"),
        (getattr(args, "rows_profile", None) is not None, "--rows-profile", "each rank's pools hold --resident of its "
         "own layers' experts; a profile's split of the rows between layers is a one-process plan"),
        (extra != 0, f"--lookahead-extra {extra}", "the ranks' lookahead names the router's k experts"),
        (getattr(args, "predictor", None) == "trace", "--predictor trace",
         "it replays a --routing file's predictions, and the ranks replay no routing"),
        (bool(getattr(args, "no_verify", False)), "--no-verify", "the ranks check every record they read"),
        (getattr(args, "host_tier", "auto") != "auto", "--host-tier", "the ranks' runtimes size their own host tier"),
    ]
    for given, option, why in ignored:
        if given:
            return f"{option} with --ranks {args.ranks}: {why}; leave it out, or run without --ranks"
    return None


def _record_clash(args: argparse.Namespace) -> str | None:
    """Why ``--record-routing FILE`` cannot be written (None: it can): FILE is the trace that
    ``--routing`` or ``--rows-profile`` reads, which the recording would replace."""
    out = getattr(args, "record_routing", None)
    if not out or not os.path.exists(out):
        return None
    for option in ("routing", "rows_profile"):
        given = getattr(args, option, None)
        if given and os.path.exists(given) and os.path.samefile(given, out):
            return (f"--record-routing {out} is the --{option.replace('_', '-')} file {given}: the recording would "
                    f"replace the trace it reads; record to another file")
    return None


def _lookahead_extra_problem(args: argparse.Namespace) -> str | None:
    """Why ``--lookahead-extra N`` would do nothing (None: it widens the predictor that runs): only the
    lookahead names experts beyond the router's k, and it is neither asked for nor, with ``--routing``,
    the default."""
    extra, asked = getattr(args, "lookahead_extra", 0), getattr(args, "predictor", None)
    if not extra or asked == "lookahead" or (asked is None and not getattr(args, "routing", None)):
        return None
    runs = (f"this run's predictor is {asked} (--predictor {asked})" if asked is not None else
            "this run's predictor is the --routing trace's own predictions, or temporal where it carries none")
    return (f"--lookahead-extra {extra} widens the lookahead predictor's sets, and {runs}: give --predictor "
            f"lookahead, or leave --lookahead-extra out")


def routing_sequence_problem(routing: str | None, sequence: int | None, trace: Any = None) -> str | None:
    """Why ``--routing-sequence sequence`` cannot be replayed from ``--routing routing`` (None: it
    can), said before a model loads: the option given without a trace (``sequence`` None: not
    given, so a given 0 is refused too), or a trace without that sequence; it starts with the
    option's name, as a usage error does (``demo``, ``bench generate`` and ``bench offload`` say it
    as ``error: --routing-sequence ...``, exit status 2). ``trace``: the file already loaded, else it
    is loaded here; a bad file raises its TraceError (one line naming it)."""
    if sequence is None:
        return None
    if not routing:
        return "--routing-sequence picks a sequence of a --routing trace: give --routing FILE"
    if not sequence:
        return None
    if trace is None:
        from .routing import RoutingTrace

        trace = RoutingTrace.load(routing)
    n = int(trace.n_sequences)
    if sequence < n:
        return None
    return f"--routing-sequence {sequence} out of range: {routing} has {n} sequence{'s' if n != 1 else ''}"


def demo_main(args: argparse.Namespace) -> int:
    """Run the demo; 0 when tokens are identical and every ledger audits clean, else 1."""
    args.resident = resident_of(args)
    if not getattr(args, "routing", None):  # --ranks too: the option is never silently ignored
        problem = routing_sequence_problem(None, getattr(args, "routing_sequence", None))
        if problem is not None:
            print(f"asyncside demo: error: {problem}", file=sys.stderr)
            return 2
    if args.ranks != 1:
        args.predictor = args.predictor or "lookahead"
        if getattr(args, "routing", None) or getattr(args, "record_routing", None):
            print("asyncside demo: error: --routing / --record-routing run in one process (not with --ranks)",
                  file=sys.stderr)
            return 2
        problem = ranks_problem(args)
        if problem is not None:
            print(f"asyncside demo: error: {problem}", file=sys.stderr)
            return 2
        from .distributed.demo import ranks_demo_main

        return ranks_demo_main(args)
    if getattr(args, "routing", None):  # read once, before anything loads: a bad file is refused now
        from .routing import RoutingTrace

        args.routing_trace = RoutingTrace.load(args.routing)
    problem = (routing_sequence_problem(getattr(args, "routing", None), getattr(args, "routing_sequence", None),
                                        getattr(args, "routing_trace", None))
               or _record_clash(args) or _lookahead_extra_problem(args))
    if problem is not None:
        print(f"asyncside demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        result = run_demo(args)
    except AsyncsideError as exc:  # e.g. pools that cannot fit the memory available: say so, no traceback
        print(f"asyncside demo: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _table(result)
        if result["tokens_identical"] is False:
            print(f"asyncside demo: tokens differ from the {result['reference']} run:\n"
                  f"  streaming:    {result['text']!r}\n  {result['reference'] + ':':<13} {result['reference_text']!r}",
                  file=sys.stderr)
    return 0 if result["tokens_identical"] is not False and result["audit_clean"] else 1


if __name__ == "__main__":  # pragma: no cover - `python -m asyncside.demo`
    from .cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
