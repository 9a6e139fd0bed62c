#!/usr/bin/env bash
# Stage what the GPU machine lacks besides MLX's CUDA wheel (which stage-mlx-cuda.sh-style staging
# puts in .devwheels/a and .devwheels/b): the project's pure and cp312 wheels at the versions this
# checkout's .venv runs (.devwheels/w1), and fmt's headers that MLX's CUDA headers include
# (.devwheels/fmt, from Debian's libfmt-dev). Run from the project root after
# `python3 -m venv .venv && .venv/bin/pip install -e '.[test]'`. tools/device/cuda-run.sh expects
# them in /root/stage (transformers) and /root/stage/whl (the rest); see its header for the calls.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.devwheels/' .git/info/exclude 2>/dev/null || echo '/.devwheels/' >> .git/info/exclude
tmp=$(mktemp -d)
# MLX comes from the CUDA wheel; numpy is there; lint, types and plots are not run there.
.venv/bin/pip freeze --exclude-editable \
  | grep -viE '^(mlx|mlx-cpu|numpy|mypy|mypy_extensions|ruff|matplotlib|contourpy|cycler|fonttools|kiwisolver|pillow|pyparsing|python-dateutil|six|pathspec|librt)==' \
  > "$tmp/want.txt"
printf "pytest-timeout\npytest-xdist\nexecnet\n" >> "$tmp/want.txt"  # SHARD runs of cuda-run.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$tmp/w1" -r "$tmp/want.txt"
(cd "$tmp" && apt-get download libfmt-dev >/dev/null 2>&1 && dpkg-deb -x libfmt-dev_*.deb fmtx)
rm -rf .devwheels/w1 .devwheels/fmt && mkdir -p .devwheels
mv "$tmp/w1" .devwheels/w1 && mv "$tmp/fmtx/usr/include" .devwheels/fmt
rm -rf "$tmp"
du -sh .devwheels/w1 .devwheels/fmt
