"""Shared fixtures. The tiny demo models (arithmetic, K&K) are built once (a short supervised warm-up, cached under
$PSPO_CACHE or ~/.cache/pspo) and shared by the tests and the demo."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from pspo.tiny import ensure_tiny_model
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_knights_model_path() -> str:
    from pspo.tiny_knights import ensure_tiny_knights_model
    return ensure_tiny_knights_model()


def pytest_collection_modifyitems(session, config, items):
    """Tests that need the tiny K&K model run last: on a fresh machine scripts/test.sh builds it in
    the background (minutes), and the rest of the suite runs meanwhile instead of waiting on it."""
    needs = [item for item in items if "tiny_knights_model_path" in getattr(item, "fixturenames", ())]
    items[:] = [item for item in items if item not in needs] + needs
