"""Realistic model shapes for ``asyncside bench generate --shape``: seeded weights, built once, cached.

``qwen3-30b-a3b`` has the shape of Qwen3-30B-A3B (values from its ``config.json``): 48 decoder
layers, every one MoE (``decoder_sparse_step`` 1, no dense MLP layers), 128 experts of which 8 are
routed per token, hidden size 2048, expert intermediate size 768, 32 attention heads over 4 KV
heads of dimension 128, vocabulary 151936, RoPE theta 1e6, RMS-norm eps 1e-6, untied embeddings,
normalised top-k scores. Quantized like the embedded model (4-bit, group 64, router 8-bit,
float32 scales: 2.95 MB per expert record, about 18 GB of experts at 48 layers).

The weights are the embedded model's construction (:func:`asyncside.models.embedded.build_model`,
one seed, structured so that routing has a trained model's locality: hot experts, token-class
specialisation, a slowly changing residual stream), at this shape. The tokenizer is the byte-level
one (the weights are seeded: text is bytes; the real model's BOS/EOS ids are replaced by the byte
tokenizer's). ``layers`` builds fewer decoder layers (a CPU with little memory); ``vocab`` a
smaller vocabulary (a faster build; the LM head's cost then no longer matches the real model's).

:func:`ensure_shape` builds the mlx-lm model directory, profiles its routing on the embedded
model's prompts (the store's resident ranking), converts it to an expert store and deletes the
model directory; the store is kept under ``cache_root()/shape-<name>-L<layers>-V<vocab>-<hash>/``
(built in a temporary directory and renamed into place, under a file lock). Its READY marker
names the build code's version (``models.embedded.BUILD_VERSION``): a store that older code built
unlike this code's (a shape of one expert a layer before its router was made finite) is rebuilt. Building needs
twice the store's size on disk while it runs and the whole quantized model in memory: both are
checked before anything is built (:class:`ShapeTooLargeError`).

A shape is a name of :data:`SHAPES`, the path of a Hugging Face ``config.json`` (or of a directory
holding one) or a Hugging Face repo id (its ``config.json`` alone is fetched, the local cache
first): :func:`config_shape` reads its MoE dimensions whatever the architecture calls them
(``num_experts`` / ``num_local_experts`` / ``n_routed_experts``, ``num_experts_per_tok`` /
``experts_per_token``, ``moe_intermediate_size`` or, where every FFN is an expert as in Mixtral,
OLMoE and gpt-oss, ``intermediate_size``; hidden size, heads, KV heads, head dim or hidden / heads,
vocabulary, RoPE theta, norm eps, ``norm_topk_prob``) and builds a qwen3_moe of those dimensions
with the construction above. What a qwen3_moe cannot represent (shared experts, dense layers,
sigmoid or group-limited routing, multi-head latent attention, sliding windows, attention sinks,
biases, RoPE scaling, scaling multipliers, ``clip_qkv``, linear attention, partial rotary embeddings,
the model's own quantization) is listed in the build's ``note``; dense layers are left out, so
``layers`` counts the model's MoE layers. The cache directory's hash is the effective config's
(with the seed and quantization), so two configs never share a store.
The named presets other than the first two are built the same way from their real configs' fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..argtypes import LEAST_VOCAB, SMALL_VOCAB
from ..errors import AsyncsideError
from ..models.embedded import _file_lock
from ..models.tokenizer import ByteTokenizer

__all__ = ["SHAPES", "SMALL_VOCAB", "ShapeBuild", "ShapeError", "ShapeSource", "ShapeTooLargeError", "config_shape",
           "describe_shape", "ensure_shape", "estimate_bytes", "parse_shape_list", "qwen3_moe_config", "shape_spec"]


class ShapeError(AsyncsideError, ValueError):
    """A shape name is unknown, or a model config cannot be built as a shape (the message names the
    file and the field)."""


SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,  # the dense MLP size: unused, every layer is MoE
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "norm_topk_prob": True,
        "bos_token_id": ByteTokenizer.BOS,
        "eos_token_id": ByteTokenizer.EOS,
        "torch_dtype": "float32",
    },
}
#: DeepSeek-V3's routing (256 routed experts, top-8) on qwen3-30b-a3b's dimensions, built by the same
#: construction (a qwen3_moe: DeepSeek-V3's own 7168 x 2048 experts, about 22 MB a record at 4 bits,
#: are too large for a CPU bench); for ``asyncside bench offload``
SHAPES["deepseek-v3-like"] = {**SHAPES["qwen3-30b-a3b"], "num_experts": 256, "num_experts_per_tok": 8,
                              "num_hidden_layers": 61}

#: The fields of real models' ``config.json`` files that the presets below are built from (through
#: :func:`qwen3_moe_config`, like a user's config). Fields the construction does not read are kept
#: where they decide a note (shared experts, dense layers, routing, attention).
HF_PRESETS: dict[str, dict[str, Any]] = {
    # allenai/OLMoE-1B-7B-0924: 16 layers, all MoE; 64 experts top-8 of intermediate 1024 (its
    # ``intermediate_size``: OLMoE has no other FFN), hidden 2048, 16 heads (no GQA), vocabulary
    # 50304, top-k weights not renormalised.
    "olmoe-1b-7b": {
        "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "vocab_size": 50304, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "norm_topk_prob": False,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    },
    # Qwen/Qwen1.5-MoE-A2.7B (model_type qwen2_moe): 24 layers, all MoE; 60 routed experts top-4 of
    # intermediate 1408 and one shared expert of intermediate 5632 (not represented), hidden 2048,
    # 16 heads, vocabulary 151936.
    "qwen2-moe-a2.7b": {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "norm_topk_prob": False, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V2-Lite: 27 layers, the first dense (``first_k_dense_replace`` 1), 26 MoE
    # of 64 routed experts top-6 of intermediate 1408 plus 2 shared experts; hidden 2048, 16 heads of
    # multi-head latent attention (``kv_lora_rank`` 512), vocabulary 102400, softmax greedy top-k.
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "num_attention_heads": 16, "num_key_value_heads": 16,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400, "rope_theta": 10000, "rms_norm_eps": 1e-6,
        "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": False, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False,
    },
    # openai/gpt-oss-20b: 24 layers, all MoE; 32 experts top-4 of intermediate 2880, hidden 2880,
    # 64 query heads over 8 KV heads of dimension 64, vocabulary 201088; attention sinks, sliding
    # windows on alternate layers, biases and MXFP4 experts (none represented).
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "rope_theta": 150000,
        "rms_norm_eps": 1e-5, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "attention_bias": True, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
        "quantization_config": {"quant_method": "mxfp4"}, "tie_word_embeddings": False,
    },
    # mistralai/Mixtral-8x7B-v0.1: 32 layers, all MoE; 8 experts top-2 of intermediate 14336 (its
    # ``intermediate_size``), hidden 4096, 32 heads over 8 KV heads, vocabulary 32000 (records of
    # about 110 MB at 4 bits: the full shape is larger than most disks' free space).
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
        "sliding_window": None, "tie_word_embeddings": False,
    },
}

#: What each preset's qwen3_moe does not represent (see :func:`qwen3_moe_config`)
PRESET_NOTES: dict[str, list[str]] = {
    "qwen3-30b-a3b": [],
    "deepseek-v3-like": ["DeepSeek-V3's expert count and top-k on qwen3-30b-a3b's dimensions: its 7168-wide "
                         "experts, shared expert, 3 dense first layers, sigmoid group-limited routing and "
                         "multi-head latent attention are not represented"],
}

# The config fields that name each dimension, in the order they are tried.
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_top_k", "moe_topk", "moe_k")
_HIDDEN = ("hidden_size", "d_model", "n_embd")
_LAYERS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
_HEADS = ("num_attention_heads", "n_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_VOCAB = ("vocab_size", "padded_vocab_size")
_EPS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")
#: the most decoder layers a config may give: the MoE layers are found by walking every index, and a
#: count of a billion (a typo) held the process until the OOM killer ended it
MAX_DECODER_LAYERS = 1 << 20
#: model types whose router renormalises the top-k weights without a ``norm_topk_prob`` field
_RENORMALISING = ("mixtral", "gpt_oss", "phimoe", "minimax", "granitemoe")


def _pick(raw: dict[str, Any], fields: tuple[str, ...]) -> tuple[str, Any] | None:
    for f in fields:
        if raw.get(f) is not None:
            return f, raw[f]
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_int(origin: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShapeError(f"{origin}: {field} must be a positive integer, got {value!r}")
    return value


def _required_int(origin: str, raw: dict[str, Any], fields: tuple[str, ...], what: str) -> tuple[str, int]:
    got = _pick(raw, fields)
    if got is None:
        raise ShapeError(f"{origin}: no {what} (looked for {' / '.join(fields)})")
    return got[0], _positive_int(origin, got[0], got[1])


def _number(origin: str, raw: dict[str, Any], fields: tuple[str, ...], default: float, what: str,
            notes: list[str]) -> float:
    got = _pick(raw, fields)
    if got is None:
        notes.append(f"{what} absent ({' / '.join(fields)}): {default:g}")
        return default
    if isinstance(got[1], bool) or not isinstance(got[1], (int, float)) or not math.isfinite(got[1]) or got[1] <= 0:
        raise ShapeError(f"{origin}: {got[0]} must be a positive number, got {got[1]!r}")
    return float(got[1])


def _refuse_outside(origin: str, field: str, indices: list[int], n_layers: int) -> None:
    """A ShapeError for layer indices outside the config's layers (else silently no layer of the
    model's: a list written for a config cut to fewer layers, say)."""
    outside = sorted({i for i in indices if not 0 <= i < n_layers})
    if outside:
        raise ShapeError(f"{origin}: {field} {outside} fall outside the model's {n_layers} decoder layers; "
                         f"expected layer indices from 0 to {n_layers - 1}")


#: The fields that say which decoder layers are MoE layers (:func:`_moe_layers`).
_MOE_LAYER_FIELDS = ("moe_layers", "is_moe_layer", "mlp_layer_types", "first_k_dense_replace", "moe_layer_freq",
                     "decoder_sparse_step", "mlp_only_layers", "interleave_moe_layer_step", "expert_layer_period",
                     "expert_layer_offset", "moe_layers_enum", "num_dense_layers")


def _own_moe_layers(origin: str, raw: dict[str, Any], n_layers: int) -> list[int] | None:
    """Step-3.5's and AFMoE's MoE layers (``moe_layers_enum``, ``num_dense_layers``, or mlx-lm's
    defaults for them); None for any other model type."""
    if raw.get("model_type") == "step3p5":
        enum = raw.get("moe_layers_enum")
        if enum is None:
            return list(range(1, n_layers))  # mlx-lm's step3p5 default
        try:
            listed = [int(i) for i in str(enum).strip().split(",")] if isinstance(enum, str) else None
        except ValueError:
            listed = None
        if listed is None:
            raise ShapeError(f"{origin}: moe_layers_enum must be a comma-separated list of layer indices, "
                             f"got {enum!r}")
        _refuse_outside(origin, "moe_layers_enum", listed, n_layers)
        return sorted(set(listed))
    if raw.get("model_type") == "afmoe":
        dense_first = raw.get("num_dense_layers", 2)  # mlx-lm's afmoe default
        if isinstance(dense_first, bool) or not isinstance(dense_first, int) or dense_first < 0:
            raise ShapeError(f"{origin}: num_dense_layers must be a non-negative integer, got {dense_first!r}")
        return list(range(dense_first, n_layers))
    return None


def _moe_layers(origin: str, raw: dict[str, Any], n_layers: int) -> list[int]:
    """The indices of the model's MoE decoder layers: an explicit ``moe_layers`` list (Llama 4), else
    DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq``, Qwen-MoE's ``decoder_sparse_step`` /
    ``mlp_only_layers``, Llama 4's ``interleave_moe_layer_step``, Jamba's ``expert_layer_period`` /
    ``expert_layer_offset``, ERNIE 4.5's ``moe_layer_start_index`` / ``moe_layer_end_index`` /
    ``moe_layer_interval``, EXAONE-MoE's ``is_moe_layer`` (one flag per layer), Laguna's
    ``mlp_layer_types`` (``"dense"`` or ``"sparse"`` per layer; without it a dense first layer, as
    mlx-lm builds one), MiMo-V2-Flash's ``moe_layer_freq`` as a list of per-layer flags, Step-3.5's
    ``moe_layers_enum`` (a comma-separated list of indices; without it every layer but the first, as
    mlx-lm builds them), AFMoE's ``num_dense_layers`` (dense first layers); every layer where none is
    given."""
    own = _own_moe_layers(origin, raw, n_layers)
    if own is not None:
        return own
    freq_flags = raw.get("moe_layer_freq")
    if isinstance(freq_flags, list):
        # MiMo-V2-Flash's moe_layer_freq is one flag per layer (1: MoE), not a period.
        if (not all(isinstance(f, int) and not isinstance(f, bool) and f in (0, 1) for f in freq_flags)
                or len(freq_flags) < n_layers):
            raise ShapeError(f"{origin}: moe_layer_freq must be a positive integer or a list of {n_layers} flags "
                             f"(1 for an MoE layer, 0 for a dense one), got {freq_flags!r}")
        return [i for i in range(n_layers) if freq_flags[i] == 1]
    kinds = raw.get("mlp_layer_types")
    if kinds is None and raw.get("model_type") == "laguna":
        kinds = ["dense"] + ["sparse"] * (n_layers - 1)  # mlx-lm's laguna default
    if kinds is not None:
        if not isinstance(kinds, list) or not all(k in ("dense", "sparse") for k in kinds) or len(kinds) < n_layers:
            raise ShapeError(f"{origin}: mlp_layer_types must be a list of {n_layers} \"dense\" or \"sparse\", one "
                             f"per decoder layer, got {kinds!r}")
        return [i for i in range(n_layers) if kinds[i] == "sparse"]
    flags = raw.get("is_moe_layer")
    if flags is not None:
        # EXAONE-MoE's decoder builds layer i as MoE where flag i is true.
        if not isinstance(flags, list) or not all(isinstance(f, bool) for f in flags) or len(flags) < n_layers:
            raise ShapeError(f"{origin}: is_moe_layer must be a list of {n_layers} true/false flags, one per "
                             f"decoder layer, got {flags!r}")
        return [i for i in range(n_layers) if flags[i]]
    listed = raw.get("moe_layers")
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
            raise ShapeError(f"{origin}: moe_layers must be a list of layer indices, got {listed!r}")
        _refuse_outside(origin, "moe_layers", listed, n_layers)
        return sorted(set(listed))
    # The least value of each field: a count of layers may be 0; a period (a MoE layer every that
    # many layers) may not, where the model's own code divides by it (0 was read as absent).
    least = {"first_k_dense_replace": 0, "moe_layer_freq": 1, "decoder_sparse_step": 1,
             "interleave_moe_layer_step": 1, "expert_layer_period": 1, "expert_layer_offset": 0,
             "moe_layer_interval": 1}
    # ERNIE 4.5's range of MoE layers: an index, or per modality a list of them (mlx-lm takes the
    # least start and the greatest end)
    bounds = {}
    for field, pick in (("moe_layer_start_index", min), ("moe_layer_end_index", max)):
        value = raw.get(field)
        values = value if isinstance(value, list) and value else [value]
        if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ShapeError(f"{origin}: {field} must be a layer index or a list of them, got {value!r}")
        bounds[field] = None if value is None else pick(values)
    ints = {f: raw.get(f) for f in least}
    for field, value in ints.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least[field]):
            what = ("a non-negative integer" if least[field] == 0 else
                    "a positive integer (a MoE layer every that many layers)")
            raise ShapeError(f"{origin}: {field} must be {what}, got {value!r}")
    only_mlp = raw.get("mlp_only_layers") or []
    if not isinstance(only_mlp, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only_mlp):
        raise ShapeError(f"{origin}: mlp_only_layers must be a list of layer indices, got {only_mlp!r}")
    _refuse_outside(origin, "mlp_only_layers", only_mlp, n_layers)
    first_dense = ints["first_k_dense_replace"] or 0
    freq = ints["moe_layer_freq"] or 1
    step = ints["decoder_sparse_step"] or ints["interleave_moe_layer_step"] or 1
    period, offset = ints["expert_layer_period"] or 1, ints["expert_layer_offset"] or 0
    interval = ints["moe_layer_interval"] or 1
    start = bounds["moe_layer_start_index"] or 0
    end = n_layers - 1 if bounds["moe_layer_end_index"] is None else bounds["moe_layer_end_index"]
    return [i for i in range(n_layers) if i >= first_dense and i % freq == 0 and (i + 1) % step == 0
            and i % period == offset % period and i not in only_mlp and (i + 1) % interval == 0
            and start <= i <= end]


#: per-model scalings a qwen3_moe leaves out (Granite's; each 1 where the model does not scale)
_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _unrepresented(raw: dict[str, Any], model_type: str, f_field: str, n_layers: int, n_moe: int,
                   head_dim: int) -> list[str]:
    """The notes on what a qwen3_moe of ``raw``'s dimensions leaves out of the model."""
    notes: list[str] = []
    if model_type != "qwen3_moe":
        notes.append(f"built as a qwen3_moe of these dimensions (per-head q/k norms, no biases), "
                     f"not as model_type {model_type!r}")
    if f_field in ("intermediate_size", "ffn_hidden_size") and model_type != "qwen3_moe":
        notes.append(f"expert intermediate size from {f_field} (every FFN of this architecture is an expert)")
    if n_moe < n_layers:
        notes.append(f"{n_layers - n_moe} dense decoder layer(s) of the {n_layers} not represented: "
                     f"{n_moe} MoE layers built")
    shared = [(f, raw[f]) for f in ("n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size",
                                    "moe_shared_expert_intermediate_size", "shared_intermediate_size") if raw.get(f)]
    if shared:
        notes.append("shared expert(s) not represented (" + ", ".join(f"{f} {v}" for f, v in shared) + ")")
    routing = [(f, raw[f]) for f in ("scoring_func", "topk_method") if raw.get(f) not in (None, "softmax", "greedy")]
    routing += [(f, raw[f]) for f in ("n_group", "topk_group") if isinstance(raw.get(f), int) and raw[f] > 1]
    if raw.get("routed_scaling_factor") not in (None, 1, 1.0):
        routing.append(("routed_scaling_factor", raw["routed_scaling_factor"]))
    if routing:
        notes.append("routing built as softmax top-k: " + ", ".join(f"{f} {v}" for f, v in routing) +
                     " not represented")
    if raw.get("kv_lora_rank"):
        notes.append(f"multi-head latent attention (kv_lora_rank {raw['kv_lora_rank']}) built as standard "
                     f"attention of head_dim {head_dim}")
    if raw.get("sliding_window") and raw.get("use_sliding_window") is not False:  # Qwen's configs switch it off
        notes.append(f"sliding-window attention (sliding_window {raw['sliding_window']}) not represented")
    kinds = raw.get("layer_types")
    if isinstance(kinds, list) and len(set(map(str, kinds))) > 1:
        notes.append(f"per-layer attention types ({', '.join(sorted(set(map(str, kinds))))}) not represented: "
                     f"every layer is full attention")
    interval = raw.get("full_attention_interval")  # Qwen3-Next: linear attention between full-attention layers
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 1:
        notes.append(f"linear-attention layers (full_attention_interval {interval}: one layer in {interval} is full "
                     f"attention) not represented: every layer is full attention")
    rotary = raw.get("partial_rotary_factor")
    if rotary is not None and rotary != 1:
        notes.append(f"partial rotary embeddings (partial_rotary_factor {rotary}) not represented")
    notes += _gpt_oss_notes(raw, model_type)
    biases = [f for f in ("attention_bias", "qkv_bias", "mlp_bias", "lm_head_bias") if raw.get(f)]
    if biases or model_type == "qwen2_moe":
        notes.append("biases not represented (" + (", ".join(biases) or "qwen2_moe's q/k/v biases") + ")")
    if raw.get("rope_scaling"):
        notes.append(f"rope_scaling {json.dumps(raw['rope_scaling'], sort_keys=True)} not represented")
    # Granite's scalings of the embeddings, residuals, attention scores and logits
    scaled = [(f, raw[f]) for f in _MULTIPLIERS if raw.get(f) is not None and raw[f] != 1]
    if scaled:
        notes.append("scaling multipliers not represented (" + ", ".join(f"{f} {v}" for f, v in scaled) + ")")
    if raw.get("clip_qkv"):
        notes.append(f"clip_qkv {raw['clip_qkv']} not represented")
    if raw.get("tie_word_embeddings"):
        notes.append("tied embeddings built untied")
    for field in ("quantization_config", "quantization"):  # Hugging Face's, mlx-lm's
        q = raw.get(field)
        if not q:
            continue
        q = q if isinstance(q, dict) else {}
        what = q.get("quant_method") or (f"{q['bits']}-bit, group {q.get('group_size')}" if q.get("bits") else field)
        notes.append(f"the model's own quantization ({what}) replaced by the bench's 4-bit affine")
        break
    return notes


def _gpt_oss_notes(raw: dict[str, Any], model_type: str) -> list[str]:
    """The notes on gpt-oss's attention sinks and its experts' activation and biases."""
    notes = []
    if model_type == "gpt_oss" or raw.get("attention_sinks"):
        notes.append("attention sinks not represented")
    if model_type == "gpt_oss" or raw.get("swiglu_limit") is not None:
        # gpt-oss's experts compute their own activation and carry biases whatever the config's fields say
        limit = f" at swiglu_limit {raw['swiglu_limit']}" if raw.get("swiglu_limit") is not None else ""
        notes.append(f"the experts' clamped SwiGLU (gate and up clamped{limit}, the gate's sigmoid scaled, up + 1) "
                     f"built as SiLU SwiGLU, and the experts' and router's biases not represented")
    return notes


def _flatten(raw: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """``raw`` with per-layer lists of an MoE dimension (Hunyuan's ``moe_topk``, ``moe_intermediate_size``)
    made one value, the largest (noted when they differ), and ``rope_theta`` taken from
    ``rope_parameters`` where only that holds it."""
    raw = dict(raw)
    for field in (*_EXPERTS, *_TOP_K, "moe_intermediate_size", "expert_intermediate_size", "intermediate_size"):
        value = raw.get(field)
        if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raw[field] = max(value)
            if min(value) != max(value):
                notes.append(f"{field} varies per layer ({min(value)} to {max(value)}): built with {max(value)} "
                             f"in every layer")
    params = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and isinstance(params, dict) and params.get("rope_theta") is not None:
        raw["rope_theta"] = params["rope_theta"]
    if isinstance(params, dict) and params.get("rope_type") not in (None, "default") and not raw.get("rope_scaling"):
        raw["rope_scaling"] = params
    return raw


def qwen3_moe_config(raw: dict[str, Any], origin: str = "config.json") -> tuple[dict[str, Any], list[str]]:
    """(the qwen3_moe config built for ``raw``, the notes on what it does not represent) from a
    Hugging Face model config (``origin`` names it in errors). A multimodal config's ``text_config``
    is read when the top level has no expert count. Raises :class:`ShapeError` naming the field for
    a config that is not a mixture of experts or has a missing or bad dimension."""
    if not isinstance(raw, dict):
        raise ShapeError(f"{origin}: a model config is a JSON object, got {type(raw).__name__}")
    notes: list[str] = []
    if _pick(raw, _EXPERTS) is None and isinstance(raw.get("text_config"), dict):
        raw = raw["text_config"]
        origin = f"{origin} (text_config)"
        notes.append("read from the config's text_config")
    if _pick(raw, _EXPERTS) is None and isinstance(raw.get("ffn_config"), dict):  # DBRX nests its MoE fields
        attn: dict[str, Any] = raw["attn_config"] if isinstance(raw.get("attn_config"), dict) else {}
        raw = {**raw, **raw["ffn_config"], **{k: v for k, v in (("num_key_value_heads", attn.get("kv_n_heads")),
                                                                  ("rope_theta", attn.get("rope_theta"))) if v}}
        notes.append("MoE fields read from the config's ffn_config (attn_config: KV heads, rope_theta)")
    raw = _flatten(raw, notes)
    model_type = str(raw.get("model_type") or "unknown")
    got = _pick(raw, _EXPERTS)
    if got is None or got[1] == 0:
        why = f"{got[0]} is 0" if got else "no " + " / ".join(_EXPERTS[:3])
        raise ShapeError(f"{origin}: not a mixture-of-experts config: {why}")
    n_experts = _positive_int(origin, got[0], got[1])
    k_field, top_k = _required_int(origin, raw, _TOP_K, "experts per token")
    if top_k > n_experts:
        raise ShapeError(f"{origin}: {k_field} {top_k} exceeds {got[0]} {n_experts}")
    got_f = _pick(raw, ("moe_intermediate_size", "expert_intermediate_size"))
    if got_f is None:
        f_field, ffn = _required_int(origin, raw, ("intermediate_size", "ffn_hidden_size"),
                                     "expert intermediate size")
    else:
        f_field, ffn = got_f[0], _positive_int(origin, got_f[0], got_f[1])
    _, hidden = _required_int(origin, raw, _HIDDEN, "hidden size")
    l_field, n_layers = _required_int(origin, raw, _LAYERS, "decoder layer count")
    if n_layers > MAX_DECODER_LAYERS:
        raise ShapeError(f"{origin}: {l_field} must be at most {MAX_DECODER_LAYERS}, got {n_layers}")
    h_field, heads = _required_int(origin, raw, _HEADS, "attention head count")
    got_kv = _pick(raw, _KV_HEADS)
    kv_heads = heads if got_kv is None else _positive_int(origin, got_kv[0], got_kv[1])
    if heads % kv_heads:
        raise ShapeError(f"{origin}: {h_field} {heads} is not a multiple of {got_kv[0] if got_kv else ''} {kv_heads}")
    if raw.get("head_dim") is not None:
        head_dim = _positive_int(origin, "head_dim", raw["head_dim"])
    elif hidden % heads:
        raise ShapeError(f"{origin}: no head_dim, and hidden size {hidden} is not a multiple of {h_field} {heads}")
    else:
        head_dim = hidden // heads
    _, vocab = _required_int(origin, raw, _VOCAB, "vocabulary size")
    theta = _number(origin, raw, ("rope_theta",), 10000.0, "rope_theta", notes)
    eps = _number(origin, raw, _EPS, 1e-6, "norm eps", notes)
    norm_topk = raw.get("norm_topk_prob")
    if norm_topk is None:
        norm_topk = model_type in _RENORMALISING
    elif not isinstance(norm_topk, bool):
        raise ShapeError(f"{origin}: norm_topk_prob must be true or false, got {norm_topk!r}")
    moe = _moe_layers(origin, raw, n_layers)
    if not moe:
        given = [f"{f} {json.dumps(raw[f])}" for f in _MOE_LAYER_FIELDS
                 if raw.get(f) is not None and (raw[f] != [] or f == "moe_layers")]
        raise ShapeError(f"{origin}: no MoE layer among the {n_layers} of {l_field}: its {', '.join(given)} "
                         f"leave{'s' if len(given) == 1 else ''} none (a shape streams the experts of MoE layers)")
    max_pos = raw.get("max_position_embeddings")
    config = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": len(moe),
        # The dense MLP size: unused (every layer is MoE), kept so a qwen3_moe config reads back unchanged.
        "intermediate_size": dense if got_f is not None and _is_count(dense := raw.get("intermediate_size")) else ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": n_experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": ffn,
        "rms_norm_eps": eps,
        "vocab_size": vocab,
        "rope_theta": theta,
        "tie_word_embeddings": False,
        "max_position_embeddings": max_pos if _is_count(max_pos) else 4096,
        "norm_topk_prob": norm_topk,
        "bos_token_id": ByteTokenizer.BOS,
        "eos_token_id": ByteTokenizer.EOS,
        "torch_dtype": "float32",
    }
    notes += _unrepresented(raw, model_type, f_field, n_layers, len(moe), head_dim)
    return config, notes


@dataclass(frozen=True)
class ShapeSource:
    """A resolved shape: ``name`` (the preset's, or a label from the config's path), the qwen3_moe
    ``config`` built, the ``notes`` on what it does not represent, the ``source`` config.json (None
    for a preset) and the quantization ``group_size`` its dimensions allow."""

    name: str
    config: dict[str, Any]
    notes: tuple[str, ...]
    source: str | None = None
    group_size: int = 64


#: the group size mlx-lm's qwen3_moe quantizes its router (``mlp.gate``, 8 bits) in, whatever group
#: the other matrices take: the hidden size, the router's input width, must be a multiple of it
ROUTER_GROUP_SIZE = 64


def _group_size(config: dict[str, Any], origin: str) -> int:
    """The largest of MLX's group sizes dividing every quantized matrix's input width; a
    :class:`ShapeError` naming each width that no group size divides, or that the router's breaks."""
    widths = {"hidden_size": config["hidden_size"], "moe_intermediate_size": config["moe_intermediate_size"],
              "num_attention_heads x head_dim": config["num_attention_heads"] * config["head_dim"]}
    if config["hidden_size"] % ROUTER_GROUP_SIZE == 0:
        for g in (64, 32):
            if all(w % g == 0 for w in widths.values()):
                return g
    router = config["hidden_size"] % ROUTER_GROUP_SIZE != 0
    bad = ", ".join(f"{k} {v}" for k, v in widths.items() if v % 32 or (router and k == "hidden_size"))
    need = (f" and hidden_size a multiple of {ROUTER_GROUP_SIZE} (the router's input width: mlx-lm's qwen3_moe "
            f"quantizes the router at 8 bits in groups of {ROUTER_GROUP_SIZE})" if router else "")
    raise ShapeError(f"{origin}: 4-bit quantization needs widths that are multiples of 32{need}: {bad}")


def config_shape(path: str | os.PathLike[str]) -> ShapeSource:
    """The shape of a Hugging Face ``config.json`` (or of a directory holding one); see
    :func:`qwen3_moe_config`. Raises :class:`ShapeError` naming the file."""
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ShapeError(f"{p}: no such config file (a shape is one of {sorted(SHAPES)}, a Hugging Face "
                         f"config.json or a directory holding one, or a Hugging Face repo id org/name)")
    try:
        raw = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShapeError(f"{p}: not a JSON config: {exc}") from None
    except ValueError:  # json's own ValueError: an integer of more digits than int() converts
        raise ShapeError(f"{p}: not a JSON config this reader takes: an integer of more than "
                         f"{sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise ShapeError(f"{p}: not a JSON config this reader takes: nested too deeply") from None
    except OSError as exc:
        raise ShapeError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    config, notes = qwen3_moe_config(raw, str(p))
    label = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.")[:48] or "config"
    return ShapeSource(name=label, config=config, notes=tuple(notes), source=str(p.resolve()),
                       group_size=_group_size(config, str(p)))


def _looks_like_path(shape: str) -> bool:
    return "/" in shape or os.sep in shape or shape.endswith(".json") or shape.startswith((".", "~"))


def _hub_config(repo_id: str) -> pathlib.Path:
    """The ``config.json`` of Hugging Face repo ``repo_id`` (only that file): the local cache first,
    then a download unless ``HF_HUB_OFFLINE`` is set. :class:`ShapeError` naming the id otherwise."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    from ..hub import _hub_cache, _offline

    cache = _hub_cache()
    try:
        return pathlib.Path(hf_hub_download(repo_id, "config.json", cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if _offline():
        raise ShapeError(f"{repo_id}: not a local path, and its config.json is not in the local Hugging Face cache "
                         f"({cache}) with HF_HUB_OFFLINE set") from None
    try:
        return pathlib.Path(hf_hub_download(repo_id, "config.json", cache_dir=cache))
    except EntryNotFoundError as exc:
        if not isinstance(exc, LocalEntryNotFoundError):  # which derives from it: the Hub was not reached
            raise ShapeError(f"{repo_id}: the Hugging Face repo has no config.json") from None
        raise ShapeError(f"{repo_id}: not a local path, and its config.json could not be fetched from the Hugging "
                         f"Face Hub ({type(exc).__name__}: {exc})") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ShapeError(f"{repo_id}: not a local path, and its config.json could not be fetched from the Hugging "
                         f"Face Hub ({type(exc).__name__}: {exc})") from None


def describe_shape(shape: str | os.PathLike[str]) -> ShapeSource:
    """The shape named ``shape``: a key of :data:`SHAPES`, a config.json path (:func:`config_shape`),
    or a Hugging Face repo id ``org/name`` that is not a local path (its config.json alone is
    fetched, the local cache first; the shape is named after the repo)."""
    from ..hub import is_repo_id

    text = os.fspath(shape)
    if text in SHAPES:
        return ShapeSource(name=text, config=SHAPES[text], notes=tuple(PRESET_NOTES.get(text, ())))
    if not os.path.exists(os.path.expanduser(text)) and is_repo_id(text):
        src = config_shape(_hub_config(text))
        return dataclasses.replace(src, name=re.sub(r"[^A-Za-z0-9._-]+", "-", text.split("/")[1])[:48],
                                   source=f"{text} ({src.source})")
    if _looks_like_path(text) or os.path.exists(text):
        return config_shape(text)
    raise ShapeError(f"unknown shape {text!r}; known shapes: {sorted(SHAPES)}, or the path of a Hugging Face "
                     f"config.json")


def parse_shape_list(text: str) -> list[tuple[str, int | None]]:
    """``--shapes``: comma-separated ``SHAPE[:LAYERS]`` (SHAPE a name or a config.json path) as
    (shape, layers or None). Raises :class:`ShapeError` for an empty entry or a bad layer count."""
    out: list[tuple[str, int | None]] = []
    for part in text.split(","):
        part = part.strip()
        shape, sep, layers = part.rpartition(":")
        shape, layers = shape.strip(), layers.strip()  # "config.json: 2" as "config.json:2"
        # ASCII digits only: str.isdigit takes superscripts ("²"), which int() does not
        count = layers.isascii() and layers.isdigit()
        if not sep:
            shape, layers = part, ""
        elif not count and os.path.exists(part):  # a path holding ':' and no layer count
            shape, sep, layers = part, "", ""
        if not shape:
            raise ShapeError(f"--shapes: empty shape in {text!r} (expected NAME[:LAYERS] or CONFIG.json[:LAYERS], "
                             f"comma-separated)")
        if sep and (not count or int(layers) < 1):  # "NAME:" too: a count forgotten is not "all"
            raise ShapeError(f"--shapes: {part!r}: LAYERS must be a positive integer, got {layers!r}")
        out.append((shape, int(layers) if layers else None))
    return out


for _name, _raw in HF_PRESETS.items():
    SHAPES[_name], PRESET_NOTES[_name] = qwen3_moe_config(_raw, f"the {_name} preset")

READY_FILE = "READY"
BUILD_FILE = "asyncside_shape.json"


def shape_spec(name: str | os.PathLike[str], *, layers: int | None = None, vocab: int | None = None) -> Any:
    """The :class:`~asyncside.models.embedded.EmbeddedSpec` of shape ``name`` (a name of :data:`SHAPES`
    or a config.json path); :class:`ShapeError` naming the choices for an unknown name, the file and
    field for a bad config, or the bad layer count / vocabulary."""
    from ..models.embedded import EmbeddedSpec

    src = describe_shape(name)
    config = dict(src.config)
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= config["num_hidden_layers"]:
            raise ShapeError(f"--layers must be an integer in [1, {config['num_hidden_layers']}] for {src.name} "
                             f"(its MoE layers; SHAPE:N in --shapes), got {layers!r}")
        config["num_hidden_layers"] = layers
    if vocab is not None:
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < LEAST_VOCAB:
            raise ShapeError(f"--vocab must be an integer >= {LEAST_VOCAB} (the byte tokenizer's tokens), 'small' or "
                             f"'full', "
                             f"got {vocab!r}")
        config["vocab_size"] = vocab
    elif config["vocab_size"] < LEAST_VOCAB:
        raise ShapeError(f"{src.source or src.name}: vocab_size {config['vocab_size']} is below the byte tokenizer's "
                         f"{LEAST_VOCAB} tokens (--vocab small or a number)")
    if src.group_size == 64:  # the default: the presets' cache keys stay the same
        return EmbeddedSpec(config=config, resident_fraction=0.25)
    return EmbeddedSpec(config=config, resident_fraction=0.25, group_size=src.group_size)


def estimate_bytes(spec: Any) -> dict[str, int]:
    """Bytes of the built store: experts and the rest (embedding, head, attention), approximately;
    ``build_memory``: what the build holds in memory at its peak (the quantized model whole, one
    layer's float experts as they are generated, the float embedding and head)."""
    c = spec.config
    d, f, e, v = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["vocab_size"]
    dsize = 2 if spec.dtype in ("bfloat16", "float16") else 4

    def q(rows: int, cols: int, bits: int = spec.bits) -> int:  # a quantized matrix with scales and biases
        return rows * cols * bits // 8 + 2 * rows * (cols // spec.group_size) * dsize

    record = 3 * q(f, d)
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attn = q(heads * hd, d) + 2 * q(kv * hd, d) + q(d, heads * hd) + q(e, d, 8)
    layers = c["num_hidden_layers"]
    experts, non_expert = layers * e * record, 2 * q(v, d) + layers * attn
    return {"record": record, "experts": experts, "non_expert": non_expert,
            "build_memory": experts + non_expert + 3 * e * f * d * 4 + 2 * v * d * 4}


class ShapeBuild(dict):  # type: ignore[type-arg]
    """What :func:`ensure_shape` returns: ``store`` (path) and the build's figures (``built``: whether
    this call built it, ``build_seconds``, ``store_bytes``, the spec), ``shape`` (the name, or the
    config's label), ``source`` (the config.json, or None), ``built_as`` (what the weights are) and
    ``note`` (what the build does not represent of the source, ``"; "``-separated; empty if nothing)."""


class ShapeTooLargeError(AsyncsideError, OSError):
    """The disk or the memory cannot hold a shape's build (the message names the directory or the
    memory's source, the bytes needed and free, and the way out: fewer layers)."""


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _disk_need(est: dict[str, int]) -> int:
    """The disk a build needs: the model directory and the store exist side by side until the
    conversion ends."""
    return int(2.1 * (est["experts"] + est["non_expert"]))


def _fewer(name: str | os.PathLike[str], vocab: int | None, cfg: dict[str, Any],
           fits: Callable[[dict[str, int]], bool]) -> str:
    """What a refused build can do instead: the most MoE layers whose estimate ``fits``, or that
    even one layer does not (its experts alone are too large)."""
    best = 0
    for n in range(1, int(cfg["num_hidden_layers"])):
        if not fits(estimate_bytes(shape_spec(name, layers=n, vocab=vocab))):
            break  # the estimates grow with the layers
        best = n
    if best:
        return f"fewer layers: --layers {best} or fewer"
    one_spec = shape_spec(name, layers=1, vocab=vocab)
    # No layer and no expert (whose float weights a build generates a layer at a time): the
    # embedding and the LM head, which the vocabulary sizes
    bare = estimate_bytes(dataclasses.replace(one_spec, config={**one_spec.config, "num_hidden_layers": 0,
                                                                "num_experts": 0}))
    if not fits(bare):
        c = one_spec.config
        return (f"the vocabulary alone does not fit: the embedding and LM head of vocab_size {c['vocab_size']} x "
                f"hidden {c['hidden_size']} are {bare['non_expert'] / 1e9:.1f} GB, "
                f"{bare['build_memory'] / 1e9:.1f} GB held while building them; a smaller --vocab (small: "
                f"{SMALL_VOCAB})")
    one = estimate_bytes(one_spec)
    return (f"even one layer does not fit: {one['experts'] / 1e9:.1f} GB of experts, {one['build_memory'] / 1e9:.1f} "
            f"GB held while building it")


def ensure_shape(name: str | os.PathLike[str], *, layers: int | None = None, vocab: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> ShapeBuild:
    """The expert store of shape ``name`` (a name of :data:`SHAPES` or a config.json path; see the
    module docstring), building it on first use.

    Refuses (:class:`ShapeTooLargeError`, an OSError naming the directory or the memory, the bytes
    needed and free) when the disk or the memory cannot hold the build. Concurrent callers wait on a
    file lock; a half-built directory is never visible.
    """
    from mlx_lm.utils import save_config, save_model

    from ..memory import available_memory
    from ..models.convert import OWNER_FILE, convert_model, owner_line, profile_routing
    from ..models.embedded import (
        PROFILE_PROMPTS,
        build_is_current,
        build_model,
        cache_root,
        publish_build,
        ready_marker,
        remove_stale_builds,
    )

    src = describe_shape(name)
    spec = shape_spec(name, layers=layers, vocab=vocab)
    cfg = spec.config
    # Who asked, not who built: the same effective config reached from another file shares the store.
    about = {"shape": src.name, "source": src.source,
             "built_as": f"qwen3_moe ({cfg['num_hidden_layers']} MoE "
                         f"layer{'s' if cfg['num_hidden_layers'] != 1 else ''} x {cfg['num_experts']} experts "
                         f"top-{cfg['num_experts_per_tok']}, hidden {cfg['hidden_size']}, expert intermediate "
                         f"{cfg['moe_intermediate_size']}; asyncside's seeded construction)",
             "note": "; ".join(src.notes)}
    root = cache_root(cache_dir)
    tag = f"shape-{src.name}-L{cfg['num_hidden_layers']}-V{cfg['vocab_size']}-{spec.key()}"
    final = root / tag
    if build_is_current(final, spec):
        info = json.loads((final / BUILD_FILE).read_text())
        return ShapeBuild(info, **about, store=final / "store", built=False)
    remove_stale_builds(root)  # killed builds' halves: before the disk check counts them as used
    with _file_lock(root / f".{tag}.lock"):
        if build_is_current(final, spec):
            info = json.loads((final / BUILD_FILE).read_text())
            return ShapeBuild(info, **about, store=final / "store", built=False)
        if (final / READY_FILE).is_file() and progress:
            print(f"[shapes] {final}: built by older code whose weights of this shape differ "
                  f"(models.embedded.BUILD_VERSION): rebuilding it", file=sys.stderr, flush=True)
        if final.exists() and not build_is_current(final, spec):
            # A leftover without READY, or built by older code unlike this one: never trusted. Asked
            # again: where the filesystem takes no locks, another process may have just built it.
            shutil.rmtree(final)
        est = estimate_bytes(spec)
        layer_count = f"{cfg['num_hidden_layers']} layer{'s' if cfg['num_hidden_layers'] != 1 else ''}"
        free = shutil.disk_usage(root).free
        if free < _disk_need(est):
            raise ShapeTooLargeError(f"{root}: building shape {src.name} with {layer_count} needs "
                                     f"about {_disk_need(est) / 1e9:.1f} GB free while it builds, {free / 1e9:.1f} GB "
                                     f"are free ({_fewer(name, vocab, cfg, lambda e: _disk_need(e) <= free)})")
        room = available_memory()
        if room.available < est["build_memory"]:
            raise ShapeTooLargeError(f"building shape {src.name} with {layer_count} holds about "
                                     f"{est['build_memory'] / 1e9:.1f} GB in memory, {room.available / 1e9:.1f} GB "
                                     f"are available ({room.source}) "
                                     f"({_fewer(name, vocab, cfg, lambda e: e['build_memory'] <= room.available)})")
        t0 = time.perf_counter()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=root))
        try:
            # Who builds it, for a filesystem that takes no locks (remove_stale_builds).
            (tmp / OWNER_FILE).write_text(owner_line(), encoding="utf-8")
            model, mcfg = build_model(spec)
            model_dir = tmp / "model"
            save_model(model_dir, model)
            save_config(dict(mcfg), model_dir / "config.json")
            tok = ByteTokenizer(cfg["vocab_size"])
            tok.save(model_dir)
            prompts = [tok.encode(p) for p in PROFILE_PROMPTS]
            prof = profile_routing(model, mcfg, prompts, max_tokens=spec.profile_tokens, source="embedded prompts")
            del model
            convert_model(model_dir, tmp / "store", profile=prof, resident_fraction=spec.resident_fraction,
                          progress=progress, model_id=f"asyncside-shape-{src.name}-L{cfg['num_hidden_layers']}"
                                                        f"-V{cfg['vocab_size']}-{spec.key()[:8]}")
            shutil.rmtree(model_dir)  # the store holds everything the bench loads
            info = {**about, "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"],
                    "build_seconds": round(time.perf_counter() - t0, 1), "store_bytes": _dir_bytes(tmp / "store"),
                    "estimate": est, "spec": asdict(spec)}
            (tmp / BUILD_FILE).write_text(json.dumps(info, indent=1) + "\n")
            (tmp / READY_FILE).write_text(ready_marker(spec))
            if not publish_build(tmp, final, spec):  # a rival's build of the same spec kept
                info = json.loads((final / BUILD_FILE).read_text())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ShapeBuild(info, store=final / "store", built=True)
