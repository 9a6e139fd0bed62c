"""Inputs the repository never made, fourth sweep: memory sizes as people type them (exponents of
either sign, units that overflow), routing traces at their edges (one token, top-k equal to the
experts, written by hand) and user configs for ``bench offload --shapes PATH:LAYERS``. What runs says
what it did; what is refused is one line naming the option, file or field and what is accepted.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest
from _cli_support import run_cli

from asyncside.memory import memory_arg, parse_size


@pytest.mark.parametrize(("text", "size"), [
    ("1e-3G", 1073741), ("1e3M", 1000 << 20), ("1e+3K", 1000 << 10), ("  2G ", 2 << 30), ("2g", 2 << 30),
    ("2GiB", 2 << 30), ("2GB", 2 << 30), ("1.5G", 3 << 29), ("+1G", 1 << 30), (".5G", 1 << 29),
])
def test_a_size_takes_an_exponent_of_either_sign(text: str, size: int) -> None:
    """``--memory 1e-3G`` (about 1 MiB) was "expected a size such as 800M, 1.5G or 4096" while
    ``1e3M`` was taken: the number's pattern had no minus sign for the exponent."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1e300T", "1e308G", "1e400"])
def test_a_size_that_overflows_in_its_unit_is_one_line(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--memory 1e300T`` ended in OverflowError (cannot convert float infinity to integer): the
    number was finite, the number in its unit was not."""
    with pytest.raises(ValueError, match="expected a finite size"):
        parse_size(text, what="memory")
    rc, err = run_cli(capsys, "bench", "offload", "--memory", text)
    assert rc == 2 and "argument --memory" in err and "finite size" in err and "Traceback" not in err, err


def test_a_budget_of_one_byte_is_one_byte() -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=r"memory '1' is 1 byte; expected at least 4K"):
        memory_arg("1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"memory '1K' is 1024 bytes; expected at least 4K"):
        memory_arg("1K")


def _trace(path: pathlib.Path, ids: np.ndarray, n_experts: int, **arrays: object) -> str:
    np.savez(path, ids=ids, n_experts=n_experts, **arrays)
    return str(path)


def test_routing_info_gives_min_where_no_access_hits(tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A trace of one token: LRU said 0.0% and Belady's MIN was left out without a word (its ratio
    to LRU divides by it). "predictions: none per token" is "predictions: none"."""
    from asyncside import cli

    path = _trace(tmp_path / "one.npz", np.array([[[0, 1]]]), 8)
    assert cli.main(["routing", "info", path]) == 0
    out = capsys.readouterr().out
    assert "predictions: none\n" in out and "none per token" not in out, out
    assert out.count("LRU 0.0% hits, Belady's MIN 0.0%") == 2, out
    _trace(tmp_path / "pred.npz", np.array([[[0, 1]]]), 8, predicted=np.array([[[0, 1, 2]]]))
    assert cli.main(["routing", "info", str(tmp_path / "pred.npz"), "--no-min"]) == 0
    assert "predictions: 3 ids per token" in capsys.readouterr().out


def test_widening_a_trace_that_routes_every_expert_says_so(tmp_path: pathlib.Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A top-16 trace of 16 experts: ``routing widen --top-k 17`` said "top_k must be an int in (16,
    16]", an empty range."""
    ids = np.tile(np.arange(16), (3, 1, 1))
    path = _trace(tmp_path / "all.npz", ids, 16)
    rc, err = run_cli(capsys, "routing", "widen", path, str(tmp_path / "out.npz"), "--top-k", "17")
    assert rc == 2 and "routes every one of its 16 experts per token already" in err, err
    assert "(16, 16]" not in err and len(err.strip().splitlines()) == 1, err


#: a tiny Mixtral-style config; what each test changes is its point
TINY: dict[str, Any] = {
    "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 1000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
}


def _config(tmp_path: pathlib.Path, **changes: Any) -> str:
    path = tmp_path / "my-moe" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in {**TINY, **changes}.items() if v is not None}))
    return str(path)


def test_more_layers_than_a_config_has_names_the_shapes_option(tmp_path: pathlib.Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --shapes my-moe/config.json:3`` of a two-layer model said "--layers must be an
    integer in [1, 2] for my-moe": bench offload has no --layers."""
    config = _config(tmp_path)
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:3", "--cache-dir", str(tmp_path / "cache"))
    assert rc == 2 and f"--shapes {config}:3: my-moe has 2 MoE layers; LAYERS must be in [1, 2]" in err, err
    assert "--layers" not in err and "Traceback" not in err and not (tmp_path / "cache").exists(), err


@pytest.mark.parametrize(("changes", "said"), [
    ({"model_type": "qwen2_moe", "num_experts": 8, "num_local_experts": None, "decoder_sparse_step": 3},
     "its decoder_sparse_step 3 leaves none"),
    ({"model_type": "deepseek_v2", "n_routed_experts": 8, "num_local_experts": None, "first_k_dense_replace": 1,
      "moe_layer_freq": 2}, "its first_k_dense_replace 1, moe_layer_freq 2 leave none"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_local_experts": None, "mlp_only_layers": [0, 1]},
     "its mlp_only_layers [0, 1] leaves none"),
    ({"moe_layers": []}, "its moe_layers [] leaves none"),
])
def test_a_config_of_no_moe_layer_names_its_fields(changes: dict[str, Any], said: str, tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Refused, but the message listed every field of every model type ("its moe_layers /
    first_k_dense_replace / ... leave none"), not the config's own."""
    config = _config(tmp_path, **changes)
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:1")
    assert rc == 2 and f"{config}: no MoE layer among the 2 of num_hidden_layers: {said}" in err, err
    assert "interleave_moe_layer_step" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("argv", "said"), [
    (["--clients", "1,8", "--long-prompt-clients", "32"], "--long-prompt-clients 32: no phase of 32 clients "
                                                          "(--clients 1,8)"),
    (["--clients", "1,8", "--long-prompt-clients", "1,8,16"], "--long-prompt-clients 1,8,16: no phase of 16 clients"),
    (["--long-prompt-clients", "32", "--long-prompt", "0"], "--long-prompt-clients 32 with --long-prompt 0"),
])
def test_bench_serve_long_prompt_phases_are_among_the_phases(argv: list[str], said: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``bench serve --clients 1,8 --long-prompt-clients 32`` ran both phases without the long prompt,
    and nothing said the option named no phase; with ``--long-prompt 0`` it had nothing to send."""
    rc, err = run_cli(capsys, "bench", "serve", "--no-mlx-lm", *argv)
    assert rc == 2 and err.startswith(f"asyncside bench serve: error: {said}"), err
    assert len(err.strip().splitlines()) == 1, err


def test_a_budget_no_process_fits_is_a_usage_error(quick_store: pathlib.Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --memory 8K`` (taken: at least 4K) ended in exit status 1, "bench offload needs
    a memory cgroup that charges the page cache: ...", where the cgroup worked and the budget was at
    fault; now a usage error leading with --memory and saying what asyncside's plan needs."""
    from asyncside.bench import offload

    ok, why = offload.check_cgroups(1 << 30)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    rc, err = run_cli(capsys, "bench", "offload", "--stores", str(quick_store), "--memory", "8K", "--store-ratio",
                      "0.0001", "--systems", "slot-cache", "--localities", "low", "--quiet")
    # Refused before any run, on what every run of the store holds at the least (its top-k rows,
    # other weights, a run's process), the budget shown as given.
    assert rc == 2 and "error: --memory 8192 bytes holds no run of the store" in err, err
    assert "asyncside's smallest plan is about" in err and "(nothing was run)" in err, err
    assert "needs a memory cgroup" not in err and len(err.strip().splitlines()) == 1, err


#: the first two tokens of layer 0 of ``preset("low", tokens=64, n_layers=2, n_experts=64, top_k=6)``
LOW_FIRST_IDS = [[0, 30, 28, 27, 14, 45], [24, 39, 11, 33, 14, 41]]


class _CountedDraws:
    """A numpy Generator whose single draws (``random()``) are counted, and refused past ``most``."""

    def __init__(self, generator: np.random.Generator, most: int) -> None:
        self.generator, self.most, self.draws = generator, most, 0

    def random(self, *args: Any, **kwargs: Any) -> Any:
        self.draws += 1
        assert self.draws <= self.most, f"more than {self.most} draws"
        return self.generator.random(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.generator, name)


def test_a_preset_whose_top_k_is_every_expert_draws_each_slot_a_bounded_number_of_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``routing preset high OUT --experts 4096 --top-k 4096 --tokens 2 --layers 1`` ran for minutes: a
    slot redrew from the popularity until an expert the token had not taken came, and with a steep
    skew the last ones are drawn once in tens of thousands. After 64 draws a slot now draws among
    the experts left; the presets of fewer slots than experts are drawn as before."""
    from asyncside import routing

    real = np.random.default_rng
    made: list[_CountedDraws] = []

    def counted(*args: Any, **kwargs: Any) -> _CountedDraws:
        made.append(_CountedDraws(real(*args, **kwargs), most=65 * 4096))
        return made[-1]

    monkeypatch.setattr(np.random, "default_rng", counted)
    trace = routing.preset("high", tokens=1, n_layers=1, n_experts=4096, top_k=4096)
    assert sorted(trace.ids[0, 0].tolist()) == list(range(4096))
    monkeypatch.setattr(np.random, "default_rng", real)
    # Fewer slots than experts: the figures docs/routing-traces.md gives are drawn as they were.
    low = routing.preset("low", tokens=64, n_layers=2, n_experts=64, top_k=6)
    assert low.ids[:2, 0].tolist() == LOW_FIRST_IDS, low.ids[:2, 0].tolist()


@pytest.mark.parametrize(("text", "parsed"), [
    ("my-moe/config.json: 2", [("my-moe/config.json", 2)]), ("my-moe/config.json :2", [("my-moe/config.json", 2)]),
    ("qwen3-30b-a3b: 4, mixtral-8x7b", [("qwen3-30b-a3b", 4), ("mixtral-8x7b", None)]),
])
def test_spaces_around_a_layer_count_are_left_out(text: str, parsed: list[tuple[str, int | None]]) -> None:
    """``--shapes "my-moe/config.json: 2"`` was "LAYERS must be a positive integer, got ' 2'", and a
    space before the colon made the path one that does not exist."""
    from asyncside.bench.shapes import parse_shape_list

    assert parse_shape_list(text) == parsed


@pytest.mark.parametrize("count", ["²", "³"])
def test_a_layer_count_of_no_ascii_digits_is_one_line(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--shapes qwen3-30b-a3b:²`` ended in a traceback (ValueError: invalid literal for int()):
    str.isdigit takes superscript digits, int() does not."""
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"qwen3-30b-a3b:{count}")
    assert rc == 2 and f"LAYERS must be a positive integer, got {count!r}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_bench_serve_refuses_an_mlx_lm_model_it_cannot_serve(what: str, tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``bench serve --mlx-lm-model /nonexist`` started both servers; mlx_lm.server answered 503 (its
    loading thread had died) and the bench waited out its ten-minute startup timeout, saying nothing."""
    model = tmp_path / "model"
    if what == "empty":
        model.mkdir()
    rc, err = run_cli(capsys, "bench", "serve", "--mlx-lm-model", str(model))
    said = "no such directory" if what == "missing" else "no config.json there"
    assert rc == 2 and err.startswith(f"asyncside bench serve: error: --mlx-lm-model {model}: {said}"), err
    assert "--no-mlx-lm" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("widened", "said"), [
    ("yes", '  widened: "yes"'), (True, "  widened: true"), ({"from_top_k": 1}, "  widened from top-1\n"),
    ({"by": "my tool"}, '  widened: {"by": "my tool"}'),
])
def test_routing_info_shows_a_hand_written_widened_as_it_is(widened: object, said: str, tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A trace whose JSON meta has a "widened" key of another form than ``widen`` writes (a string,
    true, a dict without "rule"): ``routing info`` ended in TypeError or KeyError."""
    from asyncside import cli

    path = _trace(tmp_path / "mine.npz", np.array([[[0, 1]], [[2, 3]]]), 8,
                  meta=np.array(json.dumps({"widened": widened})))
    assert cli.main(["routing", "info", path, "--no-min"]) == 0
    assert said in capsys.readouterr().out


def test_a_preset_of_too_many_experts_to_generate_is_refused_before_it_starts(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``routing preset low OUT --layers 2000 --experts 1048576 --tokens 1`` was let through (2000
    ids), and the generator's tables of every layer's experts (about 17 bytes an expert) took 34 GB:
    the ids were counted, the experts were not."""
    from asyncside import memory

    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(64 << 20, "test"))
    out = tmp_path / "p.npz"
    rc, err = run_cli(capsys, "routing", "preset", "low", str(out), "--layers", "8", "--experts", "1048576",
                      "--top-k", "1", "--tokens", "1")
    assert rc == 2 and "--layers 8 x --experts 1048576: 8 expert ids and 8388608 layer-expert entries" in err, err
    assert "fewer tokens, layers or experts" in err and not out.exists() and len(err.strip().splitlines()) == 1, err


def test_bench_policy_counts_the_per_layer_tables_before_it_generates(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``bench policy --shapes 1048576x1 --layers 2000 --tokens 1`` passed the size check (it counted
    the expert ids alone) and would have needed tens of GB for the layers' expert tables."""
    from asyncside import memory

    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(64 << 20, "test"))
    rc, err = run_cli(capsys, "bench", "policy", "--presets", "low", "--shapes", "1048576x1", "--layers", "8",
                      "--tokens", "1")
    assert rc == 2 and "8388608 layer-expert entries" in err and "fewer tokens, layers or experts" in err, err
