"""Device probe: tokens of tiny gpt_oss (float) over ResidentSource, speculation on/off, repeated."""
import sys
from typing import Any

sys.path.insert(0, "tests")
import anyio
import numpy as np

from asyncside.bridge import completed
from asyncside.models import ForwardOptions, ResidentSource, eval_completed, reference_generate, streaming_from_model

from _models_support import tiny_model


async def run(sm: Any, src: ResidentSource, options: ForwardOptions) -> list[int]:
    return [t async for t in sm.generate(prompt, max_tokens=10, source=src, predictor="lookahead", options=options)]


mt = sys.argv[1] if len(sys.argv) > 1 else "gpt_oss"
model, config = tiny_model(mt)
prompt = [int(t) for t in np.random.default_rng(7).integers(0, config["vocab_size"], 40)]
ref = reference_generate(model, prompt, max_tokens=10)
ref2 = reference_generate(model, prompt, max_tokens=10)
print(mt, "reference twice equal", ref == ref2)
for comp_name, comp in (("bridge", completed), ("eval", eval_completed)):
    sm, pools = streaming_from_model(model, config, completed=comp)
    src = ResidentSource(pools)
    for spec in (True, False, True, False):
        got = anyio.run(run, sm, src, ForwardOptions(mode="per-layer", speculate=spec))
        print(mt, comp_name, "speculate", spec, "equal", got == ref, got if got != ref else "", flush=True)
