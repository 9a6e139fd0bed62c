"""``asyncside convert`` through ``asyncside.cli.main``: success paths and clear errors (exit 2)."""

from __future__ import annotations

import json
import pathlib

import pytest
from mlx_lm.utils import save_config, save_model

from asyncside.cli import main
from asyncside.models.convert import make_profile
from asyncside.models.tokenizer import ByteTokenizer
from asyncside.store import ExpertStore

from _models_support import tiny_model

Q4 = {"group_size": 64, "bits": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("cli") / "qwen"
    model, config = tiny_model("qwen3_moe", quantize=Q4)
    save_model(path, model)
    save_config(dict(config), path / "config.json")  # no tokenizer files on purpose
    return path


def _summary(capsys: pytest.CaptureFixture[str]) -> dict:
    """The JSON summary ``--json`` printed (the last JSON object on stdout)."""
    return json.loads(capsys.readouterr().out)


def test_convert_default_resident_and_overwrite(model_dir: pathlib.Path, tmp_path: pathlib.Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "store"
    capsys.readouterr()
    assert main(["convert", str(model_dir), str(dest), "--json"]) == 0
    res = _summary(capsys)
    assert res["moe_layers"] == [0, 2] and res["experts_per_layer"] == [16]
    assert res["resident_per_layer"] == {"0": 4, "2": 4}  # 25% of 16
    assert res["resident_from"] == "no profile: expert id order"
    store = ExpertStore.open(dest)
    assert store.metadata["asyncside_model"]["resident"]["0"] == [0, 1, 2, 3]

    # An existing destination is refused without --overwrite, replaced with it.
    assert main(["convert", str(model_dir), str(dest), "--json"]) == 2
    assert "already exists (pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(model_dir), str(dest), "--resident", "0.5", "--overwrite", "--json"]) == 0
    assert _summary(capsys)["resident_per_layer"] == {"0": 8, "2": 8}


def test_convert_with_profile_file_ranks_hottest(model_dir: pathlib.Path, tmp_path: pathlib.Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    counts = {0: [0] * 16, 2: [0] * 16}
    counts[0][9], counts[0][3] = 50, 40
    counts[2][15] = 7
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(make_profile("qwen3_moe", counts, 10, "test")))
    dest = tmp_path / "store"
    assert main(["convert", str(model_dir), str(dest), "--profile", str(prof), "--resident", "0.125", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "asyncside convert" in out and "profile: hottest first" in out  # the rich summary table
    resident = ExpertStore.open(dest).metadata["asyncside_model"]["resident"]
    assert resident == {"0": [9, 3], "2": [15, 0]}


def test_convert_profile_prompts(model_dir: pathlib.Path, tmp_path: pathlib.Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    # Without tokenizer files, --profile-prompts cannot encode its prompts: a clear error.
    assert main(["convert", str(model_dir), str(tmp_path / "s0"), "--profile-prompts", "2"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "s0").exists()

    # With a byte tokenizer (a bigger vocabulary so every byte is a valid token), it profiles.
    d = tmp_path / "withtok"
    big, big_cfg = _tiny_with_vocab(300)
    save_model(d, big)
    save_config(dict(big_cfg), d / "config.json")
    ByteTokenizer(300).save(d)
    capsys.readouterr()
    dest = tmp_path / "s1"
    assert main(["convert", str(d), str(dest), "--profile-prompts", "2", "--profile-tokens", "2", "--json"]) == 0
    res = _summary(capsys)
    assert res["resident_from"] == "profile: hottest first"
    meta = ExpertStore.open(dest).metadata["asyncside_model"]
    assert meta["profile"]["source"] == "2 prompts" and meta["profile"]["tokens"] > 0


def _tiny_with_vocab(vocab: int):  # type: ignore[no-untyped-def]
    import _models_support as support

    old = support.BASE["qwen3_moe"]
    support.BASE["qwen3_moe"] = dict(old, vocab_size=vocab)
    try:
        return tiny_model("qwen3_moe", quantize=Q4)
    finally:
        support.BASE["qwen3_moe"] = old


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (lambda t: t / "nope", [], "model directory does not exist"),
        (lambda t: (t / "f.txt").write_text("x") and t / "f.txt", [], "not a directory"),
        (lambda t: (t / "empty").mkdir() or t / "empty", [], "config.json is missing"),
        (lambda t: (t / "cfg").mkdir() or (t / "cfg" / "config.json").write_text('{"model_type": "qwen3_moe"}')
         and t / "cfg", [], "no model*.safetensors"),
    ],
)
def test_convert_bad_model_dirs(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], make, extra,
                                message: str) -> None:
    src = make(tmp_path)
    assert main(["convert", str(src), str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncside convert: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_convert_bad_options(model_dir: pathlib.Path, tmp_path: pathlib.Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    dest = str(tmp_path / "out")
    with pytest.raises(SystemExit) as info:  # a usage error, as demo and serve give it
        main(["convert", str(model_dir), dest, "--resident", "1.5"])
    assert info.value.code == 2 and "argument --resident: expected a fraction in [0, 1], got 1.5" in capsys.readouterr().err
    cases = [
        (["--profile", str(tmp_path / "missing.json")], "routing profile file does not exist"),
        (["--profile-prompts", "0"], "--profile-prompts must be in 1.."),
    ]
    for extra, message in cases:
        assert main(["convert", str(model_dir), dest, *extra]) == 2
        assert message in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(make_profile("qwen3_moe", {1: [1] * 16}, 1)))
    assert main(["convert", str(model_dir), dest, "--profile", str(bad)]) == 2
    assert "layer 1 is not an MoE layer" in capsys.readouterr().err
    # The model directory itself is not a valid destination, and an existing store is not a source.
    assert main(["convert", str(model_dir), str(model_dir), "--overwrite"]) == 2
    assert "must differ from the model directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
