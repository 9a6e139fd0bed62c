"""The demo's decoding disk bytes against its misses' bytes, round 19: the process's disk counter
(/proc/self/io) counts a read when it is submitted, the runtime when it lands and its log is
applied. Taken at the first token, while the step queued ahead of it still read, the two cut
decoding at different points, and ``decode_disk_over_misses`` read below 1.0 with every read a
miss's (0.71-0.97 with the streamed switch)."""

from __future__ import annotations

import json
import pathlib

import mlx.core as mx
import pytest

import asyncside.demo as demo
from asyncside.cli import main
from asyncside.memory import proc_self_bytes
from asyncside.models.walk import DecoderWalk


def test_decodings_disk_bytes_are_its_misses_bytes_with_a_step_reading_at_the_first_token(
        quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if not pathlib.Path("/proc/self/io").is_file():
        pytest.skip("no /proc/self/io here to say what this process read")
    disk = demo.disk_read_bytes

    def after_the_stream() -> int:
        # Wherever the demo reads the disk counter, the stream has run on first: the step queued
        # ahead of the first token has submitted its reads, which the disk counts then, whatever
        # the runtime has counted (what a slow disk or a large step makes of every run).
        mx.synchronize()
        return disk()

    embed = DecoderWalk.embed

    def slow_embed(self: DecoderWalk, inputs: mx.array) -> mx.array:
        # Every step starts with compute that changes nothing (a matrix its own square, times 0):
        # the step queued ahead of the first token is still at it when the token is handed out,
        # its reads not begun, so whatever is taken then and what is taken after the stream ran
        # differ by the step's reads wherever the two counts are not taken at rest.
        a = mx.full((512, 512), 1 / 512)
        for _ in range(4):
            a = a @ a
        return embed(self, inputs) + 0 * a.sum()

    monkeypatch.setattr(DecoderWalk, "embed", slow_embed)
    monkeypatch.setattr(demo, "disk_read_bytes", after_the_stream)
    budget = f"{proc_self_bytes('status', 'VmRSS') // 2**20 + 400}M"
    capsys.readouterr()
    assert main(["demo", "--model", str(quick_store), "--tokens", "8", "--resident", "0.25", "--direct",
                 "--memory", budget, "--reference", "none", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    if not res["direct"] or not res["disk_read_bytes"]:
        pytest.skip("the store's filesystem took no O_DIRECT reads the disk counter sees")
    rt = res["runtime"]
    assert rt["decode_bytes_read"] > 0
    # O_DIRECT: every byte read is a miss's, in the whole run and in decoding alone. (Never fewer:
    # a file the process reads besides, once someone drops the page cache, can only add.)
    assert res["disk_read_bytes"] >= res["bytes_read"]
    assert rt["decode_disk_read_bytes"] >= rt["decode_bytes_read"]
    assert res["decode_disk_over_misses"] >= 1.0
    # and the steps they cover are those after the one queued ahead of the first token
    assert res["limits"]["decode_steps"] == 8 - 2
