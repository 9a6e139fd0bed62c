"""Serving through faults and shutdowns (issue 38): the API key, bounded headers, no host paths
for unauthenticated clients, graceful shutdown with streams in flight, one-line errors.

The model is the scripted one (tests/_serving_support.py), slowed per step where streams must
stay in flight; everything between HTTP and the model is the real code.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine

from asyncside.serving import BackgroundServer, ServeSettings, create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY = "s3cret-key"
LONG = "one two three four five six seven eight nine ten " * 4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def server(tokenizer: Any, *, step_delay: float = 0.0, description: dict[str, Any] | None = None,
           **settings: Any) -> BackgroundServer:
    model = ScriptedModel(tokenizer, "hello", {"count": LONG}, step_delay=step_delay)
    factory = scripted_engine(model)
    if description is not None:
        import contextlib

        from asyncside.serving import Engine

        @contextlib.asynccontextmanager
        async def factory() -> Any:  # type: ignore[no-redef]
            yield Engine(model=model, source=None, audit=lambda: (True, []), description=description)

    app = create_app(factory, ServeSettings(**{"prompt_cache_size": 0, "max_tokens_limit": 256, **settings}))
    return BackgroundServer(app)


@pytest.fixture(scope="module")
def keyed(tokenizer: Any) -> Iterator[BackgroundServer]:
    with server(tokenizer, api_key=KEY, description={"model": "/srv/models/secret-store", "resident": 0.25}) as s:
        yield s


def body(prompt: str = "hi", max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": "scripted", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


# --- item 6: the API key, headers, paths -------------------------------------------------------


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "Basic czNjcmV0LWtleQ==", f"Bearer {KEY}x", "Bearer"])
def test_requests_without_the_right_key_are_401(keyed: BackgroundServer, auth: str | None) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    for method, path, payload in [("POST", "/v1/completions", body()), ("GET", "/v1/models", None),
                                  ("GET", "/metrics", None), ("POST", "/v1/chat/completions", {})]:
        r = httpx.request(method, keyed.url + path, json=payload, headers=headers)
        assert r.status_code == 401, (path, auth, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_the_right_key_is_served(keyed: BackgroundServer) -> None:
    ok = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(keyed.url + "/v1/completions", json=body(), headers=ok)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hell"
    assert httpx.get(keyed.url + "/v1/models", headers=ok).status_code == 200
    assert 'status="401"' in httpx.get(keyed.url + "/metrics", headers=ok).text


def test_health_is_open_but_names_no_host_path_without_the_key(keyed: BackgroundServer) -> None:
    anonymous = httpx.get(keyed.url + "/health")
    assert anonymous.status_code == 200
    assert "/srv/models" not in anonymous.text and anonymous.json()["engine"]["model"] == "secret-store"
    known = httpx.get(keyed.url + "/health", headers={"Authorization": f"Bearer {KEY}"})
    assert known.json()["engine"]["model"] == "/srv/models/secret-store"


def test_oversized_headers_are_refused(keyed: BackgroundServer) -> None:
    big = {"Authorization": f"Bearer {KEY}", "X-Padding": "a" * 20_000}
    r = httpx.post(keyed.url + "/v1/completions", json=body(), headers=big)
    assert r.status_code == 431
    many = {"Authorization": f"Bearer {KEY}", **{f"X-P{i}": "b" * 900 for i in range(40)}}
    assert httpx.get(keyed.url + "/v1/models", headers=many).status_code == 431
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_no_key_configured_serves_everyone_but_hides_paths(tokenizer: Any) -> None:
    with server(tokenizer, description={"model": "/home/someone/store"}) as s:
        assert httpx.post(s.url + "/v1/completions", json=body()).status_code == 200
        health = httpx.get(s.url + "/health")
        assert "/home/someone" not in health.text and health.json()["engine"]["model"] == "store"


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncside.cli import build_parser
    from asyncside.serving.cli import settings_from_args

    monkeypatch.setenv("ASYNCSIDE_API_KEY", "from-env")
    assert settings_from_args(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert settings_from_args(build_parser().parse_args(["serve", "--api-key", "given"])).api_key == "given"
    monkeypatch.delenv("ASYNCSIDE_API_KEY")
    assert settings_from_args(build_parser().parse_args(["serve"])).api_key is None
    assert "given" not in repr(settings_from_args(build_parser().parse_args(["serve", "--api-key", "given"])))


# --- item 3: graceful shutdown ----------------------------------------------------------------


def read_stream(url: str, prompt: str, max_tokens: int, started: threading.Event | None,
                out: list[dict[str, Any]]) -> None:
    """Stream one completion; appends {'events': [...], 'done': bool, 'status': int}."""
    events: list[Any] = []
    done = False
    with httpx.stream("POST", url + "/v1/completions", json=body(prompt, max_tokens, stream=True),
                      timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            events.append(json.loads(data))
            if started is not None:
                started.set()
    out.append({"events": events, "done": done, "status": r.status_code})


def start_streams(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    threads = []
    for _ in range(n):
        started = threading.Event()
        t = threading.Thread(target=read_stream, args=(url, "count", max_tokens, started, out), daemon=True)
        t.start()
        assert started.wait(60), "a stream never sent its first chunk"
        threads.append(t)
    return threads, out


def test_stop_lets_streams_in_flight_finish_and_refuses_new_ones(tokenizer: Any) -> None:
    s = server(tokenizer, step_delay=0.02, shutdown_grace=60).start()
    threads, out = start_streams(s.url, 4, 60)
    stopper = threading.Thread(target=s.stop, daemon=True)
    stopper.start()
    state = s.app.state.asyncside
    while not state.draining:
        threading.Event().wait(0.01)
    refused = httpx.post(s.url + "/v1/completions", json=body())
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "server_shutting_down"
    for t in threads:
        t.join(120)
    stopper.join(120)
    assert not stopper.is_alive()
    assert len(out) == 4
    for r in out:
        assert r["done"] and r["status"] == 200
        assert r["events"][-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in r["events"])
        assert "".join(e["choices"][0]["text"] for e in r["events"]) == LONG[:60]


def test_streams_past_the_grace_end_with_an_error_event_and_done(tokenizer: Any) -> None:
    s = server(tokenizer, step_delay=0.05, shutdown_grace=0.3).start()
    threads, out = start_streams(s.url, 3, 200)  # 200 steps of 50 ms: far past the grace
    s.stop()
    for t in threads:
        t.join(60)
    assert len(out) == 3
    for r in out:
        assert r["done"], r
        assert r["events"][-1]["error"]["code"] == "server_shutting_down"
        assert len(r["events"]) < 200


SERVER_SCRIPT = textwrap.dedent("""
    import sys, uvloop
    sys.path.insert(0, {tests!r})
    from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine
    from asyncside.serving import ServeSettings, create_app, serve

    tok = byte_tokenizer({tmp!r})
    model = ScriptedModel(tok, "hello", {{"count": {long!r}}}, step_delay=0.05)
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_tokens_limit=256,
                                                           shutdown_grace={grace}))
    uvloop.run(serve(app, "127.0.0.1", 0, on_ready=lambda url: print(url, flush=True)))
    print("clean exit", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_with_streams_in_flight_drains_and_exits_0(tmp_path: pathlib.Path, sig: int) -> None:
    script = SERVER_SCRIPT.format(tests=str(pathlib.Path(__file__).parent), tmp=str(tmp_path), long=LONG,
                                  grace=0.5)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, proc.stderr.read() if proc.stderr else "")
        threads, out = start_streams(url, 8, 200)  # far longer than the grace: each is ended
        proc.send_signal(sig)
        for t in threads:
            t.join(60)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "clean exit" in stdout
    assert "Traceback" not in stderr, stderr
    assert len(out) == 8
    for r in out:
        assert r["done"] and r["events"][-1]["error"]["code"] == "server_shutting_down", r["events"][-2:]


# --- item 4: expected errors are one line ----------------------------------------------------


@pytest.mark.parametrize("layout", ["empty", "torn manifest", "staging only"])
@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["bench", "serve"]])
def test_a_bad_store_is_one_line_and_a_nonzero_status(tmp_path: pathlib.Path, layout: str,
                                                      command: list[str]) -> None:
    store = tmp_path / "store"
    if layout == "staging only":  # a convert killed before its rename: the staging directory beside
        (tmp_path / ".store.convert-1234").mkdir()
        (tmp_path / ".store.convert-1234" / "manifest.json").write_text("{}")
    else:
        store.mkdir()
        if layout == "torn manifest":
            (store / "manifest.json").write_text('{"format": "asyncside-expert-store", "layers": [')
            (store / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "asyncside", *command, "--model", str(store)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (1, 2), proc.stderr  # 2: refused while the options are parsed
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    # A bench names its subcommand as argparse does ("asyncside bench serve: ...").
    prefix = " ".join(command[:2]) if command[0] == "bench" else command[0]
    assert lines[0].startswith(f"asyncside {prefix}: ") and str(store) in lines[0], lines


# --- item 2: health that tells the truth, and heals ---------------------------------------------


@pytest.fixture
def store_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    """The embedded model's store, hard-linked file by file except layer 3's blob (copied: it is damaged)."""
    import shutil

    from asyncside.serving import embedded_store_dir

    src = pathlib.Path(embedded_store_dir(None))
    copy = tmp_path / "store"
    copy.mkdir()
    for f in src.iterdir():
        try:
            if not f.name.startswith("layer-") or f.name == "layer-00003.bin":
                raise OSError
            os.link(f, copy / f.name)
        except OSError:  # that one, small files, or another filesystem
            shutil.copy(f, copy / f.name)
    return copy


def wait_for(predicate: Any, what: str, limit_s: float = 120.0) -> None:
    """Poll ``predicate`` until true; a hang guard (generous), never a timing assertion."""
    import time

    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def test_health_degrades_on_a_damaged_blob_names_it_and_heals_when_it_is_replaced(store_copy: pathlib.Path) -> None:
    from asyncside.serving import open_engine
    from asyncside.store import ExpertStore

    spec = ExpertStore.open(store_copy).layer(3)
    whole = spec.path.read_bytes()
    app = create_app(lambda: open_engine(str(store_copy), resident=0.25),
                     ServeSettings(max_tokens_limit=16, prompt_cache_size=0, health_recheck_s=0.2))
    ask = {"model": None, "prompt": "The quick brown fox jumps over the lazy dog and", "max_tokens": 6}
    with BackgroundServer(app) as s:
        ask["model"] = s.app.state.asyncside.model_id
        good = httpx.post(s.url + "/v1/completions", json=ask, timeout=120)
        assert good.status_code == 200 and httpx.get(s.url + "/health").status_code == 200
        expected = good.json()["choices"][0]["text"]

        # Flipped in place, under the running server: every record of layer 3.
        damaged = bytearray(whole)
        for e in range(spec.n_experts):
            damaged[spec.record_offset(e) + spec.segments[0].offset] ^= 0x40
        spec.path.write_bytes(damaged)
        bad = httpx.post(s.url + "/v1/completions", json=ask, timeout=120)
        assert bad.status_code == 500
        message = bad.json()["error"]["message"]
        assert "layer 3 expert" in message and "checksum mismatch" in message, message
        assert str(store_copy) not in message and "ExceptionGroup" not in message
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        faults = health.json()["bad_experts"]
        assert faults and all(f["file"] == "layer-00003.bin" and f["layer"] == 3 for f in faults), faults
        assert "checksum mismatch" in faults[0]["cause"]
        metrics = httpx.get(s.url + "/metrics").text
        assert "asyncside_bad_experts 0" not in metrics and "asyncside_expert_read_failures_checksum 0" not in metrics

        # Restored as a new file (another inode): the server re-opens it, verifies, heals.
        fresh = spec.path.with_name("layer-00003.bin.new")
        fresh.write_bytes(whole)
        os.replace(fresh, spec.path)
        wait_for(lambda: httpx.get(s.url + "/health").status_code == 200, "healed after the blob was replaced")
        again = httpx.post(s.url + "/v1/completions", json=ask, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
        metrics = httpx.get(s.url + "/metrics").text
        assert "asyncside_bad_experts 0" in metrics and "asyncside_blobs_reopened 1" in metrics

        # Truncated in place: a short read, named; repaired in place: healed.
        os.truncate(spec.path, spec.record_offset(spec.n_experts // 2))
        short = httpx.post(s.url + "/v1/completions", json=ask, timeout=120)
        if short.status_code == 500:  # the prompt may route only to intact records of the layer
            assert "short read" in short.json()["error"]["message"]
            assert httpx.get(s.url + "/health").status_code == 503
        spec.path.write_bytes(whole)
        wait_for(lambda: httpx.get(s.url + "/health").status_code == 200, "healed after an in-place repair")
        assert httpx.post(s.url + "/v1/completions", json=ask, timeout=120).json()["choices"][0]["text"] == expected
