"""An mlx-lm older than the model code needs (installed past pip's floor: ``--no-deps``, another
package manager) is refused in one line that names both releases: from Python, an
MlxLmVersionError (an AsyncsideError and an ImportError); from the CLI, that line and no traceback,
where an ImportError of the first missing mlx-lm name (a traceback from ``asyncside demo``,
"unrecognized arguments" from ``asyncside convert``) was what a user saw."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from asyncside.models._mlx_lm import MLX_LM_FLOOR, MlxLmVersionError, check_mlx_lm_version

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_floor_is_pyprojects() -> None:
    deps = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    (floor,) = [s.version for r in deps if r.name == "mlx-lm" for s in r.specifier if s.operator == ">="]
    assert tuple(int(p) for p in floor.split(".")) == MLX_LM_FLOOR


@pytest.mark.parametrize("version", ["0.30.0", "0.31.3", "0.32.0", "0.32.0.post1"])
def test_an_older_mlx_lm_is_refused_in_one_line(version: str) -> None:
    need = ".".join(map(str, MLX_LM_FLOOR))
    with pytest.raises(MlxLmVersionError) as info:
        check_mlx_lm_version(version)
    assert str(info.value) == (f"mlx-lm {version} is older than asyncside needs ({need} or newer): "
                               f"pip install -U 'mlx-lm>={need}'")
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize("version", ["0.32.1", "0.32.2", "0.33.0rc1", "1.0"])
def test_the_floor_and_later_are_taken(version: str) -> None:
    check_mlx_lm_version(version)


@pytest.mark.parametrize("args", [["demo", "--tokens", "2"], ["convert", "MODEL", "OUT"], ["serve", "--port", "0"]],
                         ids=["demo", "convert", "serve"])
def test_the_cli_says_it_in_one_line(tmp_path: pathlib.Path, args: list[str]) -> None:
    site = tmp_path / "site"
    site.mkdir()
    # The mlx-lm the interpreter imports reports an older release, as one installed past the floor does.
    (site / "sitecustomize.py").write_text("import mlx_lm\nmlx_lm.__version__ = '0.31.3'\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_moe"}')
    args = [str(model) if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "asyncside.cli", *args], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode in (1, 2), (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "mlx-lm 0.31.3 is older than asyncside needs" in lines[0], r.stderr
    assert lines[0].startswith(f"asyncside {args[0]}: ")
