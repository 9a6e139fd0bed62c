"""Every example in examples/ runs, so none can rot; and `asyncside serve` runs as a real process.

Scripts run as subprocesses with this interpreter, the way a user runs them. The servers bind
127.0.0.1 with port 0 and print the URL they got; the test talks to them with the openai client
and stops them with SIGINT, which must shut them down cleanly (exit status 0).
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
STARTUP_TIMEOUT = 600  # the first run in a fresh cache builds the embedded model


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@contextmanager
def server_process(args: list[str], ready: re.Pattern[str]) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Start a server script, wait for the line announcing its URL, SIGINT it at the end."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str | None] = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        url = None
        while url is None:
            try:
                line = lines.get(timeout=STARTUP_TIMEOUT)
            except queue.Empty:
                pytest.fail(f"no ready line within {STARTUP_TIMEOUT}s; output:\n{''.join(output)}")
            if line is None:
                pytest.fail(f"server exited with {proc.wait()} before it was ready; output:\n{''.join(output)}")
            m = ready.search(line)
            url = m.group(1) if m else None
        yield url, proc
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        assert rc == 0, f"server exited with {rc} after SIGINT; output:\n{''.join(output)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def one_completion(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert 1 <= out.usage.completion_tokens <= 4
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason


def test_stream_generate_example() -> None:
    r = run([str(EXAMPLES / "stream_generate.py"), "--max-tokens", "8"], timeout=STARTUP_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"(\d+) tokens in [\d.]+s = [\d.]+ tokens/s", r.stdout)
    assert m and 1 <= int(m.group(1)) <= 8, r.stdout
    assert re.search(r"hit rate [\d.]+%, [\d.]+ MiB read, stall [\d.]+ ms", r.stdout), r.stdout


def test_minimal_server_example() -> None:
    with server_process([str(EXAMPLES / "minimal_server.py"), "--port", "0"],
                        re.compile(r"serving on (http://127\.0\.0\.1:\d+)")) as (url, _):
        one_completion(url)


def test_asyncside_serve_command() -> None:
    cli = ["-c", "import sys; from asyncside.cli import main; sys.exit(main())"]
    with server_process([*cli, "serve", "--port", "0", "--resident", "0.5"],
                        re.compile(r"asyncside serve: (http://127\.0\.0\.1:\d+) model=")) as (url, _):
        one_completion(url)


def test_serve_refuses_bad_arguments() -> None:
    cli = ["-c", "import sys; from asyncside.cli import main; sys.exit(main())"]
    r = run([*cli, "serve", "--resident", "2"], timeout=60)
    assert r.returncode == 2 and "argument --resident: expected a fraction in [0, 1], got 2" in r.stderr
    assert "Traceback" not in r.stderr


def test_pytest_asyncio_example() -> None:
    """The plugin example passes under pytest-asyncio strict mode, with the plugin auto-registered."""
    r = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES / "test_example_pytest_asyncio.py")],
            timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"\b[1-9]\d* passed\b", r.stdout) and "failed" not in r.stdout, r.stdout
