"""The demo's misses' bytes per decode token, round 14: queued steps queue the next step before its
token is awaited, so the read counters' window, which starts at the first token, covers fewer
decode steps than the tokens after the first; dividing by those tokens understated the bytes per
token and overstated the I/O limit the demo holds its tokens/s to."""

from __future__ import annotations

import json
import pathlib

import pytest

from asyncside.cli import main
from asyncside.memory import proc_self_bytes
from asyncside.store import ExpertStore


def test_the_demos_bytes_per_token_are_over_the_steps_its_counters_cover(
        quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = 10
    budget = f"{proc_self_bytes('status', 'VmRSS') // 2**20 + 400}M"
    capsys.readouterr()
    assert main(["demo", "--model", str(quick_store), "--tokens", str(tokens), "--resident", "0.25",
                 "--memory", budget, "--reference", "none", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    lim = res["limits"]
    store = ExpertStore.open(quick_store)
    assert lim["decode_bytes_read"] > 0
    # The steps the counters cover are their demands over a step's (MoE layers x top-k), which is
    # one decode step fewer than the tokens after the first where the first was queued before the
    # first token arrived (most runs; timing decides), never more; the bytes per token are the
    # counted bytes over them.
    per_step = len(store.layers) * 4  # the quick model routes top-4
    assert lim["decode_steps"] == lim["decode_demands"] / per_step
    assert tokens - 2 <= lim["decode_steps"] <= tokens - 1
    assert lim["miss_bytes_per_token"] == pytest.approx(lim["decode_bytes_read"] / lim["decode_steps"])
