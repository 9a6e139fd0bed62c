"""pytest plugin: fixtures for testing code that uses asyncside, under pytest-asyncio.

Installed with asyncside and registered through the ``pytest11`` entry point, so the fixtures are
available in any pytest run once ``asyncside`` is installed (disable with ``-p no:asyncside``):

``make_expert_store(...)``
    factory: writes a small expert store with random contents into a temporary directory and
    returns it opened (:class:`asyncside.ExpertStore`).
``expert_store``
    ``make_expert_store()`` with the default layout (2 layers x 8 experts, 3 float16 segments).
``asyncside_runtime``
    async fixture: a :class:`asyncside.runtime.Runtime` over ``expert_store``, entered on the
    test's running event loop; at teardown it is closed and every layer's ledger must audit
    clean (the test fails otherwise). Options come from the
    ``@pytest.mark.asyncside_runtime(resident=..., reader=..., ...)`` marker.
``faulty_reader``
    injects read faults into ``asyncside_runtime``'s reader: an errno for one expert's record,
    short reads, transient EAGAIN/EINTR; see :class:`FaultyReader`.
``no_blocking``
    fails an async test whose event loop thread blocks longer than a threshold (a watchdog; see
    :mod:`asyncside.testing_blocking`); ``@pytest.mark.no_blocking(threshold=..., strict=...)``.

The module is imported by every pytest run in an environment where asyncside is installed, so it
imports nothing heavy at import time: MLX, numpy and the runtime are imported inside fixtures.
The async fixture is declared with ``pytest_asyncio.fixture``, so it works in pytest-asyncio's
strict mode; it runs on the test's own loop (function scope).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime
    from .store import ExpertStore

try:
    import pytest_asyncio

    _async_fixture: Callable[..., Any] = pytest_asyncio.fixture
    _HAVE_PYTEST_ASYNCIO = True
except ImportError:  # the async fixtures then explain what is missing instead of breaking pytest
    _async_fixture = pytest.fixture
    _HAVE_PYTEST_ASYNCIO = False

#: segment key -> (row shape, dtype) of the default store: the shape of a small SwitchGLU.
DEFAULT_SEGMENTS: dict[str, tuple[tuple[int, ...], str]] = {
    "gate_proj.weight": ((32, 16), "float16"),
    "up_proj.weight": ((32, 16), "float16"),
    "down_proj.weight": ((16, 32), "float16"),
}

from .audit import audit_problems  # noqa: E402  (re-exported; the server's /health uses it too)
from .testing_blocking import no_blocking  # noqa: E402,F401  (re-exported fixture; imports no MLX)

RUNTIME_MARKER = "asyncside_runtime"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{RUNTIME_MARKER}(**kwargs): keyword arguments for the Runtime built by the asyncside_runtime fixture "
        "(resident=, side_rows=, policy=, reader=, reader_options=, ...)",
    )
    config.addinivalue_line(
        "markers", "no_blocking(threshold=0.05, strict=False, interval=None): configure the no_blocking fixture"
    )


def random_layers(
    layers: Sequence[int] | int = 2,
    n_experts: int = 8,
    segments: Mapping[str, tuple[Sequence[int], str]] | None = None,
    seed: int = 0,
) -> dict[int, dict[str, Any]]:
    """Random expert weights: layer -> {key: numpy array (n_experts, *shape)}; deterministic per seed."""
    import numpy as np

    if isinstance(layers, int):
        layers = list(range(layers))
    if n_experts < 1:
        raise ValueError(f"n_experts must be at least 1, got {n_experts}")
    segments = DEFAULT_SEGMENTS if segments is None else segments
    rng = np.random.default_rng(seed)
    out: dict[int, dict[str, Any]] = {}
    for layer in layers:
        arrays = {}
        for key, (shape, dtype) in segments.items():
            full = (n_experts, *shape)
            if np.dtype(dtype).kind in "iu":
                info = np.iinfo(dtype)
                arrays[key] = rng.integers(info.min, info.max, size=full, dtype=dtype, endpoint=True)
            else:
                arrays[key] = rng.standard_normal(full).astype(dtype)
        out[int(layer)] = arrays
    return out


@pytest.fixture
def make_expert_store(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ExpertStore]:
    """Factory fixture: ``make_expert_store(layers=2, n_experts=8, segments=None, seed=0, **create_kwargs)``.

    ``layers`` is a count or a list of layer indices; ``segments`` maps key -> (row shape, dtype);
    further keywords (``alignment``, ``checksum``, ``metadata``) go to ``ExpertStore.create``.
    Each call writes a new store in its own temporary directory.
    """
    from .store import ExpertStore

    counter = itertools.count()

    def make(
        layers: Sequence[int] | int = 2,
        n_experts: int = 8,
        segments: Mapping[str, tuple[Sequence[int], str]] | None = None,
        seed: int = 0,
        **create_kwargs: Any,
    ) -> ExpertStore:
        root = tmp_path_factory.mktemp("asyncside-store")
        data = random_layers(layers, n_experts, segments, seed)
        return ExpertStore.create(root / f"store{next(counter)}", data, **create_kwargs)

    return make


@pytest.fixture
def expert_store(make_expert_store: Callable[..., ExpertStore]) -> ExpertStore:
    """A small expert store with random contents (2 layers x 8 experts, checksummed)."""
    return make_expert_store()


@_async_fixture
async def asyncside_runtime(request: pytest.FixtureRequest, expert_store: ExpertStore) -> AsyncIterator[Runtime]:
    """A Runtime over ``expert_store`` on the test's loop; closed and audited clean at teardown.

    Fills that failed on purpose (see ``faulty_reader``) do not fail the teardown; a ledger left
    inconsistent (a leaked or half-published row) does.
    """
    if not _HAVE_PYTEST_ASYNCIO:
        pytest.fail("the asyncside_runtime fixture needs pytest-asyncio (pip install pytest-asyncio)")
    import asyncio

    from .runtime import Runtime

    kwargs: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(RUNTIME_MARKER))):
        kwargs.update(marker.kwargs)  # the closest marker wins

    # pytest-asyncio runs a fixture's setup and teardown in different tasks, but the Runtime's
    # task group must be entered and exited by one task: an owner task holds the context open
    # for the duration of the test. The runtime is still used from the test's own task.
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[Runtime] = loop.create_future()
    stop = asyncio.Event()

    async def own() -> None:
        try:
            async with Runtime(expert_store, **kwargs) as runtime:
                ready.set_result(runtime)
                await stop.wait()
                try:
                    await runtime.drain()
                except BaseExceptionGroup:
                    pass  # failed fills are the test's business; the audit is the plugin's
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
                return
            raise

    owner = asyncio.create_task(own(), name="asyncside_runtime owner")
    try:
        runtime = await ready
    except BaseException:
        await asyncio.gather(owner, return_exceptions=True)
        raise
    try:
        yield runtime
    finally:
        stop.set()
        await owner
    problems = audit_problems(runtime)
    if problems:
        pytest.fail("asyncside_runtime: ledger audit after close found:\n  " + "\n  ".join(problems))

def _scheduler_of(runtime: Any) -> Any:
    scheduler = getattr(runtime, "scheduler", None) or getattr(runtime, "_scheduler", None)
    if scheduler is None or not hasattr(scheduler, "set_faults"):
        raise RuntimeError("this Runtime exposes no scheduler with fault hooks (Scheduler.set_faults)")
    return scheduler


class FaultyReader:
    """Fault injection into a running Runtime's reader (the read backends' test hooks).

    The hooks act below the scheduler, in the reader itself (native io_uring / thread pool, or
    aiofiles), so everything above -- scheduler, ledger, runtime, model -- sees a real failure.
    One failing range is active at a time: :meth:`fail` replaces the previous one. Settings
    combine: ``fail`` + ``short_reads`` + ``transient`` may all be on together.
    """

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._settings: dict[str, Any] = {}

    def _apply(self) -> None:
        _scheduler_of(self.runtime).set_faults(**self._settings)

    def fail(self, layer: int, expert: int, errno: int = 5) -> None:
        """Every read of ``expert``'s record in ``layer`` fails with ``errno`` (default EIO)."""
        spec = self.runtime.store.layer(layer)
        if not 0 <= expert < spec.n_experts:
            raise ValueError(f"layer {layer}: expert {expert} is out of range [0, {spec.n_experts})")
        lo = spec.record_offset(expert)
        self._settings.update(path=str(spec.path), lo=lo, hi=lo + spec.stride, err=int(errno))
        self._apply()

    def short_reads(self, max_bytes: int = 512) -> None:
        """Cap every read operation at ``max_bytes`` (the reader must loop to complete records)."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self._settings["max_read_bytes"] = int(max_bytes)
        self._apply()

    def transient(self, every: int = 3, errno: int = 11) -> None:
        """Every ``every``-th read fails once with ``errno`` (EAGAIN by default) and is retried."""
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self._settings.update(transient_every=int(every), transient_err=int(errno))
        self._apply()

    def clear(self) -> None:
        """Turn every fault off."""
        self._settings = {}
        self._apply()

    def counters(self) -> dict[str, int]:
        """The reader's counters (``faults_injected``, ``short_reads``, ``retries``, ...)."""
        return dict(_scheduler_of(self.runtime).reader.counters())


@pytest.fixture
def faulty_reader(asyncside_runtime: Runtime) -> Iterator[FaultyReader]:
    """Fault injection into ``asyncside_runtime``'s reader; faults are cleared at teardown."""
    faults = FaultyReader(asyncside_runtime)
    yield faults
    faults.clear()
