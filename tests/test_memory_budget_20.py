"""What a buffered plan leaves in the page cache beyond the store's expert records.

Loading a streaming model reads the store's non-expert weights (``model.safetensors``: embeddings,
attention, norms) through the page cache into the process's own arrays, and never reads them
again. A plan that reads buffered left those pages cached, where a memory cgroup charges them to
the process beside the loaded copy: the plan counts the process's resident bytes and the store's
records, not them. Loading now drops them.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pathlib

import pytest

from asyncside.models.loading import NON_EXPERT_FILE, load_streaming_model


def _cached_bytes(path: pathlib.Path) -> int:
    """Bytes of the file ``path`` in the page cache (mincore over a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), "mmap failed"
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(v & 1 for v in vec) * mmap.PAGESIZE
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_loading_a_model_leaves_no_non_expert_pages_cached(quick_store: pathlib.Path) -> None:
    """After the load the model holds its non-expert weights itself and none of the file's pages
    stay in the page cache (all of them stayed: a buffered plan's run was charged them beside the
    copy, which the plan does not count)."""
    weights = quick_store / NON_EXPERT_FILE
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here: the page cache cannot be advised")
    fd = os.open(weights, os.O_RDONLY)
    try:
        os.fsync(fd)  # a store written by this session has dirty pages, which no advice drops
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _cached_bytes(weights) != 0:
        pytest.skip("this file system keeps the file's pages whatever the advice (tmpfs, ramfs)")
    model = load_streaming_model(quick_store)
    assert model.store is not None
    assert _cached_bytes(weights) == 0, f"{_cached_bytes(weights)} of {weights.stat().st_size} bytes still cached"
