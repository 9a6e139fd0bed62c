"""Hugging Face repo ids wherever a model is taken, with a pre-populated local cache and no network.

The cache is built here the way huggingface_hub lays it out (``models--org--name/refs/main`` ->
``snapshots/<commit>/``), holding an mlx-community-style model directory (the small embedded
model: config.json with its quantization, safetensors, tokenizer files). ``HF_HUB_OFFLINE=1`` is
set throughout, so nothing may reach the network: a lookup that tried would fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from asyncside.errors import ModelNotFoundError
from asyncside.hub import is_repo_id, resolve_model, store_for, stores_root
from asyncside.models.convert import STAGING_LOCK, convert_model, removed_stale_staging
from asyncside.models.embedded import ensure_embedded_default
from asyncside.store import ExpertStore

from _models_support import SMALL_EMBEDDED

REPO = "testorg/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Hugging Face cache holding REPO at COMMIT, and the environment that points at it."""
    root = tmp_path_factory.mktemp("hub")
    model_dir, _store = ensure_embedded_default(root / "build", spec=SMALL_EMBEDDED, progress=False)
    repo = root / "hf" / "hub" / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (snapshot / "asyncside_spec.json").unlink()  # not part of an upload
    env = {"HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(root / "hf" / "hub"), "HF_HUB_OFFLINE": "1",
           "ASYNCSIDE_CACHE": str(root / "asyncside-cache")}
    return {"root": root, "snapshot": snapshot, "env": env}


@pytest.fixture
def hub_env(hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    for k, v in hub["env"].items():
        monkeypatch.setenv(k, v)
    return hub


def cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncside.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


@pytest.mark.parametrize(("name", "ok"), [
    ("mlx-community/Qwen3-30B-A3B-4bit", True), ("org/name", True), ("a/b.c_d-e", True),
    ("name", False), ("org/name/extra", False), ("/abs/path", False), ("./org/name", False), ("org/../x", False),
    ("", False), ("org/", False),
])
def test_repo_id_shape(name: str, ok: bool) -> None:
    assert is_repo_id(name) is ok


def test_resolves_an_id_from_the_local_cache_offline(hub_env: dict[str, Any]) -> None:
    assert resolve_model(REPO) == hub_env["snapshot"]
    # A path that exists is a path.
    assert resolve_model(str(hub_env["snapshot"])) == hub_env["snapshot"]


def test_an_unknown_id_is_a_clear_error_naming_it(hub_env: dict[str, Any]) -> None:
    with pytest.raises(ModelNotFoundError, match=r"^testorg/nope: not in the local Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("testorg/nope")
    with pytest.raises(ModelNotFoundError, match=r"^no/such/dir: model directory does not exist"):
        resolve_model("no/such/dir")


def test_convert_takes_a_repo_id(hub_env: dict[str, Any], tmp_path: pathlib.Path) -> None:
    proc = cli(["convert", REPO, str(tmp_path / "store"), "--json"], hub_env["env"])
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["model_dir"] == str(hub_env["snapshot"]) and res["model_id"] == REPO
    store = ExpertStore.open(tmp_path / "store")
    assert store.metadata["asyncside_model"]["model_id"] == REPO and len(store.layers) == 2

    bad = cli(["convert", "testorg/nope", str(tmp_path / "other")], hub_env["env"])
    assert bad.returncode == 2
    assert bad.stderr.startswith("asyncside convert: error: testorg/nope: not in the local Hugging Face cache")
    assert not (tmp_path / "other").exists()


def test_store_for_converts_on_first_use_then_reuses(hub_env: dict[str, Any]) -> None:
    said: list[str] = []
    first = store_for(REPO, progress=False, say=said.append)
    assert first.parent == stores_root() and first.name.startswith("testorg--tiny-moe-")
    assert "converting" in said[0] and str(first) in said[0] and "reused later" in said[0]
    mtime = (first / "manifest.json").stat().st_mtime_ns
    again = store_for(REPO, progress=False, say=said.append)
    assert again == first and "using the store converted on first use" in said[1]
    assert (first / "manifest.json").stat().st_mtime_ns == mtime  # not converted twice
    # A store is taken as it is; the model directory itself maps to a store of its own.
    assert store_for(first, say=said.append) == first
    with pytest.raises(ModelNotFoundError, match="testorg/nope"):
        store_for("testorg/nope")


def test_serve_takes_a_repo_id(hub_env: dict[str, Any]) -> None:
    env = {**os.environ, **hub_env["env"], "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncside.cli", "serve", "--model", REPO, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=240)
            assert line is not None, f"serve exited with {proc.wait()}:\n{''.join(output)}"
            m = re.search(r"asyncside serve: (http://\S+) model=(\S+)", line)
            if m:
                url, model_id = m.group(1), m.group(2)
        assert model_id == REPO
        r = httpx.post(url + "/v1/completions", json={"model": REPO, "prompt": "Hello", "max_tokens": 4},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "".join(output)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    bad = cli(["serve", "--model", "testorg/nope", "--port", "0"], hub_env["env"], timeout=120)
    assert bad.returncode == 2 and "testorg/nope: not in the local Hugging Face cache" in bad.stderr


def test_interrupted_conversions_leave_nothing_that_opens_and_are_cleaned_up(
        hub: dict[str, Any], tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "store"
    old = time.time() - 3600
    # A conversion killed mid-way: its staging directory, lock file not held by anyone.
    dead = tmp_path / ".store.convert-dead"
    (dead / "store").mkdir(parents=True)
    (dead / STAGING_LOCK).touch()
    # One from before lock files existed.
    legacy = tmp_path / ".store.convert-legacy"
    legacy.mkdir()
    # One still running: its lock held (here by this test).
    live = tmp_path / ".store.convert-live"
    live.mkdir()
    held = open(live / STAGING_LOCK, "a+")
    fcntl.flock(held, fcntl.LOCK_EX)
    # One that just started (no lock file yet).
    young = tmp_path / ".store.convert-young"
    young.mkdir()
    # One killed a moment ago: its lock file is free, so it goes at once, however young.
    just_killed = tmp_path / ".store.convert-killed"
    just_killed.mkdir()
    (just_killed / STAGING_LOCK).touch()
    for d in (dead, legacy, live):
        os.utime(d, (old, old))
    # Another destination's staging directory is not this conversion's business.
    other = tmp_path / ".other.convert-x"
    other.mkdir()
    os.utime(other, (old, old))
    try:
        convert_model(hub["snapshot"], dest, progress=False)
        assert not dead.exists() and not legacy.exists() and not just_killed.exists()
        assert live.exists() and young.exists() and other.exists()
        assert removed_stale_staging(dest) == []
    finally:
        held.close()
    assert removed_stale_staging(dest) == [live]  # its lock died with its holder
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.convert-x", ".store.convert-young", "store"]
    ExpertStore.open(dest)


def test_load_takes_a_repo_id(hub_env: dict[str, Any]) -> None:
    """asyncside.facade.load, like mlx_lm.load, takes the id (converted on first use, then reused)."""
    from mlx_lm import generate

    from asyncside.facade import load

    model, tok = load(REPO, resident=0.5, progress=False)
    try:
        assert model.streaming.store.path == store_for(REPO, progress=False, say=lambda _line: None)
        assert model.streaming.model_id == REPO
        assert len(generate(model, tok, "Hello", max_tokens=4)) > 0
    finally:
        model.close()
