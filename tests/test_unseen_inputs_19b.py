"""Unseen inputs, round 19 (b): a mistyped local path taken for a Hugging Face repo id, and a
memory budget written as a share. What is refused is one line naming the name and what it is not.

No network is reached: huggingface_hub's ``snapshot_download`` is stood in for by one that finds
nothing in the cache and then fails as it does with no network (or answers as the Hub does)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import httpx
import pytest
from _cli_support import run_cli

NO_NETWORK = ("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying to "
              "locate the files on the Hub. Please check your internet connection and try again.")


def _stand_in_hub(monkeypatch: pytest.MonkeyPatch, download: Callable[[str], str]) -> list[str]:
    """huggingface_hub with an empty cache, online, whose download is ``download``; the ids asked."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    asked: list[str] = []

    def snapshot_download(repo_id: str, *, local_files_only: bool = False, **_: object) -> str:
        if local_files_only:
            raise LocalEntryNotFoundError("not in the cache")
        asked.append(repo_id)
        return download(repo_id)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return asked


def _unreachable(repo_id: str) -> str:
    from huggingface_hub.errors import LocalEntryNotFoundError

    raise LocalEntryNotFoundError(NO_NETWORK)


def test_a_mistyped_store_path_says_it_is_no_path_not_only_that_the_hub_is_unreachable(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --model models/qwen-store`` (``models/`` here, without ``qwen-store``) and
    ``demo --model topk15/store`` (no ``topk15/``) read as repo ids and failed with huggingface_hub's
    DNS error over two lines, never saying that no such local path exists. The one line now says the
    path is neither a directory nor a file and where it stops existing, and why the Hub did not
    give it; the path comes first where the name's first part exists."""
    import asyncside
    from asyncside.errors import ModelNotFoundError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "notes").write_text("")
    asked = _stand_in_hub(monkeypatch, _unreachable)
    hub = "could not be downloaded from the Hugging Face Hub (LocalEntryNotFoundError: Got: ConnectError"

    rc, err = run_cli(capsys, "demo", "--model", "models/qwen-store", "--tokens", "2", "--reference", "none")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and len(err.strip().splitlines()) == 2, err  # the download said, then the one line
    assert last.startswith(f"asyncside demo: models/qwen-store: {tmp_path}/models/qwen-store is neither a "
                           f"directory nor a file ({tmp_path}/models has no qwen-store); as a Hugging Face "
                           f"repo id: {hub}"), err
    assert "no local path" in err.splitlines()[0] and "Traceback" not in err

    rc, err = run_cli(capsys, "demo", "--model", "topk15/store", "--tokens", "2", "--reference", "none")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"asyncside demo: topk15/store: {hub}"), err
    assert last.endswith(f"; nor is it a local path: {tmp_path}/topk15/store is neither a directory nor a file "
                         f"({tmp_path} has no topk15)"), err

    rc, err = run_cli(capsys, "demo", "--model", "notes/store", "--tokens", "2", "--reference", "none")
    assert rc == 2 and f"({tmp_path}/notes is a file); as a Hugging Face repo id" in err, err

    with pytest.raises(ModelNotFoundError) as info:
        asyncside.load("models/qwen-store", progress=False)
    said = str(info.value)
    assert "\n" not in said and said.startswith(f"models/qwen-store: {tmp_path}/models/qwen-store is neither"), said
    assert asked == ["models/qwen-store", "topk15/store", "notes/store", "models/qwen-store"]


def test_a_name_that_is_no_repo_id_names_the_part_of_the_path_that_exists(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``./topk15/store`` or ``topk15/layers/store`` (no repo id) was "model directory does not
    exist", naming neither the directory it was looked for in nor how much of it exists."""
    from asyncside.errors import ModelNotFoundError
    from asyncside.hub import resolve_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "topk15").mkdir()
    asked = _stand_in_hub(monkeypatch, _unreachable)
    for name, missing, step in (("./topk15/store", "topk15/store", "store"),
                                ("topk15/layers/store", "topk15/layers/store", "layers"),
                                (f"../{tmp_path.name}/topk15/store", "topk15/store", "store")):
        with pytest.raises(ModelNotFoundError) as info:
            resolve_model(name)
        assert str(info.value) == (f"{name}: model directory does not exist: {tmp_path}/{missing} is neither a "
                                   f"directory nor a file ({tmp_path}/topk15 has no {step}); not a Hugging Face "
                                   "repo id (org/name) either"), info
    assert asked == []


def test_a_repo_id_is_still_downloaded_and_an_unknown_one_says_both(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the refusals above changed leaves a repo id as it was: downloaded when it is on the Hub
    (even with its organisation's name a directory here, as a download ``--local-dir`` makes), and
    an unknown one refused naming the Hub first."""
    from huggingface_hub.errors import RepositoryNotFoundError

    from asyncside.errors import ModelNotFoundError
    from asyncside.hub import resolve_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlx-community").mkdir()
    snapshot = tmp_path / "snapshot"

    def download(repo_id: str) -> str:
        if repo_id != "mlx-community/Qwen3-30B-A3B-4bit" and repo_id != "org/name":
            url = f"https://huggingface.co/api/models/{repo_id}"
            raise RepositoryNotFoundError(f"404 Client Error.\nRepository Not Found for url: {url}",
                                          response=httpx.Response(404, request=httpx.Request("GET", url)))
        snapshot.mkdir(exist_ok=True)
        return str(snapshot)

    _stand_in_hub(monkeypatch, download)
    assert resolve_model("mlx-community/Qwen3-30B-A3B-4bit") == snapshot
    assert resolve_model("org/name") == snapshot
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/nope")
    assert str(info.value) == (f"org/nope: no such model on the Hugging Face Hub (or it is private or gated: log in "
                               f"with `hf auth login`); nor is it a local path: {tmp_path}/org/nope is neither a "
                               f"directory nor a file ({tmp_path} has no org)")


@pytest.mark.parametrize(("memory", "written", "share"), [(0.5, "0.5", "0.5"), ("50%", "50%", "0.5"),
                                                          (" 25 % ", "25%", "0.25"), ("0.1", "0.1", "0.1")])
def test_a_memory_budget_written_as_a_share_says_that_a_share_is_resident(
        memory: float | str, written: str, share: str, quick_store: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``memory=0.5`` / ``--memory 50%`` (half the experts, as a user reads "memory") were refused as
    sizes ("is 0 bytes", "expected a size such as 800M") with no word that a share of the experts is
    what ``resident=`` / ``--resident`` takes. The one line now says so; a size is taken as before."""
    import asyncside
    from asyncside import ExpertStore, Runtime

    hint = f"; memory is a size, and a share of each layer's experts is --resident {written} (resident={share} in Python)"
    for command in ("demo", "serve"):
        rc, err = run_cli(capsys, command, "--model", str(quick_store), "--memory", str(memory))
        assert rc == 2 and err.strip().splitlines()[-1].endswith(hint), err
        assert err.strip().splitlines()[-1].startswith(f"asyncside {command}: error: argument --memory: memory "), err
    for refuse in (lambda: asyncside.load(quick_store, memory=memory, progress=False),
                   lambda: Runtime(ExpertStore.open(quick_store), memory=memory)):
        with pytest.raises(ValueError) as info:
            refuse()
        assert str(info.value).endswith(hint) and "\n" not in str(info.value), info


@pytest.mark.parametrize("memory", [1, "1", "0", "150%", "2K", "auto"])
def test_a_memory_that_is_no_share_gets_no_share_hint(memory: int | str) -> None:
    """A byte count, a percentage over a whole, a size too small or a word: refused as before,
    with no word of resident."""
    from asyncside.memory import check_memory, parse_size

    with pytest.raises(ValueError) as info:
        check_memory(parse_size(memory, what="memory"), memory)
    assert "resident" not in str(info.value), info


def test_a_path_that_cannot_be_looked_at_is_one_line_not_a_traceback(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --model`` of a name too long for the filesystem, or of a directory this user may not
    read (another user's store), raised OSError / PermissionError out of the command as a
    traceback. Both are one line naming the path, exit 2."""
    import os

    long_name = str(tmp_path / ("x" * 300) / "store")
    rc, err = run_cli(capsys, "demo", "--model", long_name, "--tokens", "2", "--reference", "none")
    assert rc == 2 and err.strip() == f"asyncside demo: {long_name}: {long_name} cannot be looked at: File name too long"

    closed = tmp_path / "theirs"
    closed.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(closed) else real(p, mode, **kw))
    rc, err = run_cli(capsys, "demo", "--model", str(closed), "--tokens", "2", "--reference", "none")
    assert rc == 2 and err.strip().startswith(f"asyncside demo: {closed}: {closed} is a directory this user may not "
                                              "read (its permissions are "), err


@pytest.mark.parametrize("name", ["mlx-community/Qwen3-30B-A3B-4bit/", " mlx-community/Qwen3-30B-A3B-4bit ",
                                  "mlx-community/Qwen3-30B-A3B-4bit//"])
def test_a_repo_id_with_a_slash_at_its_end_names_the_id(name: str, tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model mlx-community/Qwen3-30B-A3B-4bit/`` (a slash from tab completion or a copied path)
    was "model directory does not exist (and not a Hugging Face repo id, org/name)", as though the
    org/name in it were wrong. The line names the id it holds; nothing is asked of the Hub."""
    from asyncside.errors import ModelNotFoundError
    from asyncside.hub import resolve_model

    monkeypatch.chdir(tmp_path)
    asked = _stand_in_hub(monkeypatch, _unreachable)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(name)
    assert str(info.value).endswith("; not a Hugging Face repo id (org/name) either (did you mean the repo id "
                                    "mlx-community/Qwen3-30B-A3B-4bit?)"), info
    assert asked == []
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/name/extra/")
    assert "did you mean" not in str(info.value)
