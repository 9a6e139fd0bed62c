"""``asyncside convert``: an mlx-lm model directory -> an expert store directory.

The model is opened with mlx-lm's own loader (lazily: safetensors are read when a tensor is
needed), so every checkpoint layout mlx-lm understands (its ``sanitize`` stacks per-expert keys,
handles gpt-oss/deepseek layouts, legacy quantization configs) converts the same way. Then:

- each MoE layer's stacked switch tensors (``gate_proj.weight``/``.scales``/``.biases``, ... as the
  model holds them) become that layer's records in an :class:`~asyncside.store.ExpertStore`,
  one layer in memory at a time (the layer is detached from the model once written);
- every other weight goes to ``model.safetensors`` beside the blobs, with ``config.json`` (the
  mlx-lm config, quantization included) and the tokenizer files, so loading the streaming model
  never touches an expert tensor;
- the manifest metadata (key ``asyncside_model``) records the architecture, each switch layer's
  layout (quantization, biases), its module path, its router's top-k, and per layer the experts
  ranked hottest-first.

**Resident set.** With a routing profile (counts of routed experts per layer, from
:func:`profile_routing` or a run's :class:`RoutingTrace`), experts are ranked by count (ties by
id); without one the documented default ranking is by expert id (0, 1, 2, ...): with no evidence
every choice is as good as another, and a fixed one is reproducible. The resident set of a layer
is the first ``round(resident_fraction * n_experts)`` of its ranking; any other fraction can be
taken later from the stored ranking with :func:`resident_sets`.

The whole store directory is built beside the destination (in ``.<name>.convert-*``) and renamed
into place, so an interrupted conversion never leaves a directory that opens; the next conversion
to the same destination removes such leftovers (:func:`removed_stale_staging`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import StoreError, os_reason
from .arch import (
    Arch,
    UnsupportedModelError,
    arch_for,
    decoder_layers,
    find_switch,
    moe_layers,
    segment_keys,
    switch_meta,
    top_k_attribute,
)
from .loading import META_KEY, NON_EXPERT_FILE, _module_path, check_routers
from .pooled import PooledSwitch, SwitchSpec
from .tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:
    from rich.progress import Progress

#: resident fraction used when the caller gives none
DEFAULT_RESIDENT_FRACTION = 0.25
PROFILE_FORMAT = "asyncside-routing-profile"


# ---------------------------------------------------------------------------------------------
# Routing profiles


def make_profile(model_type: str, counts: Mapping[int, Sequence[int]], tokens: int, source: str = "") -> dict[str, Any]:
    """A routing profile document: per MoE layer, how often each expert was routed."""
    return {
        "format": PROFILE_FORMAT,
        "version": 1,
        "model_type": model_type,
        "tokens": int(tokens),
        "source": source,
        "layers": {str(int(l)): [int(c) for c in v] for l, v in sorted(counts.items())},
    }


def load_profile(profile: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Read and validate a routing profile (a path to its JSON, or the parsed document)."""
    where = "<profile>"
    if not isinstance(profile, Mapping):
        where = str(profile)
        try:
            with open(profile, "rb") as fb:
                raw = fb.read()
        except FileNotFoundError:
            raise StoreError(where, "routing profile file does not exist") from None
        except OSError as exc:  # a directory, a file that cannot be read: said as the others are
            raise StoreError(where, f"routing profile cannot be read: {exc.strerror or exc}") from None
        if raw.startswith(b"PK"):
            # A routing trace (.npz, docs/routing-traces.md) was refused as "'utf-8' codec can't decode
            # byte 0xff in position 18", naming neither the file nor what it is.
            raise StoreError(where, f"a zip archive (a routing trace .npz?), not a routing profile: a profile is "
                                    f"JSON ({{\"format\": \"{PROFILE_FORMAT}\", \"version\": 1, \"layers\": "
                                    f"{{layer: [routed count per expert]}}}}), or let --profile-prompts N make one")
        try:
            profile = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise StoreError(where, f"routing profile is not UTF-8 JSON text ({exc.reason} at byte "
                                    f"{exc.start})") from None
        except json.JSONDecodeError as exc:
            raise StoreError(where, f"routing profile is not valid JSON: {exc}") from None
    if not isinstance(profile, Mapping) or profile.get("format") != PROFILE_FORMAT:
        raise StoreError(where, f"not a routing profile (expected format {PROFILE_FORMAT!r})", "format")
    if profile.get("version") != 1:
        raise StoreError(where, f"unsupported profile version {profile.get('version')!r}; expected 1", "version")
    layers = profile.get("layers")
    if not isinstance(layers, Mapping):
        raise StoreError(where, "expected an object layer -> counts", "layers")
    canonical: dict[str, list[int]] = {}
    for l, counts in layers.items():
        if not str(l).isascii() or not str(l).isdigit():
            raise StoreError(where, f"layer key {l!r} is not a layer index", "layers")
        if not isinstance(counts, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise StoreError(where, "counts must be a list of non-negative integers", f"layers.{l}")
        # Keyed as the converter looks a layer up: "01" passed the check, then no layer "1" was found
        # and the layer was ranked by id, said to be "profile: hottest first".
        key = str(int(l))
        if key in canonical:
            raise StoreError(where, f"layer {key} is given twice (as {key!r} and another spelling)", "layers")
        canonical[key] = counts
    return {**profile, "layers": canonical}


def _resident_default(prof: Mapping[str, Any] | None, moe: Sequence[int]) -> str:
    """How the resident sets were chosen, for the store's metadata and convert's summary: a profile
    that counted no routing at a layer (left out, or all zeros) ranks it by id, which "profile:
    hottest first" did not say (an empty profile was reported as a profile used)."""
    if not prof:
        return "no profile: expert id order"
    counted = {int(l) for l, c in prof["layers"].items() if any(c)}
    blind = [l for l in moe if l not in counted]
    if not blind:
        return "profile: hottest first"
    if len(blind) == len(moe):
        return "profile counts no routing at any MoE layer: expert id order"
    return (f"profile: hottest first; expert id order at {'layer' if len(blind) == 1 else 'layers'} "
            f"{', '.join(map(str, blind))} (no routing counted)")


def rank_experts(counts: Sequence[int] | None, n_experts: int) -> list[int]:
    """Experts hottest first (count descending, id ascending); by id when there are no counts."""
    if counts is None:
        return list(range(n_experts))
    return sorted(range(n_experts), key=lambda e: (-counts[e], e))


def profile_routing(model: nn.Module, config: Mapping[str, Any], prompts: Sequence[Sequence[int]], *,
                    max_tokens: int = 16, source: str = "") -> dict[str, Any]:
    """Run the plain mlx-lm ``model`` greedily on token-id ``prompts`` and count routed experts.

    Synchronous (a tool, not for an event loop). Counts every routed (token, expert) pair of
    prefill and decode. The model is restored afterwards.
    """
    from .loading import reference_generate

    arch = arch_for(config["model_type"])
    moe = moe_layers(model, arch)
    seen: dict[int, list[mx.array]] = {l: [] for l in moe}
    switches = {}

    class _Counting(nn.Module):
        def __init__(self, inner: nn.Module, layer: int) -> None:
            super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
            self.inner = inner
            object.__setattr__(self, "_layer", layer)

        def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
            seen[self._layer].append(indices)
            return cast(mx.array, self.inner(x, indices))

    for l, (block, attr) in moe.items():
        switches[l] = getattr(block, attr)
        setattr(block, attr, _Counting(switches[l], l))
    tokens = 0
    try:
        for p in prompts:
            out = reference_generate(model, list(p), max_tokens=max_tokens)
            tokens += len(p) + len(out)
    finally:
        for l, (block, attr) in moe.items():
            setattr(block, attr, switches[l])
    counts: dict[int, list[int]] = {}
    for l, arrays in seen.items():
        n = _n_experts(switches[l])
        c = np.zeros(n, dtype=np.int64)
        for a in arrays:
            c += np.bincount(np.asarray(a).reshape(-1), minlength=n)
        counts[l] = c.tolist()
    return make_profile(config["model_type"], counts, tokens, source)


def profile_model_dir(model_dir: str | os.PathLike[str], prompts: Sequence[str], *, max_tokens: int = 16,
                      out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Profile an mlx-lm model directory on text ``prompts`` (its own tokenizer); optionally save JSON.

    Loads the whole model (all experts) once: for models that do not fit in memory, profile a
    streaming run instead (:func:`profile_from_trace` on its RoutingTrace).
    """
    from mlx_lm.utils import load_model

    from .tokenizer import load_tokenizer

    model, config = load_model(pathlib.Path(model_dir))
    tok = load_tokenizer(model_dir, config)
    if tok is None:
        raise StoreError(model_dir, "no tokenizer files to encode the profiling prompts with")
    prof = profile_routing(model, config, [tok.encode(p) for p in prompts], max_tokens=max_tokens,
                           source=f"{len(prompts)} prompts")
    if out is not None:
        pathlib.Path(out).write_text(json.dumps(prof) + "\n", encoding="utf-8")
    return prof


def profile_from_trace(trace: Any, model_type: str, n_experts: Mapping[int, int],
                       source: str = "trace") -> dict[str, Any]:
    """A routing profile from a :class:`RoutingTrace` (e.g. of a streaming run)."""
    counts = {l: np.bincount(trace.token_ids(l).reshape(-1), minlength=n_experts[l]).tolist() for l in trace.layers}
    tokens = len(trace.token_ids(trace.layers[0])) if trace.layers else 0
    return make_profile(model_type, counts, tokens, source)


# ---------------------------------------------------------------------------------------------
# Conversion


class _LayerFeed(Mapping[int, Mapping[str, mx.array]]):
    """Lazy layer -> {segment key: stacked tensor} for ExpertStore.create, one layer at a time.

    Handing a layer over detaches its switch module from the model, so once the store has
    written it nothing keeps its tensors alive.
    """

    def __init__(self, moe: dict[int, tuple[nn.Module, str]], specs: dict[int, dict[str, Any]], progress: Any) -> None:
        self._moe = moe
        self._specs = specs
        self._progress = progress
        self.expert_bytes = 0

    def __getitem__(self, layer: int) -> Mapping[str, mx.array]:
        block, attr = self._moe[layer]
        sw = getattr(block, attr)
        if isinstance(sw, PooledSwitch):
            raise RuntimeError(f"layer {layer} was already handed to the store")
        params = dict(tree_flatten(sw.parameters()))
        keys = segment_keys(self._specs[layer])
        if sorted(params) != sorted(keys):
            raise StoreError(f"layer {layer}", f"switch tensors {sorted(params)} != expected segments {keys}")
        setattr(block, attr, PooledSwitch(SwitchSpec.from_meta(self._specs[layer]), sw.activation))
        self.expert_bytes += sum(a.nbytes for a in params.values())
        if self._progress is not None:
            self._progress(layer)
        return {k: params[k] for k in keys}

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._moe))

    def __len__(self) -> int:
        return len(self._moe)


#: the staging directory's prefix where the store is converted inside its directory (a mount point)
STAGING_INSIDE = ".asyncside-convert-"


def _mount_point(dest: pathlib.Path) -> bool:
    """Whether ``dest`` is a directory that is a mount point (a disk or volume mounted there, a
    container's bind mount): it cannot be renamed (EBUSY), nor a store built beside it renamed onto
    it, so its store is converted inside it and its contents replaced."""
    return dest.is_dir() and not dest.is_symlink() and os.path.ismount(dest)


def _entries(dest: pathlib.Path) -> list[pathlib.Path]:
    """What ``dest`` holds, less what an empty mount point holds (an ext filesystem's lost+found) and
    conversions' staging directories inside it."""
    keep = {"lost+found"} if _mount_point(dest) else set()
    return [e for e in dest.iterdir() if e.name not in keep and not e.name.startswith(STAGING_INSIDE)]


def _replace_contents(dest: pathlib.Path, new: pathlib.Path, trash: pathlib.Path) -> None:
    """Replace what ``dest`` holds with what ``new`` holds (both on one filesystem), by renames:
    the old manifest goes first and the new one comes last, so that at no moment does ``dest``
    hold a manifest beside another store's blobs."""
    trash.mkdir()
    old = sorted(_entries(dest), key=lambda e: e.name != "manifest.json")
    for e in old:
        os.rename(e, trash / e.name)
    for e in sorted(new.iterdir(), key=lambda e: e.name == "manifest.json"):
        os.rename(e, dest / e.name)


def _not_replaceable(dest: pathlib.Path, src: pathlib.Path) -> str | None:
    """Why ``overwrite`` must not replace ``dest`` (None: it may): it replaces an expert store, or
    an empty directory. Any other directory (``convert MODEL "$OUT" --overwrite`` of an unset OUT is
    the current directory) was renamed away and deleted with everything in it, the model too where
    it lay inside."""
    if not dest.exists() and not dest.is_symlink():
        return None
    if not dest.is_dir():
        return "exists and is not a directory"
    if src.resolve() == dest.resolve() or dest.resolve() in src.resolve().parents:
        return f"holds the model directory {src}; overwrite replaces an expert store only"
    if (dest / "manifest.json").is_file() or not _entries(dest):
        return None
    return ("exists and is not an expert store (no manifest.json): overwrite replaces an expert store or "
            "an empty directory only; choose another directory, or empty this one first")


#: weight files of other formats a release may hold instead (PyTorch, Mistral's own, GGUF)
_UNREAD_WEIGHTS = ("pytorch_model*.bin", "consolidated*.safetensors", "consolidated*.pth", "*.gguf")


def unread_weights_note(src: pathlib.Path) -> str:
    """What ``src`` holds instead of ``model*.safetensors`` (which mlx-lm and the converter read
    only), and the way on; "" where it holds none of those formats."""
    found = sorted({p.name for pattern in _UNREAD_WEIGHTS for p in src.glob(pattern)})
    if not found:
        return ""
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    # Said where the weights are of a format it does not read: the line named none, so a
    # directory of PyTorch .bin shards read as one without weights.
    return (f" (it has {found[0]}{more}, which mlx-lm does not read: take the model's safetensors "
            "release or an mlx-community conversion, or save it as safetensors)")


def _check_paths(src: pathlib.Path, dest: pathlib.Path, overwrite: bool) -> None:
    """StoreError naming the path at fault where ``src`` is no model directory to convert, or
    ``dest`` no place for its store, before anything is read."""
    from ..store import path_not_utf8, printable_path

    for where in (src, dest):  # MLX reads and the store is opened through UTF-8 paths only
        if (problem := path_not_utf8(where)) is not None:
            raise StoreError(printable_path(where), problem)
    if not (src / "config.json").is_file():
        raise StoreError(src / "config.json", "not an mlx-lm model directory: config.json is missing")
    if not any(src.glob("model*.safetensors")):
        raise StoreError(src, "no model*.safetensors weight files in the model directory" + unread_weights_note(src))
    for name in TOKENIZER_FILES:
        # Copied once every expert is written: a file the process may not read (another user's,
        # mode 0600) failed the conversion at its end, said as "cannot write the store" with the
        # space free, though the store had been written and the fault was the model's file.
        _readable(src / name)
    if dest.exists() and not overwrite:
        raise StoreError(dest, "already exists (pass overwrite=True to replace it)")
    if overwrite and (problem := _not_replaceable(dest, src)) is not None:
        raise StoreError(dest, problem)
    if overwrite and dest.is_dir() and not dest.is_symlink() and not os.access(dest, os.W_OK | os.X_OK):
        # Moving a directory away (or its entries, a mount point's) needs write permission on it:
        # a store made read-only (mode 0555) or another user's was refused by a PermissionError
        # traceback once the whole model had been converted, the new store thrown away.
        if _read_only_mount(dest):
            # Its mode said to chmod it, which a read-only file system refuses whatever the mode.
            raise StoreError(dest, "cannot be replaced: it is on a read-only file system (mounted read-only); "
                                   "convert into another directory")
        raise StoreError(dest, f"cannot be replaced: this process may not write to the directory "
                               f"(mode {dest.stat().st_mode & 0o7777:04o}, owner uid {dest.stat().st_uid}); "
                               "make it writable (chmod u+w) or convert into another directory")
    if dest == src:
        raise StoreError(dest, "the store directory must differ from the model directory")


def _read_only_mount(path: pathlib.Path) -> bool:
    """Whether ``path`` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_RDONLY", 1))
    except OSError:
        return False


def _readable(path: pathlib.Path) -> None:
    """StoreError naming ``path`` where it is a file this process cannot open for reading (nothing
    where it is no file)."""
    if not path.is_file():
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise StoreError(path, f"cannot read it: {os_reason(exc)}", errno=exc.errno) from None


def _staging_beside(dest: pathlib.Path) -> pathlib.Path:
    """A fresh staging directory beside ``dest`` (its parents made, an interrupted conversion's
    leftovers removed); StoreError naming the path at fault where it cannot be made."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        removed_stale_staging(dest)
        if _mount_point(dest):  # built inside it: a rename onto a mount point fails (EBUSY)
            return pathlib.Path(tempfile.mkdtemp(prefix=STAGING_INSIDE, dir=dest))
        return pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.convert-", dir=dest.parent))
    except OSError as exc:  # a file where a directory of the path should be, no permission, a full disk
        from ..argtypes import file_in_the_way

        blocker = file_in_the_way(dest.parent)
        if blocker is not None:
            raise StoreError(blocker, f"exists and is not a directory, so the store {dest} cannot be made under it",
                             errno=exc.errno) from None
        raise StoreError(dest.parent, f"cannot make the store's directory here: {exc.strerror or exc}",
                         errno=exc.errno) from None


class StoreWriteError(StoreError):
    """The store could not be written: the filesystem failed (full, a quota, an I/O error), not
    the input. Nothing of it is left behind."""


def write_failure(exc: BaseException, where: pathlib.Path, *, writing: str, partial: pathlib.Path,
                  need: str, remedy: str) -> StoreWriteError | None:
    """The StoreWriteError naming ``where`` for ``writing`` that failed on its filesystem (full, a
    quota, an I/O error): the OSError's reason, or MLX's own writer's, whose RuntimeError says only
    "Unable to write N bytes", with the space free once ``partial`` (what was written) is removed
    and ``need``, what it takes. None for an error that is no failed write. A full disk was a
    traceback before."""
    from ..memory import describe_bytes

    if isinstance(exc, OSError):
        why = os_reason(exc) if exc.errno else str(exc)
    elif str(exc).startswith(("[write]", "[save")):
        why = " ".join(str(exc).split()).rstrip(".")
    else:
        return None
    shutil.rmtree(partial, ignore_errors=True)  # what a rerun has is the space without it
    at = partial
    while not at.exists() and at.parent != at:
        at = at.parent
    try:
        st = os.statvfs(at)
        free = f"; {describe_bytes(st.f_bavail * st.f_frsize)} free there"
    except OSError:
        free = ""
    return StoreWriteError(where, f"cannot write {writing}: {why}{free}, and {need}; nothing was left behind "
                                  f"({remedy})", errno=getattr(exc, "errno", None))


def _weight_bytes(src: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in src.glob("*.safetensors") if p.is_file())


def _switch_metas(moe: Mapping[int, tuple[nn.Module, str]], paths: Mapping[int, str],
                  src: pathlib.Path) -> dict[int, dict[str, Any]]:
    """Each MoE layer's switch description; a switch the pooled path cannot compute (nvfp4 experts
    with a per-expert global scale) refused naming the config and the switch's module path."""
    specs = {}
    for l, (block, attr) in moe.items():
        try:
            specs[l] = switch_meta(getattr(block, attr))
        except UnsupportedModelError as exc:
            # The line named only the linear's attribute: not the layer, nor the file it came from.
            raise UnsupportedModelError(f"{src / 'config.json'}: {paths[l]}: {exc}") from None
    return specs


def convert_model(model_dir: str | os.PathLike[str], store_dir: str | os.PathLike[str], *,
                  profile: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                  resident_fraction: float = DEFAULT_RESIDENT_FRACTION, progress: bool = True,
                  overwrite: bool = False, alignment: int = 4096, checksum: str | None = "crc32c",
                  model_id: str | None = None) -> Any:
    """Convert an mlx-lm model directory into an expert store directory; returns the ExpertStore.

    See the module docstring for what is written. Raises StoreError naming the file/field on bad
    input (missing config.json, no safetensors, a profile that does not fit the model) and
    UnsupportedModelError for architectures without supported MoE layers.
    """
    from mlx_lm.utils import save_config

    from ..store import ExpertStore

    # "~/stores/q" is the home directory's, as load() and --model read it: not a directory named "~"
    src = pathlib.Path(model_dir).expanduser().absolute()
    dest = pathlib.Path(store_dir).expanduser().absolute()
    _check_paths(src, dest, overwrite)
    if not 0.0 <= float(resident_fraction) <= 1.0:
        raise ValueError(f"resident_fraction must be in [0, 1], got {resident_fraction!r}")
    prof = load_profile(profile) if profile is not None else None
    # The file a profile that does not fit the model came from (its refusals named "<profile>").
    prof_where = "<profile>" if profile is None or isinstance(profile, Mapping) else str(profile)

    raw, arch = model_config(src)
    model, config = _load_lazily(src, raw)
    moe = _moe_layers_of(model, arch, src, raw)
    paths = {l: _module_path(model, getattr(block, attr)) for l, (block, attr) in moe.items()}
    specs = _switch_metas(moe, paths, src)
    n_experts = {l: _n_experts(getattr(block, attr)) for l, (block, attr) in moe.items()}
    if prof is not None:
        if prof.get("model_type") not in (None, config["model_type"]):
            raise StoreError(prof_where, f"profile is for {prof['model_type']!r}, model is {config['model_type']!r}",
                             "model_type")
        for l, c in prof["layers"].items():
            if int(l) not in moe:
                raise StoreError(prof_where, f"layer {l} is not an MoE layer of the model (MoE layers: {sorted(moe)})",
                                 "layers")
            if len(c) != n_experts[int(l)]:
                raise StoreError(prof_where,
                                 f"layer {l} has {len(c)} counts, the model has {n_experts[int(l)]} experts",
                                 f"layers.{l}")
    ranks = {l: rank_experts(prof["layers"].get(str(l)) if prof else None, n) for l, n in n_experts.items()}
    # The router's top-k per layer: the runtime's least pool rows follow it (runtime._plan.min_rows).
    top_k = {}
    for l, (block, _attr) in moe.items():
        where = top_k_attribute(block)
        if where is not None:
            top_k[str(l)] = int(getattr(*where))
            if not 1 <= top_k[str(l)] <= n_experts[l]:
                # mlx-lm's model builds either way: more than it has failed at the first token in
                # MLX's argpartition words, none in a queued step's fault of every expert.
                raise StoreError(src / "config.json", f"layer {l} routes each token to {top_k[str(l)]} of its "
                                                      f"{n_experts[l]} experts; expected 1 to {n_experts[l]}",
                                 _top_k_field(raw))
    check_routers(model, arch, moe, {l: SwitchSpec.from_meta(m) for l, m in specs.items()}, n_experts, raw,
                  src / "config.json")
    resident = {l: r[: int(round(resident_fraction * len(r)))] for l, r in ranks.items()}
    meta = {
        "version": 1,
        "model_type": config["model_type"],
        "model_id": model_id or _default_model_id(src),
        "source": str(src),
        # Taken before a weight is read: a file changed while converting reads as changed later.
        "source_files": source_files(src),
        "switch": {str(l): s for l, s in specs.items()},
        "switch_paths": {str(l): p for l, p in paths.items()},
        "expert_rank": {str(l): r for l, r in ranks.items()},
        "top_k": top_k,
        "resident_fraction": float(resident_fraction),
        "resident": {str(l): r for l, r in resident.items()},
        "profile": None if prof is None else {"tokens": prof.get("tokens"), "source": prof.get("source", "")},
        "resident_default": _resident_default(prof, list(n_experts)),
        "non_expert_file": NON_EXPERT_FILE,
    }

    staging = _staging_beside(dest)
    # Held for the whole conversion: the next convert beside it tells a live staging directory
    # (locked) from an interrupted one's (the lock died with its process) and removes only those.
    # Locked before it gets its name, so a lock file that can be taken is always a dead one's; it
    # names this process for filesystems that take no locks (there flock's error was a traceback).
    owner = open(staging / (STAGING_LOCK + ".new"), "a+")  # closed in the finally below
    try:
        try_lock(owner, wait=True)
        owner.write(owner_line())
        owner.flush()
        os.rename(staging / (STAGING_LOCK + ".new"), staging / STAGING_LOCK)
    except BaseException:
        owner.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        tmp_store = staging / "store"
        try:
            with _progress(progress, len(moe), src.name) as advance:
                feed = _LayerFeed(moe, specs, advance)
                ExpertStore.create(tmp_store, feed, alignment=alignment, checksum=checksum,
                                   metadata={META_KEY: meta})
                advance(None)
            non_expert = dict(tree_flatten(model.parameters()))
            mx.save_safetensors(str(tmp_store / NON_EXPERT_FILE), non_expert, metadata={"format": "mlx"})
            save_config(dict(config), tmp_store / "config.json")
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp_store / name)
            _write_summary(tmp_store, feed.expert_bytes, sum(a.nbytes for a in non_expert.values()))
        except (OSError, RuntimeError) as exc:
            from ..memory import describe_bytes

            need = f"the store takes about the model's weight files ({describe_bytes(_weight_bytes(src))}) or more"
            failed = write_failure(exc, dest, writing="the store", partial=tmp_store, need=need,
                                   remedy="free space there, or convert into another filesystem")
            if failed is None:
                raise
            raise failed from None
        if staging.parent == dest:
            # A mount point (a disk, a container's volume) cannot be renamed: renaming it away was
            # "OSError: [Errno 16] Device or resource busy" and a traceback, whatever it held.
            _replace_contents(dest, tmp_store, staging / "old")
        else:
            _publish(tmp_store, dest, src, staging, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        owner.close()
    return ExpertStore.open(dest)


def _top_k_field(raw: Mapping[str, Any]) -> str | None:
    """The name of the experts-per-token field of the config ``raw`` (its text_config's where it
    nests one), None where it has none of the names mlx-lm's models read."""
    for cfg, prefix in ((raw, ""), (raw.get("text_config"), "text_config.")):
        if isinstance(cfg, Mapping):
            for name in ("num_experts_per_tok", "moe_top_k", "top_k", "moe_k", "num_experts_per_token"):
                if name in cfg:
                    return prefix + name
    return None


def model_config(src: pathlib.Path) -> tuple[dict[str, Any], Arch]:
    """The config.json of the model directory ``src`` and the architecture asyncside streams it
    as; a StoreError (UnsupportedModelError) naming the file and field where it is neither."""
    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(src / "config.json", f"not a readable JSON config: {exc}") from None
    except RecursionError:  # json parses nesting by recursion: a file nested past Python's limit
        raise StoreError(src / "config.json", "not a JSON config this reader takes: nested too deeply") from None
    if not isinstance(raw, dict):
        raise StoreError(src / "config.json", f"a model config is a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        # Refused as "model_type '' is not supported", naming neither the file nor the field missing.
        named = raw.get("architectures")
        raise StoreError(src / "config.json", "has no \"model_type\", by which mlx-lm picks the architecture "
                                              "(e.g. \"qwen3_moe\")" + (f"; its architectures are {json.dumps(named)}"
                                                                       if named else ""), "model_type")
    try:
        arch = arch_for(model_type)  # one asyncside cannot stream: refused before mlx-lm builds it
    except UnsupportedModelError as exc:
        # The line named no file: demo --model DIR and load() convert a directory the user may
        # not know is a dense model's.
        raise UnsupportedModelError(f"{src / 'config.json'}: {exc}") from None
    return raw, arch


def _publish(store: pathlib.Path, dest: pathlib.Path, src: pathlib.Path, staging: pathlib.Path,
             overwrite: bool) -> None:
    """Rename the finished ``store`` to ``dest``, the store there (``overwrite``) moved into
    ``staging`` first. Another conversion to ``dest`` may have published its store since this one
    began (two ``convert`` commands at once, or where the filesystem takes no locks): without
    ``overwrite`` that is a StoreError, with it that store is replaced."""
    for attempt in range(16):
        try:
            os.rename(store, dest)
            return
        except OSError as exc:
            # The rename onto a directory that holds something ("Directory not empty" and a
            # traceback where another conversion got there between the check and the rename), or
            # onto a link to one (the store --overwrite replaces by a link's name).
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        if not overwrite:
            raise StoreError(dest, "already exists: another conversion made it while this one ran (pass "
                                   "overwrite=True to replace it)")
        if (problem := _not_replaceable(dest, src)) is not None:
            raise StoreError(dest, problem)
        try:
            os.rename(dest, staging / f"old-{attempt}")
        except FileNotFoundError:
            continue  # another conversion moved it away first
        except OSError as exc:
            # Not ours to move (a sticky directory such as /tmp and another user's store; made
            # read-only since the check): a traceback after the whole conversion.
            raise StoreError(dest, f"cannot be replaced: {os_reason(exc)}; "
                                   "convert into another directory", errno=exc.errno) from None
    raise StoreError(dest, "other conversions to this directory kept replacing it; convert again")


def _default_model_id(src: pathlib.Path) -> str:
    """The name a store converted from ``src`` serves its model by: the repo id of a Hugging Face
    cache snapshot (``.../models--org--name/snapshots/<commit>``, the path ``hf download`` prints),
    else the directory's name."""
    repo = src.parent.parent.name
    if src.parent.name == "snapshots" and repo.startswith("models--") and "--" in repo[len("models--"):]:
        # The snapshot's own name is a commit hash: served under it, a client asking for the
        # model by its repo id was told the model does not exist.
        return repo[len("models--"):].replace("--", "/", 1)
    return src.name


def _load_lazily(src: pathlib.Path, raw: Mapping[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-lm's lazily loaded model of ``src`` and its config; a StoreError naming config.json, or
    the weight file at fault, where mlx-lm cannot build it."""
    from mlx_lm.utils import load_model

    per_file = _weight_files(src)
    try:
        model, config = load_model(src, lazy=True)
    except (TypeError, ValueError, KeyError) as exc:  # mlx-lm's ModelArgs on a config it cannot take
        text = " ".join(str(exc).split())
        if _about_weights(exc, set().union(*per_file.values())):
            fault = _index_fault(src, per_file) or _per_expert_fault(src, per_file)
            if fault is not None:
                raise fault from None
            tensors = set().union(*per_file.values())
            scales = sorted(n for n in tensors if n.endswith(".scales"))
            if scales and "quantization" not in raw and "quantization_config" not in raw:
                raise StoreError(src / "config.json",
                                 f"has no quantization, but the weight files hold quantized tensors (e.g. "
                                 f"{scales[0]!r}): give the quantization the checkpoint was made with "
                                 "(e.g. \"quantization\": {\"group_size\": 64, \"bits\": 4})", "quantization") from None
            want = f"mlx-lm's {raw.get('model_type')!r} model of config.json"
            raise StoreError(src / "model*.safetensors",
                             f"no weight file holds tensor {exc.args[0]!r}, which {want} needs"
                             if isinstance(exc, KeyError) else
                             f"the weight files do not match {want}: {text}") from None
        uneven = _per_expert_fault(src, per_file) if text.startswith(("[stack]", "[concatenate]")) else None
        if uneven is not None:
            # mlx-lm's sanitize stacks an original release's per-expert tensors: one of another
            # shape was "[stack] All arrays must have the same shape", blamed on config.json.
            raise uneven from None
        raise StoreError(src / "config.json", f"mlx-lm cannot build a {raw.get('model_type')!r} model from it: "
                                              f"{type(exc).__name__}: {text}") from None
    return model, config


#: a per-expert tensor of an original release: (what holds the experts, expert id, the rest)
_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(.+)$")


def _per_expert_fault(src: pathlib.Path, per_file: Mapping[str, set[str]]) -> StoreError | None:
    """Where an original release's per-expert tensors (``...experts.3.up_proj.weight``) leave
    mlx-lm's sanitize unable to stack a layer's experts: one missing while experts after it are
    there (sanitize then leaves the whole layer unstacked, and mlx-lm's error lists every tensor
    but the missing one), or one of another shape than the same tensor of the layer's other
    experts. A StoreError naming the tensor, or None."""
    groups: dict[tuple[str, str], list[tuple[int, str, str, list[int]]]] = {}
    for file in per_file:
        with open(src / file, "rb") as fh:  # its header was checked by _safetensors_names
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, entry in header.items():
            m = _PER_EXPERT.match(name)
            if m is not None and isinstance(entry, dict):
                groups.setdefault((m[1], m[3]), []).append((int(m[2]), name, file, list(entry.get("shape", []))))
    for (where, what), tensors in sorted(groups.items()):
        ids = {t[0] for t in tensors}
        missing = [e for e in range(max(ids)) if e not in ids]
        if missing:
            return StoreError(src / "model*.safetensors",
                              f"no weight file holds tensor {f'{where}.{missing[0]}.{what}'!r}, though the "
                              f"{what} of {len(ids)} other experts of {where} (up to expert {max(ids)}) are there"
                              + (f"; {len(missing)} experts lack it" if len(missing) > 1 else ""))
        shapes = [tuple(t[3]) for t in tensors]
        common = max(set(shapes), key=shapes.count)
        for _e, name, file, shape in sorted(tensors):
            if tuple(shape) != common:
                return StoreError(src / file, f"tensor {name!r} has shape {shape}, where the other experts' {what} "
                                              f"of {where} have {list(common)}: the checkpoint is damaged or mixes "
                                              "two models' files")
    return None


def _moe_layers_of(model: nn.Module, arch: Arch, src: pathlib.Path,
                   raw: Mapping[str, Any]) -> dict[int, tuple[nn.Module, str]]:
    """The model's MoE layers (:func:`moe_layers`); a StoreError naming config.json and its layer
    fields where they leave none."""
    try:
        return moe_layers(model, arch)
    except UnsupportedModelError as exc:
        blocks = [getattr(layer, arch.block_attr, None) for layer in decoder_layers(model)]
        if all(b is not None and find_switch(b) is None for b in blocks):
            # A multimodal wrapper's text model keeps its layer fields in text_config (they read None).
            text = raw.get("text_config")
            raw = text if isinstance(text, Mapping) and "num_hidden_layers" in text else raw
            given = [f"{f} {json.dumps(raw[f])}" for f in _MOE_LAYER_FIELDS if f in raw]
            raise StoreError(src / "config.json",
                             f"no MoE layer among its num_hidden_layers {raw.get('num_hidden_layers')}"
                             + (f" (its {', '.join(given)})" if given else "")
                             + ": asyncside streams the experts of MoE layers, a dense model has none") from None
        raise exc


#: config.json fields that say which decoder layers are MoE layers
_MOE_LAYER_FIELDS = ("moe_layers", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
                     "mlp_only_layers")


#: the index a sharded checkpoint lists its tensors' shards in
SHARD_INDEX = "model.safetensors.index.json"


#: how a Git LFS pointer file (a clone without its large files) begins
_LFS_POINTER = b"version https://git-lfs"


def _safetensors_names(path: pathlib.Path) -> set[str]:
    """The tensor names in a safetensors file's header, after checking that the header parses and
    every tensor's bytes lie inside the file (so mlx-lm's loader never meets a cut-short file)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        if not path.is_symlink():
            raise
        # A Hugging Face snapshot's files are links to its blobs: with a blob gone the file is
        # listed, and "[Errno 2] No such file or directory" named a file the user could see.
        raise StoreError(path, f"is a link to {os.readlink(path)}, which does not exist (a Hugging Face cache "
                               "whose blobs were removed, or a download cut short): fetch the model again") from None
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(_LFS_POINTER))
    except OSError as exc:  # another user's file (mode 0600), a disk error: a PermissionError traceback
        raise StoreError(path, f"cannot read it: {os_reason(exc)}", errno=exc.errno) from None
    if head == _LFS_POINTER:
        raise StoreError(path, "is a Git LFS pointer, not the weights: fetch them (git lfs pull) and convert again")
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"its header length {n} exceeds the file's {size} bytes")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        names = set()
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            end = int(entry["data_offsets"][1])
            if end > size - 8 - n:
                raise ValueError(f"tensor {name!r} ends at byte {end} of a data section of {size - 8 - n}")
            names.add(name)
    except OSError as exc:
        raise StoreError(path, f"cannot read it: {os_reason(exc)}", errno=exc.errno) from None
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise StoreError(path, "not a complete safetensors file (an incomplete download, or another file "
                               f"named model*.safetensors?): {exc}") from None
    return names


def _weight_files(src: pathlib.Path) -> dict[str, set[str]]:
    """File name -> tensor names of ``src``'s ``model*.safetensors`` (the files mlx-lm loads), each
    file's header checked."""
    return {p.name: _safetensors_names(p) for p in sorted(src.glob("model*.safetensors"))}


def _index_fault(src: pathlib.Path, per_file: Mapping[str, set[str]]) -> StoreError | None:
    """Where loading failed on the weights: the shard :data:`SHARD_INDEX` blames (one it names that
    is missing, or one without a tensor its ``weight_map`` places there), if any. mlx-lm's loader
    ignores the index, so it only explains a failure: a stale index beside complete files loads."""
    try:
        index = json.loads((src / SHARD_INDEX).read_text())
        weight_map = index["weight_map"] if isinstance(index, dict) else None
    except (OSError, ValueError, KeyError, RecursionError):
        return None
    if not isinstance(weight_map, dict):
        return None
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            continue
        if shard not in per_file:
            listed = sum(1 for v in weight_map.values() if v == shard)
            return StoreError(src / shard, f"is missing: {SHARD_INDEX}'s weight_map places {listed} tensors "
                                           f"in it (e.g. {name!r})")
        if name not in per_file[shard]:
            return StoreError(src / shard, f"lacks tensor {name!r}, which {SHARD_INDEX}'s weight_map places in it")
    return None


def _about_weights(exc: BaseException, tensors: set[str]) -> bool:
    """Whether mlx-lm's loader failed on the weight files rather than on config.json: a tensor it
    looked up that no file holds, or its strict load's parameter mismatch."""
    if isinstance(exc, KeyError):
        key = exc.args[0] if exc.args else None
        return isinstance(key, str) and "." in key and key not in tensors
    text = str(exc)
    return "parameters not in model" in text or "Missing" in text and "parameters" in text


#: flock's errors on a filesystem that takes no locks (Lustre mounted without its flock option,
#: some network and FUSE filesystems): builds and conversions there go on unlocked, and each is
#: published by a rename that a concurrent one's cannot spoil
NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
#: the file in an embedded model's or bench shape's build directory that names the process building it
OWNER_FILE = ".owner"


def try_lock(fh: IO[Any], *, wait: bool) -> bool | None:
    """Take an exclusive flock on ``fh``: True once taken, False where another process holds it
    (``wait`` False only), None where its filesystem takes no locks (:data:`NO_LOCKS`)."""
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in NO_LOCKS:
            return None
        raise
    return True


def _this_host() -> str:
    # The pid namespace too: containers sharing a host name (and a cache) number their processes apart.
    try:
        space = os.readlink("/proc/self/ns/pid")
    except OSError:
        space = ""
    return f"{socket.gethostname()}/{space}".replace(" ", "_")


def owner_line() -> str:
    """What an owner file says of the process that writes it: its host and pid."""
    return f"{_this_host()} {os.getpid()}\n"


def owner_gone(path: pathlib.Path) -> bool:
    """Whether the owner file at ``path`` (:func:`owner_line`) names a process of this host that no
    longer runs: how a leftover is told from a live build where the filesystem takes no locks.
    False where it cannot tell (no such file, another host's process, one that still runs)."""
    try:
        host, pid = path.read_text(encoding="utf-8").split()
        number = int(pid)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    if host != _this_host() or number <= 0:
        return False
    try:
        os.kill(number, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process, alive
        return False
    return False


#: a lock file each staging directory holds while its conversion runs
STAGING_LOCK = ".owner.lock"
#: a staging directory without a lock file is a leftover once this old
STAGING_GRACE_S = 60.0


def removed_stale_staging(dest: str | os.PathLike[str]) -> list[pathlib.Path]:
    """Remove the staging directories (``.<name>.convert-*`` beside ``dest``) of conversions that
    were interrupted (killed, machine lost power); returns those removed.

    A conversion in progress holds its staging directory's lock file (taken before the file got
    its name), so it is left alone; on a filesystem that takes no locks, the file names the
    process converting, and is a leftover once that process of this host is gone. A staging
    directory without a lock file (a conversion starting this instant, or one from before lock
    files) is removed only once a minute old.
    """
    dest = pathlib.Path(dest).absolute()
    removed = []
    inside = sorted(dest.glob(f"{STAGING_INSIDE}*")) if dest.is_dir() else []  # a mount point's
    for d in [*sorted(dest.parent.glob(f".{dest.name}.convert-*")), *inside]:
        try:
            if not d.is_dir() or d.is_symlink():
                continue
            if not (d / STAGING_LOCK).is_file():
                if time.time() - d.stat().st_mtime < STAGING_GRACE_S:
                    continue
                shutil.rmtree(d, ignore_errors=True)
            else:
                with open(d / STAGING_LOCK, "a+") as fh:
                    taken = try_lock(fh, wait=False)
                    if taken is False or (taken is None and not owner_gone(d / STAGING_LOCK)):
                        continue  # a live conversion
                    shutil.rmtree(d, ignore_errors=True)
        except FileNotFoundError:  # its conversion finished meanwhile
            continue
        removed.append(d)
    return removed


def _write_summary(directory: pathlib.Path, expert_bytes: int, non_expert_bytes: int) -> None:
    total = expert_bytes + non_expert_bytes
    summary = {
        "expert_bytes": expert_bytes,
        "non_expert_bytes": non_expert_bytes,
        "expert_share": expert_bytes / total if total else 0.0,
    }
    (directory / "asyncside_summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")


class _progress:
    """Context manager yielding ``advance(layer | None)``; a rich progress bar when enabled."""

    def __init__(self, enabled: bool, total: int, name: str) -> None:
        self.enabled = enabled
        self.total = total
        self.name = name
        self._bar: Progress | None = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return lambda layer: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # On stderr: stdout may be a command's --json output (a first `bench` run converts the
        # embedded model before it measures).
        self._bar = Progress(TextColumn("[bold]convert[/] {task.description}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(), transient=False,
                             console=Console(stderr=True))
        self._bar.start()
        task = self._bar.add_task(f"{self.name}: experts", total=self.total)
        started = [0]

        def advance(layer: int | None) -> None:
            assert self._bar is not None
            if layer is None:
                self._bar.update(task, completed=self.total, description=f"{self.name}: experts written")
                return
            self._bar.update(task, completed=started[0], description=f"{self.name}: layer {layer}")
            started[0] += 1

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()


def _n_experts(switch: nn.Module) -> int:
    lin = switch.gate_proj if hasattr(switch, "gate_proj") else switch.fc1
    return int(lin["weight"].shape[0])


#: a Hugging Face cache's blob name: the file's etag (a git blob's sha1, an LFS file's sha256)
_HUB_BLOB = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?$")


def _hub_blob(path: pathlib.Path) -> str | None:
    """The blob name a Hugging Face snapshot's file links to (``../../blobs/<etag>``), or None: a
    name that changes with the file's content, which its modification time does not say (the same
    snapshot downloaded on another machine has its own)."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    where = pathlib.PurePath(target)
    return where.name if where.parent.name == "blobs" and _HUB_BLOB.match(where.name) else None


def source_files(src: str | os.PathLike[str]) -> dict[str, list[int | str]]:
    """What a store converted from the model directory ``src`` depends on, by file name: its
    ``config.json``, weight files (``*.safetensors`` and their index) and tokenizer files, each as
    its size and modification time (ns), and for a Hugging Face snapshot's file the blob it links
    to. Recorded in the store (``source_files``) when it is converted, so a directory whose model
    changed since (a model saved again into it) is told from the one converted
    (:func:`source_changed`)."""
    base = pathlib.Path(src)
    names = {"config.json", "model.safetensors.index.json", *TOKENIZER_FILES}
    names.update(p.name for p in base.glob("*.safetensors"))
    found: dict[str, list[int | str]] = {}
    for name in sorted(names):
        try:
            st = (base / name).stat()  # a Hugging Face snapshot's links: the blob's
        except OSError:
            continue
        blob = _hub_blob(base / name)
        found[name] = [int(st.st_size), int(st.st_mtime_ns), *([blob] if blob is not None else [])]
    return found


def _same_file(recorded: Any, now: list[int | str]) -> bool:
    """Whether a file recorded by :func:`source_files` is the one there now: of the same size and
    time, or linked to the same Hugging Face blob (a snapshot downloaded again, as another machine
    sharing the cache has it, is of its own time)."""
    recorded = list(recorded) if isinstance(recorded, list) else []
    if recorded == now:
        return True
    return len(recorded) == 3 and len(now) == 3 and recorded[0] == now[0] and recorded[2] == now[2]


def source_changed(store: Any, src: str | os.PathLike[str]) -> str | None:
    """What changed in the model directory ``src`` since ``store`` (an ExpertStore) was converted
    from it (a file added, gone, or of another size or time, or linked to another Hugging Face
    blob), or None where nothing did, or the store does not say (converted before stores recorded
    their source files)."""
    meta = store.metadata.get(META_KEY)
    recorded = meta.get("source_files") if isinstance(meta, dict) else None
    if not isinstance(recorded, dict):
        return None
    now = source_files(src)
    for name in sorted(set(recorded) | set(now)):
        if name not in now:
            return f"{name} is gone"
        if name not in recorded:
            return f"{name} was added"
        if not _same_file(recorded[name], now[name]):
            return f"{name} changed"
    return None


def resident_sets(store: Any, fraction: float | None = None) -> dict[int, list[int]]:
    """Per layer, the resident experts of a converted store: the recorded set, or the first
    ``round(fraction * n_experts)`` of the stored hottest-first ranking."""
    meta = store.metadata.get(META_KEY)
    if not isinstance(meta, dict):
        raise StoreError(store.path, "store was not written by the asyncside converter", f"metadata.{META_KEY}")
    if fraction is None:
        return {int(l): list(v) for l, v in meta["resident"].items()}
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    return {int(l): list(r[: int(round(fraction * len(r)))]) for l, r in meta["expert_rank"].items()}
