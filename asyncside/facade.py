"""``load``: a streaming model that mlx-lm's own functions take, as ``mlx_lm.load`` returns one.

    from mlx_lm import generate, stream_generate, batch_generate
    from asyncside.facade import load

    model, tokenizer = load("mlx-community/Qwen3-30B-A3B-4bit", resident=0.25)
    print(generate(model, tokenizer, "Hello", max_tokens=32))

``load`` takes what :func:`asyncside.hub.store_for` takes (an expert store, an mlx-lm model
directory or a Hugging Face repo id; a model is converted on first use into asyncside's cache)
and returns ``(model, tokenizer)``: ``tokenizer`` is mlx-lm's ``TokenizerWrapper`` of the model's
tokenizer files (of the byte-level tokenizer for a store that names asyncside's byte tokenizer, as
a bench shape's does), ``model`` a :class:`StreamingLM`, whose synchronous ``model(inputs, cache=cache)``
returns the logits an mlx-lm model returns. That is all ``generate``, ``stream_generate``,
``batch_generate`` and ``make_prompt_cache`` need of a model (with ``layers``, and ``make_cache``
where the mlx-lm model has one), so they run unchanged, and their tokens equal the all-resident model's.

**Where things run.** The :class:`~asyncside.runtime.Runtime` (expert pools, reads, fault tables)
lives on a background thread running an asyncio event loop; a call submits the step there and waits
for its logits. MLX streams belong to the thread that made them, so an array is never handed
lazily from one thread to the other: the caller's inputs and caches are evaluated on the caller's
thread before the step is submitted (they are a token or two and what the cache already holds),
and everything the step made (logits, cache updates) is computed before the call returns. A
decode step is then a queued step, as in :meth:`StreamingModel.generate`: the loop thread awaits
only its result.

Unlike an mlx-lm model, whose prefill calls leave their logits lazy (never computed when nobody
reads them), every call computes its logits over every position it was given: a prefill chunk of
L tokens costs one LM head product of L rows more than mlx-lm's.

The runtime is closed by :meth:`StreamingLM.close` (or ``with`` the model), once a model dropped
without it is collected, and at interpreter exit for models still open. Every model's runtime
shares one background thread.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import numbers
import os
import pathlib
import tempfile
import threading
import weakref
from collections.abc import Callable, Coroutine, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
import numpy as np

from .errors import AsyncsideError

__all__ = ["StreamingLM", "load"]

T = TypeVar("T")

_OPEN: weakref.WeakSet[StreamingLM] = weakref.WeakSet()

#: What a library around mlx-lm reaches for on a model as an ``mlx.nn.Module`` (LoRA tooling,
#: ``nn.quantize``, weight loading, a server counting parameters). None of it can work on a model
#: whose experts live in the store: refused by name, not an AttributeError deep inside MLX.
_MODULE_API = frozenset({
    "parameters", "trainable_parameters", "children", "leaf_modules", "modules", "named_modules",
    "update", "update_modules", "apply", "apply_to_modules", "filter_and_map", "freeze", "unfreeze",
    "train", "load_weights", "save_weights", "set_dtype", "state",
})

#: mlx_lm.load's own keyword arguments, which load() does not take, and what to do instead.
_MLX_LM_LOAD_ARGUMENTS = {
    "adapter_path": "a LoRA adapter is not applied to a streamed model; fuse it into the model (mlx_lm.fuse) "
                    "and load the fused directory",
    "tokenizer_config": "the tokenizer is the one the store holds; to load it otherwise, pass a tokenizer of your "
                        "own (mlx_lm.tokenizer_utils.load_tokenizer) to generate",
    "trust_remote_code": "the tokenizer is the one the store holds; to load it otherwise, pass a tokenizer of your "
                         "own (mlx_lm.tokenizer_utils.load_tokenizer) to generate",
    "model_config": "the model is built from its store's config.json; change the model directory's config.json "
                    "and load that directory (it is converted again)",
    "lazy": "a streamed model reads its experts as tokens route to them; leave lazy out",
    "return_config": "the model's config is model.streaming.config; leave return_config out",
}


def _cache_arrays(obj: Any, out: list[mx.array], depth: int = 0) -> list[mx.array]:
    """Every mx.array a cache object (or a list of them) holds, to evaluate on one thread before
    another thread reads it."""
    if isinstance(obj, mx.array):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _cache_arrays(x, out, depth)
    elif isinstance(obj, dict):
        for x in obj.values():
            _cache_arrays(x, out, depth)
    elif depth < 3 and hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            _cache_arrays(x, out, depth + 1)
    return out


class _LoopThread:
    """A daemon thread running an asyncio event loop: every StreamingLM's runtime lives on it.

    The thread never ends, even once its loop is stopped (at interpreter exit): it parks instead.
    A thread that used MLX holds thread-local MLX state (its streams, mlx-lm's compiled functions)
    whose destructors, run as the thread ends, take the GIL; ending it while the interpreter
    finalizes aborts the process (std::terminate). A parked thread ends with the process, no
    destructor run.
    """

    def __init__(self, name: str) -> None:
        #: the process the thread runs in: a forked child has no copy of it
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()
            self._stopped.set()
        threading.Event().wait()  # parked for good (see the class docstring)

    @property
    def running(self) -> bool:
        # In a forked child the loop is nobody's: what waited on it there (a step, the close at
        # exit) waited forever, and a load there must start a thread of its own.
        return self.pid == os.getpid() and not self._stopped.is_set()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        # Run in a context of its own, not a copy of the caller's: called inside trio.run, sniffio's
        # variable there said trio, and anyio in the runtime's task refused the asyncio loop it runs on.
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise AsyncsideError("a StreamingLM was called from its own runtime thread")
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            # The wait was interrupted (Ctrl-C in a notebook), not the step: it goes on updating the
            # caller's cache on this thread's stream. Returned now, the caller's next call (the same
            # prompt_cache) raced it and read arrays on a stream its own thread lacks ("There is no
            # Stream"): the interruption lands once the step has ended, as mlx-lm's eval ends first.
            if not future.done():
                concurrent.futures.wait([future])
            raise

    def stop(self, timeout: float) -> None:
        """Stop the loop (its tasks are left as they are) and wait until the thread has parked."""
        if self.running:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._stopped.wait(timeout)


_THREAD: _LoopThread | None = None
_THREAD_LOCK = threading.Lock()


def _runtime_thread() -> _LoopThread:
    """The process's runtime thread, started on first use."""
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None or not _THREAD.running:
            _THREAD = _LoopThread("asyncside-runtime")
        return _THREAD


def _at_exit() -> None:
    """Close the runtimes still open, then stop the runtime thread's loop."""
    for lm in list(_OPEN):
        lm.close()
    with _THREAD_LOCK:
        thread = _THREAD
    if thread is not None:
        thread.stop(10.0)


atexit.register(_at_exit)


async def _hold(streaming: Any, kwargs: dict[str, Any],
                ready: concurrent.futures.Future[tuple[Any, asyncio.Event]]) -> None:
    """A StreamingLM's runtime's lifetime: opened here, held until its stop event is set (by
    :meth:`StreamingLM.close` or the model's collection), closed in this task."""
    from .runtime import Runtime

    stop = asyncio.Event()
    try:
        async with Runtime(streaming.store, **kwargs) as rt:
            streaming.source = rt
            ready.set_result((rt, stop))
            await stop.wait()
    except BaseException as exc:
        if not ready.done():
            ready.set_exception(exc)
        raise
    finally:
        streaming.source = None


def _release(thread: _LoopThread, stop: asyncio.Event) -> None:
    """Ask a collected StreamingLM's runtime task to close its runtime; waits for nothing (the
    collection may run on any thread, the runtime's own included)."""
    if thread.running:
        try:
            thread.loop.call_soon_threadsafe(stop.set)
        except RuntimeError:  # the loop closed meanwhile (interpreter exit): nothing left to stop
            pass


class StreamingLM:
    """An mlx-lm style model (synchronous ``model(inputs, cache=cache)``) over a streaming model
    whose runtime runs on a background event-loop thread. Made by :func:`load`.

    ``streaming`` is the :class:`~asyncside.models.StreamingModel`; :meth:`stats` the runtime's
    counters. Safe to call from several threads (steps run one at a time, in arrival order).
    """

    def __init__(self, streaming: Any, runtime_kwargs: dict[str, Any]) -> None:
        self.streaming = streaming
        self.model_type = streaming.config.get("model_type")
        self.args = getattr(streaming.model, "args", None)
        from .serving.loading import text_config_value

        vocab = text_config_value(streaming, "vocab_size")
        self._vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
        self._thread = _runtime_thread()
        self._closed = False
        #: (the model's KV layout, its activations' bytes), read at the first call under a KV
        #: allowance (None: the config does not say the cache's size, or not read yet)
        self._kv_layout: tuple[Any, int] | None = None
        self._kv_layout_read = False
        self._lock = threading.Lock()
        ready: concurrent.futures.Future[tuple[Any, asyncio.Event]] = concurrent.futures.Future()
        # The task holds the streaming model, never this object: a model dropped without close()
        # is collected, and its finalizer ends the task (the pools and reads go with it).
        self._host: concurrent.futures.Future[None] = self._thread.submit(_hold(streaming, runtime_kwargs, ready))
        try:
            self.runtime, self._stop = ready.result()
        except BaseException:
            # Interrupted while the runtime was entered (Ctrl-C in a notebook during load()): the
            # task went on, entered the runtime and held its pools, reads and descriptors until
            # the process ended, with no model left to close it. Cancelled, it leaves the entry
            # (or closes the runtime it entered) before the interruption goes on.
            self._host.cancel()
            concurrent.futures.wait([self._host], timeout=30.0)
            raise
        self._release = weakref.finalize(self, _release, self._thread, self._stop)
        self._release.atexit = False  # _at_exit closes the models still open, waiting for each
        _OPEN.add(self)

    # -- what mlx-lm reads of a model --------------------------------------------------------

    @property
    def layers(self) -> Any:
        """The decoder layers (``make_prompt_cache`` counts them when a model has no make_cache)."""
        return self.streaming.model.layers

    @property
    def make_cache(self) -> Callable[[], list[Any]]:
        """The model's own cache maker, where its mlx-lm model has one (gpt_oss, llama4, ...).

        An AttributeError otherwise, as reading it on the mlx-lm model gives: ``make_prompt_cache``
        asks ``hasattr(model, "make_cache")`` and, where it is missing, builds the caches its
        arguments name (``max_kv_size``: rotating caches). A maker there for every model made
        ``generate(..., max_kv_size=...)`` keep every key, where mlx-lm keeps a window.
        """
        if not hasattr(self.streaming.model, "make_cache"):
            raise AttributeError(f"{type(self.streaming.model).__module__} models have no make_cache: "
                                 f"make_prompt_cache builds their caches")
        return self.streaming.make_cache

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> mx.array:
        """The logits (B, L, vocab) of ``inputs`` (B, L), computed; updates ``cache`` in place."""
        self._check_keywords(kwargs)
        # Before any MLX work, mx.array of a list included: in a forked child the first one waits
        # forever on the CPU, and crashes the child on MLX CUDA (CUDA is unusable after a fork).
        self._check_process()
        if isinstance(inputs, list):
            # The mlx-lm model indexes its embedding with a nested list of ids as with an array.
            inputs = mx.array(inputs)
        elif not isinstance(inputs, mx.array):
            raise TypeError(f"inputs: expected an mx.array of token ids of shape (batch, tokens), got "
                            f"{type(inputs).__name__}: mx.array(...) of it")
        if self._closed:
            raise AsyncsideError("this model was closed (StreamingLM.close)")
        from .models.loading import clear_streams_at_thread_end

        clear_streams_at_thread_end()  # the inputs and caches are evaluated on this thread
        if cache is None:
            cache = self.streaming.make_cache()
        # Both are the caller's thread's arrays (lazy on its streams): computed here, they are
        # plain buffers to the runtime's thread.
        try:
            mx.eval(inputs, _cache_arrays(cache, []))
        except ValueError as e:
            if "function transformations" not in str(e):
                raise
            # MLX's own message names the transformation, not why the model cannot be in one.
            raise ValueError(
                "model(...) inside mx.compile, mx.vmap or a gradient: a streamed model's step reads experts from "
                "the store as its tokens route to them and runs on the runtime's thread, so it cannot be traced "
                "into one graph; call it outside the transformation (as mlx-lm's generate does)") from e
        if self._vocab is not None and inputs.size and mx.issubdtype(inputs.dtype, mx.integer):
            from .models.streaming import outside_vocabulary

            # One past the vocabulary killed the process with SIGSEGV on the runtime thread.
            bad = outside_vocabulary(np.asarray(inputs), self._vocab)
            if bad is not None:
                raise ValueError(f"inputs: token id {bad}, outside the model's vocabulary [0, {self._vocab})")
        self._check_kv(inputs, cache)
        try:
            return self._thread.call(self._step(inputs, cache))
        except RuntimeError as e:
            if "There is no Stream" not in str(e):
                raise
            # The inputs and caches were computed above: what the step found lazy on the caller's
            # stream is a weight of the model's own, changed on the caller's thread and not computed
            # (mlx-lm's LoRA tooling adds its layers to model.layers before it fails on the model).
            raise AsyncsideError(
                "the step read a weight of the model made on another thread and not yet computed (model.layers "
                "changed: LoRA layers, update()); compute it on that thread first: "
                "mx.eval(model.streaming.model.parameters()). This call's prompt_cache may hold part of the "
                "step") from e

    def _check_keywords(self, kwargs: dict[str, Any]) -> None:
        """Refuse a keyword the call would not apply: a TypeError for one the mlx-lm model does not
        take either (``cahce=``, ``mask=`` to most), an AsyncsideError for one it takes and would
        apply (``input_embeddings``, a ``mask`` where its ``__call__`` has one); None for one it
        takes is its default, and passes."""
        # Swallowed, a misspelt cache gave the logits of no earlier tokens, and a mask went unapplied.
        if not kwargs:
            return
        import inspect

        try:
            taken = set(inspect.signature(type(self.streaming.model).__call__).parameters)
        except (TypeError, ValueError):
            taken = set()
        for name, value in kwargs.items():
            if name not in taken - {"self", "inputs", "x", "cache"}:
                raise TypeError(f"StreamingLM.__call__() got an unexpected keyword argument {name!r} (the mlx-lm "
                                f"model of {self.model_type or 'this'} type takes none of that name either)")
            if value is None:  # the mlx-lm model's own default: nothing to apply
                continue
            if name == "input_embeddings":
                # Refused, not missing: the runtime routes by token ids, and embeddings given instead
                # (a multimodal prompt) would bypass the embedding the streamed layers start from.
                raise AsyncsideError("input_embeddings: a streaming model takes token ids only; pass the prompt's "
                                     "token ids (mlx-lm's generate does unless input_embeddings is given)")
            raise AsyncsideError(f"{name}: the streamed forward computes from the token ids and the cache alone "
                                 f"(its causal mask its own) and would not apply it; leave {name} out")

    def _check_kv(self, inputs: mx.array, cache: list[Any]) -> None:
        """Refuse (AsyncsideError, before the step, the cache untouched) a call whose step would take
        ``cache`` past the memory plan's KV allowance, as :meth:`StreamingModel.generate` refuses a
        generation whose cache would: mlx-lm's generate calls the model once a token and never says
        how many tokens it will ask for, so the step that would pass it is the one refused."""
        plan = getattr(self.runtime, "plan", None)
        allowance = getattr(plan, "kv_allowance_bytes", None)
        if plan is None or not isinstance(allowance, int) or inputs.ndim != 2:
            return
        if not self._kv_layout_read:
            from .kv_layout import model_kv_layout

            self._kv_layout_read = True
            try:
                self._kv_layout = (model_kv_layout(self.streaming), _element_bytes(self.streaming))
            except AsyncsideError:  # a config that does not say the cache's size: not counted
                self._kv_layout = None
        if self._kv_layout is None:
            return
        layout, element = self._kv_layout
        rows, new = int(inputs.shape[0]), int(inputs.shape[1])
        need = _kv_bytes(layout, element, cache, rows, new)
        if need is None or need[1] <= allowance:
            return
        from .memory import describe_bytes

        positions, nbytes = need
        most = plan.kv_tokens(layout)
        batch = f" for each of {rows} sequences" if rows > 1 else ""
        raise AsyncsideError(
            f"this call would take the KV cache to {positions} positions{batch}, which may need "
            f"{describe_bytes(nbytes)} ({layout.bytes_per_token:,} bytes a position, allocated {layout.step} at a "
            f"time), past the KV allowance of {describe_bytes(allowance)} under the memory budget "
            f"({getattr(plan, 'source', 'memory=')}); one sequence's cache may reach {most} positions: ask for "
            f"fewer tokens (max_tokens), trim the prompt cache, or load with a larger memory budget")

    def _check_process(self) -> None:
        """AsyncsideError in a process forked from the one that loaded the model (``os.fork``,
        multiprocessing's 'fork' start method, a server's ``--preload``): its runtime thread, reads
        and MLX's threads stayed there, and a step waited forever."""
        if self._thread.pid != os.getpid():
            from .models.loading import FORK_ADVICE

            raise AsyncsideError(
                f"this model was loaded in process {self._thread.pid}, and this process was forked from it: "
                f"its runtime thread and MLX's threads stayed in that process. {FORK_ADVICE}")

    async def _step(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        logits = await self.streaming(inputs, cache)
        # The step's keys and values were computed with its logits; what it may have left lazy in
        # the cache is bookkeeping (a batch cache's offsets), computed here on the thread whose
        # stream it is on, in no time: the stream has nothing else queued (one step at a time).
        mx.eval(_cache_arrays(cache, []))
        return logits

    # -- what an mlx.nn.Module has -----------------------------------------------------------

    def eval(self) -> StreamingLM:
        """The model, as ``nn.Module.eval`` returns it: a streamed model only ever infers."""
        return self

    if not TYPE_CHECKING:  # a type checker still tells a misspelt attribute of the model
        def __getattr__(self, name: str) -> Any:
            # Reached only for a name the class does not have: mlx.nn.Module's API is refused by
            # name (still an AttributeError, so hasattr() keeps answering False).
            if isinstance(getattr(type(self), name, None), property):
                # A property that raised AttributeError (make_cache where the model has none) lands
                # here: its own message, not this method's, is the one the caller reads.
                return object.__getattribute__(self, name)
            if name in _MODULE_API:
                raise AttributeError(
                    f"StreamingLM.{name}: asyncside.load's model is no mlx.nn.Module, its experts stream from "
                    f"the expert store into fixed pools; quantizing, training, LoRA, loading weights or "
                    f"enumerating all its parameters would need every expert in memory. Its resident weights "
                    f"(attention, norms, routers, embeddings) are model.streaming.model's; for the whole model, "
                    f"use mlx_lm.load")
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- the rest -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The runtime's counters (hits, misses, bytes read, ...), read on its thread."""
        self._check_process()

        async def read() -> dict[str, Any]:
            return dict(self.runtime.stats())

        return self._thread.call(read())

    def close(self, timeout: float = 30.0) -> None:
        """Close the runtime (every read lands, every task ends); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _OPEN.discard(self)
        self._release.detach()
        if self._thread.running:
            _release(self._thread, self._stop)
            try:
                self._host.result(timeout)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass

    def __enter__(self) -> StreamingLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<StreamingLM {self.streaming.model_id} ({self.model_type}), {state}>"


def _element_bytes(streaming: Any) -> int:
    """Bytes of one element of the model's activations, which its KV caches store unquantized."""
    from .kv_layout import _model_element_bytes

    return _model_element_bytes(streaming)


def _kv_bytes(layout: Any, element: int, cache: list[Any], rows: int, new: int) -> tuple[int, int] | None:
    """(the most positions a layer's cache holds, the bytes ``cache`` may take at worst) once a step
    of ``rows`` sequences and ``new`` tokens each has run, counted as the KV allowance counts a
    generation's (:meth:`asyncside.kv_layout.KVLayout.bytes_for`: ``step`` positions allocated at a
    time) from what each layer's cache has fed, its window where it keeps one (``max_kv_size``'s
    rotating caches, a sliding or chunked layer's), and its bits where it is quantized (``kv_bits``).
    None where a layer's cache does not say how much it holds (a cache type mlx-lm adds): not counted."""
    if len(cache) != len(layout.per_token):
        return None
    most = total = 0
    for c, per, window in zip(cache, layout.per_token, layout.windows):
        fed = getattr(c, "offset", None)
        if not isinstance(fed, (int, np.integer)):
            fed = getattr(c, "_idx", None)  # a batch cache: its rows' shared buffer, left padding included
        if isinstance(fed, bool) or not isinstance(fed, (int, np.integer)):
            return None
        positions = int(fed) + new
        room = positions + layout.step - 1
        for name in ("max_size", "chunk_size"):
            kept = getattr(c, name, None)
            if isinstance(kept, int) and not isinstance(kept, bool):
                window = kept if window is None else min(window, kept)
        if window is not None:
            room = min(room, window + max(new, layout.step))
            positions = min(positions, window + new)
        nbytes = per * room
        bits, group = getattr(c, "bits", None), getattr(c, "group_size", None)
        if isinstance(bits, int) and isinstance(group, int) and group > 0:
            # packed elements plus a scale and a bias (of the activations' dtype) per group
            nbytes = nbytes * (bits * group + 16 * element) // (8 * element * group)
        most = max(most, positions)
        total += nbytes * rows
    return most, total


def _check_runtime_arguments(runtime: MutableMapping[str, Any], resident: float | str,
                             memory: int | str | None) -> None:
    """Refuse what :func:`load` would hand the Runtime and it would refuse, before a model is
    converted (minutes for a large one) or loaded: a name the Runtime does not take (a misspelt
    ``polcy=``), an unknown policy or reader, and every argument the Runtime checks without a
    store (:func:`asyncside.runtime.check_arguments`). The Runtime refused them only once made,
    after both."""
    import inspect

    from .policies import make_policy
    from .readers import check_reader_name
    from .runtime import Runtime, check_arguments

    taken = [n for n in inspect.signature(Runtime.__init__).parameters if n not in ("self", "store")]
    unknown = [n for n in runtime if n not in taken]
    for name in unknown:
        if name in _MLX_LM_LOAD_ARGUMENTS:
            # Code written for mlx_lm.load passes them: told so, not handed the Runtime's names.
            raise TypeError(f"load() got an unexpected keyword argument {name!r}: mlx_lm.load's, which "
                            f"asyncside.load does not take: {_MLX_LM_LOAD_ARGUMENTS[name]}")
    if unknown:
        raise TypeError(f"load() got an unexpected keyword argument {unknown[0]!r} (besides its own, it takes the "
                        f"Runtime's: {', '.join(n for n in taken if n not in ('resident', 'memory'))})")
    if "policy" in runtime:
        make_policy(runtime["policy"])
    if "reader" in runtime:
        check_reader_name(runtime["reader"])
    # The rest the Runtime checks without a store (verify="no", side_rows=-1, layers=[True]): the
    # Runtime refused them after the model was converted and loaded.
    plain = inspect.signature(check_arguments).parameters
    checked = check_arguments(resident=resident, memory=memory, **{n: v for n, v in runtime.items() if n in plain})
    if "layers" in runtime:  # an iterator was read by the check: the Runtime gets the list
        runtime["layers"] = checked["layers"]


def load(path_or_id: str | os.PathLike[str], *, resident: float | str | None = None,
         memory: int | str | None = None, cache_dir: str | os.PathLike[str] | None = None,
         revision: str | None = None, progress: bool = True, **runtime: Any) -> tuple[StreamingLM, Any]:
    """``(model, tokenizer)`` for mlx-lm's ``generate`` / ``stream_generate`` / ``batch_generate``.

    ``path_or_id``: an expert store, an mlx-lm model directory or a Hugging Face repo id (see
    :mod:`asyncside.hub`; a model is converted on first use into ``cache_dir``, default
    asyncside's cache). ``resident``: the share of each layer's experts the pools hold, or
    ``"auto"`` (sized to the memory budget); default 0.25, or ``"auto"`` when ``memory`` is given.
    ``memory``: the budget the runtime plans against (bytes or a size such as ``"8G"``; default
    what the machine has available), as :class:`~asyncside.runtime.Runtime` takes it.
    ``revision``: a repo id's branch, tag or commit (refused for a local path). Other
    keyword arguments go to the Runtime too (``reader``, ``policy``, ``verify``, ...).
    """
    from .hub import needs_a_tokenizer, store_for
    from .memory import check_memory, parse_size
    from .models import load_streaming_model
    from .models.loading import check_not_forked

    check_not_forked()  # before a conversion, whose reads wait forever there too
    if resident is None:
        resident = "auto" if memory is not None else 0.25
    # Bad arguments are refused here, before a model is converted or loaded, not at the first token.
    if memory is not None:
        # as --memory refuses it: "1.5" is a byte and a half, never a budget
        check_memory(parse_size(memory, what="memory"), memory)
    if isinstance(resident, str):
        # As Runtime(resident="25%") and --resident read it: the one parser, before converting.
        from .argtypes import parse_resident
        try:
            resident = parse_resident(resident)
        except ValueError as e:
            raise ValueError(f"resident: {e}") from None
    if resident != "auto" and (isinstance(resident, bool) or not isinstance(resident, numbers.Real)
                               or not 0.0 <= float(resident) <= 1.0):
        raise ValueError(f"resident: expected a fraction in [0, 1] or 'auto', got {resident!r}")
    _check_runtime_arguments(runtime, resident, memory)
    store_dir = store_for(path_or_id, cache_dir=cache_dir, revision=revision, progress=progress,
                          needs=needs_a_tokenizer("load() returns the model's tokenizer for mlx-lm's generate, "
                                                  "as mlx_lm.load does"))
    streaming = load_streaming_model(store_dir)
    layers = runtime.get("layers")
    if layers is not None and set(streaming.moe_layers) - set(layers):
        # A model's forward routes through every MoE layer: a subset loaded, and its first step
        # failed deep in the forward with "layer 1 is not streamed by this runtime".
        from .runtime._plan import PlanArgumentError

        missing = sorted(set(streaming.moe_layers) - set(layers))
        raise PlanArgumentError(f"layers: load() runs the whole model, whose every MoE layer streams; {list(layers)} "
                                f"leaves out {missing} (its MoE layers: {list(streaming.moe_layers)}): "
                                f"leave layers out")
    tokenizer = _mlx_tokenizer(store_dir, streaming)
    model = StreamingLM(streaming, {"resident": resident, "memory": memory, **runtime})
    return model, tokenizer


def _mlx_tokenizer(store_dir: str | os.PathLike[str], streaming: Any) -> Any:
    """mlx-lm's ``TokenizerWrapper`` of the tokenizer the streaming model encodes with (the one the
    demo and the server use); a StoreError naming ``store_dir`` where it has none.

    A store whose tokenizer is asyncside's byte tokenizer (a bench shape's) gets the byte-level
    tokenizer of the same ids as standard files would give it: mlx-lm, handed the directory alone,
    picks a tokenizer class by the model type and encodes with no vocabulary (or fails to build).
    """
    from mlx_lm.utils import load_tokenizer

    from .errors import StoreError
    from .models.tokenizer import ByteTokenizer, save_byte_level_tokenizer

    tok = streaming.tokenizer
    if tok is None:
        raise StoreError(store_dir, "holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model or asyncside_tokenizer.json): load() returns the model's tokenizer "
                         "for mlx-lm's generate; convert a model directory that has them")
    if not isinstance(tok, ByteTokenizer):  # files without a vocabulary: refused by load_tokenizer
        return tok
    limit = streaming.config.get("max_position_embeddings")
    with tempfile.TemporaryDirectory(prefix="asyncside-tokenizer-") as tmp:
        if isinstance(limit, int):
            save_byte_level_tokenizer(tmp, model_max_length=limit)
        else:
            save_byte_level_tokenizer(tmp)
        return load_tokenizer(pathlib.Path(tmp), eos_token_ids=sorted(tok.eos_token_ids))
