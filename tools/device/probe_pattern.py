"""Device probe: is a quantized prefill of plain mlx-lm reproducible across evaluation boundaries?

Runs the same tiny Mixtral (4-bit, or float with `float`) twice: one whole-graph eval, and an eval
after every attention and MoE block. On MLX 0.32 CPU both match bit for bit; on MLX CUDA (H200,
2026-11-30) the quantized logits differ by up to 1.0 while float matches. Usage (GPU machine):
`PYTHONPATH=/tmp/site:$PWD python3 tools/device/probe_pattern.py [float]`.
"""
import sys
sys.path.insert(0, "tests")
import numpy as np, mlx.core as mx
from _models_support import tiny_model
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.base import create_attention_mask
q = None if "float" in sys.argv else {"group_size": 64, "bits": 4}
model, config = tiny_model("mixtral", quantize=q)
prompt = mx.array([int(t) for t in np.random.default_rng(7).integers(0, config["vocab_size"], 40)])[None]
ref = model(prompt, cache=make_prompt_cache(model)); mx.eval(ref)
def pieces(sync):
    c = make_prompt_cache(model)
    inner = model.model
    h = inner.embed_tokens(prompt)
    mask = create_attention_mask(h, c[0])
    for l, cc in zip(inner.layers, c):
        h = h + l.self_attn(l.input_layernorm(h), mask, cc)
        if sync: mx.eval(h)
        h = h + l.block_sparse_moe(l.post_attention_layernorm(h))
        if sync: mx.eval(h)
    out = model.lm_head(inner.norm(h)); mx.eval(out); return out
for sync in (False, True):
    out = pieces(sync)
    print("quant" if q else "float", "pieces sync", sync, "equal to one-shot", mx.array_equal(out, ref).item(), "max", mx.max(mx.abs(out - ref)).item())
