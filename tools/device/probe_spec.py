"""Device probe: tokens of tiny gpt_oss (float) over ResidentSource, speculation on/off, repeated."""
import sys
sys.path.insert(0, "tests")
import anyio, numpy as np
from _models_support import tiny_model
from asyncside.models import ForwardOptions, ResidentSource, eval_completed, reference_generate, streaming_from_model
from asyncside.bridge import completed
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
        options = ForwardOptions(mode="per-layer", speculate=spec)
        async def main():
            return [t async for t in sm.generate(prompt, max_tokens=10, source=src, predictor="lookahead",
                                                 options=options)]
        got = anyio.run(main)
        print(mt, comp_name, "speculate", spec, "equal", got == ref, got if got != ref else "", flush=True)
