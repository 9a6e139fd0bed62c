"""Pipeline stages across processes and machines, on MLX's distributed engine.

Each rank runs a contiguous range of decoder layers (a *stage*) of one model and streams that
range's experts from its own part of the expert store with its own Runtime; hidden states,
predicted expert ids and tokens cross between stages with ``mx.distributed.send``/``recv``.
See docs/distributed.md for how to run it on several machines.

- :func:`join`: form the group from the launch environment (``mlx.launch`` or MLX_RANK /
  MLX_HOSTFILE), with deadlines; call it before the event loop starts.
- :func:`plan_for_store` / :func:`make_plan`: which layers each rank runs (``--split``).
- :func:`load_stage_model`: a rank's model (its layers' weights only) and its part of the store.
- :class:`Pipeline`: one rank's stage between two boundaries; rank 0's ``generate``.
- :class:`LocalLaunch`: N ranks on this machine over loopback, for demos, benchmarks and tests.
"""

from __future__ import annotations

from .errors import (
    DistributedError,
    LaunchEnvError,
    PeerLostError,
    PeerTimeoutError,
    ProtocolError,
    StageError,
)
from .plan import PlanError, Stage, StagePlan, even_split, make_plan, parse_split

__all__ = [
    "DistributedError", "LaunchEnvError", "PeerLostError", "PeerTimeoutError", "PlanError", "ProtocolError",
    "Stage", "StageError", "StagePlan", "even_split", "make_plan", "parse_split",
    "DistGroup", "LaunchEnv", "join", "LocalLaunch", "LaunchResult", "Pipeline", "load_stage_model",
    "plan_for_store", "exit_after_peer_loss",
]


def __getattr__(name: str) -> object:
    # The group, pipeline and launcher import MLX; keep `import asyncside.distributed` cheap.
    if name in ("DistGroup", "LaunchEnv", "join"):
        from . import group

        return getattr(group, name)
    if name in ("LocalLaunch", "LaunchResult"):
        from . import launcher

        return getattr(launcher, name)
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    if name in ("load_stage_model", "plan_for_store"):
        from . import stage

        return getattr(stage, name)
    if name == "exit_after_peer_loss":
        from .rank import exit_after_peer_loss

        return exit_after_peer_loss
    raise AttributeError(f"module 'asyncside.distributed' has no attribute {name!r}")
