"""Device probe: where a streamed forward's logits part from the all-resident reference's.

Teacher-forced on one shape (a config.json path; default the split-counts test's reproducer): the
reference's logits at every position (prompt in one chunk, then one token a step), the streamed
model's at residencies 1.0 (all rows), 0.5, 0.25 and the least, in per-layer and queued modes,
each twice. Prints, per run: the largest absolute difference, the positions whose argmax differs
and, there, the reference's margin between its top two logits (a flip inside the rounding of the
arithmetic is numerics; a flip across a wide margin is a wrong row). Then the kernel question on
its own: ``gather_qmm`` of the same rows from the full expert array and from a subset of it.

Usage: python tools/device/probe_exact.py [CONFIG_JSON] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from typing import Any

import anyio
import mlx.core as mx
import numpy as np

from asyncside.bench.shapes import ensure_shape
from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_reference_model, load_streaming_model
from asyncside.runtime import Runtime

REPRODUCER = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 320, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 1,
              "intermediate_size": 64}


def reference_logits(model: Any, cache: Any, tokens: list[int], prompt_len: int) -> list[np.ndarray]:
    out = [np.array(model(mx.array([tokens[:prompt_len]]), cache=cache)[0, -1].astype(mx.float32))]
    for t in tokens[prompt_len:]:
        out.append(np.array(model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)))
    return out


def streamed_logits(store: pathlib.Path, tokens: list[int], prompt_len: int, mode: str,
                    resident: float) -> tuple[list[np.ndarray], dict[str, Any]]:
    sm = load_streaming_model(store, completed=completed, options=ForwardOptions(mode=mode))

    async def main() -> tuple[list[np.ndarray], dict[str, Any]]:
        async with Runtime(sm.store, resident=resident, min_side_rows=2) as rt:
            cache = sm.make_cache()
            x = await sm(mx.array([tokens[:prompt_len]]), cache, source=rt)
            out = [np.array(x[0, -1].astype(mx.float32))]
            for t in tokens[prompt_len:]:
                x = await sm(mx.array([[t]]), cache, source=rt)
                out.append(np.array(x[0, -1].astype(mx.float32)))
            await rt.quiesce()
            audit = all(r.ok for r in rt.audit().values())
            return out, {"hits": rt.stats()["hits"], "misses": rt.stats()["misses"], "audit": audit}

    return anyio.run(main)


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict[str, Any]:
    flips = []
    for i, (r, g) in enumerate(zip(ref, got)):
        if int(r.argmax()) != int(g.argmax()):
            top = np.sort(r)[-2:]
            flips.append({"pos": i, "ref": int(r.argmax()), "got": int(g.argmax()),
                          "ref_margin": float(top[1] - top[0]), "diff_here": float(np.abs(r - g).max())})
    # NaN where both sides hold NaN counts as equal; NaN on one side only as an infinite difference
    diffs = [float(np.where(np.isnan(r) & np.isnan(g), 0.0, np.nan_to_num(np.abs(r - g), nan=np.inf)).max())
             for r, g in zip(ref, got)]
    return {"max_abs_diff": max(diffs), "first_diff_pos": next((i for i, d in enumerate(diffs) if d), None),
            "bitwise_equal_positions": sum(d == 0.0 for d in diffs), "positions": len(diffs),
            "ref_nonfinite_positions": [i for i, r in enumerate(ref) if not np.isfinite(r).all()],
            "got_nonfinite_positions": [i for i, g in enumerate(got) if not np.isfinite(g).all()],
            "per_position": [round(d, 4) for d in diffs], "flips": flips}


def kernel_probe(ref_model: Any) -> list[dict[str, Any]]:
    """gather_qmm / gather_mm of one expert's rows from the full stacked array and from a subset."""
    out = []
    for name, mod in ref_model.named_modules():
        if not hasattr(mod, "weight") or getattr(mod, "weight", None) is None or mod.weight.ndim != 3:
            continue
        w = mod.weight
        n = w.shape[0]
        quantized = hasattr(mod, "scales")
        width = mod.scales.shape[-1] * mod.group_size if quantized else w.shape[-1]
        x = mx.random.normal((1, 1, 1, width)).astype(mod.scales.dtype if quantized else w.dtype)
        sub = [n - 1, 0]
        for e in range(n):
            idx_full = mx.array([[e]], dtype=mx.uint32)
            pick = [e] + [s for s in sub if s != e][:1]
            idx_sub = mx.array([[0]], dtype=mx.uint32)
            if quantized:
                kw = {"transpose": True, "group_size": mod.group_size, "bits": mod.bits}
                biases = getattr(mod, "biases", None)
                a = mx.gather_qmm(x, w, mod.scales, biases, rhs_indices=idx_full, **kw)
                b = mx.gather_qmm(x, w[mx.array(pick)], mod.scales[mx.array(pick)],
                                  None if biases is None else biases[mx.array(pick)], rhs_indices=idx_sub, **kw)
            else:
                a = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx_full)
                b = mx.gather_mm(x, w[mx.array(pick)].swapaxes(-1, -2), rhs_indices=idx_sub)
            d = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
            out.append({"module": name, "expert": e, "max_abs_diff": d})
        # many tokens at once (a prompt chunk), sorted and not, rows remapped onto a subset
        ids = np.random.default_rng(1).integers(0, n, 24)
        pick = sorted(set(ids.tolist()))
        remap = np.array([pick.index(i) for i in ids], dtype=np.uint32)
        xs = mx.random.normal((24, 1, 1, width)).astype(x.dtype)
        for sort in (False, True):
            order = np.argsort(ids, kind="stable") if sort else np.arange(24)
            full_idx = mx.array(ids[order].astype(np.uint32))[:, None]
            sub_idx = mx.array(remap[order])[:, None]
            xo = xs[mx.array(order)]
            if quantized:
                a = mx.gather_qmm(xo, w, mod.scales, biases, rhs_indices=full_idx, sorted_indices=sort, **kw)
                sel = mx.array(pick)
                b = mx.gather_qmm(xo, w[sel], mod.scales[sel], None if biases is None else biases[sel],
                                  rhs_indices=sub_idx, sorted_indices=sort, **kw)
            else:
                a = mx.gather_mm(xo, w.swapaxes(-1, -2), rhs_indices=full_idx, sorted_indices=sort)
                b = mx.gather_mm(xo, w[mx.array(pick)].swapaxes(-1, -2), rhs_indices=sub_idx, sorted_indices=sort)
            d = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
            out.append({"module": name, "tokens": 24, "sorted": sort, "max_abs_diff": d})
        break
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?")
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--modes", default="per-layer,queued")
    p.add_argument("--residents", default="1.0,0.5,0.25,0.0")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-kernel", action="store_true")
    args = p.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="probe-exact-"))
    cfg = pathlib.Path(args.config) if args.config else root / "config.json"
    if not args.config:
        cfg.write_text(json.dumps(REPRODUCER))
    store = pathlib.Path(ensure_shape(cfg, cache_dir=root / "cache", progress=False)["store"])
    ref_model, config = load_reference_model(store)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, config["vocab_size"], 20)]
    # the reference's own greedy continuation, so both sides see the same tokens
    from asyncside.models import reference_generate
    gen = reference_generate(ref_model, prompt, max_tokens=args.tokens)
    tokens = prompt + gen
    from mlx_lm.models.cache import make_prompt_cache
    ref = reference_logits(ref_model, make_prompt_cache(ref_model), tokens, len(prompt))
    ref2 = reference_logits(ref_model, make_prompt_cache(ref_model), tokens, len(prompt))
    report: dict[str, Any] = {"device": str(mx.default_device()), "reference_repeat": compare(ref, ref2), "runs": []}
    print("reference twice:", report["reference_repeat"], flush=True)
    print("reference logits dtype and first position's range:", ref_model(mx.array([prompt])).dtype,
          float(ref[0].min()), float(ref[0].max()), flush=True)
    for mode in args.modes.split(","):
        for resident in (float(r) for r in args.residents.split(",")):
            for rep in range(args.reps):
                got, stats = streamed_logits(store, tokens, len(prompt), mode, resident)
                row = {"mode": mode, "resident": resident, "rep": rep, **stats, **compare(ref, got)}
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
    report["kernel"] = [] if args.no_kernel else kernel_probe(ref_model)
    for k in report["kernel"]:
        print("kernel", k, flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
