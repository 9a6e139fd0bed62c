"""The on-disk expert store: a directory with ``manifest.json`` and one blob file per layer.

Record ``e`` of a layer lives at byte offset ``e * stride`` of that layer's blob and holds the
expert's segments (one per pool key) at fixed offsets. The exact format is in
``docs/store-format.md``; this module writes it (:meth:`ExpertStore.create`), validates it
(:meth:`ExpertStore.open`) and reads it synchronously (:meth:`ExpertStore.read_expert`, the
ground truth every faster read path is compared against).

MLX is imported lazily (only to build arrays in :meth:`ExpertStore.read_expert` or to accept
MLX inputs in :meth:`ExpertStore.create`) so that ``import asyncside`` stays cheap.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import stat as _stat
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import StoreError, os_reason

FORMAT_NAME = "asyncside-expert-store"
#: Version written. Version 1 (CRC-32 checksums only) is still read.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
DEFAULT_ALIGNMENT = 4096
#: Every segment offset inside a record is a multiple of this (documented in store-format.md).
SEGMENT_ALIGNMENT = 64
#: Largest manifest ``open()`` will parse; a hostile manifest must not exhaust memory.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
#: Every byte count/offset in a store must stay below this, so ``e * stride + offset`` fits an
#: off_t (int64) in the native readers without overflow.
MAX_BYTES = 2**62
#: Largest alignment accepted (1 GiB); alignments are powers of two.
MAX_ALIGNMENT = 2**30
CHECKSUM_ALGORITHMS = ("crc32c", "crc32")
#: The algorithms each format version allows.
_VERSION_CHECKSUMS = {1: ("crc32",), 2: ("crc32c", "crc32")}
DEFAULT_CHECKSUM = "crc32c"
VERIFY_MODES = ("size", "full")

#: MLX dtype name -> item size in bytes. Records are little-endian.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
}

#: numpy dtype used to view a segment's bytes (bfloat16 has no numpy dtype: raw uint16).
_NUMPY_VIEW: dict[str, str] = {name: name for name in DTYPE_SIZES}
_NUMPY_VIEW["bfloat16"] = "uint16"


@dataclass(frozen=True)
class Segment:
    """One pool key's bytes inside an expert record."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        """Byte offset just past this segment inside the record."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class LayerSpec:
    """Everything a reader needs to fetch records of one layer."""

    index: int
    path: pathlib.Path
    n_experts: int
    stride: int
    alignment: int
    segments: tuple[Segment, ...]
    checksum: str | None
    checksums: tuple[int, ...] | None

    @property
    def blob_bytes(self) -> int:
        """Exact size of the blob file: ``n_experts * stride``."""
        return self.n_experts * self.stride

    def segment(self, key: str) -> Segment:
        """The segment named ``key`` (KeyError if the layer has none)."""
        for seg in self.segments:
            if seg.key == key:
                return seg
        raise KeyError(f"layer {self.index} has no segment {key!r}; keys: {[s.key for s in self.segments]}")

    def record_offset(self, expert: int) -> int:
        """Byte offset of ``expert``'s record in the blob."""
        return expert * self.stride


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def segments_checksum(algorithm: str, parts: Iterator[Any] | list[Any]) -> int:
    """Checksum of a record: ``algorithm`` over the segment bytes in table order (padding excluded).

    Defined over the segments, not the padded record, so a read path that scatters segments
    straight into pool rows can verify them without reassembling the record. ``crc32`` is
    zlib's CRC-32, ``crc32c`` the Castagnoli CRC (computed natively, hardware-accelerated).
    """
    if algorithm == "crc32":
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return crc & 0xFFFFFFFF
    if algorithm == "crc32c":
        from . import _native  # lazy: `import asyncside` stays cheap

        crc = 0
        for part in parts:
            crc = _native.checksum("crc32c", part, crc)
        return crc
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {CHECKSUM_ALGORITHMS}")


# --------------------------------------------------------------------------------------------
# Input conversion (create)


def _mx_dtype_name(dtype: Any) -> str:
    name = str(dtype)
    return name.rsplit(".", 1)[-1]


def _as_numpy_bytes_view(arr: Any, where: str) -> tuple[np.ndarray, str]:
    """Return (C-contiguous little-endian numpy array, MLX dtype name) for numpy or mx input.

    bfloat16 MLX arrays come back as a uint16 numpy array with dtype name ``"bfloat16"``.
    """
    if type(arr).__module__.startswith("mlx"):
        import mlx.core as mx  # lazy: only when the caller hands us MLX arrays

        name = _mx_dtype_name(arr.dtype)
        if name not in DTYPE_SIZES:
            raise StoreError(where, f"unsupported MLX dtype {name!r}; supported: {sorted(DTYPE_SIZES)}")
        if name == "bfloat16":
            arr = arr.view(mx.uint16)
        out = np.array(arr, copy=True)
        return np.ascontiguousarray(out), name
    if not isinstance(arr, np.ndarray):
        raise StoreError(where, f"expected a numpy or mlx array, got {type(arr).__name__}")
    name = "bool" if arr.dtype == np.bool_ else arr.dtype.name
    if name == "bfloat16" and arr.dtype.itemsize == 2:  # e.g. ml_dtypes.bfloat16: keep the raw bits
        return np.ascontiguousarray(arr).view(np.uint16), name
    if name not in DTYPE_SIZES or arr.dtype.kind not in "biufc":
        raise StoreError(where, f"unsupported numpy dtype {arr.dtype}; supported: {sorted(DTYPE_SIZES)}")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr), name


def _check_alignment(value: Any, where: object, field: str) -> int:
    if not _is_int(value) or value <= 0 or value > MAX_ALIGNMENT or value & (value - 1):
        raise StoreError(where, f"alignment must be a power of two in [1, {MAX_ALIGNMENT}], got {value!r}", field)
    return int(value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _hold_build(path: pathlib.Path) -> int | None:
    """A descriptor of the directory ``path`` that holds an exclusive flock on it while a store is
    built there (closing it lets go); None where the filesystem takes no locks."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: no build is told dead, none removed
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_dead_builds(dest: pathlib.Path) -> None:
    """Remove what builds of ``dest`` that were killed left beside it (``.NAME.tmp-*``, the store
    half written, and ``.NAME.old-*``, a store being replaced): the directories whose lock no
    process holds. A killed build's directory, hidden and as large as the store, stayed forever,
    and on a disk sized for the store the next build ran out of space."""
    import glob

    try:
        import fcntl
    except ImportError:
        return
    for pattern in (f".{glob.escape(dest.name)}.tmp-*", f".{glob.escape(dest.name)}.old-*"):
        for left in dest.parent.glob(pattern):
            try:
                fd = os.open(left, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
            except OSError:  # not a directory, a link, or gone: none of a build's
                continue
            try:
                # A live build holds it; where the filesystem takes no locks, none is told dead.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                shutil.rmtree(left, ignore_errors=True)
            finally:
                os.close(fd)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Manifest validation (open)


class _Validator:
    """Reads typed fields out of the parsed manifest, raising StoreError(path, field) on anything off."""

    def __init__(self, manifest_path: pathlib.Path) -> None:
        self.path = manifest_path

    def fail(self, field: str | None, message: str) -> StoreError:
        return StoreError(self.path, message, field)

    def get(self, obj: Mapping[str, Any], key: str, field: str) -> Any:
        if key not in obj:
            raise self.fail(field, f"missing field {key!r}")
        return obj[key]

    def int_in(self, value: Any, field: str, lo: int, hi: int) -> int:
        if not _is_int(value):
            raise self.fail(field, f"expected an integer, got {value!r}")
        if not lo <= value <= hi:
            raise self.fail(field, f"value {value} out of range [{lo}, {hi}]")
        return int(value)

    def string(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(field, f"expected a non-empty string, got {value!r}")
        return value


def _safe_blob_path(root: pathlib.Path, name: str, v: _Validator, field: str) -> pathlib.Path:
    """Resolve a blob file name, refusing anything that is not a plain file name inside ``root``."""
    if (
        "/" in name
        or "\\" in name
        or "\x00" in name
        or name in (".", "..")
        or os.path.isabs(name)
        or name == MANIFEST_NAME
        or len(name) > 255
    ):
        raise v.fail(field, f"blob file name {name!r} must be a plain file name inside the store directory")
    try:
        candidate = (root / name).resolve()
    except (OSError, RuntimeError) as exc:  # a link to itself: Python's "Symlink loop" RuntimeError
        raise v.fail(field, f"blob file name {name!r} cannot be resolved: {exc}") from None
    if candidate.parent != root.resolve():
        raise v.fail(field, f"blob file name {name!r} resolves outside the store directory ({candidate})")
    return candidate


def _blob_stat(path: pathlib.Path, field: str) -> os.stat_result:
    """``os.stat`` of a blob; StoreError naming it and ``field`` where it is missing or cannot be looked at."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise StoreError(path, "blob file is missing", field) from None
    except OSError as exc:  # a directory the process may not search, a disk error: a bare traceback
        raise StoreError(path, f"cannot look at the blob: {os_reason(exc)}", field,
                         errno=exc.errno) from None


def _parse_layer(
    root: pathlib.Path, raw: Any, i: int, v: _Validator, version: int = FORMAT_VERSION
) -> LayerSpec:
    f = f"layers[{i}]"
    if not isinstance(raw, dict):
        raise v.fail(f, f"expected an object, got {type(raw).__name__}")
    index = v.int_in(v.get(raw, "index", f"{f}.index"), f"{f}.index", 0, 2**31 - 1)
    name = v.string(v.get(raw, "file", f"{f}.file"), f"{f}.file")
    path = _safe_blob_path(root, name, v, f"{f}.file")
    n_experts = v.int_in(v.get(raw, "n_experts", f"{f}.n_experts"), f"{f}.n_experts", 1, 2**31 - 1)
    alignment = v.get(raw, "alignment", f"{f}.alignment")
    alignment = _check_alignment(alignment, str(v.path), f"{f}.alignment")
    stride = v.int_in(v.get(raw, "stride", f"{f}.stride"), f"{f}.stride", 1, MAX_BYTES)
    if stride % alignment:
        raise v.fail(f"{f}.stride", f"stride {stride} is not a multiple of alignment {alignment}")
    if n_experts * stride > MAX_BYTES:
        raise v.fail(f"{f}.stride", f"n_experts * stride = {n_experts} * {stride} exceeds {MAX_BYTES} bytes")

    raw_segments = v.get(raw, "segments", f"{f}.segments")
    if not isinstance(raw_segments, list) or not raw_segments:
        raise v.fail(f"{f}.segments", f"expected a non-empty list, got {raw_segments!r:.80}")
    segments: list[Segment] = []
    keys: set[str] = set()
    prev_end = 0
    for j, rs in enumerate(raw_segments):
        sf = f"{f}.segments[{j}]"
        if not isinstance(rs, dict):
            raise v.fail(sf, f"expected an object, got {type(rs).__name__}")
        key = v.string(v.get(rs, "key", f"{sf}.key"), f"{sf}.key")
        if key in keys:
            raise v.fail(f"{sf}.key", f"duplicate segment key {key!r}")
        keys.add(key)
        dtype = v.get(rs, "dtype", f"{sf}.dtype")
        if dtype not in DTYPE_SIZES:
            raise v.fail(f"{sf}.dtype", f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
        raw_shape = v.get(rs, "shape", f"{sf}.shape")
        if not isinstance(raw_shape, list) or len(raw_shape) > 32:
            raise v.fail(f"{sf}.shape", f"expected a list of at most 32 dimensions, got {raw_shape!r:.80}")
        shape = tuple(v.int_in(d, f"{sf}.shape[{k}]", 1, MAX_BYTES) for k, d in enumerate(raw_shape))
        offset = v.int_in(v.get(rs, "offset", f"{sf}.offset"), f"{sf}.offset", 0, MAX_BYTES)
        nbytes = v.int_in(v.get(rs, "nbytes", f"{sf}.nbytes"), f"{sf}.nbytes", 1, MAX_BYTES)
        expected = math.prod(shape) * DTYPE_SIZES[dtype]  # Python ints: no overflow
        if nbytes != expected:
            raise v.fail(
                f"{sf}.nbytes", f"nbytes {nbytes} != prod(shape {list(shape)}) * itemsize({dtype}) = {expected}"
            )
        if offset < prev_end:
            raise v.fail(
                f"{sf}.offset",
                f"segment {key!r} at offset {offset} overlaps the previous segment (which ends at {prev_end}); "
                "segments must be in increasing, non-overlapping offset order",
            )
        if offset + nbytes > stride:
            raise v.fail(f"{sf}.offset", f"segment {key!r} [{offset}, {offset + nbytes}) exceeds stride {stride}")
        prev_end = offset + nbytes
        segments.append(Segment(key, dtype, shape, offset, nbytes))

    checksum = raw.get("checksum")
    checksums: tuple[int, ...] | None = None
    if checksum is not None:
        allowed = _VERSION_CHECKSUMS[version]
        if checksum not in allowed:
            raise v.fail(f"{f}.checksum", f"unknown checksum algorithm {checksum!r} for format version {version}; "
                                          f"known: {list(allowed)}")
        values = v.get(raw, "checksums", f"{f}.checksums")
        if not isinstance(values, list) or len(values) != n_experts:
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise v.fail(f"{f}.checksums", f"expected a list of {n_experts} checksums, got {got}")
        checksums = tuple(v.int_in(c, f"{f}.checksums[{k}]", 0, 0xFFFFFFFF) for k, c in enumerate(values))
    elif raw.get("checksums") is not None:
        raise v.fail(f"{f}.checksums", "checksums given but checksum algorithm is null")

    st = _blob_stat(path, f"{f}.file")
    if not _stat.S_ISREG(st.st_mode):
        raise StoreError(path, "blob is not a regular file", f"{f}.file")
    if st.st_size != n_experts * stride:
        raise StoreError(
            path,
            f"blob size {st.st_size} != n_experts * stride = {n_experts} * {stride} = {n_experts * stride}"
            + (" (truncated)" if st.st_size < n_experts * stride else ""),
            f"{f}.file",
        )
    return LayerSpec(index, path, n_experts, stride, alignment, tuple(segments), checksum, checksums)


# --------------------------------------------------------------------------------------------


def path_not_utf8(path: str | os.PathLike[str]) -> str | None:
    """Why the native readers and MLX cannot open files under ``path`` (None: they can): a byte
    of its name is no UTF-8 (a name made in another encoding, kept by Linux as bytes). They failed
    later, as MLX's "std::bad_cast" or nanobind's "incompatible function arguments"."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = os.fsencode(str(path))
        bad = raw[len(str(path)[: exc.start].encode("utf-8", "surrogateescape"))]
        return (f"the path is not valid UTF-8 (byte 0x{bad:02x}, a name in another encoding): MLX and "
                f"asyncside's readers open UTF-8 paths only; rename the directory whose name holds it")
    return None


def printable_path(path: str | os.PathLike[str]) -> str:
    """``path`` as text any stream can write: a byte that is no UTF-8 shown as ``\\xe9``."""
    return os.fsencode(os.fspath(path)).decode("utf-8", "backslashreplace")


class ExpertStore:
    """A validated expert store (see docs/store-format.md). Build with :meth:`create` or :meth:`open`."""

    def __init__(self, path: pathlib.Path, layers: dict[int, LayerSpec], metadata: dict[str, Any]) -> None:
        self.path = path
        self.layers = layers
        self.metadata = metadata
        self.version = FORMAT_VERSION  # the manifest's format version (open() sets what it read)

    def __repr__(self) -> str:
        return f"ExpertStore({str(self.path)!r}, layers={list(self.layers)})"

    # ---- writing ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        layers: Mapping[int, Mapping[str, Any]],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        checksum: str | None = DEFAULT_CHECKSUM,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        chunk_bytes: int = 64 * 1024 * 1024,
    ) -> ExpertStore:
        """Write a store at ``path`` and return it opened.

        ``layers`` maps layer index -> {key: array shaped (n_experts, *row_shape)} (numpy or mx,
        bfloat16 included); keys keep the caller's order. Layers are converted and written one at a
        time (a lazy Mapping keeps only one layer in memory). The store is built in a temporary
        directory beside ``path`` and renamed into place, so a crash never leaves a half store
        that opens. ``overwrite`` replaces an existing store; otherwise an existing ``path`` is an error.
        """
        dest = pathlib.Path(path).absolute()
        alignment = _check_alignment(alignment, dest, "alignment")
        if checksum is not None and checksum not in CHECKSUM_ALGORITHMS:
            known = list(CHECKSUM_ALGORITHMS)
            raise StoreError(dest, f"unknown checksum algorithm {checksum!r}; known: {known}", "checksum")
        meta = {} if metadata is None else metadata
        if not isinstance(meta, dict):
            raise StoreError(dest, f"metadata must be a dict, got {type(meta).__name__}", "metadata")
        try:
            meta_json = json.loads(json.dumps(meta, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise StoreError(dest, f"metadata is not JSON-serialisable: {exc}", "metadata") from None
        if dest.exists() and not overwrite:
            raise StoreError(dest, "already exists (pass overwrite=True to replace it)")
        if not layers:
            raise StoreError(dest, "a store needs at least one layer", "layers")
        dest.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_builds(dest)

        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        held = _hold_build(tmp)
        try:
            manifest_layers = []
            for key in layers:
                if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)) or not 0 <= key < 2**31:
                    raise StoreError(dest, f"layer index must be an int in [0, 2**31), got {key!r}", "layers")
            for key in sorted(layers, key=int):  # one layer at a time: a lazy Mapping loads one at a time
                manifest_layers.append(
                    _write_layer(tmp, dest, int(key), layers[key], alignment, checksum, chunk_bytes)
                )
            manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "metadata": meta_json,
                "layers": manifest_layers,
            }
            with open(tmp / MANIFEST_NAME, "w", encoding="utf-8") as fh:
                json.dump(manifest, fh, indent=1)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(tmp)
            if dest.exists():
                trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
                held_trash = _hold_build(trash)
                try:
                    try:
                        os.rename(dest, trash / "store")
                    except OSError as exc:
                        # A store made read-only (mode 0555), another user's in a sticky directory:
                        # a bare PermissionError naming the trash, which stayed beside the store.
                        shutil.rmtree(trash, ignore_errors=True)
                        raise StoreError(dest, f"cannot be replaced: {os_reason(exc)}",
                                         errno=exc.errno) from None
                    os.rename(tmp, dest)
                    shutil.rmtree(trash, ignore_errors=True)
                finally:
                    if held_trash is not None:
                        os.close(held_trash)
            else:
                os.rename(tmp, dest)
            _fsync_dir(dest.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if held is not None:
                os.close(held)
        return cls.open(dest)

    # ---- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, layers: Iterable[int] | None = None,
             verify: str = "size") -> ExpertStore:
        """Open and validate the store at ``path``; raises StoreError naming the file and manifest
        field on anything malformed or hostile.

        ``layers`` opens only those layer indices (a pipeline stage's): the other layers' entries
        are skipped unparsed and their blobs need not exist here; asking for a layer the manifest
        lacks is a StoreError. An empty ``layers`` opens the metadata alone.

        ``verify="size"`` (the default) reads the manifest and stats the blobs (each must be
        exactly ``n_experts * stride`` bytes); records are checked against their checksums as the
        readers load them. ``verify="full"`` also reads every record now and checks its checksum
        (:meth:`verify`): a blob overwritten with same-size garbage fails here. Blocking file I/O
        either way: from an event loop, call it in a worker thread.
        """
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify: expected one of {list(VERIFY_MODES)}, got {verify!r}")
        wanted = None if layers is None else {int(i) for i in layers}
        root = pathlib.Path(path).absolute()
        mpath = root / MANIFEST_NAME
        if not root.is_dir():
            raise StoreError(root, "store directory does not exist or is not a directory")
        problem = path_not_utf8(root)
        if problem is not None:
            raise StoreError(printable_path(root), problem)
        try:
            size = os.stat(mpath).st_size
        except FileNotFoundError:
            raise StoreError(mpath, "manifest is missing") from None
        except OSError as exc:
            raise StoreError(mpath, f"cannot read the manifest: {os_reason(exc)}",
                             errno=exc.errno) from None
        if size > MAX_MANIFEST_BYTES:
            raise StoreError(mpath, f"manifest is {size} bytes, larger than the {MAX_MANIFEST_BYTES} limit")
        try:
            with open(mpath, "rb") as fh:
                manifest = json.loads(fh.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise StoreError(mpath, f"manifest is not valid JSON: {exc}") from None
        except OSError as exc:  # another user's store (mode 0600), a disk error: a PermissionError traceback
            raise StoreError(mpath, f"cannot read the manifest: {os_reason(exc)}",
                             errno=exc.errno) from None
        v = _Validator(mpath)
        if not isinstance(manifest, dict):
            raise v.fail(None, f"manifest must be a JSON object, got {type(manifest).__name__}")
        fmt = v.get(manifest, "format", "format")
        if fmt != FORMAT_NAME:
            raise v.fail("format", f"expected {FORMAT_NAME!r}, got {fmt!r:.80}")
        version = v.get(manifest, "version", "version")
        if not _is_int(version) or version not in READ_VERSIONS:
            raise v.fail("version", f"unsupported version {version!r:.80}; this reader knows versions "
                                    f"{list(READ_VERSIONS)}")
        metadata = manifest.get("metadata", {})
        if not isinstance(metadata, dict):
            raise v.fail("metadata", f"expected an object, got {type(metadata).__name__}")
        raw_layers = v.get(manifest, "layers", "layers")
        if not isinstance(raw_layers, list) or not raw_layers:
            raise v.fail("layers", f"expected a non-empty list, got {raw_layers!r:.80}")
        specs: dict[int, LayerSpec] = {}
        files: dict[pathlib.Path, int] = {}
        for i, raw in enumerate(raw_layers):
            if wanted is not None and not (isinstance(raw, dict) and _is_int(raw.get("index"))
                                           and raw["index"] in wanted):
                continue
            spec = _parse_layer(root, raw, i, v, version)
            if spec.index in specs:
                raise v.fail(f"layers[{i}].index", f"duplicate layer index {spec.index}")
            if spec.path in files:
                raise v.fail(f"layers[{i}].file",
                             f"blob {spec.path.name!r} is already used by layer {files[spec.path]}")
            files[spec.path] = spec.index
            specs[spec.index] = spec
        if wanted is not None and wanted - set(specs):
            has = sorted(r["index"] for r in raw_layers if isinstance(r, dict) and _is_int(r.get("index")))
            raise v.fail("layers", f"no layer(s) {sorted(wanted - set(specs))} in the manifest; it has {has}")
        store = cls(root, dict(sorted(specs.items())), metadata)
        store.version = version
        if verify == "full":
            store.verify()
        return store

    # ---- reading ---------------------------------------------------------------------------

    def layer(self, index: int) -> LayerSpec:
        """The spec of layer ``index`` (StoreError naming the index if the store has no such layer)."""
        try:
            return self.layers[index]
        except (KeyError, TypeError):
            raise StoreError(self.path, f"no layer {index!r}; layers: {list(self.layers)}", "layers") from None

    def _expert_in_range(self, spec: LayerSpec, expert: Any) -> int:
        if not isinstance(expert, (int, np.integer)) or isinstance(expert, (bool, np.bool_)):
            raise StoreError(spec.path, f"expert id must be an integer, got {expert!r}")
        e = int(expert)
        if not 0 <= e < spec.n_experts:
            raise StoreError(spec.path, f"expert id {e} out of range [0, {spec.n_experts})")
        return e

    def read_record(self, layer: int, expert: int, *, verify: bool = True) -> bytes:
        """The raw record (``stride`` bytes) of ``expert``; checks its checksum unless ``verify=False``."""
        spec = self.layer(layer)
        e = self._expert_in_range(spec, expert)
        try:
            fd = os.open(spec.path, os.O_RDONLY)
            try:
                data = os.pread(fd, spec.stride, e * spec.stride)
            finally:
                os.close(fd)
        except OSError as exc:
            # A blob the process may not read (another user's, mode 0600), gone, or a disk error:
            # a bare OSError from deep inside a load, naming neither the layer nor the expert.
            raise StoreError(spec.path, f"layer {layer}: cannot read expert {e}: {os_reason(exc)}",
                             errno=exc.errno) from None
        if len(data) != spec.stride:
            raise StoreError(spec.path,
                             f"short read of expert {e}: {len(data)} of {spec.stride} bytes (truncated blob?)")
        if verify and not self.verify_record(layer, e, data):
            raise StoreError(
                spec.path,
                f"checksum mismatch for layer {layer} expert {e}: {spec.checksum} "
                f"{self.record_checksum(layer, data):#010x} != manifest {spec.checksums[e]:#010x}",  # type: ignore[index]
                f"checksums[{e}]",
            )
        return data

    def segment_arrays(self, layer: int, data: Any) -> dict[str, np.ndarray]:
        """Numpy views of each segment of a record (bfloat16 segments as raw uint16)."""
        spec = self.layer(layer)
        buf = np.frombuffer(data, dtype=np.uint8)
        out = {}
        for seg in spec.segments:
            out[seg.key] = buf[seg.offset : seg.end].view(_NUMPY_VIEW[seg.dtype]).reshape(seg.shape)
        return out

    def read_expert_numpy(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Like :meth:`read_expert` but numpy arrays (bfloat16 segments as raw uint16)."""
        return {k: a.copy() for k, a in self.segment_arrays(layer, self.read_record(layer, expert)).items()}

    def read_expert(self, layer: int, expert: int) -> dict[str, Any]:
        """The segments of one expert as MLX arrays of the stored dtype and row shape (ground truth)."""
        import mlx.core as mx  # lazy: keep `import asyncside` free of MLX

        out: dict[str, Any] = {}
        spec = self.layer(layer)
        for seg, arr in zip(spec.segments, self.segment_arrays(layer, self.read_record(layer, expert)).values()):
            a = mx.array(arr)
            if seg.dtype == "bfloat16":
                a = a.view(mx.bfloat16)
            out[seg.key] = a
        return out

    def record_checksum(self, layer: int, data: Any) -> int:
        """Checksum of a record given as the whole record bytes or as {key: segment bytes}."""
        spec = self.layer(layer)
        if spec.checksum is None:
            raise StoreError(spec.path, f"layer {layer} has no checksums", "checksum")
        return segments_checksum(spec.checksum, list(self._segment_parts(spec, data)))

    @staticmethod
    def _segment_parts(spec: LayerSpec, data: Any) -> Iterator[memoryview]:
        if isinstance(data, Mapping):
            for seg in spec.segments:
                part = memoryview(data[seg.key]).cast("B")
                if part.nbytes != seg.nbytes:
                    raise StoreError(spec.path, f"segment {seg.key!r} has {part.nbytes} bytes, expected {seg.nbytes}")
                yield part
            return
        mv = memoryview(data).cast("B")
        if mv.nbytes < spec.segments[-1].end:
            raise StoreError(spec.path, f"record has {mv.nbytes} bytes, expected {spec.stride}")
        for seg in spec.segments:
            yield mv[seg.offset : seg.end]

    def verify_record(self, layer: int, expert: int, data: Any) -> bool:
        """True if ``data`` (record bytes, or {key: segment bytes}) matches the expert's checksum.

        True when the layer has no checksums.
        """
        spec = self.layer(layer)
        e = self._expert_in_range(spec, expert)
        if spec.checksum is None or spec.checksums is None:
            return True
        return self.record_checksum(layer, data) == spec.checksums[e]

    def verify(self) -> int:
        """Read every record of every layer and check its checksum; returns the number checked.

        Raises StoreError naming the layer, expert and blob on the first mismatch (or short read).
        Reads each blob once, front to back, in blocks of whole records.
        """
        checked = 0
        for index, spec in self.layers.items():
            if spec.checksum is None or spec.checksums is None:
                continue
            per_block = max(1, (64 << 20) // spec.stride)
            try:
                fd = os.open(spec.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise StoreError(spec.path, f"layer {index}: cannot open the blob: {os_reason(exc)}",
                                 errno=exc.errno) from None
            try:
                for start in range(0, spec.n_experts, per_block):
                    stop = min(spec.n_experts, start + per_block)
                    want = (stop - start) * spec.stride
                    try:
                        data = os.pread(fd, want, start * spec.stride)
                    except OSError as exc:
                        # The disk failing where a full check is run to find out: a bare OSError that
                        # named neither the blob nor where in it.
                        raise StoreError(spec.path, f"layer {index}: cannot read experts [{start}, {stop}) (bytes "
                                                    f"[{start * spec.stride}, {stop * spec.stride})): "
                                                    f"{os_reason(exc)}",
                                         errno=exc.errno) from None
                    if len(data) != want:
                        raise StoreError(spec.path, f"short read at expert {start + len(data) // spec.stride}: "
                                                    f"the blob ended early (truncated?)", f"layers[{index}].file")
                    view = memoryview(data)
                    for e in range(start, stop):
                        rec = view[(e - start) * spec.stride : (e - start + 1) * spec.stride]
                        got = segments_checksum(spec.checksum, [rec[s.offset : s.end] for s in spec.segments])
                        if got != spec.checksums[e]:
                            raise StoreError(
                                spec.path,
                                f"checksum mismatch for layer {index} expert {e}: {spec.checksum} {got:#010x} "
                                f"!= manifest {spec.checksums[e]:#010x}",
                                f"checksums[{e}]",
                            )
                        checked += 1
            finally:
                os.close(fd)
        return checked


def _write_layer(
    tmp: pathlib.Path,
    dest: pathlib.Path,
    index: int,
    arrays: Mapping[str, Any],
    alignment: int,
    checksum: str | None,
    chunk_bytes: int,
) -> dict[str, Any]:
    """Write one layer's blob into ``tmp`` and return its manifest entry."""
    where = f"{dest} layer {index}"
    if not isinstance(arrays, Mapping) or not arrays:
        raise StoreError(dest, f"layer {index} needs a non-empty mapping key -> array", f"layers[{index}]")
    n_experts: int | None = None
    converted: list[tuple[str, np.ndarray, str]] = []
    for key, arr in arrays.items():
        if not isinstance(key, str) or not key:
            raise StoreError(dest, f"segment key must be a non-empty string, got {key!r}", f"layers[{index}]")
        np_arr, name = _as_numpy_bytes_view(arr, f"{where} key {key!r}")
        if np_arr.ndim < 1 or np_arr.shape[0] < 1 or any(d < 1 for d in np_arr.shape[1:]):
            raise StoreError(dest, f"key {key!r}: expected shape (n_experts >= 1, *row_shape), got {np_arr.shape}",
                             f"layers[{index}].{key}")
        if n_experts is None:
            n_experts = np_arr.shape[0]
        elif np_arr.shape[0] != n_experts:
            raise StoreError(
                dest, f"key {key!r} has {np_arr.shape[0]} experts, other keys have {n_experts}",
                f"layers[{index}].{key}",
            )
        converted.append((key, np_arr, name))
    assert n_experts is not None

    segments = []
    offset = 0
    for key, np_arr, name in converted:
        offset = round_up(offset, SEGMENT_ALIGNMENT)
        nbytes = math.prod(np_arr.shape[1:]) * DTYPE_SIZES[name]
        segments.append(Segment(key, name, tuple(int(d) for d in np_arr.shape[1:]), offset, nbytes))
        offset += nbytes
    stride = round_up(offset, alignment)
    rows = [a.reshape(n_experts, -1).view(np.uint8) for _, a, _ in converted]

    file_name = f"layer-{index:05d}.bin"
    checksums: list[int] = []
    per_chunk = max(1, chunk_bytes // stride)
    with open(tmp / file_name, "wb") as fh:
        for start in range(0, n_experts, per_chunk):
            stop = min(n_experts, start + per_chunk)
            block = np.zeros((stop - start, stride), dtype=np.uint8)
            for seg, r in zip(segments, rows):
                block[:, seg.offset : seg.end] = r[start:stop]
            if checksum is not None:
                for k in range(stop - start):
                    checksums.append(segments_checksum(checksum, [block[k, s.offset : s.end] for s in segments]))
            fh.write(block.data)
        fh.flush()
        os.fsync(fh.fileno())
    return {
        "index": index,
        "file": file_name,
        "n_experts": n_experts,
        "stride": stride,
        "alignment": alignment,
        "segments": [
            {"key": s.key, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes}
            for s in segments
        ],
        "checksum": checksum,
        "checksums": checksums if checksum is not None else None,
    }
