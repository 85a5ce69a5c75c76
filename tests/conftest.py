import os

import pytest
import torch

# Tests must exercise the native ops: importing fedkernels.ops fails loudly if _C is missing.
import fedkernels  # noqa: F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread (two OpenMP threads on a busy 2-core box are far slower).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_report_header(config):
    try:
        return f"fedkernels build: {fedkernels.build_info()}"
    except Exception as e:  # pragma: no cover
        return f"fedkernels build: unavailable ({e})"
