import os
import warnings

import pytest

# the suite runs the Numba kernels; tests/test_firstuse.py runs their pure-Python twins too
os.environ.setdefault("TDZ_NUMBA_KERNELS", "always")

# tensordict warns about pickle defaults and robust keys on every load
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture
def small_tree():
    import numpy as np
    import torch

    return {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "nested": {"b": torch.ones(2, 4, dtype=torch.bfloat16), "deep": {"c": torch.tensor([1, 2, 3])}},
        "np": np.arange(5, dtype=np.int16),
        "tag": "hello",
    }


def pytest_report_header(config):
    return f"NUMBA_CACHE_DIR={os.environ.get('NUMBA_CACHE_DIR', '<default>')}"


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: long fuzzing runs; they skip unless selected with -m fuzz")
