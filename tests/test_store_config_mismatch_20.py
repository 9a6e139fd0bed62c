"""A store loaded with another model's config.json (copied in over the one it was converted with):
one line naming config.json's model_type and the model the store holds, not a build failure
naming the manifest's switch field as config.json's."""

from __future__ import annotations

import pathlib
import shutil

import pytest
from mlx_lm.utils import save_config, save_model

from asyncside.errors import StoreError
from asyncside.models import convert_model, load_streaming_model

from _models_support import tiny_model


def test_another_models_config_in_a_store_is_named(tmp_path: pathlib.Path) -> None:
    for name in ("qwen3_moe", "mixtral"):
        model, config = tiny_model(name)
        save_model(tmp_path / name, model)
        save_config(dict(config), tmp_path / name / "config.json")
    store = convert_model(tmp_path / "qwen3_moe", tmp_path / "store", progress=False).path
    shutil.copy(tmp_path / "mixtral" / "config.json", store / "config.json")
    with pytest.raises(StoreError, match=rf"^{store / 'config.json'} \[model_type\]: is a 'mixtral' model's config, "
                                         r"but this store holds the experts of the 'qwen3_moe' model"):
        load_streaming_model(store)


@pytest.mark.parametrize("top_k", [0, 99])
def test_a_store_config_edited_past_its_experts_is_named(tmp_path: pathlib.Path, top_k: int) -> None:
    """A store's config.json edited to route each token to more experts than the model has (or
    none): its first token failed in MLX's argpartition (0: an ExceptionGroup of one queued fault
    per expert). Raising it within the experts stays allowed (mlx-lm's tokens for that config)."""
    import json

    model, config = tiny_model("qwen3_moe")
    save_model(tmp_path / "m", model)
    save_config(dict(config), tmp_path / "m" / "config.json")
    store = convert_model(tmp_path / "m", tmp_path / "store", progress=False).path
    edited = json.loads((store / "config.json").read_text())
    edited["num_experts_per_tok"] = top_k
    (store / "config.json").write_text(json.dumps(edited))
    with pytest.raises(StoreError, match=rf"^{store / 'config.json'}: layer 0 routes each token to {top_k} of its "
                                         r"16 experts; expected 1 to 16$"):
        load_streaming_model(store)
