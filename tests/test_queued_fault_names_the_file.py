"""A queued step's failed read names the blob it read, as a fill's failure does; a group of them
says its first failure on its own line (what a traceback's last line shows)."""

from __future__ import annotations

import os
import pathlib

import anyio
import mlx.core as mx
import pytest
from _fault_helpers import model_store

from asyncside.audit import audit_problems
from asyncside.bridge import completed
from asyncside.errors import FillError
from asyncside.models import load_streaming_model
from asyncside.runtime import Runtime


def test_a_blob_truncated_under_a_running_runtime_names_its_file_layer_and_expert(tmp_path: pathlib.Path) -> None:
    """A blob truncated while the model generated (a copy still being written, a disk that filled)
    failed its queued steps with "layer 1 expert 28 (row 0): fault in a queued step: the blob ended
    before the record did", naming no file; several of them raised ``ExceptionGroup: 58 faults
    failed``, naming nothing. Each names the blob and the record's bytes, the group its first; no
    row is left taken, and the blob written back, the same runtime reads it."""
    store_dir, _model, _prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed)
    layer = sm.moe_layers[0]
    spec = sm.store.layer(layer)
    whole = spec.path.read_bytes()
    bad = [spec.n_experts - 2, spec.n_experts - 1]

    async def step(rt: Runtime, ids: list[int]) -> int:
        q = rt.queued
        s = q.begin()
        out = q.expert_rows(layer, mx.array(ids, dtype=mx.uint32)).astype(mx.int32).sum()
        q.end(out)  # type: ignore[arg-type]
        mx.async_eval(out)
        await completed(out)
        return s

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0) as rt:
            os.truncate(spec.path, spec.record_offset(bad[0]))
            failing = await step(rt, bad)
            with pytest.raises(ExceptionGroup) as group:
                rt.queued.after_step(failing)
            said = str(group.value)
            assert said.startswith("2 faults failed; the first: ") and str(spec.path) in said, said
            for exc in group.value.exceptions:
                assert isinstance(exc, FillError) and exc.layer == layer and exc.expert in bad
                lo = spec.record_offset(exc.expert)
                assert f"read of {spec.path} record {exc.expert} (bytes [{lo}, {lo + spec.stride})): " \
                       "the blob ended before the record did" in str(exc), str(exc)
            await anyio.to_thread.run_sync(spec.path.write_bytes, whole)  # the same file, whole again
            rt.queued.after_step(await step(rt, bad))
            await rt.quiesce()
            assert audit_problems(rt) == []

    anyio.run(main)
