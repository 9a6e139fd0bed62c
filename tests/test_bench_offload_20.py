"""``bench offload`` on shapes not in its presets, round 20: a Mixtral-like config (8 experts top-2)
under a ``--memory`` below any run was refused with advice that the next check refused in turn."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from asyncside.bench import offload, shapes
from tests._cli_support import run_cli

#: Mixtral's 8 experts top-2 at a quarter of its widths: records of about 28 MB at 4 bits
MIXTRAL_LIKE = {
    "model_type": "mixtral", "hidden_size": 2048, "intermediate_size": 7168, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
    "sliding_window": None, "tie_word_embeddings": False,
}


class _Built(Exception):
    """Raised where the shape would be built: every check before it passed."""


def test_a_budget_below_any_run_offers_what_the_store_ratio_check_takes(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--shapes mixtral-like:8 --memory 456M`` (a quarter of its store) holds no run; the refusal
    offered ``--memory 839M or more, or --shapes ...:1``, and each was then refused by the
    ``--store-ratio 4`` check (a top-2 of 8 experts is a quarter of every layer's records, so no
    layer count makes the store 4x a budget that holds a run). What it offers now passes both
    checks, and it says why no layer count does at the ratio asked."""
    def built(*_a: object, **_k: object) -> None:
        raise _Built

    monkeypatch.setattr(shapes, "ensure_shape", built)
    monkeypatch.setattr(offload, "process_baseline", lambda: 90 * 10**6)
    (tmp_path / "mixtral-like").mkdir()
    (tmp_path / "mixtral-like" / "config.json").write_text(json.dumps(MIXTRAL_LIKE))
    config = str(tmp_path / "mixtral-like")
    common = ["--cache-dir", str(tmp_path / "cache"), "--localities", "low", "--quiet"]
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{config}:8", "--memory", "456M", *common)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "holds no run of --shapes" in lines[0], err
    assert "M or more" not in lines[0] and ", or --shapes" not in lines[0], lines[0]
    assert "no number of layers makes the store 4x a budget that holds a run" in lines[0], lines[0]
    offered = re.search(r"--memory (\d+M) with --store-ratio ([\d.]+) or less", lines[0])
    assert offered, lines[0]
    # what it offers gets past every check before the build
    with pytest.raises(_Built):
        run_cli(capsys, "bench", "offload", "--shapes", f"{config}:8", "--memory", offered[1],
                "--store-ratio", offered[2], *common)
