"""Reading routing traces: `serve --routing` reads a pipe once, `routing info` on long traces, and
a zip bomb in a trace file refused before it is inflated."""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import numpy as np
import pytest

from asyncside.routing import RoutingTrace, preset


@pytest.fixture(scope="module")
def quick_store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from asyncside.bench import generate as bench
    from asyncside.models.embedded import ensure_embedded_default

    cache = tmp_path_factory.mktemp("embedded")
    return ensure_embedded_default(cache, spec=bench._quick_spec(), progress=False)[1]


def test_serve_replays_a_trace_from_a_pipe(quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --routing <(cat t.npz)` read the pipe to check it, then the engine opened it again and
    found it empty ("a pipe such as <(...) reads once"): the command now reads the trace once and
    hands the engine what it read. Through the CLI's own argument handling and the real engine;
    only the HTTP server is left out."""
    from asyncside.cli import build_parser
    from asyncside.serving import cli as serve_cli

    trace = preset("high", tokens=20, n_layers=2, n_experts=32, top_k=4, sequences=2)
    seen: dict[str, Any] = {}

    async def no_server(args: argparse.Namespace) -> None:
        async with serve_cli.engine_factory_from_args(args)() as engine:
            seen.update(engine.description["routing"])
            seen["replay"] = engine.routing

    monkeypatch.setattr(serve_cli, "run_serve", no_server)
    monkeypatch.setattr(serve_cli, "bound_malloc", lambda: False)
    r, w = os.pipe()
    try:
        data = _saved(trace)
        assert len(data) < 16 << 10  # fits the pipe's buffer: written whole before it is read
        os.write(w, data)
        os.close(w)
        w = -1
        args = build_parser().parse_args(["serve", "--model", str(quick_store), "--resident", "0.5",
                                          "--routing", f"/dev/fd/{r}"])
        assert serve_cli.serve_main(args) == 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert seen["file"] == str(r) and seen["tokens"] == 10 and seen["sequences"] == 2
    assert np.array_equal(seen["replay"].fitted.ids, trace.ids) and seen["replay"].source == f"/dev/fd/{r}"


def _saved(trace: RoutingTrace) -> bytes:
    """The bytes of ``trace`` saved as a file."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "t.npz"
        trace.save(path)
        return path.read_bytes()
