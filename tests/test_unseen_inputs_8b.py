"""Unseen inputs, round 8b: `routing info`'s LRU is the runtime's LRU (the ledger's order within a
step, not a stack's), `bench serve --routing` reads a pipe once, and a distributed rank's bad
--split or a path that is no store is a usage error (one line, exit status 2)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest

from asyncside.errors import CapacityError
from asyncside.policy_replay import lru_hits, replay_steps, trace_lru_hits
from asyncside.routing import RoutingTrace, preset

# ---- routing info's LRU is replay_steps(..., "lru") --------------------------------------------

#: One layer of 8 experts, top-2: at 4 rows the ledger's LRU hits once, a stack with ties by id twice.
HAND = [[4, 6], [5, 7], [2, 3], [0, 2], [1, 5], [3, 6]]


def _replayed(demands: list[list[int]], n_experts: int, rows: int) -> int:
    return replay_steps(demands, n_experts, rows, "lru").hits


def test_the_minimal_case_hits_as_the_ledger_does() -> None:
    """Step 1's misses 1 and 2 evict 0 (the ledger keeps 3, used at step 0 with the higher id);
    the stack kept 0 and lost 3, so it counted one hit where the ledger has two."""
    demands = [[0, 3], [1, 2], [2, 3]]
    assert _replayed(demands, 4, 3) == 2
    assert [c.hits for c in lru_hits(demands, 4, [3])] == [2]
    assert lru_hits(demands, 4, [3])[0].accesses == 6


def _random_demands(rng: np.random.Generator) -> tuple[list[list[int]], int]:
    n = int(rng.integers(1, 10))
    width = int(rng.integers(1, n + 1))
    demands = []
    for _ in range(int(rng.integers(0, 16))):
        d = rng.choice(n, size=int(rng.integers(0, width + 1)), replace=False).tolist()
        if d and rng.random() < 0.3:
            d += d[: int(rng.integers(1, len(d) + 1))]  # repeats within a step count once
        demands.append([int(e) for e in rng.permutation(d)])
    return demands, n


def test_lru_hits_equal_the_ledgers_on_random_traces() -> None:
    """Ragged steps, repeats, empty steps, ids in any order, every row count 0..experts: the same
    hits as a Ledger replayed with "lru", and a refusal where the ledger refuses (a step demands
    more distinct experts than rows)."""
    rng = np.random.default_rng(8)
    for _ in range(400):
        demands, n = _random_demands(rng)
        widest = max((len(set(d)) for d in demands), default=0)
        fits = [r for r in range(n + 1) if r >= widest]
        got = lru_hits(demands, n, fits)
        for r, counts in zip(fits, got):
            want = replay_steps(demands, n, r, "lru")
            assert (counts.hits, counts.accesses) == (want.hits, want.accesses), (demands, n, r)
        for r in range(widest):
            with pytest.raises(CapacityError):
                replay_steps(demands, n, r, "lru")
            with pytest.raises(ValueError, match=f"distinct experts but the cache has {r} rows"):
                lru_hits(demands, n, [r])



@pytest.mark.parametrize("elements", [1, 40])
def test_lru_hits_in_small_blocks_equal_the_ledgers(elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The passes go a block of steps (and of undecided accesses) at a time, to bound memory on
    long or wide traces: blocks of one step or one access, or cutting steps apart, change nothing."""
    from asyncside import policy_replay

    monkeypatch.setattr(policy_replay, "_BLOCK_ELEMENTS", elements)
    rng = np.random.default_rng(80)
    for _ in range(60):
        demands, n = _random_demands(rng)
        widest = max((len(set(d)) for d in demands), default=0)
        fits = list(range(widest, n + 1))
        assert [c.hits for c in lru_hits(demands, n, fits)] == [_replayed(demands, n, r) for r in fits], demands


def test_undecided_accesses_are_solved_a_bounded_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each access that can go either way holds its step's W slots while it is solved: all of a
    long top-32 layer's at once took arrays of millions x 32. The solve takes a block at a time,
    each within _BLOCK_ELEMENTS (the same figures: test above)."""
    from asyncside import policy_replay

    monkeypatch.setattr(policy_replay, "_BLOCK_ELEMENTS", 4096)
    sizes: list[int] = []
    settle = policy_replay._settle

    def counted(hit: Any, maybe: Any, *args: Any) -> None:
        sizes.append(len(maybe))
        settle(hit, maybe, *args)

    monkeypatch.setattr(policy_replay, "_settle", counted)
    rng = np.random.default_rng(3)
    ids = np.array([rng.choice(64, 32, replace=False) for _ in range(400)])[:, None, :].astype(np.int32)
    trace = RoutingTrace(ids, np.array([400]), 64, {})
    assert trace_lru_hits(trace, [48]) == [_replayed(trace.layer_steps(0), 64, 48)]
    assert len(sizes) > 1 and max(sizes) * 32 * 4 <= 4096, sizes

def test_lru_hits_refuse_an_id_outside_the_experts() -> None:
    for bad in ([[0, 4]], [[-1, 2]]):
        with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
            lru_hits(bad, 4, [2])
    assert lru_hits([], 4, [0, 4])[0].accesses == 0


@pytest.mark.parametrize("name", ["high", "middle", "low"])
def test_trace_lru_hits_equal_the_ledgers_on_presets(name: str) -> None:
    trace = preset(name, tokens=400, n_layers=3, n_experts=16, top_k=4, seed=5)
    want = [sum(_replayed(trace.layer_steps(layer), 16, r) for layer in range(3)) for r in (4, 8)]
    assert trace_lru_hits(trace, [4, 8]) == want


def test_routing_info_shows_the_runtimes_lru(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It showed the stack's 2 hits of 12 at 4 rows; the runtime's LRU (bench policy's) hits once."""
    from asyncside.cli import main
    from asyncside.policy_replay import replay_trace, total

    ids = np.array(HAND, dtype=np.int32)[:, None, :]
    trace = RoutingTrace(ids, np.array([len(HAND)]), 8, {"source": "hand"})
    path = tmp_path / "hand.npz"
    trace.save(path)
    assert main(["routing", "info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [c["rows"] for c in info["caches"]] == [2, 4]
    for c in info["caches"]:
        assert c["lru"] == round(total(replay_trace(trace, c["rows"], "lru")).hit_rate, 4)
    assert info["caches"][1]["lru"] == round(1 / 12, 4)


def test_routing_info_replays_no_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's figure without a Ledger per layer and size (slow on long traces)."""
    from asyncside import policy_replay
    from asyncside.routing_cli import trace_info

    trace = preset("low", tokens=300, n_layers=2, n_experts=16, top_k=4, seed=2)
    want = [sum(_replayed(trace.layer_steps(layer), 16, r) for layer in range(2)) for r in (4, 8)]

    def replayed(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("replayed a Ledger")

    monkeypatch.setattr(policy_replay, "Ledger", replayed)
    info = trace_info(trace, with_min=False)
    assert [c["lru"] for c in info["caches"]] == [round(h / (300 * 2 * 4), 4) for h in want]


def test_no_min_help_says_what_min_costs_now(capsys: pytest.CaptureFixture[str]) -> None:
    """It said MIN was "slow on long traces", true of the per-layer walk before aa595df: the
    vectorised pass takes about as long as the LRU figures; only layers too wide for it walk."""
    from asyncside.cli import main

    with pytest.raises(SystemExit):
        main(["routing", "info", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "slow on long traces" not in text
    assert "about as long again as the LRU figures" in text and "steps each layer in Python" in text


# ---- bench serve --routing reads a pipe once ------------------------------------------------


def _saved(trace: RoutingTrace, tmp_path: pathlib.Path) -> bytes:
    path = tmp_path / "t.npz"
    trace.save(path)
    return path.read_bytes()


class _EngineOpened(Exception):
    """Raised where the engine would open its model: the test stops there."""


def test_bench_serve_replays_a_trace_from_a_pipe(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench serve --routing <(cat t.npz)` read the pipe to check it, then the engine opened the
    path again and found it empty: the trace read once is what the engine gets. Through the
    command's own argument handling, up to where the engine opens (no server starts)."""
    import os

    import asyncside.serving as serving
    from asyncside.bench import serve as bench_serve
    from asyncside.cli import build_parser
    from asyncside.serving import engine

    trace = preset("high", tokens=20, n_layers=2, n_experts=32, top_k=4, sequences=2)
    seen: dict[str, Any] = {}

    def open_engine(model: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise _EngineOpened

    def create_app(factory: Any, settings: Any) -> Any:
        factory()  # what the server does as it starts

    monkeypatch.setattr(engine, "open_engine", open_engine)
    monkeypatch.setattr(serving, "create_app", create_app)
    monkeypatch.setattr(bench_serve, "require_extra", lambda *_a: None)
    data = _saved(trace, tmp_path)
    r, w = os.pipe()
    try:
        assert len(data) < 16 << 10  # fits the pipe's buffer: written whole before it is read
        os.write(w, data)
        os.close(w)
        w = -1
        args = build_parser().parse_args(["bench", "serve", "--no-mlx-lm", "--routing", f"/dev/fd/{r}"])
        with pytest.raises(_EngineOpened):
            bench_serve.run_serve_bench(args)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    routing = seen["routing"]
    assert isinstance(routing, RoutingTrace), routing  # not the path of a pipe already read
    assert np.array_equal(routing.ids, trace.ids) and seen["routing_source"] == f"/dev/fd/{r}"


# ---- a distributed rank: a path that is no store, a --split that does not fit -----------------

_LAUNCH_VARS = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "NCCL_HOST_IP", "NCCL_PORT",
                "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")


@pytest.fixture()
def no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No distributed launch environment: the usage error must come before it is looked for."""
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def _never(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the rank went on past its usage error")


def _no_store(tmp_path: pathlib.Path, what: str) -> pathlib.Path:
    path = tmp_path / "nothing"
    if what == "model dir":
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 2}))
    elif what == "empty dir":
        path.mkdir()
    return path


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("what", ["missing", "model dir", "empty dir"])
def test_a_rank_on_a_path_that_is_no_store_is_a_usage_error(
        what: str, single: bool, tmp_path: pathlib.Path, no_launch_env: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncside.distributed PATH`` ended with status 1 ('no distributed launch
    environment', or the plan's error under one; --single in a traceback): one line, status 2,
    naming the path, as `asyncside demo --model PATH` does."""
    from asyncside.distributed.rank import main as rank_main

    path = _no_store(tmp_path, what)
    rc = rank_main([str(path), *(["--single"] if single else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(path) in err[0] and "not an expert store" in err[0], err
    assert err[0].startswith("asyncside rank ?: "), err


def _layers(store: pathlib.Path) -> int:
    from asyncside.distributed.stage import model_layout

    return model_layout(store)[0]


def test_a_rank_refuses_a_split_that_does_not_fit_the_model(
        quick_store: pathlib.Path, no_launch_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A --split whose counts do not sum to the model's layers ended with status 1, and only once
    a launch environment was found: now one line, status 2, before it is looked for."""
    from asyncside.distributed.rank import main as rank_main

    n = _layers(quick_store)
    rc = rank_main([str(quick_store), "--split", f"{n},1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"asyncside rank ?: --split {n},1: the counts must sum to the model's {n} decoder "
                               f"layers (they sum to {n + 1})"], err


def test_a_rank_refuses_a_split_of_another_rank_count(
        quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Under a launch of one rank, a split of two that fits the model: status 2 (it was 1), and
    the ranks never meet."""
    import types

    from asyncside.distributed import group
    from asyncside.distributed.rank import main as rank_main

    monkeypatch.setattr(group.LaunchEnv, "from_environ",
                        classmethod(lambda cls, backend=None: types.SimpleNamespace(size=1, backend="ring")))
    monkeypatch.setattr(group, "join", _never)
    n = _layers(quick_store)
    rc = rank_main([str(quick_store), "--split", f"{n - 1},1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"--split {n - 1},1 has 2 entries for 1 rank" in err[0], err


def test_serve_pipeline_refuses_a_split_that_does_not_fit_the_model(
        quick_store: pathlib.Path, no_launch_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    from _cli_support import run_cli

    n = _layers(quick_store)
    rc, err = run_cli(capsys, "serve", "--pipeline", "--model", str(quick_store), "--split", f"{n},1")
    assert rc == 2 and err.strip().splitlines() == [
        f"asyncside serve: --split {n},1: the counts must sum to the model's {n} decoder layers "
        f"(they sum to {n + 1})"], err


def test_a_rank_asked_to_keep_logits_without_out_is_a_usage_error(
        quick_store: pathlib.Path, no_launch_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``--keep-logits`` without ``--out`` ended with status 1 (a SystemExit of its message): one
    line, status 2, as the rank's other usage errors."""
    from asyncside.distributed.rank import main as rank_main

    rc = rank_main([str(quick_store), "--keep-logits"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["asyncside rank ?: --keep-logits needs --out (the directory its logits.npz goes to)"], err
