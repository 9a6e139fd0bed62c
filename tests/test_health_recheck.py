"""HealthRegistry.recheck heals a bad expert only once what the runtime reads verifies.

A blob replaced on disk by another file is re-opened under the runtime (its descriptors re-pointed,
its reader's handles re-opened) before the bad experts are read again. The verification reads the
file at the path; if the replacement lands between the look at the file's identity and that read,
the record verifies from the new file while the runtime's descriptors still read the old one: the
expert was cleared, /health said 200, and the next request failed on the same records
(test_serve_faults' damaged-blob test, now and then in full-suite runs under load).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import anyio

from asyncside.errors import FillError
from asyncside.serving.health import HealthRegistry

RECORD = 64
N_EXPERTS = 4


class OneBlobStore:
    """A store of one layer (3) whose records verify when they equal ``good``'s; ``before_read``
    runs once, just before the next record is read (where a replacement can land)."""

    def __init__(self, root: pathlib.Path, good: bytes) -> None:
        self.path = root
        self.blob = root / "layer-00003.bin"
        self.good = good
        self.layers = [3]
        self.before_read: Callable[[], None] | None = None

    def layer(self, index: int) -> Any:
        assert index == 3
        return SimpleNamespace(path=self.blob)

    def read_record(self, layer: int, expert: int, verify: bool = True) -> bytes:
        hook, self.before_read = self.before_read, None
        if hook is not None:
            hook()
        with open(self.blob, "rb") as f:
            f.seek(expert * RECORD)
            data = f.read(RECORD)
        if verify and data != self.good[expert * RECORD:(expert + 1) * RECORD]:
            raise FillError(layer, expert, -1, "checksum mismatch", errno=74)
        return data


def _checksum_failure(expert: int) -> FillError:
    return FillError(3, expert, 0, "fault in a queued step: checksum mismatch", errno=74)


def _damaged(tmp_path: pathlib.Path, experts: list[int]) -> tuple[OneBlobStore, HealthRegistry, list[str]]:
    """A store whose blob was good when its registry was made, then damaged in place (the same
    file: what the runtime reads) at ``experts``, each recorded bad; and the paths the registry's
    reader hook was asked to re-open."""
    good = bytes(range(256)) * (RECORD * N_EXPERTS // 256)
    store = OneBlobStore(tmp_path, good)
    store.blob.write_bytes(good)
    reopened: list[str] = []

    async def reopen_reader(path: str) -> None:
        reopened.append(path)

    health = HealthRegistry(store, reopen_reader=reopen_reader)
    damaged = bytearray(good)
    for e in experts:
        damaged[e * RECORD] ^= 0x40
    store.blob.write_bytes(damaged)
    for e in experts:
        health.record(_checksum_failure(e))
    assert len(health.bad) == len(experts)
    return store, health, reopened


def test_a_blob_replaced_while_its_experts_are_verified_is_reopened_before_they_heal(tmp_path: pathlib.Path) -> None:
    store, health, reopened = _damaged(tmp_path, list(range(N_EXPERTS)))
    good = store.good
    held = os.open(store.blob, os.O_RDONLY)  # the runtime's descriptor: the damaged file's
    try:
        async def main() -> list[int]:
            # A first recheck sees the file changed in place: nothing to re-open, still bad.
            assert await health.recheck() == 0 and len(health.bad) == N_EXPERTS

            def replace() -> None:  # lands after the recheck looked at the file, before it reads
                fresh = store.blob.with_name("layer-00003.bin.new")
                fresh.write_bytes(good)
                os.replace(fresh, store.blob)

            store.before_read = replace
            healed = []
            for _ in range(4):
                healed.append(await health.recheck())
                if not health.bad:
                    break
            return healed

        healed = anyio.run(main)
        assert not health.bad and sum(healed) == N_EXPERTS, (healed, health.problems())
        # Healed only with what the runtime reads verifying: its descriptor was re-pointed at the
        # new file and its reader re-opened, before or in the recheck that cleared the experts.
        assert reopened == [str(store.blob)] and health.reopened == 1
        assert os.pread(held, RECORD * N_EXPERTS, 0) == good
    finally:
        os.close(held)


def test_a_blob_repaired_in_place_heals_without_reopening(tmp_path: pathlib.Path) -> None:
    store, health, reopened = _damaged(tmp_path, [1])

    async def main() -> tuple[int, int]:
        first = await health.recheck()
        store.blob.write_bytes(store.good)  # repaired in place: the runtime's descriptors read it already
        return first, await health.recheck()

    assert anyio.run(main) == (0, 1)
    assert not health.bad and reopened == [] and health.reopened == 0
