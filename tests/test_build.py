"""The package imports and its native extension is the one built against the installed MLX."""

import mlx.core as mx

import asyncside
import asyncside._native as native


def test_native_extension_loads() -> None:
    info = native.build_info()
    assert info.startswith("asyncside-native")
    assert asyncside.__version__
    assert mx.array([1, 2, 3]).sum().item() == 6


def test_typed_package_and_native_surface() -> None:
    """The package says it is typed (PEP 561), and test/bench entry points live in their own native
    submodules, not on the runtime's surface."""
    from importlib.resources import files

    assert files("asyncside").joinpath("py.typed").is_file()
    for name in ("StreamGate", "fail_on_stream", "TestingGate", "testing_fail", "wakeup_floor_ns",
                 "side_region_read", "pread_seconds", "memcpy_seconds", "cuda_h2d_bandwidth"):
        assert not hasattr(native, name), name
    assert {"StreamGate", "fail_on_stream"} <= set(dir(native.testing))
    assert {"wakeup_floor_ns", "side_region_read", "pread_seconds", "memcpy_seconds", "cuda_h2d_bandwidth"} <= set(
        dir(native.bench))
