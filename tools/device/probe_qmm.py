"""Device probe: MLX's ``quantized_matmul`` against the product of the dequantized matrix.

For each input width K and quantization group size, one token (M = 1, the matrix-vector kernel)
and 20 tokens (M = 20, a prompt chunk: the matrix-matrix kernel), 4- and 8-bit affine: the largest
absolute difference from ``x @ dequantize(w).T``, and whether two evaluations of the same product
agree bitwise. On MLX CUDA this located why the tiny 4-bit test models were not exact there: a
width of a single group per row (K == group size) with M > 1 (docs/design.md, Platforms).
Usage (GPU machine): ``PYTHONPATH=/tmp/site:$PWD python3 tools/device/probe_qmm.py``.
"""

import mlx.core as mx

mx.random.seed(0)
print("device", mx.default_device())
for k, n, group, bits in ((64, 64, 64, 4), (64, 64, 32, 4), (64, 8, 64, 8), (128, 8, 64, 8), (128, 64, 128, 4),
                          (128, 64, 64, 4), (96, 64, 32, 4), (128, 128, 32, 4), (512, 512, 64, 4), (2048, 768, 64, 4)):
    w = mx.random.normal((n, k)) * 0.05
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    dense = mx.dequantize(wq, scales, biases, group_size=group, bits=bits)
    for m in (1, 20):
        x = mx.random.normal((m, k))
        a = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)
        b = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)
        mx.eval(a, b)
        diff = float(mx.abs(a - x @ dense.T).max())
        print(f"K {k:5d} N {n:4d} group {group:3d} bits {bits} M {m:2d}: max |qmm - dense| {diff:.3g}, "
              f"repeat bitwise equal {bool(mx.array_equal(a, b))}, nan {bool(mx.isnan(a).any())}", flush=True)
