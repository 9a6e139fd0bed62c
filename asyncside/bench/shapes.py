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
(built in a temporary directory and renamed into place, under a file lock). Building needs
twice the store's size on disk while it runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import asdict
from typing import Any

from ..models.embedded import _file_lock
from ..models.tokenizer import ByteTokenizer

__all__ = ["SHAPES", "SMALL_VOCAB", "ShapeBuild", "ensure_shape", "estimate_bytes", "shape_spec"]

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

#: ``--vocab small``: the embedded model's vocabulary size
SMALL_VOCAB = 512
READY_FILE = "READY"
BUILD_FILE = "asyncside_shape.json"


def shape_spec(name: str, *, layers: int | None = None, vocab: int | None = None) -> Any:
    """The :class:`~asyncside.models.embedded.EmbeddedSpec` of shape ``name`` (ValueError naming the
    choices for an unknown name or a bad layer count / vocabulary)."""
    from ..models.embedded import EmbeddedSpec

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {sorted(SHAPES)}")
    config = dict(SHAPES[name])
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= config["num_hidden_layers"]:
            raise ValueError(f"--layers must be an integer in [1, {config['num_hidden_layers']}] for {name}, "
                             f"got {layers!r}")
        config["num_hidden_layers"] = layers
    if vocab is not None:
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 258:
            raise ValueError(f"--vocab must be an integer >= 258 (the byte tokenizer's tokens), 'small' or 'full', "
                             f"got {vocab!r}")
        config["vocab_size"] = vocab
    return EmbeddedSpec(config=config, resident_fraction=0.25)


def estimate_bytes(spec: Any) -> dict[str, int]:
    """Bytes of the built store: experts and the rest (embedding, head, attention), approximately."""
    c = spec.config
    d, f, e, v = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["vocab_size"]
    dsize = 2 if spec.dtype in ("bfloat16", "float16") else 4

    def q(rows: int, cols: int, bits: int = spec.bits) -> int:  # a quantized matrix with scales and biases
        return rows * cols * bits // 8 + 2 * rows * (cols // spec.group_size) * dsize

    record = 3 * q(f, d)
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attn = q(heads * hd, d) + 2 * q(kv * hd, d) + q(d, heads * hd) + q(e, d, 8)
    layers = c["num_hidden_layers"]
    return {"record": record, "experts": layers * e * record, "non_expert": 2 * q(v, d) + layers * attn}


class ShapeBuild(dict):  # type: ignore[type-arg]
    """What :func:`ensure_shape` returns: ``store`` (path) and the build's figures
    (``built``: whether this call built it, ``build_seconds``, ``store_bytes``, the spec)."""


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ensure_shape(name: str, *, layers: int | None = None, vocab: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> ShapeBuild:
    """The expert store of shape ``name`` (see the module docstring), building it on first use.

    Refuses (OSError naming the directory, the bytes needed and free) when the disk cannot hold
    the build. Concurrent callers wait on a file lock; a half-built directory is never visible.
    """
    from mlx_lm.utils import save_config, save_model

    from ..models.convert import convert_model, profile_routing
    from ..models.embedded import PROFILE_PROMPTS, build_model, cache_root

    spec = shape_spec(name, layers=layers, vocab=vocab)
    cfg = spec.config
    root = cache_root(cache_dir)
    tag = f"shape-{name}-L{cfg['num_hidden_layers']}-V{cfg['vocab_size']}-{spec.key()}"
    final = root / tag
    if (final / READY_FILE).is_file():
        info = json.loads((final / BUILD_FILE).read_text())
        return ShapeBuild(info, store=final / "store", built=False)
    with _file_lock(root / f".{tag}.lock"):
        if (final / READY_FILE).is_file():
            info = json.loads((final / BUILD_FILE).read_text())
            return ShapeBuild(info, store=final / "store", built=False)
        if final.exists():  # a leftover without READY: never trust it
            shutil.rmtree(final)
        est = estimate_bytes(spec)
        # The model directory and the store exist side by side until the conversion ends.
        need = int(2.1 * (est["experts"] + est["non_expert"]))
        free = shutil.disk_usage(root).free
        if free < need:
            raise OSError(f"{root}: building shape {name} with {cfg['num_hidden_layers']} layers needs about "
                          f"{need / 1e9:.1f} GB free while it builds, {free / 1e9:.1f} GB are free "
                          f"(fewer layers: --layers N)")
        t0 = time.perf_counter()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=root))
        try:
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
                          progress=progress, model_id=f"asyncside-shape-{name}-L{cfg['num_hidden_layers']}"
                                                        f"-V{cfg['vocab_size']}-{spec.key()[:8]}")
            shutil.rmtree(model_dir)  # the store holds everything the bench loads
            info = {"shape": name, "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"],
                    "build_seconds": round(time.perf_counter() - t0, 1), "store_bytes": _dir_bytes(tmp / "store"),
                    "estimate": est, "spec": asdict(spec)}
            (tmp / BUILD_FILE).write_text(json.dumps(info, indent=1) + "\n")
            (tmp / READY_FILE).write_text(spec.key() + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ShapeBuild(info, store=final / "store", built=True)
