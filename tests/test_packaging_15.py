"""The dependency floors in pyproject.toml are the versions the code was checked against.

CI installs the newest release of every dependency, so a floor (``mlx-lm>=...``) is never tried
there; a user's resolver may pick it. Each floor below was established by building a venv with
every dependency at its floor (``tools/floors_check.py``, docs/testing.md "Dependency floors") and
running the suite's slice there, and, for the libraries whose names asyncside imports, by reading
each release's source (the wheels unpacked, release by release): the tables record which names
asyncside imports and the first release that has each. A new import of mlx-lm's or a new anyio
name must be added to its table, with the release that has it, and the floor raised if need be.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
import subprocess
import sys
import tarfile
import tomllib
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from asyncside.models.arch import ARCHS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncside"

#: every requirement of the package and of its extras -> (its established floor, what decided it).
#: MLX is pinned (==), not floored: the extension is built against that exact release.
FLOORS: dict[str, tuple[str, str]] = {
    "mlx-lm": ("0.32.1", "MLX_LM_SINCE: infer_quant_config and _byte_decoder are first in 0.32.0 (with 0.31.3 "
                         "`import asyncside.models` is an ImportError); MLX_LM_BEHAVIOUR: phimoe as forcing.py "
                         "re-walks it is 0.32.1's (with 0.32.0 tests/test_models.py and test_queued.py fail on phimoe)"),
    "anyio": ("4.10.0", "ANYIO_SINCE: notify_closing (the pipeline's control link) is first in 4.10.0, "
                        "wait_readable (every native reader) in 4.7.0; with 4.5.0 tests/test_runtime.py fails"),
    "aiofiles": ("23.2.1", "the first 23.2 release on the index (there is no 23.2.0)"),
    "uvloop": ("0.19.0", "the slice passes at the floor"),
    "numpy": ("1.26.0", "the slice passes at the floor"),
    "rich": ("13.0.0", "the slice and tests/test_cli.py pass at the floor"),
    "starlette": ("0.40.0", "the slice passes at the floor (tests/test_serve.py)"),
    "uvicorn": ("0.30.0", "the slice passes at the floor (tests/test_serve.py, tests/test_examples.py)"),
    "h11": ("0.16.0", "older releases read malformed chunked bodies a proxy may frame differently (request "
                      "smuggling, CVE-2025-43859); the slice and tests/test_serve_unseen_14.py (serve's read "
                      "timeout, on h11's states) pass at the floor"),
    "huggingface-hub": ("1.5.0", "mlx-lm's floor needs transformers 5.7.0 or later, which needs it; the slice, "
                                 "tests/test_hub.py and tests/test_hub_config_only.py pass at the floor"),
    "tokenizers": ("0.22.1", "the first release transformers 5.7.0 takes beside huggingface-hub 1.x (0.22.0 wants "
                             "huggingface-hub<1.0); the slice passes at the floor"),
    "matplotlib": ("3.8.0", "tests/test_bench_generate.py (its PNG) passes at the floor"),
    "httpx": ("0.27.0", "the slice passes at the floor (tests/test_serve.py)"),
    "pytest": ("8.2.0", "pytest-asyncio 0.24.0 (its floor) requires pytest>=8.2,<9: a lower floor cannot install"),
    "pytest-asyncio": ("0.24.0", "the slice passes at the floor (loop_scope, asyncio_default_fixture_loop_scope)"),
    "hypothesis": ("6.100.0", "the slice passes at the floor"),
    "trio": ("0.25.0", "the slice passes at the floor (tests/test_bridge_asyncio.py, the plugin's trio runs)"),
    "openai": ("1.40.0", "the slice passes at the floor (tests/test_examples.py talks to the server with it)"),
    "prometheus-client": ("0.20.0", "tests/test_serve_ops_15.py's scrapes parse at the floor (text_string_to_metric_families)"),
    "mypy": ("2.4.0", "pinned to a minor (.ci/run): new checks arrive in minors"),
    "ruff": ("0.17.0", "pinned to a minor (.ci/run): new rules arrive in minors"),
}

#: ``module:name`` asyncside imports from mlx-lm -> the first release that has it. Found by unpacking
#: the mlx-lm wheels 0.30.0 to 0.32.2 and reading each module's top-level definitions; "0.30.0"
#: means present in every release checked, the earliest included.
MLX_LM_SINCE: dict[str, str] = {
    "mlx_lm:": "0.30.0",
    "mlx_lm.generate:generate_step": "0.30.0",
    "mlx_lm.models.base:create_attention_mask": "0.30.0",
    "mlx_lm.models.base:scaled_dot_product_attention": "0.30.0",
    "mlx_lm.models.cache:BatchKVCache": "0.30.0",
    "mlx_lm.models.cache:CacheList": "0.30.0",
    "mlx_lm.models.cache:ChunkedKVCache": "0.30.0",
    "mlx_lm.models.cache:KVCache": "0.30.0",
    "mlx_lm.models.cache:make_prompt_cache": "0.30.0",
    "mlx_lm.models.cache:trim_prompt_cache": "0.30.0",
    "mlx_lm.models.switch_layers:QuantizedSwitchLinear": "0.30.0",
    "mlx_lm.models.switch_layers:SwitchGLU": "0.30.0",
    "mlx_lm.models.switch_layers:SwitchLinear": "0.30.0",
    "mlx_lm.models.switch_layers:SwitchMLP": "0.30.0",
    "mlx_lm.sample_utils:apply_min_p": "0.30.0",
    "mlx_lm.sample_utils:apply_top_k": "0.30.0",
    "mlx_lm.sample_utils:apply_top_p": "0.30.0",
    "mlx_lm.sample_utils:make_logits_processors": "0.30.0",
    "mlx_lm.tokenizer_utils:BPEStreamingDetokenizer": "0.30.0",
    "mlx_lm.tokenizer_utils:SPMStreamingDetokenizer": "0.30.0",
    # a module-level function from 0.32.0 on; before, a class attribute of the BPE detokenizer
    "mlx_lm.tokenizer_utils:_byte_decoder": "0.32.0",
    "mlx_lm.utils:": "0.30.0",
    "mlx_lm.utils:MODEL_REMAPPING": "0.30.0",
    "mlx_lm.utils:_get_classes": "0.30.0",
    "mlx_lm.utils:infer_quant_config": "0.32.0",
    "mlx_lm.utils:load_config": "0.30.0",
    "mlx_lm.utils:load_model": "0.30.0",
    "mlx_lm.utils:load_tokenizer": "0.30.0",
    "mlx_lm.utils:quantize_model": "0.30.0",
    "mlx_lm.utils:save_config": "0.30.0",
    "mlx_lm.utils:save_model": "0.30.0",
}

#: what asyncside relies on inside an mlx-lm model module, beyond the names it imports -> the first
#: release that has it, and the source text that shows it (the same wheels read, then the floors run).
MLX_LM_BEHAVIOUR: dict[str, tuple[str, str, str]] = {
    # asyncside.models.forcing._phimoe re-walks phimoe's router (HF's sparsemixer, with its
    # block.jitter_eps); 0.32.0 routed with a plain softmax over the top-k and had no jitter_eps,
    # and refused a null rope_scaling (Phi-mini-MoE; tests/_models_support.py's phimoe)
    "phimoe sparsemixer routing": ("0.32.1", "mlx_lm.models.phimoe", "self.jitter_eps = args.router_jitter_noise"),
    "phimoe null rope_scaling": ("0.32.1", "mlx_lm.models.phimoe", "if args.rope_scaling is None:"),
}

#: the mlx-lm model module (``mlx_lm.models.<type>``) of each architecture asyncside streams -> the
#: first release that has it (the same wheels read).
MLX_LM_MODELS_SINCE: dict[str, str] = {**{t: "0.30.0" for t in (
    "bailing_moe", "deepseek_v2", "deepseek_v3", "dots1", "ernie4_5_moe", "glm4_moe", "gpt_oss", "granitemoe",
    "hunyuan", "llama4", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe", "minimax", "deepseek", "Klear")},
    # Not in 0.30.0; recorded at the floor, whose wheel's modules are the ones tests/test_archs_18.py
    # proves exact.
    "glm4_moe_lite": "0.32.1", "mistral4": "0.32.1", "exaone_moe": "0.32.1", "mellum": "0.32.1", "laguna": "0.32.1", "mimo_v2_flash": "0.32.1",
    # Read in the wheels 0.30.0 to 0.32.1; the floor's modules are identical to the ones
    # tests/test_archs_19.py proves exact.
    "deepseek_v32": "0.30.0", "afmoe": "0.30.0", "step3p5": "0.30.6", "kimi_vl": "0.30.0", "kimi_k25": "0.30.6",
    "qwen3_vl_moe": "0.30.0", "mistral3": "0.30.0"}

#: each top-level name asyncside uses of anyio (``anyio.X``, ``from anyio.X import``) -> the first release
#: that has it. Found by resolving every name in a venv at anyio 4.5.0 (all but three resolve) and by
#: reading ``anyio/__init__.py`` of the wheels 4.6.0 to 4.12.0.
ANYIO_SINCE: dict[str, str] = {
    **{name: "4.5.0" for name in (
        "BrokenResourceError", "CancelScope", "ClosedResourceError", "Event", "Lock", "TASK_STATUS_IGNORED", "abc",
        "create_memory_object_stream", "create_task_group", "current_time", "fail_after", "get_cancelled_exc_class",
        "get_current_task", "lowlevel", "move_on_after", "run", "sleep", "sleep_forever", "streams", "to_thread")},
    "wait_readable": "4.7.0",
    "wait_writable": "4.7.0",
    "notify_closing": "4.10.0",
}


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra, rs in project["optional-dependencies"].items():
        reqs += [Requirement(r) for r in rs if extra != "cuda"]
    return [r for r in reqs if r.name != project["name"]]


def _declared_floors() -> dict[str, str]:
    out: dict[str, str] = {}
    for req in _requirements():
        floors = [s.version for s in req.specifier if s.operator == ">="]
        if floors:
            out[req.name] = floors[0]
    return out


def _python_files() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _mlx_lm_imports() -> dict[str, list[str]]:
    """``module:name`` (``module:`` for a plain import) of every mlx-lm import in asyncside/ -> files."""
    out: dict[str, list[str]] = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            keys: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mlx_lm":
                keys = [f"{node.module}:{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                keys = [f"{a.name}:" for a in node.names if a.name.split(".")[0] == "mlx_lm"]
            for key in keys:
                out.setdefault(key, []).append(path.relative_to(ROOT).as_posix())
    return out


def _anyio_names() -> dict[str, list[str]]:
    """Each top-level anyio name asyncside/ uses -> files."""
    out: dict[str, list[str]] = {}
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "anyio":
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "anyio":
                names = [a.name for a in node.names] if node.module == "anyio" else [node.module.split(".")[1]]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("anyio.")]
            for name in names:
                out.setdefault(name, []).append(rel)
    return out


def test_every_requirement_has_an_established_floor() -> None:
    """A new dependency (or a new floor) is added to FLOORS once the floors run has tried it."""
    declared = _declared_floors()
    assert sorted(declared) == sorted(FLOORS), "tools/floors_check.py, then FLOORS"
    pinned = [r for r in _requirements() if r.name not in declared]
    assert {r.name for r in pinned} == {"mlx"}, pinned
    assert all(str(s.operator) == "==" for r in pinned for s in r.specifier)


#: distributions asyncside/ imports that only an extra declares -> why a module of the package may
#: import them all the same (each import runs only where the extra, or the user's own code, put it)
EXTRA_ONLY: dict[str, str] = {
    "matplotlib": "bench: asyncside bench generate --plot, through require_extra (names the extra)",
    "httpx": "bench: python -m asyncside.serving.soak, which names the extra when it is missing",
    "trio": "imported only inside a trio run (the bridge's completion queue, the blocking detector's loop)",
    "pytest": "the pytest plugin (asyncside.testing), which pytest loads; testing_blocking's fixture is optional",
}


def _imported_distributions() -> dict[str, list[str]]:
    """Each distribution of a module asyncside/ imports (absolute imports, the standard library and
    asyncside itself left out) -> the files that import it."""
    owners = importlib.metadata.packages_distributions()
    out: dict[str, list[str]] = {}
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in sys.stdlib_module_names or top == "asyncside":
                    continue
                assert top in owners, f"{rel} imports {top}, which no installed distribution provides"
                # a namespace several distributions fill (mlx, mlx-cpu) is declared through any of them
                dist = canonicalize_name(sorted(owners[top], key=len)[0])
                if rel not in out.setdefault(dist, []):
                    out[dist].append(rel)
    return out


def test_every_distribution_asyncside_imports_is_declared() -> None:
    """A module asyncside imports itself must be a requirement of its own, with its floor: one that
    only arrived through another library (huggingface-hub and tokenizers through mlx-lm's
    transformers, h11 through uvicorn) was at whatever version that library allowed, or gone when
    it stopped needing it. Those in an extra only are listed in EXTRA_ONLY with why."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    extras = {canonicalize_name(r.name) for r in _requirements()} - core
    imported = _imported_distributions()
    undeclared = {d: f for d, f in imported.items() if d not in core and not (d in extras and d in EXTRA_ONLY)}
    assert not undeclared, f"declare these in pyproject.toml (with a floor tools/floors_check.py ran): {undeclared}"
    assert sorted(EXTRA_ONLY) == sorted(d for d in imported if d not in core), "EXTRA_ONLY lists exactly those"


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_the_declared_floor_is_the_established_one(name: str) -> None:
    floor, why = FLOORS[name]
    assert Version(_declared_floors()[name]) == Version(floor), f"pyproject.toml {name}>={floor}: {why}"


def test_every_mlx_lm_import_is_recorded_and_within_the_floor() -> None:
    """Every name asyncside imports from mlx-lm has a row in MLX_LM_SINCE (a new import needs the
    release that has it), and the mlx-lm floor is at least every row's release."""
    used = _mlx_lm_imports()
    missing = {k: v for k, v in used.items() if k not in MLX_LM_SINCE}
    assert not missing, f"add these to MLX_LM_SINCE with the first mlx-lm release that has them: {missing}"
    stale = sorted(set(MLX_LM_SINCE) - set(used))
    assert not stale, f"no longer imported, drop from MLX_LM_SINCE: {stale}"
    floor = Version(FLOORS["mlx-lm"][0])
    too_new = {k: v for k, v in MLX_LM_SINCE.items() if Version(v) > floor}
    assert not too_new, f"mlx-lm>={floor} lacks {too_new}: raise the floor"


def test_what_the_walks_rely_on_is_within_the_mlx_lm_floor() -> None:
    floor = Version(FLOORS["mlx-lm"][0])
    assert all(Version(since) <= floor for since, _, _ in MLX_LM_BEHAVIOUR.values()), MLX_LM_BEHAVIOUR


def test_every_streamed_architecture_has_its_mlx_lm_module_from_the_floor() -> None:
    assert sorted(ARCHS) == sorted(MLX_LM_MODELS_SINCE), "a new architecture: record its mlx-lm module's release"
    floor = Version(FLOORS["mlx-lm"][0])
    assert all(Version(v) <= floor for v in MLX_LM_MODELS_SINCE.values())


def test_every_anyio_name_is_recorded_and_within_the_floor() -> None:
    used = _anyio_names()
    missing = {k: v for k, v in used.items() if k not in ANYIO_SINCE}
    assert not missing, f"add these to ANYIO_SINCE with the first anyio release that has them: {missing}"
    floor = Version(FLOORS["anyio"][0])
    too_new = {k: v for k, v in ANYIO_SINCE.items() if Version(v) > floor and k in used}
    assert not too_new, f"anyio>={floor} lacks {too_new}: raise the floor"


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def test_the_installed_mlx_lm_has_every_recorded_name() -> None:
    """The tables are true of the mlx-lm this suite runs with (a name it dropped shows here)."""
    for key in MLX_LM_SINCE:
        module, _, name = key.partition(":")
        if name:
            assert hasattr(_module(module), name), f"{key}: not in mlx-lm {importlib.metadata.version('mlx-lm')}"
    for model_type in MLX_LM_MODELS_SINCE:
        assert importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None, model_type
    for what, (_, module, text) in MLX_LM_BEHAVIOUR.items():
        assert text in inspect.getsource(_module(module)), f"{what}: mlx-lm {importlib.metadata.version('mlx-lm')}"


def test_the_installed_versions_meet_the_floors() -> None:
    for name, (floor, _) in FLOORS.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert Version(have) >= Version(floor), f"{name} {have} is below the floor {floor}"


def test_the_floors_tool_pins_each_established_floor() -> None:
    """tools/floors_check.py's constraints are exactly the floors above, and MLX at its pin."""
    spec = importlib.util.spec_from_file_location("floors_check", ROOT / "tools" / "floors_check.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    constraints = tool.floor_constraints(tool.requirements(ROOT / "pyproject.toml"))
    pins = {name: Version(v) for name, v in (c.split("==") for c in constraints)}
    assert {k: v for k, v in pins.items() if k != "mlx"} == {k: Version(v[0]) for k, v in FLOORS.items()}
    assert pins["mlx"] == Version(importlib.metadata.version("mlx"))


#: what a build from the sdist needs, and what its test suite reads (tests/ reads docs/, README.md,
#: examples/ and tools/), none of which an sdist exclude may catch
SDIST_NEEDS = ("pyproject.toml", "CMakeLists.txt", "README.md", "BENCHMARKS.md", "native", "asyncside", "tests",
               "docs", "examples", "tools")


def _sdist_excludes() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
    return list(config.get("sdist", {}).get("exclude", []))


def test_the_sdist_leaves_out_the_benchmark_results_and_nothing_a_build_needs() -> None:
    """scikit-build-core's sdist is the tree less .gitignore and ``sdist.exclude`` (gitignore
    patterns, matched as it matches them): benchmarks/ (some two MB of raw JSON and logs) stays
    out, every file a build or the tests read stays in."""
    pathspec = pytest.importorskip("pathspec")
    spec = pathspec.GitIgnoreSpec.from_lines(_sdist_excludes())
    needed = [p for name in SDIST_NEEDS for p in ([ROOT / name] if (ROOT / name).is_file()
                                                   else (ROOT / name).rglob("*")) if p.is_file()]
    caught = [p.relative_to(ROOT).as_posix() for p in needed if spec.match_file(p.relative_to(ROOT).as_posix())]
    assert not caught, caught
    results = [p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").rglob("*") if p.is_file()]
    assert results and all(spec.match_file(p) for p in results)


def test_the_sdist_builds_with_what_a_build_needs(tmp_path: pathlib.Path) -> None:
    """The sdist itself, where scikit-build-core is installed (the suite's venv has it only
    inside pip's build isolation): native/, CMakeLists.txt, README and the package's py.typed in,
    benchmarks/ and built files out."""
    pytest.importorskip("scikit_build_core")
    code = ("import sys; from scikit_build_core.build import build_sdist; "
            "print(build_sdist(sys.argv[1]))")
    name = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as tar:
        files = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    for needed in ("pyproject.toml", "CMakeLists.txt", "README.md", "native/bindings.cpp",
                   "native/mlx_dependency.h", "asyncside/py.typed", "asyncside/models/embedded.py"):
        assert needed in files, needed
    assert not [f for f in files if f.startswith(("benchmarks/", ".ci/", "build/")) or f.endswith(".so")]
