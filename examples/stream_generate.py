"""Stream tokens from the embedded MoE model while asyncside streams its experts from the SSD store.

    python examples/stream_generate.py --prompt "Once upon a time" --max-tokens 32

Only a quarter of each layer's experts stay in memory (``--resident``); the rest are read from
the expert store just in time, overlapped with compute. Prints the text as it is generated, then
tokens/s and the runtime's hit rate, bytes read and stall time.
"""

from __future__ import annotations

import argparse
import time

import uvloop

from asyncside.models import load_streaming_model
from asyncside.models.embedded import ensure_embedded_default
from asyncside.runtime import Runtime


async def main(prompt: str, max_tokens: int, resident: float) -> None:
    _, store_dir = ensure_embedded_default()  # built into the user cache on first run
    model = load_streaming_model(store_dir)
    tok = model.tokenizer

    async with Runtime(model.store, resident=resident) as runtime:
        ids: list[int] = []
        shown = ""
        start = time.perf_counter()
        async for token in model.generate(tok.encode(prompt), max_tokens=max_tokens, source=runtime):
            ids.append(token)
            text = tok.decode(ids)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                print(text[len(shown):], end="", flush=True)
                shown = text
        elapsed = time.perf_counter() - start
        stats = runtime.stats()

    print()
    print(f"{len(ids)} tokens in {elapsed:.2f}s = {len(ids) / elapsed:.1f} tokens/s "
          f"(model {model.model_id}, {resident:.0%} of experts resident, reader {stats['reader']})")
    print(f"hit rate {stats['hit_rate']:.1%}, {stats['bytes_read'] / 2**20:.1f} MiB read, "
          f"stall {stats['stall_time_s'] * 1000:.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--resident", type=float, default=0.25)
    args = parser.parse_args()
    uvloop.run(main(args.prompt, args.max_tokens, args.resident))
