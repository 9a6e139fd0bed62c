"""Device probe: is a quantized prefill of plain mlx-lm reproducible across evaluation boundaries?

Runs the same tiny Mixtral (4-bit, or float with `float`) twice: one whole-graph eval, and an eval
after every attention and MoE block, and prints whether the logits are equal and how far apart.
What it showed on MLX CPU and on MLX CUDA is in BENCHMARKS.md (the H200 section); it is why the
4-bit exactness tests skip on MLX CUDA. Usage (GPU machine):
`PYTHONPATH=/tmp/site:$PWD python3 tools/device/probe_pattern.py [float]`.
"""

import sys

sys.path.insert(0, "tests")
import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from _models_support import tiny_model

q = None if "float" in sys.argv else {"group_size": 64, "bits": 4}
model, config = tiny_model("mixtral", quantize=q)
prompt = mx.array([int(t) for t in np.random.default_rng(7).integers(0, config["vocab_size"], 40)])[None]
ref = model(prompt, cache=make_prompt_cache(model))
mx.eval(ref)


def pieces(sync: bool) -> mx.array:
    c = make_prompt_cache(model)
    inner = model.model
    h = inner.embed_tokens(prompt)
    mask = create_attention_mask(h, c[0])
    for layer, cache in zip(inner.layers, c):
        h = h + layer.self_attn(layer.input_layernorm(h), mask, cache)
        if sync:
            mx.eval(h)
        h = h + layer.block_sparse_moe(layer.post_attention_layernorm(h))
        if sync:
            mx.eval(h)
    out = model.lm_head(inner.norm(h))
    mx.eval(out)
    return out


for sync in (False, True):
    out = pieces(sync)
    print("quant" if q else "float", "pieces sync", sync, "equal to one-shot", mx.array_equal(out, ref).item(),
          "max", mx.max(mx.abs(out - ref)).item())
