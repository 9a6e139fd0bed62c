"""A short soak of `asyncside serve` (issue 38 item 5): the real command as a child process, the
embedded model, clients mixing every kind of request (a third dropping streams midway), the
server's RSS sampled; after the warm-up quarter it must stay flat, and every cache the server
keeps must report its bytes and its bound in /metrics. The hour-long run is the same tool with
``--duration 3600 --clients 32`` (docs/serving.md)."""

from __future__ import annotations

import anyio
import pytest

from asyncside.serving import embedded_store_dir
from asyncside.serving.soak import growth, quarter_means, soak, start_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_growth_compares_the_second_quarter_with_the_last() -> None:
    flat = [(float(t), 100) for t in range(0, 41)]
    assert growth(flat) == 0.0
    rising = [(float(t), 100 + 2 * t) for t in range(0, 41)]
    assert growth(rising) > 0.05  # a leak is seen
    warm = [(float(t), 50 if t < 10 else 100) for t in range(0, 41)]
    assert growth(warm) == 0.0  # warm-up (the first quarter) is not counted


def test_soak_rss_is_flat_after_warm_up_and_caches_report_their_bounds() -> None:
    store = embedded_store_dir(None)
    # Small bounds, so that the caches reach them within the warm-up quarter of a short run.
    proc, url = start_server(["--model", store, "--max-tokens-limit", "32", "--prompt-cache-bytes", "4M",
                              "--mlx-cache-limit", "32M"])
    try:
        # 40 s of load before sampling: the pools' pages and the first batches' buffers are
        # touched then (on a loaded CI machine that takes most of a minute), then 48 s sampled.
        out = anyio.run(soak, url, proc.pid, 8, 48.0, 1.0, 40.0)
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 0
    done = sum(n for kind, n in out["requests"].items() if kind.endswith("_200") or kind == "stream_left_or_done")
    assert done >= 4, out["requests"]
    assert not any(kind.startswith("error") or kind.endswith("_500") for kind in out["requests"]), out["requests"]
    bounds = out["bounds"]
    assert bounds["asyncside_prompt_cache_limit_bytes"] == 4 << 20
    assert 0 < bounds["asyncside_prompt_cache_bytes"] <= 4 << 20
    assert bounds["asyncside_mlx_cache_limit_bytes"] == 32 << 20
    assert bounds["asyncside_mlx_cache_bytes"] <= bounds["asyncside_mlx_cache_limit_bytes"]
    # Flat: the mean RSS of the last quarter is within 5% of the second quarter's, or has grown by no
    # more than the two bounded caches may still take (their bounds: a cache that was not yet full in
    # the second quarter fills by the last; the 32M MLX cache alone is most of 5% of this process).
    second, last = quarter_means(out["samples"])
    grew = last - second
    caches = bounds["asyncside_mlx_cache_limit_bytes"] + bounds["asyncside_prompt_cache_limit_bytes"]
    assert out["growth"] < 0.05 or grew <= caches, [(t, r >> 20) for t, r in out["samples"]]
