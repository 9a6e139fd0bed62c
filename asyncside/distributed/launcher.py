"""Start N ranks on this machine over loopback (the ring backend), each a subprocess with a deadline.

What ``asyncside demo --ranks N``, ``asyncside bench pipeline`` and the tests use. Unlike
``mlx.launch`` its outcome reflects a failed rank: when one rank exits non-zero the others get a
grace period to stop on their own (their watchdogs stop them within seconds), then are killed,
and :attr:`LaunchResult.returncode` is non-zero; past the deadline every rank is killed.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .group import COORDINATOR_VAR

#: the launch's return code when the deadline passed
DEADLINE_RC = 124


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (the OS picks them)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    killed: bool = False


@dataclass
class LaunchResult:
    ranks: list[RankResult]
    #: why the launch failed (None: every rank exited 0)
    reason: str | None = None
    deadline_passed: bool = False
    seconds: float = 0.0

    @property
    def returncode(self) -> int:
        if self.deadline_passed:
            return DEADLINE_RC
        for r in self.ranks:
            if r.returncode != 0:
                return r.returncode if r.returncode and r.returncode > 0 else 1
        return 0

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass
class LocalLaunch:
    """``argv(rank)`` on ``size`` ranks over 127.0.0.1 with MLX_RANK / MLX_HOSTFILE set.

    ``cpus`` pins rank r to ``cpus[r]`` (sched_setaffinity), ``env`` adds variables to every rank.
    """

    argv: Sequence[Sequence[str]]
    cpus: Sequence[Sequence[int]] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    workdir: pathlib.Path | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.argv)

    def start(self) -> "LocalLaunch":
        if self.size < 2:
            raise ValueError(f"a launch needs at least 2 ranks, got {self.size}")
        own = self.workdir is None
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="asyncside-ranks-")) if own else self.workdir
        self._own_workdir = own
        ports = free_ports(self.size + 1, self.host)
        hostfile = self.workdir / "hostfile.json"
        hostfile.write_text(json.dumps([[f"{self.host}:{p}"] for p in ports[:-1]]))
        base = {**os.environ, **self.env, "MLX_HOSTFILE": str(hostfile),
                COORDINATOR_VAR: f"{self.host}:{ports[-1]}", "PYTHONUNBUFFERED": "1"}
        for rank, argv in enumerate(self.argv):
            cpus = None if self.cpus is None else list(self.cpus[rank])
            out = open(self.workdir / f"rank{rank}.out", "wb")
            err = open(self.workdir / f"rank{rank}.err", "wb")

            def pin(cpus: list[int] | None = cpus) -> None:
                if cpus:
                    os.sched_setaffinity(0, cpus)

            self.procs.append(subprocess.Popen(list(argv), env={**base, "MLX_RANK": str(rank)}, stdout=out, stderr=err,
                                               stdin=subprocess.DEVNULL, preexec_fn=pin if cpus else None))
            out.close()
            err.close()
        self._t0 = time.monotonic()
        return self

    def output(self, rank: int, stream: str = "out") -> str:
        assert self.workdir is not None
        path = self.workdir / f"rank{rank}.{stream}"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to rank ``rank`` (tests: a crash, a hang)."""
        if self.procs[rank].poll() is None:
            self.procs[rank].send_signal(sig)

    def wait(self, deadline_s: float, *, grace_s: float = 10.0) -> LaunchResult:
        """Wait for every rank; stop the rest once one fails (after ``grace_s``) or at the deadline."""
        end = self._t0 + deadline_s
        reason: str | None = None
        failed_at: float | None = None
        killed: set[int] = set()
        deadline = False
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed_at is None:
                failed_at = now
                reason = f"rank {bad[0]} exited with status {codes[bad[0]]}"
            if now >= end or (failed_at is not None and now - failed_at >= grace_s):
                if now >= end and failed_at is None:
                    deadline = True
                    reason = f"the ranks were still running at the {deadline_s:g} s deadline"
                for r, p in enumerate(self.procs):
                    if p.poll() is None:
                        p.kill()
                        killed.add(r)
                for p in self.procs:
                    p.wait()
                break
            time.sleep(0.05)
        results = [RankResult(r, p.returncode, self.output(r, "out"), self.output(r, "err"), r in killed)
                   for r, p in enumerate(self.procs)]
        if reason is None and any(r.returncode != 0 for r in results):
            first = next(r for r in results if r.returncode != 0)
            reason = f"rank {first.rank} exited with status {first.returncode}"
        return LaunchResult(results, reason, deadline, time.monotonic() - self._t0)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if getattr(self, "_own_workdir", False) and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalLaunch":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def python_argv(*args: str) -> list[str]:
    """``python -m asyncside.distributed ARGS`` with this interpreter."""
    return [sys.executable, "-m", "asyncside.distributed", *args]
