"""Pipelines of real ranks: each rank a subprocess over loopback (the ring backend) with a deadline.

Tokens and logits equal one process bit for bit (every rank with its own Runtime over its own
store layers, concurrent requests pipelined); a crashed or hung peer is an error on the other
rank, not a hang; a peer that never comes up is given up on at the deadline; ranks with
different plans refuse to form a group; the launcher's status reflects a failed rank. The NCCL
variant needs two GPUs and is skipped without them.
"""

from __future__ import annotations

import json
import pathlib
import signal
import sys
import time
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside.bridge import completed
from asyncside.distributed.launcher import LaunchResult, LocalLaunch, python_argv
from asyncside.distributed.stage_forward import greedy
from asyncside.models import convert_model, load_streaming_model
from asyncside.runtime import Runtime

from _models_support import tiny_model

#: every launch must end well before this (seconds); a hang fails the test instead of stalling CI
DEADLINE = 150.0
TOKENS = 6


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pathlib.Path, list[int]]]:
    out = {}
    for model_type in ("qwen3_moe", "deepseek_v3"):
        root = tmp_path_factory.mktemp(model_type)
        model, config = tiny_model(model_type, seed=1)
        save_model(root / "model", model)
        save_config(dict(config), root / "model" / "config.json")
        convert_model(root / "model", root / "store", progress=False)
        prompt = [int(t) for t in np.random.default_rng(5).integers(0, config["vocab_size"], 20)]
        out[model_type] = (root / "store", prompt)
    return out


def _rank_args(store: pathlib.Path, prompt: list[int], *extra: str) -> list[str]:
    return python_argv(str(store), "--prompt-ids", ",".join(map(str, prompt)), "--side-rows", "1",
                       "--join-timeout", "30", *extra)


def _report(res: LaunchResult) -> str:
    return "\n".join(f"--- rank {r.rank}: status {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"
                     for r in res.ranks)


async def _reference(store: pathlib.Path, prompt: list[int], tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """One process, one request: tokens and every step's logits (until EOS, as generate stops)."""
    sm = load_streaming_model(store, completed=completed)
    fwd = sm.forward
    eos = set(getattr(sm.tokenizer, "eos_token_ids", ()) or ())
    out: list[int] = []
    logits: list[np.ndarray] = []
    async with Runtime(sm.store, resident=0.25, side_rows=1) as rt:
        pred, cache = fwd.make_predictor("lookahead"), sm.make_cache()
        await fwd(mx.array(prompt[:-1])[None], cache, rt, pred, logits=False)
        inp = mx.array(prompt[-1:])
        for _ in range(tokens):
            lg = await fwd(inp[None], cache, rt, pred)
            await completed(lg)
            logits.append(np.array(lg))
            tok = int(greedy(lg).item())
            if tok in eos:
                break
            out.append(tok)
            inp = mx.array([tok])
    return out, logits


@pytest.mark.parametrize("model_type, split", [("qwen3_moe", None), ("deepseek_v3", "1,2")])
def test_two_ranks_equal_one_process(stores: Any, tmp_path: pathlib.Path, model_type: str, split: str | None) -> None:
    """Two concurrent requests through two ranks: tokens and logits bitwise one process's.

    deepseek_v3 split 1,2 gives rank 0 only the dense first layer (no experts, no Runtime).
    """
    store, prompt = stores[model_type]
    extra = ["--tokens", str(TOKENS), "--requests", "2", "--keep-logits", "--out", str(tmp_path)]
    if split:
        extra += ["--split", split]
    with LocalLaunch([_rank_args(store, prompt, *extra)] * 2) as launch:
        res = launch.wait(DEADLINE)
    assert res.ok, _report(res)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    refs = [anyio.run(_reference, store, p, TOKENS) for p in r0["prompts"]]
    assert r0["tokens"] == [t for t, _ in refs]
    assert all(len(t) == TOKENS for t in r0["tokens"])  # these seeds generate no EOS early
    kept = np.load(tmp_path / "logits.npz")
    by_request: dict[str, list[np.ndarray]] = {}
    for key in sorted(kept.files, key=lambda k: (k.split("_")[0], int(k.split("_")[1]))):
        by_request.setdefault(key.split("_")[0], []).append(kept[key])
    assert len(by_request) == 2
    unmatched = [logits for _, logits in refs]
    for got in by_request.values():
        match = [i for i, ref in enumerate(unmatched)
                 if len(ref) == len(got) and all(np.array_equal(a, b) for a, b in zip(ref, got))]
        assert match, "a request's logits differ from one process's"
        unmatched.pop(match[0])
    # Each rank streamed its own layers only, with its own Runtime.
    stage0, stage1 = r0["stage"], r1["stage"]
    assert stage0["stop"] == stage1["start"] and stage0["start"] == 0
    if stage0["moe_layers"]:
        assert r0["pool_bytes"] > 0 and r0["stats"]["runtime"]["fills"] >= 0
    else:
        assert r0["pool_bytes"] == 0 and "runtime" not in r0["stats"]
    assert r1["stats"]["runtime"]["bytes_read"] > 0
    # Rank 0's last MoE layer predicts rank 1's first; the ids crossed ahead of the hidden states.
    if stage0["moe_layers"]:
        assert r0["stats"]["predictions_sent"] > 0 and r1["stats"]["predictions_received"] > 0
    assert r1["stats"]["steps"] == r0["stats"]["steps"] == 2 * (1 + TOKENS)


def _launch_and_wait_for_tokens(store: pathlib.Path, prompt: list[int], *extra: str) -> LocalLaunch:
    launch = LocalLaunch([_rank_args(store, prompt, "--tokens", "100000", "--echo", *extra)] * 2).start()
    end = time.monotonic() + DEADLINE
    while "token" not in launch.output(0):
        if time.monotonic() > end or not (launch.running(0) and launch.running(1)):
            launch.close()
            pytest.fail("the ranks never produced a token:\n" + launch.output(0, "err") + launch.output(1, "err"))
        time.sleep(0.05)
    return launch


@pytest.mark.parametrize("victim", [1, 0])
def test_a_crashed_peer_is_an_error_not_a_hang(stores: Any, victim: int) -> None:
    store, prompt = stores["qwen3_moe"]
    launch = _launch_and_wait_for_tokens(store, prompt)
    try:
        launch.kill(victim, signal.SIGKILL)
        res = launch.wait(DEADLINE, grace_s=60.0)
    finally:
        launch.close()
    survivor = res.ranks[1 - victim]
    assert not res.deadline_passed and not survivor.killed, _report(res)
    assert survivor.returncode == 3, _report(res)
    assert (f"rank {victim} (127.0.0.1) closed its control link without a goodbye: its process exited or was "
            "killed") in survivor.stderr
    assert res.returncode == 3 and f"rank {victim} was killed by signal 9" in (res.reason or "")


def test_a_hung_peer_is_an_error(stores: Any) -> None:
    store, prompt = stores["qwen3_moe"]
    launch = _launch_and_wait_for_tokens(store, prompt, "--peer-timeout", "2")
    try:
        launch.kill(1, signal.SIGSTOP)
        end = time.monotonic() + DEADLINE
        while launch.running(0) and time.monotonic() < end:
            time.sleep(0.05)
        launch.kill(1, signal.SIGKILL)
        res = launch.wait(DEADLINE)
    finally:
        launch.close()
    assert res.ranks[0].returncode == 3, _report(res)
    assert "no word from rank 1 (127.0.0.1) for" in res.ranks[0].stderr
    assert "it hung or its host is unreachable" in res.ranks[0].stderr


@pytest.mark.parametrize("alone", [0, 1])
def test_a_missing_peer_is_given_up_at_the_deadline(stores: Any, alone: int) -> None:
    """Only one rank of two starts: it gives up after --join-timeout, naming the other."""
    store, prompt = stores["qwen3_moe"]
    with LocalLaunch([_rank_args(store, prompt, "--join-timeout", "2")] * 2, skip=[1 - alone]) as launch:
        res = launch.wait(DEADLINE, grace_s=60.0)
    mine = res.ranks[alone]
    assert mine.returncode == 3, _report(res)
    if alone == 0:
        assert "rank 1 (127.0.0.1) did not reach the coordinator" in mine.stderr and "within 2 s" in mine.stderr
    else:
        assert "rank 0 (the coordinator) at 127.0.0.1:" in mine.stderr and "never came up" in mine.stderr


def test_ranks_with_different_plans_refuse_to_start(stores: Any) -> None:
    store, prompt = stores["qwen3_moe"]
    argv = [_rank_args(store, prompt, "--split", "2,1"), _rank_args(store, prompt, "--split", "1,2")]
    with LocalLaunch(argv) as launch:
        res = launch.wait(DEADLINE, grace_s=60.0)
    assert res.ranks[0].returncode == 1 and res.ranks[1].returncode == 1, _report(res)
    assert "rank 1 runs 'layers=3 split=1,2' but rank 0 runs 'layers=3 split=2,1'" in res.ranks[0].stderr
    assert "rank 0 refused the group: rank 1 runs" in res.ranks[1].stderr


def test_launch_status_reflects_a_failed_rank(tmp_path: pathlib.Path) -> None:
    argv = [[sys.executable, "-c", "import sys; sys.exit(5)"], [sys.executable, "-c", "import time; time.sleep(600)"]]
    with LocalLaunch(argv) as launch:
        res = launch.wait(DEADLINE, grace_s=1.0)
    assert res.returncode == 5 and not res.ok
    assert res.ranks[1].killed and res.reason == "rank 0 exited with status 5; rank 1 was stopped by the launcher"
    with LocalLaunch([[sys.executable, "-c", "import time; time.sleep(600)"]] * 2) as launch:
        res = launch.wait(1.0)
    assert res.deadline_passed and res.returncode == 124 and "deadline" in (res.reason or "")


def _gpus() -> int:
    try:
        return mx.device_count(mx.gpu) if mx.distributed.is_available(backend="nccl") else 0
    except (RuntimeError, ValueError):
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs MLX's NCCL backend and two GPUs")
def test_two_gpus_over_nccl_equal_one_gpu(stores: Any, tmp_path: pathlib.Path) -> None:
    store, prompt = stores["qwen3_moe"]
    extra = ["--tokens", str(TOKENS), "--backend", "nccl", "--out", str(tmp_path)]
    with LocalLaunch([_rank_args(store, prompt, *extra)] * 2, backend="nccl") as launch:
        res = launch.wait(DEADLINE)
    assert res.ok, _report(res)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["backend"] == "nccl"
    assert r0["tokens"] == [anyio.run(_reference, store, prompt, TOKENS)[0]]
