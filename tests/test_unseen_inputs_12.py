"""Unseen inputs, round 12: the Python API as a user writes it from the README (a policy instance
given to ``Runtime``), and stores, models and caches as users bring them: a manifest edited by hand
in the fields the runtime's plan reads (the converter's ranking, a routing profile, a resident
list), paths under a file, in another encoding or from an unset shell variable, and ``--overwrite``
aimed at a directory that is no store. What is refused is one line naming the file, field, variable
or option, before anything is read or deleted; what runs pins each expert once."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from typing import Any

import anyio
import pytest

from asyncside import ExpertStore, Runtime, StoreError
from asyncside.runtime import plan_layer
from tests._cli_support import run_cli


def _edited(quick_store: pathlib.Path, tmp_path: pathlib.Path, edit: Any) -> pathlib.Path:
    """A copy of the quick store whose manifest ``edit`` changed (as a hand edit would)."""
    store = tmp_path / "my store ü"
    shutil.copytree(quick_store, store)
    manifest = store / "manifest.json"
    doc = json.loads(manifest.read_text())
    edit(doc)
    manifest.write_text(json.dumps(doc))
    return store


def _model(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["metadata"]["asyncside_model"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("edit", "field", "said"), [
    (lambda d: _model(d)["expert_rank"].__setitem__("0", ["a", "b"]), "metadata.asyncside_model.expert_rank.0",
     "expected a list of expert ids, got ['a', 'b']"),
    (lambda d: _model(d)["expert_rank"].__setitem__("1", 5), "metadata.asyncside_model.expert_rank.1",
     "expected a list of expert ids, got 5"),
    (lambda d: _model(d)["expert_rank"].__setitem__("0", [1.5, 2]), "metadata.asyncside_model.expert_rank.0",
     "expected expert ids (integers), got 1.5"),
    (lambda d: _model(d).__setitem__("expert_rank", [[1, 2], [3, 4]]), "metadata.asyncside_model.expert_rank",
     "expected an object of per-layer lists keyed by layer index, got list"),
    (lambda d: (_model(d).pop("expert_rank"), d["metadata"].__setitem__("profile", {"0": "hot"})),
     "metadata.profile.0", "expected a list of routed counts, got 'hot'"),
])
def test_a_hand_edited_ranking_of_another_form_names_its_field(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                               edit: Any, field: str, said: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The plan read these lists as it found them: a ranking of strings ended ``demo`` in int()'s
    ValueError traceback, one that is no list in "'int' object is not iterable", a list of lists in
    "'list' object has no attribute 'get'", and 1.5 was taken as expert 1."""
    store = _edited(quick_store, tmp_path, edit)

    async def enter() -> None:
        async with Runtime(ExpertStore.open(store), resident=0.5, side_rows=4):
            pass

    with pytest.raises(StoreError) as info:
        anyio.run(enter)
    assert info.value.field == field and info.value.path == str(store / "manifest.json")
    assert said in str(info.value)
    rc, err = run_cli(capsys, "demo", "--model", str(store), "--tokens", "2", "--reference", "none")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"manifest.json [{field}]: {said}" in err


def test_a_ranking_that_lists_an_expert_twice_pins_it_once(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A ranking naming expert 3 at every place (and ids past the layer's experts) was refused at
    entry as "resident expert 3 is listed twice", a list nobody wrote: it is a ranking, read in
    order, each expert once, the rest in id order after it."""
    store = _edited(quick_store, tmp_path, lambda d: _model(d)["expert_rank"].__setitem__("0", [3, 3, 999, 3, 1]))

    pinned, side = plan_layer(ExpertStore.open(store), 0, resident=0.5, side_rows=4)
    assert side == 4 and pinned[:3] == [3, 1, 0] and sorted(pinned) == sorted(set(pinned)) and len(pinned) == 12

    async def go() -> None:
        async with Runtime(ExpertStore.open(store), resident=0.5, side_rows=4) as rt:
            assert all(report.ok for report in rt.audit().values())

    anyio.run(go)


@pytest.mark.parametrize("under", ["sub", "a/b"])
def test_a_store_path_under_a_file_is_one_line_naming_the_file(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                               under: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert MODEL notes.txt/store`` (a file where a directory of the path should be)
    ended in pathlib's FileExistsError (or NotADirectoryError) traceback with exit status 1."""
    from asyncside import convert_model

    model = quick_store.parent / "model"
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a directory")
    dest = blocker / under
    with pytest.raises(StoreError) as info:
        convert_model(model, dest, progress=False)
    assert info.value.path == str(blocker) and "exists and is not a directory" in str(info.value)
    rc, err = run_cli(capsys, "convert", str(model), str(dest), "--quiet")  # refused when parsed: argparse's usage
    assert rc == 2 and "Traceback" not in err, err
    assert f"argument STORE_DIR: {dest}: expected a directory; {blocker} is a file" in err.strip().splitlines()[-1]
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("command", [["demo", "--tokens", "2"], ["serve"], ["bench", "generate", "--quick"]])
@pytest.mark.parametrize("below", ["", "x"])
def test_a_cache_that_is_a_file_is_refused_before_anything_loads(tmp_path: pathlib.Path, command: list[str],
                                                                  below: str, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``ASYNCSIDE_CACHE=notes.txt`` (or ``--cache-dir notes.txt``, or a path under it) ended demo,
    serve and bench generate in pathlib's FileExistsError / NotADirectoryError traceback once they
    built or converted there; docs/api.md says the variable takes a directory and a bad value is a
    one-line usage error before anything loads."""
    from asyncside.errors import EnvVarError
    from asyncside.native_env import check_env

    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a directory")
    cache = str(blocker / below) if below else str(blocker)
    rc, err = run_cli(capsys, *command, "--cache-dir", cache)
    assert rc == 2 and f"argument --cache-dir: {cache}: expected a directory; {blocker} is a file" in err, err
    assert "Traceback" not in err
    monkeypatch.setenv("ASYNCSIDE_CACHE", cache)
    rc, err = run_cli(capsys, *command)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"environment: ASYNCSIDE_CACHE: expected a directory ({blocker} is a file" in err and repr(cache) in err
    with pytest.raises(EnvVarError, match="ASYNCSIDE_CACHE"):
        check_env()
    assert blocker.read_text() == "not a directory"


def test_a_cache_that_does_not_exist_yet_is_taken(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncside.models.embedded import cache_root
    from asyncside.native_env import check_env

    monkeypatch.setenv("ASYNCSIDE_CACHE", str(tmp_path / "new dir ü" / "cache"))
    check_env()
    assert cache_root() == tmp_path / "new dir ü" / "cache"
    monkeypatch.setenv("ASYNCSIDE_CACHE", "")
    check_env()
    assert cache_root() != tmp_path


def test_a_runtime_takes_a_policy_instance_for_every_layer(quick_store: pathlib.Path) -> None:
    """``Runtime(store, policy=LRFU(half_life=2))`` (a public policy class, with the parameter a
    name cannot give) was refused at entry: "policy 'lrfu' instance is already attached to another
    ledger", a ledger the user never made. Each layer now gets its own copy, with its parameters,
    and a run under ``LRU()`` counts what one under ``"lru"`` does; an unknown name is refused when
    the runtime is made, not once entered."""
    from asyncside import LRFU, LRU, LedgerError, load_streaming_model

    sm = load_streaming_model(quick_store)
    prompt = sm.tokenizer.encode("Hello world, a longer prompt")
    given = LRFU(half_life=2)

    async def run(policy: Any) -> tuple[list[int], tuple[int, int], list[Any]]:
        async with Runtime(ExpertStore.open(quick_store), resident=0.2, policy=policy) as rt:
            tokens = [t async for t in sm.generate(prompt, max_tokens=12, source=rt)]
            stats = rt.stats()
            assert all(report.ok for report in rt.audit().values())
            policies = [st.ledger.policy for st in rt._s.layers.values()]
            return tokens, (stats["hits"], stats["misses"]), policies

    by_name, by_instance = anyio.run(run, "lru"), anyio.run(run, LRU())
    assert by_instance[:2] == by_name[:2]
    tokens, _, policies = anyio.run(run, given)
    assert tokens == by_name[0]
    assert len({id(p) for p in policies}) == len(policies) and all(p.half_life == 2.0 for p in policies)
    assert given._owner is None  # the instance given stays the caller's, attached to nothing
    with pytest.raises(LedgerError, match="unknown policy 'nope'"):
        Runtime(ExpertStore.open(quick_store), policy="nope")


def test_overwrite_replaces_a_store_and_nothing_else(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert MODEL "$OUT" --overwrite`` with OUT unset converted into the current
    directory and replaced it, deleting every file in it; ``convert MODEL ~/work --overwrite``
    deleted ~/work, and a directory holding the model deleted the model. STORE_DIR is no empty
    name now, and overwrite replaces an expert store or an empty directory only."""
    from asyncside import convert_model

    model = quick_store.parent / "model"
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("precious")
    monkeypatch.chdir(work)
    rc, err = run_cli(capsys, "convert", str(model), "", "--overwrite", "--quiet")
    assert rc == 2 and "argument STORE_DIR: expected a directory, got ''" in err, err
    for dest in (work, pathlib.Path("."), model.parent):
        with pytest.raises(StoreError) as info:
            convert_model(model, dest, overwrite=True, progress=False)
        assert "overwrite replaces an expert store" in str(info.value)
        rc, err = run_cli(capsys, "convert", str(model), str(dest), "--overwrite", "--quiet")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "overwrite replaces an expert store" in err, err
    assert (work / "notes.txt").read_text() == "precious" and (model / "config.json").is_file()
    store, empty = tmp_path / "store", tmp_path / "empty"
    empty.mkdir()
    for dest in (store, store, empty):  # made, then a store replaced; an empty directory taken
        assert convert_model(model, dest, overwrite=True, progress=False).path == dest


def test_a_path_in_another_encoding_is_one_line(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A store or model under a name made in Latin-1 (``café`` as the byte 0xe9, kept by Linux as
    it is): ``demo --model`` said "the model cannot be loaded from this store: std::bad_cast", a
    Runtime's readers "add_layout(): incompatible function arguments", ``convert`` of such a model
    ended in MLX's RuntimeError traceback and ``demo --model`` of it in a UnicodeEncodeError; a store
    written there was refused only once converted. Each is now refused first, naming the path."""
    import os

    from asyncside import convert_model

    latin1 = tmp_path / os.fsdecode(b"caf\xe9")
    shutil.copytree(quick_store, latin1 / "store")
    shutil.copytree(quick_store.parent / "model", latin1 / "model")
    said = "the path is not valid UTF-8 (byte 0xe9, a name in another encoding)"
    for opened in (lambda: ExpertStore.open(latin1 / "store"),
                   lambda: convert_model(latin1 / "model", tmp_path / "out", progress=False),
                   lambda: convert_model(quick_store.parent / "model", latin1 / "out", progress=False)):
        with pytest.raises(StoreError, match=re.escape(said)):
            opened()
    assert not (latin1 / "out").exists() and not list(latin1.glob(".out.convert-*"))
    for command in (["demo", "--model", str(latin1 / "store")], ["demo", "--model", str(latin1 / "model")],
                    ["convert", str(latin1 / "model"), str(tmp_path / "out")]):
        rc, err = run_cli(capsys, *command, *(["--tokens", "2"] if command[0] == "demo" else []))
        assert rc == 2 and len(err.strip().splitlines()) == 1 and said in err, (command, err)


def test_a_cache_in_another_encoding_is_refused_before_anything_loads(tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``ASYNCSIDE_CACHE`` or ``--cache-dir`` of a Latin-1 name built the embedded model there and
    ended in MLX's "std::bad_cast" traceback from save_safetensors."""
    import os

    cache = str(tmp_path / os.fsdecode(b"caf\xe9"))
    said = "caf\\xe9 is not valid UTF-8 (a name in another encoding): MLX writes UTF-8 paths only"
    rc, err = run_cli(capsys, "demo", "--tokens", "2", "--cache-dir", cache)
    assert rc == 2 and f"argument --cache-dir: {tmp_path}/caf\\xe9: expected a directory; " in err and said in err
    monkeypatch.setenv("ASYNCSIDE_CACHE", cache)
    rc, err = run_cli(capsys, "demo", "--tokens", "2")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "environment: ASYNCSIDE_CACHE: expected a directory" in err
    assert said in err and not (tmp_path / os.fsdecode(b"caf\xe9")).exists()


def test_a_runtime_takes_a_host_tier_size_as_the_docs_write_it(quick_store: pathlib.Path) -> None:
    """docs/api.md, "Sizes": ``Runtime(..., host_tier=)`` takes a size as ``--host-tier`` does, and
    memory.parse_host_tier says it parses "as Runtime(host_tier=...) takes it"; yet ``host_tier="1G"``
    was refused as "expected 'auto' or a number of bytes"."""

    async def go(tier: Any) -> Any:
        async with Runtime(ExpertStore.open(quick_store), resident=0.25, host_tier=tier) as rt:
            return rt._host_tier

    assert anyio.run(go, "1G") == 1 << 30 and anyio.run(go, " 512MiB ") == 512 << 20
    assert anyio.run(go, "0") == 0 and anyio.run(go, "AUTO") == "auto"


def test_pinned_experts_of_a_layer_the_store_lacks_are_refused(quick_store: pathlib.Path) -> None:
    """``Runtime(store, pinned={7: [1]})`` on a store of layers 0 and 1 (a typo, or another model's
    map) ran with nothing pinned and said nothing; a map for the store's layers still runs a
    pipeline stage's subset (``layers=[1]``)."""
    from asyncside.runtime._plan import PlanArgumentError

    with pytest.raises(PlanArgumentError, match=re.escape("pinned: the store has no layer 7 (its layers: [0, 1])")):
        Runtime(ExpertStore.open(quick_store), pinned={0: [1], 7: [1]})

    async def go() -> list[int]:
        async with Runtime(ExpertStore.open(quick_store), pinned={0: [1], 1: [2]}, layers=[1]) as rt:
            return list(rt.audit())

    assert anyio.run(go) == [1]


@pytest.mark.parametrize(("given", "error", "said"), [
    ({"polcy": "lru"}, TypeError, "load() got an unexpected keyword argument 'polcy'"),
    ({"policy": "nope"}, ValueError, "unknown policy 'nope'"),
    ({"reader": "mmap"}, ValueError, "reader: expected one of ['auto', 'io_uring', 'threads', 'aiofiles'], got 'mmap'"),
])
def test_load_refuses_a_runtime_argument_before_converting(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                           given: dict[str, Any], error: type[Exception],
                                                           said: str) -> None:
    """``load(MODEL_DIR, polcy="lru")`` (a misspelt Runtime argument), an unknown policy or reader:
    the model was converted into the cache (minutes for a large one) and loaded, then the Runtime
    refused the argument (as "Runtime.__init__() got an unexpected keyword argument", a name the
    caller never wrote). They are refused first, and nothing is converted."""
    from asyncside import load

    with pytest.raises(error) as info:
        load(quick_store.parent / "model", cache_dir=tmp_path / "cache", progress=False, **given)
    assert said in str(info.value)
    assert not (tmp_path / "cache" / "stores").exists() or not any((tmp_path / "cache" / "stores").iterdir())
