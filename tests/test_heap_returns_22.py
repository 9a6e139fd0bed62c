"""Under a plan that reads past the page cache, freed C-heap blocks of 128 KiB or more go back to
the system at once.

glibc raises the size from which a block is a mapping of its own each time a larger one is freed
(up to 32 MiB), so MLX's buffers of a long prompt's chunks, freed past MLX's own cache, were kept
in the heap and in the resident size a memory budget charges (BENCHMARKS.md, "A long prompt at
the smallest budget: where the memory goes"). The runtime pins that size where the budget is tight.
"""

from __future__ import annotations

import pathlib

import anyio
import pytest
from _fault_helpers import direct_budget

import asyncside.runtime as runtime_mod
from asyncside import ExpertStore, Runtime, memory
from asyncside.runtime import _plan as plan_mod


@pytest.mark.skipif(memory._libc_function("mallopt", [], None) is None,
                    reason="a C library without mallopt (musl, macOS)")
def test_return_large_frees_pins_the_threshold() -> None:
    assert memory.return_large_frees() is True
    assert memory.return_large_frees() is True  # idempotent


@pytest.mark.parametrize("direct", [True, False])
def test_the_runtime_pins_it_only_past_the_page_cache(quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                      direct: bool) -> None:
    calls: list[int] = []
    monkeypatch.setattr(runtime_mod, "return_large_frees", lambda: calls.append(1) or True)
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)  # planned as if the process held nothing
    store = ExpertStore.open(quick_store)
    budget = direct_budget(store) if direct else 1 << 40

    async def main() -> bool:
        async with Runtime(store, resident=0.25, memory=budget) as rt:
            assert rt.plan is not None
            return bool(rt.plan.direct)

    try:
        planned_direct = anyio.run(main)
    except OSError as exc:  # a file system that refuses O_DIRECT
        pytest.skip(f"O_DIRECT refused here: {exc}")
    assert planned_direct is direct
    assert calls == ([1] if direct else [])
