"""Benchmarks: one module per `asyncside bench <what>`."""
