import numpy as np
import pytest

import ferrox_kv


def pytest_report_header(config):
    return f"ferrox_kv {ferrox_kv.__version__} from {ferrox_kv.__file__}"


def rows(n, width, seed=0, scale=1.0):
    """Deterministic, distinct float32 rows (never zeros)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, width)) * scale + 0.5).astype(np.float32)


@pytest.fixture
def make_rows():
    return rows
