"""Unseen inputs, round 18: the store's disk and filesystem as a user's machine has them, larger than
memory: filesystems that refuse O_DIRECT, stores of another alignment, files changed or failing
under a running runtime, and a store written onto a filesystem that fills or a run cut short."""

from __future__ import annotations

import errno
import os
import pathlib
from typing import Any

import pytest

from asyncside import ExpertStore


def _refuse_o_direct(monkeypatch: pytest.MonkeyPatch, under: pathlib.Path) -> None:
    """Opens of files under ``under`` with O_DIRECT fail with EINVAL, as ramfs and some FUSE mounts
    (and tmpfs before Linux 6.6) answer them."""
    real = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0) and str(under) in str(path):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def test_the_demos_disk_probe_on_a_filesystem_without_o_direct_measures_nothing(
        quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --model STORE --memory 400M`` with the store on ramfs (no O_DIRECT) ended in
    ``OSError: [Errno 22] Invalid argument`` and a traceback from the disk probe, though the plan
    read the store buffered. The probe measures nothing ("the disk probe read nothing") and the
    demo runs; no file is left open."""
    from _fault_helpers import describe_fds, open_fds

    from asyncside.demo import probe_disk

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    store = ExpertStore.open(quick_store)
    _refuse_o_direct(monkeypatch, quick_store)
    before = open_fds()
    got = probe_disk(store, seconds=0.05)
    assert got["bytes_per_s"] == 0.0 and got["record_bytes"] == max(s.stride for s in store.layers.values())
    leaked = open_fds() - before
    assert not leaked, describe_fds(leaked)
