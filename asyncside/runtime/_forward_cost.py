"""What one forward's transient buffers cost, from the model's ``config.json``, and the longest
prompt chunk whose forward fits a given room.

A memory plan sizes the pools and leaves a fixed headroom for MLX's buffers. Decode steps stay far
inside it, but a prompt's forward grows with its chunk: activations per token, and attention
scores per (query, key) pair per head, which MLX materializes where it has no fused kernel (the
CPU). A chunk as long as mlx-lm's prefill step took several times the headroom on a model of the
width of Qwen3-30B-A3B, so under a budget the plan bounds the chunk instead (BENCHMARKS.md,
"Memory we use").

The estimate is deliberately on the high side: float32 activations, every copy of a layer alive
at once. It only ever shortens chunks, which costs a little prefill speed and no exactness: a
chunk's keys and values are the same whichever chunk a position is in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FIT", "TOP_K_KEYS", "ForwardCost", "config_top_k", "forward_cost"]

#: Bytes of one activation element (float32: what the CPU computes in, the worst case).
ELEMENT_BYTES = 4
#: Hidden-sized activations alive per token within a layer: the residual stream, the norms, the
#: attention's queries, keys, values and output, the router's input and the MoE's output sum.
HIDDEN_COPIES = 24
#: Per routed (token, expert) pair: the gate and up projections and their product.
EXPERT_COPIES = 3
#: Per (query, key) pair and head: the scores, their masked and scaled form, the softmax.
PAIR_COPIES = 3
#: The share of a room the estimate may fill: on small models the forwards took up to a fifth more
#: than estimated once the context grew (BENCHMARKS.md, "Memory we use").
FIT = 0.8
#: Where the config does not say its top-k (the plan's own default).
DEFAULT_TOP_K = 8
#: Where a model's config.json keeps its router's top-k, by architecture family (hunyuan's
#: ``moe_topk`` may list one per layer; ernie4_5_moe's is ``moe_k``).
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_top_k", "moe_k", "top_k")


@dataclass(frozen=True)
class ForwardCost:
    """Bytes a forward of ``t`` new tokens over ``c`` cached positions takes beyond what is held:
    ``fixed + t * per_token + t * (c + t) * per_pair``."""

    per_token: int
    per_pair: int
    fixed: int = 0

    def bytes(self, tokens: int, cached: int = 0) -> int:
        """The estimate for ``tokens`` new tokens after ``cached`` positions."""
        return self.fixed + tokens * self.per_token + tokens * (cached + tokens) * self.per_pair

    def chunk(self, room: int, want: int, cached: int = 0) -> int:
        """The most tokens, at most ``want`` (and at least one), whose forward after ``cached``
        positions fits ``room`` bytes."""
        if want <= 1 or self.bytes(want, cached) <= room:
            return max(want, 1)
        # per_pair * t^2 + (per_token + per_pair * cached) * t - (room - fixed) <= 0
        a, b, c = self.per_pair, self.per_token + self.per_pair * cached, self.fixed - room
        if c >= 0:
            return 1
        t = (-c / b) if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
        best = max(1, min(want, int(t)))
        while best > 1 and self.bytes(best, cached) > room:  # float rounding at the boundary
            best -= 1
        return best


def _positive(scope: Mapping[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` that ``scope`` holds as a positive integer (the largest, where it
    holds a list of them: one per layer)."""
    for key in keys:
        v = scope.get(key)
        if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
            return int(max(v))
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def config_top_k(config: Mapping[str, Any] | None) -> int | None:
    """The router's top-k an mlx-lm ``config`` names (:data:`TOP_K_KEYS`, its text section too);
    None where it names none."""
    if not isinstance(config, Mapping):
        return None
    inner = config.get("text_config")
    for scope in (config, inner if isinstance(inner, Mapping) else {}):
        k = _positive(scope, *TOP_K_KEYS)
        if k is not None:
            return k
    return None


def forward_cost(config: Mapping[str, Any] | None, top_k: int | None = None) -> ForwardCost | None:
    """The :class:`ForwardCost` of an mlx-lm model's ``config`` (its text section where it nests
    one); None where the config lacks the widths it needs (the plan then bounds nothing)."""
    if not isinstance(config, Mapping):
        return None
    inner = config.get("text_config")
    scope = inner if isinstance(inner, Mapping) and "hidden_size" in inner else config
    hidden = _positive(scope, "hidden_size")
    heads = _positive(scope, "num_attention_heads")
    # the experts' width: qwen3_moe / deepseek / olmoe name it apart from the dense MLP's; mixtral
    # and gpt-oss have only the one
    width = _positive(scope, "moe_intermediate_size", "intermediate_size")
    if hidden is None or heads is None or width is None:
        return None
    k = top_k or _positive(scope, *TOP_K_KEYS) or DEFAULT_TOP_K
    vocab = _positive(scope, "vocab_size") or 0
    per_token = ELEMENT_BYTES * (HIDDEN_COPIES * hidden + EXPERT_COPIES * k * width)
    # the head runs on the last position only (logits and their log-softmax)
    return ForwardCost(per_token=per_token, per_pair=ELEMENT_BYTES * PAIR_COPIES * heads,
                       fixed=2 * ELEMENT_BYTES * vocab)
