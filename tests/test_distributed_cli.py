"""The pipeline's commands: ``serve STORE --pipeline``, ``demo --ranks 2``, ``bench pipeline``.

Two ranks over loopback each time. Served completions (one, then several streaming at once)
equal one process's greedy text, and SIGINT on rank 0 shuts both ranks down cleanly (status 0:
the steps in flight drained, then the barrier). The demo reports identical tokens; the benchmark
runs end to end (its numbers are not asserted).
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import signal
import sys
import time
import urllib.request
from typing import Any

import anyio
import pytest

from asyncside.bridge import completed
from asyncside.distributed.launcher import LocalLaunch, free_ports
from asyncside.models import load_streaming_model
from asyncside.runtime import Runtime

from _models_support import byte_model_store

DEADLINE = 150.0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return byte_model_store(tmp_path_factory.mktemp("serve"))


async def _one_process(store: pathlib.Path, prompt: str, tokens: int) -> str:
    sm = load_streaming_model(store, completed=completed)
    async with Runtime(sm.store, resident=0.25) as rt:
        out = [t async for t in sm.generate(sm.tokenizer.encode(prompt), max_tokens=tokens, source=rt)]
    return sm.tokenizer.decode(out)


def _post(port: int, body: dict[str, Any]) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


def _streamed_text(sse: str) -> str:
    text = ""
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_serve_pipeline_answers_like_one_process(store: pathlib.Path) -> None:
    port = free_ports(1)[0]
    cmd = [sys.executable, "-c", "import sys; from asyncside.cli import main; sys.exit(main())",
           "serve", str(store), "--pipeline", "--port", str(port), "--join-timeout", "30"]
    with LocalLaunch([cmd, cmd]) as launch:
        end = time.monotonic() + DEADLINE
        while f"http://127.0.0.1:{port}" not in launch.output(0):
            if time.monotonic() > end or not (launch.running(0) and launch.running(1)):
                pytest.fail("the pipeline server did not start:\n" + launch.output(0, "err") + launch.output(1, "err"))
            time.sleep(0.1)
        model_id = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30).read())["data"][0]["id"]
        prompts = [f"Route {i} to the experts. " for i in range(4)]
        single = json.loads(_post(port, {"model": model_id, "prompt": prompts[0], "max_tokens": 8}))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streamed = list(pool.map(lambda p: _post(port, {"model": model_id, "prompt": p, "max_tokens": 8,
                                                            "stream": True}), prompts[1:]))
        launch.kill(0, signal.SIGINT)
        res = launch.wait(DEADLINE)
    assert res.ok, res.reason + "".join(r.stderr[-2000:] for r in res.ranks)
    assert "runs layers 2..2" in res.ranks[1].stdout
    expected = [anyio.run(_one_process, store, p, 8) for p in prompts]
    assert all(expected) and len(set(expected)) > 1  # real text, not all alike
    assert single["choices"][0]["text"] == expected[0]
    assert [_streamed_text(s) for s in streamed] == expected[1:]


def test_demo_ranks_json(store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import main

    capsys.readouterr()
    assert main(["demo", "--ranks", "2", "--model", str(store), "--tokens", "5", "--json", "--join-timeout", "30"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] is True and res["launch"]["returncode"] == 0
    assert res["split"] == [2, 1] and res["backend"] == "ring"
    assert [r["layers"] for r in res["per_rank"]] == [[0, 2], [2, 3]]
    pools = [r["pool_bytes"] for r in res["per_rank"]]
    assert all(p > 0 for p in pools) and sum(pools) == res["single_process"]["pool_bytes"]
    assert res["text"] == res["reference_text"] != ""
    assert res["per_rank"][0]["predictions_sent"] > 0 and res["per_rank"][1]["predictions_received"] > 0


def test_demo_ranks_refuses_a_bad_split(store: pathlib.Path) -> None:
    from asyncside.cli import main

    with pytest.raises(SystemExit, match="asyncside demo: --split 1,1: .* sum to the model's 3 decoder layers"):
        main(["demo", "--ranks", "2", "--model", str(store), "--split", "1,1"])


def test_bench_pipeline_quick(store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import main

    capsys.readouterr()
    assert main(["bench", "pipeline", "--quick", "--json", "--model", str(store), "--requests", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    s = res["summary"]
    assert s["tokens_identical"] is True and len(res["rounds"]) == 1
    assert s["aggregate_ratio_median"] > 0 and s["boundary_ms_per_step_median"] > 0
    ping = res["rounds"][0]["pipeline"]["ping_ms"]
    assert 0 < ping["raw_median"] and 0 < ping["p10"] <= ping["median"] <= ping["p90"]
    floor = res["rounds"][0]["pipeline"]["wake_floor_ms"]
    assert 0 < floor["idle_p10"] <= floor["idle_median"] <= floor["idle_p90"] and floor["back_to_back_median"] > 0
    assert s["wake_floor_ms_median"] == floor["idle_median"] and s["raw_transfer_ms_median"] == ping["raw_median"]
    assert s["pool_bytes"]["single"] == sum(s["pool_bytes"]["ranks"]) and all(s["max_rss_bytes"]["ranks"])


@pytest.mark.parametrize(("argv", "said"), [
    (["--peer-timeout", "0"], "--peer-timeout 0: expected a finite number of seconds > 0"),
    (["--join-timeout", "-1"], "--join-timeout -1: expected a finite number of seconds > 0"),
    (["--side-rows", "-3"], "--side-rows -3: expected a number of rows >= 0"),
    (["--split", "2,0"], "--split 2,0: expected a count >= 1 of decoder layers for each rank"),
    (["--tokens", "0"], "--tokens"),
    (["--requests", "0"], "--requests"),
    (["--ping", "-1"], "--ping"),
])
def test_a_rank_refuses_bad_stage_options_before_it_joins(argv: list[str], said: str, tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m asyncside.distributed STORE --peer-timeout 0`` (and the others) were taken unchecked:
    a rank refuses them as a usage error (exit 2) before it looks for its peers."""
    from asyncside.distributed import group, rank

    def no_join(*a: Any, **k: Any) -> None:
        raise AssertionError("the rank went on to meet its peers")

    monkeypatch.setattr(group.LaunchEnv, "from_environ", no_join)
    with pytest.raises(SystemExit) as exited:
        rank.main([str(tmp_path), *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
