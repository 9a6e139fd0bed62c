"""Paired benchmark: mlx-lm's ``stream_generate`` over :func:`asyncside.facade.load` against
asyncside's own generation loop (``StreamingModel.generate``), on the same runtime.

    python tools/bench_facade.py [--model STORE|DIR|ORG/NAME] [--tokens 128] [--rounds 5] [--resident 0.25]
                                 [--predictor lookahead|temporal|none]

Both run on the facade's runtime (same pools, same thread, same store), alternated round by round
(own loop first in odd rounds, the facade first in even ones), so machine load drifts hit both
alike. Each round: the same prompt, greedy, ``--tokens`` tokens; decode tokens/s is (tokens - 1)
over the time from the first token to the last, taken the same way for both. Prints one JSON
document: per round both figures and their ratio, the median ratio, and whether the tokens of
every run were identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from asyncside.argtypes import int_at_least


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded model (built on first run)")
    p.add_argument("--tokens", type=int_at_least(2), default=128)
    p.add_argument("--rounds", type=int_at_least(1), default=5)
    p.add_argument("--resident", type=float, default=0.25)
    p.add_argument("--predictor", default="lookahead", choices=["lookahead", "temporal", "none"],
                   help="the own loop's expert predictor (the facade's steps run none)")
    p.add_argument("--prompt", default="Mixture-of-Experts models route every token to a few experts out of many. ")
    args = p.parse_args(argv)

    from mlx_lm import stream_generate

    from asyncside.facade import load
    from asyncside.models.embedded import ensure_embedded_default

    model_name = args.model if args.model is not None else str(ensure_embedded_default()[1])
    model, tok = load(model_name, resident=args.resident)
    sm = model.streaming
    prompt_ids = list(tok.encode(args.prompt))
    n = args.tokens

    def facade_run() -> tuple[list[int], float]:
        toks, first, last = [], 0.0, 0.0
        for r in stream_generate(model, tok, prompt_ids, max_tokens=n):
            last = time.perf_counter()
            if not toks:
                first = last
            toks.append(r.token)
        return toks, (len(toks) - 1) / (last - first)

    async def own_loop() -> tuple[list[int], float]:
        toks, first, last = [], 0.0, 0.0
        async for t in sm.generate(prompt_ids, max_tokens=n, source=model.runtime, stop_at_eos=False,
                                     predictor=args.predictor):
            last = time.perf_counter()
            if not toks:
                first = last
            toks.append(t)
        return toks, (len(toks) - 1) / (last - first)

    def own_run() -> tuple[list[int], float]:
        return model._thread.call(own_loop())

    facade_run()  # warm-up of both (kernels, pools), not counted
    own_run()
    rounds: list[dict[str, Any]] = []
    identical = True
    for i in range(args.rounds):
        order = [("own", own_run), ("facade", facade_run)]
        if i % 2:
            order.reverse()
        got = {name: fn() for name, fn in order}
        identical &= got["own"][0][: len(got["facade"][0])] == got["facade"][0]
        rounds.append({"own_tok_s": got["own"][1], "facade_tok_s": got["facade"][1],
                       "ratio": got["facade"][1] / got["own"][1], "first": order[0][0]})
    model.close()
    print(json.dumps({
        "model": sm.model_id, "resident": args.resident, "tokens": n, "own_predictor": args.predictor,
        "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "median_own_tok_s": statistics.median(r["own_tok_s"] for r in rounds),
        "median_facade_tok_s": statistics.median(r["facade_tok_s"] for r in rounds),
        "tokens_identical": identical,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
