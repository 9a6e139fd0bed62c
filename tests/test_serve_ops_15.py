"""``asyncside serve`` as an operator runs it, round 15: a drain that waits for the load balancer to
see /health fail, the default request body limit of a context of millions of tokens, bench serve's
mlx_lm.server logs left in $TMPDIR, /metrics read by a real Prometheus parser and probes across a
server's life, restarts on the same port, and a stderr that nobody reads.

The servers run the real command line (``asyncside.cli.main``) in a child process, with the
scripted model (tests/_serving_support.py) in place of a store: everything between the socket and
the model is the real code.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, read_stream, scripted_engine

from asyncside.serving import BackgroundServer, ServeSettings, create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LONG = "one two three four five six seven eight nine ten " * 4
#: a hang guard for each request (generous), never a timing assertion
HELD = 60.0

#: ``asyncside serve ARGS`` through the console script's entry point, the engine the scripted model
SERVE_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine
    import asyncside.serving.cli as serve_cli
    from asyncside.cli import main

    model = ScriptedModel(byte_tokenizer({tmp!r}), "hello", {{"count": {long!r}}}, step_delay={delay})
    serve_cli.engine_factory_from_args = lambda args: scripted_engine(model)
    sys.exit(main(["serve", *sys.argv[1:]]))
""")


def _signals_by_default() -> None:
    """In the child: the signals these tests send at their default disposition (a test runner
    started under ``nohup`` hands its children SIGHUP and SIGINT ignored)."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_argv(tmp: pathlib.Path, *args: str, reply: str = LONG) -> list[str]:
    script = SERVE_SCRIPT.format(tests=str(pathlib.Path(__file__).parent), tmp=str(tmp), long=reply, delay=0.02)
    return [sys.executable, "-c", script, *args]


@contextlib.contextmanager
def _serving(tmp: pathlib.Path, *args: str, stderr: Any = subprocess.PIPE,
             reply: str = LONG) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``asyncside serve ARGS`` (the scripted model) and its URL, from the line it prints once it
    serves; killed on the way out if it has not exited by then."""
    proc = subprocess.Popen(_serve_argv(tmp, *args, reply=reply), stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}, preexec_fn=_signals_by_default)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("asyncside serve: http://127.0.0.1:"), (line, proc.poll())
        yield proc, line.split()[2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stream(url: str, out: list[dict[str, Any]], started: threading.Event, max_tokens: int = 200) -> None:
    result = read_stream(url, started, max_tokens=max_tokens, timeout=HELD * 2, status=200)
    started.set()
    out.append(result)


def _streams(url: str, n: int, max_tokens: int = 200) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    threads = []
    for _ in range(n):
        started = threading.Event()
        threads.append(threading.Thread(target=_stream, args=(url, out, started, max_tokens), daemon=True))
        threads[-1].start()
        assert started.wait(HELD), "a stream never sent its first chunk"
    return threads, out


# --- item 1: a drain delay --------------------------------------------------------------------------


def test_drain_delay_keeps_serving_while_health_says_draining(tmp_path: pathlib.Path) -> None:
    """On SIGTERM the server refused new requests at once, before a load balancer's health check
    (every 5-30 s) had seen /health fail: the requests it routed meanwhile got 503. With
    ``--drain-delay`` /health answers 503 "draining" at once while requests are still taken and
    served, streams in flight go on, and a second signal skips the delay and the grace: the
    streams end with their error event, and the process exits 0 without a traceback."""
    with _serving(tmp_path, "--port", "0", "--drain-delay", "600", "--shutdown-grace", "600",
                  "--max-tokens-limit", "1000", reply=LONG * 20) as (proc, url):
        threads, out = _streams(url, 2, max_tokens=900)  # the scripted context: 1024
        proc.send_signal(signal.SIGTERM)
        while httpx.get(url + "/health", timeout=HELD).status_code != 503:
            time.sleep(0.02)
        health = httpx.get(url + "/health", timeout=HELD)
        assert health.json()["status"] == "draining" and health.json()["active_requests"] == 2, health.text
        # Still taken and served while the balancer has not yet acted on the failed check.
        r = httpx.post(url + "/v1/completions", timeout=HELD, json={"model": "scripted", "prompt": "x",
                                                                    "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hel", r.text
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # the operator's second signal: skip the delay and the grace
        stdout, stderr = proc.communicate(timeout=HELD * 2)
        for t in threads:
            t.join(HELD)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert len(out) == 2
    for r in out:
        assert r["done"] and r["events"][-1]["error"]["code"] == "server_shutting_down", r["events"][-1:]


def test_drain_delay_ends_by_itself_and_a_stream_in_flight_finishes(tmp_path: pathlib.Path) -> None:
    with _serving(tmp_path, "--port", "0", "--drain-delay", "0.5", "--shutdown-grace", "600") as (proc, url):
        threads, out = _streams(url, 1, max_tokens=60)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=HELD * 2)
        threads[0].join(HELD)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    [r] = out
    assert r["done"] and r["events"][-1]["choices"][0]["finish_reason"] == "length", r["events"][-1:]
    assert "".join(e["choices"][0]["text"] for e in r["events"]) == LONG[:60]


@pytest.mark.parametrize("bad", ["-1", "inf", "nan", "soon"])
def test_drain_delay_on_the_command_line(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import build_parser
    from asyncside.serving.settings import settings_from_args

    parse = build_parser(["serve"]).parse_args
    assert settings_from_args(parse(["serve"])).drain_delay == 0.0  # the drain starts at once, as before
    assert settings_from_args(parse(["serve", "--drain-delay", "15"])).drain_delay == 15.0
    with pytest.raises(SystemExit) as info:
        parse(["serve", "--drain-delay", bad])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("asyncside serve: error: argument --drain-delay: expected seconds >= 0"), err
    with pytest.raises(ValueError, match="drain_delay"):
        ServeSettings(drain_delay=-1.0)


# --- item 2: the default body limit is capped --------------------------------------------------------


def test_the_default_body_limit_of_a_context_of_millions_of_tokens_is_capped() -> None:
    """The default followed the context uncapped: llama4's declared 10485760 tokens of 6-digit ids
    let each connection make the server hold about 80 MiB of body. It stops at 8 MiB (about a
    million ids), where long-context models of today still fit."""
    from asyncside.serving.settings import MAX_BODY_LIMIT, MIN_BODY_LIMIT, default_body_limit

    assert MAX_BODY_LIMIT == 8 << 20
    assert default_body_limit(10_485_760, 202_048) == MAX_BODY_LIMIT
    assert default_body_limit(262_144, 151_936) == 262_144 * 8 + (64 << 10)  # unchanged below the cap
    assert default_body_limit(1_010_000, 151_936) < MAX_BODY_LIMIT  # a million-token context's ids fit
    assert default_body_limit(512, 32_000) == default_body_limit(None, None) == MIN_BODY_LIMIT


def test_an_explicit_body_limit_wins_over_the_cap(tmp_path: pathlib.Path) -> None:
    body = b" " * (9 << 20)  # past the cap; whitespace: a 400 once it is read whole
    model = ScriptedModel(byte_tokenizer(tmp_path), "hello", context=10_485_760)
    with BackgroundServer(create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0))) as srv:
        r = httpx.post(srv.url + "/v1/completions", content=body, timeout=HELD,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"], r.text
        assert str(8 << 20) in r.json()["error"]["message"], r.text
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_body_bytes=32 << 20))
    with BackgroundServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", content=body, timeout=HELD,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text


# --- item 3: bench serve's mlx_lm.server log ---------------------------------------------------------


def _stand_in(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx_lm.server replaced by a process that never answers (a model that loads for long)."""
    fake = tmp_path / "python"
    # SIGINT at its default (a runner under nohup hands it ignored): _stop's SIGINT ends it.
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -c "import signal, time; '
                    f'signal.signal(signal.SIGINT, signal.SIG_DFL); time.sleep(600)"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_bench_leaves_no_mlx_lm_log(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                   stop: type[BaseException]) -> None:
    """Every bench serve interrupted by Ctrl-C or SIGTERM (which ``asyncside.cli.main`` raises as
    SystemExit) left ``asyncside-bench-mlx-lm-PORT.log`` in $TMPDIR, its only content the child's
    KeyboardInterrupt: while the child loaded (no __exit__ runs then) or while the phases ran. It
    is removed now; one that says why the server did not come up is kept (tests/test_unseen_inputs_5)."""
    import asyncside.bench.serve as bench_serve

    _stand_in(tmp_path, monkeypatch)
    served = bench_serve.MlxLmServer(str(tmp_path / "model"), startup_timeout=600)

    def interrupted(_: float) -> None:
        assert served.log.exists()
        raise stop()

    monkeypatch.setattr(bench_serve, "time", type("T", (), {"monotonic": time.monotonic, "sleep": interrupted}))
    with pytest.raises(stop):
        served.__enter__()
    assert served.proc is not None and served.proc.poll() is not None
    assert not served.log.exists()
    # Interrupted once up: the block raised it.
    served = bench_serve.MlxLmServer(str(tmp_path / "model"))
    served._wait_ready = lambda httpx: served  # type: ignore[method-assign]
    with pytest.raises(stop), served:
        assert served.log.exists()
        raise stop()
    assert not served.log.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("asyncside-bench")] == []


# --- item 4: /metrics through a Prometheus parser, and probes ----------------------------------------


def _families(text: str) -> dict[str, Any]:
    """The families of a scrape, parsed by prometheus_client; each line checked on the way."""
    parser = pytest.importorskip("prometheus_client.parser")
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(helps) == len(set(helps)) and helps == types, "HELP and TYPE once per family, together"
    assert text.endswith("\n") and "\n\n" not in text
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for f in families.values():
        assert f.type in ("counter", "gauge", "histogram"), f
        if f.type == "histogram":
            buckets = [s for s in f.samples if s.name.endswith("_bucket")]
            counts = [s.value for s in buckets]
            assert counts == sorted(counts), f"{f.name}: buckets not cumulative"
            assert buckets[-1].labels["le"] == "+Inf"
            [count] = [s.value for s in f.samples if s.name == f.name + "_count"]
            assert buckets[-1].value == count, f.name
        for s in f.samples:
            assert not math.isnan(s.value) or f.type == "gauge", s
    return families


def _counters(families: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values()
            if f.type in ("counter", "histogram") for s in f.samples}


def test_a_wrong_method_on_a_models_path_is_labelled_by_the_route(tmp_path: pathlib.Path) -> None:
    """A 405 on ``/v1/models/{id}`` labelled its series with the path the client sent: every id a
    client tried (quotes, backslashes and all) was a new series, which the server kept and sent at
    every scrape for good. The label is the route now."""
    model = ScriptedModel(byte_tokenizer(tmp_path), "hello")
    with BackgroundServer(create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0))) as srv:
        for i in range(20):
            assert httpx.post(srv.url + f"/v1/models/m{i}").status_code == 405
        assert httpx.delete(srv.url + '/v1/models/a"b\\c').status_code == 405
        text = httpx.get(srv.url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("asyncside_http_requests_total{")]
    assert lines == ['asyncside_http_requests_total{endpoint="/metrics",status="200"} 1',  # this scrape
                     'asyncside_http_requests_total{endpoint="/v1/models/{id}",status="405"} 21'], lines


def test_metrics_parse_and_counters_only_grow_across_a_servers_life(tmp_path: pathlib.Path) -> None:
    """/metrics read by Prometheus's own parser before any request, during 8 streams, after errors
    (a 500, 404s, 405s on odd paths) and once the drain began: every family's HELP and TYPE once,
    counters that only grow, histogram buckets cumulative up to +Inf = count, route labels only."""
    pytest.importorskip("prometheus_client.parser")
    model = ScriptedModel(byte_tokenizer(tmp_path), "hello", {"count": LONG}, step_delay=0.02, fail_when="boom")
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_tokens_limit=512,
                                                           shutdown_grace=600))
    srv = BackgroundServer(app).start()
    try:
        scrapes = [_families(httpx.get(srv.url + "/metrics").text)]
        threads, out = _streams(srv.url, 8, max_tokens=120)
        scrapes.append(_families(httpx.get(srv.url + "/metrics").text))
        for path in ('/v1/models/a"b', "/v1/models/c\\d", "/v1/models/e%20f", "/v1/models/x"):
            assert httpx.post(srv.url + path).status_code == 405
        scrapes.append(_families(httpx.get(srv.url + "/metrics").text))
        for t in threads:
            t.join(HELD)
        assert all(r["done"] for r in out)
        scrapes.append(_families(httpx.get(srv.url + "/metrics").text))
        # A failing forward fails the step it is in: the streams have ended.
        assert httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": "boom"}).status_code == 500
        assert httpx.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        assert httpx.get(srv.url + "/nowhere").status_code == 404
        scrapes.append(_families(httpx.get(srv.url + "/metrics").text))
        state = srv.app.state.asyncside
        srv.call(lambda: state.drain(0.0))
        scrapes.append(_families(httpx.get(srv.url + "/metrics").text))
    finally:
        srv.stop()
    series = [_counters(f) for f in scrapes]
    for before, after in zip(series, series[1:]):
        for key, value in before.items():
            assert after.get(key, 0.0) >= value, key
    endpoints = {s.labels["endpoint"] for s in scrapes[-1]["asyncside_http_requests"].samples}
    assert endpoints == {"/metrics", "/v1/models/{id}", "/v1/completions", "unmatched"}, endpoints
    final = series[-1]
    assert final[("asyncside_http_requests_total", (("endpoint", "/v1/models/{id}"), ("status", "405")))] == 4
    assert final[("asyncside_generated_tokens_total", (("endpoint", "/v1/completions"),))] >= 8 * 120


def test_label_values_round_trip_through_the_parser() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    from asyncside.serving.metrics import Registry

    r = Registry()
    c = r.counter("t_total", 'a help with \\ and "quotes"\nand a second line', ("model",))
    odd = 'org/model "quoted" \\ back\nslash'
    c.inc(2, model=odd)
    [family] = parser.text_string_to_metric_families(r.render())
    [sample] = family.samples
    assert sample.labels == {"model": odd} and sample.value == 2
    assert family.documentation == 'a help with \\ and "quotes"\nand a second line'


def test_probes_under_load_and_every_method_on_every_route(tmp_path: pathlib.Path) -> None:
    """/health and /v1/models while 8 streams run (their times printed, not asserted); HEAD and
    OPTIONS on each route; a CORS preflight with --allow-origin (and an API key: the preflight
    carries none, as browsers send it)."""
    model = ScriptedModel(byte_tokenizer(tmp_path), "hello", {"count": LONG}, step_delay=0.02)
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_tokens_limit=512,
                                                           allow_origins=("https://app.example",),
                                                           api_key="k3y"))
    auth = {"Authorization": "Bearer k3y"}
    with BackgroundServer(app) as srv:
        threads, out = _streams_authed(srv.url, 8, auth)
        took: dict[str, list[float]] = {"/health": [], "/v1/models": []}
        for _ in range(10):
            for path in took:
                t0 = time.perf_counter()
                assert httpx.get(srv.url + path, headers=auth, timeout=HELD).status_code == 200
                took[path].append(time.perf_counter() - t0)
        print({p: f"max {max(t) * 1000:.1f} ms, mean {sum(t) / len(t) * 1000:.1f} ms" for p, t in took.items()})
        for path, methods in (("/health", {"GET", "HEAD"}), ("/metrics", {"GET", "HEAD"}),
                              ("/v1/models", {"GET", "HEAD"}), ("/v1/models/scripted", {"GET", "HEAD"}),
                              ("/v1/completions", {"POST"}), ("/v1/chat/completions", {"POST"}),
                              ("/completions", {"POST"}), ("/chat/completions", {"POST"})):
            head = httpx.head(srv.url + path, headers=auth)
            if "HEAD" in methods:
                assert head.status_code == 200 and head.content == b"", (path, head.status_code)
            else:
                assert head.status_code == 405 and {m.strip() for m in head.headers["allow"].split(",")} == methods
            options = httpx.options(srv.url + path, headers=auth)
            assert options.status_code == 405, (path, options.status_code)
            assert {m.strip() for m in options.headers["allow"].split(",")} == methods
            preflight = httpx.options(srv.url + path, headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            assert preflight.status_code == 200, (path, preflight.text)
            assert preflight.headers["access-control-allow-origin"] == "https://app.example"
            assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
            other = httpx.options(srv.url + path, headers={"Origin": "https://evil.example",
                                                           "Access-Control-Request-Method": "POST"})
            assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        for t in threads:
            t.join(HELD)
        assert all(r["done"] for r in out)


def _streams_authed(url: str, n: int, auth: dict[str, str]) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    threads = []

    def one(started: threading.Event) -> None:
        done = False
        with httpx.stream("POST", url + "/v1/completions", timeout=HELD * 2, headers=auth,
                          json={"model": "scripted", "prompt": "count", "max_tokens": 150, "stream": True}) as r:
            for line in r.iter_lines():
                started.set()
                done = done or line == "data: [DONE]"
        started.set()
        out.append({"done": done})

    for _ in range(n):
        started = threading.Event()
        threads.append(threading.Thread(target=one, args=(started,), daemon=True))
        threads[-1].start()
        assert started.wait(HELD), "a stream never started"
    return threads, out


# --- item 5: restarts and a stderr nobody reads --------------------------------------------------------


def test_a_restart_on_the_same_port_right_after_sigterm_binds_and_a_second_server_is_one_line(
        tmp_path: pathlib.Path) -> None:
    """The old server closed its kept-alive connections first, which leaves them in TIME_WAIT on
    its port: the new one binds all the same (SO_REUSEADDR). A second server on a port in use is
    one line and status 1, before any model loads."""
    port = _free_port()
    with _serving(tmp_path, "--port", str(port)) as (proc, url):
        with httpx.Client() as client:  # a connection kept alive, which the server closes at its exit
            assert client.get(url + "/health").status_code == 200
            second = subprocess.run(_serve_argv(tmp_path, "--port", str(port)), capture_output=True, text=True,
                                    timeout=HELD * 2)
            assert second.returncode == 1, second.stderr
            assert second.stderr.strip().splitlines() == [
                f"asyncside serve: cannot bind 127.0.0.1:{port}: Address already in use (another process listens "
                "there: choose another port, or 0 for a free one)"], second.stderr
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=HELD * 2)
    assert proc.returncode == 0
    with _serving(tmp_path, "--port", str(port)) as (again, url):
        assert httpx.get(url + "/health").status_code == 200
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=HELD * 2)
    assert again.returncode == 0


def test_a_stderr_nobody_reads_does_not_stall_serving(tmp_path: pathlib.Path) -> None:
    """Under a service manager or in a container, stderr is a pipe; when its reader stops reading
    (a log shipper stuck, docker's blocking log mode) it fills, and the access log's write on the
    event loop's thread blocked every request and every probe for good: the server hung with the
    first line past the pipe's capacity. Log lines are written by a thread of their own now; the
    server serves on, uvicorn's own warnings (a malformed request) included, and exits 0."""
    with _serving(tmp_path, "--port", "0", stderr=subprocess.PIPE) as (proc, url):
        long_path = "/" + "p" * 4000  # each 404 logs a line of about 4 KB
        with httpx.Client(timeout=HELD) as client:
            for _ in range(300):  # far past a pipe's capacity
                assert client.get(url + long_path).status_code == 404
            host, port = url[len("http://"):].rsplit(":", 1)
            for _ in range(50):
                with socket.create_connection((host, int(port)), timeout=HELD) as sock:
                    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn warns: Invalid HTTP request received
                    sock.recv(4096)
            assert client.get(url + "/health").status_code == 200
            assert client.post(url + "/v1/completions", json={"model": "scripted", "prompt": "x",
                                                              "max_tokens": 3}).json()["choices"][0]["text"] == "hel"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HELD * 2) == 0  # stderr still unread
        assert proc.stderr is not None
        said = proc.stderr.read()  # what the pipe held: the lines queued behind it were never taken
    assert "Traceback" not in said and f'"GET {long_path}" 404' in said, said[-500:]
