"""Running one test alone in a child pytest process.

A queued step whose fault fails raises on MLX's stream thread, and MLX then loses count of that
task: its count of tasks in flight stays one too high for the rest of the process (seen after
``test_a_failed_fault_fails_the_step_and_frees_its_row``, not after every run). MLX's own
throttle reads that count, and a later test of the same process was seen to wait in
``async_eval`` forever. A test that fails a step on purpose runs in a child process instead, so
what MLX keeps after it ends with it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = "ASYNCSIDE_TEST_IN_CHILD"


def ran_in_child(request: pytest.FixtureRequest, timeout: float = 600.0) -> bool:
    """In the parent: run ``request``'s test (its node id, parameters included) alone in a child
    pytest, assert that it passed, and return True (the caller returns). In the child: False
    (the caller runs the test's body)."""
    if os.environ.get(CHILD) == "1":
        return False
    env = {**os.environ, CHILD: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                          cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{request.node.nodeid} in a child process:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert " passed" in done.stdout, done.stdout[-2000:]  # it ran, not deselected or skipped
    return True
