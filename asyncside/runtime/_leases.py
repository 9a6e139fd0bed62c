"""Leases: rows a forward reads stay pinned until the computation that reads them completed.

A lease is taken on the host when the forward builds its graph and released by the completion
of that graph on its stream (the completion bridge), never by the luck of ordering: a row is not
refilled while a computation that took its old mapping may still read it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import mlx.core as mx

from ._state import Shared, native_available


class Leases:
    """Lease and release rows; the release of a lease can wait for a computation."""

    def __init__(self, shared: Shared) -> None:
        self._s = shared
        #: release_after() calls whose computation is awaited by a task: key -> (x, leases)
        self._pending: dict[int, tuple[mx.array, list[tuple[int, int]]]] = {}
        self._keys = itertools.count()

    def lease(self, layer: int, experts: Iterable[int]) -> int:
        """Pin the rows of ``experts`` so no fill overwrites them; returns a lease id."""
        return self._s.layer(layer).ledger.lease(experts)

    def release(self, layer: int, lease_id: int) -> None:
        """Release a lease now (the caller knows the rows are no longer read)."""
        self._s.layer(layer).ledger.release(lease_id)
        self._s.notify()

    def release_after(self, x: mx.array, leases: Iterable[tuple[int, int]]) -> None:
        """Release ``leases`` ((layer, lease id) pairs) once ``x`` has been computed."""
        held = list(leases)
        if not held:
            return
        if self._s.closed or native_available(x):
            # Closed: no fill will write a row again. Computed (e.g. a prefill chunk's awaited
            # output): nothing reads the rows. Either way, release now.
            self._release_all(held)
            return
        key = next(self._keys)
        self._pending[key] = (x, held)
        self._s.spawn(self._release_when_computed, key)

    async def _release_when_computed(self, key: int) -> None:
        entry = self._pending.get(key)
        if entry is None:
            return  # release_computed() released them before this task first ran
        x = entry[0]
        try:
            await self._s.computed(x)
        except Exception:
            # x's computation failed: its own awaiter hears of that. Raised here, in the runtime's
            # task group, it cancelled the whole `async with Runtime(...)` body and the exit
            # raised it again; the rows are released all the same (nothing reads them any more).
            pass
        finally:
            # Even when cancelled (runtime closing) the leases go: nothing reads them after.
            # (release_computed() may have released them already.)
            held = self._pending.pop(key, None)
            if held is not None:
                self._release_all(held[1])

    def release_computed(self) -> None:
        """Release now the leases whose computation already finished but whose release task has
        not run yet (a step about to be queued needs those rows lendable)."""
        done = [k for k, (x, _) in self._pending.items() if native_available(x)]
        for key in done:
            self._release_all(self._pending.pop(key)[1], notify=False)
        if done:
            self._s.notify()

    def _release_all(self, held: list[tuple[int, int]], *, notify: bool = True) -> None:
        for layer, lease_id in held:
            self._s.layer(layer).ledger.release(lease_id)
        if notify:
            self._s.notify()
