"""The pytest plugin, used as docs/testing.md documents it, by a project outside this repository.

Each test writes a small project into a temporary directory (its own ``pytest.ini``, strict
asyncio mode, no conftest of ours) and runs ``pytest`` there in a subprocess with this interpreter,
so the plugin arrives through its ``pytest11`` entry point exactly as in a user's project:

- ``test_external_suite``: the fixtures under pytest-asyncio with function-, module- and
  session-scoped loops (on asyncio and, where pytest-asyncio has loop factories, uvloop) and under
  anyio's plugin on asyncio, uvloop and trio; every test repeated (:data:`REPS` per process,
  :data:`ROUNDS` processes: 50 runs of each by default, ``ASYNCSIDE_PLUGIN_REPS`` /
  ``ASYNCSIDE_PLUGIN_ROUNDS`` change that), odd rounds with the two plugins registered in the
  other order. Every one must pass. A module-scoped loop used to leave the test waiting on a
  runtime opened on another loop (idle in select() for ever), and an anyio test on trio either
  could not open the runtime or, with pytest-asyncio's fixture hook outermost, waited for ever on
  a runtime opened on an asyncio loop nobody ran: see asyncside/testing.py.
- ``test_a_hung_test_fails_with_where_it_was_stuck``: the per-test deadline ends tests that wait
  for ever, ignore cancellation (also with a teardown slower than the watchdog's patience) or
  block their loop (in the test's task or in a loop callback), each failing with the line it was
  stuck on, and the run goes on. The watchdog used to send a second SIGINT a second after the
  first, whatever had happened: one that arrived while the loop waited on a slow teardown raised
  KeyboardInterrupt outside the test's task, which stopped the whole run with no test reported
  (the slow-teardown test here shows it every time; on a loaded machine the runtime's own close
  was that slow, the likely cause of this test's intermittent failure in full-suite runs).

A run that does not end is killed at :data:`RUN_TIMEOUT_S` and fails the test with its output
(``faulthandler_timeout`` has put every thread's stack in it): these tests fail, never hang.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

#: Repetitions of every external test inside one pytest process, and processes run in sequence.
REPS = int(os.environ.get("ASYNCSIDE_PLUGIN_REPS", "10"))
ROUNDS = int(os.environ.get("ASYNCSIDE_PLUGIN_ROUNDS", "5"))
#: The deadline the external tests run under (seconds; generous for a loaded machine, and a hang
#: detector, not a timing assertion) and the hard limit of one external pytest process.
EXTERNAL_DEADLINE_S = 60
RUN_TIMEOUT_S = int(os.environ.get("ASYNCSIDE_PLUGIN_RUN_TIMEOUT_S", "300"))

PYTEST_INI = """\
[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
"""

CONFTEST = '''\
import asyncio
import os

import pytest
import pytest_asyncio.plugin
import uvloop

REPS = int(os.environ["EXTERNAL_REPS"])


def pytest_generate_tests(metafunc):
    if "rep" in metafunc.fixturenames:
        metafunc.parametrize("rep", range(REPS))


if hasattr(pytest_asyncio.plugin, "PytestAsyncioSpecs"):  # pytest-asyncio with loop factories
    def pytest_asyncio_loop_factories(config, item):
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
'''

# Shared by every test file: what a user checks first (the bytes an ensure loaded, a fault).
HELPERS = '''\
import errno

import numpy as np
import pytest

from asyncside import FillError


async def check_ensure(runtime, store):
    layer = next(iter(store.layers))
    experts = [5, 6, 7]
    await runtime.ensure(layer, experts)
    table = np.array(runtime.lookup(layer))
    for expert in experts:
        row = int(table[expert])
        assert row >= 0, expert
        want = store.read_expert(layer, expert)
        for key, pool in runtime.pools(layer).items():
            assert np.array_equal(np.array(pool[row]), np.array(want[key])), (expert, key)


async def check_fault(runtime, faults, store):
    layer = next(iter(store.layers))
    table = np.array(runtime.lookup(layer))
    victim = max(e for e in range(store.layer(layer).n_experts) if table[e] < 0)  # not resident: a read
    faults.fail(layer, victim, errno.EIO)
    with pytest.raises((FillError, ExceptionGroup)):
        await runtime.ensure(layer, [victim])
    assert int(np.array(runtime.lookup(layer))[victim]) == -1
    faults.clear()
    await runtime.ensure(layer, [victim])
    assert int(np.array(runtime.lookup(layer))[victim]) >= 0
'''

TEST_FILES = {
    "test_function_loop.py": '''\
import pytest

from helpers import check_ensure, check_fault


@pytest.mark.asyncio
async def test_ensure(asyncside_runtime, expert_store, rep):
    await check_ensure(asyncside_runtime, expert_store)


@pytest.mark.asyncio
async def test_fault(asyncside_runtime, faulty_reader, expert_store, rep):
    await check_fault(asyncside_runtime, faulty_reader, expert_store)
''',
    "test_module_loop.py": '''\
import asyncio

import pytest
import pytest_asyncio

from helpers import check_ensure

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_loop():
    return asyncio.get_running_loop()


async def test_module_loop_scope(asyncside_runtime, expert_store, module_loop, rep):
    assert asyncio.get_running_loop() is module_loop
    await check_ensure(asyncside_runtime, expert_store)


@pytest.mark.no_blocking(threshold=1.0)
async def test_module_loop_scope_watched(asyncside_runtime, expert_store, no_blocking, rep):
    await check_ensure(asyncside_runtime, expert_store)


@pytest.mark.no_blocking(threshold=1.0)
async def test_module_loop_scope_watched_first(no_blocking, asyncside_runtime, expert_store, rep):
    await check_ensure(asyncside_runtime, expert_store)
''',
    "test_session_loop.py": '''\
import pytest

from helpers import check_ensure, check_fault


@pytest.mark.asyncio(loop_scope="session")
async def test_session_loop_scope(asyncside_runtime, faulty_reader, expert_store, rep):
    await check_ensure(asyncside_runtime, expert_store)
    await check_fault(asyncside_runtime, faulty_reader, expert_store)
''',
    "test_anyio_backends.py": '''\
import pytest

from helpers import check_ensure, check_fault


@pytest.fixture(params=[pytest.param(("asyncio", {}), id="asyncio"),
                        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
                        pytest.param(("trio", {}), id="trio")])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_anyio_ensure(asyncside_runtime, expert_store, rep):
    await check_ensure(asyncside_runtime, expert_store)


@pytest.mark.anyio
@pytest.mark.no_blocking(threshold=1.0)
async def test_anyio_fault(asyncside_runtime, faulty_reader, expert_store, no_blocking, rep):
    await check_fault(asyncside_runtime, faulty_reader, expert_store)
''',
}


def _have_loop_factories() -> bool:
    import pytest_asyncio.plugin

    return hasattr(pytest_asyncio.plugin, "PytestAsyncioSpecs")


def expected_tests(reps: int) -> int:
    """How many tests one external run has: pytest-asyncio's run once per loop factory."""
    loops = 2 if _have_loop_factories() else 1
    return reps * ((2 + 3 + 1) * loops + 2 * 3)


def write_project(root: pathlib.Path, files: dict[str, str], loop_factories: bool = True) -> None:
    """The external project: pytest.ini, a conftest (``rep``; uvloop through pytest-asyncio's loop
    factories unless ``loop_factories`` is false), the helpers and ``files``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text(PYTEST_INI)
    (root / "conftest.py").write_text(CONFTEST if loop_factories else CONFTEST.split("\n\nif hasattr")[0] + "\n")
    (root / "helpers.py").write_text(HELPERS)
    for name, text in files.items():
        (root / name).write_text(text)


def _interruptible() -> None:
    """In the child before it runs Python: SIGINT unblocked and at its default disposition, as in a
    shell, whatever this process's own state (a child inherits a blocked or ignored SIGINT): the
    deadline watchdog of the external run may need to interrupt its main thread."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_project(root: pathlib.Path, reps: int, extra: list[str] | None = None,
                deadline_s: float | str = EXTERNAL_DEADLINE_S) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    """pytest in ``root`` (a subprocess, killed at RUN_TIMEOUT_S); its result and the junit counts."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTHONPATH")}
    env.update(EXTERNAL_REPS=str(reps), ASYNCSIDE_TEST_DEADLINE_S=str(deadline_s), PYTHONUNBUFFERED="1")
    report = root / "junit.xml"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           "-o", f"faulthandler_timeout={RUN_TIMEOUT_S - 30}", *(extra or [])]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              preexec_fn=_interruptible)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"the external pytest run did not end within {RUN_TIMEOUT_S} s (a hang); killed. "
                    f"Its output:\n{out[-20000:]}\n--- stderr ---\n{err[-20000:]}", pytrace=False)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.exists():
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    return proc, counts


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("external-project")
    write_project(root, TEST_FILES)
    return root


#: Odd rounds register anyio's plugin before pytest-asyncio's (pytest loads ``-p`` plugins before
#: the entry points), so that pytest-asyncio's fixture hook wraps anyio's: which of the two claims
#: an async fixture first depends on that order, which depends on how the packages were installed.
SWAPPED = ["-p", "no:anyio", "-p", "anyio.pytest_plugin"]


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_external_suite(project: pathlib.Path, round_: int) -> None:
    proc, counts = run_project(project, REPS, SWAPPED if round_ % 2 else [])
    output = proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-5000:]
    want = expected_tests(REPS)
    assert proc.returncode == 0, f"external pytest exited with {proc.returncode}:\n{output}"
    assert counts == {"tests": want, "failures": 0, "errors": 0, "skipped": 0}, f"{counts}:\n{output}"


HANGING = {
    "test_hangs.py": '''\
import asyncio
import time

import anyio
import pytest


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.asyncside_deadline(1)
async def test_waits_for_ever(asyncside_runtime):
    await anyio.Event().wait()  # STUCK-HERE-1


@pytest.mark.asyncio
@pytest.mark.asyncside_deadline(1)
async def test_ignores_cancellation(asyncside_runtime):
    with anyio.CancelScope(shield=True):
        await anyio.sleep(3600)  # STUCK-HERE-2


@pytest.mark.asyncio
@pytest.mark.asyncside_deadline(1)
async def test_blocks_its_loop(asyncside_runtime):
    time.sleep(3600)  # STUCK-HERE-3


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
@pytest.mark.asyncside_deadline(1)
async def test_trio_waits_for_ever(asyncside_runtime, anyio_backend):
    await anyio.sleep_forever()  # STUCK-HERE-4


@pytest.mark.asyncio
@pytest.mark.asyncside_deadline(1)
async def test_ignores_cancellation_then_ends_slowly(asyncside_runtime):
    try:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(3600)  # STUCK-HERE-5
    finally:
        with anyio.CancelScope(shield=True):  # a teardown slower than the watchdog's patience
            await anyio.to_thread.run_sync(time.sleep, 3)


def block():
    time.sleep(3600)  # STUCK-HERE-6


@pytest.mark.asyncio
@pytest.mark.asyncside_deadline(1)
async def test_blocks_its_loop_in_a_callback(asyncside_runtime):
    asyncio.get_running_loop().call_soon(block)
    await anyio.sleep(3600)


@pytest.mark.asyncio(loop_scope="module")
async def test_after_the_hangs(asyncside_runtime, expert_store):
    await asyncside_runtime.ensure(next(iter(expert_store.layers)), [5])
''',
}


def test_a_hung_test_fails_with_where_it_was_stuck(tmp_path: pathlib.Path) -> None:
    write_project(tmp_path, HANGING, loop_factories=False)
    proc, counts = run_project(tmp_path, 1, ["-rf"])
    output = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    assert counts == {"tests": 7, "failures": 6, "errors": 0, "skipped": 0}, f"{counts}:\n{output}"
    assert "1 passed" in proc.stdout, output  # the run went on after the hung tests
    parts = re.split(r"^_{3,} (\S+) _{3,}$", proc.stdout, flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    for n, name in enumerate(["test_waits_for_ever", "test_ignores_cancellation", "test_blocks_its_loop",
                              "test_trio_waits_for_ever", "test_ignores_cancellation_then_ends_slowly",
                              "test_blocks_its_loop_in_a_callback"], start=1):
        assert f"FAILED test_hangs.py::{name}" in proc.stdout, output
        # Each failure names the line the test was stuck on in the DeadlineExceeded message (the
        # "E" lines of its report; the source listings of the traceback show it too, unprefixed).
        report = next(text for test_id, text in sections.items() if test_id.split("[")[0] == name)
        message = [line for line in report.splitlines() if line.startswith("E ")]
        assert any(f"DeadlineExceeded: test_hangs.py::{name}" in line for line in message), report
        assert any(f"STUCK-HERE-{n}" in line for line in message), report
    # A test that ignores cancellation or blocks its loop also gets every thread's stack on stderr.
    assert "it ignores cancellation" in proc.stderr and "it is blocked in a call" in proc.stderr, output


def test_deadline_settings_are_checked(tmp_path: pathlib.Path) -> None:
    write_project(tmp_path, {"test_one.py": textwrap.dedent('''\
        import pytest


        @pytest.mark.asyncio
        async def test_one(asyncside_runtime):
            pass
        ''')}, loop_factories=False)
    proc, _ = run_project(tmp_path, 1, deadline_s="soon")
    assert proc.returncode != 0
    assert "ASYNCSIDE_TEST_DEADLINE_S: expected a number of seconds >= 0 (0: no deadline), got 'soon'" in (
        proc.stdout + proc.stderr), proc.stdout + proc.stderr
