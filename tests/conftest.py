import numpy as np
import pytest

import ferrox_kv


def pytest_report_header(config):
    return f"ferrox_kv {ferrox_kv.__version__} from {ferrox_kv.__file__}"


def rows(n, width, seed=0, scale=1.0):
    """Deterministic, distinct float32 rows (never zeros)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, width)) * scale + 0.5).astype(np.float32)


class ArrayHook:
    """An array-like whose conversion runs ``effect`` first (hostile-input
    tests: conversion is user code that may close caches or empty lists)."""

    def __init__(self, value, effect):
        self.value, self.effect = value, effect

    def __array__(self, dtype=None, copy=None):
        self.effect()
        return np.asarray(self.value, dtype=dtype)


@pytest.fixture
def make_rows():
    return rows


def pytest_configure(config):
    # CI runs the suite against the installed package, never the source tree.
    import os
    if os.environ.get("FERROX_KV_REQUIRE_INSTALLED") == "1":
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        src = os.path.join(here, "ferrox_kv")
        if os.path.dirname(os.path.abspath(ferrox_kv.__file__)) == src:
            raise RuntimeError(f"tests imported ferrox_kv from the source tree ({src})")
