"""Start N ranks on this machine over loopback, each a subprocess with a deadline.

The ring backend by default (a hostfile of 127.0.0.1 ports); ``backend="nccl"`` sets what
``mlx.launch --backend nccl`` sets instead (one GPU per rank through CUDA_VISIBLE_DEVICES).

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
        codes = [r.returncode for r in self.ranks if r.returncode != 0]
        positive = [c for c in codes if c is not None and c > 0]
        return positive[0] if positive else (1 if codes else 0)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass
class LocalLaunch:
    """``argv[r]`` on ``len(argv)`` ranks over 127.0.0.1, with the launch environment of ``backend``.

    ``cpus`` pins rank r to ``cpus[r]`` (sched_setaffinity), ``env`` adds variables to every rank.
    """

    argv: Sequence[Sequence[str]]
    cpus: Sequence[Sequence[int]] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    backend: str = "ring"
    #: ranks not to start (tests: a peer that never comes up); they count as exited with status 0
    skip: Sequence[int] = ()
    host: str = "127.0.0.1"
    workdir: pathlib.Path | None = None
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.argv)

    def start(self) -> LocalLaunch:
        if self.size < 2:
            raise ValueError(f"a launch needs at least 2 ranks, got {self.size}")
        own = self.workdir is None
        workdir = pathlib.Path(tempfile.mkdtemp(prefix="asyncside-ranks-")) if self.workdir is None else self.workdir
        self.workdir = workdir
        self._own_workdir = own
        ports = free_ports(self.size + 1, self.host)
        base = {**os.environ, **self.env, COORDINATOR_VAR: f"{self.host}:{ports[-1]}", "PYTHONUNBUFFERED": "1"}
        per_rank: list[dict[str, str]] = [{"MLX_RANK": str(r)} for r in range(self.size)]
        if self.backend == "ring":
            hostfile = workdir / "hostfile.json"
            hostfile.write_text(json.dumps([[f"{self.host}:{p}"] for p in ports[:-1]]))
            base["MLX_HOSTFILE"] = str(hostfile)
        elif self.backend == "nccl":
            base.update({"MLX_WORLD_SIZE": str(self.size), "NCCL_HOST_IP": self.host, "NCCL_PORT": str(ports[0])})
            for r, e in enumerate(per_rank):
                e["CUDA_VISIBLE_DEVICES"] = str(r)
        else:
            raise ValueError(f"LocalLaunch runs the ring or nccl backend, not {self.backend!r}")
        for rank, argv in enumerate(self.argv):
            if rank in self.skip:
                self.procs.append(None)
                continue
            cpus = None if self.cpus is None else list(self.cpus[rank])
            out = open(workdir / f"rank{rank}.out", "wb")
            err = open(workdir / f"rank{rank}.err", "wb")

            def pin(cpus: list[int] | None = cpus) -> None:
                if cpus:
                    os.sched_setaffinity(0, cpus)

            self.procs.append(subprocess.Popen(list(argv), env={**base, **per_rank[rank]}, stdout=out, stderr=err,
                                               stdin=subprocess.DEVNULL, preexec_fn=pin if cpus else None))
            out.close()
            err.close()
        self._t0 = time.monotonic()
        return self

    def output(self, rank: int, stream: str = "out") -> str:
        assert self.workdir is not None
        path = self.workdir / f"rank{rank}.{stream}"
        return path.read_text(errors="replace") if path.exists() else ""

    def _started(self) -> list[tuple[int, subprocess.Popen[bytes]]]:
        return [(r, p) for r, p in enumerate(self.procs) if p is not None]

    def running(self, rank: int) -> bool:
        p = self.procs[rank]
        return p is not None and p.poll() is None

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to rank ``rank`` (tests: a crash, a hang)."""
        p = self.procs[rank]
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def wait(self, deadline_s: float, *, grace_s: float = 10.0) -> LaunchResult:
        """Wait for every rank; stop the rest once one fails (after ``grace_s``) or at the deadline."""
        end = self._t0 + deadline_s
        reason: str | None = None
        failed_at: float | None = None
        killed: set[int] = set()
        deadline = False
        while True:
            codes = [0 if p is None else p.poll() for p in self.procs]
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
                for r, p in self._started():
                    if p.poll() is None:
                        p.kill()
                        killed.add(r)
                for _r, p in self._started():
                    p.wait()
                break
            time.sleep(0.05)
        results = [RankResult(r, 0 if p is None else p.returncode, self.output(r, "out"), self.output(r, "err"),
                              r in killed) for r, p in enumerate(self.procs)]
        failures = [_status(r) for r in results if r.returncode != 0]
        if failures and not deadline:
            reason = "; ".join(failures)
        return LaunchResult(results, reason, deadline, time.monotonic() - self._t0)

    def close(self) -> None:
        for _r, p in self._started():
            if p.poll() is None:
                p.kill()
                p.wait()
        if getattr(self, "_own_workdir", False) and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalLaunch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _status(r: RankResult) -> str:
    if r.killed:
        return f"rank {r.rank} was stopped by the launcher"
    if r.returncode is not None and r.returncode < 0:
        return f"rank {r.rank} was killed by signal {-r.returncode}"
    return f"rank {r.rank} exited with status {r.returncode}"


def python_argv(*args: str) -> list[str]:
    """``python -m asyncside.distributed ARGS`` with this interpreter."""
    return [sys.executable, "-m", "asyncside.distributed", *args]
