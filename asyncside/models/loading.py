"""Building models: the streaming model (no expert weights) and the plain mlx-lm reference.

A converted store directory holds, beside the expert blobs, ``config.json`` (mlx-lm config with
its ``quantization``), ``model.safetensors`` (every non-expert weight) and the tokenizer files.
:func:`load_streaming_model` builds the mlx-lm model class from that config with each switch
layer replaced by a :class:`PooledSwitch` *before* any weight is materialised (mlx-lm initialises
expert weights lazily, so the dropped ones are never allocated), then loads the non-expert weights
through mlx-lm's own ``load_model`` (same quantization path as ``mlx_lm.load``; not its
``sanitize``, which the converter already applied to the weights it stored).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes, infer_quant_config, load_config, load_model

from ..bridge import Completed
from ..errors import AsyncsideError, StoreError, os_reason
from .arch import UnsupportedModelError, arch_for, decoder_layers, moe_layers, switch_meta, top_k_attribute
from .forward import ForwardOptions
from .pooled import PooledSwitch, SwitchSpec, replace_switches
from .streaming import StreamingModel
from .tokenizer import load_tokenizer

#: key of the asyncside model description inside the store manifest's metadata
META_KEY = "asyncside_model"
NON_EXPERT_FILE = "model.safetensors"

#: what a process forked from one that loaded a model is told to do instead
FORK_ADVICE = ("Load the model in each worker process, with none loaded in the parent before it forks them "
               "(multiprocessing's 'spawn' or 'forkserver' start method; a server without --preload)")

#: the process that loaded a model here (None: none has)
_LOADED_IN: int | None = None


class _ClearStreams:
    """Held by a thread-local of a thread that ran MLX; dropped as the thread ends."""

    def __del__(self) -> None:
        mx.clear_streams()


_THREAD_END = threading.local()


def clear_streams_at_thread_end() -> None:
    """Have MLX's streams of the calling thread (not the main thread) destroyed as it ends, while
    it is still a Python thread.

    Why: MLX's thread-local state takes the GIL in its destructor, which runs after the thread has
    left Python. A thread that loaded or ran a model (``load()`` and ``generate`` in a worker
    thread, ``anyio.run`` of the README's loop in one) and ended as the interpreter exited aborted
    the process there: "terminate called without an active exception", exit status 134, once the
    work was done. MLX's own advice is ``mx.clear_streams()`` at the end of each thread.
    """
    if threading.current_thread() is threading.main_thread() or getattr(_THREAD_END, "held", None) is not None:
        return
    _THREAD_END.held = _ClearStreams()


def check_not_forked() -> None:
    """AsyncsideError in a process forked from one that had loaded a model: MLX's threads that
    loaded it (its loader's, its streams') are not in the child, where MLX's next load or step
    waited forever."""
    if _LOADED_IN is not None and _LOADED_IN != os.getpid():
        raise AsyncsideError(f"this process was forked from process {_LOADED_IN} after that process had loaded "
                             f"a model: MLX's threads stayed in it, and a load here would wait forever. "
                             f"{FORK_ADVICE}")


#: (model class, its ModelArgs class) of a config, as mlx-lm's ``get_model_classes`` hook returns
#: them; the model class is an nn.Module subclass built from a ModelArgs, which type[nn.Module]
#: (whose __init__ takes no argument) cannot say
ModelClasses = tuple[type[Any], type[Any]]


def _stripped_classes(specs: Mapping[int, SwitchSpec]) -> Callable[[dict[str, Any]], ModelClasses]:
    """A ``get_model_classes`` hook for mlx-lm's load_model: the model class, switch layers pooled."""

    def get_classes(config: dict[str, Any]) -> ModelClasses:
        model_class, args_class = _get_classes(config)
        arch = arch_for(config["model_type"])

        class Pooled(model_class):  # type: ignore[misc, valid-type]
            def __init__(self, args: Any) -> None:
                super().__init__(args)
                moe = moe_layers(self, arch)
                missing = sorted(set(moe) - set(specs))
                extra = sorted(set(specs) - set(moe))
                if missing or extra:
                    raise StoreError(
                        "config.json",
                        f"its model's MoE layers are {sorted(moe)}, the store's {sorted(specs)} (manifest.json "
                        f"metadata.{META_KEY}.switch): a config.json of another model than the one converted "
                        "into this store?",
                    )
                replace_switches(self, moe, specs)

            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                # A store's non-expert weights are the converted model's own parameters, which
                # mlx-lm's sanitize already made: applying it again is not always a no-op
                # (bailing_moe's norm_head divides its head by the column norms once more).
                return weights

        Pooled.__name__ = model_class.__name__
        Pooled.__qualname__ = model_class.__qualname__
        return Pooled, args_class

    return get_classes


def is_store_dir(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / "manifest.json").is_file()



def switch_specs(store: Any, path: pathlib.Path) -> tuple[dict[str, Any], dict[int, SwitchSpec]]:
    """The converter's metadata of ``store`` (at ``path``) and its per-layer switch descriptions;
    StoreError naming the field when the store was not written by the converter or is damaged."""
    meta = store.metadata.get(META_KEY)
    if not isinstance(meta, dict):
        raise StoreError(path / "manifest.json", "store was not written by the asyncside converter",
                         f"metadata.{META_KEY}")
    try:
        specs = {int(l): SwitchSpec.from_meta(m) for l, m in meta["switch"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(path / "manifest.json", f"bad switch description: {exc}",
                         f"metadata.{META_KEY}.switch") from None
    return meta, specs

def drop_loaded_weights(path: pathlib.Path, extra: Sequence[pathlib.Path] = ()) -> list[pathlib.Path]:
    """Evict the non-expert weight files of the store or model directory ``path``
    (``model*.safetensors``, what mlx-lm's loader reads), and the ``extra`` files, from the page
    cache once the model holds its own copy of them; returns the files advised (none on a platform
    without ``posix_fadvise``).

    Why: the loader reads them through the page cache and never again, and a memory cgroup charges
    those pages to the process beside the loaded weights, outside what the memory plan counts (it
    counts the process's resident bytes and the store's expert records)."""
    advise = getattr(os, "posix_fadvise", None)
    done: list[pathlib.Path] = []
    if advise is None:
        return done
    for f in [*sorted(path.glob("model*.safetensors")), *extra]:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # it loaded, so it was readable: gone since, nothing of it to drop
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done.append(f)
        except OSError:
            pass  # the file system keeps no such advice: nothing to drop
        finally:
            os.close(fd)
    return done


def load_streaming_model(model_dir_or_store: str | pathlib.Path, *, completed: Completed | None = None,
                         model_id: str | None = None, options: ForwardOptions | None = None) -> StreamingModel:
    """The streaming model of a converted store directory (see :func:`convert_model`).

    ``completed`` defaults to ``asyncside.bridge.completed``. A plain mlx-lm model directory is
    refused with a message saying how to convert it.
    """
    from ..store import ExpertStore

    global _LOADED_IN
    check_not_forked()
    clear_streams_at_thread_end()
    path = pathlib.Path(model_dir_or_store).absolute()
    if not is_store_dir(path):
        if (path / "config.json").is_file():
            raise StoreError(
                path,
                "this is an mlx-lm model directory, not an expert store; convert it first with "
                f"`asyncside convert {path} STORE_DIR` (or asyncside.models.convert_model)",
            )
        raise StoreError(path, "not an expert store (no manifest.json) nor a model directory (no config.json)")
    store = ExpertStore.open(path)
    meta, specs = switch_specs(store, path)
    if sorted(specs) != sorted(store.layers):
        raise StoreError(path / "manifest.json", f"switch layers {sorted(specs)} != store layers {list(store.layers)}",
                         f"metadata.{META_KEY}.switch")
    _check_gathered_dtypes(store, path)
    if not (path / NON_EXPERT_FILE).is_file():
        raise StoreError(path / NON_EXPERT_FILE, "non-expert weights are missing")
    if not (path / "config.json").is_file():
        raise StoreError(path / "config.json", "the model's config is missing (asyncside convert writes it beside "
                                               "the manifest)")
    _check_config_is_the_stores(path, meta)
    _LOADED_IN = os.getpid()
    try:
        model, config = load_model(path, lazy=False, strict=True, get_model_classes=_stripped_classes(specs))
    except (RuntimeError, ValueError) as exc:  # MLX's and mlx-lm's words for a file they cannot read
        text = " ".join(str(exc).split())  # one line (mlx-lm lists missing parameters on the next)
        at_fault = (path / "config.json" if isinstance(exc, json.JSONDecodeError)
                    else path / NON_EXPERT_FILE if "safetensors" in text or "arameters" in text else path)
        raise StoreError(at_fault, f"the model cannot be loaded from this store: {text}") from None
    except OSError as exc:  # config.json another user's (mode 0600), a disk error: a PermissionError traceback
        raise StoreError(exc.filename or path, f"the model cannot be loaded from this store: cannot read it: "
                                               f"{os_reason(exc)}", errno=exc.errno) from None
    drop_loaded_weights(path)
    arch = arch_for(config["model_type"])
    moe = moe_layers(model, arch)
    for layer, (block, _attr) in moe.items():
        where = top_k_attribute(block)
        n = store.layers[layer].n_experts if layer in store.layers else None
        if where is not None and n is not None and not 1 <= int(getattr(*where)) <= n:
            # A store's config.json edited to route to more experts than there are (or none):
            # its first token failed in MLX's argpartition, or in one queued fault per expert.
            raise StoreError(path / "config.json", f"layer {layer} routes each token to {int(getattr(*where))} "
                                                   f"of its {n} experts; expected 1 to {n}")
    check_routers(model, arch, moe, specs, {l: store.layers[l].n_experts for l in moe if l in store.layers}, config,
                  path / "config.json")
    return StreamingModel(
        model, arch=arch, moe=moe, specs=specs, tokenizer=load_tokenizer(path, config), config=config,
        model_id=model_id or meta.get("model_id") or path.name, store=store, completed=completed,
        options=options,
    )


#: the configuration fields that shape an MoE router, named when one cannot route a token
_ROUTER_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "num_experts_per_tok",
                  "n_group", "topk_group", "topk_method", "routed_scaling_factor", "norm_topk_prob")


def check_routers(model: nn.Module, arch: Any, moe: Mapping[int, tuple[nn.Module, str]],
                  specs: Mapping[int, SwitchSpec], n_experts: Mapping[int, int], config: Mapping[str, Any],
                  where: pathlib.Path) -> None:
    """StoreError naming ``where`` (the model's config.json) when an MoE layer's own router cannot
    route one token: a configuration mlx-lm builds but whose first forward fails (experts that
    ``n_group`` does not divide, groups of one expert where the router sums each group's top two).

    Each router runs once on a zero hidden state, stopped before its switch layer, so no expert
    weight is read; a switch that is not yet pooled (the converter's model) is swapped for a
    :class:`PooledSwitch` of its spec for the call and put back.
    """
    from .pooled import route

    layers = decoder_layers(model)
    for layer, (block, attr) in moe.items():
        norm = getattr(layers[layer], arch.mlp_norm, None)
        width = getattr(norm, "weight", None)
        if not isinstance(width, mx.array) or width.ndim != 1:
            continue  # no hidden width to probe with (a norm without a weight): left to the forward
        sw = getattr(block, attr)
        pooled = sw if isinstance(sw, PooledSwitch) else PooledSwitch(specs[layer], sw.activation)
        setattr(block, attr, pooled)
        try:
            mx.eval(route(block, attr, mx.zeros((1, 1, width.shape[0]), dtype=width.dtype))[1])
        except (ValueError, RuntimeError, TypeError) as exc:  # TypeError: a count written as 4.0 or "4"
            if isinstance(exc, AsyncsideError):
                raise
            # nanobind lists every overload between the call and what it was given: only those kept
            text = re.sub(r" The following argument types are supported:.*?(?=Invoked with|$)", " ",
                          " ".join(str(exc).split()))
            cfg = dict(config.get("text_config") or {}, **config)
            fields = {f: cfg[f] for f in _ROUTER_FIELDS if f in cfg}
            field, expected = _router_expectation(fields, n_experts.get(layer))
            raise StoreError(where, f"MoE layer {layer}'s router cannot route a token ({text[:300]}); its fields "
                                    f"{json.dumps(fields)}{expected}", field) from None
        finally:
            setattr(block, attr, sw)


#: the router fields that count experts or groups: integers
_COUNT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "num_experts_per_tok",
                 "n_group", "topk_group")


def _router_expectation(fields: Mapping[str, Any], n: int | None) -> tuple[str | None, str]:
    """(field at fault, what it needed) of a router that could not route (``n``: the layer's
    experts), where the fields say: a count that is not an integer, a grouping that does not fit."""
    for name in _COUNT_FIELDS:
        value = fields.get(name)
        if name in fields and (isinstance(value, bool) or not isinstance(value, int)):
            return name, f": expected {name} to be an integer, got {json.dumps(value)}"
    groups = fields.get("n_group")
    if not isinstance(groups, int) or groups <= 1 or n is None:
        return None, ""
    if n % groups:
        return "n_group", f": expected n_group to divide the layer's {n} experts, got {groups}"
    if n // groups < 2:
        return "n_group", (f": expected groups of at least 2 experts (the router sums each group's top two), "
                           f"got {n} experts in {groups} groups")
    return None, ""


def _check_config_is_the_stores(path: pathlib.Path, meta: Mapping[str, Any]) -> None:
    """StoreError naming config.json's model_type where it is not the one the store was converted
    from (a config.json copied in from another model)."""
    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # mlx-lm's load names what is wrong with the file
    converted = meta.get("model_type")
    if isinstance(converted, str) and isinstance(model_type, str) and model_type != converted:
        # It failed deep in the build, with the MoE layers of two models said to differ or a
        # parameter of the wrong shape, and the store's file and field named as the fault.
        raise StoreError(path / "config.json", f"is a {model_type!r} model's config, but this store holds the "
                                               f"experts of the {converted!r} model it was converted from "
                                               f"(manifest.json metadata.{META_KEY}.model_type): put back the "
                                               "config.json it was converted with, or convert the other model",
                         "model_type")


def _gather_mm_takes(dtype: mx.Dtype) -> bool:
    """Whether MLX's default device multiplies gathered unquantized experts (``gather_mm``, as
    mlx-lm's switch linears do) of ``dtype``; MLX's CPU backend takes only float32."""
    x = mx.zeros((1, 1, 2), dtype=dtype)
    try:
        mx.eval(mx.gather_mm(x, mx.zeros((1, 2, 2), dtype=dtype), rhs_indices=mx.zeros((1,), dtype=mx.uint32)))
    except RuntimeError:
        return False
    return True


def _check_gathered_dtypes(store: Any, path: pathlib.Path) -> None:
    """Refuse a store whose unquantized expert weights this device cannot multiply gathered: the
    forward (and mlx-lm's own) would fail at its first MoE layer with MLX's error."""
    takes: dict[str, bool] = {"float32": True}
    for layer, spec in store.layers.items():
        keys = {seg.key for seg in spec.segments}
        for i, seg in enumerate(spec.segments):
            if not seg.key.endswith(".weight") or seg.key[: -len("weight")] + "scales" in keys:
                continue  # quantized weights are multiplied by gather_qmm
            if seg.dtype not in takes:
                takes[seg.dtype] = _gather_mm_takes(getattr(mx, seg.dtype))
            if not takes[seg.dtype]:
                device = mx.default_device().type.name
                raise StoreError(path / "manifest.json",
                                 f"the experts are unquantized {seg.dtype}, which MLX's {device} backend cannot "
                                 "multiply gathered (its gather_mm takes float32 only): convert a float32 or a "
                                 "quantized checkpoint, or run on a GPU", f"layers[{layer}].segments[{i}].dtype")


def streaming_from_model(model: nn.Module, config: dict[str, Any], *, tokenizer: Any = None,
                         model_id: str = "in-memory", completed: Completed | None = None,
                         options: ForwardOptions | None = None,
                         ) -> tuple[StreamingModel, dict[int, dict[str, mx.array]]]:
    """A StreamingModel sharing a loaded mlx-lm model's non-expert weights, plus its expert pools.

    The plain ``model`` is left untouched (it stays the reference). The returned pools
    (layer -> key -> stacked expert tensor) feed a ResidentSource or a test source.
    """
    arch = arch_for(config["model_type"])
    src_moe = moe_layers(model, arch)
    pools: dict[int, dict[str, mx.array]] = {}
    switch_prefixes = []
    specs = {}
    for layer, (block, attr) in src_moe.items():
        sw = getattr(block, attr)
        if isinstance(sw, PooledSwitch):
            raise ValueError("streaming_from_model needs a plain mlx-lm model (its switch layers hold the experts)")
        pools[layer] = dict(tree_flatten(sw.parameters()))
        try:
            specs[layer] = SwitchSpec.from_meta(switch_meta(sw))
        except UnsupportedModelError as exc:
            # The line named only the linear's attribute, not which layer's switch holds it.
            raise UnsupportedModelError(f"{_module_path(model, sw)}: {exc}") from None
    model_class, args_class = _stripped_classes(specs)(config)
    new: nn.Module = model_class(args_class.from_dict(config))
    # Quantize exactly the modules that are quantized in the source model.
    src_modules = dict(model.named_modules())

    def predicate(path: str, m: nn.Module) -> bool | dict[str, Any]:
        src = src_modules.get(path)
        if src is None or not hasattr(src, "group_size") or not hasattr(m, "to_quantized"):
            return False
        return {"group_size": src.group_size, "bits": src.bits, "mode": getattr(src, "mode", "affine")}

    nn.quantize(new, class_predicate=predicate)
    for block, attr in src_moe.values():
        prefix = _module_path(model, getattr(block, attr))
        switch_prefixes.append(prefix + ".")
    # tree_flatten returns a list of (path, leaf) when given no destination (its annotation also
    # admits the dict a destination makes).
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = [(k, v) for k, v in params if not k.startswith(tuple(switch_prefixes))]
    new.load_weights(weights, strict=True)
    new.eval()
    moe = moe_layers(new, arch)
    sm = StreamingModel(new, arch=arch, moe=moe, specs=specs, tokenizer=tokenizer, config=config,
                        model_id=model_id, completed=completed, options=options)
    return sm, pools


def _module_path(root: nn.Module, target: nn.Module) -> str:
    for name, m in cast(list[tuple[str, nn.Module]], root.named_modules()):
        if m is target:
            return name
    raise ValueError("module not found in the model")


def reference_generate(model: nn.Module, prompt_ids: list[int], *, max_tokens: int,
                       eos_token_ids: set[int] | None = None,
                       prefill_step_size: int = 2048) -> list[int]:
    """Greedy tokens of the plain mlx-lm model through mlx-lm's own ``generate_step`` (synchronous).

    The all-resident reference every streaming run is compared with. Stops before an EOS token.
    """
    eos = eos_token_ids or set()
    out: list[int] = []
    if max_tokens <= 0:
        return out
    for y, _ in generate_step(mx.array([int(t) for t in prompt_ids]), model, max_tokens=max_tokens,
                              prefill_step_size=prefill_step_size):
        tok = int(y)
        if tok in eos:
            break
        out.append(tok)
    return out


def _build_plain(config: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    """The plain mlx-lm model of ``config`` holding ``weights`` (mlx-lm's quantization rules)."""
    model_class, args_class = _get_classes(config)
    model: nn.Module = model_class(args_class.from_dict(config))
    q = config.get("quantization")
    if q is not None:
        def class_predicate(p: str, m: nn.Module) -> bool | dict[str, Any]:
            if p in q:
                return cast(bool | dict[str, Any], q[p])
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return infer_quant_config(p, m, weights)

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                    class_predicate=class_predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def load_reference_model(path: str | pathlib.Path) -> tuple[nn.Module, dict[str, Any]]:
    """The plain mlx-lm model with all its experts: from a model directory (``mlx_lm.utils.load_model``)
    or rebuilt from a converted store (non-expert weights + every expert record)."""
    path = pathlib.Path(path).absolute()
    if not is_store_dir(path):
        loaded = load_model(path)
        drop_loaded_weights(path)
        return loaded
    from ..store import ExpertStore

    store = ExpertStore.open(path)
    meta = store.metadata.get(META_KEY) or {}
    paths = meta.get("switch_paths", {})
    config = load_config(path)
    # A .safetensors file loads as a dict of arrays (mx.load's annotation covers every format).
    weights = dict(cast(dict[str, mx.array], mx.load(str(path / NON_EXPERT_FILE))))
    for layer, spec in store.layers.items():
        prefix = paths.get(str(layer))
        if prefix is None:
            raise StoreError(path / "manifest.json", f"no switch path for layer {layer}",
                             f"metadata.{META_KEY}.switch_paths")
        per_key: dict[str, list[mx.array]] = {s.key: [] for s in spec.segments}
        for e in range(spec.n_experts):
            for k, a in store.read_expert(layer, e).items():
                per_key[k].append(a)
        stacked = {f"{prefix}.{k}": mx.stack(v) for k, v in per_key.items()}
        # Each layer's records are read through the page cache into the model's own arrays: left
        # there, the store's whole size was charged beside the model's copy while it loaded ('demo
        # --memory' under an all-resident reference went past its budget by it), and each layer's
        # read pieces stayed beside their stacked copy until the model was built.
        mx.eval(*stacked.values())
        del per_key
        weights.update(stacked)
        drop_loaded_weights(path, [pathlib.Path(spec.path)])
    model = _build_plain(config, weights)
    drop_loaded_weights(path)
    return model, config
