"""The runtime's audit: every ledger's own invariants, plus what only the runtime can see (the
native fault tables agree with the ledgers; nothing is left leased or pending after close)."""

from __future__ import annotations

import numpy as np

from ..ledger import AuditReport
from ._queued import QueuedSide
from ._state import LayerState, Shared


def audit(shared: Shared, queued: QueuedSide) -> dict[int, AuditReport]:
    """Layer -> AuditReport, with the queued steps' faults applied first."""
    idle = queued.idle()
    reports: dict[int, AuditReport] = {}
    for i, st in shared.layers.items():
        queued.reconcile(st)
        report = st.ledger.audit()
        extra = _native_table_problems(st) if idle else []
        if shared.exited:
            extra += _left_behind(st, report)
        if extra:
            report = AuditReport(False, [*report.problems, *extra], report.counts)
        reports[i] = report
    return reports


def _native_table_problems(st: LayerState) -> list[str]:
    """With no queued step in flight, a layer's native fault table must equal its ledger."""
    if st.faults is None or st.native_dirty:
        return []
    problems: list[str] = []
    native = np.asarray(st.faults.table(), dtype=np.int32)
    lookup = st.ledger.lookup()
    if not np.array_equal(native, lookup):
        bad = np.flatnonzero(native != lookup)[:8].tolist()
        problems.append(f"native fault table differs from the ledger for experts {bad}")
    lent_native = sorted(st.faults.lent())
    if lent_native != sorted(st.ledger.lent_rows()):
        problems.append(f"rows lent natively {lent_native} != lent by the ledger {sorted(st.ledger.lent_rows())}")
    return problems


def _left_behind(st: LayerState, report: AuditReport) -> list[str]:
    """Once the runtime closed: a lease nobody released, or a fill still pending, is a problem."""
    problems: list[str] = []
    pinned = st.ledger.pinned_rows()
    n_leases = report.counts.get("leases", 0)
    if n_leases or pinned:
        problems.append(f"{n_leases} lease(s) still open after the runtime closed "
                        f"(pinned rows {sorted(pinned)}): a lease was never released")
    pending = st.ledger.pending()
    if pending:
        problems.append(f"{len(pending)} fill(s) still pending after the runtime closed: {pending[:4]}")
    return problems
