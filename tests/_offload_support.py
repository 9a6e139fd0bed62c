"""Memory budgets for tests that run ``bench offload``.

A test's ``--memory`` was written for the CPU, where a run's process holds little before its model.
On MLX CUDA it holds several times more (the CUDA runtime and MLX's device state), and the same
budget holds no run: the bench refuses it before anything runs. :func:`offload_budget` keeps the
room a test's budget leaves beyond a run's process on every device.
"""

from __future__ import annotations

from asyncside.bench import offload

#: at least what a run's process holds on the CPU before its model (``offload.process_baseline``)
CPU_PROCESS_BYTES = 128 * 2**20


def offload_budget(cpu_budget: int) -> int:
    """``cpu_budget`` where a run's process holds what it does on the CPU; where it holds more
    (:func:`offload.process_baseline`, measured in a child once per test process), a budget that
    leaves the same room beyond it."""
    return max(cpu_budget, offload.process_baseline() + cpu_budget - CPU_PROCESS_BYTES)
