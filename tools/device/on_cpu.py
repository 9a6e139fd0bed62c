"""Run a Python script with MLX's default device set to the CPU (on the GPU machine, to measure the
host pools' read path there: its disk and cores). Usage: python3 tools/device/on_cpu.py SCRIPT ARGS...
With IN_PLACE=0 in the environment, O_DIRECT fault reads land in a buffer and are copied into the
rows, never read straight into them; with IN_PLACE=force, straight into them even where they are
CUDA managed memory (``_native.testing.set_direct_in_place``)."""

import os
import runpy
import sys

import mlx.core as mx

mx.set_default_device(mx.cpu)
if os.environ.get("IN_PLACE") in ("0", "force"):
    from asyncside import _native

    _native.testing.set_direct_in_place(os.environ["IN_PLACE"] == "force", force=True)
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
