"""``asyncside bench generate``: decode speed of asyncside beside mlx-lm all-resident and a plain slot cache.

Everything runs in one process, in **paired rounds**, after a warm-up. In every round, for every
residency, one greedy generation (same prompt, same token count) of each system, interleaved (odd
rounds in reverse order):

- **mlx-lm all-resident**: the plain mlx-lm model through mlx-lm's own ``generate_step`` (the
  reference for tokens and for speed);
- **asyncside**: :class:`asyncside.Runtime` with its pools holding that share of each layer's
  experts, once per step mode (``--modes``: how the forward runs a decode step, see
  :func:`set_step_mode`) and predictor (``--predictors``);
- **slot cache**: the plain synchronous baseline (:mod:`asyncside.bench.slot_cache`): per MoE layer
  as many LRU slots as the runtime has rows, the routed ids evaluated per layer, misses read with
  ``preadv`` on the calling thread, then the gather from the slots.

Each round also runs asyncside's forward over all experts (:class:`ResidentSource`) once: the
forward's own overhead. A row's ratios are taken **per round** (its run over the mlx-lm run and
over the slot-cache run of the same round and residency) and the row reports their median.

Per run, over the decode steps only (from the first generated token to the last): decode
tokens/s; the **loop-thread CPU time per step** (``time.thread_time`` on the thread driving the
generation: the event-loop thread for asyncside, the caller's for mlx-lm's generate loop and the
slot cache; compute threads are not counted) and the process CPU time per step; for asyncside and
the slot cache the hit rate (distinct routed experts per layer visit found in a row), the bytes
read per token and the misses' bytes per token (misses x record stride).

Page cache: **warm** runs read the whole store once first. **cold** runs read every expert from
the disk: asyncside with ``direct=True`` (O_DIRECT), the slot cache with O_DIRECT whole-record
reads, and, when running as root, the page cache dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``)
before each cold run. The method used is in the JSON (``cold_method``).

``--load N`` starts N CPU-bound busy processes beside the runs (stopped at the end): every
system then runs as loaded as the mlx-lm run it is compared with.

Hit rates of the policies: one :class:`RoutingTrace` is recorded (per-layer steps, all-resident;
the lookahead predictor, or under ``--routing`` the trace's own predictions or temporal: see
:func:`asyncside.models.predict.choose_predictor`), then every ledger policy is replayed over it at
each residency (the runtime's resident set and side rows), demand only and with the recorded
predictions as prefetches, beside Belady's MIN; and with every row dynamic, starting empty (close to the slot
cache's arrangement, which starts holding the resident set), LRU beside Belady's MIN.

Models: the embedded model (default), a converted store (``--model``), or a realistic shape built
once from seeded weights (``--shape qwen3-30b-a3b``, ``--layers N``, ``--vocab``; see
:mod:`asyncside.bench.shapes`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import mmap
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..argtypes import Once, directory, file_name, int_at_least, parse_resident
from ..demo import Run, positive_int, prompt_tokens, routing_sequence_problem
from ..policies import DEFAULT_POLICY, POLICY_NAMES
from . import check_store_dir, require_extra
from .machine import machine_info
from .shapes import SHAPES, SMALL_VOCAB

if TYPE_CHECKING:  # for annotations; the functions import the models where they use them
    from ..models import ForwardOptions
    from ..models.embedded import EmbeddedSpec

#: a short prompt: decode speed is what residency changes; a long prefill at low residency splits
#: into many capacity groups and would dominate the run time (its cost shows in ``ttft_s``)
DEFAULT_PROMPT = "Only the experts a token needs are read. "
DEFAULT_RESIDENCIES = (0.25, 0.5, 0.75)
#: how asyncside's forward runs a decode step (:func:`set_step_mode`)
STEP_MODES = ("default", "queued", "per-layer", "whole", "per-layer-nospec")
PREDICTORS = ("lookahead", "temporal", "trace", "none")
POLICIES = ("lrfu", "lru", "lfu", "aging-lfu", "oneshot")
MLX_LM = "mlx-lm"
#: below this many tokens a run, decode figures are flagged as a smoke test (:func:`short_run_note`)
SHORT_RUN_TOKENS = 16
SLOT_CACHE = "slot-cache"
#: the decode targets checked against each run: (device kind, residency) -> minimum decode ratio to
#: all-resident / to the slot cache; loop CPU and bytes read as maxima; the loaded ratio as a minimum
TARGETS: dict[str, Any] = {
    "vs_all_resident": {("cpu", 0.25): 0.97, ("gpu", 0.25): 0.6, ("gpu", 0.5): 0.75},
    "vs_slot_cache": {("cpu", 0.25): 1.3, ("gpu", 0.25): 2.0, ("gpu", 0.5): 2.0},
    "loop_cpu_vs_mlx_lm": 1.2,
    "bytes_read_vs_miss_bytes": 1.05,
    "loaded_vs_all_resident": 0.9,
}


def _residency(text: str) -> float:
    """``--residency``: a fraction in [0, 1] or a percentage. 0 is a setting, as ``demo --resident 0``
    takes it: every expert streamed through the least rows the runtime plans (the model's top-k)."""
    try:
        return float(parse_resident(text, allow_auto=False))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``asyncside bench generate`` (the caller adds ``--json``)."""
    p.add_argument("--model", metavar="STORE_DIR", default=None,
                   help="a converted expert store (default: the embedded Qwen3-MoE model)")
    p.add_argument("--shape", metavar="NAME|CONFIG", default=None,
                   help=f"a realistic model shape with seeded weights, built once and cached (see --layers, --vocab): "
                        f"one of {', '.join(SHAPES)}, or a Hugging Face config.json (its directory, or a repo id "
                        f"org/name) whose MoE dimensions are built as a qwen3_moe (docs/models.md)")
    p.add_argument("--layers", metavar="N", type=int, default=None,
                   help="--shape with N MoE decoder layers instead of all (the full qwen3-30b-a3b has ~18 GB of "
                        "experts)")
    p.add_argument("--vocab", metavar="V", default=None,
                   help=f"--shape vocabulary: 'full' (default, the real size), 'small' ({SMALL_VOCAB}) or a number")
    p.add_argument("--quick", action="store_true",
                   help="tiny model and run for CI smoke tests (about a minute; numbers are noise); with "
                        "--shape, 2 layers and the small vocabulary unless --layers / --vocab say otherwise")
    p.add_argument("--tokens", metavar="N", type=positive_int, default=None,
                   help="tokens generated per run (default 32)")
    p.add_argument("--repeats", metavar="N", type=int, default=None,
                   help="paired rounds of the warm runs; per-round ratios, medians reported (default 3)")
    p.add_argument("--cold-repeats", metavar="N", type=int, default=None,
                   help="paired rounds of the cold runs (default 2; 0 skips cold runs)")
    p.add_argument("--residency", metavar="F", type=_residency, nargs="+", default=None,
                   help="pool budgets as fractions of each layer's experts, 0.25 or 25%% (0: every expert streamed "
                        "through the least rows, the model's top-k; default 0.25 0.5 0.75)")
    p.add_argument("--modes", nargs="+", choices=STEP_MODES, default=None,
                   help="asyncside step modes to run, A/B in the same rounds (default: default, the forward's own)")
    p.add_argument("--predictors", nargs="+", choices=PREDICTORS, default=None,
                   help="asyncside predictors to run (default lookahead; with --routing: trace when the trace "
                        "carries predictions, else temporal)")
    p.add_argument("--verify", nargs="+", choices=("on", "off"), default=None,
                   help="asyncside runs with record checksums verified (on, the default) and/or not (off), "
                        "A/B in the same rounds (the slot cache never verifies)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--routing", metavar="FILE", type=file_name, action=Once, default=None,
                   help="replay a routing trace (.npz, docs/routing-traces.md) in every system, mlx-lm's too")
    p.add_argument("--routing-sequence", metavar="N", type=int_at_least(0), default=None,
                   help="which sequence of a --routing trace of several to replay (default 0, the first; needs "
                        "--routing)")
    p.add_argument("--rows-profile", metavar="FILE", type=file_name, action=Once, default=None,
                   help="split asyncside's pool rows between layers by this routing trace's miss curves "
                        "(Runtime(rows_profile=...); plan from another sequence than the one replayed)")
    p.add_argument("--policy", default=DEFAULT_POLICY,  # checked after parsing, with the other settings
                   help=f"eviction policy of asyncside's runs: {', '.join(POLICY_NAMES)} (default {DEFAULT_POLICY})")
    p.add_argument("--reader", default="auto", choices=["auto", "io_uring", "threads", "aiofiles"],
                   help="read backend of the runtime (default auto)")
    p.add_argument("--load", metavar="N", type=int, default=0,
                   help="run N CPU-bound busy processes beside the whole run (default 0)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="cold runs use O_DIRECT only, without dropping the page cache")
    p.add_argument("--plot", metavar="PATH", default="bench-out/generate.png",
                   help="PNG plot path (default bench-out/generate.png; 'none' to skip)")
    p.add_argument("--cache-dir", type=directory, default=None,
                   help="where the embedded model and the shapes are built (default: $ASYNCSIDE_CACHE, else "
                        "$XDG_CACHE_HOME/asyncside, else ~/.cache/asyncside)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for BENCHMARKS.md) instead")


# ---------------------------------------------------------------------------------------------
# Step modes


def step_options(mode: str) -> ForwardOptions:
    """The :class:`~asyncside.models.ForwardOptions` of a bench step mode (one of :data:`STEP_MODES`).

    - ``default``: the forward's own choice (queued steps where the source allows them);
    - ``queued``: one step queued per token, misses served inside the stream;
    - ``per-layer``: each MoE layer's routed ids awaited on the host, with the speculative
      in-graph gather from a row snapshot;
    - ``whole``: the step queued whole, every MoE layer gathering from a snapshot, checked after it
      computed and redone from its first unsound layer;
    - ``per-layer-nospec``: per layer, without the speculative gather (rows looked up on the host).
    """
    from ..models import ForwardOptions, StepMode

    options = {
        "default": ForwardOptions(),
        "queued": ForwardOptions(mode=StepMode.QUEUED),
        "per-layer": ForwardOptions(mode=StepMode.PER_LAYER),
        "whole": ForwardOptions(mode=StepMode.WHOLE),
        "per-layer-nospec": ForwardOptions(mode=StepMode.PER_LAYER, speculate=False),
    }
    if mode not in options:
        raise ValueError(f"unknown step mode {mode!r}; expected one of {list(STEP_MODES)}")
    return options[mode]


def set_step_mode(sm: Any, mode: str) -> None:
    """Make ``sm`` run its next generations' decode steps in ``mode`` (its ``options``)."""
    sm.options = step_options(mode)


def step_mode_of(sm: Any) -> str:
    """The step mode ``sm``'s options name (``auto``: queued steps where the source allows them)."""
    options = sm.options
    if options.mode == "per-layer" and not options.speculate:
        return "per-layer-nospec"
    return str(options.mode.value)


# ---------------------------------------------------------------------------------------------
# Page cache control, load


def warm_store(store: Any) -> int:
    """Read every blob of ``store`` once (into the page cache); returns bytes read."""
    total = 0
    for spec in store.layers.values():
        with open(spec.path, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                total += len(chunk)
    return total


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when not permitted (not root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def o_direct_works(path: str | os.PathLike[str]) -> bool:
    """Whether an aligned O_DIRECT read of ``path`` succeeds on its filesystem."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        buf.close()
        return False
    try:
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


def _can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


@contextlib.contextmanager
def busy_load(n: int) -> Iterator[list[int]]:
    """``n`` CPU-bound busy processes (a Python spin loop each) while the block runs; yields their pids.

    They are killed and reaped on the way out, whatever happens in the block.
    """
    if n < 0:
        raise ValueError(f"--load must be >= 0, got {n}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


# ---------------------------------------------------------------------------------------------
# Runs


@dataclass
class BenchRun(Run):
    """A :class:`Run` with the figures of its decode steps: loop-thread and process CPU time, and
    the source's counters at the first token (``stats_first``) and at the end (``stats``)."""

    cpu_first: float = 0.0
    cpu_last: float = 0.0
    proc_first: float = 0.0
    proc_last: float = 0.0
    stats_first: dict[str, Any] = field(default_factory=dict)
    #: the forward's counters over the run (asyncside runs)
    counters: dict[str, float] = field(default_factory=dict)
    #: experts a decode step demands (MoE layers x top-k; 0: unknown): the steps the counters cover
    demands_per_step: int = 0

    def arrived(self, tok: int, stats: Callable[[], dict[str, Any]] | None = None) -> None:
        """Record one generated token; on the first, also the source's counters (``stats()``)."""
        if not self.tokens and stats is not None:
            self.stats_first = dict(stats())
        cpu, proc = time.thread_time(), time.process_time()
        if not self.tokens:
            self.cpu_first, self.proc_first = cpu, proc
        self.cpu_last, self.proc_last = cpu, proc
        self.first_token()
        self.tokens.append(tok)

    @property
    def decode_steps(self) -> int:
        return max(len(self.tokens) - 1, 0)

    def decode_stats(self) -> dict[str, float]:
        """The source's numeric counters over the decode steps (end minus first token)."""
        out: dict[str, float] = {}
        for k, v in self.stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v - self.stats_first.get(k, 0)
        return out

    def counted_steps(self) -> float:
        """The decode steps the source's counters cover: their demands over a step's (batch one:
        each MoE layer demands top-k distinct experts). Queued steps queue the next step before its
        token is awaited, so some or all of the first decode step's demands are counted before the
        first token arrives: its counters then cover fewer steps than the tokens after the first."""
        steps = self.decode_steps
        if not self.demands_per_step or not steps:
            return float(steps)
        d = self.decode_stats()
        demands = d.get("hits", 0) + d.get("misses", 0)
        return demands / self.demands_per_step if demands else float(steps)

    def decode_figures(self, record_bytes: int) -> dict[str, Any]:
        """Decode speed, CPU per step, and (with a source) hit rate and bytes per token (over the
        steps the counters cover: :meth:`counted_steps`)."""
        steps = self.decode_steps
        out: dict[str, Any] = {
            "tokens": len(self.tokens),
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "tokens_per_s": self.tokens_per_s,
            "ttft_s": self.ttft_s,
            "loop_cpu_ms_per_token": (self.cpu_last - self.cpu_first) / steps * 1e3 if steps else None,
            "process_cpu_ms_per_token": (self.proc_last - self.proc_first) / steps * 1e3 if steps else None,
            "hit_rate": None, "bytes_read_per_token": None, "miss_bytes_per_token": None,
        }
        if self.stats and steps:
            d = self.decode_stats()
            hits, misses = d.get("hits", 0), d.get("misses", 0)
            out["hit_rate"] = hits / (hits + misses) if hits + misses else 1.0
            counted = self.counted_steps()
            out["bytes_read_per_token"] = d.get("bytes_read", 0) / counted
            out["miss_bytes_per_token"] = misses * record_bytes / counted
        return out


def _anyio_run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    import anyio

    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": sys.platform != "win32"})


def _reference_run(model: Any, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> BenchRun:
    """Greedy tokens of the plain mlx-lm model through its own ``generate_step``, timed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from ..models.forcing import rewind_reference

    rewind_reference(model)  # a replayed routing starts at position 0 again
    run = BenchRun(start=time.perf_counter())
    for y, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        tok = int(y)
        if tok in eos:
            break
        run.arrived(tok)
    run.end = time.perf_counter()
    return run


async def _generate(sm: Any, source: Any, prompt_ids: list[int], tokens: int, predictor: str) -> BenchRun:
    """One asyncside generation over ``source``, timed (the source's counters when it has ``stats()``)."""
    stats = getattr(source, "stats", None)
    stats = stats if callable(stats) else None
    before = dict(getattr(sm.forward, "counters", {}))
    run = BenchRun(start=time.perf_counter())
    async for tok in sm.generate(prompt_ids, max_tokens=tokens, source=source, predictor=predictor):
        run.arrived(tok, stats)
    run.end = time.perf_counter()
    if stats is not None:
        run.stats = dict(stats())
    after = getattr(sm.forward, "counters", {})
    run.counters = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
    return run


async def _resident_run(sm: Any, source: Any, prompt_ids: list[int], tokens: int) -> BenchRun:
    set_step_mode(sm, "default")
    return await _generate(sm, source, prompt_ids, tokens, "none")


async def _asyncside_run(sm: Any, store: Any, prompt_ids: list[int], tokens: int, cfg: Config,
                         residency: float, cold: bool, s: Settings) -> BenchRun:
    from ..runtime import Runtime

    set_step_mode(sm, cfg.mode)
    direct = True if (cold and s.direct_ok) else None
    async with Runtime(store, resident=residency, policy=s.policy, reader=s.reader, direct=direct,
                       verify=cfg.verify, rows_profile=s.rows_profile) as rt:
        run = await _generate(sm, rt, prompt_ids, tokens, cfg.predictor)
        await rt.drain()
        run.stats = rt.stats().as_dict()
        run.audit_ok = all(r.ok for r in rt.audit().values()) and not any(
            rt.ledger(layer).pending() for layer in store.layers)
    return run


def _slot_run(sm: Any, store: Any, prompt_ids: list[int], tokens: int, residency: float, cold: bool,
              s: Settings, eos: set[int]) -> BenchRun:
    from .slot_cache import SlotCache, slot_generate

    with SlotCache(store, residency, direct=cold and s.direct_ok) as sc:
        run = BenchRun(start=time.perf_counter())
        for tok in slot_generate(sm, sc, prompt_ids, max_tokens=tokens, eos_token_ids=eos):
            run.arrived(tok, sc.stats)
        run.end = time.perf_counter()
        run.stats = sc.stats()
    return run


@dataclass(frozen=True)
class Config:
    """One system of a round: mlx-lm, asyncside in one step mode with one predictor, the slot cache."""

    system: str
    mode: str = ""
    predictor: str = ""
    verify: bool = True  # asyncside: records checked against their checksums

    @property
    def key(self) -> str:
        if self.system != "asyncside":
            return self.system
        return f"asyncside/{self.mode}/{self.predictor}" + ("" if self.verify else "/noverify")


@dataclass
class Settings:
    tokens: int
    repeats: int
    cold_repeats: int
    residencies: tuple[float, ...]
    modes: tuple[str, ...]
    predictors: tuple[str, ...]
    policy: str
    reader: str
    load: int = 0
    verify: tuple[bool, ...] = (True,)
    direct_ok: bool = True
    drop: bool = True
    rows_profile: str | None = None  # Runtime(rows_profile=...): rows split between layers

    @property
    def configs(self) -> list[Config]:
        """A round's systems in the order they run: mlx-lm, asyncside's, the slot cache."""
        return ([Config(MLX_LM)] + [Config("asyncside", m, p, v) for m in self.modes for p in self.predictors
                                    for v in self.verify]
                + [Config(SLOT_CACHE)])


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(getattr(args, "quick", False))
    tokens = args.tokens if args.tokens is not None else (6 if quick else 32)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    cold_repeats = args.cold_repeats if args.cold_repeats is not None else (1 if quick else 2)
    if args.no_cold:
        cold_repeats = 0
    # A residency given twice ran twice a round into one row (its repeats doubled) and printed that row twice.
    residencies = (tuple(dict.fromkeys(args.residency)) if args.residency
                   else ((0.5,) if quick else DEFAULT_RESIDENCIES))
    modes = tuple(dict.fromkeys(args.modes)) if args.modes else ("default",)
    predictors = tuple(dict.fromkeys(args.predictors)) if args.predictors else ("lookahead",)
    verify = tuple(v == "on" for v in dict.fromkeys(getattr(args, "verify", None) or ["on"]))
    if tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (decode speed needs two tokens), got {tokens}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if cold_repeats < 0:
        raise ValueError(f"--cold-repeats must be >= 0, got {cold_repeats}")
    for r in residencies:
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"--residency values must be in [0, 1], got {r}")
    load = getattr(args, "load", 0) or 0
    if load < 0:
        raise ValueError(f"--load must be >= 0, got {load}")
    from ..policies import POLICIES as POLICY_NAMES

    if args.policy not in POLICY_NAMES:
        raise ValueError(f"--policy must be one of {sorted(POLICY_NAMES)}, got {args.policy!r}")
    return Settings(tokens=tokens, repeats=repeats, cold_repeats=cold_repeats, residencies=residencies,
                    modes=modes, predictors=predictors, policy=args.policy, reader=args.reader, load=load,
                    verify=verify, rows_profile=getattr(args, "rows_profile", None))


def _vocab(value: str | None) -> int | None:
    """``--vocab``: None for the shape's own (``full`` or absent), :data:`SMALL_VOCAB` for ``small``."""
    if value is None or value == "full":
        return None
    if value == "small":
        return SMALL_VOCAB
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--vocab must be 'full', 'small' or an integer, got {value!r}") from None


#: ``--quick`` with ``--shape``: the shape's MoE layers built unless ``--layers`` says otherwise
QUICK_SHAPE_LAYERS = 2


#: the quick model: the embedded architecture, shrunk (2 layers, 32 experts)
def _quick_spec() -> EmbeddedSpec:
    from ..models.embedded import EmbeddedSpec

    base = EmbeddedSpec()
    return EmbeddedSpec(
        config={**base.config, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
                "moe_intermediate_size": 128},
        profile_tokens=2,
    )


def _resolve_store(args: argparse.Namespace, verbose: bool) -> tuple[pathlib.Path, dict[str, Any]]:
    """(store directory, what it is) from ``--model`` / ``--shape`` / the embedded model."""
    from ..models.embedded import ensure_embedded_default
    from .shapes import ensure_shape

    shape = getattr(args, "shape", None)
    layers, vocab = getattr(args, "layers", None), getattr(args, "vocab", None)
    if shape is None and (layers is not None or vocab is not None):
        raise ValueError("--layers and --vocab apply to --shape only")
    if args.model is not None:
        if shape is not None:
            raise ValueError("--model and --shape are exclusive: a store, or a shape built for the bench")
        return check_store_dir("--model", args.model), {"kind": "store"}
    if shape is not None:
        if args.quick:  # a smoke run of the shape: a few layers and a small vocabulary unless asked
            layers = QUICK_SHAPE_LAYERS if layers is None else layers
            vocab = "small" if vocab is None else vocab
        build = ensure_shape(shape, layers=layers, vocab=_vocab(vocab), cache_dir=args.cache_dir, progress=verbose)
        info = {"kind": "shape", "shape": build["shape"], "source": build.get("source"),
                "built_as": build.get("built_as"), "note": build.get("note"), "layers": build["layers"],
                "vocab": build["vocab"],
                "built_now": build["built"], "build_seconds": build["build_seconds"],
                "store_bytes": build["store_bytes"]}
        return pathlib.Path(build["store"]), info
    spec = _quick_spec() if args.quick else None
    return ensure_embedded_default(args.cache_dir, spec=spec, progress=verbose)[1], {
        "kind": "embedded-quick" if args.quick else "embedded"}


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(statistics.median(vals)) if vals else None


def _label(cfg: Config, sm: Any) -> str:
    if cfg.system == MLX_LM:
        return "mlx-lm all-resident"
    if cfg.system == SLOT_CACHE:
        return "slot cache (sync, LRU)"
    mode = cfg.mode
    if mode == "default":
        set_step_mode(sm, "default")
        mode = f"default={step_mode_of(sm)}"
    return f"asyncside ({mode}, {cfg.predictor}{'' if cfg.verify else ', no verify'})"


def _summarise(runs: list[BenchRun], ref_tokens: list[int], record_bytes: int) -> dict[str, Any]:
    """Medians over rounds of every figure, the tokens check, the counters of the median run."""
    figs = [r.decode_figures(record_bytes) for r in runs]
    dec = [f["decode_tokens_per_s"] for f in figs]
    order = sorted(range(len(runs)), key=lambda i: dec[i])
    mid = runs[order[len(order) // 2]]
    out: dict[str, Any] = {"repeats": len(runs), "decode_tokens_per_s_all": dec}
    for k in ("decode_tokens_per_s", "tokens_per_s", "ttft_s", "loop_cpu_ms_per_token", "process_cpu_ms_per_token",
              "hit_rate", "bytes_read_per_token", "miss_bytes_per_token"):
        out[k] = _median([f[k] for f in figs])
    out["tokens"] = len(mid.tokens)
    out["tokens_identical"] = all(r.tokens == ref_tokens for r in runs)
    out["audit_clean"] = all(r.audit_ok for r in runs)
    if mid.stats:
        d = mid.decode_stats()
        out["decode_counters"] = {k: d[k] for k in ("hits", "misses", "bytes_read", "fills", "reads", "evictions",
                                                    "late", "prefetched", "stall_time_s") if k in d}
        out["decode_counters"]["steps"] = mid.counted_steps()
        out["reader"] = mid.stats.get("reader")
    if any(r.counters for r in runs):
        from ..models.predict import PREDICTION_COUNTERS, PredictionQuality

        # Over every round: precision and recall of the predictions the run's steps counted.
        out["prediction"] = PredictionQuality.from_counters(
            {k: sum(r.counters.get(k, 0) for r in runs) for k in PREDICTION_COUNTERS}).as_dict()
    if mid.counters:
        out["forward_counters"] = mid.counters
        if mid.counters.get("optimistic"):
            out["redo_rounds_per_whole_step"] = mid.counters.get("optimistic_redone", 0) / mid.counters["optimistic"]
    return out


# ---------------------------------------------------------------------------------------------
# Policies vs Belady


def policy_hit_rates(trace: Any, store: Any, residencies: Sequence[float],
                     policies: Sequence[str] = POLICIES, predictor: str = "lookahead") -> list[dict[str, Any]]:
    """Per residency: each policy's hit rate (demand only, and, as ``<policy>+<predictor>``, with the
    predictions the trace recorded from ``predictor`` as prefetches) beside Belady's MIN, replayed
    over the same trace; and with every row dynamic, starting empty, LRU beside Belady's MIN.

    Two MINs from the same start (empty side rows, the resident set pinned): with bypass
    (``belady``, ``vs_belady``), and under the ledger's rule (``belady_no_bypass``,
    ``vs_belady_no_bypass``: every demanded expert takes a row, a step larger than the side rows,
    a prefill, passing in groups; :func:`asyncside.policy_replay.belady_no_bypass`), the bound of
    every demand-only replay, which prefetches can pass (a prefetched expert counts as a hit)."""
    from ..models.trace import CacheResult, belady, replay_policy
    from ..policy_replay import Counts, belady_no_bypass
    from ..runtime import plan_layer

    def ruled(side: dict[int, int], pinned: dict[int, Sequence[int]]) -> float:
        """MIN under the ledger's rule summed over the trace's layers, its hit rate."""
        return sum((belady_no_bypass(trace.demands(l), pinned[l], side[l], groups=True) for l in trace.layers),
                   start=Counts()).hit_rate

    rows = []
    for frac in residencies:
        plans = {layer: plan_layer(store, layer, frac) for layer in trace.layers}
        n_exp = {layer: store.layer(layer).n_experts for layer in trace.layers}
        b = sum((belady(trace.demands(l), plans[l][0], plans[l][1]) for l in trace.layers), start=CacheResult())
        nb = ruled({l: plans[l][1] for l in trace.layers}, {l: plans[l][0] for l in trace.layers})
        row: dict[str, Any] = {
            "residency": frac,
            "resident_per_layer": len(next(iter(plans.values()))[0]),
            "side_rows": next(iter(plans.values()))[1],
            "belady": b.hit_rate,
            "belady_side_hit_rate": b.side_hit_rate,
            "belady_no_bypass": nb,
            "policies": {},
        }
        for pol in policies:
            for with_pred in (False, True):
                r = sum((replay_policy(trace.demands(l), n_exp[l], plans[l][0], plans[l][1], pol,
                                       predictions=trace.predictions(l) if with_pred else None)
                         for l in trace.layers), start=CacheResult())
                name = pol + (f"+{predictor}" if with_pred else "")  # under --routing: trace or temporal
                row["policies"][name] = {
                    "hit_rate": r.hit_rate,
                    "vs_belady": r.hit_rate / b.hit_rate if b.hit_rate else float("nan"),
                    "vs_belady_no_bypass": r.hit_rate / nb if nb else float("nan"),
                    "demand_reads": r.misses,
                    "prefetch_reads": r.prefetch_reads,
                }
        rows_all = {l: len(plans[l][0]) + plans[l][1] for l in trace.layers}
        ba = sum((belady(trace.demands(l), [], rows_all[l]) for l in trace.layers), start=CacheResult())
        la = sum((replay_policy(trace.demands(l), n_exp[l], [], rows_all[l], "lru") for l in trace.layers),
                 start=CacheResult())
        # From empty rows (the replays pin a resident set or start empty; the slot cache starts
        # holding the runtime's resident set, evictable: its measured hit rate is in the rows).
        row["all_rows_dynamic"] = {"rows": next(iter(rows_all.values())), "start": "empty",
                                   "belady": ba.hit_rate, "lru": la.hit_rate,
                                   "belady_no_bypass": ruled(rows_all, dict.fromkeys(trace.layers, []))}
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# The bench


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(f"[bench generate] {msg}", file=sys.stderr, flush=True)


def _read_traces_first(args: argparse.Namespace) -> Any:
    """Read ``--routing`` and ``--rows-profile``: a bad file is refused (TraceError naming the file and
    the field), and a ``--routing`` trace that does not fit a ``--shape`` (RoutingReplayError),
    before a shape is built or a model loads, as bench offload's are. Returns the ``--routing``
    trace (None without), which the run replays: the file is read once (a pipe reads once)."""
    from ..models.forcing import RoutingReplay
    from ..routing import RoutingTrace
    from .shapes import shape_spec

    routing, sequence = getattr(args, "routing", None), getattr(args, "routing_sequence", None)
    trace = RoutingTrace.load(routing) if routing else None
    if getattr(args, "rows_profile", None):
        RoutingTrace.load(args.rows_profile)
    problem = routing_sequence_problem(routing, sequence, trace)
    if problem is not None:  # a usage error, said as the demo says it ("error: --routing-sequence ...")
        raise ValueError(problem)
    shape = getattr(args, "shape", None)
    if shape is not None and trace is not None and getattr(args, "model", None) is None:
        # Fitted onto the shape's dimensions now (a smaller top-k is refused) rather than after its build.
        cfg = shape_spec(shape, layers=getattr(args, "layers", None), vocab=_vocab(getattr(args, "vocab", None))).config
        RoutingReplay(trace, moe_layers=range(cfg["num_hidden_layers"]),
                      n_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"], sequence=sequence or 0,
                      source=str(args.routing))
    return trace


def run_generate_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration in paired rounds; print the tables unless ``args.json``; return the result."""
    import mlx.core as mx

    from ..models import RoutingTrace, load_reference_model, load_streaming_model
    from ..models.predict import PredictionQuality
    from ..runtime._plan import store_top_k
    from ..store import ExpertStore

    plot = getattr(args, "plot", None)
    if plot and plot != "none":
        # Before the rounds, not after them: a missing plotting package should not cost a whole run.
        require_extra("matplotlib", "asyncside bench generate --plot (use --plot none to skip it)")
    s = _settings(args)
    verbose = not getattr(args, "json", False)
    started = time.time()
    mach = machine_info()
    routing_trace = _read_traces_first(args)
    store_dir, model_info = _resolve_store(args, verbose)
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    prompt_ids = prompt_tokens(sm.tokenizer, args.prompt, store_dir)
    eos = set(getattr(sm.tokenizer, "eos_token_ids", ()) or ())
    reference = {"model": load_reference_model(store_dir)[0]}  # dropped before the trace is replayed
    if getattr(args, "routing", None):
        from ..models.forcing import force_reference

        replay = sm.set_routing(routing_trace, sequence=getattr(args, "routing_sequence", None) or 0,
                                source=str(args.routing))
        assert replay is not None
        force_reference(reference["model"], sm.arch.block_attr, replay)
        _log(verbose, f"routing {replay.describe()['note']}")
    record_predictor, predictor_notes = _choose_predictors(args, s, sm, verbose)
    resident_src = sm.resident_source()
    first = store.layer(next(iter(store.layers)))
    record_bytes = first.stride
    demands_per_step = len(store.layers) * (store_top_k(store) or 0)  # 0: the store does not say
    configs = s.configs
    labels = {c.key: _label(c, sm) for c in configs}
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"

    cold_method = _cold_method(args, s, first.path)

    def one(cfg: Config, frac: float, cold: bool, tokens: int) -> BenchRun:
        if cold and s.drop and cfg.system != MLX_LM:
            drop_caches()
        if cfg.system == MLX_LM:
            return _reference_run(reference["model"], prompt_ids, tokens, eos)
        if cfg.system == SLOT_CACHE:
            run = _slot_run(sm, store, prompt_ids, tokens, frac, cold, s, eos)
        else:
            run = _anyio_run(_asyncside_run, sm, store, prompt_ids, tokens, cfg, frac, cold, s)
        run.demands_per_step = demands_per_step
        return run

    _log(verbose, f"model {sm.model_id}: {len(store.layers)} MoE layers x {first.n_experts} experts "
                  f"(record {record_bytes / 1e6:.2f} MB), prompt {len(prompt_ids)} tokens, {s.tokens} generated; "
                  f"systems: {', '.join(labels.values())}" + (f"; {s.load} busy processes beside" if s.load else ""))
    res_runs: list[BenchRun] = []
    table: dict[tuple[str, float, str], list[BenchRun]] = {}
    load_info: dict[str, Any] = {"processes": s.load}
    with busy_load(s.load) as pids:
        load_info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
        # Warm-up (not timed): compile every path once, fill the page cache.
        _log(verbose, "warming up")
        warm_bytes = warm_store(store)
        _anyio_run(_resident_run, sm, resident_src, prompt_ids, 2)
        for cfg in configs:
            one(cfg, s.residencies[0], False, 2)
        for cache_state, rounds in (("warm", s.repeats), ("cold", s.cold_repeats)):
            for rep in range(rounds):
                _log(verbose, f"{cache_state} round {rep + 1}/{rounds}"
                              + (f" ({cold_method})" if cache_state == "cold" else ""))
                if cache_state == "warm":
                    res_runs.append(_anyio_run(_resident_run, sm, resident_src, prompt_ids, s.tokens))
                for frac in s.residencies:
                    # Odd rounds run the group in reverse: a drift within a group (a shared host's
                    # speed moves within minutes) then favours no system over the rounds.
                    for cfg in (configs if rep % 2 == 0 else configs[::-1]):
                        table.setdefault((cache_state, frac, cfg.key), []).append(
                            one(cfg, frac, cache_state == "cold", s.tokens))
        load_info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        load_info["pids"] = pids
    if s.cold_repeats and s.drop:
        warm_store(store)  # leave the machine as we found it, roughly
    ref_tokens = table[("warm", s.residencies[0], MLX_LM)][0].tokens

    # One routing trace (the recording predictor's predictions with it), policies replayed over it.
    _log(verbose, "recording a routing trace; replaying policies vs Belady")
    trace = RoutingTrace()
    set_step_mode(sm, "per-layer")  # per-layer steps record the predictions too
    counted = dict(sm.forward.counters)

    async def record() -> list[int]:
        return [t async for t in sm.generate(prompt_ids, max_tokens=s.tokens, source=resident_src,
                                             predictor=record_predictor, trace=trace)]

    trace_tokens = _anyio_run(record)
    trace_prediction = PredictionQuality.from_counters(sm.forward.counters, counted).as_dict()
    policies = policy_hit_rates(trace, store, s.residencies, predictor=record_predictor)
    reference.clear()
    mx.clear_cache()

    ref_all = [r for (c, _f, k), runs in table.items() if c == "warm" and k == MLX_LM for r in runs]
    ref = _summarise(ref_all, ref_tokens, record_bytes)
    res = _summarise(res_runs, ref_tokens, record_bytes)
    rows = _paired_rows(table, s, configs, labels, sm, ref_tokens, record_bytes)

    plan = {str(frac): dict(zip(("resident_per_layer", "side_rows"),
                                (lambda p: (len(p[0]), p[1]))(_plan(store, frac))))
            for frac in s.residencies}
    result: dict[str, Any] = {
        "bench": "generate",
        "model": sm.model_id,
        "model_info": model_info,
        "store": str(store_dir),
        "device": device,
        "experts_per_layer": first.n_experts,
        "moe_layers": len(store.layers),
        "record_bytes": record_bytes,
        "store_blob_bytes": sum(sp.blob_bytes for sp in store.layers.values()),
        "prompt_tokens": len(prompt_ids),
        "routing": None if sm.routing is None else {"file": str(args.routing), "meta": sm.routing.trace.meta,
                                                    **sm.routing.describe()},
        "settings": {"tokens": s.tokens, "repeats": s.repeats, "cold_repeats": s.cold_repeats,
                     "residencies": list(s.residencies), "modes": list(s.modes), "predictors": list(s.predictors),
                     "verify": list(s.verify),
                     "policy": s.policy, "reader": s.reader, "load": s.load, "quick": bool(args.quick),
                     "shape": getattr(args, "shape", None), "layers": getattr(args, "layers", None),
                     "vocab": getattr(args, "vocab", None), "rows_profile": s.rows_profile},
        "configs": [{"config": c.key, "system": c.system, "label": labels[c.key]} for c in configs],
        "pool_plan": plan,
        "definition": (
            "Decode figures cover the decode steps only (first generated token to the last): "
            "decode_tokens_per_s = (tokens - 1) / that time; loop_cpu_ms_per_token = time.thread_time of the "
            "thread driving the generation (asyncside: the event loop's; mlx-lm generate_step and the slot "
            "cache: the caller's) over those steps, per step; process_cpu_ms_per_token likewise for the whole "
            "process; hit_rate = hits / (hits + misses), each distinct routed expert of a layer visit counted "
            "once, counted from the first token to the end; bytes_read_per_token = bytes the source read "
            "(demand and prefetch) per step the counters cover; miss_bytes_per_token = misses x record_bytes "
            "per such step (decode_counters.steps = (hits + misses) / (MoE layers x top-k): queued steps "
            "count some or all of the first decode step before the first token). tokens_per_s = tokens / whole run "
            "(prefill included). Medians over rounds. residency = pool rows per layer / experts per layer "
            "as asked (the runtime's plan: a resident set and side rows, at least the model's top-k rows a "
            "layer, which 0 and small shares are raised to; the slot cache has as many slots, starting "
            "with the same resident set and warm set). Ratios are paired by round: vs_all_resident = the run's decode "
            "tokens/s over the mlx-lm run of the same round and residency, vs_slot_cache over the slot "
            "cache's, loop_cpu_vs_mlx_lm = loop CPU per step over mlx-lm's; the row reports the median of "
            "its per-round ratios (*_per_round)."),
        "warm_method": f"the whole store read once before the runs ({warm_bytes} bytes)",
        "cold_method": cold_method,
        "load": load_info,
        "machine": mach,
        "all_resident": {"mlx_lm": ref, "async_resident": res,
                         "async_overhead_ratio": ((res["decode_tokens_per_s"] or 0.0) / ref["decode_tokens_per_s"]
                                                  if ref["decode_tokens_per_s"] else None)},
        "rows": rows,
        "policies_vs_belady": policies,
        "trace": {"tokens": len(trace_tokens), "steps": len(trace.steps),
                  "tokens_identical": trace_tokens == ref_tokens, "predictor": record_predictor,
                  "prediction": trace_prediction},
        "predictor_notes": predictor_notes,
        "notes": [n for n in (short_run_note(s.tokens),) if n],
        "tokens_identical": (ref["tokens_identical"] and res["tokens_identical"]
                             and all(r["tokens_identical"] for r in rows) and trace_tokens == ref_tokens),
    }
    result["targets"] = _targets(result)
    if plot and plot != "none":
        try:
            result["plot"] = str(plot_result(result, plot))
        except ImportError as exc:
            result["plot"] = f"not written: {exc}"
    result["seconds"] = round(time.time() - started, 1)
    if getattr(args, "markdown", False):
        print(render_markdown(result))
    elif verbose:
        render_table(result)
    return result


def _choose_predictors(args: argparse.Namespace, s: Any, sm: Any, verbose: bool) -> tuple[str, list[str]]:
    """The predictor the routing trace is recorded with and the notes about the chosen ones; with no
    ``--predictors``, the recording one is the only one run (``s.predictors``)."""
    from ..models.predict import choose_predictor

    # Under replay the default predictor is the trace's own (or temporal): see choose_predictor.
    record_predictor, note = choose_predictor(None, sm.routing)
    predictor_notes = [note] if note else []
    if args.predictors:
        predictor_notes += [x for x in (choose_predictor(p, sm.routing)[1] for p in s.predictors) if x]
    else:
        s.predictors = (record_predictor,)
    for line in predictor_notes:
        _log(verbose, f"note: {line}")
    return record_predictor, predictor_notes


def _cold_method(args: argparse.Namespace, s: Any, blob: Any) -> str:
    """How cold runs bypass the page cache (sets ``s.direct_ok`` and ``s.drop``; no cold rounds when
    neither O_DIRECT nor dropping the cache is possible); the sentence the result records."""
    s.direct_ok = o_direct_works(blob)
    s.drop = not args.no_drop_caches and _can_drop_caches()
    if not s.cold_repeats:
        return "skipped"
    parts = []
    if s.direct_ok:
        parts.append("O_DIRECT reads (runtime direct=True; slot cache O_DIRECT whole-record reads)")
    if s.drop:
        parts.append("page cache dropped before each cold run (sync; echo 3 > /proc/sys/vm/drop_caches)")
    if not parts:
        s.cold_repeats = 0
    return " + ".join(parts) if parts else "unavailable: no O_DIRECT on this filesystem and not root"


def _paired_rows(table: dict[tuple[str, float, str], list[BenchRun]], s: Any, configs: Any, labels: dict[str, str],
                 sm: Any, ref_tokens: list[int], record_bytes: int) -> list[dict[str, Any]]:
    """One result row per (cache state, residency, configuration): its medians and its ratios paired
    by round with the same round's mlx-lm and slot-cache runs."""
    rows = []
    for cache_state, n in (("warm", s.repeats), ("cold", s.cold_repeats)):
        if not n:
            continue
        for frac in s.residencies:
            refs = table[(cache_state, frac, MLX_LM)]
            slots = table[(cache_state, frac, SLOT_CACHE)]
            for cfg in configs:
                runs = table[(cache_state, frac, cfg.key)]
                row: dict[str, Any] = {"cache": cache_state, "residency": frac, "system": cfg.system,
                                       "config": cfg.key, "label": labels[cfg.key],
                                       **_summarise(runs, ref_tokens, record_bytes)}
                if cfg.system == "asyncside":
                    row["step_mode"] = cfg.mode
                    set_step_mode(sm, cfg.mode)
                    row["step_mode_resolved"] = step_mode_of(sm)
                    row["predictor"] = cfg.predictor
                    row["verify"] = cfg.verify
                # Paired: each round's run over the same round's mlx-lm and slot-cache runs.
                row["vs_all_resident_per_round"] = [r.decode_tokens_per_s / b.decode_tokens_per_s
                                                    if b.decode_tokens_per_s else None for r, b in zip(runs, refs)]
                row["vs_slot_cache_per_round"] = [r.decode_tokens_per_s / b.decode_tokens_per_s
                                                  if b.decode_tokens_per_s else None for r, b in zip(runs, slots)]
                cpu = [(r.decode_figures(record_bytes)["loop_cpu_ms_per_token"],
                        b.decode_figures(record_bytes)["loop_cpu_ms_per_token"]) for r, b in zip(runs, refs)]
                row["loop_cpu_vs_mlx_lm_per_round"] = [a / b if a is not None and b else None for a, b in cpu]
                for k in ("vs_all_resident", "vs_slot_cache", "loop_cpu_vs_mlx_lm"):
                    row[k] = _median(row[k + "_per_round"])
                rows.append(row)
    set_step_mode(sm, "default")
    return rows


def _plan(store: Any, frac: float) -> tuple[list[int], int]:
    from ..runtime import plan_layer

    return plan_layer(store, next(iter(store.layers)), frac)


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    """The decode targets (:data:`TARGETS`), checked against this run's headline asyncside configuration (the first
    one run); a check's value and ``met`` are None where this run lacks the figure."""
    device = result["device"]
    head = result["configs"][1]["config"] if len(result["configs"]) > 2 else None
    loaded = result["settings"]["load"] > 0
    checks: list[dict[str, Any]] = []

    def row(frac: float, config: str | None) -> dict[str, Any] | None:
        for r in result["rows"]:
            if r["cache"] == "warm" and r["residency"] == frac and r["config"] == config:
                return r
        return None

    def figure(r: dict[str, Any] | None, key: str) -> float | None:
        """The row's figure ``key``; None without the row."""
        return None if r is None else r[key]

    def check(target: str, value: float | None, bound: float, at_most: bool = False) -> None:
        met = None if value is None else (value <= bound if at_most else value >= bound)
        checks.append({"target": f"{target} {'<=' if at_most else '>='} {bound}", "value": value, "met": met})

    for (dev, frac), bound in TARGETS["vs_all_resident"].items():
        if dev != device:
            continue
        r = row(frac, head)
        if loaded:
            check(f"loaded_vs_all_resident at {frac:.0%} warm", figure(r, "vs_all_resident"),
                  TARGETS["loaded_vs_all_resident"])
        else:
            check(f"vs_all_resident at {frac:.0%} warm", figure(r, "vs_all_resident"), bound)
            check(f"vs_slot_cache at {frac:.0%} warm", figure(r, "vs_slot_cache"),
                  TARGETS["vs_slot_cache"][(dev, frac)])
    frac = 0.25 if any(r["residency"] == 0.25 for r in result["rows"]) else result["settings"]["residencies"][0]
    r, slot = row(frac, head), row(frac, SLOT_CACHE)
    check(f"loop CPU per step vs mlx-lm at {frac:.0%} warm", figure(r, "loop_cpu_vs_mlx_lm"),
          TARGETS["loop_cpu_vs_mlx_lm"], at_most=True)
    ratio = None
    if r is not None and r["bytes_read_per_token"] is not None and r["miss_bytes_per_token"]:
        ratio = r["bytes_read_per_token"] / r["miss_bytes_per_token"]
    check(f"bytes read vs misses' bytes at {frac:.0%} warm", ratio, TARGETS["bytes_read_vs_miss_bytes"], at_most=True)
    diff = None
    if r is not None and slot is not None and r["hit_rate"] is not None and slot["hit_rate"] is not None:
        diff = r["hit_rate"] - slot["hit_rate"]
    check(f"hit rate - slot cache's (LRU, same rows) at {frac:.0%} warm", diff, 0.0)
    return {"device": device, "config": head, "loaded": loaded, "checks": checks}


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}"


def plot_result(result: dict[str, Any], path: str | os.PathLike[str]) -> pathlib.Path:
    """Decode tokens/s vs residency per system (warm, cold) beside mlx-lm; hit rates vs Belady."""
    matplotlib = require_extra("matplotlib", "asyncside bench generate --plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    caches = [c for c in ("warm", "cold") if any(r["cache"] == c for r in result["rows"])]
    fig, axes = plt.subplots(1, len(caches) + 1, figsize=(5.2 * (len(caches) + 1), 4.8), dpi=90)
    axes = list(np.atleast_1d(axes))
    cmap = plt.get_cmap("tab10")
    configs = [c for c in result["configs"] if c["system"] != MLX_LM]
    top = max([r["decode_tokens_per_s"] or 0.0 for r in result["rows"]] + [1e-9]) * 1.15
    for ax, cache in zip(axes, caches):
        for i, c in enumerate(configs):
            pts = sorted((r["residency"], r["decode_tokens_per_s"]) for r in result["rows"]
                         if r["cache"] == cache and r["config"] == c["config"])
            if pts:
                xs, ys = zip(*pts)
                ax.plot([100 * x for x in xs], ys, marker="o", color=cmap(i), label=c["label"])
        pts = sorted((r["residency"], r["decode_tokens_per_s"]) for r in result["rows"]
                     if r["cache"] == cache and r["system"] == MLX_LM)
        if pts:
            xs, ys = zip(*pts)
            ax.plot([100 * x for x in xs], ys, color="black", linestyle="--", linewidth=1.2,
                    label="mlx-lm all-resident (same rounds)")
        ax.set_title(f"{cache} page cache" + (f", {result['settings']['load']} busy processes"
                                              if result["settings"]["load"] else ""))
        ax.set_xlabel("experts in pools per layer (%)")
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_ylim(0, top)
        ax.set_xticks([100 * x for x in result["settings"]["residencies"]])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    ax = axes[-1]
    pol_rows = result["policies_vs_belady"]
    base = list(dict.fromkeys(n.split("+")[0] for n in (pol_rows[0]["policies"] if pol_rows else {})))
    names = ["belady"] + list(pol_rows[0]["policies"] if pol_rows else []) + ["lru, all rows dynamic (from empty)"]
    width = 0.8 / max(len(names), 1)
    cmap20 = plt.get_cmap("tab20")
    color: str | tuple[float, float, float, float]  # a colour name or a colormap's RGBA
    for i, name in enumerate(names):
        if name == "belady":
            heights, color = [p["belady"] for p in pol_rows], "black"
        elif name == "lru, all rows dynamic (from empty)":
            heights, color = [p["all_rows_dynamic"]["lru"] for p in pol_rows], "grey"
        else:  # one hue per policy: light = demand only, dark = with the predictor's prefetches
            heights = [p["policies"][name]["hit_rate"] for p in pol_rows]
            color = cmap20(2 * base.index(name.split("+")[0]) + (0 if "+" in name else 1))
        positions = np.arange(len(pol_rows)) + (i - (len(names) - 1) / 2) * width
        ax.bar(positions, heights, width, label=name, color=color)
    ax.set_xticks(np.arange(len(pol_rows)))
    ax.set_xticklabels([f"{p['residency']:.0%}" for p in pol_rows])
    lows = ([p["belady"] for p in pol_rows] + [v["hit_rate"] for p in pol_rows for v in p["policies"].values()]
            + [p["all_rows_dynamic"]["lru"] for p in pol_rows])
    ax.set_ylim(max(0.0, min(lows) - 0.05) if lows else 0.0, 1.0)
    ax.set_title("hit rate over one recorded routing trace")
    ax.set_xlabel("experts in pools per layer")
    ax.legend(fontsize=6.5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"asyncside bench generate — {result['model']}, {result['settings']['tokens']} tokens, "
                 f"{result['machine']['nproc']} CPUs, {result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


#: the headline table's columns: (title, row -> text)
_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("decode tok/s", lambda r: _fmt(r["decode_tokens_per_s"], ".2f")),
    ("vs all-resident", lambda r: _fmt(r["vs_all_resident"], ".2f", "x")),
    ("vs slot cache", lambda r: _fmt(r["vs_slot_cache"], ".2f", "x")),
    ("hit rate", lambda r: _fmt(None if r["hit_rate"] is None else 100 * r["hit_rate"], ".1f", "%")),
    ("MB read/tok", lambda r: _mb(r["bytes_read_per_token"])),
    ("miss MB/tok", lambda r: _mb(r["miss_bytes_per_token"])),
    ("loop CPU ms/tok", lambda r: _fmt(r["loop_cpu_ms_per_token"], ".2f")),
    ("CPU vs mlx-lm", lambda r: _fmt(r["loop_cpu_vs_mlx_lm"], ".2f", "x")),
    ("tokens =", lambda r: "yes" if r["tokens_identical"] else "NO"),
]


def _title(result: dict[str, Any]) -> str:
    s = result["settings"]
    load = f", {s['load']} busy processes beside" if s["load"] else ""
    info = result.get("model_info") or {}
    # A shape from a user's config: what it was built as, and what of the model it leaves out.
    shape = f"; shape {info['shape']}: {info['built_as']}" if info.get("built_as") else ""
    shape += f"; not represented: {info['note']}" if info.get("note") else ""
    return (f"asyncside bench generate — {result['model']} ({result['moe_layers']} MoE layers x "
            f"{result['experts_per_layer']} experts, record {result['record_bytes'] / 1e6:.2f} MB), "
            f"{result['device']}, {s['tokens']} tokens, "
            f"paired rounds: {s['repeats']} warm / {s['cold_repeats']} cold{load}{shape}")


def _pools_cell(result: dict[str, Any], residency: float, *, rows_beside: bool = False) -> str:
    """What the pools hold at ``residency``: the share asked, or, where the plan raised it (to the
    model's top-k rows a layer, which 0 and small shares are), the share held, its rows and the share
    asked (a cell saying 0% over pools of the top-k rows misstates them); ``rows_beside``: the
    cell's table shows the rows itself."""
    plan = (result.get("pool_plan") or {}).get(str(residency))
    experts = result.get("experts_per_layer")
    if not plan or not experts:
        return f"{residency:.0%}"
    rows = plan["resident_per_layer"] + plan["side_rows"]
    if rows <= round(residency * experts):
        return f"{residency:.0%}"
    if rows_beside:
        return f"{rows / experts:.0%}, {residency:.0%} asked"
    return f"{rows / experts:.0%} ({rows}/{experts} rows; {residency:.0%} asked)"


def render_table(result: dict[str, Any]) -> None:
    """Print the result as rich tables (stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 200)  # the table is wide; piped output defaults to 80
    t = Table(title=_title(result))
    t.add_column("cache")
    t.add_column("residency", justify="right")
    t.add_column("system", no_wrap=True)
    for name, _ in _COLUMNS:
        t.add_column(name, justify="left" if name == "tokens =" else "right", no_wrap=True)
    last = None
    for r in result["rows"]:
        group = (r["cache"], r["residency"])
        if last is not None and group != last:
            t.add_section()
        last = group
        t.add_row(r["cache"], _pools_cell(result, r["residency"]), r["label"], *[fn(r) for _, fn in _COLUMNS])
    console.print(t)
    ar = result["all_resident"]
    console.print(f"asyncside forward over all experts (ResidentSource): "
                  f"{_fmt(ar['async_resident']['decode_tokens_per_s'], '.2f')} tok/s, "
                  f"{_fmt(ar['async_overhead_ratio'], '.2f', 'x')} of mlx-lm's median "
                  f"{_fmt(ar['mlx_lm']['decode_tokens_per_s'], '.2f')}")
    p = Table(title="hit rate over one recorded routing trace: ledger policies vs Belady's MIN (in brackets: "
                    "of MIN with bypass / of MIN under the ledger's rule, no bypass)")
    p.add_column("residency")
    p.add_column("resident+side rows", justify="right")
    p.add_column("belady", justify="right")
    p.add_column("belady, no bypass", justify="right")
    names = list(result["policies_vs_belady"][0]["policies"]) if result["policies_vs_belady"] else []
    for n in names:
        p.add_column(n, justify="right")
    p.add_column("all rows dynamic, from empty: belady / no bypass / lru", justify="right")
    for row in result["policies_vs_belady"]:
        p.add_row(_pools_cell(result, row["residency"], rows_beside=True),
                  f"{row['resident_per_layer']}+{row['side_rows']}",
                  f"{row['belady']:.3f}", _fmt(row.get("belady_no_bypass"), ".3f"),
                  *[_policy_cell(row["policies"][n]) for n in names], _dynamic_cell(row["all_rows_dynamic"]))
    console.print(p)
    tg = result["targets"]
    console.print(f"targets ({tg['device']}, {tg['config']}):")
    for c in tg["checks"]:
        console.print(f"  {c['target']}: {_fmt(c['value'], '.3f')}, met: {c['met']}")
    console.print(f"cold: {result['cold_method']}; plot: {result.get('plot')}; "
                  f"tokens identical everywhere: {result['tokens_identical']}; {result['seconds']} s")
    for note in result.get("notes", []):
        console.print(f"note: {note}")


def _policy_cell(v: dict[str, Any]) -> str:
    """A policy's hit rate, then its fraction of MIN with bypass / under the ledger's rule."""
    of = [v.get(k) for k in ("vs_belady", "vs_belady_no_bypass")]  # NaN: MIN hit nothing, no ratio
    return f"{v['hit_rate']:.3f} (" + " / ".join(_fmt(None if x is None or math.isnan(x) else x, ".2f")
                                                 for x in of) + ")"


def _dynamic_cell(dyn: dict[str, Any]) -> str:
    """Every row dynamic, from empty: MIN with bypass / under the ledger's rule / LRU."""
    return f"{dyn['belady']:.3f} / {_fmt(dyn.get('belady_no_bypass'), '.3f')} / {dyn['lru']:.3f}"


def short_run_note(tokens: int) -> str | None:
    """Why decode figures of runs this short are not figures, or None. A pipelined loop (asyncside's,
    mlx-lm's generate_step) queues its second step before its first token arrives, and on a small
    model the stream may have run it by then, so the window from the first token to the last can
    hold up to one step fewer than it counts: over a few steps that step is a large share, and the
    slot cache's synchronous loop has no such head start."""
    if tokens >= SHORT_RUN_TOKENS:
        return None
    return (f"{tokens} token(s) a run: the decode figures cover {max(tokens - 1, 0)} step(s) and overstate the "
            "pipelined loops (asyncside, mlx-lm), which queue their second step before the first token arrives; "
            f"read them as a smoke test (--tokens {SHORT_RUN_TOKENS} or more for figures)")


def render_markdown(result: dict[str, Any]) -> str:
    """The result as markdown tables (what BENCHMARKS.md shows)."""
    lines = [f"{_title(result)}", "",
             "| cache | experts in pools | system | " + " | ".join(n for n, _ in _COLUMNS) + " |",
             "| --- | ---: | --- | " + " | ".join("---" if n == "tokens =" else "---:" for n, _ in _COLUMNS) + " |"]
    for r in result["rows"]:
        lines.append(f"| {r['cache']} | {_pools_cell(result, r['residency'])} | {r['label']} | "
                     + " | ".join(fn(r) for _, fn in _COLUMNS) + " |")
    ar = result["all_resident"]
    lines += ["", f"asyncside's forward over all experts (ResidentSource): "
                  f"{_fmt(ar['async_resident']['decode_tokens_per_s'], '.2f')} tok/s, "
                  f"{_fmt(ar['async_overhead_ratio'], '.2f', 'x')} of mlx-lm's median "
                  f"{_fmt(ar['mlx_lm']['decode_tokens_per_s'], '.2f')} tok/s."]
    pols = result["policies_vs_belady"]
    names = list(pols[0]["policies"]) if pols else []
    lines += ["", "In brackets: of MIN with bypass / of MIN under the ledger's rule (no bypass).", "",
              "| experts in pools (resident + side rows) | Belady (MIN) | MIN, no bypass | "
              + " | ".join(names) + " | all rows dynamic, from empty: Belady / no bypass / LRU |",
              "| --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " | ---: |"]
    for p in pols:
        pools = _pools_cell(result, p["residency"], rows_beside=True)
        lines.append(f"| {pools} ({p['resident_per_layer']} + {p['side_rows']}) | {p['belady']:.3f} | "
                     f"{_fmt(p.get('belady_no_bypass'), '.3f')} | "
                     + " | ".join(_policy_cell(p["policies"][n]) for n in names)
                     + f" | {_dynamic_cell(p['all_rows_dynamic'])} |")
    lines += [f"\nNote: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.generate [--json] ...``"""
    from . import bench_main

    return bench_main("generate", argv)


if __name__ == "__main__":
    sys.exit(main())
