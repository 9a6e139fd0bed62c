"""The memory plan: how many rows each layer's pools get, and what the memory budget leaves.

One sizing rule (:func:`layer_rows`) serves the allocation, the budget check and ``resident="auto"``.
The plan is made once, before anything is allocated or opened, and states everything the runtime
will hold: the pools, the host tier and its staging arrays (device pools), the headroom for the
non-expert weights and MLX's buffers, and what is left for the page cache. Buffered reads leave
every record they read there, the pools' records as well as the others: when the streamed layers'
records cannot all stay in that page cache, they would only evict each other (and, in a memory
cgroup, be charged to the process beside the pools): the plan then reads with O_DIRECT, bypassing it.

With a rows profile (a routing trace recorded or generated earlier, :func:`profile_rows`), the
same total of pool rows is split between the layers by their LRU miss curves on that trace
(:func:`asyncside.policy_replay.split_rows`) instead of evenly, every layer keeping at least the
rows a step needs.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from .. import memory as _memory
from ..errors import AsyncsideError, StoreError, TraceError
from ..kv_layout import KV_STEP, KVLayout, dtype_bytes, kv_layout
from ..memory import AUTO_SHARE, MIN_HEADROOM, TIER_SHARE, MemoryBudget, describe_bytes, layer_rows, parse_size
from ..readers import ENV_DIRECT, ReaderOptions, _env_direct
from ..store import MANIFEST_NAME, ExpertStore, LayerSpec
from ._forward_cost import FIT, ForwardCost, config_top_k, forward_cost

if TYPE_CHECKING:
    from ..read_window import ReadWindow
    from ..routing import RoutingTrace

__all__ = ["DEFAULT_MIN_ROWS", "Headroom", "MemoryPlan", "choose_resident", "estimate_headroom", "layer_rows",
           "min_rows", "plan_headroom", "plan_layer", "plan_memory", "profile_rows", "reader_staging_bytes",
           "rows_raised", "side_rows_problem", "tier_bytes", "warm_experts"]

#: The pools' least rows per layer for a store that does not say how many experts its router picks.
DEFAULT_MIN_ROWS = 8
#: Under a memory budget, the share of the headroom that KV caches may take (the KV allowance); the
#: rest is MLX's buffers, a cache's growth copy and the forwards' activations. A plan that reads
#: past the page cache gives the KV caches the same share of the page cache's room, which O_DIRECT
#: reads leave unused; the other share stays for what the budget does not plan (the allocator's
#: slack, files other than the store's that the process reads).
KV_SHARE = 0.5
#: The least headroom a plan keeps for a model whose config it can read: MLX's cache of freed
#: buffers and what the process allocates while it runs beside them (BENCHMARKS.md, "Memory we
#: use": the budget sweep measured that growth against the estimate).
HEADROOM_FLOOR = 64 << 20
#: Of the headroom, what the estimate keeps for MLX's cache of freed buffers, the interpreter's and
#: the native threads' growth over a run: measured beside the estimate in the same sweep.
RUNTIME_SLACK = 32 << 20
#: Positions of one sequence the headroom holds KV cache for (more may fit in the page cache's room
#: that O_DIRECT reads leave: :attr:`MemoryPlan.kv_spare_bytes`).
PLANNED_CONTEXT = 2048
#: Tokens of a prompt chunk at the start of a prompt the headroom holds a forward for: the plan
#: bounds chunks by what it leaves (:meth:`MemoryPlan.prompt_chunk`), so this is the least chunk
#: it keeps room for, not a limit.
PLANNED_CHUNK = 128

#: What ``rows_profile`` takes: a routing trace, or the path of one (``.npz``, docs/routing-traces.md).
RowsProfile: TypeAlias = "RoutingTrace | str | os.PathLike[str]"


class PlanArgumentError(AsyncsideError, ValueError):
    """Runtime sizing arguments that are not valid, or do not go together: a ValueError, as a bad
    argument is, and an AsyncsideError, so a command refuses it in one line as the plan's other
    refusals."""


def store_config(store: ExpertStore) -> dict[str, Any] | None:
    """The model's ``config.json`` beside the store's manifest; None where there is none (a store
    written without its model's config, ``ExpertStore.create``) or it is not a JSON object."""
    path = getattr(store, "path", None)
    if path is None:
        return None
    try:
        import json

        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def store_top_k(store: ExpertStore) -> int | None:
    """How many experts the store's model routes each token to, per MoE layer at most: what
    ``asyncside convert`` recorded from the blocks (``metadata["asyncside_model"]["top_k"]``), else
    the model's ``config.json`` beside the manifest; None where neither says."""
    model_meta = (store.metadata or {}).get("asyncside_model")
    recorded = model_meta.get("top_k") if isinstance(model_meta, Mapping) else None
    if isinstance(recorded, Mapping) and recorded:
        values = [v for v in recorded.values() if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        if values:
            return max(values)
    return config_top_k(store_config(store))


def min_rows(store: ExpertStore) -> int:
    """The least dynamic rows each layer's pools get unless ``min_side_rows`` says otherwise: the
    model's top-k (a queued decode step lends one token's k distinct experts a row each), so a
    model that routes few of few experts (top-2 of 8) can still stream; :data:`DEFAULT_MIN_ROWS`
    where the store does not say its top-k."""
    k = store_top_k(store)
    return DEFAULT_MIN_ROWS if k is None else k


def _manifest(store: ExpertStore) -> pathlib.Path:
    """The store's manifest file, which a refusal of its metadata names."""
    return pathlib.Path(getattr(store, "path", ".")) / MANIFEST_NAME


def _listed(store: ExpertStore, meta: Mapping[str, Any], key: str, layer: int, where: str,
            what: str = "expert ids") -> list[Any] | None:
    """``meta[key][str(layer)]``, a per-layer list the manifest's metadata may hold (written by hand
    too); None where it names no list for ``layer``. StoreError naming the manifest and the field
    where it is of another form: a traceback from deep in the plan was all a hand edit got."""
    table = meta.get(key)
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise StoreError(_manifest(store), f"expected an object of per-layer lists keyed by layer index, got "
                               f"{type(table).__name__}", f"{where}{key}")
    value = table.get(str(layer))
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise StoreError(_manifest(store), f"expected a list of {what}, got {value!r:.60}", f"{where}{key}.{layer}")
    return value


def _expert_ids(store: ExpertStore, ids: list[Any], n_experts: int, field: str) -> list[int]:
    """The expert ids of a hand-editable list, in order, each once; those past the layer's experts
    left out. StoreError naming ``field`` for a number that is no id."""
    bad = next((v for v in ids if not isinstance(v, int)), None)
    if bad is not None:
        raise StoreError(_manifest(store), f"expected expert ids (integers), got {bad!r}", field)
    return list(dict.fromkeys(e for e in ids if 0 <= e < n_experts))


def choose_resident(store: ExpertStore, layer: int, count: int) -> list[int]:
    """Pick ``count`` experts of ``layer`` to pin, hottest first.

    From the converter's hottest-first ranking (``metadata["asyncside_model"]["expert_rank"]``,
    written by ``asyncside convert``), else a top-level routing profile (``metadata["profile"]``:
    per-layer routed counts), else the experts named in ``metadata["resident"]`` in order, else
    experts ``0..count-1``. An id listed twice counts once; one past the layer's experts is left out;
    a list of another form is a StoreError naming the manifest's field.
    """
    spec = store.layer(layer)
    count = max(0, min(count, spec.n_experts))
    meta = store.metadata or {}
    model_meta = meta.get("asyncside_model")
    where = "metadata.asyncside_model."
    ranking = _listed(store, model_meta, "expert_rank", layer, where) if isinstance(model_meta, Mapping) else None
    if ranking is not None:
        ranked = _expert_ids(store, ranking, spec.n_experts, f"{where}expert_rank.{layer}")
        seen = set(ranked)
        ranked += [e for e in range(spec.n_experts) if e not in seen]
        return ranked[:count]
    profile = _listed(store, meta, "profile", layer, "metadata.", "routed counts")
    if profile is not None:
        counts = np.asarray(profile, dtype=np.float64)
        # Stable sort on -count: ties keep the smaller expert id first.
        order = np.argsort(-counts, kind="stable")
        return [int(e) for e in order[:count] if e < spec.n_experts]
    listed = _listed(store, meta, "resident", layer, "metadata.")
    if listed is not None:
        chosen = _expert_ids(store, listed, spec.n_experts, f"metadata.resident.{layer}")[:count]
        rest = [e for e in range(spec.n_experts) if e not in set(chosen)]
        return chosen + rest[: count - len(chosen)]
    return list(range(count))


def _rows(n: int) -> str:
    """``n`` rows, in the singular for one (a top-1 model's least pools were "1 rows a layer")."""
    return f"{n} row" if n == 1 else f"{n} rows"


def _experts(n: int) -> str:
    """``n`` experts, in the singular for one."""
    return f"{n} expert" if n == 1 else f"{n} experts"


def side_rows_problem(store: ExpertStore, layers: Sequence[int], side_rows: int | None,
                      pinned: Mapping[int, Sequence[int]] | None = None, *, name: str = "side_rows=") -> str | None:
    """Why ``side_rows`` cannot be the dynamic rows of each of ``layers`` (None: it can): not a
    number of rows >= 0, or more than a layer has experts to stream (its experts, less those
    ``pinned`` names). ``name`` is how the setting is named, ``"--side-rows "`` on a command line."""
    if side_rows is None:
        return None
    if isinstance(side_rows, bool) or not isinstance(side_rows, int) or side_rows < 0:
        return f"{name.rstrip('= ')}: expected a number of rows >= 0, got {side_rows!r}"
    most: tuple[int, int, int, int] | None = None  # (rows, layer, experts, pinned)
    for i in layers:
        n = store.layer(i).n_experts
        held = len(set(int(e) for e in pinned.get(i, ()))) if pinned is not None else 0
        if most is None or n - held < most[0]:
            most = (n - held, i, n, held)
    if most is None or side_rows <= most[0]:
        return None
    rows, layer, n, held = most
    if held:
        why = (f"layer {layer} pins {held} of its {_experts(n)}, which leaves {rows} to stream "
               f"through its dynamic rows")
    elif all(store.layer(i).n_experts == n for i in layers):
        why = (f"this model's layers have {_experts(n)} each; at {n} every row is dynamic and "
               f"none pinned")
    else:
        why = f"layer {layer} has {_experts(n)}; at {n} its every row is dynamic and none pinned"
    return f"{name}{side_rows}: at most {rows} dynamic {'row' if rows == 1 else 'rows'} a layer ({why})"


def plan_layer(store: ExpertStore, index: int, resident: float = 0.25, side_rows: int | None = None,
               min_side_rows: int | None = None,
               pinned: Mapping[int, Sequence[int]] | None = None) -> tuple[list[int], int]:
    """(pinned experts, dynamic rows) of one layer, as ``Runtime`` sizes it. Exposed so other
    expert sources (benchmark baselines) size their pools alike.

    ``resident`` is the pools' size: :func:`layer_rows` rows in all. By default every row is
    dynamic (managed online by the policy; a store's routing ranking only warms them up, see
    :func:`warm_experts`). ``side_rows`` pins ``rows - side_rows`` of the hottest experts
    (:func:`choose_resident`) and leaves ``side_rows`` dynamic. ``pinned`` names the pinned experts
    per layer instead (then ``side_rows``, default ``min_side_rows``, rows are dynamic).
    ``min_side_rows`` None: :func:`min_rows` of the store. A ``side_rows`` the layer cannot hold
    (:func:`side_rows_problem`) is a :class:`PlanArgumentError`.
    """
    spec = store.layer(index)
    problem = side_rows_problem(store, [index], side_rows, pinned)
    if problem is not None:
        raise PlanArgumentError(problem)
    if min_side_rows is None:
        min_side_rows = min_rows(store)
    if isinstance(resident, Mapping):
        raise TypeError("resident: expected a fraction of each layer's experts (the pools' size); "
                        "name pinned experts with pinned={layer: [experts]}")
    if pinned is not None:
        chosen = [int(e) for e in pinned.get(index, ())]
        side = side_rows if side_rows is not None else min_side_rows
    else:
        rows = layer_rows(spec.n_experts, resident, side_rows, min_side_rows)
        side = rows if side_rows is None else min(int(side_rows), spec.n_experts)
        chosen = choose_resident(store, index, max(0, rows - side))
    if side < 0:
        raise ValueError(f"side_rows: expected a number of rows >= 0, got {side}")
    side = min(side, spec.n_experts - len(chosen))
    return chosen, side


def warm_experts(store: ExpertStore, index: int, count: int, exclude: Sequence[int] = ()) -> list[int]:
    """The experts to load into ``count`` dynamic rows before the first step: the hottest by the
    store's routing ranking (``asyncside convert`` writes one from a profile), or none when the
    store has no ranking (no arbitrary set: the rows then fill as the model routes)."""
    meta = store.metadata or {}
    model_meta = meta.get("asyncside_model")
    has_rank = isinstance(model_meta, Mapping) and _listed(
        store, model_meta, "expert_rank", index, "metadata.asyncside_model.") is not None
    if not has_rank and _listed(store, meta, "profile", index, "metadata.", "routed counts") is None:
        return []
    skip = set(int(e) for e in exclude)
    ranked = [e for e in choose_resident(store, index, store.layer(index).n_experts) if e not in skip]
    return ranked[: max(0, count)]


def record_bytes(spec: LayerSpec) -> int:
    """Bytes of one expert in the pools (its segments, padding excluded)."""
    return sum(seg.nbytes for seg in spec.segments)


def tier_bytes(spec: LayerSpec) -> int:
    """Host memory of one layer's host tier: the mirror's layout, each segment a page-rounded
    block of one row per expert."""
    return sum(-(-spec.n_experts * seg.nbytes // 4096) * 4096 for seg in spec.segments)


def _staging_key(spec: LayerSpec) -> tuple[Any, ...]:
    return (spec.n_experts, tuple((seg.key, tuple(seg.shape), seg.dtype) for seg in spec.segments))


@dataclass(frozen=True)
class Headroom:
    """What a plan's headroom is kept for, in bytes: estimated from the model's ``config.json``
    (:func:`estimate_headroom`), or the fixed :data:`~asyncside.memory.MIN_HEADROOM` where the
    config does not say the model's widths (``kv`` and ``forward`` None)."""

    total: int
    kv: int | None  # one sequence's KV cache at ``context`` positions
    forward: int | None  # a forward of PLANNED_CHUNK prompt tokens or a decode step, over FIT
    staging: int  # the reader's O_DIRECT staging slab (0 for buffered reads)
    slack: int  # MLX's cache of freed buffers and the process's growth over a run
    context: int = PLANNED_CONTEXT

    @property
    def estimated(self) -> bool:
        """Whether the figure comes from the model's config (else it is the fixed one)."""
        return self.kv is not None and self.forward is not None

    @property
    def kv_own(self) -> int:
        """The KV caches' own part of the headroom: as estimated, else a share of the fixed figure."""
        return self.kv if self.kv is not None and self.forward is not None else int(self.total * KV_SHARE)

    @property
    def not_forward(self) -> int:
        """The part no forward's buffers may use, beside the KV caches': the staging slab, which the
        reader holds for its life, and the slack, which MLX's cache of freed buffers and the
        process's growth take while a prompt's chunks run (in an estimate; the fixed figure counted
        both as room)."""
        return self.staging + self.slack if self.estimated else 0

    def describe(self) -> str:
        """The parts in a few words, for the printed plan."""
        b = describe_bytes
        if not self.estimated:
            return ("the fixed figure: the model's config.json does not say its widths"
                    + (f"; the reader's O_DIRECT staging {b(self.staging)} of it" if self.staging else ""))
        parts = [f"KV cache of {self.context:,} positions {b(self.kv or 0)}",
                 f"a forward of {PLANNED_CHUNK} prompt tokens {b(self.forward or 0)}"]
        if self.staging:
            parts.append(f"the reader's O_DIRECT staging {b(self.staging)}")
        parts.append(f"MLX's cache and the process's growth {b(self.slack)}")
        summed = sum(x or 0 for x in (self.kv, self.forward, self.staging, self.slack))
        floor = f", raised to the floor of {b(self.total)}" if self.total > summed else ""
        return "estimated: " + ", ".join(parts) + floor

    def as_dict(self) -> dict[str, Any]:
        return {"total_bytes": self.total, "kv_bytes": self.kv, "forward_bytes": self.forward,
                "staging_bytes": self.staging, "slack_bytes": self.slack, "context": self.context,
                "estimated": self.estimated}


def reader_staging_bytes(options: ReaderOptions | None = None) -> int:
    """The O_DIRECT staging slab a reader of ``options`` (defaults when None) allocates: whole
    slots of ``slot_bytes``, at least one (native/io_reader.cpp)."""
    o = ReaderOptions() if options is None else options
    slot = max(1, int(o.slot_bytes))
    return max(1, int(o.staging_bytes) // slot) * slot


def _element_bytes(config: Mapping[str, Any]) -> int:
    """Bytes of one KV element of the model ``config`` describes: its ``torch_dtype`` (its text
    section's too), else float32's (the most a cache takes)."""
    inner = config.get("text_config")
    for scope in (config, inner if isinstance(inner, Mapping) else {}):
        for key in ("torch_dtype", "dtype"):
            try:
                return dtype_bytes(scope[key])
            except (KeyError, ValueError):
                continue
    return 4


def estimate_headroom(store: ExpertStore, *, direct: bool, staging_bytes: int | None = None,
                      context: int = PLANNED_CONTEXT) -> Headroom:
    """The headroom a run of ``store``'s model needs beside the pools (BENCHMARKS.md, "Memory we
    use"): one sequence's KV cache at ``context`` positions, a forward of :data:`PLANNED_CHUNK`
    prompt tokens (or a decode step at ``context``, the larger; the plan bounds longer chunks by
    what is left), the reader's O_DIRECT staging slab when ``direct`` (``staging_bytes``, default
    the reader's), and :data:`RUNTIME_SLACK`; at least :data:`HEADROOM_FLOOR`. Where the model's
    config.json does not say its widths: the fixed :data:`~asyncside.memory.MIN_HEADROOM`."""
    staging = (reader_staging_bytes() if staging_bytes is None else int(staging_bytes)) if direct else 0
    config = store_config(store)
    cost = forward_cost(config, store_top_k(store))
    layout: KVLayout | None = None
    if config is not None:
        try:
            where = f"{getattr(store, 'path', 'the store')}/config.json"
            layout = kv_layout(config, _element_bytes(config), where=where)
        except (AsyncsideError, ValueError, TypeError):
            layout = None
    if cost is None or layout is None:
        # Nothing to estimate from: the fixed figure, which held the staging slab as well.
        return Headroom(total=MIN_HEADROOM, kv=None, forward=None, staging=staging, slack=0, context=context)
    kv = layout.bytes_for(context)
    forward = int(max(cost.bytes(PLANNED_CHUNK), cost.bytes(1, context)) / FIT)
    total = max(HEADROOM_FLOOR, kv + forward + staging + RUNTIME_SLACK)
    return Headroom(total=total, kv=kv, forward=forward, staging=staging, slack=RUNTIME_SLACK, context=context)


@dataclass(frozen=True)
class MemoryPlan:
    """What the runtime holds and what it leaves, in bytes, decided before anything is allocated."""

    budget: int  # what the plan is made against
    source: str  # where the budget comes from ("--memory", a cgroup, MemAvailable)
    resident: float | str  # the pools' fraction of each layer's experts, or "pinned"
    rows: Mapping[int, int]  # layer -> pool rows
    pool_bytes: int
    host_tier_layers: frozenset[int]
    host_tier_bytes: int
    staging_bytes: int
    headroom_bytes: int  # MLX's buffers, the KV caches
    store_bytes: int  # every record of the streamed layers
    page_cache_bytes: int  # what the budget leaves for the page cache
    direct: bool  # reads bypass the page cache (O_DIRECT)
    direct_reason: str
    notes: tuple[str, ...] = field(default=())
    split: str | None = None  # how the rows were split between layers by a profile (None: evenly)
    #: what KV caches may take, served requests' or a generation's (None: no memory budget, no limit):
    #: a share of the headroom, plus :attr:`kv_spare_bytes`
    kv_allowance_bytes: int | None = None
    #: what a forward's transient buffers cost, from the model's config.json (None: unknown)
    forward: ForwardCost | None = None
    #: the part of the KV allowance that lies in the page cache's room, unused by O_DIRECT reads (0
    #: in a plan that reads through the page cache)
    kv_spare_bytes: int = 0
    #: layer -> its experts (what :attr:`pools_fraction` counts the rows against)
    experts: Mapping[int, int] = field(default_factory=dict)
    #: where the pools hold more rows a layer than ``resident`` asks for (:func:`rows_raised`); None
    #: where every layer holds what was asked
    rows_raised: Mapping[str, Any] | None = None
    #: how many pieces the ordered reads past the page cache keep in flight, and why (set once the
    #: runtime is entered: the disk may be measured for it; None in a plan that reads buffered)
    read_window: ReadWindow | None = None
    #: what the headroom is kept for (None: a plan made without an estimate)
    headroom_parts: Headroom | None = None

    @property
    def pools_fraction(self) -> float | None:
        """What the pools hold: their rows over the experts of every layer (more than
        :attr:`resident` where :attr:`rows_raised` says why); None without layers."""
        total = sum(self.experts.get(i, 0) for i in self.rows)
        return sum(self.rows.values()) / total if total else None

    @property
    def forward_room_bytes(self) -> int | None:
        """The headroom a forward's buffers may take under a memory budget (the rest of it is the KV
        allowance's); None without a budget."""
        if self.kv_allowance_bytes is None:
            return None
        # the reader's staging slab is held for the runtime's life, and the slack is what the run
        # grows by beside a chunk's buffers (a long prompt took a run past its budget without it)
        held = self.headroom_parts.not_forward if self.headroom_parts is not None else 0
        return self.headroom_bytes - (self.kv_allowance_bytes - self.kv_spare_bytes) - held

    def kv_tokens(self, layout: KVLayout, chunk: int | None = None) -> int | None:
        """The most positions (prompt and generated tokens) one sequence's KV cache of ``layout``
        may reach within the KV allowance, at worst (:meth:`KVLayout.bytes_for`, prefill chunks of
        at most ``chunk`` tokens, default the cache's growth step); None: no limit."""
        if self.kv_allowance_bytes is None:
            return None
        chunk = KV_STEP if chunk is None else chunk
        lo, hi = 0, 1
        while layout.bytes_for(hi, chunk) <= self.kv_allowance_bytes and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # bytes_for grows with the tokens: bisect the last that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if layout.bytes_for(mid, chunk) <= self.kv_allowance_bytes else (lo, mid)
        return lo

    def prompt_chunk(self, want: int, cached: int = 0) -> int:
        """How many of ``want`` prompt tokens one forward after ``cached`` positions may take:
        ``want`` without a budget or a known forward cost, else the most whose buffers fit
        :attr:`forward_room_bytes` by the estimate, with a margin for its error (at least one)."""
        room = self.forward_room_bytes
        if room is None or self.forward is None:
            return want
        return self.forward.chunk(int(room * FIT), want, cached)

    @property
    def held_bytes(self) -> int:
        """Everything the runtime itself allocates."""
        return self.pool_bytes + self.host_tier_bytes + self.staging_bytes

    def describe(self) -> str:
        """The plan in a few lines, for the start of a run."""
        b = describe_bytes
        lines = [
            f"memory budget {b(self.budget)} ({self.source})",
            f"pools {b(self.pool_bytes)} ({self._pools_note()}) of a {b(self.store_bytes)} store",
        ]
        if self.host_tier_bytes or self.staging_bytes:
            lines.append(f"host tier {b(self.host_tier_bytes)} ({len(self.host_tier_layers)} layers), "
                         f"staging {b(self.staging_bytes)}")
        kv = ""
        if self.kv_allowance_bytes is not None:
            own = self.kv_allowance_bytes - self.kv_spare_bytes
            unused = "unused by O_DIRECT reads" if self.direct else "beyond the store's streamed records"
            kv = f": KV allowance {b(own)} of it" + (
                f" and {b(self.kv_spare_bytes)} of the page cache's room, {unused}" if self.kv_spare_bytes else "")
        lines.append(f"headroom {b(self.headroom_bytes)} (MLX buffers, KV caches{kv}), "
                     f"page cache {b(self.page_cache_bytes)}")
        if self.headroom_parts is not None:
            lines.append(f"headroom {self.headroom_parts.describe()}")
        lines.append(f"reads: {'O_DIRECT' if self.direct else 'buffered'} ({self.direct_reason})")
        if self.read_window is not None:
            lines.append(self.read_window.describe())
        room = self.forward_room_bytes
        if room is not None and self.forward is not None:
            lines.append(f"prompt chunks: at most {self.prompt_chunk(1 << 20)} tokens a forward at the start of a "
                         f"prompt, fewer as its context grows (their buffers within {b(room)} of the headroom)")
        if self.split is not None:
            lines.append(self.split)
        lines.extend(self.notes)
        return "\n".join(lines)

    def _pools_note(self) -> str:
        """What the pools hold (of every layer's experts, their rows) and what was asked: where the
        plan raised the rows above ``resident``, to how many a layer and why."""
        held = self.pools_fraction
        rows = f"{sum(self.rows.values())} rows in {len(self.rows)} {'layer' if len(self.rows) == 1 else 'layers'}"
        note = rows if held is None else f"{held:.0%} of experts, {rows}"
        asked = self.resident if isinstance(self.resident, str) else f"{self.resident:g}"
        raised = self.rows_raised
        if not raised:
            return f"{note}; resident {asked}"
        how = "chosen for the budget" if raised["asked_by"] == "auto" else "asked"
        least = raised["rows"]
        return (f"{note}; resident {asked} {how}, raised to {least} {'row' if least == 1 else 'rows'} a layer "
                f"({raised['why']})")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures (what ``Runtime.memory`` reports)."""
        return {
            "budget_bytes": self.budget, "source": self.source, "resident": self.resident,
            "pool_bytes": self.pool_bytes, "host_tier_bytes": self.host_tier_bytes,
            "host_tier_layers": len(self.host_tier_layers), "staging_bytes": self.staging_bytes,
            "headroom_bytes": self.headroom_bytes, "kv_allowance_bytes": self.kv_allowance_bytes,
            "kv_spare_bytes": self.kv_spare_bytes, "store_bytes": self.store_bytes,
            "page_cache_bytes": self.page_cache_bytes, "direct": self.direct, "direct_reason": self.direct_reason,
            # the figure a budget check compares with (kept under its older name too)
            "available_bytes": self.budget,
            "rows": {str(i): r for i, r in self.rows.items()}, "split": self.split,
            # what the pools hold ("resident" is what was asked, or chosen for the budget)
            "pools_fraction": self.pools_fraction,
            "rows_raised": None if self.rows_raised is None else dict(self.rows_raised),
            "prompt_chunk_at_start": (None if self.forward_room_bytes is None or self.forward is None
                                      else self.prompt_chunk(1 << 20)),
            "read_window": None if self.read_window is None else self.read_window.as_dict(),
            "headroom_parts": None if self.headroom_parts is None else self.headroom_parts.as_dict(),
        }


def _load_profile(profile: RowsProfile) -> tuple[RoutingTrace, str]:
    """(the trace, where it came from) of a ``rows_profile`` argument."""
    from ..routing import RoutingTrace

    if isinstance(profile, RoutingTrace):
        return profile, "<in memory>"
    if isinstance(profile, (str, os.PathLike)):
        return RoutingTrace.load(profile), os.fspath(profile)
    raise TypeError(f"rows_profile: expected a RoutingTrace or the path of one (.npz), got {type(profile).__name__}")


def profile_rows(store: ExpertStore, layers: Sequence[int], even: Mapping[int, int], profile: RowsProfile,
                 min_rows: int = 8) -> tuple[dict[int, int], str]:
    """Split the rows of ``even`` (layer -> rows, the even plan) between ``layers`` by ``profile``.

    ``profile``: a :class:`~asyncside.routing.RoutingTrace` or its path, of the runtime's shape:
    one trace layer per runtime layer (in order), each with that layer's number of experts. Each
    layer's LRU miss curve on it (:func:`asyncside.policy_replay.trace_miss_curves`) drives
    :func:`asyncside.policy_replay.split_rows` over the same total. Every layer keeps at least
    ``min(n_experts, max(min_rows, top_k))`` rows (the profile's ``top_k``): a queued decode step
    lends a layer its rows for the token's ``top_k`` distinct experts, and ``min_rows`` is the even
    plan's own floor (where the pools are too small for that, no layer goes below its even rows).
    Returns (layer -> rows, a line for :meth:`MemoryPlan.describe`); TraceError naming the file and
    field for a profile of another shape.
    """
    from ..policy_replay import split_rows, trace_miss_curves

    trace, where = _load_profile(profile)
    order = list(layers)
    if trace.n_layers != len(order):
        raise TraceError(where, f"rows_profile: expected {len(order)} MoE layer{'s' if len(order) != 1 else ''} "
                                f"(the runtime's), got {trace.n_layers} (ids shape {tuple(trace.ids.shape)})",
                         field="ids")
    for i in order:
        n = store.layer(i).n_experts
        if trace.n_experts != n:
            raise TraceError(where, f"rows_profile: expected {n} expert{'s' if n != 1 else ''} (layer {i} of the "
                                    f"store), got {trace.n_experts}", field="n_experts")
    total_rows = sum(int(even[i]) for i in order)
    mins = [min(store.layer(i).n_experts, max(int(min_rows), trace.top_k)) for i in order]
    if sum(mins) > total_rows:
        # Pools smaller than every layer's need: no layer goes below its even share either.
        mins = [min(m, int(even[i])) for m, i in zip(mins, order)]
    curves = trace_miss_curves(trace)
    split = split_rows(curves, total_rows, min_rows=mins)
    rows = {i: int(r) for i, r in zip(order, split)}
    line = (f"rows split by profile {where} ({trace.n_tokens} tokens, LRU miss curves): "
            f"{[rows[i] for i in order]} (even: {int(even[order[0]]) if order else 0} each, "
            f"{total_rows} in all; at least {min(mins) if mins else 0} a layer)")
    return rows, line


def _resident_now() -> int:
    """Bytes this process holds now (VmRSS): the model loaded before the runtime, MLX, Python."""
    return _memory.proc_self_bytes("status", "VmRSS")


def resolve_budget(memory: int | str | None, grows_by: int = 0) -> MemoryBudget:
    """What the runtime may add to this process: ``memory`` (the process's whole budget, bytes or
    a size such as ``"1.5G"``) less what the process holds already and the ``grows_by`` bytes it
    will still take before the runtime enters, capped by what it can still use; or (None) what
    the memory cgroup and MemAvailable allow (their usage counts already)."""
    available = _memory.available_memory()  # through the module: tests stand in a budget
    if memory is None:
        return available
    wanted = parse_size(memory, what="memory")
    if wanted <= 0:
        raise ValueError(f"memory: expected a size > 0, got {memory!r}")
    now = _resident_now()
    held = now + max(0, int(grows_by))
    room = max(0, wanted - held)
    label = f"memory={describe_bytes(wanted)}, {describe_bytes(now)} of it held by the process already"
    if held > now:
        label += f" and {describe_bytes(held - now)} it will take before the runtime enters"
    if room > available.available:
        return MemoryBudget(available.available, f"{label}, capped by {available.source}")
    return MemoryBudget(room, label)


#: what a refusal's "memory=... or more" adds to what the process holds now: a later run of the
#: same command holds a few MiB more or less before it plans, and the figure named must fit it too
#: (``asyncside demo`` also keeps it for the code an all-resident reference leaves: demo.choose_reference)
NEED_MARGIN = 16 << 20


def _pools_refusal(memory: int | str | None, budget: MemoryBudget, pools: int, headroom: int,
                   rows: Mapping[int, int], asked_auto: bool, label: Any, pools_at: Any,
                   raised: Mapping[str, Any] | None = None, grows_by: int = 0) -> AsyncsideError:
    """Why the pools and the headroom do not fit the budget, and what would: the memory= that
    would, and the largest resident fraction that fits where one does. ``raised``
    (:func:`rows_raised`) says why the pools hold the rows they do; ``grows_by`` is what the process
    will take before the runtime enters (:func:`resolve_budget`), which the memory= named includes."""

    def needed(pool_bytes: int) -> str:
        """What memory= would have to be for ``pool_bytes`` of pools (a budget counts what the
        process holds already)."""
        if memory is None:
            # The budget is what the memory cgroup or MemAvailable leaves: only more of that helps
            # (without a figure the refusal read "a larger memory budget for the smallest pools,  for these").
            return f" (at least {describe_bytes(pool_bytes + headroom)} free)"
        # What the process holds now, not memory= less the budget: a memory= below what it holds
        # left a budget of 0, which would hide the difference. What the process will still take
        # before the runtime enters counts as held: a figure without it is refused again then.
        need = _resident_now() + max(0, int(grows_by)) + pool_bytes + headroom + NEED_MARGIN
        return f" (memory={describe_bytes(-(-need // (1 << 20)) << 20)} or more)"

    if asked_auto:
        least = max(rows.values()) if rows else 0
        why = raised["why"] if raised else "top-k"
        if why.startswith(("side_rows=", "min_side_rows=")):
            # Rows the caller asked for: fewer of them fit where the model's top-k allows.
            name = why.split("=")[0]
            advice = (f"these pools hold {_rows(least)} a layer ({why} as given), so the budget must leave "
                      f"at least {describe_bytes(pools + headroom)} beside what the process holds"
                      f"{needed(pools)}: a smaller {name}, a larger memory budget, or fewer layers in this process")
        else:  # already the least rows a step needs: only more memory helps
            reason = "the model's top-k" if why == "top-k" else "the least a layer may hold"
            advice = (f"these are the smallest pools ({_rows(least)} a layer, {reason}), so the "
                      f"budget must leave at least {describe_bytes(pools + headroom)} beside what the process "
                      f"holds{needed(pools)}: a larger memory budget, or fewer layers in this process")
    else:
        fits = _largest_fraction(pools_at, budget.available - headroom)
        if fits is None:
            these = f", {needed(pools).strip(' ()')} for these" if pools != pools_at(0.0) else ""
            advice = (f"no resident fraction fits beside the headroom: a larger memory budget"
                      f"{needed(pools_at(0.0))} for the smallest pools{these}")
        else:
            advice = (f"use resident={fits:.3g} or less (the most whose pools fit), resident='auto', or a larger "
                      f"memory budget{needed(pools)}")
    capped_by = budget.source.partition(", capped by ")[2] if memory is not None else ""
    if capped_by:
        # memory= asked for more than the machine lets the process have: a larger memory= named
        # alone was capped again, to the same budget.
        advice += f"; memory= is capped by {capped_by}, which must allow as much too"
    return AsyncsideError(
        f"the pools need {describe_bytes(pools)} (resident={'auto' if asked_auto else label}) and "
        f"{describe_bytes(headroom)} of headroom for MLX's buffers and the KV caches, "
        f"but the memory budget is {describe_bytes(budget.available)} ({budget.source}): {advice}")


def _refuse_no_dynamic_rows(store: ExpertStore, specs: Mapping[int, LayerSpec], resident: float,
                            side_rows: int | None, min_side_rows: int,
                            pinned: Mapping[int, Sequence[int]] | None) -> None:
    """AsyncsideError where a layer pins some of its experts and has no dynamic row: the first
    token routed to another could not be read anywhere (it failed then, mid-generation)."""
    for i, spec in specs.items():
        chosen, side = plan_layer(store, i, resident, side_rows, min_side_rows, pinned)
        if side == 0 and len(chosen) < spec.n_experts:
            how = "as named by pinned" if pinned is not None else f"by resident={resident:g}"
            raise AsyncsideError(
                f"side_rows=0 with {len(chosen)} of layer {i}'s {spec.n_experts} experts pinned ({how}) leaves "
                f"no row for the other {spec.n_experts - len(chosen)}: a token routed to one of them could not "
                f"be served; give side_rows of at least 1 (the model's top-k, {min_side_rows}, reads a token's "
                f"experts at once) or pin every expert (resident=1)")


def _largest_fraction(pools_at: Any, room: int) -> float | None:
    """The largest resident fraction (to three figures, rounded down) whose pools ``pools_at(f)``
    fit ``room`` bytes; None where even the least pools do not."""
    if room <= 0 or pools_at(0.0) > room:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(30):  # the pools grow with the fraction
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pools_at(mid) <= room else (lo, mid)
    return float(np.floor(lo * 1000) / 1000)


def rows_raised(store: ExpertStore, rows: Mapping[int, int], resident: float, *, side_rows: int | None,
                min_side_rows: int | None, auto: bool = False) -> dict[str, Any] | None:
    """Where the pools' ``rows`` (layer -> rows, the even plan) hold more a layer than ``resident``
    of its experts asks for: the least such rows, the fraction asked (``auto``: the one chosen for
    the budget) and why (``side_rows``, ``min_side_rows`` as given, or the model's top-k, which a
    queued step lends a row each); None where every layer holds what was asked."""
    asked = {i: layer_rows(store.layer(i).n_experts, resident, min_side_rows=1) for i in rows}
    raised = [r for i, r in rows.items() if r > asked[i]]
    if not raised:
        return None
    least = min(raised)
    if side_rows is not None and least == int(side_rows):
        why = f"side_rows={int(side_rows)}"
    elif min_side_rows is not None and least == int(min_side_rows):
        why = f"min_side_rows={int(min_side_rows)}"
    elif least == min_rows(store) and store_top_k(store) is not None:
        why = "top-k"
    else:
        why = "the least rows a layer"
    return {"asked": float(resident), "asked_by": "auto" if auto else "resident", "rows": least, "why": why}


def _choose_direct(direct: bool | None, cached: int, page_cache: int) -> tuple[bool, str]:
    """Whether reads bypass the page cache, and why: as asked, else $ASYNCSIDE_DIRECT, else when
    the ``cached`` bytes (every record of the streamed layers, which buffered reads leave in the
    page cache) exceed the ``page_cache`` the budget leaves."""
    if direct is not None:
        use_direct, why = bool(direct), "asked for"
    elif os.environ.get(ENV_DIRECT) is not None:
        # The readers' parser: 0/1 (true/false, yes/no), anything else refused, never read as 0.
        try:
            use_direct, why = _env_direct(), ENV_DIRECT
        except ValueError as exc:
            raise AsyncsideError(str(exc)) from None
    elif cached > page_cache:
        use_direct = True
        why = (f"the store's {describe_bytes(cached)} of records, which buffered reads would keep in the page "
               f"cache beside the pools' copies, exceed the {describe_bytes(max(page_cache, 0))} the budget "
               f"leaves for it")
    else:
        use_direct = False
        why = (f"the store's {describe_bytes(cached)} of records fit the {describe_bytes(page_cache)} left for "
               f"the page cache")
    return use_direct, why


def _without_staging(direct: bool | None, headroom: int, buffered: Headroom, store_bytes: int, room: int, *,
                     over: bool) -> int:
    """``headroom``, or where it takes the pools ``over`` the budget the ``buffered`` one (no
    staging slab) if the reads may stay buffered: the store's records fit the page cache that
    headroom leaves of ``room`` (a small store under a tight budget, which the slab alone took
    past it)."""
    if over and headroom > buffered.total and not _choose_direct(direct, store_bytes, room - buffered.total)[0]:
        return buffered.total
    return headroom


def plan_headroom(store: ExpertStore, staging_bytes: int | None = None) -> int:
    """The most headroom a plan of ``store`` keeps (:func:`estimate_headroom` of reads past the page
    cache, which add the reader's staging slab): what a figure made before the plan (the demo's
    reference check, ``bench offload``'s least budget) counts for it."""
    return estimate_headroom(store, direct=True, staging_bytes=staging_bytes).total


def plan_memory(
    store: ExpertStore,
    layers: Sequence[int],
    *,
    resident: float | str,
    pinned: Mapping[int, Sequence[int]] | None,
    side_rows: int | None,
    min_side_rows: int | None,
    memory: int | str | None,
    direct: bool | None,
    host_tier: int | str,
    tier_possible: bool,
    rows_profile: RowsProfile | None = None,
    grows_by: int = 0,
    staging_bytes: int | None = None,
) -> MemoryPlan:
    """Plan the runtime's memory (see the module docstring); AsyncsideError when nothing sensible
    fits: the pools, the tier's staging and the headroom must fit the budget. ``rows_profile``
    splits the pools' rows between the layers (:func:`profile_rows`; dynamic rows only: not with
    ``pinned`` or ``side_rows``).

    ``direct`` None lets the plan choose; ``tier_possible`` is whether pools live on a device whose
    fault path can keep a host tier; ``grows_by`` is what the process will take before the runtime
    enters (:func:`resolve_budget`); ``staging_bytes`` is the reader's O_DIRECT staging slab
    (:func:`reader_staging_bytes`, default the reader's own), part of the headroom of a plan that
    reads past the page cache."""
    budget = resolve_budget(memory, grows_by)
    min_given = min_side_rows
    if min_side_rows is None:
        min_side_rows = min_rows(store)
    # The non-expert weights are loaded before the runtime plans (their bytes are in the process's
    # usage, which the budget excludes already; the loader drops their file's pages from the page
    # cache, models.loading.drop_loaded_weights): the headroom is for MLX's buffers and KV caches,
    # estimated from the model (a fixed figure took half of a small budget for no reason). Reads
    # past the page cache add the reader's staging slab, so the plan sizes against that headroom
    # (the larger) and keeps the buffered one where the reads stay buffered.
    parts_direct = estimate_headroom(store, direct=True, staging_bytes=staging_bytes)
    parts_buffered = estimate_headroom(store, direct=False, staging_bytes=staging_bytes)
    headroom = parts_buffered.total if direct is False else parts_direct.total
    specs = {i: store.layer(i) for i in layers}
    notes: list[str] = []

    def rows_at(fraction: float) -> dict[int, int]:
        out = {}
        for i in specs:
            chosen, side = plan_layer(store, i, fraction, side_rows, min_side_rows, pinned)
            out[i] = len(chosen) + side
        return out

    def pools_at(fraction: float) -> int:
        return sum(r * record_bytes(specs[i]) for i, r in rows_at(fraction).items())

    asked_auto = resident == "auto"
    if resident == "auto":
        if pinned is not None:
            raise PlanArgumentError("resident='auto' sizes the pools itself: it takes no pinned experts")
        target = max(0, budget.available - headroom) * AUTO_SHARE
        fraction = 1.0
        if pools_at(1.0) > target:
            lo, hi = 0.0, 1.0
            for _ in range(30):  # bisect: the pools grow with the fraction
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if pools_at(mid) <= target else (lo, mid)
            fraction = lo
        resident = fraction
    elif isinstance(resident, str):
        raise PlanArgumentError(f"resident: expected a fraction in [0, 1] or 'auto', got {resident!r}")
    if rows_profile is not None and (pinned is not None or side_rows is not None):
        raise PlanArgumentError("rows_profile splits the dynamic rows between layers: it takes no pinned experts "
                                "and no side_rows")
    rows = rows_at(float(resident))
    if side_rows is not None or pinned is not None:
        _refuse_no_dynamic_rows(store, specs, float(resident), side_rows, min_side_rows, pinned)
    raised = None if pinned is not None else rows_raised(store, rows, float(resident), side_rows=side_rows,
                                                          min_side_rows=min_given, auto=asked_auto)
    split = None
    if rows_profile is not None:
        rows, split = profile_rows(store, list(specs), rows, rows_profile, min_side_rows)
    pools = sum(r * record_bytes(specs[i]) for i, r in rows.items())

    # The host tier (device pools): whole layers in order while their records fit its bound.
    room = budget.available - pools - headroom
    cap = int(max(room, 0) * TIER_SHARE) if host_tier == "auto" else int(host_tier)
    tier_layers: set[int] = set()
    tier_total = 0
    if not tier_possible and host_tier != "auto" and cap > 0:
        # An explicit host tier on host pools (CPU, or no device fault path) was dropped without a
        # word: the demo printed the same plan with --host-tier 2G as without it.
        notes.append(f"host tier: none kept (host_tier={describe_bytes(cap)} asked): the pools are not MLX CUDA "
                     f"device pools, so a fault reads the record into its row from the store")
    if tier_possible and cap > 0:
        for i, spec in specs.items():
            if tier_total + tier_bytes(spec) > cap:
                break
            tier_layers.add(i)
            tier_total += tier_bytes(spec)
    # The tier's layers get staging arrays: one whole layer per shape, shared by its layers.
    staging_shapes = {_staging_key(specs[i]): specs[i].n_experts * record_bytes(specs[i]) for i in tier_layers}
    staging = sum(staging_shapes.values())

    store_bytes = sum(spec.blob_bytes for spec in specs.values())
    held = pools + tier_total + staging
    page_cache = budget.available - held - headroom
    label = "pinned" if pinned is not None else resident
    headroom = _without_staging(direct, headroom, parts_buffered, store_bytes, budget.available - held,
                                over=pools + headroom > budget.available)
    page_cache = budget.available - held - headroom
    if pools + headroom > budget.available:
        raise _pools_refusal(memory, budget, pools, headroom, rows, asked_auto, label, pools_at, raised, grows_by)
    if page_cache < 0:
        # The tier is pinned host memory held for the runtime's life, like the pools: a tier the
        # budget cannot hold beside them would take the process past it. ("auto" bounds itself
        # to a share of the room, so only an explicit size gets here.)
        raise AsyncsideError(
            f"the host tier (host_tier={host_tier!r}) takes {describe_bytes(tier_total)} "
            f"({len(tier_layers)} layers) plus {describe_bytes(staging)} of staging, but beside the pools' "
            f"{describe_bytes(pools)} and {describe_bytes(headroom)} of headroom the memory budget of "
            f"{describe_bytes(budget.available)} ({budget.source}) leaves {describe_bytes(max(room, 0))}: "
            f"ask for a smaller host_tier, host_tier='auto', or a larger memory budget")
    # Buffered reads leave every record they read in the page cache, the pools' records too: a row is
    # filled through it, and a dynamic row's record is read again once evicted. The page cache then
    # holds the whole store beside the pools' copies, not only the records outside the pools (which
    # took a run past its budget by the pools' size).
    cached = store_bytes
    use_direct, why = _choose_direct(direct, cached, page_cache)
    if not use_direct:
        # buffered reads allocate no staging slab: its room goes to the page cache
        headroom = parts_buffered.total
        page_cache = budget.available - held - headroom
    parts = parts_direct if use_direct else parts_buffered
    # The page cache's room that reads leave unused goes to the KV caches too (KV_SHARE of it): all of
    # it under O_DIRECT, what is left beyond the store's records where reads go through the page cache.
    # Without it a budget of many GiB over a store the page cache holds granted the KV caches a share
    # of the fixed headroom alone, and refused long prompts with "serve with a larger --memory".
    unused = page_cache if use_direct else page_cache - cached
    kv_spare = int(max(unused, 0) * KV_SHARE) if memory is not None else 0
    return MemoryPlan(budget=budget.available, source=budget.source, resident=label, rows=rows, pool_bytes=pools,
                      host_tier_layers=frozenset(tier_layers), host_tier_bytes=tier_total, staging_bytes=staging,
                      headroom_bytes=headroom, store_bytes=store_bytes, page_cache_bytes=max(page_cache, 0),
                      direct=use_direct, direct_reason=why, notes=tuple(notes), split=split,
                      # only a budget asked for (memory=) limits the KV caches: without one the
                      # plan is made against what the machine has now, not a promise to keep
                      kv_allowance_bytes=None if memory is None else parts.kv_own + kv_spare,
                      kv_spare_bytes=kv_spare, forward=forward_cost(store_config(store), store_top_k(store)),
                      experts={i: spec.n_experts for i, spec in specs.items()}, rows_raised=raised,
                      headroom_parts=parts)
