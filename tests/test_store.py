"""The expert store: round trips, the on-disk layout, and refusal of malformed or hostile stores."""

from __future__ import annotations

import json
import os
import pathlib
import re
import zlib
from typing import Any

import numpy as np
import pytest

from asyncside import ExpertStore, StoreError
from asyncside.store import SEGMENT_ALIGNMENT


def _crc_table(reflected_poly: int) -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ reflected_poly if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C_TABLE = _crc_table(0x82F63B78)


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli), bytewise in Python: the reference the native paths are checked against."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = (c >> 8) ^ _CRC32C_TABLE[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


def _layers(n_experts: int = 5, seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        0: {
            "gate_proj.weight": rng.integers(0, 2**32, (n_experts, 4, 6), dtype=np.uint32),
            "gate_proj.scales": rng.standard_normal((n_experts, 4, 3)).astype(np.float16),
            "down_proj.bias": rng.standard_normal((n_experts, 7)).astype(np.float32),
            "odd": rng.integers(-128, 127, (n_experts, 13), dtype=np.int8),
        },
        3: {
            "w": rng.standard_normal((n_experts, 33)).astype(np.float32),
        },
    }


@pytest.fixture
def store(tmp_path: pathlib.Path) -> tuple[ExpertStore, dict[int, dict[str, np.ndarray]]]:
    layers = _layers()
    return ExpertStore.create(tmp_path / "s", layers, metadata={"model": "toy", "resident": [1, 2]}), layers


def test_round_trip_numpy(store: Any) -> None:
    st, layers = store
    assert list(st.layers) == [0, 3]
    assert st.metadata == {"model": "toy", "resident": [1, 2]}
    for li, arrays in layers.items():
        spec = st.layer(li)
        assert [s.key for s in spec.segments] == list(arrays)  # the caller's key order
        for e in range(spec.n_experts):
            got = st.read_expert(li, e)
            for key, arr in arrays.items():
                assert str(got[key].dtype).endswith(arr.dtype.name)
                np.testing.assert_array_equal(np.array(got[key]), arr[e])


def test_layout_matches_the_documented_format(store: Any) -> None:
    """Record e at e*stride, segments at 64-aligned offsets in order, stride 4096-aligned, zero padding."""
    st, layers = store
    spec = st.layer(0)
    assert spec.alignment == 4096 and spec.stride % 4096 == 0
    assert spec.path == st.path / "layer-00000.bin"
    assert os.path.getsize(spec.path) == spec.n_experts * spec.stride
    end = 0
    for seg in spec.segments:
        assert seg.offset % SEGMENT_ALIGNMENT == 0 and seg.offset >= end
        end = seg.end
    raw = spec.path.read_bytes()
    for e in range(spec.n_experts):
        rec = raw[e * spec.stride : (e + 1) * spec.stride]
        covered = bytearray(spec.stride)
        for seg in spec.segments:
            assert rec[seg.offset : seg.end] == layers[0][seg.key][e].tobytes()
            covered[seg.offset : seg.end] = b"\1" * seg.nbytes
        assert all(b == 0 for b, c in zip(rec, covered) if not c), "padding must be zero"
        # checksum: crc32c over the segment bytes in table order (an independent implementation)
        crc = 0
        for seg in spec.segments:
            crc = crc32c_reference(rec[seg.offset : seg.end], crc)
        assert spec.checksum == "crc32c" and spec.checksums is not None and spec.checksums[e] == crc
    manifest = json.loads((st.path / "manifest.json").read_text())
    assert manifest["format"] == "asyncside-expert-store" and manifest["version"] == 2


def test_bfloat16_mx_round_trip(tmp_path: pathlib.Path) -> None:
    mx = pytest.importorskip("mlx.core")
    a = mx.random.normal((3, 5, 8)).astype(mx.bfloat16)
    b = mx.arange(3 * 4, dtype=mx.int32).reshape(3, 4)
    st = ExpertStore.create(tmp_path / "bf", {7: {"w": a, "i": b}}, alignment=512)
    assert st.layer(7).stride % 512 == 0
    for e in range(3):
        got = st.read_expert(7, e)
        assert got["w"].dtype == mx.bfloat16 and got["w"].shape == (5, 8)
        assert mx.array_equal(got["w"], a[e]).item()
        assert mx.array_equal(got["i"], b[e]).item()


def test_verify_record_accepts_record_or_segments(store: Any) -> None:
    st, layers = store
    rec = st.read_record(0, 2)
    assert st.verify_record(0, 2, rec)
    assert not st.verify_record(0, 1, rec)
    segs = {k: np.ascontiguousarray(v[2]) for k, v in layers[0].items()}
    assert st.verify_record(0, 2, segs)
    bad = bytearray(rec)
    bad[0] ^= 1
    assert not st.verify_record(0, 2, bytes(bad))
    assert st.verify() == 10


def test_no_checksum_store(tmp_path: pathlib.Path) -> None:
    st = ExpertStore.create(tmp_path / "n", _layers(), checksum=None)
    assert st.layer(0).checksums is None
    assert st.verify_record(0, 0, b"junk")
    assert st.verify() == 0


def test_create_refuses_existing_and_overwrites_atomically(tmp_path: pathlib.Path) -> None:
    ExpertStore.create(tmp_path / "s", _layers(seed=1))
    with pytest.raises(StoreError, match="already exists"):
        ExpertStore.create(tmp_path / "s", _layers(seed=2))
    st = ExpertStore.create(tmp_path / "s", _layers(seed=2), overwrite=True)
    np.testing.assert_array_equal(np.array(st.read_expert(3, 0)["w"]), _layers(seed=2)[3]["w"][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"], "no temp dirs left behind"


def test_create_crash_leaves_no_store(tmp_path: pathlib.Path) -> None:
    class Boom(Exception):
        pass

    class Lazy(dict):  # a layer mapping that fails half way, as a crash would
        def __getitem__(self, k: int) -> Any:
            if k == 3:
                raise Boom()
            return super().__getitem__(k)

    with pytest.raises(Boom):
        ExpertStore.create(tmp_path / "s", Lazy(_layers()))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "layers, match",
    [
        ({0: {"w": np.zeros((3, 2), np.float32), "v": np.zeros((4, 2), np.float32)}}, "4 experts, other keys have 3"),
        ({0: {"w": [[1.0]]}}, "expected a numpy or mlx array"),
        ({0: {"w": np.zeros((3, 2), np.float128)}}, "unsupported numpy dtype"),
        ({0: {"w": np.zeros((0, 2), np.float32)}}, "n_experts >= 1"),
        ({0: {}}, "non-empty mapping"),
        ({-1: {"w": np.zeros((3, 2), np.float32)}}, "layer index"),
        ({}, "at least one layer"),
    ],
)
def test_create_rejects_bad_input(tmp_path: pathlib.Path, layers: Any, match: str) -> None:
    with pytest.raises(StoreError, match=match):
        ExpertStore.create(tmp_path / "s", layers)
    assert not (tmp_path / "s").exists()


def test_create_rejects_bad_options(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StoreError, match="power of two.*3000"):
        ExpertStore.create(tmp_path / "s", _layers(), alignment=3000)
    with pytest.raises(StoreError, match="'md5'"):
        ExpertStore.create(tmp_path / "s", _layers(), checksum="md5")
    with pytest.raises(StoreError, match="JSON"):
        ExpertStore.create(tmp_path / "s", _layers(), metadata={"x": object()})


@pytest.mark.parametrize("bad", [-1, 5, 10**20, 1.0, True, "1", np.float32(1)])
def test_read_rejects_bad_expert_ids(store: Any, bad: Any) -> None:
    st, _ = store
    shown = str(bad) if isinstance(bad, int) and not isinstance(bad, bool) else repr(bad)
    with pytest.raises(StoreError, match=re.escape(shown)):
        st.read_expert(0, bad)


def test_read_rejects_unknown_layer(store: Any) -> None:
    st, _ = store
    with pytest.raises(StoreError, match="no layer 1"):
        st.read_record(1, 0)


# ---- hostile manifests ---------------------------------------------------------------------


def _mutate(st: ExpertStore, fn: Any) -> pathlib.Path:
    mpath = st.path / "manifest.json"
    m = json.loads(mpath.read_text())
    fn(m)
    mpath.write_text(json.dumps(m))
    return mpath


def _seg(m: dict, j: int = 1) -> dict:
    return m["layers"][0]["segments"][j]


HOSTILE: list[tuple[str, Any, str, str]] = [
    # (test id, mutation, expected field, expected message fragment)
    ("wrong-format", lambda m: m.update(format="safetensors"), "format", "'safetensors'"),
    ("wrong-version", lambda m: m.update(version=3), "version", "unsupported version 3"),
    ("crc32c-in-version-1", lambda m: m.update(version=1), "layers[0].checksum", "'crc32c' for format version 1"),
    ("bool-version", lambda m: m.update(version=True), "version", "True"),
    ("missing-version", lambda m: m.pop("version"), "version", "missing field 'version'"),
    ("missing-layers", lambda m: m.pop("layers"), "layers", "missing"),
    ("empty-layers", lambda m: m.update(layers=[]), "layers", "non-empty list"),
    ("layer-not-object", lambda m: m["layers"].__setitem__(0, 7), "layers[0]", "expected an object"),
    ("metadata-not-object", lambda m: m.update(metadata=[1]), "metadata", "expected an object"),
    ("missing-stride", lambda m: m["layers"][0].pop("stride"), "layers[0].stride", "missing field 'stride'"),
    ("negative-n-experts", lambda m: m["layers"][0].update(n_experts=-3), "layers[0].n_experts", "-3"),
    ("float-n-experts", lambda m: m["layers"][0].update(n_experts=5.0), "layers[0].n_experts", "5.0"),
    ("huge-n-experts", lambda m: m["layers"][0].update(n_experts=2**70), "layers[0].n_experts", str(2**70)),
    ("huge-stride", lambda m: m["layers"][0].update(stride=2**64), "layers[0].stride", str(2**64)),
    ("overflowing-product", lambda m: m["layers"][0].update(n_experts=2**31 - 1, stride=2**40), "layers[0].stride", "exceeds"),
    ("stride-not-aligned", lambda m: m["layers"][0].update(stride=4097), "layers[0].stride", "not a multiple of alignment"),
    ("alignment-not-pow2", lambda m: m["layers"][0].update(alignment=3), "layers[0].alignment", "power of two"),
    ("negative-index", lambda m: m["layers"][0].update(index=-1), "layers[0].index", "-1"),
    ("duplicate-index", lambda m: m["layers"][1].update(index=0), "layers[1].index", "duplicate layer index 0"),
    ("dotdot-file", lambda m: m["layers"][0].update(file="../x"), "layers[0].file", "'../x'"),
    ("dotdot-only", lambda m: m["layers"][0].update(file=".."), "layers[0].file", "'..'"),
    ("absolute-file", lambda m: m["layers"][0].update(file="/etc/passwd"), "layers[0].file", "'/etc/passwd'"),
    ("backslash-file", lambda m: m["layers"][0].update(file="..\\x"), "layers[0].file", "plain file name"),
    ("manifest-as-blob", lambda m: m["layers"][0].update(file="manifest.json"), "layers[0].file", "plain file name"),
    ("shared-blob", lambda m: m["layers"][1].update(file=m["layers"][0]["file"]), "layers[1].file", "already used by layer 0"),
    ("missing-blob", lambda m: m["layers"][0].update(file="nope.bin"), "layers[0].file", "missing"),
    ("unknown-dtype", lambda m: _seg(m).update(dtype="float8"), "layers[0].segments[1].dtype", "'float8'"),
    ("negative-offset", lambda m: _seg(m).update(offset=-64), "layers[0].segments[1].offset", "-64"),
    ("nbytes-mismatch", lambda m: _seg(m).update(nbytes=_seg(m)["nbytes"] + 2), "layers[0].segments[1].nbytes", "prod(shape"),
    ("zero-dim", lambda m: _seg(m).update(shape=[0, 3]), "layers[0].segments[1].shape[0]", "value 0"),
    ("overlapping-segments", lambda m: _seg(m).update(offset=_seg(m, 0)["offset"] + 8), "layers[0].segments[1].offset", "overlaps"),
    ("segment-past-stride", lambda m: _seg(m, 3).update(offset=m["layers"][0]["stride"] - 8), "layers[0].segments[3].offset", "exceeds stride"),
    ("duplicate-key", lambda m: _seg(m).update(key=_seg(m, 0)["key"]), "layers[0].segments[1].key", "duplicate segment key"),
    ("empty-segments", lambda m: m["layers"][0].update(segments=[]), "layers[0].segments", "non-empty list"),
    ("unknown-checksum", lambda m: m["layers"][0].update(checksum="sha1"), "layers[0].checksum", "'sha1'"),
    ("short-checksums", lambda m: m["layers"][0]["checksums"].pop(), "layers[0].checksums", "expected a list of 5"),
    ("negative-checksum", lambda m: m["layers"][0]["checksums"].__setitem__(2, -1), "layers[0].checksums[2]", "-1"),
    ("checksums-without-algorithm", lambda m: m["layers"][0].update(checksum=None), "layers[0].checksums", "null"),
]


@pytest.mark.parametrize("mutate, field, fragment", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_open_rejects_hostile_manifest(store: Any, mutate: Any, field: str, fragment: str) -> None:
    st, _ = store
    _mutate(st, mutate)
    with pytest.raises(StoreError) as info:
        ExpertStore.open(st.path)
    assert info.value.field == field, str(info.value)
    assert fragment in str(info.value)


def test_open_rejects_non_json_and_missing_manifest(tmp_path: pathlib.Path, store: Any) -> None:
    st, _ = store
    (st.path / "manifest.json").write_bytes(b"{not json")
    with pytest.raises(StoreError, match="not valid JSON") as info:
        ExpertStore.open(st.path)
    assert info.value.path.endswith("manifest.json")
    (st.path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(StoreError, match="JSON object"):
        ExpertStore.open(st.path)
    os.unlink(st.path / "manifest.json")
    with pytest.raises(StoreError, match="manifest is missing"):
        ExpertStore.open(st.path)
    with pytest.raises(StoreError, match="does not exist"):
        ExpertStore.open(tmp_path / "nowhere")


def test_open_rejects_symlink_escaping_the_store(store: Any, tmp_path: pathlib.Path) -> None:
    st, _ = store
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * os.path.getsize(st.layer(0).path))
    os.symlink(outside, st.path / "link.bin")
    _mutate(st, lambda m: m["layers"][0].update(file="link.bin"))
    with pytest.raises(StoreError, match="outside the store directory") as info:
        ExpertStore.open(st.path)
    assert info.value.field == "layers[0].file"


def test_open_rejects_truncated_and_oversized_blob(store: Any) -> None:
    st, _ = store
    path = st.layer(0).path
    size = os.path.getsize(path)
    os.truncate(path, size - 1)
    with pytest.raises(StoreError, match=f"blob size {size - 1} != .*truncated") as info:
        ExpertStore.open(st.path)
    assert info.value.path == str(path) and info.value.field == "layers[0].file"
    os.truncate(path, size + 4096)
    with pytest.raises(StoreError, match=f"blob size {size + 4096}"):
        ExpertStore.open(st.path)


def test_open_does_not_read_blobs(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """open() only stats blobs: it never opens one (blobs may be many GiB)."""
    import builtins

    st, _ = store
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file: Any, *a: Any, **k: Any) -> Any:
        opened.append(str(file))
        return real_open(file, *a, **k)

    def spy_os_open(file: Any, *a: Any, **k: Any) -> Any:
        opened.append(str(file))
        return real_os_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    ExpertStore.open(st.path)
    assert opened and not [p for p in opened if p.endswith(".bin")], opened


def test_checksum_mismatch_names_layer_and_expert(store: Any) -> None:
    st, _ = store
    spec = st.layer(0)
    with open(spec.path, "r+b") as fh:
        fh.seek(3 * spec.stride + spec.segments[1].offset)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))
    reopened = ExpertStore.open(st.path)  # open() does not read blobs, so it still opens
    reopened.read_expert(0, 2)
    with pytest.raises(StoreError, match="checksum mismatch for layer 0 expert 3") as info:
        reopened.read_expert(0, 3)
    assert info.value.field == "checksums[3]" and info.value.path == str(spec.path)
    with pytest.raises(StoreError, match="expert 3"):
        reopened.verify()
    assert reopened.read_record(0, 3, verify=False)  # raw access still possible


def test_padding_changes_do_not_affect_checksum(store: Any) -> None:
    """The checksum covers segment bytes only (documented), so padding is not part of it."""
    st, _ = store
    spec = st.layer(3)
    pad = spec.segments[-1].end
    assert pad < spec.stride
    with open(spec.path, "r+b") as fh:
        fh.seek(pad)
        fh.write(b"\x55")
    st.read_expert(3, 0)


def test_blob_truncated_after_open_gives_a_short_read_error(store: Any) -> None:
    st, _ = store
    spec = st.layer(0)
    os.truncate(spec.path, spec.blob_bytes - 100)
    st.read_expert(0, spec.n_experts - 2)
    with pytest.raises(StoreError, match=f"short read of expert {spec.n_experts - 1}"):
        st.read_expert(0, spec.n_experts - 1)


def test_numpy_integer_layer_indices_are_accepted(tmp_path: pathlib.Path) -> None:
    st = ExpertStore.create(tmp_path / "s", {np.int64(4): {"w": np.ones((2, 3), np.float16)}})
    assert list(st.layers) == [4] and type(st.layer(4).index) is int


# ---- checksums and format versions ---------------------------------------------------------


def test_native_checksums_match_the_references() -> None:
    """The native CRCs (the fastest path this CPU has, and the portable tables) equal zlib's crc32
    and a bytewise Python CRC-32C, at every length around the folding block sizes and at odd
    offsets, and chain like zlib's."""
    import asyncside._native as native

    rng = np.random.default_rng(11)
    buf = rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    assert native.checksum("crc32c", b"123456789") == 0xE3069283
    assert native.checksum("crc32", b"123456789") == 0xCBF43926 == zlib.crc32(b"123456789")
    lengths = [*range(0, 70), *range(240, 300), 511, 512, 513, 1023, 4096, 4099, 65536 - 7]
    for n in lengths:
        off = int(rng.integers(0, 64)) if n < 65536 - 64 else 0
        part = buf[off : off + n]
        state = int(rng.integers(0, 2**32)) if n % 3 else 0
        assert native.checksum("crc32", part, state) == zlib.crc32(part, state), n
        assert native.checksum_portable("crc32", part, state) == zlib.crc32(part, state), n
        fast, portable = native.checksum("crc32c", part, state), native.checksum_portable("crc32c", part, state)
        assert fast == portable, n
        if n <= 4099:
            assert fast == crc32c_reference(part, state), n
    whole = native.checksum("crc32c", buf)
    assert native.checksum("crc32c", buf[1000:], native.checksum("crc32c", buf[:1000])) == whole
    for kind in ("crc32", "crc32c"):
        for cut in (0, 1, 999, 4096, len(buf)):
            a, b = native.checksum(kind, buf[:cut]), native.checksum(kind, buf[cut:])
            assert native.checksum_combine(kind, a, b, len(buf) - cut) == native.checksum(kind, buf), (kind, cut)
    assert native.checksum("crc32c", np.frombuffer(buf, dtype=np.uint8)) == whole  # any buffer
    assert native.checksum_implementation("crc32c") in ("vpclmulqdq", "pclmulqdq", "sse4.2", "armv8-crc", "table")
    with pytest.raises(ValueError, match="'md5'"):
        native.checksum("md5", b"")


@pytest.mark.parametrize("kind", ["crc32", "crc32c"])
def test_checksums_leave_the_vector_upper_state_clean(kind: str) -> None:
    """The AVX-512 path ends with vzeroupper. Without it, a fault verified on MLX's stream thread
    left the upper register halves dirty and the SSE kernels MLX ran next on that thread paid a
    transition penalty on every instruction (a decode step ran 2.5x slower with verify on)."""
    import asyncside._native as native

    states = {n: native.checksum_leaves_upper_state(kind, n) for n in (0, 63, 64, 255, 256, 300, 4096, 1 << 20)}
    if set(states.values()) == {-1}:
        pytest.skip("this CPU cannot report its vector register state (XGETBV ECX=1)")
    assert all(v == 0 for v in states.values()), (native.checksum_implementation(kind), states)


def _as_version_1(st: ExpertStore) -> ExpertStore:
    """Rewrite a crc32 store's manifest as format version 1 (what stores written before looked like)."""
    _mutate(st, lambda m: m.update(version=1))
    return ExpertStore.open(st.path)


def test_version_1_stores_still_open_and_verify(tmp_path: pathlib.Path) -> None:
    layers = _layers()
    v1 = _as_version_1(ExpertStore.create(tmp_path / "old", layers, checksum="crc32"))
    assert v1.version == 1 and v1.layer(0).checksum == "crc32"
    for e in range(5):
        np.testing.assert_array_equal(v1.read_expert_numpy(0, e)["odd"], layers[0]["odd"][e])
    assert v1.verify() == 10
    assert ExpertStore.open(v1.path, verify="full").verify() == 10
    new = ExpertStore.create(tmp_path / "new", layers)
    assert new.version == 2 and new.layer(0).checksum == "crc32c"


@pytest.mark.parametrize("damage", ["zeroed", "flipped-byte"])
def test_open_verify_full_catches_damaged_records(store: Any, damage: str) -> None:
    st, _ = store
    spec = st.layer(3)
    if damage == "zeroed":
        spec.path.write_bytes(b"\0" * spec.blob_bytes)  # same size: passes the size check
        bad_expert = 0
    else:
        bad_expert = 3
        with open(spec.path, "r+b") as fh:
            fh.seek(bad_expert * spec.stride + spec.segments[0].offset + 17)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0x10]))
    ExpertStore.open(st.path)  # sizes only: opens
    with pytest.raises(StoreError, match=f"checksum mismatch for layer 3 expert {bad_expert}") as info:
        ExpertStore.open(st.path, verify="full")
    assert info.value.field == f"checksums[{bad_expert}]" and info.value.path == str(spec.path)
    with pytest.raises(ValueError, match="verify: expected one of"):
        ExpertStore.open(st.path, verify="sometimes")
