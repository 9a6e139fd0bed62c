"""``asyncside serve STORE --pipeline``: two ranks over loopback, HTTP on rank 0.

Completions (one, then several streaming at once) equal one process's greedy text, and SIGINT on
rank 0 shuts both ranks down cleanly (status 0: the steps in flight drained, then the barrier).
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

import _models_support
import anyio
import pytest
from _models_support import tiny_model
from mlx_lm.utils import save_config, save_model

from asyncside.bridge import completed
from asyncside.distributed.launcher import LocalLaunch, free_ports
from asyncside.models import convert_model, load_streaming_model
from asyncside.models.tokenizer import ByteTokenizer
from asyncside.runtime import Runtime

DEADLINE = 150.0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # The byte tokenizer needs a vocabulary of at least 258 ids.
    _models_support.BASE.setdefault("qwen3_moe_bytes", dict(_models_support.BASE["qwen3_moe"], vocab_size=258))
    root = tmp_path_factory.mktemp("serve")
    model, config = tiny_model("qwen3_moe_bytes", seed=2)
    save_model(root / "model", model)
    save_config(dict(config), root / "model" / "config.json")
    ByteTokenizer(258).save(root / "model")
    convert_model(root / "model", root / "store", progress=False)
    return root / "store"


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
