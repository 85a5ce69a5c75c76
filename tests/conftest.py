import os

import pytest
import torch

# Tests must exercise the native ops: importing fedkernels.ops fails loudly if _C is missing.
import fedkernels  # noqa: F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    try:
        return f"fedkernels build: {fedkernels.build_info()}"
    except Exception as e:  # pragma: no cover
        return f"fedkernels build: unavailable ({e})"
