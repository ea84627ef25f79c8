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
