"""The host's floor under a boundary round trip: one byte each way between two idle processes.

A decode step crosses the boundary twice (the hidden state's header forward, the token back), and
each crossing wakes a process that was asleep waiting for it. On a virtual machine that wake-up is
not cheap: the sender's ``send`` must interrupt the peer's halted virtual CPU. This module measures
exactly that and nothing of ours: two processes, each pinned to its own core like the ranks of
``asyncside bench pipeline``, exchange one byte over a TCP loopback connection with blocking
``send``/``recv`` (no event loop, no MLX, no Python objects to speak of between the two calls).

Two forms, so the report says how much of a round trip is the wake-up itself:

- ``idle``: before each round trip both processes sleep ``gap`` seconds, as the ranks do between
  the messages of a step (a rank waits a whole stage's compute for its next message);
- ``back_to_back``: round trips one after the other (the peer has barely gone to sleep).

Run as ``python -m asyncside.distributed.wakefloor --cpus 0,1 --json`` (the benchmark runs it in
its own process, so the caller's affinity is untouched); prints one JSON object, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence


def _pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a TCP loopback connection, TCP_NODELAY like the control links."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def _recv1(s: socket.socket) -> None:
    if not s.recv(1):
        raise ConnectionError("the peer closed the connection")


def measure(cpus: tuple[int, int] | None, n: int, gap_s: float) -> dict[str, float]:
    """Median/p10/p90 seconds of ``n`` one-byte round trips in each form (see the module docstring)."""
    a, b = _pair()
    pid = os.fork()
    if pid == 0:  # the peer: answer every byte, until told to stop
        try:
            a.close()
            if cpus is not None:
                os.sched_setaffinity(0, {cpus[1]})
            while True:
                byte = b.recv(1)
                if not byte or byte == b"q":
                    break
                b.send(b"y")
        finally:
            os._exit(0)
    b.close()
    try:
        if cpus is not None:
            os.sched_setaffinity(0, {cpus[0]})
        out: dict[str, float] = {}
        for form, gap in (("idle", gap_s), ("back_to_back", 0.0)):
            times = []
            for i in range(n + n // 10):
                if gap:
                    time.sleep(gap)
                t0 = time.perf_counter()
                a.send(b"x")
                _recv1(a)
                if i >= n // 10:  # the first tenth warms up
                    times.append(time.perf_counter() - t0)
            times.sort()
            out[f"{form}_median"] = statistics.median(times)
            out[f"{form}_p10"] = times[len(times) // 10]
            out[f"{form}_p90"] = times[(9 * len(times)) // 10]
        a.send(b"q")
    finally:
        a.close()
        os.waitpid(pid, 0)
    out["gap_s"] = gap_s
    out["n"] = n
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncside.distributed.wakefloor",
                                description="one-byte round trips between two idle processes (the host's floor)")
    p.add_argument("--cpus", default=None, help="two cores, e.g. 0,1 (default: unpinned)")
    p.add_argument("-n", type=int, default=300, help="round trips per form (default 300)")
    p.add_argument("--gap-us", type=float, default=300.0, help="idle time before each idle round trip (default 300)")
    args = p.parse_args(argv)
    cpus: tuple[int, int] | None = None
    if args.cpus:
        first, second = (int(c) for c in args.cpus.split(","))
        cpus = (first, second)
    if args.n < 10:
        raise SystemExit("wakefloor: -n must be at least 10")
    json.dump(measure(cpus, args.n, args.gap_us * 1e-6), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
