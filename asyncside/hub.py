"""Where a model comes from: a local directory or a Hugging Face repo id, as mlx-lm takes them.

Every command that takes a model (``asyncside convert``, ``asyncside serve --model``, ``asyncside
demo --model``, :func:`asyncside.facade.load`) accepts three kinds of name:

- an expert store directory written by ``asyncside convert`` (it has ``manifest.json``);
- an mlx-lm model directory (``config.json`` + ``*.safetensors``);
- a Hugging Face repo id ``org/name`` (e.g. ``mlx-community/Qwen3-30B-A3B-4bit``), resolved by
  :func:`resolve_model` through ``huggingface_hub`` (a dependency of mlx-lm): the local cache
  first (nothing is asked of the network when the cached snapshot is complete), then a download
  with huggingface_hub's progress bars; ``HF_HUB_OFFLINE=1`` means the cache only. An id that
  cannot be found is a :class:`~asyncside.errors.ModelNotFoundError` naming it.

A name that exists as a local path is a path, even if it also reads as an id (as in mlx-lm). A
name that is neither is refused in one line that says both: the path is neither a directory nor a
file (and the nearest part of it that exists), and why the Hub did not give it; the path comes first
where the name's first part exists here, as in a mistyped ``models/qwen-store``.

:func:`store_for` turns any of the three into a store directory: a model directory or an id is
converted on first use into ``<cache>/stores/<name>-<hash>`` (``<cache>`` is asyncside's cache
directory, see :func:`asyncside.models.embedded.cache_root`), said on stderr, and reused later.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import re
import sys
from collections.abc import Callable

from .errors import ModelNotFoundError

__all__ = ["ALLOW_PATTERNS", "is_repo_id", "resolve_model", "store_for", "stores_root"]

#: the files of a repo that a conversion reads (mlx-lm's own download list, minus code): the weights
#: are the model*.safetensors mlx-lm loads, never a release's consolidated copy of them
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


#: a repo's address on the Hub (``https://huggingface.co/org/name``, its ``/tree/REV`` or a file's page)
_HUB_URL = re.compile(r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/([^/\s]+/[^/\s]+?)"
                      r"(?:/(?:tree|blob|resolve)/\S*)?/?$")


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hugging Face repo id (``org/name``, no other slash)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def _offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (it reads its constant once, at import; the
    environment is read here too so that a change made after the import still counts)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(constants.HF_HUB_OFFLINE) or env in {"1", "ON", "YES", "TRUE"}


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def _no_such_path(path: pathlib.Path) -> str:
    """Why ``path``, which does not exist, is nothing: a dangling link, or the nearest
    part of it that exists (the directory that lacks the next name, or a file in the way)."""
    path = pathlib.Path(os.path.abspath(path))  # "../x" named as the directory it is, not ".../.."
    if path.is_symlink():
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    head = path.parent
    while head != head.parent and not head.exists():
        head = head.parent
    step = path.relative_to(head).parts[0]
    where = f"{head} is a file" if head.is_file() else f"{head} has no {step}"
    return f"{path} is neither a directory nor a file ({where})"


def _one_line(exc: BaseException) -> str:
    # huggingface_hub's messages run over several lines; a refusal is one.
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def resolve_model(name: str | os.PathLike[str], *, revision: str | None = None) -> pathlib.Path:
    """The local directory that ``name`` (a path or a Hugging Face repo id) designates.

    A path that exists is returned as it is. A repo id is looked up in the local Hugging Face
    cache first; when the cached snapshot is missing or incomplete and ``HF_HUB_OFFLINE`` is not
    set, it is downloaded (the weights, configs and tokenizer files only) with a progress bar.
    Raises :class:`ModelNotFoundError` naming ``name`` when it is neither.
    """
    text = os.fspath(name)
    if not text:
        # pathlib reads an empty path as the working directory: a name from an unset variable
        # loaded (or tried to convert) whatever directory the process ran in.
        raise ModelNotFoundError(repr(text), "an empty name; expected an expert store, an mlx-lm model directory "
                                             "or a Hugging Face repo id (org/name)")
    path = pathlib.Path(text).expanduser()
    try:
        exists = path.exists()
    except OSError as exc:
        # A path under a directory this user may not enter (another user's home, /root) raised
        # PermissionError out of every command as a traceback; so did a name too long to look up.
        closed = " (a directory on its way is closed to this user)" if exc.errno == errno.EACCES else ""
        raise ModelNotFoundError(text, f"{path} cannot be looked at: {exc.strerror or exc}{closed}") from None
    if exists:
        if revision is not None:
            # A revision names a commit of a repo on the Hub: on a local directory it was ignored
            # without a word, and the directory's files were loaded whatever revision was asked.
            raise ModelNotFoundError(text, f"a local path, where revision={revision!r} means nothing (a revision "
                                           "is a Hugging Face repo's branch, tag or commit): leave it out, or "
                                           "name the repo id (org/name) from a directory that has no such path")
        return path.absolute()
    if not is_repo_id(text):
        # A repo's page address, pasted from the browser, was said to be no repo id, with no word
        # of the one it holds.
        url = _HUB_URL.match(text.strip())
        if url and is_repo_id(url.group(1)):
            raise ModelNotFoundError(text, f"a Hugging Face page address: give its repo id, {url.group(1)}")
        # An id pasted with a slash at its end or spaces around it was said to be no id, as if the
        # org/name in it were wrong.
        bare = text.strip().rstrip("/")
        meant = f" (did you mean the repo id {bare}?)" if is_repo_id(bare) else ""
        raise ModelNotFoundError(text, f"model directory does not exist: {_no_such_path(path.absolute())}; not a "
                                       f"Hugging Face repo id (org/name) either{meant}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = _hub_cache()
    missing = ""
    local = _no_such_path(path.absolute())
    # A name whose first part exists here reads as a mistyped path more than as an id: its
    # refusal says the path first. Either way it says both, where it said only that the Hub could
    # not be reached, and the user never learnt the path they meant was not there.
    typed_path = pathlib.Path(text.split("/", 1)[0]).exists()

    def refused(why: str) -> ModelNotFoundError:
        if typed_path:
            return ModelNotFoundError(text, f"{local}; as a Hugging Face repo id: {why}")
        return ModelNotFoundError(text, f"{why}; nor is it a local path: {local}")

    try:
        return pathlib.Path(snapshot_download(text, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                              cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError as exc:  # IncompleteSnapshotError derives from it
        if getattr(exc, "snapshot_path", None) is not None:
            found = re.search(r"\d+ file\(s\) are missing \(.*?\)(?=\. )", str(exc))
            missing = found.group(0) if found else "files are missing"
    if _offline() and missing:
        # A download cut short was said to be "not in the local Hugging Face cache", where it is,
        # in part: what it lacks is what the user needs to know.
        raise ModelNotFoundError(text, f"its snapshot in the local Hugging Face cache ({cache}) is incomplete "
                                       f"({missing}) and HF_HUB_OFFLINE is set; unset it to finish the download")
    if _offline():
        raise refused(f"not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; unset it to "
                      "download the model, or give a local directory")
    if typed_path:
        print(f"asyncside: {text}: no local path {path.absolute()}; downloading it as a Hugging Face repo id "
              f"into {cache}", file=sys.stderr, flush=True)
    else:
        print(f"asyncside: downloading {text} from the Hugging Face Hub into {cache}", file=sys.stderr, flush=True)
    try:
        return pathlib.Path(snapshot_download(text, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                              cache_dir=cache))
    except (RepositoryNotFoundError, GatedRepoError):
        raise refused("no such model on the Hugging Face Hub (or it is private or gated: log in with "
                      "`hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(text, f"revision {revision!r} does not exist on the Hugging Face Hub") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise refused(f"could not be downloaded from the Hugging Face Hub ({_one_line(exc)})") from None


def stores_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Where :func:`store_for` keeps stores converted on first use."""
    from .models.embedded import cache_root

    return cache_root(cache_dir) / "stores"


def _cached_store_name(name: str, directory: pathlib.Path) -> str:
    # The resolved directory is in the key: a repo id's snapshot path holds its commit, so a new
    # revision of the model gets its own store.
    stem = re.sub(r"[^A-Za-z0-9._-]+", "--", name.strip("/")).strip("-.")[-80:] or "model"
    digest = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:12]
    return f"{stem}-{digest}"


def needs_a_tokenizer(use: str) -> Callable[[pathlib.Path, bool], None]:
    """A ``needs`` check for :func:`store_for` refusing a model directory whose tokenizer cannot be
    had, naming the directory: one without tokenizer files, or (before it is converted) one whose
    files do not load. ``use`` says what the caller needs the tokenizer for."""
    from .errors import StoreError
    from .models.tokenizer import BYTE_TOKENIZER_FILE, load_tokenizer

    def check(model_dir: pathlib.Path, converting: bool) -> None:
        # Refused only after the conversion, the error named the store in asyncside's cache: the
        # model was converted (a copy as large as it) for nothing, and the user's directory unnamed.
        if not any((model_dir / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                                                       BYTE_TOKENIZER_FILE)):
            raise StoreError(model_dir, f"holds no tokenizer files (tokenizer.json, tokenizer_config.json or "
                                        f"tokenizer.model): {use}; copy them from the model it was made from")
        if converting:
            load_tokenizer(model_dir)  # a StoreError naming the directory and its files where they do not load

    return check


def _cached_store(root: pathlib.Path, name: str, directory: pathlib.Path) -> pathlib.Path:
    """The store in ``root`` for the model at ``directory`` that ``name`` designates: one already
    converted from that directory under any name, else the one :func:`_cached_store_name` names."""
    from .models.loading import is_store_dir

    dest = root / _cached_store_name(name, directory)
    if is_store_dir(dest):
        return dest
    # The name's stem is only a label: "./m", "/home/u/m" and a link to it are one model, and each
    # name converted it once more into a store of its own, as large as the model.
    digest = dest.name.rsplit("-", 1)[-1]
    try:
        found = sorted(p for p in root.glob(f"*-{digest}") if is_store_dir(p))
    except OSError:
        found = []
    return found[0] if found else dest


def _not_a_model(directory: pathlib.Path) -> str | None:
    """Why ``directory`` (no expert store) is no mlx-lm model directory either; None when it is one."""
    if directory.is_dir() and (directory / "config.json").is_file():
        return None
    expected = "an expert store (manifest.json) or an mlx-lm model directory (config.json)"
    if directory.is_file() and directory.name in ("manifest.json", "config.json"):
        return f"is a file: pass its directory, {directory.parent}"  # the store's or model's own file
    if directory.is_file():
        return f"is a file; expected {expected}"
    if directory.is_dir() and not any(directory.iterdir()):
        return f"is an empty directory; expected {expected}"
    if (hint := hub_cache_folder_hint(directory)) is not None:
        return hint
    return "is neither an expert store (manifest.json) nor an mlx-lm model directory (config.json)"


def hub_cache_folder_hint(directory: pathlib.Path) -> str | None:
    """What to pass instead of a Hugging Face cache's repo folder (``models--org--name``, or its
    ``snapshots``) where ``directory`` is one; None where it is not."""
    repo = directory.parent if directory.name == "snapshots" else directory
    if not (repo.name.startswith("models--") and (repo / "snapshots").is_dir()):
        return None
    # The folder a file browser shows for a downloaded model was said to be no model directory,
    # with no word of the snapshot inside it, or of the repo id that names it.
    repo_id = repo.name[len("models--"):].replace("--", "/", 1)
    try:
        commit = (repo / "refs" / "main").read_text().strip()
    except OSError:
        commit = ""
    snapshot = repo / "snapshots" / commit
    where = str(snapshot) if commit and snapshot.is_dir() else f"{repo / 'snapshots'}/<commit>"
    return (f"is a Hugging Face cache's folder of the repo {repo_id}, not a model directory: pass the repo id "
            f"{repo_id}, or its snapshot directory {where}")


def _remove_stale_staging_of_other_names(root: pathlib.Path, dest: pathlib.Path) -> None:
    """Remove the staging directories of conversions of ``dest``'s model killed under another of
    its names (a converting process's own are left, as :func:`removed_stale_staging` leaves them)."""
    from .models.convert import removed_stale_staging

    # A conversion killed part way under one name left its staging directory (as large as the
    # part written) for ever, where the model was then taken under another name: only a later
    # conversion under the first name removed it.
    digest = dest.name.rsplit("-", 1)[-1]
    try:
        names = {p.name[1:].split(".convert-", 1)[0] for p in root.glob(f".*-{digest}.convert-*")}
        for name in sorted(names - {dest.name}):
            removed_stale_staging(root / name)
    except OSError:
        pass  # a cache this process may not write (read-only, another user's): nothing of it to clean


def store_for(name: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
              revision: str | None = None, progress: bool = True,
              say: Callable[[str], None] | None = None,
              needs: Callable[[pathlib.Path, bool], None] | None = None) -> pathlib.Path:
    """An expert store directory for ``name``: a store as it is, else the model (a directory or a
    repo id, see :func:`resolve_model`) converted on first use into :func:`stores_root` and
    reused on later calls. ``say`` receives the one line that says which (default: stderr).
    ``needs(directory, converting)``, where given, checks a model directory for what the caller
    needs of it and raises to refuse it: before its cached store is taken, and again (``converting``
    true) before it is converted.

    Raises :class:`ModelNotFoundError` for a name that is nothing of these, and the converter's
    errors (StoreError, UnsupportedModelError) for a model it cannot convert.
    """
    from .errors import StoreError
    from .models.embedded import _file_lock
    from .models.loading import is_store_dir

    def tell(line: str) -> None:
        if say is not None:
            say(line)
        else:
            print(line, file=sys.stderr, flush=True)

    text = os.fspath(name)
    directory = resolve_model(text, revision=revision)
    if directory.is_dir() and not os.access(directory, os.R_OK | os.X_OK):
        # Looking for its manifest.json raised PermissionError out of every command as a traceback.
        raise ModelNotFoundError(text, f"{directory} is a directory this user may not read (its permissions "
                                       f"are {directory.stat().st_mode & 0o777:o})")
    if is_store_dir(directory):
        return directory
    if (why := _not_a_model(directory)) is not None:
        raise ModelNotFoundError(text, f"{directory} {why}")
    if not any(directory.glob("model*.safetensors")):
        # A config.json alone (as `bench generate --shape DIR` takes one): said before the line that
        # announces a conversion, which would fail at once and leave a lock file behind.
        from .models.convert import unread_weights_note

        if note := unread_weights_note(directory):
            raise StoreError(directory, f"has a config.json but no model*.safetensors weight files{note}, so it "
                                        "cannot be converted")
        raise StoreError(directory, "has a config.json but no model*.safetensors weight files, so it cannot be "
                                    "converted; for a model of this config's shape with seeded weights, "
                                    f"asyncside bench generate --shape {text} (docs/models.md)")
    from .store import path_not_utf8, printable_path

    if (problem := path_not_utf8(directory)) is not None:  # said before a conversion is announced
        raise StoreError(printable_path(directory), problem)
    if needs is not None:
        from .models.convert import model_config

        model_config(directory)  # a model asyncside cannot stream is refused as that first
        needs(directory, False)
    root = stores_root(cache_dir)
    dest = _cached_store(root, text, directory)
    _remove_stale_staging_of_other_names(root, dest)

    def stale() -> str | None:
        # The cache is keyed by the directory's path: a model saved again into it (fine-tuned,
        # another checkpoint) reused the store of the one converted first, its tokens those of
        # the old weights, without a word.
        from .models.convert import source_changed
        from .store import ExpertStore

        try:
            return source_changed(ExpertStore.open(dest), directory)
        except (OSError, StoreError):
            return "the cached store cannot be opened"

    changed: str | None = None
    if is_store_dir(dest) and (changed := stale()) is None:
        tell(f"asyncside: {text}: using the store converted on first use, {dest}")
        return dest

    def waiting() -> None:
        tell(f"asyncside: {text}: another process is converting it into {dest}; waiting for it")

    from .models.convert import StoreWriteError

    locked = False
    try:
        with _file_lock(root / f".{dest.name}.lock", waiting):
            locked = True
            if not is_store_dir(dest) or (changed := stale()) is not None:
                from .models.convert import convert_model

                if needs is not None:
                    needs(directory, True)
                if is_store_dir(dest):
                    tell(f"asyncside: {text}: {changed} since its store was converted; converting again into {dest}")
                else:
                    tell(f"asyncside: {text}: converting to an expert store in {dest} (first use; reused later)")
                try:
                    convert_model(directory, dest, progress=progress, overwrite=True,
                                  model_id=text if is_repo_id(text) else None)
                except FileNotFoundError as exc:
                    raise StoreError(directory, f"cannot be converted: {exc}") from None
    except StoreWriteError as exc:
        if locked or changed is None:
            raise
        # A cache another machine filled, mounted read-only here: the refusal named the lock file
        # it could not make, not why the store it holds was not taken as it is.
        raise StoreWriteError(directory, f"{changed} since its store {dest} was converted, and converting it "
                                         f"again needs a cache this process can write: {exc}",
                              errno=exc.errno) from None
    return dest
