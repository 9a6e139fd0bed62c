"""The front door with model directories as users have them, round 20: ``asyncside.load``,
``asyncside convert``, ``demo --model`` and ``serve --model`` given one model under several names
(relative, absolute, through a link), model directories without a working tokenizer, models made
by mlx-lm's own ``convert`` with a mixed recipe, configs routing to more experts than there are,
stores on a read-only file system and conversions killed part way. A model converts once whatever
it is called, and streams mlx-lm's tokens; what is refused is one line naming the file and field at
fault, before anything is converted or written."""

from __future__ import annotations

import pathlib

import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside.facade import load
from asyncside.hub import stores_root
from asyncside.models.tokenizer import save_byte_level_tokenizer

from _models_support import tiny_model

PROMPT = "hello experts "


def _save(d: pathlib.Path, model: nn.Module, config: dict[str, object], *, tokenizer: bool = True) -> pathlib.Path:
    d.mkdir(parents=True)
    save_model(d, model)
    save_config(dict(config), d / "config.json")
    if tokenizer:
        save_byte_level_tokenizer(d)
    return d


def _stores(cache: pathlib.Path) -> list[str]:
    root = stores_root(cache)
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def test_one_model_under_several_names_converts_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load("models/m")`` from the project's directory, then ``load("/abs/.../models/m")`` in a
    notebook (or through a link to it): each name converted the same directory once more, into a
    store of its own as large as the model, without a word. The second name now reuses the first
    name's store, and its tokens are mlx-lm's."""
    d = _save(tmp_path / "models" / "m", *tiny_model("mixtral"))
    (tmp_path / "link").symlink_to(d)
    cache = tmp_path / "cache"
    monkeypatch.chdir(tmp_path)
    ref_model, ref_tok = mlx_lm.load(str(d))
    want = mlx_lm.generate(ref_model, ref_tok, PROMPT, max_tokens=6)
    for name in ("models/m", str(d), "link", "./models/m/"):
        model, tok = load(name, resident=0.25, cache_dir=cache, progress=False)
        with model:
            assert mlx_lm.generate(model, tok, PROMPT, max_tokens=6) == want, name
        assert len(_stores(cache)) == 1, (name, _stores(cache))


@pytest.mark.parametrize("damage", ["none", "broken-json"])
def test_a_model_without_a_tokenizer_is_refused_before_converting(tmp_path: pathlib.Path, damage: str) -> None:
    """``load(DIR)`` of a model directory without tokenizer files (weights and config copied alone)
    or with a tokenizer.json cut short: the model was converted first (a copy as large as the
    model), then the refusal named that store in asyncside's cache, not the user's directory. It
    is refused first, naming the directory, and nothing is converted."""
    from asyncside.errors import StoreError

    d = _save(tmp_path / "m", *tiny_model("qwen3_moe"), tokenizer=damage != "none")
    if damage == "broken-json":
        (d / "tokenizer.json").write_text("{")
    said = "holds no tokenizer files" if damage == "none" else "its tokenizer files cannot be loaded"
    cache = tmp_path / "cache"
    with pytest.raises(StoreError, match=rf"^{d}: {said}") as info:
        load(d, cache_dir=cache, progress=False)
    assert "\n" not in str(info.value)
    assert _stores(cache) == []


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_demo_and_serve_of_a_model_without_a_tokenizer_refuse_before_converting(
        tmp_path: pathlib.Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside demo --model DIR`` / ``asyncside serve --model DIR`` of a model directory
    without tokenizer files converted it, then refused naming the store in the cache. One line
    naming DIR, status 2, and nothing converted."""
    from asyncside.cli import main

    d = _save(tmp_path / "m", *tiny_model("qwen3_moe"), tokenizer=False)
    cache = tmp_path / "cache"
    extra = ["--tokens", "2", "--quiet"] if command == "demo" else ["--port", "0"]
    assert main([command, "--model", str(d), "--cache-dir", str(cache), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"asyncside {command}: ") and f"{d}: holds no tokenizer files" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert _stores(cache) == []


def test_a_store_on_a_read_only_file_system_is_not_said_to_need_chmod(tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert MODEL STORE --overwrite`` where STORE is on a file system mounted
    read-only (a shared volume, a container's read-only bind mount) was told "make it writable
    (chmod u+w)", which the file system refuses whatever the mode. It names the read-only mount;
    the store stays as it was."""
    import os

    from asyncside.cli import main
    from asyncside.models import convert as convert_module

    d = _save(tmp_path / "m", *tiny_model("mixtral"))
    store = tmp_path / "store"
    assert main(["convert", str(d), str(store), "--quiet"]) == 0
    before = sorted(p.name for p in store.iterdir())
    real_access, real_statvfs = os.access, os.statvfs

    class _ReadOnly:
        f_flag = os.ST_RDONLY

    # As a read-only mount answers: no write access whatever the mode (root's included).
    monkeypatch.setattr(convert_module.os, "access",
                        lambda p, mode, **kw: False if pathlib.Path(p) == store and mode & os.W_OK
                        else real_access(p, mode, **kw))
    monkeypatch.setattr(convert_module.os, "statvfs",
                        lambda p: _ReadOnly() if pathlib.Path(p) == store else real_statvfs(p))
    capsys.readouterr()
    assert main(["convert", str(d), str(store), "--quiet", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"asyncside convert: error: {store}: cannot be replaced: it is on a read-only file system "
                   "(mounted read-only); convert into another directory"), err
    assert sorted(p.name for p in store.iterdir()) == before


@pytest.mark.parametrize(("model_type", "options"), [
    ("mixtral", {"quant_predicate": "mixed_3_6"}),
    ("qwen3_moe", {"quant_predicate": "mixed_2_6"}),
    ("gpt_oss", {"quant_predicate": "mixed_4_6"}),
])
def test_a_mixed_recipe_as_mlx_lm_convert_writes_it_streams_mlx_lms_tokens(tmp_path: pathlib.Path, model_type: str,
                                                                           options: dict[str, str]) -> None:
    """``mlx_lm.convert(..., quant_predicate="mixed_3_6")`` (how mlx-community makes its mixed
    models) records each module's entry with ``"group_size": null`` (MLX's default for the mode),
    and mlx-lm loads it so. ``load``/``asyncside convert`` of it ended in "TypeError: int()
    argument must be ... not 'NoneType'" from inside the converter. The group size and bits are
    now what the experts were quantized with, and the tokens mlx-lm's."""
    import contextlib
    import io
    import json

    from mlx_lm.convert import convert

    src = _save(tmp_path / "float", *tiny_model(model_type))
    out = tmp_path / "mixed"
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), mlx_path=str(out), quantize=True, **options)
    entries = json.loads((out / "config.json").read_text())["quantization"]
    assert any(isinstance(v, dict) and v["group_size"] is None for v in entries.values())
    ref_model, ref_tok = mlx_lm.load(str(out))
    want = [r.token for r in mlx_lm.stream_generate(ref_model, ref_tok, PROMPT, max_tokens=8)]
    model, tok = load(out, resident=0.25, cache_dir=tmp_path / "cache", progress=False)
    with model:
        assert [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=8)] == want
        assert mlx_lm.generate(model, tok, PROMPT, max_tokens=8) == mlx_lm.generate(ref_model, ref_tok, PROMPT,
                                                                                    max_tokens=8)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("top_k", [0, 99])
def test_experts_per_token_outside_the_experts_is_named(tmp_path: pathlib.Path, model_type: str, top_k: int,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json whose ``num_experts_per_tok`` is more than the model's experts (or none)
    builds in mlx-lm, and converted: its first token failed in MLX's "[argpartition] Received
    invalid kth" (0: in an ExceptionGroup of one fault per expert, "no lent row was left"). The
    conversion refuses it in one line naming config.json and the field; nothing is written."""
    import json

    from asyncside.cli import main

    d = _save(tmp_path / "m", *tiny_model(model_type))
    config = json.loads((d / "config.json").read_text())
    n_experts = next(config[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in config)
    config["num_experts_per_tok"] = top_k
    (d / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["convert", str(d), str(tmp_path / "store"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"asyncside convert: error: {d / 'config.json'} [num_experts_per_tok]: layer ")
    assert f"routes each token to {top_k} of its {n_experts} experts; expected 1 to {n_experts}" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_conversion_killed_under_one_name_is_cleaned_up_under_another(tmp_path: pathlib.Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``load("models/m")`` killed while converting left its staging directory in the cache (as
    large as what it had written); the model then loaded as ``load("/abs/.../models/m")`` converted
    again and left it there for ever: only a conversion under the first name removed it. A
    conversion still running under the other name (its lock held) is left alone."""
    import fcntl
    import os
    import time

    from asyncside.hub import _cached_store_name
    from asyncside.models.convert import STAGING_LOCK

    d = _save(tmp_path / "models" / "m", *tiny_model("qwen3_moe"))
    cache = tmp_path / "cache"
    root = stores_root(cache)
    root.mkdir(parents=True)
    killed = root / f".{_cached_store_name('models/m', d)}.convert-killed"
    (killed / "store").mkdir(parents=True)
    (killed / STAGING_LOCK).touch()  # its lock died with the process
    old = time.time() - 3600
    os.utime(killed, (old, old))
    live = root / f".{_cached_store_name('./m', d)}.convert-live"
    live.mkdir()
    with open(live / STAGING_LOCK, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        model, tok = load(d, resident=0.25, cache_dir=cache, progress=False)
        model.close()
        assert not killed.exists() and live.exists()
    assert len(_stores(cache)) == 1


@pytest.mark.parametrize("command", ["load", "convert", "demo"])
@pytest.mark.parametrize("folder", ["repo", "snapshots"])
def test_a_hugging_face_cache_folder_names_the_repo_id_and_snapshot(tmp_path: pathlib.Path, command: str,
                                                                     folder: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The folder a file browser shows for a downloaded model (``~/.cache/huggingface/hub/
    models--org--name``, or its ``snapshots``) passed as the model: "is neither an expert store
    nor an mlx-lm model directory", no word of the snapshot inside or the repo id. The line names
    both."""
    from asyncside.cli import main
    from asyncside.errors import ModelNotFoundError

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--mlx-community--Tiny-MoE-4bit"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = _save(repo / "snapshots" / commit, *tiny_model("qwen3_moe"))
    given = repo if folder == "repo" else repo / "snapshots"
    said = (f"is a Hugging Face cache's folder of the repo mlx-community/Tiny-MoE-4bit, not a model directory: "
            f"pass the repo id mlx-community/Tiny-MoE-4bit, or its snapshot directory {snapshot}")
    cache = tmp_path / "cache"
    if command == "load":
        with pytest.raises(ModelNotFoundError) as info:
            load(given, cache_dir=cache, progress=False)
        assert said in str(info.value), str(info.value)
    else:
        args = ([command, str(given), str(tmp_path / "store")] if command == "convert"
                else [command, "--model", str(given), "--cache-dir", str(cache), "--tokens", "2"])
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert _stores(cache) == [] and not (tmp_path / "store").exists()
