"""Errors of the distributed pipeline. Every message names the rank (and host) it is about."""

from __future__ import annotations

from ..errors import AsyncsideError


class DistributedError(AsyncsideError, RuntimeError):
    """Something went wrong between the ranks of a pipeline."""


class LaunchEnvError(DistributedError, ValueError):
    """The environment does not describe a distributed launch (which variable, what was expected)."""


class PeerTimeoutError(DistributedError, TimeoutError):
    """A peer did not come up (or answer) before the deadline; ``peer`` is its rank."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerLostError(DistributedError):
    """A peer died, hung, or aborted; the group cannot go on. ``origin`` is the rank that failed first.

    After this error the MLX group is unusable (a transfer with the dead peer can never complete):
    the process should report and exit (:func:`asyncside.distributed.exit_after_peer_loss`).
    """

    def __init__(self, message: str, origin: int | None = None) -> None:
        super().__init__(message)
        self.origin = origin


class ProtocolError(DistributedError):
    """A rank received a message it cannot accept (bad header, out-of-order sequence number)."""


class StageError(DistributedError):
    """One request failed on a stage (its message says which rank and why); other requests go on."""
