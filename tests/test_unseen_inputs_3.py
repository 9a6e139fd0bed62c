"""Valid but unusual inputs run end to end: tiny models of every architecture, pools at their
edges, budgets just above the smallest plan, routing traces of other shapes than the model. What
runs is exact and stays under its budget; what must be refused is refused early, in one line.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from _cli_support import offload_args, run_cli

from asyncside.bench import offload

MB = 1_000_000

#: a tiny Mixtral-style config (the experts' width is ``intermediate_size``): built in a second
TINY_MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 1000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
}


class _ReachedTheRuns(Exception):
    """The bench got past its budget checks to the runs' cgroup (the budget it chose)."""


def _store_bytes(store_dir: Any) -> tuple[int, int]:
    """(a record's bytes, every record's bytes) of the store at ``store_dir``."""
    from asyncside.store import ExpertStore

    store = ExpertStore.open(store_dir)
    return store.layer(next(iter(store.layers))).stride, sum(sp.blob_bytes for sp in store.layers.values())


def test_a_built_shape_gets_the_smallest_plan_of_the_same_store_reused(tmp_path: pathlib.Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench offload --shapes olmoe-1b-7b:2 --store-ratio 1`` built the shape (a minute), then
    refused its 526 MB store as less than the budget "raised to asyncside's smallest plan, about
    657 MB": the plan counted what the bench's own process held, grown by the build by some 230 MB.
    The same command again, the store reused, ran with a 526 MB budget. The process a run starts
    is measured before anything is built."""
    from asyncside import memory
    from asyncside.bench import shapes

    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_MIXTRAL))
    built = shapes.ensure_shape(config, layers=2, vocab=512, cache_dir=tmp_path / "cache", progress=False)
    store_bytes = int(built["store_bytes"])

    grown = {"by": 0}
    real_ensure, real_rss = shapes.ensure_shape, memory.proc_self_bytes

    def ensure_and_grow(*args: Any, **kwargs: Any) -> Any:
        grown["by"] = 300 * MB  # what a build of a larger shape leaves in the process
        return real_ensure(*args, **kwargs)

    def rss(name: str, key: str) -> int:
        return 100 * MB + grown["by"] if (name, key) == ("status", "VmRSS") else real_rss(name, key)

    def cgroups(budget: int) -> tuple[bool, str]:
        if budget == 1 << 30:  # the check before building
            return True, "a cgroup"
        raise _ReachedTheRuns(budget)

    monkeypatch.setattr(shapes, "ensure_shape", ensure_and_grow)
    monkeypatch.setattr(memory, "proc_self_bytes", rss)
    monkeypatch.setattr(offload, "check_cgroups", cgroups)
    record, experts = _store_bytes(built["store"])
    # The process a run starts, as the bench measures it (a fresh child: several times the CPU's on
    # MLX CUDA), not the stand-in size of this one.
    least = offload.least_budget({"moe_layers": 2, "top_k": 2, "record_bytes": record, "store_bytes": store_bytes,
                                  "expert_bytes": experts, "process_bytes": offload.process_baseline()})
    # A ratio the store passes against its smallest plan with room to spare, and fails against a
    # plan 300 MB larger.
    ratio = store_bytes / (least + 100 * MB)
    args = offload_args("--shapes", f"{config}:2", "--store-ratio", repr(ratio), "--cache-dir",
                        str(tmp_path / "cache"), "--localities", "low", "--quiet")
    with pytest.raises(_ReachedTheRuns) as info:
        offload.run_offload_bench(args)
    assert info.value.args[0] == int(store_bytes / ratio), info.value.args


@pytest.mark.parametrize(("argv", "given"), [
    (["--memory", "300M"], "--memory (300.0 MiB) with --ranks 2"),
    (["--resident", "auto"], "--resident auto with --ranks 2"),
    (["--memory", "300M", "--resident", "0.5"], "--memory (300.0 MiB) with --ranks 2"),
])
def test_ranks_refuse_a_budget_they_would_not_keep(argv: list[str], given: str, quick_store: pathlib.Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --ranks 2 --memory 300M`` ran the one-process generation without the budget, started
    ranks that refused ``--resident auto`` (exit status 2, their usage on stderr), then ended in a
    traceback formatting 'auto' as a percentage; with ``--resident 0.5`` the budget bounded
    nothing and nothing said so."""
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--ranks", "2", "--tokens", "2", "--quiet", *argv)
    assert rc == 2 and given in err and "--resident 0.25 and no --memory" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_pools_without_a_dynamic_row_are_refused_at_the_start(quick_store: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --side-rows 0`` pinned a quarter of each layer's experts and left no row to read the
    others into: the demo ran its reference, then failed at the first token routed elsewhere with
    "demand needs 1 distinct non-resident experts at once but the side region has 0 rows", naming
    no option. The plan refuses it; pinning every expert still runs."""
    from asyncside.errors import AsyncsideError
    from asyncside.runtime import _plan
    from asyncside.store import ExpertStore

    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--side-rows", "0", "--tokens", "2", "--quiet")
    assert rc == 2 and "side_rows=0 with 8 of layer 0's 32 experts pinned (by resident=0.25)" in err, err
    assert "side_rows of at least 1" in err and len(err.strip().splitlines()) == 1, err
    store = ExpertStore.open(quick_store)
    plan = dict(resident=0.25, side_rows=0, min_side_rows=None, memory=None, direct=None, host_tier=0,
                tier_possible=False)
    with pytest.raises(AsyncsideError, match=r"^side_rows=0 with 2 of layer 0's 32 experts pinned \(as named by pinned\) leaves no row"):
        _plan.plan_memory(store, list(store.layers), **{**plan, "pinned": {0: [1, 2], 1: [3]}})  # type: ignore[arg-type]
    everything = _plan.plan_memory(store, list(store.layers), **{**plan, "resident": 1.0, "pinned": None})  # type: ignore[arg-type]
    assert set(everything.rows.values()) == {32}


def test_offload_prompts_a_model_whose_vocabulary_ends_before_its_prompt(tmp_path: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run of ``bench offload`` prompted the byte tokenizer's "T" (id 84): on a store of a
    64-token vocabulary asyncside refused the id (exit status 1) while mlx-lm and the slot cache
    embedded whatever lay past the table and reported tokens unlike the reference's."""
    from _offload_support import offload_budget
    from mlx_lm.utils import save_config, save_model

    from asyncside.models.convert import convert_model

    from _models_support import BASE, tiny_model

    budget = offload_budget(1 << 30)
    ok, why = offload.check_cgroups(budget)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    monkeypatch.setitem(BASE, "qwen3_moe", {**BASE["qwen3_moe"], "vocab_size": 64})
    model, config = tiny_model("qwen3_moe")
    save_model(tmp_path / "model", model)
    save_config(dict(config), tmp_path / "model" / "config.json")
    store = tmp_path / "store"
    convert_model(tmp_path / "model", store, progress=False)
    assert offload.prompt_for(str(store)) == [63]
    res = offload.run_offload_bench(offload_args("--stores", str(store), "--store-ratio", "0.00001", "--memory", str(budget),
                                                 "--seconds", "1", "--tokens", "3", "--localities", "low",
                                                 "--systems", "asyncside,mlx-lm", "--quiet"))
    for run in res["runs"]:
        assert run["status"] == "ok" and run["tokens_match_reference"] is True, run


def test_a_store_without_a_tokenizer_is_refused_before_serving(quick_store: pathlib.Path,
                                                               tmp_path: pathlib.Path) -> None:
    """A store converted from a model directory without tokenizer files (a model written by
    ``save_model`` alone) was served: ``/v1/models`` answered, and every completion, a text prompt
    or token ids, was a 500 "internal error: AttributeError: 'NoneType' object has no attribute
    'encode'" (or 'decode')."""
    import shutil

    import anyio

    from asyncside.errors import StoreError
    from asyncside.models.tokenizer import BYTE_TOKENIZER_FILE, TOKENIZER_FILES
    from asyncside.serving.loading import open_engine

    store = tmp_path / "store"
    shutil.copytree(quick_store, store)
    for name in (*TOKENIZER_FILES, BYTE_TOKENIZER_FILE):
        (store / name).unlink(missing_ok=True)

    async def main() -> None:
        async with open_engine(str(store)):
            pass

    with pytest.raises(StoreError, match=r"holds no tokenizer files .*: the server encodes prompts") as info:
        anyio.run(main)
    assert str(info.value).startswith(f"{store}: "), str(info.value)


def test_ranks_refuse_a_plan_as_the_one_process_demo_does(quick_store: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --side-rows 0`` is refused with exit status 2; with ``--ranks 2`` the same refusal of
    the one-process run's plan exited with status 1, as a run that failed."""
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--ranks", "2", "--side-rows", "0",
                      "--tokens", "2", "--quiet")
    assert rc == 2 and "side_rows=0 with 8 of layer 0's 32 experts pinned" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_rows_profile_beside_side_rows_is_one_line(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --rows-profile F --side-rows 2`` (each valid alone) ended in the plan's ValueError
    traceback; it is refused in one line (exit status 2), and stays a ValueError from Python."""
    from asyncside.routing import preset
    from asyncside.runtime import _plan
    from asyncside.store import ExpertStore

    profile = tmp_path / "profile.npz"
    preset("middle", tokens=32, n_layers=2, n_experts=32, top_k=4).save(profile)
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--rows-profile", str(profile), "--side-rows", "2",
                      "--tokens", "2", "--quiet")
    assert rc == 2 and "rows_profile splits the dynamic rows between layers" in err and "no side_rows" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    store = ExpertStore.open(quick_store)
    with pytest.raises(ValueError, match="takes no pinned experts"):
        _plan.plan_memory(store, list(store.layers), resident="auto", pinned={0: [1]}, side_rows=None,
                          min_side_rows=None, memory=None, direct=None, host_tier=0, tier_possible=False)


@pytest.fixture(scope="module")
def tiny_shape_store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A bench shape's store (the byte tokenizer's asyncside_tokenizer.json, no tokenizer.json)."""
    from asyncside.bench import shapes

    config = tmp_path_factory.mktemp("shape") / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_MIXTRAL))
    built = shapes.ensure_shape(config, layers=2, vocab=512, cache_dir=config.parent.parent / "cache", progress=False)
    return pathlib.Path(built["store"])


def test_load_gives_a_shape_store_the_byte_tokenizer(tiny_shape_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """``asyncside.load`` on a bench shape's store handed the directory to mlx-lm's tokenizer
    loader, which picked a class by the model type: "hello" encoded to ``[]`` (qwen3_moe), or
    "Couldn't instantiate the backend tokenizer" (mixtral, deepseek_v3). It returns the byte
    tokenizer's ids, as the demo encodes them; a store without tokenizer files, or whose files hold
    no vocabulary (they encoded every text to no tokens), is refused."""
    import shutil

    from mlx_lm import generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from asyncside import load
    from asyncside.errors import StoreError
    from asyncside.models.tokenizer import BYTE_TOKENIZER_FILE, ByteTokenizer

    model, tok = load(tiny_shape_store, resident=0.5)
    with model:
        assert isinstance(tok, TokenizerWrapper)
        assert tok.encode("hello") == ByteTokenizer().encode("hello") == list(b"hello")
        assert tok.eos_token_ids == {ByteTokenizer.EOS} and tok.decode(list(b"hi")) == "hi"
        assert isinstance(generate(model, tok, "hello", max_tokens=2), str)
    bare = tmp_path / "store"
    shutil.copytree(tiny_shape_store, bare)
    (bare / BYTE_TOKENIZER_FILE).unlink()
    with pytest.raises(StoreError, match=r"holds no tokenizer files .*: load\(\) returns the model's tokenizer") as info:
        load(bare)
    assert str(info.value).startswith(f"{bare}: "), str(info.value)
    (bare / "tokenizer_config.json").write_text("{}")  # tokenizer files without a vocabulary
    with pytest.raises(StoreError, match=r"its tokenizer files hold no vocabulary \(they encode 'hello' to no tokens"):
        load(bare)


def test_a_hidden_size_the_router_cannot_be_quantized_in_is_refused_before_building(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config of hidden_size 160 (a multiple of 32, not of 64) passed the width check, took the
    group size 32, and ended the build in MLX's quantize traceback: mlx-lm's qwen3_moe quantizes
    its router at 8 bits in groups of 64 whatever group the rest takes. It is refused naming the
    field, before anything is built; hidden_size 192 with a 96-wide expert still takes group 32."""
    from asyncside.bench import shapes

    odd = {"model_type": "qwen3_moe", "hidden_size": 160, "num_hidden_layers": 2, "num_attention_heads": 5,
           "num_key_value_heads": 1, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
           "vocab_size": 600}
    config = tmp_path / "odd" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(odd))
    cache = tmp_path / "cache"
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:2", "--store-ratio", "0.0001",
                      "--cache-dir", str(cache), "--quiet")
    assert rc == 2 and f"{config}: 4-bit quantization needs widths that are multiples of 32 and hidden_size a " \
                       "multiple of 64 (the router's input width" in err and err.rstrip().endswith(": hidden_size 160"), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not cache.exists() or not any(cache.iterdir())
    config.write_text(json.dumps({**odd, "hidden_size": 192, "num_attention_heads": 6}))
    assert shapes.describe_shape(str(config)).group_size == 32


@pytest.mark.parametrize("split", [True, False])
def test_policy_ratios_without_a_figure_are_null_and_dashes(split: bool, tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``bench policy --split`` on a trace of one-token sequences (no hit on the holdout, MIN's
    included) wrote NaN into the JSON, which no JSON parser takes, and "nanx" / "(nan of MIN)" into
    the table; without --split a one-token trace did the same. Ratios with nothing to divide by
    are null in the JSON and "-" in the table."""
    from asyncside.routing import preset

    trace = tmp_path / "short.npz"
    tokens, sequences = (8, 8) if split else (1, 1)
    preset("low", tokens=tokens, n_layers=3, n_experts=16, top_k=4, sequences=sequences).save(trace)
    common = ["bench", "policy", "--quick", "--presets", "", "--trace", str(trace), "--policies", "lru",
              *(["--split"] if split else [])]
    out = tmp_path / "policy.json"
    assert run_cli(capsys, *common, "--json", "--out", str(out))[0] == 0

    def no_constant(name: str) -> Any:
        raise AssertionError(f"{name} in the JSON")

    rows = json.loads(out.read_text(), parse_constant=no_constant)["rows"]
    ratios = ("split/even", "even/min", "split/min") if split else ("lru/min",)
    assert rows and all(r[k] is None for r in rows for k in ratios), rows
    from asyncside import cli

    assert cli.main(common) == 0
    table = capsys.readouterr().out
    assert "nan" not in table and ("(- of MIN) | - |" if split else "(-) | 0.000 (-) |") in table, table


def test_bench_serve_fits_its_default_long_prompt_to_the_context(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``bench serve`` on a model of a 512-token context was refused for "--long-prompt 2000", an
    option nobody typed. The default long prompt is cut to what the context leaves beside
    --max-tokens, and a note says so; a --long-prompt given past the context is still refused."""
    import shutil

    pytest.importorskip("httpx")
    store = tmp_path / "store"
    shutil.copytree(quick_store, store)
    config = json.loads((store / "config.json").read_text())
    (store / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    common = ["bench", "serve", "--model", str(store), "--clients", "2", "--duration", "0.5", "--warmup", "0",
              "--max-tokens", "2", "--prompt-lengths", "4", "--no-mlx-lm"]
    from asyncside import cli

    rc = cli.main([*common, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "note: the long prompt is 510 tokens, not the default 2000: the model's context is 512" in err, err
    result = json.loads(out)
    assert result["long_prompt"] == 510 and result["long_prompt_note"], result
    assert [p["long_prompt_sent"] for p in result["phases"]] == [True], result["phases"]
    rc, err = run_cli(capsys, *common, "--long-prompt", "600")
    assert rc == 2 and "--long-prompt 600 with --max-tokens 2: past the model's context of 512 tokens" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_counts_of_one_are_singular(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace of one token, one layer and one expert was "1 tokens, 1 layers x 1 experts" in the
    routing commands, the replay's note and bench offload's log, and "(1 rows, ...)" in
    ``routing info``."""
    from asyncside import cli
    from asyncside.models.forcing import RoutingReplay
    from asyncside.routing import RoutingTrace

    trace = tmp_path / "one.npz"
    assert cli.main(["routing", "preset", "low", str(trace), "--experts", "1", "--top-k", "1", "--layers", "1",
                     "--tokens", "1", "--sequences", "1"]) == 0
    assert cli.main(["routing", "info", str(trace)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {trace}: 1 token, 1 layer x 1 expert, top-1" in out, out
    assert f"{trace}: 1 token in 1 sequence, 1 MoE layer x 1 expert, top-1;" in out and "(1 row, " in out, out
    note = RoutingReplay(RoutingTrace.load(trace), moe_layers=[0], n_experts=1, top_k=1).describe()["note"]
    assert "(1 token; " in note and "its 1 layer x 1 expert top-1, the model's own" in note, note
    line = offload.routing_note({"label": "r", "file": str(trace), "mapped_from": None, "sequence": 0, "sequences": 1,
                                 "sequence_tokens": 1, "wraps": False,
                                 "source_shape": {"n_layers": 1, "n_experts": 1, "top_k": 1}})
    assert "(1 layer x 1 expert top-1, the shape's own)" in line and "replayed (1 token)" in line, line


@pytest.mark.parametrize(("tokenizer_config", "said"), [
    ({"tokenizer_class": "PreTrainedTokenizerFast"}, "its tokenizer files cannot be loaded (it has "
                                                     "tokenizer_config.json; it lacks tokenizer.json, tokenizer.model"),
    ({}, "its tokenizer files hold no vocabulary (they encode 'hello' to no tokens; it has tokenizer_config.json; "
         "it lacks tokenizer.json, tokenizer.model"),
])
def test_tokenizer_files_without_a_vocabulary_are_refused_naming_the_store(
        tokenizer_config: dict[str, Any], said: str, quick_store: pathlib.Path, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A store whose tokenizer_config.json names a tokenizer class beside no vocabulary ended
    ``demo --model STORE`` and ``serve STORE`` in transformers' "Couldn't instantiate the backend
    tokenizer" traceback, naming no store; a tokenizer_config.json of no class loaded a tokenizer
    that encoded every text to nothing, and the demo blamed --prompt. Both are one line naming the
    store and which tokenizer files it has and lacks."""
    import shutil

    import anyio

    from asyncside.errors import StoreError
    from asyncside.models.tokenizer import BYTE_TOKENIZER_FILE, TOKENIZER_FILES
    from asyncside.serving.loading import open_engine

    store = tmp_path / "store"
    shutil.copytree(quick_store, store)
    for name in (*TOKENIZER_FILES, BYTE_TOKENIZER_FILE):
        (store / name).unlink(missing_ok=True)
    (store / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    rc, err = run_cli(capsys, "demo", "--model", str(store), "--tokens", "2", "--quiet")
    assert rc == 2 and f"asyncside demo: {store}: {said}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err

    async def main() -> None:
        async with open_engine(str(store)):
            pass

    with pytest.raises(StoreError) as info:
        anyio.run(main)
    assert str(info.value).startswith(f"{store}: {said}"), str(info.value)


def test_a_store_of_one_layer_is_this_layer(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --shapes CONFIG:1`` refused below its --store-ratio with "runs these 1 layers
    as they are", and a model of one MoE layer was "the model has 1 MoE layers"."""
    import argparse

    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({**TINY_MIXTRAL, "num_hidden_layers": 1}))
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:1", "--store-ratio", "100",
                      "--cache-dir", str(tmp_path / "cache"), "--quiet")
    assert rc == 2 and "or less runs this layer as it is (a quick check" in err and "1 layers" not in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    shape = {"spec": str(config), "shape": "tiny", "store": None, "moe_layers": 1, "max_layers": 1, "store_bytes": MB,
             "least_budget_bytes": 300 * MB, "top_k": 2, "experts_per_layer": 8}
    args = argparse.Namespace(store_ratio=2.0, stores=None, memory=None)
    said = offload._too_small(args, shape, 300 * MB, "", 3)
    assert "about 3 MoE layers would be, and the model has 1 MoE layer; " in said and "1 layers" not in said, said
    said = offload._too_small(args, {**shape, "moe_layers": 2, "max_layers": 2}, 300 * MB, "", 3)
    assert "the model has 2 MoE layers; " in said and "runs these 2 layers as they are" in said, said


@pytest.mark.parametrize(("argv", "raised", "said"), [
    (["--resident", "0.05"], {"asked": 0.05, "asked_by": "--resident", "rows": 4, "why": "top-k"},
     "12% of experts in pools (4/32 rows per layer; 5% asked, raised to 4 rows a layer (top-k))"),
    (["--resident", "0.05", "--side-rows", "6"], {"asked": 0.05, "asked_by": "--resident", "rows": 6,
                                                  "why": "--side-rows 6"},
     "19% of experts in pools (6/32 rows per layer; 5% asked, raised to 6 rows a layer (--side-rows 6))"),
    (["--resident", "0.5"], None, "50% of experts in pools (16/32 rows per layer)"),
])
def test_the_demo_title_says_what_the_pools_hold(argv: list[str], raised: dict[str, Any] | None, said: str,
                                                 quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --resident 0.05`` on a top-4 model of 32 experts a layer titled its table "5% of
    experts in pools (4/32 rows per layer)": the plan raises the rows to the model's top-k, and the
    pools held 12%. The title says what they hold and, where more than asked, what was asked and why."""
    from asyncside import cli, demo

    assert cli.main(["demo", "--model", str(quick_store), "--tokens", "2", "--json", *argv]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows_raised"] == raised and result["pools_fraction"] == result["pool_rows_per_layer"] / 32, result
    assert demo.title(result) == f"asyncside demo — {result['model']}, {said}", demo.title(result)


def test_bench_generate_takes_residency_zero_as_the_demo_does(quick_store: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --resident 0`` runs (every expert streamed through the model's top-k rows) while
    ``bench generate --residency 0`` was refused: "expected a fraction in (0, 1]". It runs, its
    pools raised to the top-k as the demo's; a residency outside [0, 1] is still refused."""
    from asyncside import cli

    argv = ["bench", "generate", "--model", str(quick_store), "--quick", "--no-cold", "--tokens", "2",
            "--plot", "none"]
    assert cli.main([*argv, "--residency", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["residencies"] == [0.0], result["settings"]
    assert {r["residency"] for r in result["rows"]} == {0.0} and result["tokens_identical"], \
        result["rows"]
    assert [(p["resident_per_layer"], p["side_rows"]) for p in result["policies_vs_belady"]] == [(0, 4)]
    rc, err = run_cli(capsys, *argv, "--residency", "1.5")
    assert rc == 2 and "expected a fraction in [0, 1], got 1.5; a fraction such as 0.25" in err, err


@pytest.mark.parametrize(("argv", "said"), [
    (["--mode", "queued"], "--mode queued with --ranks 2: each rank's stage steps its layers one at a time"),
    (["--direct"], "--direct with --ranks 2: the ranks' runtimes read as the memory plan chooses"),
    (["--reference", "slot-cache"], "--reference slot-cache with --ranks 2: the pipeline's tokens are checked "
                                    "against the one-process streaming run"),
    (["--rows-profile", "profile.npz"], "--rows-profile with --ranks 2: each rank's pools hold --resident"),
    (["--streamed-switch", "on"], "--streamed-switch on with --ranks 2: each rank's stage steps its layers"),
    (["--lookahead-extra", "2"], "--lookahead-extra 2 with --ranks 2: the ranks' lookahead names the router's k"),
    (["--no-verify"], "--no-verify with --ranks 2: the ranks check every record they read"),
    (["--host-tier", "0"], "--host-tier with --ranks 2: the ranks' runtimes size their own host tier"),
    (["--predictor", "trace"], "--predictor trace with --ranks 2: it replays a --routing file's predictions"),
])
def test_ranks_refuse_the_options_they_would_ignore(argv: list[str], said: str, quick_store: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --ranks 2`` ran its one-process run and the pipeline as if --mode, --direct,
    --reference, --rows-profile, --streamed-switch (and --lookahead-extra, --no-verify, --host-tier)
    had not been given: neither run passed them on, and nothing said so; --predictor trace ran the
    one-process run, then every rank ended in its own usage error. Each is refused in one line
    naming it, before anything runs."""
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--ranks", "2", "--tokens", "2", "--quiet", *argv)
    assert rc == 2 and f"asyncside demo: error: {said}" in err and "run without --ranks" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_demo_table_gives_small_pools_in_tenths_of_a_mib(quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The pools / memory budget row rounded to whole MiB: 0.2 MiB of pools read "0 MiB"."""
    from asyncside import cli

    monkeypatch.setenv("COLUMNS", "200")  # the row on one line

    assert cli.main(["demo", "--model", str(quick_store), "--tokens", "2", "--resident", "0.05"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "pools / memory budget" in line)
    assert " 0 MiB" not in row and "0.2 MiB /" in row, row
