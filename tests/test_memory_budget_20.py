"""What a buffered plan leaves in the page cache beyond the store's expert records.

Loading a streaming model reads the store's non-expert weights (``model.safetensors``: embeddings,
attention, norms) through the page cache into the process's own arrays, and never reads them
again. A plan that reads buffered left those pages cached, where a memory cgroup charges them to
the process beside the loaded copy: the plan counts the process's resident bytes and the store's
records, not them. Loading now drops them.

The plain reference model (every expert in memory, what ``asyncside demo`` checks tokens against
when it fits the budget) reads the whole store the same way: ``demo --memory 680M`` on a 279 MiB
store was charged 744.8 MiB at its peak in a larger cgroup. Loading it now drops those pages too.
"""

from __future__ import annotations

import os
import pathlib

import pytest
from _fault_helpers import cached_bytes

from asyncside.models.loading import NON_EXPERT_FILE, load_reference_model, load_streaming_model
from asyncside.store import ExpertStore


def _clean_and_dropped(files: list[pathlib.Path]) -> None:
    """``files`` written to the disk and out of the page cache; skips where advice keeps them."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here: the page cache cannot be advised")
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # a store written by this session has dirty pages, which no advice drops
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if cached_bytes(f) != 0:
            pytest.skip("this file system keeps the file's pages whatever the advice (tmpfs, ramfs)")


def test_the_reference_model_leaves_none_of_the_store_cached(quick_store: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """After the plain reference model is built from a store (its every record and its non-expert
    weights read), none of those files' pages stay in the page cache (all of them stayed, beside
    the model's own copy of every byte); nor, while it loads, do the layers already read (they
    stayed until the model was built, the whole store's pages at its peak)."""
    store = ExpertStore.open(quick_store)
    blobs = {i: pathlib.Path(spec.path) for i, spec in store.layers.items()}
    files = [quick_store / NON_EXPERT_FILE, *blobs.values()]
    _clean_and_dropped(files)
    read = ExpertStore.read_expert
    seen: dict[int, int] = {}  # layer -> bytes of the layers read before it still cached when it is

    def read_expert(self: ExpertStore, layer: int, expert: int) -> dict[str, object]:
        if layer not in seen:
            seen[layer] = sum(cached_bytes(f) for i, f in blobs.items() if i != layer)
        return read(self, layer, expert)

    monkeypatch.setattr(ExpertStore, "read_expert", read_expert)
    model, _config = load_reference_model(quick_store)
    assert len(seen) == len(blobs) > 1 and not any(seen.values()), seen
    assert model is not None
    cached = {f.name: cached_bytes(f) for f in files}
    assert not any(cached.values()), cached


def test_loading_a_model_leaves_no_non_expert_pages_cached(quick_store: pathlib.Path) -> None:
    """After the load the model holds its non-expert weights itself and none of the file's pages
    stay in the page cache (all of them stayed: a buffered plan's run was charged them beside the
    copy, which the plan does not count)."""
    weights = quick_store / NON_EXPERT_FILE
    _clean_and_dropped([weights])
    model = load_streaming_model(quick_store)
    assert model.store is not None
    assert cached_bytes(weights) == 0, f"{cached_bytes(weights)} of {weights.stat().st_size} bytes still cached"
