"""Inputs the repository never made, seventh sweep: routing traces built in Python and handed to
``set_routing`` as they are (or another model's replay), hand-written trace files of odd make
(``meta.version`` that is no number, ``n_experts`` in a 2-d array, an array header that claims
petabytes), sequence numbers and seeds that are no int, residencies and least rows typed as -0,
True, None or -3, a shape of one expert a layer, and ``--lookahead-extra`` past a layer's experts
or beside a predictor it does not widen. What runs gives the tokens it should; what is refused
says which argument, field or option, and what was expected.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import warnings
from typing import Any

import anyio
import numpy as np
import pytest
from _cli_support import run_cli

from asyncside.errors import TraceError
from asyncside.routing import RoutingTrace


def _generate(sm: Any, routing: Any, sequence: int) -> list[int]:
    from asyncside.runtime import Runtime

    async def main() -> list[int]:
        async with Runtime(sm.store, resident=0.25) as rt:
            sm.set_routing(routing, sequence=sequence)
            try:
                prompt = sm.tokenizer.encode("Mixture of experts")
                return [t async for t in sm.generate(prompt, max_tokens=4, source=rt, predictor="none")]
            finally:
                sm.set_routing(None)

    return anyio.run(main)


def test_a_trace_in_memory_replays_as_its_file_does(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """``sm.set_routing(trace)`` with the ``asyncside.RoutingTrace`` just generated or loaded ended in
    ``TypeError: expected str, bytes or os.PathLike object, not RoutingTrace`` from inside the file
    reader: only a path or a RoutingReplay was taken. A trace in memory is fitted to the model as
    its file is; anything else is refused naming what is taken, and a sequence that is no int
    (1.0 and True ended in numpy's "slice indices must be integers", "only 0-dimensional arrays")
    names the argument."""
    from asyncside.models import load_streaming_model
    from asyncside.models.forcing import RoutingReplayError
    from asyncside.routing import synthetic

    sm = load_streaming_model(quick_store)
    # another shape than the model (3 layers x 64 experts top-8 onto 2 x 32 top-4), two sequences
    made = synthetic(tokens=24, n_layers=3, n_experts=64, top_k=8, skew=0.5, overlap=0.3, layer_corr=0.1, seed=3)
    trace = RoutingTrace(made.ids, np.array([10, 14]), made.n_experts, dict(made.meta))
    path = tmp_path / "made.npz"
    trace.save(path)
    assert _generate(sm, trace, 1) == _generate(sm, path, 1)
    assert sm.set_routing(trace).fitted.n_experts == 32 and sm.routing is not None
    sm.set_routing(None)

    with pytest.raises(TypeError, match=r"set_routing: expected a RoutingReplay, an asyncside.RoutingTrace, a trace "
                                        r"file's path or None, got int"):
        sm.set_routing(3)  # type: ignore[arg-type]
    for sequence in (1.0, True, "1"):
        with pytest.raises(RoutingReplayError, match=r"sequence: expected an int, which of the trace's 2 sequences "
                                                     r"to replay, got " + repr(sequence).replace(".", r"\.")):
            sm.set_routing(path, sequence=sequence)  # type: ignore[arg-type]
    assert sm.routing is None


def test_a_residency_of_minus_zero_is_zero() -> None:
    """``demo --resident -0`` titled its run "-0% asked" and its plan "resident -0 asked", and
    ``bench generate --residency -0`` keyed its pool plan ``"-0.0"``: the sign of a zero kept."""
    from asyncside.argtypes import parse_resident, resident_fraction

    for value in (resident_fraction()("-0"), resident_fraction(allow_auto=False)("-0%"),
                  parse_resident("-0.0", allow_auto=False)):
        assert value == 0.0 and math.copysign(1.0, float(value)) == 1.0, value


@pytest.mark.parametrize("resident", [True, None, float("nan"), 1.5, np.bool_(True)])
def test_a_runtime_refuses_a_residency_that_is_no_fraction_when_made(resident: object,
                                                                    quick_store: pathlib.Path) -> None:
    """``Runtime(store, resident=True)`` ran with every expert in the pools (True taken as 1.0);
    ``resident=None`` ended in ``float() argument must be ... not 'NoneType'`` when entered, and a
    string or 1.5 was refused only then. Each is refused when the Runtime is made, as
    ``asyncside.load`` refuses them."""
    from asyncside.runtime import PlanArgumentError, Runtime
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)
    with pytest.raises(PlanArgumentError, match=r"resident: expected a fraction in \[0, 1\] or 'auto', got "):
        Runtime(store, resident=resident)  # type: ignore[arg-type]


def test_a_runtime_of_residency_minus_zero_plans_zero(quick_store: pathlib.Path) -> None:
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)

    async def main() -> tuple[str, Any]:
        async with Runtime(store, resident=-0.0) as rt:
            assert rt.plan is not None
            return rt.plan.describe(), rt.memory["resident"]

    described, resident = anyio.run(main)
    assert "resident 0 asked" in described and "-0" not in described, described
    assert math.copysign(1.0, resident) == 1.0


@pytest.mark.parametrize(("version", "said"), [
    ("1", 'got "1", not the number 1'),
    (None, "got null, not the number 1"),
    (True, "got true, not the number 1"),
    (2, "got 2: a newer asyncside wrote it"),
])
def test_a_version_that_is_no_number_is_not_called_newer(version: object, said: str, tmp_path: pathlib.Path) -> None:
    """A hand-written ``meta`` of ``{"version": "1"}`` or ``null`` was refused as "a newer asyncside
    wrote it", and ``true`` was taken as version 1 (True == 1 in Python)."""
    path = tmp_path / "hand.npz"
    np.savez(path, ids=np.zeros((2, 1, 1), np.int32), n_experts=4, meta=np.array(json.dumps({"version": version})))
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(path)
    assert info.value.field == "meta.version" and said in str(info.value), str(info.value)


@pytest.mark.parametrize(("argv", "said"), [
    (["--predictor", "temporal"], "this run's predictor is temporal (--predictor temporal)"),
    (["--predictor", "none"], "this run's predictor is none (--predictor none)"),
    (["--routing", "TRACE"], "this run's predictor is the --routing trace's own predictions, or temporal"),
])
def test_lookahead_extra_beside_another_predictor_is_refused(argv: list[str], said: str, tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --predictor temporal --lookahead-extra 2`` ran the temporal predictor, ignored the 2 and
    showed the predictor as "temporal+2"; under ``--routing`` the default predictor (the trace's,
    else temporal) ignored it likewise. Refused before anything loads (the store here is none)."""
    trace = tmp_path / "t.npz"
    np.savez(trace, ids=np.zeros((2, 1, 1), np.int32), n_experts=4)
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    rc, err = run_cli(capsys, "demo", "--model", str(tmp_path / "no-store"), "--lookahead-extra", "2", *argv)
    assert rc == 2 and f"--lookahead-extra 2 widens the lookahead predictor's sets, and {said}" in err, err
    assert "give --predictor lookahead, or leave --lookahead-extra out" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_shape_of_one_expert_a_layer_builds_a_finite_router(tmp_path: pathlib.Path) -> None:
    """``bench generate --shape CONFIG`` of one expert a layer (top-1) built a router of NaN scales:
    the experts' seeded popularity was standardised by its spread, 0 for one expert ("invalid value
    encountered in divide"), and every token came out as id 0, in asyncside and mlx-lm alike (so
    they still compared identical)."""
    import mlx.core as mx

    from asyncside.bench import shapes

    config = tmp_path / "one-expert" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 1, "num_experts_per_tok": 1,
        "vocab_size": 512}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        built = shapes.ensure_shape(config, layers=1, vocab=512, cache_dir=tmp_path / "cache", progress=False)
    files = sorted(pathlib.Path(built["store"]).glob("*.safetensors"))
    assert files
    for file in files:
        for name, value in mx.load(str(file)).items():
            if mx.issubdtype(value.dtype, mx.floating):
                assert bool(mx.isfinite(value.astype(mx.float32)).all()), (file.name, name)


@pytest.mark.parametrize("least", [-3, 2.0, True])
def test_a_runtime_refuses_a_least_rows_that_is_no_count_when_made(least: object, quick_store: pathlib.Path) -> None:
    """``Runtime(store, min_side_rows=-3)`` (and ``asyncside.load(..., min_side_rows=-3)``) ran as if
    it were left out and 2.0 as 2, where ``side_rows=-1`` is refused: the least rows a layer gets
    is a count."""
    from asyncside.runtime import PlanArgumentError, Runtime
    from asyncside.store import ExpertStore

    with pytest.raises(PlanArgumentError, match=r"min_side_rows: expected a number of rows >= 0 \(None: the "
                                                r"model's top-k\), got " + re.escape(repr(least))):
        Runtime(ExpertStore.open(quick_store), min_side_rows=least)  # type: ignore[arg-type]


def test_lookahead_extra_past_the_layers_experts_names_every_expert(quick_store: pathlib.Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --lookahead-extra 40 --mode per-layer`` on layers of 32 experts top-4 (or 5 on a
    2-expert model) ended in mlx's "[argpartition] Received invalid kth" traceback, in every
    architecture: the router was asked for more experts than the layer has. The lookahead names
    at most every expert."""
    from asyncside import cli

    rc = cli.main(["demo", "--model", str(quick_store), "--tokens", "2", "--mode", "per-layer",
                   "--lookahead-extra", "40", "--json", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert result["tokens_identical"] is True and result["experts_per_layer"] == 32, result
    pq = result["prediction"]
    assert pq["token_layers"] > 0 and pq["predicted"] == 32 * pq["token_layers"], pq


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_a_synthetic_trace_names_a_bad_seed(seed: object) -> None:
    """``synthetic(..., seed=-1)`` (and ``preset``) ended in numpy's "expected non-negative integer",
    1.5 in "SeedSequence expects int or sequence of ints", neither naming the argument; widen's
    seed was already checked."""
    from asyncside.routing import preset

    with pytest.raises(ValueError, match=r"synthetic: seed must be an int >= 0, got " + re.escape(repr(seed))):
        preset("low", n_layers=1, n_experts=4, top_k=1, tokens=4, seed=seed)  # type: ignore[arg-type]


def test_a_synthetic_trace_of_a_numpy_seed_is_that_seed() -> None:
    """A seed that is a numpy integer (one drawn from another generator) was written into ``meta``
    as it was, and the trace refused itself: "[meta]: not JSON-able: Object of type int64"."""
    from asyncside.routing import preset

    trace = preset("middle", n_layers=2, n_experts=8, top_k=2, tokens=16, seed=np.int64(3))  # type: ignore[arg-type]
    same = preset("middle", n_layers=2, n_experts=8, top_k=2, tokens=16, seed=3)
    assert np.array_equal(trace.ids, same.ids) and trace.meta == same.meta


def test_a_replay_fitted_to_another_model_is_refused(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """``sm.set_routing(replay)`` with the RoutingReplay another model's ``set_routing`` returned was
    taken as it was: on a model of the same layers it routed to the other model's ids and top-k
    without a word (top-1 where the model routes 4), elsewhere a step ended in a ZeroDivisionError.
    It is refused naming both shapes and the way out, by ``set_routing`` and by the serving engine
    (``Batcher(routing=replay)``, which replayed it per request likewise); the same model's replay
    is taken."""
    from _fault_helpers import model_store

    from asyncside.models import load_streaming_model
    from asyncside.models.forcing import RoutingReplayError
    from asyncside.routing import synthetic

    quick = load_streaming_model(quick_store)  # 2 MoE layers x 32 experts, top-4
    other = load_streaming_model(model_store(tmp_path, "mixtral", None)[0])  # 2 MoE layers x 8 experts, top-2
    trace = synthetic(tokens=12, n_layers=2, n_experts=64, top_k=8, skew=0.5, overlap=0.3, layer_corr=0.1)
    replay = quick.set_routing(trace)
    quick.set_routing(None)
    assert replay is not None and load_streaming_model(quick_store).set_routing(replay) is replay
    with pytest.raises(RoutingReplayError, match=r"<in memory>: this replay was fitted to MoE layers \[0, 1\] x 32 "
                                                 r"experts, top-4, and this model has MoE layers \[0, 1\] x 8 experts, "
                                                 r"top-2: pass the trace itself \(its file or RoutingTrace\)"):
        other.set_routing(replay)
    assert other.routing is None
    assert other.set_routing(trace) is not None  # the trace itself is fitted to it
    other.set_routing(None)

    from asyncside.runtime import Runtime
    from asyncside.serving import Batcher

    with pytest.raises(RoutingReplayError, match=r"this replay was fitted to MoE layers \[0, 1\] x 32 experts"):
        Batcher(other, Runtime(other.store, resident=0.25), routing=replay)  # the server's engine, alike


def test_a_profile_for_one_layer_is_said_in_the_singular(quick_store: pathlib.Path) -> None:
    """A two-layer profile for a runtime of one layer (``Runtime(layers=[1])``, a one-layer model)
    was refused as "expected 1 MoE layers"."""
    from asyncside.routing import preset
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    profile = preset("low", n_layers=2, n_experts=32, top_k=4, tokens=8)

    async def main() -> None:
        async with Runtime(ExpertStore.open(quick_store), layers=[1], rows_profile=profile):
            pass

    with pytest.raises(TraceError, match=r"rows_profile: expected 1 MoE layer \(the runtime's\), got 2"):
        anyio.run(main)


@pytest.mark.parametrize("s", [1.0, True, "1", None])
def test_a_trace_sequence_that_is_no_int_is_named(s: object) -> None:
    """``trace.sequence(1.0)`` ended in numpy's "slice indices must be integers", ``sequence(True)``
    in "only 0-dimensional arrays can be converted", ``sequence("1")`` in a comparison's TypeError."""
    trace = RoutingTrace(np.zeros((3, 1, 1), np.int32), np.array([1, 2]), 4, {})
    for view in (trace.sequence, trace.sequence_predicted):
        with pytest.raises(TypeError, match=r"sequence: expected an int, which of the trace's 2 sequences, got "
                                            + re.escape(repr(s))):
            view(s)  # type: ignore[arg-type]
    assert trace.sequence(np.int64(1)).shape == (2, 1, 1)


def test_lengths_left_out_in_python_say_how_to_write_one_sequence() -> None:
    """``RoutingTrace(ids, None, n_experts, {})`` (a file may leave ``lengths`` out) was refused as
    "got shape () dtype object"."""
    with pytest.raises(TraceError, match=r"\[lengths\]: expected a non-empty 1-d integer array, got None; one "
                                         r"sequence of every token is np.array\(\[3\]\)"):
        RoutingTrace(np.zeros((3, 1, 1), np.int32), None, 4, {})  # type: ignore[arg-type]


def test_an_array_whose_header_claims_more_than_memory_is_named(tmp_path: pathlib.Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A trace archive whose ``ids.npy`` header gives a shape of petabytes over a few bytes of data
    ended in numpy's ``_ArrayMemoryError: Unable to allocate ... TiB`` traceback: numpy allocates
    what the header says before it reads the data (a header a little past its data is numpy's
    "EOF: reading array data", named as an unreadable file already)."""
    import io
    import zipfile

    from numpy.lib import format as npy

    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": "<i4", "fortran_order": False, "shape": (10**15, 1, 1)})
    n_experts = io.BytesIO()
    np.save(n_experts, np.array(8))
    path = tmp_path / "liar.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("ids.npy", header.getvalue() + bytes(64))
        z.writestr("n_experts.npy", n_experts.getvalue())
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(path)
    assert info.value.field == "ids" and "header gives a shape too large to allocate" in str(info.value)
    rc, err = run_cli(capsys, "routing", "info", str(path))
    assert rc == 2 and f"{path} [ids]: the array's header gives a shape too large" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_model_of_one_layer_for_two_ranks_is_said_in_the_singular() -> None:
    """``demo --ranks 2`` on a one-layer model: "the model has 1 decoder layers"."""
    from asyncside.distributed.plan import PlanError, make_plan

    with pytest.raises(PlanError, match=r"the model has 1 decoder layer, fewer than the 2 ranks: every stage"):
        make_plan(1, [0], 2)


def test_n_experts_in_any_one_element_array_is_read(tmp_path: pathlib.Path) -> None:
    """The format takes ``n_experts`` as "an integer scalar or 1-element array", and ``[[64]]`` (a
    1-element array written from a 2-d table) was refused as "expected an integer scalar"."""
    path = tmp_path / "t.npz"
    np.savez(path, ids=np.zeros((2, 1, 1), np.int32), n_experts=np.array([[64]]))
    assert RoutingTrace.load(path).n_experts == 64
    np.savez(path, ids=np.zeros((2, 1, 1), np.int32), n_experts=np.array([64, 64]))
    with pytest.raises(TraceError, match=r"\[n_experts\]: expected a 1-element array or an integer scalar, got "
                                         r"shape \(2,\)"):
        RoutingTrace.load(path)


@pytest.mark.parametrize("meta", [{"version": "2024-05"}, {"version": 2}, {"format": "mine"}])
def test_a_trace_never_saves_a_file_version_it_would_not_load(meta: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """A trace whose own metadata had a "version" key ({"version": "2024-05"}, the model's) was saved
    over the file format's version and the file was then refused by load ("expected version 1")."""
    ids = np.zeros((2, 1, 1), np.int32)
    key = next(iter(meta))
    with pytest.raises(TraceError, match=rf"\[meta\.{key}\]: '{key}' is the trace file's own key .*: name yours "
                                         r"otherwise") as info:
        RoutingTrace(ids, np.array([2]), 4, meta)
    assert info.value.field == f"meta.{key}"
    RoutingTrace(ids, np.array([2]), 4, {"version": 1, "model": "m"}).save(tmp_path / "ok.npz")
    assert RoutingTrace.load(tmp_path / "ok.npz").meta == {"model": "m"}


def test_a_trace_from_a_pipe_is_read_once_whole(tmp_path: pathlib.Path) -> None:
    """``asyncside routing info <(gunzip -c trace.npz.gz)``, ``demo --routing <(...)``: the file's
    first bytes were read to tell what it is, then numpy opened the pipe again to read the archive
    and said "not a readable .npz file: No data left in file". A pipe is read once, whole; one
    read already is named as such, not as an empty file."""
    import os

    path = tmp_path / "t.npz"
    RoutingTrace(np.arange(8, dtype=np.int32).reshape(2, 1, 4), np.array([2]), 8, {"model": "m"}).save(path)
    r, w = os.pipe()
    try:
        os.write(w, path.read_bytes())  # a few hundred bytes: within the pipe's buffer
        os.close(w)
        w = -1
        where = f"/dev/fd/{r}"
        trace = RoutingTrace.load(where)
        assert trace.n_experts == 8 and trace.meta == {"model": "m"} and trace.ids.tolist() == [[[0, 1, 2, 3]],
                                                                                                 [[4, 5, 6, 7]]]
        with pytest.raises(TraceError, match=r"this is nothing: a pipe such as <\(\.\.\.\) reads once, and this "
                                             r"one was read \(give a file\)"):
            RoutingTrace.load(where)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@pytest.mark.parametrize("command", [["demo", "--quiet"],
                                     ["bench", "generate", "--repeats", "1", "--cold-repeats", "0", "--residency",
                                      "0.5", "--plot", "none"]])
def test_a_routing_pipe_is_read_once_by_the_commands(command: list[str], quick_store: pathlib.Path,
                                                     tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --routing <(...) --routing-sequence 1`` and ``bench generate --routing <(...)`` read the
    file before anything loads, to refuse a bad one, then again to replay it: the pipe was empty
    by then. Each reads it once and replays what it read, named by its path."""
    import os

    from asyncside import cli
    from asyncside.routing import synthetic

    made = synthetic(tokens=12, n_layers=2, n_experts=32, top_k=4, skew=0.5, overlap=0.3, layer_corr=0.1, seed=5)
    path = tmp_path / "t.npz"
    RoutingTrace(made.ids, np.array([5, 7]), 32, {}).save(path)
    r, w = os.pipe()
    try:
        os.write(w, path.read_bytes())
        os.close(w)
        w = -1
        rc = cli.main([*command, "--model", str(quick_store), "--tokens", "2", "--json", "--routing", f"/dev/fd/{r}",
                       "--routing-sequence", "1"])
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    routing = json.loads(captured.out)["routing"]
    assert routing["sequence"] == 1 and routing["sequence_tokens"] == 7, routing
    assert routing["note"].startswith(f"/dev/fd/{r}: sequence 1 of 2 replayed"), routing


def test_serve_takes_a_routing_pipe_for_a_file(tmp_path: pathlib.Path) -> None:
    """``serve --routing <(...)`` was refused as "/dev/fd/63: no such routing trace file": the option
    took regular files only. A pipe passes the option (the trace says what it holds when read);
    a missing path and a directory are still refused, naming the path."""
    import argparse
    import os

    from asyncside.serving.cli import _existing_file

    r, w = os.pipe()
    try:
        assert _existing_file(f"/dev/fd/{r}") == f"/dev/fd/{r}"
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(argparse.ArgumentTypeError, match=r"nope\.npz: no such routing trace file"):
        _existing_file(str(tmp_path / "nope.npz"))
    with pytest.raises(argparse.ArgumentTypeError, match=r": is a directory; expected a routing trace file"):
        _existing_file(str(tmp_path))
