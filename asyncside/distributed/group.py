"""Forming the group: the launch environment, the ranks' meeting, and MLX's own group.

A pipeline runs on MLX's distributed engine: ``mx.distributed.init(backend=..., strict=True)``
configured by the environment ``mlx.launch`` sets (``MLX_RANK`` and ``MLX_HOSTFILE`` for the ring;
``MLX_WORLD_SIZE``, ``NCCL_HOST_IP`` and ``NCCL_PORT`` for NCCL; ``MLX_JACCL_COORDINATOR`` and
``MLX_IBV_DEVICES`` for jaccl). Beside it every rank keeps two small TCP *control links*, to the
next and from the previous rank of the ring, which carry the boundary's message headers,
heartbeats, and abort and goodbye notices (see :mod:`.control`); tensors never travel on them.

MLX's ring init blocks without a deadline (a rank whose peer never comes up waits in ``accept``
forever, holding the GIL), so the ranks first meet on the control plane, with a deadline and an
error naming whoever is missing: every rank connects to a coordinator at rank 0
(``ASYNCSIDE_COORDINATOR=host:port``, or derived from the launch environment), says hello with
its plan's fingerprint, learns where its ring neighbours listen, and connects its links. Only
then is MLX's group formed, under a deadline as well.

:func:`join` does all of it; call it before the event loop starts (it blocks).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .errors import DistributedError, LaunchEnvError, PeerTimeoutError

BACKENDS = ("ring", "nccl", "jaccl", "jaccl-ring", "mpi")
COORDINATOR_VAR = "ASYNCSIDE_COORDINATOR"
#: frame types of the control links (shared with :mod:`.control`)
HELLO, WELCOME, LINK, HEADER, HEARTBEAT, ABORT, BYE, REFUSE = range(1, 9)
FRAME = struct.Struct("!IB")  # body length, frame type
MAX_FRAME = 1 << 20


# --------------------------------------------------------------------------- launch environment


def _split_hostport(text: str, var: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise LaunchEnvError(f"{var}={text!r}: expected host:port")
    try:
        p = int(port)
    except ValueError:
        raise LaunchEnvError(f"{var}={text!r}: the port {port!r} is not a number") from None
    if not 0 < p < 65536:
        raise LaunchEnvError(f"{var}={text!r}: the port must be in [1, 65535]")
    return host.strip("[]"), p


def _int_var(environ: Mapping[str, str], var: str) -> int:
    raw = environ.get(var)
    if raw is None:
        raise LaunchEnvError(f"{var} is not set")
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"{var}={raw!r}: expected an integer") from None


def _json_file(environ: Mapping[str, str], var: str) -> Any:
    path = environ.get(var)
    if not path:
        raise LaunchEnvError(f"{var} is not set")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise LaunchEnvError(f"{var}={path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise LaunchEnvError(f"{var}={path}: not valid JSON ({exc})") from None


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about this process's place in the group."""

    backend: str
    rank: int
    size: int
    #: where rank 0 listens for the other ranks' hello (host, port)
    coordinator: tuple[str, int]
    #: each rank's host where the launch names it (ring hostfile), else empty
    hosts: tuple[str, ...] = ()

    def host_of(self, rank: int) -> str:
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else "?"

    def describe(self, rank: int) -> str:
        """``rank N (host)`` for messages."""
        host = self.host_of(rank)
        return f"rank {rank}" + (f" ({host})" if host != "?" else "")

    @classmethod
    def from_environ(cls, backend: str | None = None, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """Read the launch environment of ``backend`` (None: guess it from which variables are set)."""
        env = os.environ if environ is None else environ
        if backend is None:
            if env.get("MLX_HOSTFILE") and "MLX_RANK" in env:
                backend = "ring"
            elif env.get("NCCL_HOST_IP") and env.get("MLX_WORLD_SIZE"):
                backend = "nccl"
            elif env.get("MLX_JACCL_COORDINATOR"):
                backend = "jaccl-ring" if env.get("MLX_JACCL_RING") else "jaccl"
            else:
                raise LaunchEnvError(
                    "no distributed launch environment: run under `mlx.launch` or set MLX_RANK and "
                    "MLX_HOSTFILE (ring), MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP and NCCL_PORT (nccl), or "
                    "MLX_RANK, MLX_JACCL_COORDINATOR and MLX_IBV_DEVICES (jaccl)")
        if backend not in BACKENDS:
            raise LaunchEnvError(f"backend {backend!r} is not one of {list(BACKENDS)}")
        explicit = env.get(COORDINATOR_VAR)
        hosts: tuple[str, ...] = ()
        if backend == "mpi":
            rank = _int_var(env, "OMPI_COMM_WORLD_RANK") if "MLX_RANK" not in env else _int_var(env, "MLX_RANK")
            size = _int_var(env, "OMPI_COMM_WORLD_SIZE")
            if not explicit:
                raise LaunchEnvError(f"the mpi backend needs {COORDINATOR_VAR}=host:port (rank 0's control address)")
            coordinator = _split_hostport(explicit, COORDINATOR_VAR)
        else:
            rank = _int_var(env, "MLX_RANK")
            if backend == "ring":
                nodes = _json_file(env, "MLX_HOSTFILE")
                if (not isinstance(nodes, list) or not nodes
                        or not all(isinstance(n, list) and n and all(isinstance(a, str) for a in n) for n in nodes)):
                    raise LaunchEnvError(f"MLX_HOSTFILE={env['MLX_HOSTFILE']}: expected a list per rank of "
                                         '"ip:port" strings, e.g. [["10.0.0.1:5000"], ["10.0.0.2:5000"]]')
                size = len(nodes)
                addrs = [[_split_hostport(a, "MLX_HOSTFILE") for a in n] for n in nodes]
                hosts = tuple(n[0][0] for n in addrs)
                # One port past every ring port: free on rank 0's host even when all ranks share it.
                coordinator = (hosts[0], max(p for n in addrs for _, p in n) + 1)
            elif backend == "nccl":
                size = _int_var(env, "MLX_WORLD_SIZE")
                host = env.get("NCCL_HOST_IP")
                if not host:
                    raise LaunchEnvError("NCCL_HOST_IP is not set (mlx.launch --backend nccl sets it)")
                coordinator = (host, _int_var(env, "NCCL_PORT") + 1)
            else:
                devices = _json_file(env, "MLX_IBV_DEVICES")
                if not isinstance(devices, list) or not devices:
                    raise LaunchEnvError("MLX_IBV_DEVICES: expected a JSON list with one entry per rank")
                size = len(devices)
                host, port = _split_hostport(env.get("MLX_JACCL_COORDINATOR", ""), "MLX_JACCL_COORDINATOR")
                coordinator = (host, port + 1)
            if explicit:
                coordinator = _split_hostport(explicit, COORDINATOR_VAR)
        if size < 2:
            raise LaunchEnvError(f"a pipeline needs at least 2 ranks; the launch has {size}")
        if not 0 <= rank < size:
            raise LaunchEnvError(f"rank {rank} is outside the group of {size}")
        return cls(backend, rank, size, coordinator, hosts)


# --------------------------------------------------------------------------- control frames (blocking)


def send_frame(sock: socket.socket, kind: int, body: bytes = b"") -> None:
    sock.sendall(FRAME.pack(len(body), kind) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(what)
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"{what}: the peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, deadline: float, what: str) -> tuple[int, bytes]:
    length, kind = FRAME.unpack(_recv_exact(sock, FRAME.size, deadline, what))
    if length > MAX_FRAME:
        raise DistributedError(f"{what}: a control frame of {length} bytes (the limit is {MAX_FRAME})")
    return kind, _recv_exact(sock, length, deadline, what)


def _json_body(kind: int, body: bytes, expected: int, what: str) -> dict[str, Any]:
    if kind == REFUSE:
        raise DistributedError(body.decode("utf-8", "replace"))
    if kind != expected:
        raise DistributedError(f"{what}: expected control frame {expected}, got {kind}")
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DistributedError(f"{what}: malformed control message ({exc})") from None
    if not isinstance(data, dict):
        raise DistributedError(f"{what}: malformed control message (not an object)")
    return data


# --------------------------------------------------------------------------- rendezvous


@dataclass
class Links:
    """The two control links of one rank, connected and identified."""

    to_next: socket.socket
    from_prev: socket.socket
    #: what each rank said in its hello (rank -> hello), as relayed by rank 0
    peers: dict[int, dict[str, Any]] = field(default_factory=dict)

    def close(self) -> None:
        for s in (self.to_next, self.from_prev):
            try:
                s.close()
            except OSError:
                pass


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise LaunchEnvError(f"cannot resolve host {host!r}: {exc}") from None


def _listener(host: str, port: int) -> socket.socket:
    s = socket.socket(_family(host), socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(64)
    return s


def _connect_until(addr: tuple[str, int], deadline: float, who: str, me: str) -> socket.socket:
    """Connect to ``addr``, retrying while it refuses, until ``deadline``."""
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeoutError(f"{me}: {who} at {addr[0]}:{addr[1]} never came up (last error: {last})")
        try:
            s = socket.create_connection(addr, timeout=min(left, 5.0))
        except OSError as exc:
            last = exc
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            continue
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s


def _accept_until(lst: socket.socket, deadline: float) -> socket.socket | None:
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    lst.settimeout(left)
    try:
        conn, _ = lst.accept()
    except TimeoutError:
        return None
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _refusal(hello: dict[str, Any], hellos: Mapping[int, Any], size: int, fingerprint: str) -> str | None:
    """Why rank 0 refuses a rank's ``hello`` (None: the rank joins)."""
    r = hello.get("rank")
    if not isinstance(r, int) or not 0 < r < size:
        return f"a process said it was rank {r!r}; the group has ranks 1..{size - 1}"
    if r in hellos:
        return f"two processes say they are rank {r}"
    if hello.get("size") != size:
        return f"rank {r} was launched in a group of {hello.get('size')}, rank 0 in one of {size}"
    if hello.get("fingerprint") != fingerprint:
        return f"rank {r} runs {hello.get('fingerprint')!r} but rank 0 runs {fingerprint!r}"
    return None


def rendezvous(env: LaunchEnv, fingerprint: str, *, timeout: float = 60.0) -> Links:
    """Meet every rank through rank 0 and connect this rank's two control links.

    Raises PeerTimeoutError naming the ranks that did not come up within ``timeout`` seconds, and
    DistributedError when a rank runs a different plan (``fingerprint``) or group size.
    """
    deadline = time.monotonic() + timeout
    me = env.describe(env.rank)
    hello = {"rank": env.rank, "size": env.size, "fingerprint": fingerprint, "pid": os.getpid(),
             "hostname": socket.gethostname()}
    star: list[socket.socket] = []
    ring_listener: socket.socket | None = None
    try:
        if env.rank == 0:
            host, port = env.coordinator
            try:
                coord = _listener(host, port)
            except OSError as exc:
                raise DistributedError(f"{me}: cannot listen on the coordinator address {host}:{port} "
                                       f"({exc})") from None
            star.append(coord)
            ring_listener = _listener(host, 0)
            hellos: dict[int, dict[str, Any]] = {0: {**hello, "listen": [host, ring_listener.getsockname()[1]]}}
            conns: dict[int, socket.socket] = {}
            while len(hellos) < env.size:
                conn = _accept_until(coord, deadline)
                if conn is None:
                    missing = [r for r in range(env.size) if r not in hellos]
                    raise PeerTimeoutError(
                        f"{me}: {', '.join(env.describe(r) for r in missing)} did not reach the coordinator "
                        f"{host}:{port} within {timeout:g} s", missing[0])
                star.append(conn)
                try:
                    h = _json_body(*recv_frame(conn, min(deadline, time.monotonic() + 10.0), "hello"), HELLO, "hello")
                except (TimeoutError, ConnectionError, DistributedError):
                    continue  # not one of ours (or it died mid-hello): keep waiting for the real ranks
                problem = _refusal(h, hellos, env.size, fingerprint)
                if problem is not None:
                    for c in list(conns.values()) + [conn]:
                        try:
                            send_frame(c, REFUSE, f"rank 0 refused the group: {problem}".encode())
                        except OSError:
                            pass
                    raise DistributedError(f"{me}: {problem}")
                r = int(h["rank"])
                hellos[r] = h
                conns[r] = conn
            welcome = json.dumps({str(r): h for r, h in hellos.items()}).encode()
            for conn in conns.values():
                send_frame(conn, WELCOME, welcome)
            peers = hellos
        else:
            conn = _connect_until(env.coordinator, deadline, "rank 0 (the coordinator)", me)
            star.append(conn)
            local = conn.getsockname()[0]
            ring_listener = _listener(local, 0)
            send_frame(conn, HELLO, json.dumps({**hello, "listen": [local, ring_listener.getsockname()[1]]}).encode())
            try:
                table = _json_body(*recv_frame(conn, deadline, "welcome"), WELCOME, "welcome")
            except TimeoutError:
                raise PeerTimeoutError(f"{me}: rank 0 did not complete the group within {timeout:g} s "
                                       "(another rank never came up?)", 0) from None
            except ConnectionError:
                raise PeerTimeoutError(f"{me}: rank 0 closed the connection before the group was complete "
                                       "(it gave up or died)", 0) from None
            peers = {int(r): h for r, h in table.items()}
        nxt, prev = (env.rank + 1) % env.size, (env.rank - 1) % env.size
        listen = peers[nxt].get("listen")
        if not (isinstance(listen, list) and len(listen) == 2):
            raise DistributedError(f"{me}: rank {nxt} sent no control address")
        to_next = _connect_until((str(listen[0]), int(listen[1])), deadline, env.describe(nxt), me)
        send_frame(to_next, LINK, json.dumps({"rank": env.rank}).encode())
        from_prev = _accept_until(ring_listener, deadline)
        if from_prev is None:
            to_next.close()
            raise PeerTimeoutError(f"{me}: {env.describe(prev)} did not open its control link within "
                                   f"{timeout:g} s", prev)
        try:
            link = _json_body(*recv_frame(from_prev, deadline, "link"), LINK, "link")
        except (TimeoutError, ConnectionError) as exc:
            raise PeerTimeoutError(f"{me}: {env.describe(prev)} did not identify its control link ({exc})",
                                   prev) from None
        if link.get("rank") != prev:
            raise DistributedError(f"{me}: expected the control link of rank {prev}, got one from rank "
                                   f"{link.get('rank')!r}")
        return Links(to_next, from_prev, peers)
    finally:
        for s in star:
            s.close()
        if ring_listener is not None:
            ring_listener.close()


# --------------------------------------------------------------------------- MLX's group


def comm_device(backend: str) -> mx.Device:
    """The device whose streams carry the backend's transfers (NCCL: the GPU; the others: the CPU)."""
    return mx.Device(mx.gpu) if backend == "nccl" else mx.Device(mx.cpu)


def init_group(env: LaunchEnv, *, timeout: float = 60.0) -> Any:
    """``mx.distributed.init(backend=env.backend, strict=True)`` under a deadline.

    MLX's init blocks inside C++ holding the GIL, so no Python thread can watch it: on the main
    thread a SIGALRM interrupts a waiting ``accept`` (MLX then raises, and this names the missing
    peer); as a last resort ``faulthandler`` ends the process 10 s after the deadline.
    """
    me = env.describe(env.rank)
    if env.backend == "ring" and env.rank == env.size - 1:
        # The last rank connects first; its neighbours are just now calling init and binding
        # their listeners. MLX's ring retries a refused connect only after a full second.
        time.sleep(0.2)
    fired = threading.Event()
    main = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    old = None
    if main:
        def _alarm(signum: int, frame: Any) -> None:
            fired.set()

        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        faulthandler.dump_traceback_later(timeout + 10.0, exit=True, file=sys.stderr)
    except (ValueError, AttributeError, OSError):  # stderr without a file descriptor: no backstop
        pass
    try:
        # "jaccl-ring" is a launch flavour (MLX_JACCL_RING); MLX's backend is "jaccl".
        group = mx.distributed.init(backend=env.backend.split("-")[0], strict=True)
    except RuntimeError as exc:
        if fired.is_set():
            others = ", ".join(env.describe(r) for r in ((env.rank - 1) % env.size, (env.rank + 1) % env.size)
                               if r != env.rank)
            raise PeerTimeoutError(f"{me}: MLX's {env.backend} group did not form within {timeout:g} s "
                                   f"(waiting for {others})") from None
        raise DistributedError(f"{me}: mx.distributed.init(backend={env.backend!r}) failed: {exc}") from exc
    finally:
        faulthandler.cancel_dump_traceback_later()
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    if group.size() != env.size or group.rank() != env.rank:
        raise DistributedError(f"{me}: MLX formed a group where this is rank {group.rank()} of {group.size()}, "
                               f"but the launch says rank {env.rank} of {env.size}")
    return group


@dataclass
class DistGroup:
    """A formed pipeline group: MLX's group, this rank's place in it, and its control links."""

    env: LaunchEnv
    group: Any  # mx.distributed.Group
    links: Links

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def size(self) -> int:
        return self.env.size

    @property
    def next(self) -> int:
        return (self.env.rank + 1) % self.env.size

    @property
    def prev(self) -> int:
        return (self.env.rank - 1) % self.env.size

    @property
    def device(self) -> mx.Device:
        return comm_device(self.env.backend)

    def describe(self, rank: int) -> str:
        host = self.links.peers.get(rank, {}).get("hostname")
        if rank < len(self.env.hosts):
            host = self.env.hosts[rank]
        return f"rank {rank}" + (f" ({host})" if host else "")


def join(fingerprint: str, *, env: LaunchEnv | None = None, backend: str | None = None, timeout: float = 60.0,
         environ: Mapping[str, str] | None = None) -> DistGroup:
    """Form the pipeline group from the launch environment: the ranks meet, then MLX's group forms.

    ``fingerprint`` is what every rank must agree on (the plan's, see ``StagePlan.fingerprint``).
    ``env`` defaults to ``LaunchEnv.from_environ(backend, environ)``. Blocks for up to about
    ``timeout`` seconds per phase; call it before starting the event loop.
    """
    env = env if env is not None else LaunchEnv.from_environ(backend, environ)
    if not mx.distributed.is_available(backend=env.backend.split("-")[0]):
        raise LaunchEnvError(f"this MLX build has no {env.backend!r} distributed backend")
    links = rendezvous(env, fingerprint, timeout=timeout)
    try:
        group = init_group(env, timeout=timeout)
    except BaseException:
        links.close()
        raise
    return DistGroup(env, group, links)
