"""What a model's KV cache takes, from its config: per attention layer, the bytes of one position and
the most positions a sliding-window layer keeps.

A request's KV cache holds, per attention layer, the keys and values of every position it has fed.
mlx-lm's caches (``mlx_lm.models.cache``) grow in steps: ``KVCache`` (and the ``BatchKVCache`` the
engine merges decoding requests into) allocates ``step`` (256) positions at a time past where the
growth starts, so a cache holding ``T`` positions has room for at most ``T + step - 1`` (the room
is a multiple of ``step`` only when every growth starts at one: a merged or copied cache starts at
its exact length). A sliding-window layer (``RotatingKVCache``, gpt-oss) keeps at most its window
plus one prefill chunk. :class:`KVLayout` holds those per-layer figures; :func:`kv_layout` reads
them from an mlx-lm config (the architectures asyncside serves: keys and values of
``num_key_value_heads x head_dim`` each, or deepseek-v3's compressed latent plus its rope key).

Used where a memory plan bounds the KV caches: the server's admission
(:mod:`asyncside.serving.kv_budget`) and :meth:`asyncside.models.StreamingModel.generate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import AsyncsideError

__all__ = ["KV_STEP", "KVLayout", "dtype_bytes", "kv_layout", "model_kv_layout"]

#: Positions mlx-lm's KV caches grow by (``KVCache.step``, ``BatchKVCache.step``, ``RotatingKVCache.step``).
KV_STEP = 256

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class KVLayout:
    """Per attention layer: the bytes one position's keys and values take, and the most positions a
    sliding-window layer keeps (None: every position)."""

    per_token: tuple[int, ...]
    windows: tuple[int | None, ...]
    step: int = KV_STEP

    def __post_init__(self) -> None:
        if len(self.per_token) != len(self.windows):
            raise ValueError(f"per_token and windows: expected one entry per layer each, got "
                             f"{len(self.per_token)} and {len(self.windows)}")
        if self.step < 1 or any(b < 0 for b in self.per_token):
            raise ValueError(f"step must be >= 1 and per-layer bytes >= 0, got step {self.step}, {self.per_token}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more position adds to a cache of full-attention layers (all of them)."""
        return sum(self.per_token)

    def room(self, tokens: int, chunk: int = KV_STEP) -> list[int]:
        """Per layer, the most positions a cache that has fed ``tokens`` positions (prefill chunks of
        at most ``chunk``) can have allocated (see the module docstring)."""
        if tokens <= 0:
            return [0] * len(self.per_token)
        grown = tokens + self.step - 1
        return [grown if w is None else min(grown, w + max(chunk, self.step)) for w in self.windows]

    def bytes_for(self, tokens: int, chunk: int = KV_STEP) -> int:
        """Worst-case bytes of one request's cache after ``tokens`` positions (:meth:`room`)."""
        return sum(b * r for b, r in zip(self.per_token, self.room(tokens, chunk)))


def _scope(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config's text model section (multimodal configs nest it under ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) and "num_hidden_layers" in inner else config


def _int(config: Mapping[str, Any], key: str, where: str) -> int:
    v = config.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise AsyncsideError(f"{where}: expected '{key}' to be an integer >= 1 (needed to size the KV caches), "
                             f"got {v!r:.60}")
    return v


def dtype_bytes(name: Any) -> int:
    """Bytes of one element of the dtype ``name`` (``"bfloat16"``, ``mx.float16``, ...); ValueError otherwise."""
    key = str(name).rsplit(".", 1)[-1].lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPE_BYTES)}, got {name!r}")
    return _DTYPE_BYTES[key]


def kv_layout(config: Mapping[str, Any], element_bytes: int, where: str = "config.json") -> KVLayout:
    """The KV layout of an mlx-lm model's ``config`` with keys and values of ``element_bytes`` each.

    Per layer: ``2 x num_key_value_heads x head_dim x element_bytes`` (``num_key_value_heads``
    defaults to ``num_attention_heads``, ``head_dim`` to ``hidden_size / num_attention_heads``);
    deepseek-v3 (``kv_lora_rank``) caches ``kv_lora_rank + qk_rope_head_dim`` elements, deepseek-v2
    (its attention decompressed) ``num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim +
    v_head_dim)``; layers whose
    ``layer_types`` entry is ``"sliding_attention"`` keep ``sliding_window`` positions.
    AsyncsideError naming ``where`` and the key when the config lacks one.
    """
    if element_bytes < 1:
        raise ValueError(f"element_bytes: expected >= 1, got {element_bytes}")
    c = _scope(config)
    layers = _int(c, "num_hidden_layers", where)
    if c.get("model_type") == "mimo_v2_flash":
        return _mimo_v2_flash_layout(c, layers, element_bytes, where)
    if c.get("model_type") == "step3p5":
        return _step3p5_layout(c, layers, element_bytes, where)
    if c.get("kv_lora_rank") is not None and c.get("model_type") == "deepseek_v2":
        # mlx-lm's deepseek_v2 caches every head's decompressed key (nope + rope parts) and value
        heads = _int(c, "num_attention_heads", where)
        per = heads * (_int(c, "qk_nope_head_dim", where) + _int(c, "qk_rope_head_dim", where)
                       + _int(c, "v_head_dim", where)) * element_bytes
    elif c.get("kv_lora_rank") is not None:  # multi-head latent attention: one latent + one rope key per position
        per = (_int(c, "kv_lora_rank", where) + _int(c, "qk_rope_head_dim", where)) * element_bytes
        if c.get("index_head_dim") is not None:
            # deepseek_v32's attention indexer caches a key of its own per position, and mlx-lm
            # keeps a zero value of the same size beside it
            per += 2 * _int(c, "index_head_dim", where) * element_bytes
    else:
        heads = _int(c, "num_attention_heads", where)
        kv_heads = _int(c, "num_key_value_heads", where) if c.get("num_key_value_heads") is not None else heads
        head_dim = (_int(c, "head_dim", where) if c.get("head_dim") is not None
                    else _int(c, "hidden_size", where) // heads)
        per = 2 * kv_heads * head_dim * element_bytes
    windows: list[int | None] = [None] * layers
    types = c.get("layer_types")
    if isinstance(types, Sequence) and not isinstance(types, str):
        if len(types) != layers:
            raise AsyncsideError(f"{where}: expected 'layer_types' to name {layers} layers (num_hidden_layers), "
                                 f"got {len(types)}")
        if any(t == "sliding_attention" for t in types):
            window = _int(c, "sliding_window", where)
            windows = [window if t == "sliding_attention" else None for t in types]
    return KVLayout(tuple([per] * layers), tuple(windows))


def _mimo_v2_flash_layout(c: Mapping[str, Any], layers: int, element_bytes: int, where: str) -> KVLayout:
    # Its hybrid_layer_pattern marks the sliding layers (1), which have their own heads and head
    # sizes, and its values may be narrower than its keys.
    pattern = c.get("hybrid_layer_pattern")
    if (not isinstance(pattern, Sequence) or isinstance(pattern, str) or len(pattern) != layers
            or any(p not in (0, 1) or isinstance(p, (bool, float)) for p in pattern)):
        raise AsyncsideError(f"{where}: expected 'hybrid_layer_pattern' to give {layers} flags (num_hidden_layers: "
                             f"1 for a sliding-window layer, 0 for a full-attention one), got {pattern!r}")
    full = _int(c, "num_key_value_heads", where) * (_int(c, "head_dim", where) + _int(c, "v_head_dim", where))
    swa = _int(c, "swa_num_key_value_heads", where) * (_int(c, "swa_head_dim", where)
                                                       + _int(c, "swa_v_head_dim", where))
    window = _int(c, "sliding_window_size", where) if any(p == 1 for p in pattern) else None
    return KVLayout(tuple((swa if p == 1 else full) * element_bytes for p in pattern),
                    tuple(window if p == 1 else None for p in pattern))


def _step3p5_layout(c: Mapping[str, Any], layers: int, element_bytes: int, where: str) -> KVLayout:
    # Step-3.5 names its key-value heads num_attention_groups; its sliding layers (layer_types, or
    # without it every even layer, as mlx-lm builds them) take theirs from attention_other_setting.
    types = c.get("layer_types")
    if types is None:
        sliding = [i % 2 == 0 for i in range(layers)]
    elif (not isinstance(types, Sequence) or isinstance(types, str) or len(types) != layers
          or not all(isinstance(t, str) for t in types)):
        raise AsyncsideError(f"{where}: expected 'layer_types' to name {layers} layers (num_hidden_layers), "
                             f"got {types!r}")
    else:
        sliding = [t == "sliding_attention" for t in types]
    head_dim = _int(c, "head_dim", where)
    full = _int(c, "num_attention_groups", where)
    other = c.get("attention_other_setting")
    if other is not None and not isinstance(other, Mapping):
        raise AsyncsideError(f"{where}: expected 'attention_other_setting' to be an object of the sliding "
                             f"layers' heads, got {other!r}")
    swa = _int(other, "num_attention_groups", f"{where}: attention_other_setting") if other else full
    window = _int(c, "sliding_window", where) if any(sliding) else None
    return KVLayout(tuple(2 * (swa if s else full) * head_dim * element_bytes for s in sliding),
                    tuple(window if s else None for s in sliding))


def _model_element_bytes(model: Any) -> int:
    """Bytes of the activations' dtype (what the caches store): the first floating-point parameter
    of the mlx-lm module (a quantized model's scales), else the config's ``torch_dtype``, else 2."""
    inner = getattr(model, "model", None)
    params = getattr(inner, "parameters", None)
    if callable(params):
        from mlx.utils import tree_flatten

        for item in tree_flatten(params()):
            dtype = getattr(item[1], "dtype", None)
            if dtype is not None:
                try:
                    if "float" in str(dtype):
                        return dtype_bytes(dtype)
                except ValueError:
                    continue
    config = getattr(model, "config", None) or {}
    for key in ("torch_dtype", "dtype"):
        name = _scope(config).get(key) or config.get(key)
        if name is not None:
            try:
                return dtype_bytes(name)
            except ValueError:
                pass
    return 2


def model_kv_layout(model: Any) -> KVLayout:
    """The KV layout of a served model (its ``config``, its parameters' dtype)."""
    config = getattr(model, "config", None)
    if not isinstance(config, Mapping):
        raise AsyncsideError("the model has no config to size its KV caches from")
    return kv_layout(config, _model_element_bytes(model), where=f"{getattr(model, 'model_id', 'the model')} config")
