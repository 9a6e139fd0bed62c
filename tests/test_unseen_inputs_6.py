"""Inputs the repository never made, sixth sweep: hand-written configs of public MoE models and
configs that JSON reads but Python does not take (``bench offload --shapes CONFIG:LAYERS``),
sequence lengths of a trace that overflow their sum, and ``demo --reference none``'s table. What
runs says what it did; what is refused is one line naming the file and the field.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
from _cli_support import run_cli

from asyncside.bench.shapes import describe_shape
from asyncside.errors import TraceError
from asyncside.routing import RoutingTrace

#: a two-layer Mixtral-like config small enough to build in a second
TINY = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 1000}


def _write(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "my-moe" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("text", "said"), [
    # json reads an integer of any length, and int() refuses past sys.get_int_max_str_digits()
    (json.dumps(TINY)[:-1] + ', "vocab_size": 1' + "0" * 5000 + "}",
     f"not a JSON config this reader takes: an integer of more than {sys.get_int_max_str_digits()} digits"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "not a JSON config this reader takes: nested too deeply"),
])
def test_a_config_json_reads_and_python_does_not_is_one_line(text: str, said: str, tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A config with a 5001-digit number ended in json's ValueError traceback ("Exceeds the limit
    (4300 digits) for integer string conversion ... use sys.set_int_max_str_digits()"), one nested
    a hundred thousand deep in a RecursionError traceback."""
    config = _write(tmp_path, text)
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:1", "--cache-dir", str(tmp_path / "cache"))
    assert rc == 2 and f"{config}: {said}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "cache").exists(), err


def test_granite_multipliers_are_noted_as_not_represented(tmp_path: pathlib.Path) -> None:
    """ibm-granite/granite-3.0-1b-a400m's config (granitemoe: 32 experts top-8, hidden 1024, expert
    intermediate 512) was built and described without a word of its embedding, residual, attention
    and logits multipliers, which a qwen3_moe does not apply."""
    config = _write(tmp_path, json.dumps({
        "model_type": "granitemoe", "hidden_size": 1024, "intermediate_size": 512, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 8, "num_local_experts": 32, "num_experts_per_tok": 8,
        "vocab_size": 49155, "rope_theta": 10000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "embedding_multiplier": 12.0, "logits_scaling": 6.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625}))
    src = describe_shape(config)
    assert (src.config["num_experts"], src.config["num_experts_per_tok"], src.config["moe_intermediate_size"]) == \
        (32, 8, 512)
    assert ("scaling multipliers not represented (embedding_multiplier 12.0, residual_multiplier 0.22, "
            "attention_multiplier 0.015625, logits_scaling 6.0)") in src.notes, src.notes


def test_granite_shared_experts_are_noted_as_not_represented(tmp_path: pathlib.Path) -> None:
    """granitemoeshared names its shared expert's size ``shared_intermediate_size``: no note said
    that the shared expert is left out, as it does for DeepSeek's and Qwen's."""
    config = _write(tmp_path, json.dumps({**TINY, "model_type": "granitemoeshared", "shared_intermediate_size": 1024}))
    assert "shared expert(s) not represented (shared_intermediate_size 1024)" in describe_shape(config).notes


@pytest.mark.parametrize(("lengths", "said"), [
    # int64 counts near the largest int64 whose numpy sum wraps to the 20 tokens
    (np.array([2**63 - 1, 2**63 - 1, 22], dtype=np.int64), "sequence 0 has 9223372036854775807 tokens"),
    # a uint64 count whose sum wraps, then read back as -1 by the in-memory check
    (np.array([2**64 - 1, 21], dtype=np.uint64), "sequence 0 has 18446744073709551615 tokens"),
    (np.array([4, 30], dtype=np.int64), "sequence 1 has 30 tokens"),
])
def test_lengths_whose_sum_overflows_are_refused_naming_the_file(lengths: np.ndarray, said: str,
                                                                  tmp_path: pathlib.Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """int64 lengths [2**63-1, 2**63-1, 22] summed (numpy wraps) to the 20 tokens of ids: the trace
    loaded with a first sequence of 9.2e18 tokens; uint64 lengths passed the file's check and were
    refused by the in-memory one as "<in memory> [lengths]: ... got [-1, 21]", the file unnamed."""
    path = tmp_path / "mine.npz"
    ids = np.tile(np.arange(4, dtype=np.int32), (20, 2, 1))
    np.savez(path, ids=ids, n_experts=32, lengths=lengths)
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(path)
    assert info.value.field == "lengths" and str(path) in str(info.value), info.value
    assert f"{said}, but ids has 20 tokens" in str(info.value), info.value
    rc, err = run_cli(capsys, "routing", "info", str(path))
    assert rc == 2 and f"{path} [lengths]: {said}" in err and "<in memory>" not in err, err


def test_more_sequences_than_tokens_are_refused() -> None:
    """Counted before their sum: each at least one token, so more of them than tokens cannot fit."""
    with pytest.raises(TraceError, match=r"3 sequences of at least one token each, but ids has 2 tokens"):
        RoutingTrace(np.zeros((2, 1, 1), np.int32), np.ones(3, np.int64), 4, {})


def test_the_demo_without_a_reference_shows_no_reference_figures(quick_store: pathlib.Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --reference none`` printed its "no reference" column as 0.00 tokens/s, 0 ms, 0.0
    tokens, and a ratio of 0.000x: figures of a run that never ran."""
    from asyncside import cli

    monkeypatch.setenv("COLUMNS", "200")  # one line a row, whatever the terminal

    rc = cli.main(["demo", "--model", str(quick_store), "--tokens", "2", "--reference", "none", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, (captured.err, captured.out)
    out = captured.out
    assert "no reference" in out, out
    for label in ("tokens/s (whole run)", "decode tokens/s ", "time to first token"):
        row = next(line for line in out.splitlines() if label in line)
        assert "—" in row and " 0.00 " not in row and "0.000x" not in row and " 0 ms" not in row, row


def test_olmoe_clip_qkv_is_noted_as_not_represented(tmp_path: pathlib.Path) -> None:
    """OLMoE's ``clip_qkv`` (its queries, keys and values clipped) was left out without a word."""
    config = _write(tmp_path, json.dumps({**TINY, "model_type": "olmoe", "num_experts": 8, "num_local_experts": None,
                                          "clip_qkv": 8.0}))
    assert "clip_qkv 8.0 not represented" in describe_shape(config).notes


def test_one_of_a_count_is_singular_where_a_trace_cannot_be_replayed(tmp_path: pathlib.Path) -> None:
    """A top-1 trace of one expert on a top-4 model: "(2 layers x 1 experts, top-1)" and "its 1
    experts"; a one-layer model: "(1 MoE layers x ...)"."""
    from asyncside.models.forcing import RoutingReplay, RoutingReplayError

    trace = RoutingTrace(np.zeros((3, 2, 1), np.int32), np.array([3]), 1, {})
    with pytest.raises(RoutingReplayError) as info:
        RoutingReplay(trace, moe_layers=range(1), n_experts=32, top_k=4, sequence=0, source="--routing T")
    said = str(info.value)
    assert "(2 layers x 1 expert, top-1) onto the model (1 MoE layer x 32 experts, top-4)" in said, said
    assert "its 1 expert: no widening" in said, said


def test_a_one_layer_build_too_large_says_one_layer(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench generate --shape CONFIG --layers 1`` past the disk: "building shape S with 1 layers"."""
    import shutil as shutil_module

    from asyncside.bench import shapes

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    config = _write(tmp_path, json.dumps(TINY))
    with pytest.raises(shapes.ShapeTooLargeError, match=r"building shape my-moe with 1 layer needs about"):
        shapes.ensure_shape(config, layers=1, vocab=512, cache_dir=tmp_path / "cache", progress=False)


def test_a_shape_of_one_expert_a_layer_is_said_in_the_singular(tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --shapes CONFIG`` of one expert top-1: "a layer's top-1 of 1 experts"."""
    config = _write(tmp_path, json.dumps({**TINY, "num_local_experts": 1, "num_experts_per_tok": 1}))
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:2", "--vocab", "small",
                      "--cache-dir", str(tmp_path / "cache"))
    assert rc == 2 and "a layer's top-1 of 1 expert, grow with the store" in err, err


#: allenai/OLMoE-1B-7B-0924's config.json as far as a shape reads it: 16 layers of 64 experts top-8
OLMOE = {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
         "vocab_size": 50304, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "norm_topk_prob": False,
         "max_position_embeddings": 4096, "clip_qkv": None, "tie_word_embeddings": False}


def test_the_layer_count_a_refusal_names_passes(tmp_path: pathlib.Path) -> None:
    """``bench offload --shapes olmoe/config.json:2`` said "about 12 MoE layers are (--shapes ...:12)";
    at 12 the refusal said 15, at 15 it said 16: each layer's attention adds to the store once and
    to asyncside's smallest plan (which loads it) --store-ratio times, and the count was worked out
    as if the other weights stayed as they were. The count named now passes, one fewer does not."""
    import re

    from _cli_support import offload_args

    from asyncside.bench import offload

    config = _write(tmp_path, json.dumps(OLMOE))
    # about what a run holds before its model here, less the margin least_budget keeps (the count
    # named must stay within the model's layers)
    held = 64 << 20

    def refusal(layers: int) -> str | None:
        args = offload_args("--shapes", f"{config}:{layers}")
        try:
            offload.choose_budget(args, [offload._estimated_shape(args, config, layers, held)], False)
        except ValueError as exc:
            return str(exc)
        return None

    said = refusal(2)
    assert said is not None
    found = re.search(re.escape(f"(--shapes {config}:") + r"(\d+)\)", said)
    assert found, said
    n = int(found.group(1))
    assert refusal(n) is None, (n, refusal(n))
    assert refusal(n - 1) is not None, n


def test_qwen3_next_linear_attention_is_noted_as_not_represented(tmp_path: pathlib.Path) -> None:
    """Qwen/Qwen3-Next-80B-A3B's config (512 experts top-10, one full-attention layer in four, the
    rest linear attention, a quarter of each head rotated) was described as if a qwen3_moe with a
    shared expert were all it left out."""
    config = _write(tmp_path, json.dumps({
        "model_type": "qwen3_next", "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256,
        "hidden_size": 2048, "intermediate_size": 5120, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
        "moe_intermediate_size": 512, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
        "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
        "shared_expert_intermediate_size": 512, "vocab_size": 151936, "rope_theta": 10000000}))
    notes = describe_shape(config).notes
    assert ("linear-attention layers (full_attention_interval 4: one layer in 4 is full attention) not "
            "represented: every layer is full attention") in notes, notes
    assert "partial rotary embeddings (partial_rotary_factor 0.25) not represented" in notes, notes


def test_phimoe_lm_head_bias_is_among_the_biases(tmp_path: pathlib.Path) -> None:
    """microsoft/Phi-3.5-MoE-instruct's ``lm_head_bias`` was left out of the biases noted."""
    config = _write(tmp_path, json.dumps({**TINY, "model_type": "phimoe", "attention_bias": True,
                                          "lm_head_bias": True}))
    assert "biases not represented (attention_bias, lm_head_bias)" in describe_shape(config).notes


@pytest.mark.parametrize(("text", "said"), [
    ("1P", "no unit P, the largest is T (1P is 1024T)"), ("2PiB", "no unit P, the largest is T (1P is 1024T)"),
    ("1EB", "no unit E, the largest is T (1E is 1048576T)"),
])
def test_a_size_in_a_unit_past_t_says_the_unit(text: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --memory 1P`` was "expected a size such as 800M, 1.5G or 4096" while ``--memory
    1024T`` was taken (and capped by the machine): the unit at fault was not named."""
    rc, err = run_cli(capsys, "demo", "--memory", text)
    last = err.strip().splitlines()[-1]  # argparse's usage, then the error in one line
    assert rc == 2 and f"argument --memory: memory {text!r}: {said}" in last and "Traceback" not in err, err


def test_a_bare_e_is_still_an_unfinished_exponent() -> None:
    """``1e`` is no exabyte: it is refused as a size that is not one, as before."""
    from asyncside.memory import parse_size

    with pytest.raises(ValueError, match=r"expected a size such as 800M"):
        parse_size("1e")


def test_widening_a_trace_of_one_expert_says_its_only_expert(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: pathlib.Path) -> None:
    """``routing widen`` of a top-1 trace of one expert: "every one of its 1 experts"."""
    path = tmp_path / "one.npz"
    np.savez(path, ids=np.zeros((3, 2, 1), np.int32), n_experts=1)
    rc, err = run_cli(capsys, "routing", "widen", str(path), str(tmp_path / "out.npz"), "--top-k", "4")
    assert rc == 2 and "the trace routes its only expert per token already (top-1)" in err, err


@pytest.mark.parametrize("option", ["--routing", "--rows-profile"])
def test_recording_over_the_trace_a_demo_reads_is_refused(option: str, quick_store: pathlib.Path,
                                                          tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --routing T.npz --record-routing T.npz`` replayed T, then wrote the run's own routing
    over it: a 12-layer hand-written trace became the 2-layer recording, without a word."""
    trace = tmp_path / "mine.npz"
    RoutingTrace(np.tile(np.arange(4, dtype=np.int32), (6, 2, 1)), np.array([6]), 32, {}).save(trace)
    before = trace.read_bytes()
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), option, str(trace),
                      "--record-routing", str(tmp_path / "." / "mine.npz"), "--tokens", "2", "--quiet")
    assert rc == 2 and f"is the {option} file {trace}: the recording would replace the trace it reads" in err, err
    assert len(err.strip().splitlines()) == 1 and trace.read_bytes() == before, err


def test_the_slot_cache_reference_shows_its_own_reads(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --reference slot-cache`` (the reference ``--memory`` picks where the model does not fit)
    printed 0 bytes read and 0 stall time in the slot cache's column, the all-resident run's
    figures, while the slot cache reads every miss synchronously; its hit rate was left blank."""
    from asyncside import cli

    monkeypatch.setenv("COLUMNS", "200")
    argv = ["demo", "--model", str(quick_store), "--tokens", "4", "--reference", "slot-cache", "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "bytes read while generating" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[2].endswith(" MB") and cells[2] != "0.0 MB", row  # the slot cache read its misses
    hits = next(line for line in out.splitlines() if "hit rate (demand)" in line)
    assert [c.strip() for c in hits.split("│") if c.strip()][2].endswith("%"), hits
    assert cli.main([*argv, "--json"]) == 0
    reads = json.loads(capsys.readouterr().out)["reference_reads"]
    assert reads["bytes_read"] > 0 and 0 <= reads["hit_rate"] < 1 and reads["stall_time_s"] >= 0, reads


@pytest.mark.parametrize("argv", [
    ["demo", "--routing"], ["demo", "--rows-profile"], ["demo", "--record-routing"],
    ["bench", "generate", "--routing"], ["bench", "generate", "--rows-profile"], ["bench", "offload", "--routing"],
    ["bench", "policy", "--trace"], ["bench", "policy", "--out"],
])
def test_an_empty_file_name_is_refused_when_parsed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --routing "$TRACE"`` with TRACE unset ran the model's own routing, as if the option were
    left out (``--rows-profile ''`` and ``--record-routing ''`` alike); ``bench offload --routing ''``
    said ": no such file"."""
    rc, err = run_cli(capsys, *argv, "")
    assert rc == 2 and f"argument {argv[-1]}: expected a file name, got ''" in err, err


def test_a_vocabulary_too_large_to_build_is_named(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench offload --shapes CONFIG:2 --vocab 1000000000`` was refused for the disk with "even one
    layer does not fit: 0.0 GB of experts, 2368.0 GB held while building it": the layers were
    blamed for the embedding and LM head that the vocabulary sizes."""
    import shutil as shutil_module

    from asyncside.bench import shapes

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda _p: usage._replace(free=10**9))
    config = _write(tmp_path, json.dumps(TINY))
    with pytest.raises(shapes.ShapeTooLargeError) as info:
        shapes.ensure_shape(config, layers=2, vocab=10**7, cache_dir=tmp_path / "cache", progress=False)
    said = str(info.value)
    assert ("the vocabulary alone does not fit: the embedding and LM head of vocab_size 10000000 x hidden 256 are "
            "3.2 GB") in said and "a smaller --vocab (small: 512)" in said and "one layer" not in said, said


def test_a_model_config_nested_too_deeply_is_one_error_naming_it(tmp_path: pathlib.Path) -> None:
    """``asyncside convert`` of a model directory whose config.json nests past Python's recursion
    limit raised RecursionError with its traceback; it is a StoreError naming the file now."""
    from asyncside.errors import StoreError
    from asyncside.models.convert import convert_model

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(StoreError) as info:
        convert_model(model, tmp_path / "store", progress=False)
    assert "config.json" in str(info.value) and "nested too deeply" in str(info.value), str(info.value)


@pytest.mark.parametrize("argv", [
    ["demo", "--routing"], ["demo", "--rows-profile"], ["demo", "--record-routing"],
    ["bench", "generate", "--routing"], ["bench", "generate", "--rows-profile"],
])
def test_a_file_option_given_twice_is_refused(argv: list[str], tmp_path: pathlib.Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --routing A --routing B`` replayed B and dropped A without a word (argparse keeps the
    last); the option takes one file, so a second one is refused when parsed, naming both."""
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    rc, err = run_cli(capsys, *argv, str(a), argv[-1], str(b))
    assert rc == 2 and f"argument {argv[-1]}: given twice ({a} and {b}): it takes one file; give it once" in err, err
