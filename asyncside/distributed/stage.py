"""Loading one rank's stage: its expert-store layers, its share of the non-expert weights.

A store split across machines is normal: a rank opens only its MoE layers
(``ExpertStore.open(path, layers=...)``), so the other layers' blobs need not exist on its disk.
The non-expert weights (``model.safetensors``) are loaded lazily and only the stage's are
materialised: its decoder layers, the embedding on the first rank, the final norm and the head on
the last (the embedding too when the head is tied to it). The lookahead router of the next
stage's first MoE layer is read on first use (its gate weights are small).
"""

from __future__ import annotations

import pathlib
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_config, load_model

from ..bridge import Completed
from ..errors import StoreError
from ..models.arch import arch_for, decoder_layers, moe_layers
from ..models.loading import META_KEY, NON_EXPERT_FILE, _stripped_classes, is_store_dir, switch_specs
from ..models.streaming import StreamingModel
from ..models.tokenizer import load_tokenizer
from ..store import ExpertStore
from .plan import Stage, StagePlan, make_plan


def model_layout(store_dir: str | pathlib.Path) -> tuple[int, list[int]]:
    """(decoder layer count, MoE layer ids) of a converted store, from its config and manifest alone."""
    path = pathlib.Path(store_dir).absolute()
    if not is_store_dir(path):
        raise StoreError(path, "not an expert store (no manifest.json); convert the model with `asyncside convert`")
    store = ExpertStore.open(path, layers=())
    meta = store.metadata.get(META_KEY)
    if not isinstance(meta, dict) or not isinstance(meta.get("switch"), dict):
        raise StoreError(path / "manifest.json", "store was not written by the asyncside converter",
                         f"metadata.{META_KEY}")
    try:
        moe = sorted(int(k) for k in meta["switch"])
    except ValueError:
        raise StoreError(path / "manifest.json", "switch layer ids must be integers",
                         f"metadata.{META_KEY}.switch") from None
    config = load_config(path)
    text = config.get("text_config")
    # llama4 nests its text model's config under text_config
    scope: dict[str, Any] = text if isinstance(text, dict) and "num_hidden_layers" in text else config
    n = scope.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        field = "num_hidden_layers" if scope is config else "text_config.num_hidden_layers"
        raise StoreError(path / "config.json", f"{field} must be a positive integer, got {n!r}", field)
    return n, moe


def plan_for_store(store_dir: str | pathlib.Path, size: int, split: list[int] | None = None) -> StagePlan:
    """The stage plan of a converted store over ``size`` ranks (``split``: layers per rank)."""
    n, moe = model_layout(store_dir)
    return make_plan(n, moe, size, split)


def load_stage_model(store_dir: str | pathlib.Path, plan: StagePlan, rank: int, *,
                     completed: Completed | None = None) -> StreamingModel:
    """The streaming model of rank ``rank``'s stage; ``.store`` holds only the stage's MoE layers.

    Every decoder layer object exists (layer ids stay the model's), but only the stage's weights
    are in memory.
    """
    path = pathlib.Path(store_dir).absolute()
    stage: Stage = plan.stage(rank)
    store = ExpertStore.open(path, layers=stage.moe_layers)
    meta, specs = switch_specs(store, path)
    if not (path / NON_EXPERT_FILE).is_file():
        raise StoreError(path / NON_EXPERT_FILE, "non-expert weights are missing")
    model, config = load_model(path, lazy=True, strict=True, get_model_classes=_stripped_classes(specs))
    arch = arch_for(config["model_type"])
    layers = decoder_layers(model)
    if len(layers) != plan.n_layers:
        raise StoreError(path / "config.json", f"the model has {len(layers)} decoder layers; the plan was made for "
                         f"{plan.n_layers}", "num_hidden_layers")
    inner, head, embedding = arch.inner(model), arch.head_module(model), arch.embedding(model)
    keep: list[Any] = [layers[i].parameters() for i in stage.layers]
    if stage.first:
        keep.append(embedding.parameters())
    if plan.is_last(rank):
        keep.append(inner.norm.parameters())
        keep.append(head.lm_head.parameters() if "lm_head" in head else embedding.parameters())
    mx.eval(keep)
    return StreamingModel(
        model, arch=arch, moe=moe_layers(model, arch), specs=specs, tokenizer=load_tokenizer(path, config),
        config=config, model_id=meta.get("model_id") or path.name, store=store, completed=completed,
    )
