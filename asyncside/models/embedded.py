"""The embedded default model: a small qwen3_moe built from a fixed seed on first run.

It is a real mlx-lm model directory (``config.json`` + ``model.safetensors``, 4-bit group-64
affine quantization with the router at 8 bits, like community MLX conversions of
Qwen3-MoE), converted to an expert store beside it. Experts are ~97% of its ~290 MB.
Scales and unquantized weights are float32, not the community's bfloat16: MLX's CPU backend runs
half-precision quantized matmuls many times slower (BENCHMARKS.md, measurements behind code
choices), and the CPU is where this model mostly runs. ``EmbeddedSpec(dtype=...)`` changes it.

Random weights route almost uniformly, which would make residency meaningless. The weights are
therefore structured (all from one seed) so routing looks like a trained MoE's:

- *hot experts*: every token embedding shares a common direction ``u``; each layer's router row
  ``e`` has a component ``hot[l, e] * u`` with ``hot`` drawn log-normally and shuffled per layer,
  so a minority of experts takes most of the traffic (a different minority per layer);
- *token specialisation*: bytes fall into classes (lowercase, uppercase, digits, space and
  punctuation, other) with one direction each in the embeddings; every expert has an affinity
  to one class, so which experts a token routes to depends on what kind of token it is;
- *slowly changing residual stream*: attention and expert outputs are scaled down (x0.6), so a
  token's hidden state drifts little between layers; this is what makes next-layer lookahead
  prediction work in real models, and it does here.

The LM head only scores printable ASCII and newline (other rows are zero), so greedy output is
printable text (gibberish: the model is untrained). The tokenizer is byte-level (UTF-8 bytes as
ids, :class:`ByteTokenizer`'s ids), written as a standard ``tokenizer.json`` with a chat template
(:func:`~.tokenizer.save_byte_level_tokenizer`), so mlx-lm's own tools load the model directory.

:func:`ensure_embedded_default` builds the model and its store into a cache directory (keyed by a
hash of the spec) under a file lock, atomically, and returns the paths; later calls reuse them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from .tokenizer import ByteTokenizer, load_tokenizer, save_byte_level_tokenizer

#: 2: a standard tokenizer.json + tokenizer_config.json (chat template) instead of asyncside_tokenizer.json
SPEC_VERSION = 2
READY_FILE = "READY"
#: What :func:`build_model` makes of a spec, where that changed for some specs only (a new
#: SPEC_VERSION would rebuild every cached model); each bump is listed in :func:`least_build`.
#: Written in the READY marker; a marker without it is of the first build.
BUILD_VERSION = 2

DEFAULT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 384,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "norm_topk_prob": True,
    "bos_token_id": ByteTokenizer.BOS,
    "eos_token_id": ByteTokenizer.EOS,
    "torch_dtype": "float32",
}

#: prompts profiled to pick the resident (hottest) experts of the embedded store
PROFILE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. ",
    "In 1969, 3 astronauts flew to the Moon and back; the trip took about 8 days.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 40))\n",
    "Mixture-of-Experts models route every token to a few experts out of many.",
)


@dataclass(frozen=True)
class EmbeddedSpec:
    """Everything that determines the embedded model's bytes (its hash keys the cache)."""

    config: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CONFIG))
    seed: int = 20240607
    group_size: int = 64
    bits: int = 4
    dtype: str = "float32"        # MLX CPU runs bf16/fp16 quantized matmuls far slower (module docstring)
    hot_sigma: float = 1.0       # log-normal spread of per-expert hotness
    emb_shared: float = 0.3      # weight of the shared direction u in every token embedding
    emb_class: float = 0.3       # weight of the token-class direction in embeddings
    hot_scale: float = 0.03      # router weight of the shared "hot" direction
    class_scale: float = 0.03    # router weight of the token-class direction
    router_temp: float = 1.0     # router logit scale (softmax sharpness; top-k is unaffected)
    attn_scale: float = 0.6      # scale of attention output projections
    expert_scale: float = 0.6    # scale of expert down projections
    resident_fraction: float = 0.25
    profile_tokens: int = 8

    def key(self) -> str:
        blob = json.dumps({"v": SPEC_VERSION, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _token_classes(vocab: int) -> np.ndarray:
    cls = np.full(vocab, 4, dtype=np.int64)
    for t in range(min(vocab, 256)):
        c = chr(t)
        if c.islower() and c.isascii():
            cls[t] = 0
        elif c.isupper() and c.isascii():
            cls[t] = 1
        elif c.isdigit() and c.isascii():
            cls[t] = 2
        elif c.isascii() and (c.isspace() or (32 <= t < 127)):
            cls[t] = 3
    return cls


def _printable(vocab: int) -> np.ndarray:
    ok = np.zeros(vocab, dtype=bool)
    ok[32:127] = True
    ok[10] = True
    return ok


def build_model(spec: EmbeddedSpec) -> tuple[Any, dict[str, Any]]:
    """The embedded mlx-lm model (quantized, evaluated) and its config."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, quantize_model

    cfg = dict(spec.config)
    if cfg.get("model_type") != "qwen3_moe":
        raise ValueError(f"the embedded model is a qwen3_moe, got model_type {cfg.get('model_type')!r}")
    D, E, F, V = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    L = cfg["num_hidden_layers"]
    dtype = getattr(mx, spec.dtype)
    rng = np.random.default_rng(spec.seed)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))

    def normal(*shape: int, std: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    n_classes = 5
    u = normal(D)
    class_dirs = normal(n_classes, D)
    tok_cls = _token_classes(V)
    emb = normal(V, D) + spec.emb_class * class_dirs[tok_cls] + spec.emb_shared * u
    expert_cls = rng.integers(0, n_classes, size=(L, E))
    u_hat = u / np.linalg.norm(u)
    cls_hat = class_dirs / np.linalg.norm(class_dirs, axis=1, keepdims=True)

    params: dict[str, np.ndarray] = {"model.embed_tokens.weight": emb}
    head = normal(V, D, std=D**-0.5)
    head[~_printable(V)] = 0.0
    params["lm_head.weight"] = head
    # tree_flatten returns a list of (path, leaf) when given no destination (its annotation also
    # admits the dict a destination makes).
    for k, v in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())):
        if k in params:
            continue
        if k.endswith("norm.weight"):
            params[k] = np.ones(v.shape, np.float32)
        elif ".mlp.gate." in k + ".":
            pass  # router: below
        elif ".switch_mlp." in k:
            pass  # experts: below, per layer (large)
        elif k.endswith("o_proj.weight"):
            params[k] = normal(*v.shape, std=spec.attn_scale * v.shape[-1] ** -0.5)
        elif v.ndim == 2:
            params[k] = normal(*v.shape, std=v.shape[-1] ** -0.5)
        else:
            raise AssertionError(f"unexpected parameter {k} {v.shape}")
    for l in range(L):
        hot = rng.lognormal(0.0, spec.hot_sigma, size=E)
        spread = hot.std()
        # A layer of one expert has no spread to standardise: dividing by it made the router NaN.
        hot = (hot - hot.mean()) / spread if spread > 0 else np.zeros_like(hot)
        router = normal(E, D, std=D**-0.5)
        router += spec.hot_scale * hot[:, None] * u_hat[None, :]
        router += spec.class_scale * cls_hat[expert_cls[l]]
        params[f"model.layers.{l}.mlp.gate.weight"] = spec.router_temp * router
    model.update(tree_unflatten([(k, mx.array(v).astype(dtype)) for k, v in params.items()]))
    # Experts, one layer at a time: generate on the MLX side (fast), cast, evaluate.
    mx.random.seed(spec.seed)
    for l in range(L):
        sw = model.model.layers[l].mlp.switch_mlp
        key = mx.random.key(spec.seed * 1000 + l)
        k1, k2, k3 = mx.random.split(key, 3)
        sw.gate_proj.weight = (mx.random.normal((E, F, D), key=k1) * D**-0.5).astype(dtype)
        sw.up_proj.weight = (mx.random.normal((E, F, D), key=k2) * D**-0.5).astype(dtype)
        sw.down_proj.weight = (mx.random.normal((E, D, F), key=k3) * (spec.expert_scale * F**-0.5)).astype(dtype)
        # Quantized layer by layer as they are generated: the float experts of a large shape (the
        # bench's qwen3-30b-a3b) do not fit in memory all at once. quantize_model below makes the
        # same to_quantized call, so the bytes are the same either way.
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(sw, name, getattr(sw, name).to_quantized(group_size=spec.group_size, bits=spec.bits))
        mx.eval(sw.parameters())
    cfg.pop("quantization", None)
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # quantize_model prints bits/weight
        model, cfg = quantize_model(model, cfg, spec.group_size, spec.bits)
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    model.eval()
    return model, cfg


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """``cache_dir``, else $ASYNCSIDE_CACHE, else $XDG_CACHE_HOME/asyncside, else ~/.cache/asyncside."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()  # "~/cache" as --model reads "~": the home directory's
    from ..native_env import ENV_CACHE, env_cache

    chosen = env_cache(os.environ.get(ENV_CACHE, ""))
    if chosen is not None:
        return pathlib.Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg) / "asyncside"
    try:
        home = pathlib.Path.home()
    except RuntimeError:
        # No $HOME and no passwd entry for the user (a container run as --user 1234): pathlib's
        # "Could not determine home directory." and a traceback.
        from ..errors import AsyncsideError

        raise AsyncsideError(f"no cache directory: $HOME is not set and user {os.getuid()} has no home "
                             f"directory; give one with --cache-dir DIR (cache_dir= in Python), "
                             f"${ENV_CACHE} or $XDG_CACHE_HOME") from None
    return home / ".cache" / "asyncside"


def least_build(spec: EmbeddedSpec) -> int:
    """The oldest :data:`BUILD_VERSION` whose model of ``spec`` is the one :func:`build_model` makes
    now: the second for layers of one expert (the first build's router was NaN: their popularity has
    no spread to standardise), the first for every other spec."""
    return 2 if int(spec.config.get("num_experts", 0)) <= 1 else 1


def ready_marker(spec: EmbeddedSpec) -> str:
    """The READY file's text of a build of ``spec`` by this code: its key and :data:`BUILD_VERSION`."""
    return f"{spec.key()}\nbuild {BUILD_VERSION}\n"


def publish_build(tmp: pathlib.Path, final: pathlib.Path, spec: Any) -> bool:
    """Rename the finished build ``tmp`` to ``final``; False (``tmp`` removed) where a current
    build of ``spec`` got there first."""
    try:
        os.rename(tmp, final)
    except OSError as exc:
        # Where the filesystem takes no locks, another process may have published the same build
        # meanwhile: its rename won, and this one's copy is not needed.
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not build_is_current(final, spec):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return True


def build_is_current(directory: pathlib.Path, spec: EmbeddedSpec) -> bool:
    """Whether ``directory`` holds a finished build of ``spec`` (its READY marker) that this code
    would make alike: built by a :data:`BUILD_VERSION` at least :func:`least_build`. A marker that
    names no build is of build 1, as older code wrote it; one that cannot be read is no build."""
    try:
        lines = (directory / READY_FILE).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    version = 1
    for line in lines:
        if line.startswith("build "):
            try:
                version = int(line.split()[1])
            except (IndexError, ValueError):
                return False
    return version >= least_build(spec)


@contextlib.contextmanager
def _file_lock(path: pathlib.Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the exclusive lock of the file at ``path`` (made if missing) for the block; ``waiting``
    is called where another process holds it, before waiting for it. On a filesystem that takes
    no locks the block runs unlocked (:data:`~.convert.NO_LOCKS`)."""
    from .convert import try_lock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+")
    except OSError as exc:
        # A cache the process cannot write (a read-only home, another user's cache, HOME=/ in a
        # container) was an OSError traceback from mkdir or open.
        from ..errors import os_reason
        from ..native_env import ENV_CACHE
        from .convert import StoreWriteError

        raise StoreWriteError(exc.filename or path.parent, f"cannot build in this cache directory: "
                              f"{os_reason(exc)}; give a writable one with "
                              f"--cache-dir DIR (cache_dir= in Python) or ${ENV_CACHE}",
                              errno=exc.errno) from None
    with fh:
        taken = try_lock(fh, wait=False)
        if taken is False:
            # Another process builds the same thing (a second `demo` started at once): this one
            # waited without a word for as long as that build took, minutes for a large model.
            if waiting is not None:
                waiting()
            taken = try_lock(fh, wait=True)
        try:
            yield
        finally:
            if taken:
                fcntl.flock(fh, fcntl.LOCK_UN)


def remove_stale_builds(root: pathlib.Path) -> list[pathlib.Path]:
    """Remove the temporary directories of embedded-model and bench-shape builds that died under
    ``root`` (``.embedded-*.tmp-*``, ``.shape-*.tmp-*``, left where a process was killed without
    running its cleanup): those of a tag whose lock no process holds, so never a build in
    progress; on a filesystem that takes no locks, those whose owner file names a process of this
    host that is gone (:func:`~.convert.owner_gone`). Returns what was removed."""
    from .convert import OWNER_FILE, owner_gone, try_lock

    removed = []
    # Only the builders' own (made under their tag's lock), never another writer's (a store's).
    leftovers = [*root.glob(".embedded-*.tmp-*"), *root.glob(".shape-*.tmp-*")] if root.is_dir() else []
    for tmp in sorted(leftovers):
        tag = tmp.name[1:].rsplit(".tmp-", 1)[0]
        if not tmp.is_dir() or not tag:
            continue
        try:
            fh = open(root / f".{tag}.lock", "a+")
        except OSError:
            continue  # a cache this process cannot write: another's leftovers are not its to remove
        with fh:
            taken = try_lock(fh, wait=False)
            if taken is False or (taken is None and not owner_gone(tmp / OWNER_FILE)):
                continue  # a build of this tag is running: its directory is no leftover
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
            finally:
                if taken:
                    fcntl.flock(fh, fcntl.LOCK_UN)
    return removed


def ensure_embedded_default(cache_dir: str | os.PathLike[str] | None = None, *,
                            spec: EmbeddedSpec | None = None, progress: bool = True
                            ) -> tuple[pathlib.Path, pathlib.Path]:
    """Paths (model_dir, store_dir) of the embedded default model, building them on first use.

    Built under ``cache_root(cache_dir)/embedded-<spec hash>/``: ``model/`` (mlx-lm model
    directory) and ``store/`` (its expert store, resident set from a routing profile of
    :data:`PROFILE_PROMPTS`). Concurrent callers wait on a file lock (said on stderr with
    ``progress``); a half-built directory is never visible (built in a temporary directory,
    renamed into place).
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config, save_model

    from .convert import OWNER_FILE, convert_model, owner_line, profile_routing

    spec = spec or EmbeddedSpec()
    root = cache_root(cache_dir)
    final = root / f"embedded-{spec.key()}"
    if build_is_current(final, spec):
        return final / "model", final / "store"
    remove_stale_builds(root)  # before the disk fills up with killed builds' halves

    def waiting() -> None:
        if progress:
            print(f"asyncside: another process is building the embedded model in {final}; waiting for it",
                  file=sys.stderr, flush=True)

    with _file_lock(root / f".embedded-{spec.key()}.lock", waiting):
        if build_is_current(final, spec):
            return final / "model", final / "store"
        if final.exists() and not build_is_current(final, spec):
            # A leftover without READY, or built by older code unlike this one: never trusted. Asked
            # again: where the filesystem takes no locks, another process may have just built it.
            shutil.rmtree(final)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".embedded-{spec.key()}.tmp-", dir=root))
        model_bytes = 0
        try:
            # Who builds it, for a filesystem that takes no locks (remove_stale_builds).
            (tmp / OWNER_FILE).write_text(owner_line(), encoding="utf-8")
            model, cfg = build_model(spec)
            model_bytes = sum(v.nbytes for _, v in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
            model_dir = tmp / "model"
            save_model(model_dir, model)
            save_config(dict(cfg), model_dir / "config.json")
            save_byte_level_tokenizer(model_dir, model_max_length=int(cfg["max_position_embeddings"]))
            tok = load_tokenizer(model_dir, dict(cfg))
            assert tok is not None, "the tokenizer files were written just above"
            (model_dir / "asyncside_spec.json").write_text(json.dumps(asdict(spec), indent=1) + "\n")
            prompts = [tok.encode(p) for p in PROFILE_PROMPTS]
            prof = profile_routing(model, cfg, prompts, max_tokens=spec.profile_tokens, source="embedded prompts")
            del model
            convert_model(model_dir, tmp / "store", profile=prof, resident_fraction=spec.resident_fraction,
                          progress=progress, model_id=f"asyncside-embedded-qwen3moe-{spec.key()[:8]}")
            (tmp / READY_FILE).write_text(ready_marker(spec))
            publish_build(tmp, final, spec)
        except (OSError, RuntimeError) as exc:
            # A full disk under the cache directory was MLX's "[write] Unable to write N bytes to
            # file." and a traceback.
            from ..memory import describe_bytes
            from .convert import write_failure

            need = f"the build takes about {describe_bytes(model_bytes * 2)} (the model, then its store)"
            failed = write_failure(exc, root, writing="the embedded model and its store", partial=tmp, need=need,
                                   remedy="free space there, or give another --cache-dir")
            shutil.rmtree(tmp, ignore_errors=True)
            if failed is None:
                raise
            raise failed from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final / "model", final / "store"
