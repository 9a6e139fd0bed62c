"""Unseen inputs, round 11: real models' config.json files (Qwen3-235B-A22B, Qwen3-Coder-480B-A35B,
Mixtral-8x22B, OLMoE-1B-7B, Kimi-K2, DeepSeek-V3, gpt-oss-120b) given to the bench shapes, memory
sizes as people type them, and routing trace files as they reach a user: compressed whole for
transfer (``trace.npz.gz``) or cut short by a copy. What is refused is one line naming the file and
saying what to do; a shape's note names what its build leaves out of the model."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import pathlib

import numpy as np
import pytest

from asyncside.bench import shapes
from asyncside.errors import TraceError
from asyncside.routing import RoutingTrace
from tests._cli_support import run_cli

#: openai/gpt-oss-120b's config.json, as published (its MoE dimensions and the fields a note reads)
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_local_experts": 128,
    "experts_per_token": 4, "num_experts_per_tok": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "sliding_window": 128, "swiglu_limit": 7.0,
    "rope_theta": 150000, "rms_norm_eps": 1e-05, "vocab_size": 201088, "max_position_embeddings": 131072,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"quant_method": "mxfp4"}, "tie_word_embeddings": False,
}


def _trace(path: pathlib.Path) -> bytes:
    """A hand-written trace (np.savez): 40 tokens of 8 layers, 64 experts top-4; its file's bytes."""
    rng = np.random.default_rng(11)
    ids = np.stack([np.stack([rng.choice(64, 4, replace=False) for _ in range(8)]) for _ in range(40)])
    np.savez(path, ids=ids, n_experts=64)
    return path.read_bytes()


@pytest.mark.parametrize(("suffix", "pack", "tool"), [(".gz", gzip.compress, "gunzip"),
                                                      (".bz2", bz2.compress, "bunzip2"),
                                                      (".xz", lzma.compress, "unxz")])
def test_a_trace_compressed_whole_says_to_decompress_it(tmp_path: pathlib.Path, suffix: str, pack: object,
                                                        tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``routing info trace.npz.gz`` (a trace gzipped for transfer) was "this is a file starting
    b'\\x1f\\x8b\\x08\\x00...'": it now names the compression and the command that undoes it."""
    raw = _trace(tmp_path / "t.npz")
    packed = tmp_path / f"t.npz{suffix}"
    packed.write_bytes(pack(raw))  # type: ignore[operator]
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(packed)
    assert f"-compressed file: decompress it first ({tool} FILE, or give <({tool} -c FILE)" in str(info.value)
    rc, err = run_cli(capsys, "routing", "info", str(packed))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and f"{packed}: " in err and tool in err, err


@pytest.mark.parametrize("keep", [0.5, -10, 30])
def test_a_truncated_trace_is_said_to_be_cut_short(tmp_path: pathlib.Path, keep: float,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A trace cut short by a copy (half of it, all but its last bytes, its first bytes) was "not a
    readable .npz file: File is not a zip file", of a file that starts as one. It now says the
    archive ends without its index: the file is truncated, and how many bytes it has."""
    raw = _trace(tmp_path / "t.npz")
    cut = raw[:int(len(raw) * keep)] if isinstance(keep, float) else raw[:keep]
    (tmp_path / "cut.npz").write_bytes(cut)
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(tmp_path / "cut.npz")
    assert f"its {len(cut)} bytes end without the archive's index" in str(info.value)
    assert "the file is truncated" in str(info.value)
    rc, err = run_cli(capsys, "routing", "info", str(tmp_path / "cut.npz"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "truncated" in err, err


def test_a_damaged_trace_that_is_whole_is_not_called_truncated(tmp_path: pathlib.Path) -> None:
    """Bytes changed inside a member of a whole archive: zipfile's own words (a bad CRC), not truncation."""
    raw = bytearray(_trace(tmp_path / "t.npz"))
    raw[200] ^= 0xFF
    (tmp_path / "bad.npz").write_bytes(bytes(raw))
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(tmp_path / "bad.npz")
    assert "truncated" not in str(info.value) and "CRC" in str(info.value)


def test_gpt_oss_experts_activation_and_biases_are_noted(tmp_path: pathlib.Path) -> None:
    """gpt-oss-120b's config: its experts' clamped SwiGLU (``swiglu_limit``) and the experts' and
    router's biases were left out of the note without a word (only ``attention_bias`` was named),
    though the build is a qwen3_moe's SiLU SwiGLU without biases. The preset gpt-oss-20b too."""
    (tmp_path / "gpt-oss-120b").mkdir()
    (tmp_path / "gpt-oss-120b" / "config.json").write_text(json.dumps(GPT_OSS_120B))
    src = shapes.describe_shape(str(tmp_path / "gpt-oss-120b"))
    assert (src.config["num_experts"], src.config["num_experts_per_tok"], src.config["hidden_size"]) == (128, 4, 2880)
    activation = [n for n in src.notes if "SwiGLU" in n]
    assert len(activation) == 1 and "swiglu_limit 7.0" in activation[0], src.notes
    assert "the experts' and router's biases not represented" in activation[0]
    assert "biases not represented (attention_bias)" in src.notes
    assert any("clamped SwiGLU" in n for n in shapes.describe_shape("gpt-oss-20b").notes)
    # A qwen3_moe's own config is built as it is: nothing to note.
    assert shapes.describe_shape("qwen3-30b-a3b").notes == ()


def test_bench_serve_refuses_a_budget_as_serve_does(quick_store: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``bench serve --memory 64k`` (a size below what the smallest pools need) said the plan's refusal
    in one line, as ``serve --memory 64k`` does, but ended with exit status 1, a failed run, where
    serve and demo end with 2, a usage error."""
    common = ("--model", str(quick_store), "--memory", "64k")
    rc, err = run_cli(capsys, "bench", "serve", *common, "--duration", "1", "--warmup", "0", "--clients", "1",
                      "--no-mlx-lm")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("asyncside bench serve: the pools need "), err
    assert "so the budget must leave at least" in last and "Traceback" not in err
    rc, err = run_cli(capsys, "serve", *common, "--port", "0")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("asyncside serve: the pools need "), err


#: mistralai/Mixtral-8x22B-v0.1's config.json, as published: 8 experts top-2 of 16384 x 6144 (records of
#: about 189 MB at 4 bits), so a layer's top-2 rows alone take 377 MB
MIXTRAL_8X22B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384,
    "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1000000, "rms_norm_eps": 1e-05,
    "max_position_embeddings": 65536, "sliding_window": None, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("memory", ["100M", "300M"])
def test_offload_refuses_a_budget_below_any_run_before_building(tmp_path: pathlib.Path, memory: str,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --shapes Mixtral-8x22B:1 --memory 100M --store-ratio 1``: the store (1.6 GB)
    passes the ratio, so the shape was built (minutes, 1.6 GB written), and then every run was
    refused or killed, since one layer's top-2 records alone are 377 MB: no system's run fits the
    budget. It is refused before building, naming --memory, the figures and the least to ask for."""

    def built(*_a: object, **_k: object) -> None:
        raise AssertionError("the shape was built")

    monkeypatch.setattr(shapes, "ensure_shape", built)
    (tmp_path / "Mixtral-8x22B").mkdir()
    (tmp_path / "Mixtral-8x22B" / "config.json").write_text(json.dumps(MIXTRAL_8X22B))
    spec = f"{tmp_path / 'Mixtral-8x22B'}:1"
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", spec, "--memory", memory, "--store-ratio", "1",
                      "--cache-dir", str(tmp_path / "cache"), "--localities", "low", "--quiet")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"asyncside bench offload: error: --memory {memory[:-1]} MiB "), lines
    assert f"holds no run of --shapes {spec}: its MoE layer's top-2 experts alone are 377 MB (records of 189 MB)" \
        in lines[0] and "(nothing was built)" in lines[0], lines
    assert ", or --shapes" not in lines[0]  # no fewer layers than one
    least = int(lines[0].split(" MB in all)")[0].rsplit("(", 1)[-1])
    plan = int(lines[0].split("--memory ")[-1].split("M or more")[0])
    assert least * 10**6 <= plan << 20  # the least it names to ask for passes this check
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_offload_names_the_layers_a_budget_below_any_run_holds(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Three Mixtral-8x22B layers under 1G: the refusal names the most layers whose smallest plan
    fits (one), and that count's plan does fit while one more layer's does not."""
    from asyncside.bench import offload
    from tests._cli_support import offload_args

    monkeypatch.setattr(shapes, "ensure_shape", lambda *_a, **_k: pytest.fail("the shape was built"))
    # What a fresh process holds before its model, whatever this one holds by now: inside a full
    # suite the test process held over 2.5 GB, and no layer's plan fitted 1G.
    monkeypatch.setattr(offload, "process_baseline", lambda: 250 * 10**6)
    (tmp_path / "Mixtral-8x22B").mkdir()
    (tmp_path / "Mixtral-8x22B" / "config.json").write_text(json.dumps(MIXTRAL_8X22B))
    config = str(tmp_path / "Mixtral-8x22B")
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:3", "--memory", "1G", "--store-ratio", "1",
                      "--cache-dir", str(tmp_path / "cache"), "--localities", "low", "--quiet")
    assert rc == 2 and f"holds no run of --shapes {config}:3: its 3 MoE layers' top-2 experts" in err, err
    assert f", or --shapes {config}:1 (whose smallest plan fits) (nothing was built)" in err, err
    held = int(err.split(" MB of process")[0].rsplit("about ", 1)[-1]) * 10**6
    plans = [offload.least_budget(offload._estimated_shape(offload_args("--shapes", f"{config}:{n}"), config, n, held))
             for n in (1, 2)]
    assert plans[0] <= 1 << 30 < plans[1], plans


def test_routing_preset_says_the_sequences_it_wrote(tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``routing preset middle OUT --layers 60 --experts 384 --top-k 8 --sequences 4`` (Kimi-K2's
    routing shape) said "wrote OUT: 64 tokens, 60 layers x 384 experts, top-8": the four sequences
    asked for, one of which every replay picks, went unsaid; routing info says them."""
    from asyncside.cli import main

    out = tmp_path / "kimi.npz"
    argv = ["routing", "preset", "middle", str(out), "--layers", "60", "--experts", "384", "--top-k", "8",
            "--tokens", "64"]
    assert main([*argv, "--sequences", "4"]) == 0
    assert f"wrote {out}: 64 tokens in 4 sequences, 60 layers x 384 experts, top-8" in capsys.readouterr().out
    assert RoutingTrace.load(out).n_sequences == 4
    assert main(argv) == 0  # one sequence: said as before
    assert f"wrote {out}: 64 tokens, 60 layers x 384 experts, top-8" in capsys.readouterr().out
