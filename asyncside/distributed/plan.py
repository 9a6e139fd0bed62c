"""Which decoder layers each pipeline stage runs.

Rank 0 holds the embedding and the first layers, the last rank the last layers, the final norm
and the head; every layer id is the model's own (the expert store's) id, never renumbered.
``--split a,b,...`` gives the number of decoder layers per rank in rank order; without it the
layers are split evenly, the earlier ranks taking the remainder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import AsyncsideError


class PlanError(AsyncsideError, ValueError):
    """A split that does not fit the model or the group (the message names the value)."""


@dataclass(frozen=True)
class Stage:
    """One rank's share of the model: decoder layers ``[start, stop)``."""

    rank: int
    start: int
    stop: int
    #: the MoE layers among them (store layer ids), ascending
    moe_layers: tuple[int, ...]

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def first(self) -> bool:
        return self.start == 0

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "start": self.start, "stop": self.stop, "moe_layers": list(self.moe_layers)}


@dataclass(frozen=True)
class StagePlan:
    """Every rank's stage. ``stages[r]`` is rank r's; they tile ``[0, n_layers)`` in order."""

    n_layers: int
    stages: tuple[Stage, ...]

    @property
    def size(self) -> int:
        return len(self.stages)

    @property
    def split(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.stages)

    def stage(self, rank: int) -> Stage:
        if not 0 <= rank < self.size:
            raise PlanError(f"rank {rank} is outside the plan's {self.size} stages")
        return self.stages[rank]

    def is_last(self, rank: int) -> bool:
        return rank == self.size - 1

    def next_moe(self, rank: int) -> int | None:
        """The first MoE layer after rank ``rank``'s stage (what its successor routes first), or None."""
        for s in self.stages[rank + 1:]:
            if s.moe_layers:
                return s.moe_layers[0]
        return None

    def fingerprint(self) -> str:
        """A short text every rank must agree on (checked when the ranks meet)."""
        return f"layers={self.n_layers} split={','.join(map(str, self.split))}"

    def to_json(self) -> dict[str, object]:
        return {"n_layers": self.n_layers, "split": list(self.split), "stages": [s.to_json() for s in self.stages]}


def parse_split(text: str | None) -> list[int] | None:
    """``"a,b,..."`` -> ``[a, b, ...]`` (None for None/empty). PlanError on anything else."""
    if text is None or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise PlanError(f"--split {text!r}: expected comma-separated layer counts such as 2,2") from None
    return counts


def even_split(n_layers: int, size: int) -> list[int]:
    """``n_layers`` over ``size`` ranks as evenly as possible, the earlier ranks taking the remainder."""
    base, extra = divmod(n_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def make_plan(n_layers: int, moe_layers: Sequence[int], size: int, split: Sequence[int] | None = None) -> StagePlan:
    """The stage of every rank for a model of ``n_layers`` decoder layers (MoE ones: ``moe_layers``)."""
    if size < 1:
        raise PlanError(f"a pipeline needs at least one rank, got {size}")
    if n_layers < size:
        raise PlanError(f"the model has {n_layers} decoder layer{'s' if n_layers != 1 else ''}, fewer than the "
                        f"{size} ranks: "
                        "every stage needs at least one layer")
    counts = list(split) if split is not None else even_split(n_layers, size)
    if len(counts) != size:
        raise PlanError(f"--split {','.join(map(str, counts))} has {len(counts)} "
                        f"{'entry' if len(counts) == 1 else 'entries'} for {size} {'rank' if size == 1 else 'ranks'}")
    if any(c < 1 for c in counts) or sum(counts) != n_layers:
        raise PlanError(f"--split {','.join(map(str, counts))}: every count must be >= 1 and they must sum to "
                        f"the model's {n_layers} decoder layers (they sum to {sum(counts)})")
    moe = sorted(int(m) for m in moe_layers)
    if any(not 0 <= m < n_layers for m in moe):
        raise PlanError(f"MoE layers {moe} fall outside the model's {n_layers} decoder layers")
    stages = []
    start = 0
    for rank, c in enumerate(counts):
        stop = start + c
        stages.append(Stage(rank, start, stop, tuple(m for m in moe if start <= m < stop)))
        start = stop
    return StagePlan(n_layers, tuple(stages))
