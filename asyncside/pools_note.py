"""What a demo's pools hold, in the command line's words: the title's rows per layer and, where the
runtime's plan raised the rows above ``--resident``, what was asked and why; a ``--side-rows`` they
cannot hold, refused. Shared by the one-process demo (:mod:`asyncside.demo`) and the ranks'
(:mod:`asyncside.distributed.demo`)."""

from __future__ import annotations

from typing import Any

__all__ = ["cli_rows_raised", "rows_note", "side_rows_refused"]


def cli_rows_raised(raised: dict[str, Any] | None) -> dict[str, Any] | None:
    """The runtime plan's ``rows_raised`` (see ``MemoryPlan.rows_raised``) in the command line's
    words: ``--resident`` asked, ``--side-rows N`` raised."""
    if not raised:
        return None
    why = str(raised["why"])
    if why.startswith("side_rows="):
        why = f"--side-rows {why.split('=', 1)[1]}"
    asked_by = "auto" if raised["asked_by"] == "auto" else "--resident"
    return {**raised, "asked_by": asked_by, "why": why}


def rows_note(result: dict[str, Any]) -> str:
    """The pools' rows per layer for the table's title: one figure, or the split by a profile; and,
    where they hold more than asked, what was asked and why it was raised."""
    split = result.get("pool_rows_split")
    if split:
        return f"rows per layer split by a profile: {' '.join(str(r) for r in split)} of {result['experts_per_layer']}"
    note = f"{result['pool_rows_per_layer']}/{result['experts_per_layer']} rows per layer"
    raised = result.get("rows_raised")
    if raised:
        rows = raised["rows"]
        asked = "chosen for the budget" if raised.get("asked_by") == "auto" else "asked"
        note += (f"; {raised['asked']:.0%} {asked}, raised to {rows} {'row' if rows == 1 else 'rows'} a layer "
                 f"({raised['why']})")
    return note


def side_rows_refused(store: Any, side_rows: int | None) -> None:
    """A PlanArgumentError naming ``--side-rows`` where ``side_rows`` is more dynamic rows than a
    layer of ``store`` has experts (the most it can be, and why), as the runtime refuses
    ``side_rows=``: said before a model loads."""
    from .runtime._plan import PlanArgumentError, side_rows_problem

    problem = side_rows_problem(store, list(store.layers), side_rows, name="--side-rows ")
    if problem is not None:
        raise PlanArgumentError(problem)
