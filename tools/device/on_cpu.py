"""Run a Python script with MLX's default device set to the CPU (on the GPU machine, to measure the
host pools' read path there: its disk and cores). Usage: python3 tools/device/on_cpu.py SCRIPT ARGS..."""

import runpy
import sys

import mlx.core as mx

mx.set_default_device(mx.cpu)
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
