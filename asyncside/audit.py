"""The runtime's ledger audit as a list of problems: shared by the pytest plugin and the server's /health."""

from __future__ import annotations

from typing import Any


def audit_problems(runtime: Any) -> list[str]:
    """Every problem the runtime's ledgers report, prefixed by layer; empty when all are clean."""
    problems: list[str] = []
    for layer, report in runtime.audit().items():
        if not report.ok:
            problems.extend(f"layer {layer}: {p}" for p in report.problems)
    return problems
