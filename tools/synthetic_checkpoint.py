"""Write a synthetic mlx-community-style checkpoint of a model shape, for measuring conversion.

    python tools/synthetic_checkpoint.py OUT_DIR [--shape qwen3-30b-a3b] [--layers N] [--shard-gb 5]

OUT_DIR gets what an mlx-community 4-bit upload holds: ``config.json`` (the shape's config with
``quantization: {group_size: 64, bits: 4}``), ``model-0000k-of-0000n.safetensors`` shards of at
most ``--shard-gb`` GB with ``model.safetensors.index.json`` (its ``weight_map``), and a
byte-level tokenizer. Tensor names, shapes and dtypes are those of mlx-lm's quantized model of
the shape (bfloat16 scales, biases and norms, uint32 packed weights); the bytes are pseudo-random
(packed weights) or small finite bfloat16 values, written tensor by tensor with bounded memory.
The model is not meant to produce text; it is meant to be converted.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import numpy as np

BLOCK = 1 << 24  # bytes of random data reused (at shifting offsets) for every packed tensor


def tensor_specs(config: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor of mlx-lm's quantized model of ``config``,
    obtained from the module tree without computing a weight."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    q = config["quantization"]
    nn.quantize(model, group_size=q["group_size"], bits=q["bits"],
                class_predicate=lambda _p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % q["group_size"] == 0)
    names = {mx.uint32: "U32", mx.float32: "BF16", mx.bfloat16: "BF16", mx.float16: "BF16"}
    return [(k, names[v.dtype], tuple(v.shape)) for k, v in tree_flatten(model.parameters())]


def write_checkpoint(out: pathlib.Path, config: dict[str, Any], shard_bytes: int) -> int:
    """Write ``out`` (see the module docstring); returns the bytes of weights written."""
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(config)
    size = {"U32": 4, "BF16": 2}
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, dt, shape in specs:
        n = int(np.prod(shape)) * size[dt]
        if shards[-1] and used + n > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, dt, shape))
        used += n
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, BLOCK, dtype=np.uint8)
    # small finite bfloat16 values: the top halves of float32 draws
    floats = (rng.standard_normal(BLOCK // 2, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    fblock = floats.astype(np.uint16).view(np.uint8)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        off = 0
        for name, dt, shape in shard:
            n = int(np.prod(shape)) * size[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        hdr = json.dumps(header, separators=(",", ":")).encode()
        hdr += b" " * (-len(hdr) % 8)
        with open(out / fname, "wb") as fh:
            fh.write(len(hdr).to_bytes(8, "little"))
            fh.write(hdr)
            for j, (_name, dt, shape) in enumerate(shard):
                n = int(np.prod(shape)) * size[dt]
                src = block if dt == "U32" else fblock
                start = (j * 4099 * 8) % (BLOCK // 2)
                while n > 0:
                    chunk = src[start:start + min(n, BLOCK - start)]
                    fh.write(chunk.data)
                    n -= len(chunk)
                    start = 0
        total += off
        print(f"{fname}: {off / 1e9:.2f} GB", file=sys.stderr, flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    from asyncside.models.tokenizer import save_byte_level_tokenizer

    save_byte_level_tokenizer(out, model_max_length=int(config.get("max_position_embeddings", 4096)))
    return total


def main(argv: list[str] | None = None) -> int:
    from asyncside.bench.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--shard-gb", type=float, default=5.0)
    args = p.parse_args(argv)
    config = dict(SHAPES[args.shape])
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    config["quantization"] = {"group_size": 64, "bits": 4}
    config["torch_dtype"] = "bfloat16"
    total = write_checkpoint(args.out, config, int(args.shard_gb * 1e9))
    print(f"{args.out}: {total / 1e9:.2f} GB of weights", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
