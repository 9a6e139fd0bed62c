"""``asyncside convert MODEL STORE_DIR``: the command-line face of :func:`convert_model`.

MODEL is an mlx-lm model directory or a Hugging Face repo id (``org/name``), resolved by
:func:`asyncside.hub.resolve_model`: the local Hugging Face cache first, a download otherwise
(none with ``HF_HUB_OFFLINE=1``).

Options:

- ``--profile PROFILE.json``: a routing profile (:func:`~asyncside.models.convert.load_profile`
  format) that ranks the experts, so the hottest become resident;
- ``--profile-prompts N``: make that profile here, by running the model greedily on the first N
  of :data:`PROFILE_PROMPTS` (needs the model's tokenizer files; loads every expert once);
- ``--resident FRACTION``: share of each layer's experts recorded as the resident set;
- ``--overwrite``: replace an existing STORE_DIR that is an expert store (or an empty directory; any other is refused).

Bad input (a directory that is not an mlx-lm model, an unknown repo id, an unsupported
architecture, a profile that does not fit, an existing destination) ends with exit status 2 and
one line naming what is wrong.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

from ..argtypes import directory, resident_fraction

#: profiling texts for ``--profile-prompts N``: varied kinds of text (prose, numbers, code, lists)
PROFILE_PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. ",
    "In 1969, 3 astronauts flew to the Moon and back; the trip took about 8 days.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 40))\n",
    "Mixture-of-Experts models route every token to a few experts out of many.",
    "Dear committee, I am writing to apply for the position of research assistant.",
    "Ingredients: 2 cups flour, 1 tsp salt, 3 eggs, 250 ml milk. Whisk until smooth.",
    "SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;",
    "Q: What is the capital of France?\nA: Paris. Q: And of Japan?\nA:",
)

EXIT_BAD_INPUT = 2


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``asyncside convert``."""
    p.add_argument("model_dir", metavar="MODEL",
                   help="an mlx-lm model directory (config.json + *.safetensors) or a Hugging Face repo id (org/name)")
    p.add_argument("store_dir", metavar="STORE_DIR", type=directory,
                   help="where to write the expert store directory")
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--profile", metavar="PROFILE.json", default=None,
                      help="routing profile ranking the experts (hottest become resident)")
    prof.add_argument("--profile-prompts", metavar="N", type=int, default=None,
                      help=f"profile the routing here on N built-in prompts (1..{len(PROFILE_PROMPTS)}); "
                           "needs the model's tokenizer and memory for every expert")
    p.add_argument("--profile-tokens", metavar="N", type=int, default=16,
                   help="tokens generated per prompt when profiling (default 16)")
    p.add_argument("--resident", metavar="FRACTION", type=resident_fraction(allow_auto=False), default=None,
                   help="share of each layer's experts recorded as resident, in [0, 1] (0.25 or 25%%; 0: none) "
                        "(default 0.25)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace STORE_DIR if it is an expert store (or an empty directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")


def _fail(message: str) -> int:
    print(f"asyncside convert: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _check_args(args: argparse.Namespace) -> str | None:
    """A message for arguments that are wrong before anything is loaded, else None."""
    src = pathlib.Path(args.model_dir)
    dest = pathlib.Path(args.store_dir)
    if not src.exists():
        return f"{src}: model directory does not exist"
    if not src.is_dir():
        return f"{src}: not a directory (expected an mlx-lm model directory)"
    if (src / "manifest.json").is_file() and not (src / "config.json").is_file():
        return f"{src}: this is already an expert store, not an mlx-lm model directory"
    if not (src / "config.json").is_file():
        from ..hub import hub_cache_folder_hint

        if (hint := hub_cache_folder_hint(src)) is not None:
            return f"{src}: {hint}"
        return f"{src}: not an mlx-lm model directory: config.json is missing"
    if dest.exists() and not dest.is_dir():
        return f"{dest}: exists and is not a directory"
    if dest.exists() and not args.overwrite:
        return f"{dest}: already exists (pass --overwrite to replace it)"
    if dest.absolute() == src.absolute():
        return f"{dest}: the store directory must differ from the model directory"
    if args.profile is not None and pathlib.Path(args.profile).is_dir():
        return f"{args.profile}: is a directory; --profile takes a routing profile file (JSON)"
    if args.profile is not None and not pathlib.Path(args.profile).is_file():
        return f"{args.profile}: routing profile file does not exist"
    if args.profile_prompts is not None and not 1 <= args.profile_prompts <= len(PROFILE_PROMPTS):
        return f"--profile-prompts must be in 1..{len(PROFILE_PROMPTS)}, got {args.profile_prompts}"
    if args.profile_tokens < 1:
        return f"--profile-tokens must be >= 1, got {args.profile_tokens}"
    return None


def _profile_here(args: argparse.Namespace) -> dict[str, Any]:
    """Profile the model directory on the first ``args.profile_prompts`` built-in prompts."""
    from .convert import profile_model_dir

    prompts = list(PROFILE_PROMPTS[: args.profile_prompts])
    if args.quiet or args.json:
        return profile_model_dir(args.model_dir, prompts, max_tokens=args.profile_tokens)
    from rich.console import Console

    with Console(stderr=True).status(f"profiling routing on {len(prompts)} prompt(s), "
                                     f"{args.profile_tokens} tokens each"):
        return profile_model_dir(args.model_dir, prompts, max_tokens=args.profile_tokens)


def run_convert(args: argparse.Namespace) -> dict[str, Any]:
    """Convert as ``args`` say; returns a summary dict. Raises the converter's errors."""
    from .convert import DEFAULT_RESIDENT_FRACTION, convert_model
    from .loading import META_KEY

    started = time.perf_counter()
    profile: Any = args.profile
    if args.profile_prompts is not None:
        profile = _profile_here(args)
    profiled = time.perf_counter()
    fraction = DEFAULT_RESIDENT_FRACTION if args.resident is None else args.resident
    store = convert_model(args.model_dir, args.store_dir, profile=profile, resident_fraction=fraction,
                          progress=not (args.quiet or args.json), overwrite=args.overwrite,
                          model_id=getattr(args, "model_id", None))
    meta = store.metadata[META_KEY]
    summary_file = store.path / "asyncside_summary.json"
    summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {}
    layers = list(store.layers.values())
    return {
        "model_dir": str(pathlib.Path(args.model_dir).absolute()),
        "store_dir": str(store.path),
        "model_type": meta["model_type"],
        "model_id": meta["model_id"],
        "moe_layers": [s.index for s in layers],
        "experts_per_layer": sorted({s.n_experts for s in layers}),
        "record_bytes": sorted({s.stride for s in layers}),
        "expert_bytes": summary.get("expert_bytes"),
        "non_expert_bytes": summary.get("non_expert_bytes"),
        "blob_bytes": sum(s.blob_bytes for s in layers),
        "resident_fraction": fraction,
        "resident_per_layer": {str(l): len(v) for l, v in meta["resident"].items()},
        "resident_from": meta["resident_default"],
        "profile_seconds": profiled - started if args.profile_prompts is not None else 0.0,
        "seconds": time.perf_counter() - started,
    }


def _print_summary(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"asyncside convert — {res['model_id']} ({res['model_type']})", show_header=False)
    table.add_column("", style="bold")
    # folded, never cut with an ellipsis: the store's path is what a user copies from here (a
    # path longer than a narrow or non-tty console's 80 columns lost its end)
    table.add_column("", overflow="fold")
    table.add_row("store", res["store_dir"])
    table.add_row("MoE layers", f"{len(res['moe_layers'])} ({', '.join(map(str, res['moe_layers']))})")
    table.add_row("experts per layer", ", ".join(map(str, res["experts_per_layer"])))
    table.add_row("record size", ", ".join(f"{b / 1024:.0f} KiB" for b in res["record_bytes"]))
    if res["expert_bytes"] is not None:
        total = res["expert_bytes"] + res["non_expert_bytes"]
        table.add_row("expert / non-expert bytes",
                      f"{res['expert_bytes'] / 1e6:.1f} MB / {res['non_expert_bytes'] / 1e6:.1f} MB "
                      f"({res['expert_bytes'] / total:.0%} experts)")
    table.add_row("resident set", f"{res['resident_fraction']:.0%} per layer, {res['resident_from']}")
    table.add_row("time", f"{res['seconds']:.1f} s" + (f" (profiling {res['profile_seconds']:.1f} s)"
                                                      if res["profile_seconds"] else ""))
    Console().print(table)


def convert_main(args: argparse.Namespace) -> int:
    """Run ``asyncside convert``; 0 on success, 2 with a one-line message on bad input."""
    from ..errors import AsyncsideError, ModelNotFoundError
    from ..hub import is_repo_id, resolve_model

    name = args.model_dir
    try:
        args.model_dir = str(resolve_model(name))
    except ModelNotFoundError as exc:
        return _fail(str(exc))
    if is_repo_id(name) and args.model_dir != str(pathlib.Path(name).absolute()):
        args.model_id = name  # a repo id: the store's model id is the id, not the snapshot hash
    if (pathlib.Path(args.model_dir) / "manifest.json").is_file():
        # A store's directory also has a config.json and safetensors (without the experts).
        return _fail(f"{name}: is already an expert store (manifest.json); use it as it is, e.g. "
                     f"asyncside demo --model {name}")
    problem = _check_args(args)
    if problem is not None:
        return _fail(problem)
    from .convert import StoreWriteError

    try:
        res = run_convert(args)
    except StoreWriteError as exc:  # the filesystem failed (a full disk), not the input: no usage error
        print(f"asyncside convert: {exc}", file=sys.stderr)
        return 1
    except (AsyncsideError, ValueError, FileNotFoundError) as exc:
        # StoreError / UnsupportedModelError / bad profile: the message names the file or field.
        return _fail(str(exc))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_summary(res)
    return 0
