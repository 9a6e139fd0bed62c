"""A new user's machine, round 14, on the facade's side: ``load()`` reads a residency as the
command line writes it, and a model directory saved again is converted again, not served from the
store of the weights it held before."""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

import pytest

from asyncside.facade import load
from asyncside.hub import store_for

from _facade_support import dirs  # noqa: F401  (a fixture)


def _rows(model: Any) -> set[int]:
    plan = model.runtime.plan
    assert plan is not None
    return set(dict(plan.rows).values())


def test_load_takes_a_residency_as_the_command_line_writes_it(dirs: tuple[pathlib.Path, pathlib.Path]) -> None:
    """``load(store, resident="25%")`` was refused ("expected a fraction in [0, 1] or 'auto', got
    '25%'") where ``Runtime(resident="25%")`` and ``--resident 25%`` take it."""
    with load(dirs[1], resident=0.25)[0] as plain:
        expected = _rows(plain)
    for spelled in ("25%", " 0.25 "):
        with load(dirs[1], resident=spelled)[0] as model:
            assert _rows(model) == expected
    for bad in ("125%", "x", ""):
        with pytest.raises(ValueError, match=r"^resident: "):
            load(dirs[1], resident=bad)


def test_a_model_directory_saved_again_is_converted_again(dirs: tuple[pathlib.Path, pathlib.Path],
                                                          tmp_path: pathlib.Path) -> None:
    """A model directory is converted on first use and its store cached by the directory's path:
    a model saved again into that directory (fine-tuned, another checkpoint) reused the store of
    the first, and generated the old weights' tokens without a word."""
    model_dir = tmp_path / "model"
    shutil.copytree(dirs[0], model_dir)
    said: list[str] = []
    first = store_for(model_dir, cache_dir=tmp_path / "cache", progress=False, say=said.append)
    assert "converting" in said[-1]
    assert store_for(model_dir, cache_dir=tmp_path / "cache", progress=False, say=said.append) == first
    assert "using the store converted on first use" in said[-1]

    weights = sorted(model_dir.glob("*.safetensors"))[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # saved again
    again = store_for(model_dir, cache_dir=tmp_path / "cache", progress=False, say=said.append)
    assert again == first
    assert f"{weights.name} changed since its store was converted; converting again" in said[-1], said[-1]
    assert store_for(model_dir, cache_dir=tmp_path / "cache", progress=False, say=said.append) == first
    assert "using the store converted on first use" in said[-1]


def test_a_revision_of_a_local_directory_is_refused(dirs: tuple[pathlib.Path, pathlib.Path]) -> None:
    """``load(local_dir, revision="v2")`` ignored the revision without a word and loaded the
    directory's files, whatever revision had been asked for."""
    from asyncside.errors import ModelNotFoundError
    from asyncside.hub import resolve_model

    for name in dirs:
        with pytest.raises(ModelNotFoundError, match=r"a local path, where revision='v2' means nothing"):
            load(name, revision="v2")
    assert resolve_model(dirs[0]) == dirs[0].absolute()
