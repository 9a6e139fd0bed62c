"""A model directory of a config.json alone (no weights), given to ``demo --model`` / ``serve
--model``: refused in one line before a conversion is announced, pointing at the bench shapes."""

from __future__ import annotations

import json
import pathlib

import pytest

from asyncside import hub
from asyncside.errors import StoreError


def test_a_config_without_weights_is_refused_before_converting(tmp_path: pathlib.Path) -> None:
    said: list[str] = []
    (tmp_path / "OLMoE").mkdir()
    (tmp_path / "OLMoE" / "config.json").write_text(json.dumps({"model_type": "olmoe"}))
    with pytest.raises(StoreError) as info:
        hub.store_for(tmp_path / "OLMoE", cache_dir=tmp_path / "cache", say=said.append)
    assert "no model*.safetensors weight files" in str(info.value)
    assert "asyncside bench generate --shape" in str(info.value)
    assert said == []  # no "converting to an expert store" line before the refusal
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.lock"))
