"""The benchmarks' optional packages (matplotlib, httpx) are an extra: without them the commands say
which extra to install instead of failing with a bare ImportError, and the core does not need them."""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import pytest

from asyncside.bench import require_extra, run_bench
from asyncside.errors import MissingExtraError

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)


def test_bench_packages_are_an_extra_not_core_dependencies() -> None:
    project = _pyproject()["project"]
    core = " ".join(project["dependencies"])
    assert "matplotlib" not in core and "httpx" not in core
    bench = " ".join(project["optional-dependencies"]["bench"])
    assert "matplotlib" in bench and "httpx" in bench
    assert "asyncside[bench]" in project["optional-dependencies"]["test"]


def test_require_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: the import fails
    with pytest.raises(MissingExtraError, match=r"pip install 'asyncside\[bench\]'") as info:
        require_extra("matplotlib", "asyncside bench generate --plot")
    assert info.value.module == "matplotlib" and info.value.extra == "bench"
    assert isinstance(info.value, ImportError)


def test_require_extra_returns_the_module() -> None:
    assert require_extra("json", "nothing").__name__ == "json"


@pytest.mark.parametrize(("bench", "module", "extra_args"), [
    ("generate", "matplotlib", {"plot": "out.png"}),
    ("serve", "httpx", {}),
])
def test_bench_without_its_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], bench: str, module: str,
                                                      extra_args: dict) -> None:
    """Exit status 2 and the pip command on stderr, before any model is built or server started."""
    from asyncside.bench import serve

    monkeypatch.setitem(sys.modules, module, None)
    # serve validates its options first; the check that matters comes next.
    monkeypatch.setattr(serve, "_check", lambda args: None)
    args = argparse.Namespace(json=False, **extra_args)
    assert run_bench(bench, args) == 2
    err = capsys.readouterr().err
    assert f"asyncside bench {bench}" in err and module in err and "pip install 'asyncside[bench]'" in err
