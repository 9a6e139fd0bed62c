"""The package imports and its native extension is the one built against the installed MLX."""

import mlx.core as mx

import asyncside
import asyncside._native as native


def test_native_extension_loads() -> None:
    info = native.build_info()
    assert info.startswith("asyncside-native")
    assert asyncside.__version__
    assert mx.array([1, 2, 3]).sum().item() == 6
