import os

import pytest
import torch

# Tests must exercise the native ops: importing fedkernels.ops fails loudly if _C is missing.
import fedkernels  # noqa: F401

# Hypothesis profiles (tests/test_fuzz.py takes its example counts from the loaded one): "suite" for
# `make test`, "thorough" ten times as many examples: `pytest tests/test_fuzz.py --hypothesis-profile
# thorough` (the long campaign is `python -m bench.fuzz`).
try:
    from hypothesis import settings as _hyp_settings
except ImportError:  # pragma: no cover  (hypothesis is in the `test` extra)
    _hyp_settings = None
if _hyp_settings is not None:
    _hyp_settings.register_profile("suite", max_examples=30)
    _hyp_settings.register_profile("thorough", max_examples=300)
    _hyp_settings.load_profile("suite")  # --hypothesis-profile NAME (pytest_configure) loads another


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
