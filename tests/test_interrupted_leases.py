"""A lease interrupted inside the ledger leaves nothing pinned: ``rt.lease()`` whose eviction policy
hook raises a BaseException (an interrupt, a MemoryError) pins no row, and the runtime goes on."""

from __future__ import annotations

import pathlib

import anyio
import pytest

from asyncside import ExpertStore, Runtime
from asyncside.audit import audit_problems


class Interrupt(BaseException):
    """What a KeyboardInterrupt or a MemoryError raised inside the policy's hook stands for."""


def test_a_lease_whose_policy_hook_raises_pins_nothing(quick_store: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``rt.lease()`` pinned the rows before the eviction policy heard of the lease: a hook that
    raised left them pinned under no lease id the caller could release, so no fill could ever take
    those rows again and the audit reported them after the exit."""
    store = ExpertStore.open(quick_store)
    layer = min(store.layers)

    def raising(expert: int) -> None:
        raise Interrupt("the policy's hook")

    async def main() -> Runtime:
        async with Runtime(store, resident=0.25) as rt:
            await rt.ensure(layer, [1, 2])
            ledger = rt.ledger(layer)
            monkeypatch.setattr(ledger.policy, "on_lease", raising)
            with pytest.raises(Interrupt):
                rt.lease(layer, [1, 2])
            monkeypatch.undo()
            assert ledger.pinned_rows() == {}
            rt.release(layer, rt.lease(layer, [1, 2]))  # the runtime goes on leasing
        return rt

    rt = anyio.run(main)
    assert audit_problems(rt) == []
