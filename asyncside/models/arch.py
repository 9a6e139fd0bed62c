"""Per-architecture adapters: how to walk an mlx-lm MoE model layer by layer.

The async forward cannot call an mlx-lm model's ``__call__`` (it must stop inside every MoE block
to learn the routed experts on the host before the expert gather is built). So it re-walks the
model's *own modules* in the same order with the same ops: embedding, per decoder layer
``h = x + self_attn(input_layernorm(x), mask, cache)``, ``out = h + mlp(post_attention_layernorm(h))``,
final norm, LM head. Every supported architecture follows this decoder pattern; what differs is
kept here: where the MoE block lives, how attention masks are built, how a layer's attention is
called and where the embedding lives, and which configurations of a type are refused.

The MoE blocks themselves are not re-implemented: the forward calls each block's own ``__call__``
(see :mod:`asyncside.models.pooled`), so routing, score normalisation, shared experts and biases are
exactly mlx-lm's.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from ..errors import AsyncsideError
from .chunked_batch import BatchChunkedKVCache


class UnsupportedModelError(AsyncsideError, ValueError):
    """The model's architecture (config ``model_type``) is not one asyncside can stream."""


def _masks_shared(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    mask = create_attention_mask(h, cache[0])
    return [mask] * len(cache)


def _masks_array(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # deepseek_v3 adds the mask to its rope scores, so it asks for an array mask.
    mask = create_attention_mask(h, cache[0], return_array=True)
    return [mask] * len(cache)


def _masks_gpt_oss(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    inner = model.model
    full = create_attention_mask(h, cache[inner.ga_idx])
    swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
    return [full if t == "full_attention" else swa for t in inner.layer_types]


def _masks_exaone_moe(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # mlx-lm's ExaoneMoEModel.__call__: a causal mask from its first full-attention layer's cache, a
    # windowed one from its first sliding layer's (the first cache where it has none of a kind).
    inner = model.model
    full = create_attention_mask(h, cache[inner.ga_idx] if inner.ga_idx is not None else cache[0])
    swa = create_attention_mask(h, cache[inner.swa_idx] if inner.swa_idx is not None else cache[0],
                                window_size=inner.window_size)
    return [swa if layer.is_sliding_window else full for layer in inner.layers]


def _masks_mellum(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # mlx-lm's MellumModel.__call__: layer types as its config lists them, each kind's mask from the
    # cache of its first layer of that kind.
    inner = model.model
    types = inner.args.layer_types
    full = create_attention_mask(h, cache[inner._first_full])
    sliding = (None if inner._first_sliding is None else
               create_attention_mask(h, cache[inner._first_sliding], window_size=inner.args.sliding_window))
    return [full if t == "full_attention" else sliding for t in types]


def _masks_full_and_sliding(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # mlx-lm's LagunaModel.__call__ and AfmoeModel.__call__: the full-attention mask from the first
    # full layer's cache (fa_idx), the windowed one from the first sliding layer's (swa_idx; where
    # there is none, no layer uses it).
    inner = model.model
    full = create_attention_mask(h, cache[inner.fa_idx])
    swa = full if inner.swa_idx is None else create_attention_mask(h, cache[inner.swa_idx],
                                                                   window_size=inner.sliding_window)
    return [swa if layer.use_sliding else full for layer in inner.layers]


def _masks_mimo_v2_flash(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # mlx-lm's mimo_v2_flash LanguageModel.__call__ (which sizes its masks by the token ids, of the
    # same length as the hidden state): the full mask from its first full layer's cache, the
    # windowed one from its first sliding layer's.
    inner = model.model
    full = create_attention_mask(h, cache[inner.ga_idx])
    swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window_size)
    return [swa if layer.is_sliding_window else full for layer in inner.layers]


def _masks_llama4(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # mlx-lm's LlamaModel.__call__ (llama4) step for step: its chunked layers (every layer but each
    # fourth) drop the keys before their window first, then one chunk mask serves them all and the
    # fourth layers share a causal mask. Caches of several sequences at their own positions
    # (BatchChunkedKVCache, with mlx-lm's BatchKVCache for the fourth layers) give a mask per row.
    inner = model.language_model.model
    for idx, c in enumerate(cache):
        if (idx + 1) % 4 != 0:
            c.maybe_trim_front()
    global_mask = create_attention_mask(h, cache[3])
    if isinstance(cache[0], BatchChunkedKVCache):
        chunk_mask = cache[0].make_mask(h.shape[1])
    else:
        start = cache[0].start_position
        offset = cache[0].offset
        end = offset + h.shape[1]
        linds = mx.arange(start, end)
        rinds = mx.arange(offset, end)[:, None]
        block_pos = mx.abs((linds // inner.attention_chunk_size) - (rinds // inner.attention_chunk_size))
        token_pos = linds <= rinds
        chunk_mask = (block_pos == 0) & token_pos
    return [chunk_mask if (idx + 1) % 4 != 0 else global_mask for idx in range(len(cache))]


def _masks_deepseek_v32(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # mlx-lm's DeepseekV32Model.__call__: each layer's cache is a CacheList of its latent keys and
    # its indexer's keys; one array mask from the first layer's latent cache serves every layer.
    mask = create_attention_mask(h, cache[0][0] if cache[0] else None, return_array=True)
    return [mask] * len(cache)


def _masks_step3p5(model: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # mlx-lm's Step3p5Model.__call__: each kind's mask from the cache of its first layer of that kind.
    inner = model.model
    full = None if inner._full_idx is None else create_attention_mask(h, cache[inner._full_idx])
    swa = (None if inner._swa_idx is None else
           create_attention_mask(h, cache[inner._swa_idx], window_size=inner.args.sliding_window))
    return [swa if layer.is_sliding else full for layer in inner.layers]


def _afmoe_embed_scale(inner: nn.Module, h: mx.array) -> mx.array:
    # AfmoeModel.__call__ scales the embeddings by the square root of the width under muP.
    return h * math.sqrt(inner.hidden_size) if inner.mup_enabled else h


def _llama4_attn(layer: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array:
    # mlx-lm's llama4 Attention.__call__, except in a global (non-rotary) layer over a batch cache:
    # there its attention temperature (a scale of the queries by their positions) is taken at each
    # row's own positions, which mlx-lm's code builds from one scalar offset.
    attn = layer.self_attn
    offset = getattr(cache, "offset", 0)
    if isinstance(offset, int) or attn.use_rope or not attn.attn_temperature_tuning:
        return cast(mx.array, attn(x, mask, cache))
    b, n, _ = x.shape
    queries = attn.q_proj(x).reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
    keys = attn.k_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    positions = offset[:, None] + mx.arange(1, n + 1)[None]  # (B, n): mlx-lm's arange(offset + 1, offset + n + 1)
    scales = mx.log(mx.floor(positions / attn.floor_scale) + 1.0) * attn.attn_scale + 1.0
    queries = (queries * scales[:, None, :, None]).astype(queries.dtype)
    keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return cast(mx.array, attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1)))


def _mistral4_attn(layer: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array:
    # mistral4's model scales every layer's queries by a factor of the step's positions (its
    # llama-4 attention scale), computed once from the first cache's offset; every layer's cache
    # is at that offset before its update, so the factor is taken from the layer's own (an offset
    # per row over a batch cache, which mlx-lm's function takes). The function is the one the
    # layer's own module uses.
    attn = layer.self_attn
    attn_scale = importlib.import_module(type(attn).__module__)._get_llama_4_attn_scale
    rope = attn.args.rope_parameters
    offset = cache.offset if cache is not None else 0
    scale = attn_scale(x.shape[1], offset, rope["llama_4_scaling_beta"],
                       rope["original_max_position_embeddings"]).astype(x.dtype)
    return cast(mx.array, attn(x, scale, mask, cache))


def _self_attn(layer: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array:
    return cast(mx.array, layer.self_attn(x, mask, cache))


def _attention_attr(layer: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array:
    # bailing_moe names its attention sub-layer ``attention``.
    return cast(mx.array, layer.attention(x, mask, cache))


def _hunyuan_attn(layer: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array:
    # hunyuan's attention also returns the keys and values it computed, which a later layer reuses
    # under cross-layer attention; without it (checked by _hunyuan_check) no layer is handed any.
    return cast(mx.array, layer.self_attn(x, mask, cache)[0])


def _hunyuan_check(model: nn.Module) -> None:
    if getattr(getattr(model, "args", None), "use_cla", False):
        raise UnsupportedModelError("hunyuan: cross-layer attention (use_cla) is not supported: its layers "
                                    "share keys and values computed by an earlier layer")


def _no_check(model: nn.Module) -> None:
    return None


def _mistral3_check(model: nn.Module) -> None:
    # Mistral 3's wrapper builds a ministral3 or llama text model (dense) unless its text_config
    # names mistral4, the one that routes experts.
    text = getattr(getattr(model, "args", None), "text_config", None) or {}
    kind = text.get("model_type") if isinstance(text, dict) else None
    if kind != "mistral4":
        raise UnsupportedModelError(f"mistral3: its text model ({kind!r} in text_config) is a dense model; only a "
                                    f"mistral4 text model routes experts")


@dataclass(frozen=True)
class Arch:
    """What the generic decoder walk needs to know about one mlx-lm architecture."""

    model_type: str
    #: attribute of a decoder layer holding its MLP / MoE block
    block_attr: str
    #: builds one attention mask per layer exactly as the model's ``__call__`` does
    masks: Callable[[nn.Module, mx.array, list[Any]], list[Any]]
    #: a decoder layer's attention over its normed input: ``(layer, x, mask, cache) -> output``
    attention: Callable[[nn.Module, mx.array, Any, Any], mx.array] = _self_attn
    #: attribute of the inner model (``model.model``) holding the token embedding
    embed_attr: str = "embed_tokens"
    #: refuses (UnsupportedModelError) a model of this type whose configuration the walk does not follow
    check: Callable[[nn.Module], None] = _no_check
    #: where the text model lives: the module holding ``lm_head`` (None: the model itself; llama4:
    #: ``language_model``), whose ``model`` holds the embedding, the decoder layers and the final norm
    text_attr: str | None = None
    #: whether the block's router can be asked for more experts than it routes (the wider
    #: lookahead, :meth:`asyncside.models.walk.DecoderWalk.route_ids`); llama4's cannot
    widens: bool = True
    #: granitemoe's scaling multipliers, as attribute names (None: not scaled): the inner model's
    #: factor of the embeddings, a decoder layer's factor of each sub-layer's output before its
    #: residual add, the head module's divisor of the logits
    embed_scale: str | None = None
    residual_scale: str | None = None
    logits_divisor: str | None = None
    #: the inner model's op on the token embeddings before the first layer (afmoe's muP scale),
    #: ``(inner model, embeddings) -> embeddings``; None: none
    embed_op: Callable[[nn.Module, mx.array], mx.array] | None = None
    #: a decoder layer's norm of its attention output before the residual add (afmoe's
    #: ``post_attention_layernorm``); None: the output is added as it is
    attn_out_norm: str | None = None
    #: a decoder layer's norm of the MLP / MoE block's input
    mlp_norm: str = "post_attention_layernorm"
    #: a decoder layer's norm of its MLP / MoE block's output before the residual add (afmoe's
    #: ``post_mlp_layernorm``: the walk's blocks return their output normed, :class:`NormedBlock`)
    mlp_out_norm: str | None = None

    def head_module(self, model: nn.Module) -> nn.Module:
        """The module holding the output head (``lm_head``) and the inner model (``.model``)."""
        return model if self.text_attr is None else cast(nn.Module, getattr(model, self.text_attr))

    def inner(self, model: nn.Module) -> nn.Module:
        """The inner text model: embedding, decoder layers, final norm."""
        return cast(nn.Module, self.head_module(model).model)

    def embedding(self, model: nn.Module) -> nn.Module:
        """The model's token embedding module (its ``as_linear`` is the head of tied embeddings)."""
        return cast(nn.Module, getattr(self.inner(model), self.embed_attr))


ARCHS: dict[str, Arch] = {
    "qwen3_moe": Arch("qwen3_moe", "mlp", _masks_shared),
    "mixtral": Arch("mixtral", "block_sparse_moe", _masks_shared),
    "olmoe": Arch("olmoe", "mlp", _masks_shared),
    "deepseek_v3": Arch("deepseek_v3", "mlp", _masks_array),
    "gpt_oss": Arch("gpt_oss", "mlp", _masks_gpt_oss),
    "qwen2_moe": Arch("qwen2_moe", "mlp", _masks_shared),
    "deepseek_v2": Arch("deepseek_v2", "mlp", _masks_shared),
    "glm4_moe": Arch("glm4_moe", "mlp", _masks_shared),
    "phimoe": Arch("phimoe", "block_sparse_moe", _masks_shared),
    "ernie4_5_moe": Arch("ernie4_5_moe", "mlp", _masks_shared),
    "dots1": Arch("dots1", "mlp", _masks_shared),
    "hunyuan": Arch("hunyuan", "mlp", _masks_shared, attention=_hunyuan_attn, check=_hunyuan_check),
    "bailing_moe": Arch("bailing_moe", "mlp", _masks_shared, attention=_attention_attr,
                        embed_attr="word_embeddings"),
    "granitemoe": Arch("granitemoe", "block_sparse_moe", _masks_shared, embed_scale="embedding_multiplier",
                       residual_scale="residual_multiplier", logits_divisor="logits_scaling"),
    # llama4's MoE block scales the switch input by its one expert's sigmoid score: a wider router
    # would not broadcast.
    "llama4": Arch("llama4", "feed_forward", _masks_llama4, attention=_llama4_attn, text_attr="language_model",
                   widens=False),
    # Architectures added in session 18 (tests/test_archs_18.py).
    "minimax": Arch("minimax", "block_sparse_moe", _masks_shared),
    "deepseek": Arch("deepseek", "mlp", _masks_shared),
    # glm4_moe_lite's multi-head latent attention adds the mask to its rope scores, as deepseek_v3's.
    "glm4_moe_lite": Arch("glm4_moe_lite", "mlp", _masks_array),
    "mistral4": Arch("mistral4", "mlp", _masks_shared, attention=_mistral4_attn),
    "Klear": Arch("Klear", "mlp", _masks_shared),
    "exaone_moe": Arch("exaone_moe", "mlp", _masks_exaone_moe),
    "mellum": Arch("mellum", "mlp", _masks_mellum),
    "laguna": Arch("laguna", "mlp", _masks_full_and_sliding),
    "mimo_v2_flash": Arch("mimo_v2_flash", "mlp", _masks_mimo_v2_flash),
    # Architectures added in session 19 (tests/test_archs_19.py).
    "deepseek_v32": Arch("deepseek_v32", "mlp", _masks_deepseek_v32),
    "afmoe": Arch("afmoe", "mlp", _masks_full_and_sliding, embed_op=_afmoe_embed_scale,
                  attn_out_norm="post_attention_layernorm", mlp_norm="pre_mlp_layernorm",
                  mlp_out_norm="post_mlp_layernorm"),
    "step3p5": Arch("step3p5", "mlp", _masks_step3p5),
    # Multimodal wrappers whose text model (``language_model``) is a supported one's: the walk runs
    # the text model; the vision weights are dropped as mlx-lm's own loading drops them.
    "kimi_vl": Arch("kimi_vl", "mlp", _masks_array, text_attr="language_model"),
    "kimi_k25": Arch("kimi_k25", "mlp", _masks_array, text_attr="language_model"),
    "qwen3_vl_moe": Arch("qwen3_vl_moe", "mlp", _masks_shared, text_attr="language_model"),
    "mistral3": Arch("mistral3", "mlp", _masks_shared, attention=_mistral4_attn, check=_mistral3_check,
                     text_attr="language_model"),
}

#: ``model_type``s whose mlx-lm module builds a supported architecture's model (its ``Model`` is
#: that module's, or a subclass adding nothing the walk sees) under its own name, which mlx-lm's
#: ``MODEL_REMAPPING`` does not list
ALIASES: dict[str, str] = {
    "solar_open": "glm4_moe",
    "glm_moe_dsa": "deepseek_v32",
}

#: mlx-lm MoE architectures the decoder walk cannot follow, and why: converting or loading one is
#: refused naming the reason, not only as a type missing from the supported list
REFUSED: dict[str, str] = {
    "qwen3_next": "its linear-attention layers (gated delta net) keep a recurrent state and a convolution "
                  "state (ArraysCache), not the keys and values the walk's caches hold",
    "kimi_linear": "its linear-attention layers (Kimi Delta Attention) keep a recurrent state (ArraysCache), "
                   "not the keys and values the walk's caches hold",
    "kimi_k3": "its linear-attention layers (Kimi Delta Attention) keep a recurrent state (ArraysCache), and "
               "its decoder layers add residual blocks carried across layers",
    "bailing_moe_v3": "its linear-attention layers keep a recurrent state (ArraysCache), not the keys and "
                      "values the walk's caches hold",
    "qwen3_5_moe": "its linear-attention layers (gated delta net) keep a recurrent state and a convolution "
                   "state (ArraysCache), not the keys and values the walk's caches hold",
    "bailing_moe_linear": "its linear-attention layers keep a recurrent state (ArraysCache), not the keys and "
                          "values the walk's caches hold",
    "jamba": "its Mamba layers keep a convolution and an SSM state (ArraysCache) in place of attention",
    "nemotron_h": "its Mamba-2 layers keep a convolution and an SSM state (ArraysCache) in place of attention",
    "granitemoehybrid": "its Mamba-2 layers keep a convolution and an SSM state (ArraysCache) in place of "
                        "attention",
    "lfm2_moe": "its short-convolution layers keep a convolution state (ArraysCache) in place of attention",
    "longcat_flash": "each decoder layer runs two attention and two dense MLP sub-layers around one MoE "
                     "block whose output joins at the layer's end, not one attention then one MoE block",
    "gemma4_text": "its decoder layers route the experts from the hidden state outside their MoE block (the "
                   "layer's own router) beside a dense MLP, norm each sub-layer's output, and may reuse an "
                   "earlier layer's keys and values (num_kv_shared_layers)",
    "gemma4": "its text model is gemma4_text, whose decoder layers route the experts from the hidden state "
              "outside their MoE block beside a dense MLP and may reuse an earlier layer's keys and values",
    "qwen3_5": "its linear-attention layers (gated delta net) keep a recurrent state and a convolution state "
               "(ArraysCache), not the keys and values the walk's caches hold",
    "prism_hadamard_qwen35": "it is a qwen3_5 model, whose linear-attention layers (gated delta net) keep a "
                             "recurrent state and a convolution state (ArraysCache), not the keys and values "
                             "the walk's caches hold",
    "bailing_hybrid": "its linear-attention layers keep a recurrent state (ArraysCache), not the keys and values "
                      "the walk's caches hold",
    "longcat_flash_ngram": "each decoder layer runs two attention and two dense MLP sub-layers around one MoE "
                           "block, and its n-gram embedding keeps a state of earlier tokens (ArraysCache)",
    "deepseek_v41": "its layers mix several residual streams (hyper-connections) and compress earlier keys into "
                    "a cache of their own (LayerCache), not one residual stream and the keys and values the "
                    "walk's caches hold",
    "muse_spark": "its layers join each sub-layer's output through learned residual gates that also norm the "
                  "next sub-layer's input (norm_add_norm), not plain residual adds",
    "phixtral": "each decoder layer runs its attention and its MoE block side by side on the same normed "
                "input, not the MoE block after the attention",
    "dbrx": "its experts are separate MLP modules looped over in Python, not one stacked switch layer whose "
            "rows can be streamed",
}

SWITCH_TYPES = (SwitchGLU, SwitchMLP)


def arch_for(model_type: str) -> Arch:
    """The adapter of ``model_type``, or of the architecture mlx-lm builds it as (its
    ``MODEL_REMAPPING``: ``kimi_k2`` is a ``deepseek_v3``); UnsupportedModelError naming the reason
    for an architecture in :data:`REFUSED`, listing the supported ones otherwise."""
    from mlx_lm.utils import MODEL_REMAPPING

    # Kimi-K2's config says kimi_k2, which mlx-lm builds with deepseek_v3's classes: refusing the
    # name refused a model whose architecture the walk follows.
    arch = (ARCHS.get(model_type) or ARCHS.get(MODEL_REMAPPING.get(model_type, ""))
            or ARCHS.get(ALIASES.get(model_type, "")))
    reason = REFUSED.get(model_type) or REFUSED.get(MODEL_REMAPPING.get(model_type, ""))
    if arch is None and reason is not None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported: {reason}")
    if arch is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {sorted(ARCHS)}"
            f" (and {', '.join(sorted(remapped_model_types()))}, which mlx-lm builds as one of them)"
        )
    return arch


def remapped_model_types() -> dict[str, str]:
    """The ``model_type``s mlx-lm builds with the classes of a supported one, and that one."""
    from mlx_lm.utils import MODEL_REMAPPING

    return {**{k: v for k, v in MODEL_REMAPPING.items() if v in ARCHS and k not in ARCHS},
            **{k: v for k, v in ALIASES.items() if v in ARCHS}}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in order (``model.layers`` is mlx-lm's convention)."""
    return list(model.layers)


class NormedBlock(nn.Module):
    """An MLP or MoE block whose output its decoder layer norms before the residual add (afmoe's
    ``post_mlp_layernorm``): ``norm`` of the block's own output, the same op the layer applies. Its
    other attributes are the block's (its switch layer, router, top-k)."""

    def __init__(self, block: nn.Module, norm: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self.block = block
        self.norm = norm

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "block" not in self:  # while __init__ sets it
                raise
            return getattr(self["block"], name)

    def __call__(self, x: mx.array) -> mx.array:
        return cast(mx.array, self.norm(self.block(x)))


def unwrapped(block: nn.Module) -> nn.Module:
    """The mlx-lm block a :class:`ScaledBlock` or :class:`NormedBlock` wraps (``block`` itself
    otherwise): where its router keeps what the walk sets (the wider lookahead's top-k)."""
    while isinstance(block, (ScaledBlock, NormedBlock)):
        block = block["block"]
    return block


class ScaledBlock(nn.Module):
    """An MLP or MoE block whose output its decoder layer scales before the residual add
    (granitemoe's ``residual_multiplier``): the block's own output times ``scale``, the same op
    the layer applies. Its other attributes are the block's (its switch layer, router, top-k)."""

    def __init__(self, block: nn.Module, scale: float) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self.block = block
        object.__setattr__(self, "scale", scale)  # a plain number, not a parameter

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "block" not in self:  # while __init__ sets it
                raise
            return getattr(self["block"], name)

    def __call__(self, x: mx.array) -> mx.array:
        return cast(mx.array, self.block(x) * self.scale)


#: switch layer types defined outside this module (the pooled switch registers itself on import)
_REGISTERED_SWITCHES: list[type] = []


def register_switch_type(cls: type) -> type:
    """Make :func:`find_switch` recognise ``cls`` as a switch layer; returns ``cls`` (a decorator).
    The pooled switch registers itself, so this module need not import it."""
    if cls not in _REGISTERED_SWITCHES:
        _REGISTERED_SWITCHES.append(cls)
    return cls


def find_switch(block: nn.Module) -> tuple[str, nn.Module] | None:
    """The (attribute name, module) of the switch layer (stacked experts) inside an MoE block.

    Recognises mlx-lm's ``SwitchGLU``/``SwitchMLP`` and the replacements registered with
    :func:`register_switch_type` (asyncside's pooled switch). Returns None for a dense MLP.
    """
    kinds = (*SWITCH_TYPES, *_REGISTERED_SWITCHES)
    found = [(str(name), child) for name, child in block.children().items()
             if isinstance(child, nn.Module) and isinstance(child, kinds)]
    if not found:
        return None
    if len(found) > 1:
        raise UnsupportedModelError(
            f"{type(block).__name__} has {len(found)} switch layers ({[n for n, _ in found]}); expected one"
        )
    return found[0]


def top_k_attribute(block: nn.Module) -> tuple[Any, str] | None:
    """Where an MoE block keeps how many experts its router picks, as (object, attribute name).

    deepseek_v3 routes in its gate module (``gate.top_k``); qwen3_moe and olmoe keep ``top_k`` on
    the block, mixtral and gpt_oss ``num_experts_per_tok``, ernie4_5_moe ``k``, granitemoe its
    router's ``top_k``. None if the block has no such int.
    """
    gate = getattr(block, "gate", None)
    router = getattr(block, "router", None)
    for obj, name in ((gate, "top_k"), (router, "top_k"), (block, "top_k"), (block, "num_experts_per_tok"),
                      (block, "k")):
        if obj is not None and isinstance(getattr(obj, name, None), int) and not isinstance(getattr(obj, name), bool):
            return obj, name
    return None


def moe_layers(model: nn.Module, arch: Arch) -> dict[int, tuple[nn.Module, str]]:
    """layer index -> (MoE block, attribute name of its switch layer), for layers that route experts.
    UnsupportedModelError for a model whose configuration the walk does not follow (``arch.check``)."""
    arch.check(model)
    out: dict[int, tuple[nn.Module, str]] = {}
    for i, layer in enumerate(decoder_layers(model)):
        block = getattr(layer, arch.block_attr, None)
        if block is None:
            raise UnsupportedModelError(
                f"{arch.model_type}: decoder layer {i} ({type(layer).__name__}) has no attribute {arch.block_attr!r}"
            )
        sw = find_switch(block)
        if sw is not None:
            out[i] = (block, sw[0])
    if not out:
        raise UnsupportedModelError(f"{arch.model_type}: the model has no MoE layer (no SwitchGLU/SwitchMLP found)")
    return out


def _group_size_and_bits(lin: nn.Module) -> tuple[int, int]:
    """A quantized switch linear's group size and bits; where it keeps None for either (MLX's
    default for its mode, as mlx-lm's convert records a mixed recipe's per-module entries),
    what its arrays were quantized with."""
    group_size, bits = lin.group_size, lin.bits
    if group_size is None or bits is None:
        # MLX's own defaults, read off a quantization of one row: its scales give the group size
        # and its packed weight the bits.
        width = 512
        packed, scales, *_ = mx.quantize(mx.zeros((1, width)), group_size=group_size, bits=bits,
                                         mode=getattr(lin, "mode", "affine"))
        group_size = group_size if group_size is not None else width // scales.shape[-1]
        bits = bits if bits is not None else packed.shape[-1] * 32 // width
    return int(group_size), int(bits)


def linear_meta(name: str, lin: nn.Module) -> dict[str, Any]:
    """JSON description of one switch linear (quantisation, bias) the pooled path reproduces."""
    if isinstance(lin, QuantizedSwitchLinear):
        if getattr(lin, "global_scale", None) is not None:
            raise UnsupportedModelError(
                f"switch linear {name!r} uses a per-expert global scale (nvfp4 global_scale); not supported"
            )
        group_size, bits = _group_size_and_bits(lin)
        return {
            "quantized": True,
            "group_size": group_size,
            "bits": bits,
            "mode": str(lin.mode),
            "affine_biases": lin.get("biases") is not None,
            "bias": "bias" in lin,
        }
    if isinstance(lin, SwitchLinear):
        return {"quantized": False, "bias": "bias" in lin}
    raise UnsupportedModelError(
        f"switch child {name!r} is a {type(lin).__name__}, expected SwitchLinear/QuantizedSwitchLinear")


def switch_meta(switch: nn.Module) -> dict[str, Any]:
    """JSON description of a switch layer: kind and its linears in call order."""
    if isinstance(switch, SwitchGLU):
        names = ["gate_proj", "up_proj", "down_proj"]
        kind = "glu"
    elif isinstance(switch, SwitchMLP):
        names = ["fc1", "fc2"]
        kind = "mlp"
    else:
        raise UnsupportedModelError(f"{type(switch).__name__} is not a SwitchGLU/SwitchMLP")
    return {"kind": kind, "linears": {n: linear_meta(n, getattr(switch, n)) for n in names}}


def segment_keys(meta: dict[str, Any]) -> list[str]:
    """Pool/segment keys of a switch layer, e.g. ``gate_proj.weight``, ``gate_proj.scales``, ..."""
    keys = []
    for name, lm in meta["linears"].items():
        keys.append(f"{name}.weight")
        if lm["quantized"]:
            keys.append(f"{name}.scales")
            if lm["affine_biases"]:
                keys.append(f"{name}.biases")
        if lm["bias"]:
            keys.append(f"{name}.bias")
    return keys
