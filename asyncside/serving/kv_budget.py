"""What served requests' KV caches take, from the model's config, and the engine's admission rule.

A request's KV cache holds, per attention layer, the keys and values of every position it has fed.
mlx-lm's caches (``mlx_lm.models.cache``) grow in steps: ``KVCache`` (and the ``BatchKVCache`` the
engine merges decoding requests into) allocates ``step`` (256) positions at a time past where the
growth starts, so a cache holding ``T`` positions has room for at most ``T + step - 1`` (the room
is a multiple of ``step`` only when every growth starts at one: a merged or copied cache starts at
its exact length). A sliding-window layer (``RotatingKVCache``, gpt-oss) keeps at most its window
plus one prefill chunk. :class:`KVLayout` holds those per-layer figures; :func:`kv_layout` reads
them from an mlx-lm config (the architectures asyncside serves: keys and values of
``num_key_value_heads x head_dim`` each, or deepseek-v3's compressed latent plus its rope key).

Under a memory budget the engine admits a waiting request only while the KV caches fit the plan's
KV allowance (:attr:`asyncside.runtime.MemoryPlan.kv_allowance_bytes`); see :class:`KVAdmission`.
Where the plan also reads past the page cache, every row evicted is a disk read: the engine then
admits no more requests at once than the pools' smallest layer holds one step's experts of
(:func:`rows_concurrency`). More would evict each other's experts within every step, and on a disk
that binds, the aggregate fell below one request's alone (BENCHMARKS.md, "Serving under a memory
budget").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AsyncsideError
from ..memory import describe_bytes

__all__ = ["KV_STEP", "KVAdmission", "KVLayout", "dtype_bytes", "kv_layout", "model_kv_layout", "plan_admission",
           "rows_concurrency"]

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
    deepseek-v3 (``kv_lora_rank``) caches ``kv_lora_rank + qk_rope_head_dim`` elements; layers whose
    ``layer_types`` entry is ``"sliding_attention"`` keep ``sliding_window`` positions.
    AsyncsideError naming ``where`` and the key when the config lacks one.
    """
    if element_bytes < 1:
        raise ValueError(f"element_bytes: expected >= 1, got {element_bytes}")
    c = _scope(config)
    layers = _int(c, "num_hidden_layers", where)
    if c.get("kv_lora_rank") is not None:  # multi-head latent attention: one latent + one rope key per position
        per = (_int(c, "kv_lora_rank", where) + _int(c, "qk_rope_head_dim", where)) * element_bytes
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


class KVAdmission:
    """Whether the engine may admit one more request under a KV allowance.

    The requests decoding together share mlx-lm's merged batch caches, every row padded to the
    longest, so the caches of ``n`` admitted requests are counted as ``n`` times the largest worst
    case among them (:meth:`KVLayout.bytes_for` of prompt + ``max_tokens``); the prefix cache's
    bytes count beside them. The engine admits the oldest waiting request only while that fits
    (:meth:`admits`), so one that does not fit holds back those behind it (first come, first
    admitted); :meth:`check` refuses at submission one whose worst case alone exceeds the
    allowance. ``allowance`` None: no limit. ``budget``: the memory budget, as refusals name it.
    """

    def __init__(self, layout: KVLayout, allowance: int | None, chunk: int = KV_STEP,
                 budget: str = "memory budget", max_active: int | None = None) -> None:
        self.layout = layout
        self.allowance = allowance
        self.chunk = chunk
        self.budget = budget
        #: requests generating at once that the pools' rows hold a step of (None: no such bound)
        self.max_active = max_active
        self.waits = 0  # admissions deferred because the caches would not fit
        self.row_waits = 0  # admissions deferred because the pools' rows would not hold another request

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        """Worst-case bytes of one request's cache (its prompt and every token it may generate)."""
        return self.layout.bytes_for(prompt_tokens + max_tokens, self.chunk)

    def reserved(self, needs: Sequence[int]) -> int:
        """Bytes the caches of requests with worst cases ``needs`` may take together."""
        return len(needs) * max(needs) if needs else 0

    def fits(self, needs: Sequence[int], extra: int = 0) -> bool:
        """Whether requests with worst cases ``needs`` fit the allowance beside ``extra`` bytes."""
        return self.allowance is None or self.reserved(needs) + extra <= self.allowance

    def admits(self, active: Sequence[Any], slot: Any, prefix_cache: Any) -> bool:
        """Whether ``slot`` (its ``kv_need``) fits beside the ``active`` requests, making room in
        ``prefix_cache`` (least recently used entries first) when that is what it takes."""
        if self.max_active is not None and len(active) >= self.max_active:
            self.row_waits += 1
            return False
        needs = [s.kv_need for s in active] + [slot.kv_need]
        if self.fits(needs):
            while not self.fits(needs, prefix_cache.nbytes) and len(prefix_cache):
                prefix_cache.drop_oldest()
            if self.fits(needs, prefix_cache.nbytes):
                return True
        self.waits += 1
        return False

    def refusal(self, prompt_tokens: int, max_tokens: int, budget: str | None = None) -> str | None:
        """Why a request can never be admitted (its worst case alone exceeds the allowance), or None."""
        if self.allowance is None:
            return None
        need = self.need(prompt_tokens, max_tokens)
        if need <= self.allowance:
            return None
        per = f"{self.layout.bytes_per_token:,} bytes"
        return (f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) may need {describe_bytes(need)} "
                f"of KV cache, past the KV allowance of {describe_bytes(self.allowance)} under the memory budget "
                f"({budget or self.budget}); {per} a token, allocated {self.layout.step} tokens at a time: ask for "
                f"fewer tokens, or serve with a larger --memory")

    def check(self, prompt_tokens: int, max_tokens: int) -> int:
        """A request's worst case (its ``kv_need``); a 400 ``RequestError`` (code ``kv_budget_exceeded``)
        saying why when it can never be admitted."""
        from .protocol import RequestError

        refused = self.refusal(prompt_tokens, max_tokens)
        if refused is not None:
            raise RequestError(refused, param="max_tokens", code="kv_budget_exceeded")
        return self.need(prompt_tokens, max_tokens)


def plan_admission(model: Any, source: Any, chunk: int, prefix_cache: Any) -> KVAdmission | None:
    """The engine's admission under ``source``'s memory plan (its ``kv_allowance_bytes``), or None
    where the plan grants none (no memory budget, no plan). The prefix cache is bounded by the
    allowance too (its entries count against it)."""
    plan = getattr(source, "plan", None)
    allowance = getattr(plan, "kv_allowance_bytes", None)
    if not isinstance(allowance, int):
        return None
    prefix_cache.max_bytes = min(prefix_cache.max_bytes, allowance)
    budget = str(getattr(plan, "source", "memory budget"))
    return KVAdmission(model_kv_layout(model), allowance, max(chunk, KV_STEP), budget,
                       max_active=rows_concurrency(plan, model))


def rows_concurrency(plan: Any, model: Any) -> int | None:
    """Under a plan that reads past the page cache (``plan.direct``), how many requests may generate
    at once: as many as the smallest layer's pool rows hold one decode step's experts of (rows //
    the model's top-k, at least one). None where the plan reads through the page cache (a miss is
    then a copy, not a disk read) or the rows or the top-k are unknown.

    ``ASYNCSIDE_ROWS_CONCURRENCY`` overrides it: ``off`` (no bound, for A/B runs) or a count >= 1.
    """
    import os

    from ..runtime._forward_cost import config_top_k

    raw = os.environ.get("ASYNCSIDE_ROWS_CONCURRENCY", "").strip().lower()
    if raw == "off":
        return None
    if raw not in ("", "auto"):
        if not raw.isdigit() or int(raw) < 1:
            raise AsyncsideError(f"ASYNCSIDE_ROWS_CONCURRENCY: expected off, auto or a count >= 1, got {raw!r}")
        return int(raw)
    rows = getattr(plan, "rows", None)
    if not getattr(plan, "direct", False) or not isinstance(rows, Mapping) or not rows:
        return None
    k = config_top_k(getattr(model, "config", None))
    if k is None:
        return None
    return max(1, min(int(r) for r in rows.values()) // k)
