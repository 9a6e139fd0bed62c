"""Reading routing traces: `serve --routing` reads a pipe once, `routing info` on long traces, and
a zip bomb in a trace file refused before it is inflated."""

from __future__ import annotations

import argparse
import io
import os
import pathlib
from typing import Any

import numpy as np
import pytest

from asyncside.errors import TraceError
from asyncside.routing import RoutingTrace, preset


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


# -- routing info: LRU and MIN hit rates vectorised, the same figures as the walks they replaced --


def _reference_lru_miss_curve(demands: list[list[int]], n_experts: int) -> np.ndarray:
    """The stack walk ``policy_replay.lru_miss_curve`` was before it was vectorised (one list
    operation per access: about a minute for `routing info` on 100k tokens x 8 layers)."""
    stack: list[int] = []
    hist = np.zeros(n_experts + 1, dtype=np.int64)
    accesses = 0
    for d in demands:
        req = sorted({int(e) for e in d})
        for e in req:
            accesses += 1
            if e in stack:
                hist[stack.index(e)] += 1
        stack = req + [e for e in stack if e not in req]
    hits = np.concatenate([[0], np.cumsum(hist)[:n_experts]])
    return np.asarray(accesses - hits, dtype=np.int64)


def _reference_min_hits(trace: RoutingTrace, rows: int) -> int:
    """MIN with bypass layer by layer, as `routing info` computed it before."""
    from asyncside.models.trace import belady

    return sum(belady(trace.layer_steps(layer), (), rows).side_hits for layer in range(trace.n_layers))


_SMALL = [
    dict(name="low", tokens=300, n_layers=3, n_experts=16, top_k=4, sequences=2, seed=1),
    dict(name="middle", tokens=257, n_layers=2, n_experts=32, top_k=6, sequences=1, seed=2),
    dict(name="high", tokens=200, n_layers=4, n_experts=8, top_k=2, sequences=3, seed=3),
    dict(name="high", tokens=50, n_layers=1, n_experts=5, top_k=5, sequences=1, seed=4),
    dict(name="low", tokens=1, n_layers=2, n_experts=4, top_k=1, sequences=1, seed=5),
]


@pytest.mark.parametrize("spec", _SMALL, ids=lambda s: f"{s['name']}-{s['n_experts']}x{s['top_k']}")
def test_vectorised_hit_rates_equal_the_reference(spec: dict[str, Any]) -> None:
    from asyncside.policy_replay import lru_miss_curve, trace_min_hits, trace_miss_curves

    spec = dict(spec)
    trace = preset(spec.pop("name"), **spec)
    curves = trace_miss_curves(trace)
    for layer in range(trace.n_layers):
        ref = _reference_lru_miss_curve(trace.ids[:, layer, :].tolist(), trace.n_experts)
        assert np.array_equal(curves[layer], ref)
        assert np.array_equal(lru_miss_curve(trace.layer_steps(layer), trace.n_experts), ref)
    sizes = [0, 1, trace.top_k, trace.n_experts // 2, trace.n_experts, trace.n_experts + 3]
    assert trace_min_hits(trace, sizes) == [_reference_min_hits(trace, r) for r in sizes]


def test_lru_miss_curve_takes_ragged_demands_with_repeats() -> None:
    """Demands of any length, an id repeated within a step, an empty step: as the walk counts them."""
    from asyncside.policy_replay import lru_miss_curve

    rng = np.random.default_rng(7)
    demands = [rng.integers(0, 10, size=int(rng.integers(0, 6))).tolist() for _ in range(400)]
    assert np.array_equal(lru_miss_curve(demands, 10), _reference_lru_miss_curve(demands, 10))
    assert np.array_equal(lru_miss_curve([], 4), np.zeros(5, dtype=np.int64))
    for bad in ([[0, 4]], [[-1]]):
        with pytest.raises(ValueError, match="outside"):
            lru_miss_curve(bad, 4)


def test_min_hits_in_layer_groups_and_past_the_vector_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers too many for one pass go in groups; experts too many for one layer's pass fall back
    to the walk: the same hits either way."""
    from asyncside import policy_replay

    trace = preset("middle", tokens=120, n_layers=5, n_experts=16, top_k=3, seed=9)
    want = [_reference_min_hits(trace, r) for r in (4, 8)]
    for limit in (2 * 16 * 2, 1):  # two layers a group; none fits: the walk
        monkeypatch.setattr(policy_replay, "_MIN_VECTOR_ELEMENTS", limit)
        assert policy_replay.trace_min_hits(trace, [4, 8]) == want


def test_routing_info_does_not_walk_the_trace_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`routing info` stepped Belady's MIN with Python sets and sorts per layer and step, and LRU
    with a list walk per access: about a minute on 100k tokens x 8 layers x 64 experts. It now
    runs the vectorised passes (tests above: the same figures), never the per-layer walks."""
    from asyncside import policy_replay
    from asyncside.routing_cli import trace_info

    trace = preset("low", tokens=200, n_layers=3, n_experts=16, top_k=4)
    want = {r: _reference_min_hits(trace, r) for r in (4, 8)}

    def walked(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("walked the trace per layer")

    monkeypatch.setattr(policy_replay, "belady_bypass", walked)
    monkeypatch.setattr(policy_replay, "lru_miss_curve", walked)
    info = trace_info(trace)
    accesses = 200 * 3 * 4
    assert [c["rows"] for c in info["caches"]] == [4, 8]
    assert [c["min"] for c in info["caches"]] == [round(want[r] / accesses, 4) for r in (4, 8)]
    # The runtime's LRU (a Ledger replayed), as routing info shows it since tests/test_unseen_inputs_8b.py
    lru = {r: sum(policy_replay.replay_steps(trace.layer_steps(layer), 16, r, "lru").hits for layer in range(3))
           for r in (4, 8)}
    assert [c["lru"] for c in info["caches"]] == [round(lru[r] / accesses, 4) for r in (4, 8)]


# -- zip bombs: no member of a trace file inflates past what a trace of its shape takes --

_ZEROS = bytes(1 << 20)


def _npy_header(shape: tuple[int, ...], descr: str) -> bytes:
    from numpy.lib import format as npy

    out = io.BytesIO()
    npy.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _archive(path: pathlib.Path, bomb: str, bomb_mib: int, shape: tuple[int, ...] | None = None,
             descr: str = "<i8") -> None:
    """A valid trace (10 tokens, 2 layers, top-4 of 16 experts) as an .npz, plus member ``bomb``:
    an .npy header (``shape``, default the zeros' own) over ``bomb_mib`` MiB of zeros, written a
    MiB at a time (they deflate to about a thousandth)."""
    import zipfile

    trace = preset("middle", tokens=10, n_layers=2, n_experts=16, top_k=4)
    arrays = {"ids": trace.ids, "lengths": trace.lengths, "n_experts": np.array(16)}
    itemsize = np.dtype(descr).itemsize
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, a in arrays.items():
            if name != bomb:
                buf = io.BytesIO()
                np.save(buf, a)
                z.writestr(f"{name}.npy", buf.getvalue())
        with z.open(f"{bomb}.npy", "w") as fh:
            fh.write(_npy_header(shape or ((bomb_mib << 20) // itemsize,), descr))
            for _ in range(bomb_mib):
                fh.write(_ZEROS)


def _inflated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes every zip member read has yielded, appended per read."""
    import zipfile

    reads: list[int] = []
    read = zipfile.ZipExtFile.read

    def counted(self: Any, n: int = -1) -> bytes:
        data = read(self, n)
        reads.append(len(data))
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "read", counted)
    return reads


def _declare(path: pathlib.Path, member: str, size: int) -> None:
    """Make the central directory of ``path`` declare ``size`` inflated bytes for ``member`` (a lie)."""
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x01\x02")
    while True:
        name_len = int.from_bytes(raw[at + 28:at + 30], "little")
        if raw[at + 46:at + 46 + name_len] == member.encode():
            raw[at + 24:at + 28] = size.to_bytes(4, "little")
            break
        at = raw.index(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(raw))


def test_a_zip_bomb_member_is_refused_before_it_is_inflated(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``lengths.npy`` of 200 MiB of zeros (about 200 KiB in the file) was inflated whole by
    np.load before anything looked at it; a trace of 10 tokens has at most 10 counts: the member's
    declared size is refused first, naming the file and the member, and nothing is inflated."""
    from asyncside.cli import main

    path = tmp_path / "bomb.npz"
    _archive(path, "lengths", 200)
    assert path.stat().st_size < 2 << 20
    reads = _inflated(monkeypatch)
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(path)
    assert info.value.field == "lengths" and str(path) in str(info.value)
    assert "member lengths.npy of the archive declares 209715328 bytes inflated" in str(info.value)
    assert sum(reads) < 1 << 20, sum(reads)
    assert main(["routing", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "lengths.npy" in err and "Traceback" not in err, err


def test_a_member_lying_about_its_size_inflates_no_more_than_it_declares(tmp_path: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``ids.npy``'s ZipInfo declares a MiB while its data inflate to 64 MiB and its header says so:
    refused from the header, and the stream yields no more than the member declared. (One that
    declares less than zipfile's first read ends in its bad-CRC error, a readable-file refusal.)"""
    path = tmp_path / "liar.npz"
    _archive(path, "ids", 64, shape=(1 << 20, 4, 4), descr="<i4")
    _declare(path, "ids.npy", 1 << 20)
    reads = _inflated(monkeypatch)
    with pytest.raises(TraceError, match=r"\[ids\]: member ids.npy of the archive has a header giving shape "
                                         r"\(1048576, 4, 4\) of int32: 67108864 bytes, more than the \d+ bytes of "
                                         r"data the member declares"):
        RoutingTrace.load(path)
    assert sum(reads) <= 1 << 20, sum(reads)


def test_ids_past_the_documented_maximum_are_refused_unread(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """ids bound no other array: they are held to MAX_IDS_BYTES (lowered here), by the size their
    member declares and, where that lies, by their header."""
    from asyncside import routing

    path = tmp_path / "big.npz"
    _archive(path, "ids", 8, shape=(1 << 19, 2, 2), descr="<i4")
    monkeypatch.setattr(routing, "MAX_IDS_BYTES", 1 << 20)
    reads = _inflated(monkeypatch)
    with pytest.raises(TraceError, match=r"\[ids\]: member ids.npy of the archive declares 8388736 bytes inflated, "
                                         r"more than a trace's ids takes \(at most 1048576 bytes of data here"):
        RoutingTrace.load(path)
    assert sum(reads) == 0
    _declare(path, "ids.npy", 1 << 16)
    with pytest.raises(TraceError, match=r"\[ids\]: the array's header gives a shape too large to allocate for a "
                                         r"trace's ids: member ids.npy gives \(524288, 2, 2\) of int32, 8388608 "
                                         r"bytes \(at most 1048576 here"):
        RoutingTrace.load(path)
    assert sum(reads) < 1 << 16, sum(reads)


def test_an_extra_member_is_never_inflated(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays a trace file holds beside its own are ignored: they are no longer read at all, so a
    bomb among them costs nothing and the trace loads."""
    path = tmp_path / "extra.npz"
    _archive(path, "notes", 64)
    reads = _inflated(monkeypatch)
    trace = RoutingTrace.load(path)
    assert trace.n_tokens == 10 and trace.n_layers == 2
    assert sum(reads) < 1 << 16, sum(reads)
