"""Serving on unseen inputs, round 13: a user's own memory budget, model shapes and benchmark
settings that the server refuses every request of.

``bench serve`` refuses up front what the server would refuse every time (a prompt past the
model's context, and now one whose KV cache the memory budget's allowance can never admit),
instead of measuring a phase of errors; its advice names a length that can be asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from asyncside.bench.serve import _check_context, _fit_long_prompt
from asyncside.kv_layout import KVLayout
from asyncside.serving.kv_budget import KVAdmission

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: a model whose KV cache takes 96 KiB a position (three layers of sixteen 256-wide heads in float32)
LAYOUT = KVLayout(per_token=(32768,) * 3, windows=(None,) * 3)
ALLOWANCE = 128 << 20


def _admission() -> KVAdmission:
    return KVAdmission(LAYOUT, ALLOWANCE, budget="memory=420.0 MiB")


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"prompt_lengths": [8, 32, 128], "max_tokens": 32, "long_prompt": None, **kw})


def test_bench_serve_refuses_a_max_tokens_that_leaves_no_room_for_a_prompt() -> None:
    """``bench serve --max-tokens 1000`` on a model of 512 positions advised "ask for at most -488
    prompt tokens": the flag at fault is --max-tokens, and the advice names what it may be."""
    with pytest.raises(ValueError) as info:
        _check_context(_args(max_tokens=1000), 512, [0])
    said = str(info.value)
    assert said.startswith("--max-tokens 1000 leaves no room for a prompt in the model's context of 512 tokens")
    assert said.endswith("ask for at most 511") and "-" not in said.split("at most")[1], said
    with pytest.raises(ValueError, match=r"^--max-tokens 512 leaves no room .* at most 511$"):
        _check_context(_args(max_tokens=512), 512, [0])
    _check_context(_args(max_tokens=511, prompt_lengths=[1]), 512, [0])  # one prompt token fits


def test_bench_serve_refuses_prompts_whose_kv_cache_the_budget_never_admits() -> None:
    """Under ``--memory`` the server refuses a request whose KV cache may outgrow the allowance
    (400 kv_budget_exceeded); the bench sent them anyway: the default 2000-token long prompt made
    a phase of one error and "long TTFT not reached". The default long prompt is now cut to what
    the allowance admits (a note says so), and lengths given that it never admits are refused
    before any phase, naming the allowance and the longest prompt it admits."""
    admission = _admission()
    longest = max(n for n in range(1, 4096) if admission.refusal(n, 32) is None)
    assert admission.refusal(longest + 1, 32) is not None and longest < 2000
    fit, note = _fit_long_prompt(_args(), 4096, True, admission)
    assert fit == longest and note is not None and "KV allowance of 128.0 MiB" in note, note
    _check_context(_args(), 4096, [0, fit], admission)  # what it cut to is admitted
    assert _fit_long_prompt(_args(), 4096, False, admission) == (2000, None)  # no phase sends it
    with pytest.raises(ValueError) as info:
        _check_context(_args(long_prompt=2000, prompt_lengths=[8, 1500]), 4096, [0, 2000], admission)
    said = str(info.value)
    assert said.startswith("--prompt-lengths 1500, --long-prompt 2000 with --max-tokens 32: their KV caches may "
                           "not fit the KV allowance of 128.0 MiB under the memory budget (memory=420.0 MiB)"), said
    assert said.endswith(f"ask for at most {longest} prompt tokens"), said
    with pytest.raises(ValueError) as info:
        _check_context(_args(max_tokens=2000), 4096, [0], admission)
    most = max(n for n in range(1, 4096) if admission.refusal(1, n) is None)
    assert str(info.value).startswith("--max-tokens 2000: a request's KV cache may not fit the KV allowance")
    assert str(info.value).endswith(f"ask for at most {most}"), info.value
    # Without a budget (no allowance) only the context bounds them, as before.
    _check_context(_args(prompt_lengths=[1500]), 4096, [2000], KVAdmission(LAYOUT, None))


@pytest.mark.parametrize("argv, said", [(["--temp", "0.7"], "--temp 0.7"), (["--joint-prefill"], "--joint-prefill"),
                                        (["--prefill-chunk", "8"], "--prefill-chunk")])
def test_serve_pipeline_refuses_options_its_ranks_cannot_honour(argv: list[str], said: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --pipeline --temp 0.7`` started, then answered every request that gave no
    temperature with 400 "a pipeline of ranks decodes greedily: leave out temperature" (the user
    had left it out); --joint-prefill and --prefill-chunk were ignored without a word. Each is now a
    usage error before the ranks launch (exit 2, one line); --temp 0 still runs."""
    from _cli_support import run_cli

    from asyncside.cli import build_parser
    from asyncside.serving.cli import pipeline_problem

    rc, err = run_cli(capsys, "serve", "--pipeline", *argv)
    assert rc == 2 and f"{said} is not supported with --pipeline" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert pipeline_problem(build_parser().parse_args(["serve", "--pipeline", "--temp", "0"])) is None
    assert pipeline_problem(build_parser().parse_args(["serve", *argv])) is None  # without --pipeline: fine


def _scripted_app(tmp: pathlib.Path, reply: str, context: int, allowance: int | None = None, **settings: Any) -> Any:
    """The app over a scripted model of ``context`` positions whose KV cache takes 8 KiB a position,
    under a memory plan granting ``allowance`` bytes of KV caches (None: no budget)."""
    from types import SimpleNamespace

    from _serving_support import ScriptedModel, byte_tokenizer

    from asyncside.serving import Engine, ServeSettings, create_app

    model = ScriptedModel(byte_tokenizer(tmp), reply, context=context)
    model.config.update(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1024,
                        torch_dtype="float32")
    source = None if allowance is None else SimpleNamespace(
        plan=SimpleNamespace(kv_allowance_bytes=allowance, direct=False, source="memory=1G"))

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[Engine]:
        yield Engine(model=model, source=source, audit=lambda: (True, []), description={"model": "scripted"})

    return create_app(factory, ServeSettings(prompt_cache_size=0, **settings))


@pytest.mark.parametrize("budget", [False, True])
def test_a_request_without_max_tokens_generates_to_what_the_context_and_budget_leave(tmp_path: pathlib.Path,
                                                                                   budget: bool) -> None:
    """A chat request with no ``max_tokens`` whose prompt left less of the context than the
    server's default (128) was refused: "the prompt is 40 tokens and max_tokens is 128 ... past the
    model's context", a max_tokens the client never sent (OpenAI generates up to the context's
    end); under --memory likewise "ask for fewer tokens" of the KV allowance. The default is now cut
    to what the context and the allowance leave; a max_tokens the client gives is still refused."""
    import httpx

    from asyncside.serving import BackgroundServer

    # 8 KiB a position, allocated 256 at a time: the allowance holds 768 positions, 512 generated and prompt.
    allowance = 8192 * 768 if budget else None
    context = 2048 if budget else 64
    app = _scripted_app(tmp_path, "y" * 1200, context, allowance, max_tokens_limit=1000, default_chat_max_tokens=1000)
    with BackgroundServer(app) as srv:
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "x" * 16}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        room = 768 - 255 if budget else context
        assert usage["prompt_tokens"] + usage["completion_tokens"] == room, usage
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "max_tokens": 1000}, timeout=60)
        assert r.status_code == 400, r.text
        code = r.json()["error"]["code"]
        assert code == ("kv_budget_exceeded" if budget else "context_length_exceeded"), r.text
        if not budget:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": "x" * 70}, timeout=60)
            said = r.json()["error"]["message"]
            assert r.status_code == 400 and said.endswith("the model's context of 64 leaves no room for a token"), said


def test_a_full_queue_under_the_rows_limit_says_what_runs_and_when_to_retry(tmp_path: pathlib.Path) -> None:
    """Past the page cache the engine runs at most ``rows // top-k`` requests at once (one here);
    a full queue answered 429 "the server is at capacity (32 requests generating, ...)" with one
    running, and a Retry-After that divided the wait by the 32 slots, so clients came back 32 times
    too early. It now names the requests generating and divides by how many run at once."""
    from _serving_support import ScriptedModel, byte_tokenizer

    from asyncside.serving import Batcher
    from asyncside.serving.engine import QueueFull

    b = Batcher(ScriptedModel(byte_tokenizer(tmp_path)), None, max_batch=32, max_queue=2)
    b.kv_admission = KVAdmission(LAYOUT, None, max_active=1)
    b._duration_ewma = 10.0  # seconds a request has taken
    for _ in range(1 + 31 + 2):  # one generating, then the queue: 31 free slots beyond max_queue
        b.submit([1, 2], 4)
    b._active.append(b._waiting.popleft())
    with pytest.raises(QueueFull) as info:
        b.submit([1, 2], 4)
    assert "(1 requests generating, 33 waiting)" in str(info.value), info.value
    assert info.value.retry_after == 10 * (33 - 31 + 1), info.value  # three ahead, one at a time


@pytest.mark.parametrize("argv, said", [
    (["--prompt-ids", "9999"], "--prompt-ids: token id 9999 is outside the model's vocabulary [0, 512)"),
    (["--prompt-ids", "-1"], "--prompt-ids: token id -1 is outside the model's vocabulary [0, 512)"),
    (["--single", "--prompt-ids", "512"], "token id 512 is outside the model's vocabulary [0, 512)"),
    (["--prompt-ids", "1,x"], "--prompt-ids 1,x: expected comma-separated token ids, got 'x'"),
    (["--prompt-ids", ","], "--prompt-ids ',': no token ids"),
    (["--prompt", ""], "--prompt is empty"),
])
def test_a_rank_refuses_a_prompt_the_model_cannot_take_before_the_ranks_meet(
        quick_store: pathlib.Path, argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncside.distributed STORE --prompt-ids 9999`` under a launch: every rank met and
    loaded its stage, then rank 0 read past its embedding and was killed by SIGSEGV (its peer left
    with "closed its control link without a goodbye"); ``--prompt-ids 1,x`` was a traceback of
    rank 0 after the launch, and an empty ``--prompt`` ran the default prompt. Each is now a usage
    error of every rank (exit 2, one line) before the launch environment is looked for."""
    from asyncside.distributed.rank import main

    assert main([str(quick_store), *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_rank_refuses_an_unknown_reader_as_a_usage_error(quick_store: pathlib.Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--reader bogus`` was taken, every rank met and loaded its stage, then each failed with a
    ValueError traceback and exit status 1: it is now argparse's usage error naming the choices."""
    from asyncside.distributed.rank import main

    with pytest.raises(SystemExit) as info:
        main([str(quick_store), "--reader", "bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice: 'bogus'" in err and "io_uring" in err, err


def test_batcher_submit_refuses_token_ids_outside_the_vocabulary(tmp_path: pathlib.Path) -> None:
    """The HTTP layer checks prompt ids against the vocabulary, but ``Batcher.submit`` (the engine's
    public entry, for servers that embed it) queued them: the embedding read past its table and
    the process died of SIGSEGV at the request's first step. It is now a ValueError naming the id."""
    from _serving_support import ScriptedModel, byte_tokenizer

    from asyncside.serving import Batcher

    b = Batcher(ScriptedModel(byte_tokenizer(tmp_path)), None)
    for ids in ([1, 512], [-1]):
        with pytest.raises(ValueError, match=rf"token id {ids[-1]}, outside the model's vocabulary \[0, 512\)"):
            b.submit(ids, 4)
    assert b.waiting == 0
    b.submit([1, 511], 4)  # the last id of the vocabulary is fine
    assert b.waiting == 1


def test_pipeline_generate_refuses_token_ids_outside_the_vocabulary() -> None:
    """``Pipeline.generate`` (rank 0's public entry) took ids past the vocabulary, and rank 0 died
    of SIGSEGV in its embedding; now a ValueError before the request is started. (A pipeline that
    runs, stubbed: the check comes before anything of the ranks is touched.)"""
    from types import SimpleNamespace

    import anyio

    from asyncside.distributed import Pipeline

    pipe = Pipeline.__new__(Pipeline)
    started: list[Any] = []
    pipe.rank, pipe.control, pipe.sm = 0, SimpleNamespace(failed=None), SimpleNamespace(config={"vocab_size": 512})
    pipe._tg = SimpleNamespace(start_soon=lambda *a: started.append(a))

    async def first(ids: list[int]) -> None:
        async for _ in pipe.generate(ids, 3):
            break

    with pytest.raises(ValueError, match=r"token id 512, outside the model's vocabulary \[0, 512\)"):
        anyio.run(first, [1, 512])
    assert started == []
