"""Pipeline stages, in one process: the store's layer filter, stage plans, message headers, the
launch environment, and stage forwards that compose bitwise into the one-process forward."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import types
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside import ExpertStore, StoreError
from asyncside.bridge import completed
from asyncside.distributed import PlanError, make_plan, parse_split
from asyncside.distributed.boundary import (
    HEADER,
    HIDDEN,
    INLINE,
    LOGITS,
    MAGIC,
    NONE,
    PRED,
    SHUTDOWN,
    TRANSPORT,
    Message,
    _inline_array,
    decode_header,
    encode_header,
)
from asyncside.distributed.errors import LaunchEnvError, ProtocolError
from asyncside.distributed.group import COORDINATOR_VAR, LaunchEnv, comm_device
from asyncside.distributed.stage import load_stage_model, plan_for_store
from asyncside.distributed.stage_forward import embed, greedy, head, run_layers
from asyncside.models import convert_model, load_streaming_model
from asyncside.runtime import Runtime

from _models_support import tiny_model

# -- ExpertStore.open(layers=...) ------------------------------------------------------------------


def _two_layer_store(tmp_path: pathlib.Path) -> ExpertStore:
    rng = np.random.default_rng(0)
    layers = {i: {"w": rng.standard_normal((4, 8)).astype(np.float32)} for i in (0, 2, 5)}
    return ExpertStore.create(tmp_path / "s", layers, metadata={"model": "toy"})


def test_open_some_layers_skips_the_others_blobs(tmp_path: pathlib.Path) -> None:
    full = _two_layer_store(tmp_path)
    part = ExpertStore.open(full.path, layers=[2, 5])
    assert list(part.layers) == [2, 5] and part.metadata == {"model": "toy"}
    np.testing.assert_array_equal(np.array(part.read_expert(2, 1)["w"]), np.array(full.read_expert(2, 1)["w"]))
    # A store split across machines: layer 0's blob is not on this one.
    full.layer(0).path.unlink()
    with pytest.raises(StoreError, match="blob file is missing"):
        ExpertStore.open(full.path)
    assert list(ExpertStore.open(full.path, layers=(5,)).layers) == [5]
    meta_only = ExpertStore.open(full.path, layers=())
    assert meta_only.layers == {} and meta_only.metadata == {"model": "toy"}


def test_open_unknown_layer_names_it(tmp_path: pathlib.Path) -> None:
    full = _two_layer_store(tmp_path)
    with pytest.raises(StoreError, match=r"no layer\(s\) \[3, 7\] in the manifest; it has \[0, 2, 5\]") as info:
        ExpertStore.open(full.path, layers=[2, 3, 7])
    assert info.value.field == "layers"
    # A selected layer is still validated in full.
    manifest = json.loads((full.path / "manifest.json").read_text())
    manifest["layers"][1]["stride"] = 100
    (full.path / "manifest.json").write_text(json.dumps(manifest))
    ExpertStore.open(full.path, layers=[5])
    with pytest.raises(StoreError, match="stride 100 is not a multiple"):
        ExpertStore.open(full.path, layers=[2])


# -- stage plans -------------------------------------------------------------------------------------


def test_even_split_gives_rank_0_the_embedding_and_the_first_layers() -> None:
    plan = make_plan(7, [1, 2, 4, 5, 6], 3)
    assert plan.split == (3, 2, 2)
    assert [(s.start, s.stop, s.moe_layers) for s in plan.stages] == [(0, 3, (1, 2)), (3, 5, (4,)), (5, 7, (5, 6))]
    assert plan.stage(0).first and not plan.stage(1).first and plan.is_last(2)
    assert plan.next_moe(0) == 4 and plan.next_moe(1) == 5 and plan.next_moe(2) is None
    assert plan.fingerprint() == "layers=7 split=3,2,2"


def test_split_without_moe_layers_and_next_moe_skips_it() -> None:
    plan = make_plan(4, [2, 3], 3, parse_split("1, 1,2"))
    assert [s.moe_layers for s in plan.stages] == [(), (), (2, 3)]
    assert plan.next_moe(0) == 2


@pytest.mark.parametrize("split, message", [
    ("2,x", "expected comma-separated layer counts"),
    ("2,2,2", "has 3 entries for 2 ranks"),
    ("3,0", "every count must be >= 1"),
    ("2,1", "sum to the model's 4 decoder layers"),
])
def test_bad_splits_are_refused(split: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(4, [0, 1], 2, parse_split(split))


def test_more_ranks_than_layers_is_refused() -> None:
    with pytest.raises(PlanError, match="fewer than the 3 ranks"):
        make_plan(2, [0], 3)


# -- message headers ----------------------------------------------------------------------------------


def test_header_round_trip() -> None:
    msg = Message(HIDDEN, req=7, payload=mx.zeros((1, 5, 64), dtype=mx.bfloat16), flags=LOGITS, layer=-1, step=3, seq=12)
    data = encode_header(msg)
    assert len(data) == HEADER.size == 49
    got, dtype, shape, where = decode_header(data)
    assert (got.kind, got.req, got.flags, got.layer, got.step, got.seq) == (HIDDEN, 7, LOGITS, -1, 3, 12)
    assert dtype == mx.bfloat16 and shape == (1, 5, 64) and where == TRANSPORT
    got, dtype, shape, where = decode_header(encode_header(Message(SHUTDOWN, seq=1)))
    assert got.kind == SHUTDOWN and dtype is None and shape == () and where == NONE
    ids = mx.array([[[3, 1, 4, 1]]], dtype=mx.int32)
    frame = encode_header(Message(PRED, 2, ids, layer=9), INLINE) + memoryview(ids).tobytes()
    got, dtype, shape, where = decode_header(frame)
    assert got.layer == 9 and dtype == mx.int32 and shape == (1, 1, 4) and where == INLINE
    assert _inline_array(frame[HEADER.size:], dtype, shape).tolist() == [[[3, 1, 4, 1]]]
    bf = mx.array([1.5, -2.0], dtype=mx.bfloat16)
    frame = encode_header(Message(PRED, payload=bf), INLINE) + memoryview(bf).tobytes()
    _msg, dtype, shape, _where = decode_header(frame)
    back = _inline_array(frame[HEADER.size:], dtype, shape)
    assert back.dtype == mx.bfloat16 and back.tolist() == [1.5, -2.0]


def test_malformed_headers_are_refused() -> None:
    good = bytearray(encode_header(Message(HIDDEN, payload=mx.zeros((2, 3)), seq=1)))
    with pytest.raises(ProtocolError, match="magic"):
        decode_header(b"XXXX" + bytes(good[4:]))
    bad_kind = bytearray(good)
    bad_kind[4] = 99
    with pytest.raises(ProtocolError, match="unknown kind 99"):
        decode_header(bytes(bad_kind))
    huge = HEADER.pack(MAGIC, HIDDEN, 11, 3, 0, TRANSPORT, 1, 0, 0, 0, 1 << 20, 1 << 20, 64, 0)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(huge)
    with pytest.raises(ProtocolError, match="48 bytes"):
        decode_header(bytes(good[:-1]))
    with pytest.raises(ProtocolError, match="3 payload bytes for a transport payload"):
        decode_header(bytes(good) + b"abc")
    short_inline = encode_header(Message(PRED, payload=mx.zeros((4,), dtype=mx.int32)), INLINE) + b"\0" * 15
    with pytest.raises(ProtocolError, match="15 payload bytes for an inline payload"):
        decode_header(short_inline)
    with pytest.raises(ValueError, match="at most 4"):
        encode_header(Message(HIDDEN, payload=mx.zeros((1, 1, 1, 1, 1))))


# -- the launch environment ------------------------------------------------------------------------------


def test_ring_environment(tmp_path: pathlib.Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5001"], ["10.0.0.3:5002"]]))
    env = LaunchEnv.from_environ(environ={"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)})
    assert (env.backend, env.rank, env.size) == ("ring", 1, 3)
    assert env.coordinator == ("10.0.0.1", 5003)
    assert env.describe(2) == "rank 2 (10.0.0.3)"
    env = LaunchEnv.from_environ(environ={"MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile), COORDINATOR_VAR: "10.0.0.9:7000"})
    assert env.coordinator == ("10.0.0.9", 7000)


def test_nccl_environment_uses_the_gpu() -> None:
    env = LaunchEnv.from_environ(environ={"MLX_RANK": "1", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "10.1.1.1",
                                          "NCCL_PORT": "12345"})
    assert (env.backend, env.size, env.coordinator) == ("nccl", 2, ("10.1.1.1", 12346))
    assert comm_device("nccl") == mx.Device(mx.gpu) and comm_device("ring") == mx.Device(mx.cpu)
    assert LaunchEnv.from_environ("nccl", {"MLX_RANK": "0", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "h",
                                           "NCCL_PORT": "1"}).backend == "nccl"


def test_jaccl_environment(tmp_path: pathlib.Path) -> None:
    devices = tmp_path / "ibv.json"
    devices.write_text(json.dumps([[None, "rdma_en3"], ["rdma_en3", None]]))
    env = LaunchEnv.from_environ(environ={"MLX_RANK": "0", "MLX_JACCL_COORDINATOR": "192.168.1.2:32323",
                                          "MLX_IBV_DEVICES": str(devices)})
    assert (env.backend, env.size, env.coordinator) == ("jaccl", 2, ("192.168.1.2", 32324))


@pytest.mark.parametrize("environ, message", [
    ({}, "no distributed launch environment"),
    ({"MLX_RANK": "x", "MLX_HOSTFILE": "/nonexistent"}, "MLX_RANK='x': expected an integer"),
    ({"MLX_RANK": "0", "MLX_HOSTFILE": "/nonexistent/h.json"}, "cannot read it"),
    ({"MLX_RANK": "0", "MLX_WORLD_SIZE": "1", "NCCL_HOST_IP": "h", "NCCL_PORT": "1"}, "at least 2 ranks"),
    ({"MLX_RANK": "2", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "h", "NCCL_PORT": "1"}, "outside the group of 2"),
    ({"MLX_RANK": "0", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "h", "NCCL_PORT": "1", COORDINATOR_VAR: "nohost"},
     "expected host:port"),
])
def test_bad_environments_name_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvError, match=message):
        LaunchEnv.from_environ(environ=environ)


def test_bad_hostfile(tmp_path: pathlib.Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"hosts": []}))
    with pytest.raises(LaunchEnvError, match='list per rank of "ip:port"'):
        LaunchEnv.from_environ(environ={"MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)})


# -- stage forwards compose into the one-process forward (bitwise) ------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pathlib.Path, list[int]]]:
    out = {}
    for model_type in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        root = tmp_path_factory.mktemp(model_type)
        model, config = tiny_model(model_type)
        save_model(root / "model", model)
        save_config(dict(config), root / "model" / "config.json")
        convert_model(root / "model", root / "store", progress=False)
        prompt = [int(t) for t in np.random.default_rng(3).integers(0, config["vocab_size"], 30)]
        out[model_type] = (root / "store", prompt)
    return out


#: prefill chunk: later chunks' masks depend on the cache offset (and gpt_oss's window)
CHUNK = 12


async def _one_process(store: pathlib.Path, prompt: list[int], tokens: int) -> tuple[list[int], list[np.ndarray]]:
    sm = load_streaming_model(store, completed=completed)
    fwd = sm.forward
    out, logits = [], []
    async with Runtime(sm.store, resident=0.25, side_rows=1) as rt:
        pred, cache = fwd.make_predictor("lookahead"), sm.make_cache()
        for i in range(0, len(prompt) - 1, CHUNK):
            await fwd(mx.array(prompt[i:min(i + CHUNK, len(prompt) - 1)])[None], cache, rt, pred, logits=False)
        inp = mx.array(prompt[-1:])
        for _ in range(tokens):
            lg = await fwd(inp[None], cache, rt, pred)
            await completed(lg)
            logits.append(np.array(lg))
            out.append(int(greedy(lg).item()))
            inp = mx.array(out[-1:])
    return out, logits


async def _stages(store: pathlib.Path, prompt: list[int], tokens: int, split: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """Each stage its own model (its weights only), its own store layers, its own Runtime and cache."""
    from asyncside.distributed.pipeline import StageSource

    plan = plan_for_store(store, len(split), split)
    models = [load_stage_model(store, plan, r, completed=completed) for r in range(plan.size)]
    out, logits = [], []
    async with contextlib.AsyncExitStack() as stack:
        rts = [await stack.enter_async_context(Runtime(sm.store, resident=0.25, side_rows=1))
               if plan.stage(r).moe_layers else None for r, sm in enumerate(models)]
        sent: list[list[tuple[int, Any]]] = [[] for _ in models]
        forwarded = [0] * plan.size

        def forward(r: int, layer: int, ids: Any) -> None:
            assert layer == plan.next_moe(r)
            sent[r].append((layer, ids))
            forwarded[r] += 1

        srcs = [StageSource(rts[r], plan.stage(r).moe_layers, plan.next_moe(r),
                            lambda layer, ids, r=r: forward(r, layer, ids)) for r in range(plan.size)]
        preds = [sm.forward.make_predictor("lookahead") for sm in models]
        caches = [sm.make_cache() for sm in models]

        async def step(t: mx.array, prefill: bool = False) -> mx.array:
            h = embed(models[0], t[None])
            for r, sm in enumerate(models):
                st = plan.stage(r)
                if r > 0:
                    h = mx.array(np.array(h))  # what the next rank receives: a fresh array
                    for layer, ids in sent[r - 1]:
                        srcs[r].prefetch(layer, ids)
                    sent[r - 1].clear()
                h = await run_layers(sm, h, caches[r], srcs[r], preds[r], start=st.start, stop=st.stop,
                                     prefill_end=prefill and r == plan.size - 1)
            return h

        for i in range(0, len(prompt) - 1, CHUNK):
            await step(mx.array(prompt[i:min(i + CHUNK, len(prompt) - 1)]), prefill=True)
        inp = mx.array(prompt[-1:])
        for _ in range(tokens):
            lg = head(models[-1], await step(inp))
            await completed(lg)
            logits.append(np.array(lg))
            out.append(int(greedy(lg).item()))
            inp = mx.array(out[-1:])
        # A stage with MoE layers predicts the next stage's first MoE layer, every step.
        for r in range(plan.size):
            predicts = bool(plan.stage(r).moe_layers) and plan.next_moe(r) is not None
            assert forwarded[r] == (len(range(0, len(prompt) - 1, CHUNK)) + tokens if predicts else 0)
    return out, logits


@pytest.mark.parametrize("model_type, split", [
    ("qwen3_moe", [2, 1]), ("qwen3_moe", [1, 2]), ("deepseek_v3", [1, 2]), ("deepseek_v3", [1, 1, 1]),
    ("gpt_oss", [1, 1]),
])
def test_stages_compose_bitwise(stores: Any, model_type: str, split: list[int]) -> None:
    store, prompt = stores[model_type]
    ref_tokens, ref_logits = anyio.run(_one_process, store, prompt, 6)
    tokens, logits = anyio.run(_stages, store, prompt, 6, split)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) == 6
    for a, b in zip(logits, ref_logits):
        assert np.array_equal(a, b)


def test_stage_model_holds_only_its_weights(stores: Any) -> None:
    from mlx.utils import tree_flatten

    from asyncside import _native

    store, _prompt = stores["qwen3_moe"]
    plan = plan_for_store(store, 2, [2, 1])
    sm = load_stage_model(store, plan, 1)
    assert list(sm.store.layers) == [2]
    params = dict(tree_flatten(sm.model.parameters()))
    loaded = {k for k, v in params.items() if _native.is_available(v)}
    assert any(k.startswith("model.layers.2.") for k in loaded)
    assert not any(k.startswith(("model.layers.0.", "model.layers.1.", "model.embed_tokens")) for k in loaded)
    assert any(k.startswith("lm_head") for k in loaded) and any(k.startswith("model.norm") for k in loaded)


def test_run_layers_checks_the_range(stores: Any) -> None:
    store, _prompt = stores["qwen3_moe"]
    sm = load_streaming_model(store, completed=completed)

    async def go() -> None:
        await run_layers(sm, mx.zeros((1, 1, 64)), sm.make_cache(), None, sm.forward.make_predictor("none"),
                         start=2, stop=4)

    with pytest.raises(ValueError, match=r"need 0 <= start < stop <= 3"):
        anyio.run(go)

    async def not_the_end() -> None:
        await run_layers(sm, mx.zeros((1, 1, 64)), sm.make_cache(), None, sm.forward.make_predictor("none"),
                         start=0, stop=2, prefill_end=True)

    with pytest.raises(ValueError, match=r"prefill_end needs the range to end the model \(stop=3\), got stop=2"):
        anyio.run(not_the_end)


def test_wake_floor_measures_both_forms() -> None:
    # (in a process of its own, as the benchmark runs it: it forks, and pins both processes)
    cpus = sorted(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, "-m", "asyncside.distributed.wakefloor", "-n", "20", "--gap-us", "100",
                           "--cpus", f"{cpus[0]},{cpus[-1]}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for form in ("idle", "back_to_back"):
        assert 0 < out[f"{form}_p10"] <= out[f"{form}_median"] <= out[f"{form}_p90"] < 1.0
    assert out["n"] == 20 and out["gap_s"] == pytest.approx(1e-4)
    bad = subprocess.run([sys.executable, "-m", "asyncside.distributed.wakefloor", "-n", "3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "-n must be at least 10" in bad.stderr


class _StubGroup:
    """The little of a DistGroup a ControlPlane uses: rank 0 of two, its links two sockets."""

    rank, next, prev = 0, 1, 1

    def __init__(self, to_next: socket.socket | None = None, from_prev: socket.socket | None = None) -> None:
        self.links = types.SimpleNamespace(to_next=to_next, from_prev=from_prev)

    def describe(self, rank: int) -> str:
        return f"rank {rank}"


def test_a_peer_is_silent_only_while_nothing_waits_unread() -> None:
    """The watchdog counts a peer silent only when nothing it sent waits in the socket: a rank
    whose own loop was held up (a GPU kernel compiled on first use) must not blame its peer."""
    from asyncside.distributed.control import ControlPlane, _Link
    from asyncside.distributed.group import FRAME, HEARTBEAT

    control = ControlPlane(_StubGroup(), heartbeat_s=0.1, peer_timeout_s=0.5)  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    try:
        link = _Link("from-prev", 1, ours, last=100.0, heard=True)
        assert not control._silent(link, 100.4)  # within the timeout
        assert control._silent(link, 101.0)  # nothing arrived: silent
        theirs.send(FRAME.pack(0, HEARTBEAT))  # the peer spoke while this loop was busy
        assert link.has_unread() and not control._silent(link, 101.0)
        assert link.last == 101.0 and link.has_unread()  # counted as heard; the frame is still the reader's
        assert ours.recv(64) == FRAME.pack(0, HEARTBEAT)
        assert not link.has_unread() and control._silent(link, 101.6)
        theirs.close()  # end-of-file: not "something to read" (the reader reports the lost peer)
        assert not link.has_unread()
    finally:
        ours.close()
        theirs.close()


def test_heartbeats_go_on_while_the_loop_is_held() -> None:
    """A rank's loop held for many heartbeat periods (a GPU kernel compiled on first use) still
    beats: the control plane's thread writes whole heartbeat frames between the loop's frames."""
    import threading
    import time

    from asyncside.distributed.control import ControlPlane
    from asyncside.distributed.group import FRAME, HEARTBEAT

    out_ours, out_peer = socket.socketpair()
    in_ours, in_peer = socket.socketpair()

    control = ControlPlane(_StubGroup(out_ours, in_ours), heartbeat_s=0.05, peer_timeout_s=5.0)  # type: ignore[arg-type]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(control.run)
            await anyio.sleep(0.2)  # the loop beats for itself meanwhile
            quiet = control.counters["heartbeats_from_thread"]
            time.sleep(0.6)  # noqa: ASYNC251 - held on purpose: twelve periods without the loop
            assert control.counters["heartbeats_from_thread"] - quiet >= 4
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
        for peer in (out_peer, in_peer):  # every byte that arrived parses as whole heartbeat frames
            peer.setblocking(False)
            data = b""
            with contextlib.suppress(BlockingIOError):
                while chunk := peer.recv(65536):
                    data += chunk
            frames = [FRAME.unpack_from(data, i) for i in range(0, len(data), FRAME.size)]
            assert len(data) % FRAME.size == 0 and len(frames) >= 6
            assert all(frame == (0, HEARTBEAT) for frame in frames)
        end = time.monotonic() + 2.0  # the thread ends with the control plane
        while any(t.name == "asyncside-heartbeat" for t in threading.enumerate()) and time.monotonic() < end:
            time.sleep(0.01)
        assert not any(t.name == "asyncside-heartbeat" for t in threading.enumerate())
    finally:
        for s in (out_ours, out_peer, in_ours, in_peer):
            s.close()
