"""Serving under a memory budget: KV bytes from a model's config, the plan's KV allowance, and the
engine's admission against it (asyncside.serving.kv_budget, Batcher.take_waiting)."""

from __future__ import annotations

import contextlib
import types
from typing import Any

import anyio
import httpx
import mlx.core as mx
import pytest
from _serving_support import ScriptedModel, byte_tokenizer
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from asyncside.errors import AsyncsideError
from asyncside.serving import BackgroundServer, Batcher, Engine, ServeSettings, create_app
from asyncside.serving.concurrency import ConcurrencyTuner
from asyncside.serving.kv_budget import KV_STEP, KVAdmission, KVLayout, dtype_bytes, kv_layout, plan_admission
from asyncside.serving.prompt_cache import PrefixCache
from asyncside.serving.protocol import RequestError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QWEN3_30B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}


def test_bytes_per_token_of_two_configs() -> None:
    # layers x 2 (keys, values) x kv heads x head_dim x dtype bytes
    assert kv_layout(QWEN3_30B, 2).bytes_per_token == 48 * 2 * 4 * 128 * 2
    assert kv_layout(QWEN3_30B, 4).bytes_per_token == 48 * 2 * 4 * 128 * 4
    # multi-head latent attention: one latent and one rope key per position
    assert kv_layout(DEEPSEEK_V3, 2).bytes_per_token == 61 * (512 + 64) * 2
    # no num_key_value_heads / head_dim: every head, hidden_size / heads
    plain = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_layout(plain, 4).bytes_per_token == 2 * 2 * 4 * 16 * 4
    nested = {"text_config": QWEN3_30B}
    assert kv_layout(nested, 2) == kv_layout(QWEN3_30B, 2)


def test_sliding_layers_are_bounded_by_their_window() -> None:
    layout = kv_layout(GPT_OSS, 2)
    assert layout.windows == (128, None, 128, None)
    per = 2 * 8 * 64 * 2
    short = layout.bytes_for(10)
    assert short == 4 * per * (10 + KV_STEP - 1)
    long = layout.bytes_for(10_000)
    assert long == 2 * per * (10_000 + KV_STEP - 1) + 2 * per * (128 + KV_STEP)


def test_bad_config_names_the_key() -> None:
    with pytest.raises(AsyncsideError, match="num_hidden_layers"):
        kv_layout({"num_attention_heads": 4}, 2, where="m/config.json")
    with pytest.raises(AsyncsideError, match="m/config.json.*head_dim"):
        kv_layout({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": "x"}, 2, where="m/config.json")
    with pytest.raises(AsyncsideError, match="layer_types"):
        kv_layout({**GPT_OSS, "layer_types": ["full_attention"]}, 2)
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("int4")
    assert dtype_bytes(mx.bfloat16) == 2 and dtype_bytes("float32") == 4


def _feed(cache: object, chunks: list[int], heads: int = 2, dim: int = 8) -> None:
    for n in chunks:
        k = mx.zeros((1, heads, n, dim), mx.float16)
        cache.update_and_fetch(k, k)  # type: ignore[attr-defined]
        mx.eval(cache.keys)  # type: ignore[attr-defined]


@pytest.mark.parametrize("chunks", [
    [1], [255], [256], [257], [16] * 20 + [1] * 300, [100, 100, 100] + [1] * 50, [600] + [1] * 10,
    [250, 16] + [1] * 3, [1] * 513,
])
def test_bound_holds_for_mlx_lm_caches(chunks: list[int]) -> None:
    """The worst case (tokens + step - 1 positions) is never below what mlx-lm's caches allocate,
    and is within one step of it."""
    layout = KVLayout((2 * 2 * 8 * 2,), (None,))
    tokens = sum(chunks)
    plain = KVCache()
    _feed(plain, chunks)
    assert plain.nbytes <= layout.bytes_for(tokens)
    assert layout.bytes_for(tokens) - plain.nbytes < KV_STEP * layout.bytes_per_token
    # A cache copied at its exact length (a merge, a row of a joint prefill) grows from there.
    merged = BatchKVCache.merge([plain])
    _feed(merged, [1] * 3)
    assert merged.nbytes <= layout.bytes_for(tokens + 3)
    window = KVLayout((2 * 2 * 8 * 2,), (64,))
    rotating = RotatingKVCache(max_size=64)
    _feed(rotating, chunks)
    assert rotating.nbytes <= window.bytes_for(tokens, chunk=max(chunks))


def test_admission_counts_rows_padded_to_the_longest() -> None:
    layout = KVLayout((1000,), (None,))
    adm = KVAdmission(layout, allowance=3 * layout.bytes_for(100))
    small, big = adm.need(50, 50), adm.need(300, 100)
    assert small == layout.bytes_for(100)
    assert adm.fits([small, small, small]) and not adm.fits([small] * 4)
    assert adm.reserved([small, big]) == 2 * big
    assert not adm.fits([small, small], extra=small + 1)
    assert KVAdmission(layout, None).fits([big] * 1000)
    assert adm.refusal(50, 50, "memory=1 GiB") is None
    message = adm.refusal(5000, 100, "memory=1 GiB")
    assert message is not None and "memory=1 GiB" in message and "KV allowance" in message


# --- the engine under a KV allowance (a scripted model, no expert source) ------------------------

# One layer of one head of 32 float16 elements: 128 bytes a position.
SMALL_MODEL = {"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 32, "torch_dtype": "float16"}
PER_TOKEN = 2 * 32 * 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def budget_source(allowance: int | None) -> Any:
    """An expert source whose memory plan grants ``allowance`` bytes of KV caches."""
    plan = types.SimpleNamespace(kv_allowance_bytes=allowance, source="memory=1 GiB, test",
                                 headroom_bytes=None if allowance is None else 3 * allowance,
                                 forward_room_bytes=None if allowance is None else 2 * allowance)
    return types.SimpleNamespace(plan=plan)


def scripted(tokenizer: Any) -> ScriptedModel:
    model = ScriptedModel(tokenizer, "one two three four five six seven eight nine ten", step_delay=0.001)
    model.config.update(SMALL_MODEL, max_position_embeddings=8192)
    return model


class Watched(Batcher):
    """A Batcher that records who it admits and the KV bytes it holds reserved after each admission."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admitted: list[int] = []
        self.reserved: list[int] = []
        self.batch_sizes: list[int] = []

    def take_waiting(self) -> list[Any]:
        taken = super().take_waiting()
        self.admitted.extend(id(s) for s in taken)
        self.reserved.append(self.kv_reserved() + self.prefix_cache.nbytes)
        self.batch_sizes.append(len(self._active))
        return taken


async def _serve_all(b: Batcher, requests: list[tuple[list[int], int]]) -> list[Any]:
    """Submit every request at once, read them all to the end; returns the slots in submission order."""
    gens = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        for ids, n in requests:
            gens.append(b.submit(ids, n))

        async def drain(g: Any) -> None:
            async for _ in g:
                pass

        async with anyio.create_task_group() as readers:
            for g in gens:
                readers.start_soon(drain, g)
        tg.cancel_scope.cancel()
    return [g._slot for g in gens]


@pytest.mark.anyio
async def test_many_clients_stay_under_the_allowance_in_order(tokenizer: Any) -> None:
    layout = KVLayout((PER_TOKEN,), (None,))
    prompt = list(tokenizer.encode("a question of some length, please"))
    need = layout.bytes_for(len(prompt) + 8, KV_STEP)
    allowance = 3 * need + need // 2  # room for three requests' worst cases, not four
    b = Watched(scripted(tokenizer), budget_source(allowance), max_batch=32, prefill_chunk=16, prompt_cache_size=0)
    assert b.kv_admission is not None and b.kv_admission.need(len(prompt), 8) == need
    slots = await _serve_all(b, [(prompt, 8)] * 12)
    assert all(s.finish_reason == "length" for s in slots)
    assert max(b.reserved) <= allowance
    assert max(b.batch_sizes) == 3  # the allowance, not max_batch, held the batch
    assert b.admitted == [id(s) for s in slots]  # first come, first admitted
    assert b.kv_admission.waits > 0


@pytest.mark.anyio
async def test_a_large_request_at_the_head_is_not_overtaken(tokenizer: Any) -> None:
    layout = KVLayout((PER_TOKEN,), (None,))
    small = (list(tokenizer.encode("short one")), 4)
    large = (list(tokenizer.encode("x" * 300)), 200)
    allowance = 2 * layout.bytes_for(len(large[0]) + large[1], KV_STEP)  # two large, or more small
    b = Watched(scripted(tokenizer), budget_source(allowance), max_batch=32, prefill_chunk=16, prompt_cache_size=0)
    order = [small, small, large, large, small, small, small]
    slots = await _serve_all(b, order)
    assert b.admitted == [id(s) for s in slots]
    assert max(b.reserved) <= allowance
    assert all(s.finish_reason in ("length", "stop") for s in slots)


@pytest.mark.anyio
async def test_a_request_too_large_for_the_allowance_is_refused(tokenizer: Any) -> None:
    layout = KVLayout((PER_TOKEN,), (None,))
    allowance = layout.bytes_for(1000, KV_STEP)
    b = Batcher(scripted(tokenizer), budget_source(allowance), prefill_chunk=16, prompt_cache_size=0)
    b.submit([1] * 500, 400)  # fits: admitted later
    with pytest.raises(RequestError, match=r"KV allowance of .* under the memory budget \(memory=1 GiB, test\)") as e:
        b.submit([1] * 500, 2000)
    assert e.value.status == 400 and e.value.param == "max_tokens" and e.value.code == "kv_budget_exceeded"
    assert b.waiting == 1  # the refused request never queued


def test_no_budget_no_admission_limit(tokenizer: Any) -> None:
    for source in (None, budget_source(None)):
        b = Batcher(scripted(tokenizer), source, max_batch=4, prefill_chunk=16, prompt_cache_size=0)
        assert b.kv_admission is None
        for _ in range(6):
            b.submit([1] * 4000, 4000)
        assert len(b.take_waiting()) == 4 and b.kv_reserved() == 0


def test_prefix_cache_is_bounded_by_the_allowance_and_gives_way(tokenizer: Any) -> None:
    layout = KVLayout((PER_TOKEN,), (None,))
    allowance = 2 * layout.bytes_for(100, KV_STEP)
    b = Batcher(scripted(tokenizer), budget_source(allowance), prefill_chunk=16, prompt_cache_size=4,
                prompt_cache_bytes=1 << 30)
    assert b.prefix_cache.max_bytes == allowance
    entry = [KVCache()]
    _feed(entry[0], [64], heads=1, dim=32)  # 256 positions allocated
    b.prefix_cache.insert(list(range(64)), entry)
    held = b.prefix_cache.nbytes
    assert held > 0
    b.submit([1] * 50, 50)
    assert len(b.take_waiting()) == 1  # fits beside the entry
    b.submit([2] * 50, 50)
    # Two requests' worst cases fill the allowance: the entry is dropped to make room.
    assert len(b.take_waiting()) == 1 and b.prefix_cache.nbytes == 0


def test_http_refusal_names_the_budget(tokenizer: Any) -> None:
    model = scripted(tokenizer)
    allowance = KVLayout((PER_TOKEN,), (None,)).bytes_for(600, KV_STEP)

    @contextlib.asynccontextmanager
    async def factory() -> Any:
        yield Engine(model=model, source=budget_source(allowance), audit=lambda: (True, []),
                     description={"model": "scripted"})

    app = create_app(factory, ServeSettings(prompt_cache_size=0, max_tokens_limit=4096, prefill_chunk=16))
    before = mx.set_cache_limit(0)  # the server sets MLX's process-wide limit: given back after
    mx.set_cache_limit(before)
    with contextlib.ExitStack() as restore:
        restore.callback(mx.set_cache_limit, before)
        srv = restore.enter_context(BackgroundServer(app))
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "scripted", "prompt": "hi", "max_tokens": 2000},
                       timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "KV allowance" in err["message"] and "memory=1 GiB" in err["message"]
        assert err["code"] == "kv_budget_exceeded" and err["param"] == "max_tokens"
        ok = httpx.post(f"{srv.url}/v1/completions", json={"model": "scripted", "prompt": "hi", "max_tokens": 5},
                        timeout=30)
        assert ok.status_code == 200, ok.text
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("asyncside_") and len(line.split()) == 2}
        assert values["asyncside_kv_allowance_bytes"] == allowance
        assert values["asyncside_kv_reserved_bytes"] == 0
        # MLX's freed buffers get what the headroom leaves beside the KV allowance
        assert values["asyncside_mlx_cache_limit_bytes"] == 2 * allowance


# --- the plan's KV allowance --------------------------------------------------------------------


def test_plan_grants_a_kv_allowance_only_under_a_budget(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from asyncside import ExpertStore, memory
    from asyncside.runtime import _plan as plan_mod

    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)
    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(1 << 40, "test"))
    rng = np.random.default_rng(0)
    store = ExpertStore.create(tmp_path / "s", {layer: {"w": rng.integers(0, 255, size=(16, 4096), dtype=np.uint8)}
                                                for layer in range(2)})

    def plan(memory_arg: Any) -> Any:
        return plan_mod.plan_memory(store, list(store.layers), resident=0.25, pinned=None, side_rows=None,
                                    min_side_rows=4, memory=memory_arg, direct=None, host_tier="auto",
                                    tier_possible=False)

    budgeted = plan("1G")
    own = int(budgeted.headroom_bytes * plan_mod.KV_SHARE)
    assert budgeted.kv_allowance_bytes == own + budgeted.kv_spare_bytes and own > 0
    assert budgeted.as_dict()["kv_allowance_bytes"] == budgeted.kv_allowance_bytes
    assert "KV allowance 128.0 MiB" in budgeted.describe()
    free = plan(None)
    assert free.kv_allowance_bytes is None and free.as_dict()["kv_allowance_bytes"] is None
    assert "KV allowance" not in free.describe()


# --- the real embedded model: mlx-lm's caches never hold more than admission reserved -----------


class Measured(Batcher):
    """A Batcher that measures, after every step, the bytes of every KV cache it holds (the merged
    batch caches, each request's own, the prefix cache) beside what admission reserved."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: list[tuple[int, int]] = []

    async def step(self) -> None:
        from asyncside.serving.prompt_cache import cache_nbytes

        await super().step()
        if self._inflight is not None:
            mx.eval([c.keys for c in self._merged.layers or [] if c.keys is not None])
        own = sum(cache_nbytes(s.cache) for s in self._active if s.cache is not None)
        merged = cache_nbytes(self._merged.layers or [])
        self.held.append((own + merged + self.prefix_cache.nbytes, self.kv_reserved() + self.prefix_cache.nbytes))


@pytest.mark.asyncio
async def test_real_caches_stay_within_what_admission_reserved() -> None:
    import dataclasses

    from asyncside.models import load_streaming_model
    from asyncside.runtime import Runtime
    from asyncside.serving import embedded_store_dir
    from asyncside.serving.kv_budget import model_kv_layout

    sm = load_streaming_model(embedded_store_dir())
    layout = model_kv_layout(sm)
    config = sm.config
    assert layout.bytes_per_token == (config["num_hidden_layers"] * 2 * config["num_key_value_heads"]
                                      * config["head_dim"] * 4)  # the embedded model computes in float32
    tok = sm.tokenizer
    prompts = [tok.encode(p * k) for p, k in (("The quick brown fox ", 3), ("0 1 2 3 4 ", 20), ("MoE ", 2))]
    worst = max(layout.bytes_for(len(p) + 24, 32) for p in prompts)
    allowance = 2 * worst  # two of these at a time
    async with Runtime(sm.store, resident=0.5) as rt:
        rt._plan = dataclasses.replace(rt._plan, kv_allowance_bytes=allowance)
        b = Measured(sm, rt, prefill_chunk=32, prompt_cache_size=2, max_batch=8)
        gens = [b.submit(p, 24) for p in prompts * 3]

        async def read(g: Any) -> None:
            async for _ in g:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(b.run)
            async with anyio.create_task_group() as readers:
                for g in gens:
                    readers.start_soon(read, g)
            tg.cancel_scope.cancel()
    assert all(g.finish_reason in ("length", "stop") for g in gens)
    assert b.held and max(h for h, _ in b.held) > 0
    over = [(h, r) for h, r in b.held if h > r]
    assert not over, over
    assert max(r for _, r in b.held) <= allowance


def direct_source(allowance: int, rows: int, direct: bool = True) -> Any:
    """A source whose plan grants ``allowance`` bytes of KV caches and ``rows`` pool rows a layer,
    reading past the page cache or not."""
    plan = types.SimpleNamespace(kv_allowance_bytes=allowance, source="memory=1 GiB, test", headroom_bytes=None,
                                 direct=direct, rows={0: rows + 3, 1: rows})
    return types.SimpleNamespace(plan=plan)


def test_rows_concurrency_is_what_the_smallest_layer_holds_a_step_of() -> None:
    from asyncside.serving.kv_budget import rows_concurrency

    model = types.SimpleNamespace(config={"num_experts_per_tok": 8})
    assert rows_concurrency(direct_source(1, 11).plan, model) == 1   # 11 rows: one request's 8 experts
    assert rows_concurrency(direct_source(1, 64).plan, model) == 8
    assert rows_concurrency(direct_source(1, 5).plan, model) == 1    # never none at all
    assert rows_concurrency(direct_source(1, 64, direct=False).plan, model) is None  # misses are copies
    nested = types.SimpleNamespace(config={"text_config": {"num_experts_per_tok": 4}})
    assert rows_concurrency(direct_source(1, 16).plan, nested) == 4
    assert rows_concurrency(direct_source(1, 16).plan, types.SimpleNamespace(config={})) is None


@pytest.mark.anyio
async def test_past_the_page_cache_the_rows_hold_the_batch(tokenizer: Any) -> None:
    """Requests beyond what the pools' rows hold a step of wait their turn, in order, and all finish;
    the same plan reading through the page cache batches them."""
    model = scripted(tokenizer)
    model.config.update(num_experts_per_tok=4)
    prompt = list(tokenizer.encode("a question"))
    roomy = 1 << 30  # the KV allowance never binds here
    b = Watched(model, direct_source(roomy, rows=8), max_batch=32, prefill_chunk=16, prompt_cache_size=0)
    assert b.kv_admission is not None and b.kv_admission.max_active == 2
    # The rows' bound is the tuner's ceiling; it starts at one request and climbs only on measurements.
    assert b.kv_admission.tuner is not None and b.kv_admission.tuner.limit == 1
    # A tuner that judges every turn: its first probe (to the ceiling) admits a second request.
    b.kv_admission.tuner = ConcurrencyTuner(2, window_s=0.0, window_tokens=1)
    slots = await _serve_all(b, [(prompt, 6)] * 7)
    assert all(s.finish_reason == "length" for s in slots)
    assert max(b.batch_sizes) == 2  # the rows, not max_batch, held the batch
    assert b.admitted == [id(s) for s in slots]
    assert b.kv_admission.row_waits > 0
    assert b.kv_admission.tuner.windows > 0 and b.kv_admission.tuner.probes > 0  # the engine fed it

    held = Watched(model, direct_source(roomy, rows=8), max_batch=32, prefill_chunk=16, prompt_cache_size=0)
    assert held.kv_admission is not None and held.kv_admission.tuner is not None
    held.kv_admission.tuner.window_s = 3600.0  # no window ends: the limit stays at its start
    await _serve_all(held, [(prompt, 6)] * 7)
    assert max(held.batch_sizes) == 1

    cached = Watched(model, direct_source(roomy, rows=8, direct=False), max_batch=32, prefill_chunk=16,
                     prompt_cache_size=0)
    assert cached.kv_admission is not None and cached.kv_admission.max_active is None
    await _serve_all(cached, [(prompt, 6)] * 7)
    assert max(cached.batch_sizes) > 2


def test_rows_concurrency_can_be_set_or_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncside.errors import AsyncsideError
    from asyncside.serving.kv_budget import rows_concurrency

    model = types.SimpleNamespace(config={"num_experts_per_tok": 8})
    plan = direct_source(1, 11).plan
    monkeypatch.setenv("ASYNCSIDE_ROWS_CONCURRENCY", "off")
    assert rows_concurrency(plan, model) is None
    monkeypatch.setenv("ASYNCSIDE_ROWS_CONCURRENCY", "3")
    assert rows_concurrency(plan, model) == 3
    # A count set is held as it is (no tuning), past the rows' own bound too.
    shaped = types.SimpleNamespace(config={"num_experts_per_tok": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 16,
                                           "head_dim": 8, "torch_dtype": "float16"})
    admission = plan_admission(shaped, direct_source(1 << 30, rows=11), 16, PrefixCache(0, 16))
    assert admission is not None and admission.tuner is not None and admission.tuner.fixed
    assert admission.limit == 3
    admission.observe(0.0, 0, True)
    admission.observe(100.0, 1000, True)
    assert admission.limit == 3 and admission.tuner.windows == 0
    monkeypatch.setenv("ASYNCSIDE_ROWS_CONCURRENCY", "auto")
    assert rows_concurrency(plan, model) == 1
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("ASYNCSIDE_ROWS_CONCURRENCY", bad)
        with pytest.raises(AsyncsideError, match="ASYNCSIDE_ROWS_CONCURRENCY"):
            rows_concurrency(plan, model)


def test_metrics_show_the_rows_ceiling_and_the_tuned_limit(tokenizer: Any) -> None:
    """Past the page cache, /metrics gauges the rows' ceiling and the limit the tuner holds now."""
    model = scripted(tokenizer)
    model.config.update(num_experts_per_tok=4)

    @contextlib.asynccontextmanager
    async def factory() -> Any:
        yield Engine(model=model, source=direct_source(1 << 30, rows=16), audit=lambda: (True, []),
                     description={"model": "scripted"})

    app = create_app(factory, ServeSettings(prompt_cache_size=0, max_tokens_limit=4096, prefill_chunk=16))
    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)
    with contextlib.ExitStack() as restore:
        restore.callback(mx.set_cache_limit, before)
        srv = restore.enter_context(BackgroundServer(app))
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("asyncside_") and len(line.split()) == 2}
    assert values["asyncside_max_active_by_rows"] == 4  # 16 rows, top-4
    assert values["asyncside_active_limit"] == 1  # the tuner starts at one request
