"""Shared fixtures. The tiny arithmetic model is built once (a short supervised warm-up, cached under
$PSPO_CACHE or ~/.cache/pspo) and shared by the tests and the demo. The K&K presets are rehearsed on
the untrained twin of the tiny K&K model (same tokenizer and architecture, built in seconds); the
trained K&K model (~20 minutes to build) is used only by the tests marked `knights_model`, which run
when it is already built or PSPO_BUILD_KNIGHTS=1 asks for the build (`scripts/study.sh --task knights`
does both), and are skipped with a reason otherwise."""
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
def knights_standin_path() -> str:
    from pspo.tiny_knights import knights_standin
    return knights_standin()


@pytest.fixture(scope="session")
def tiny_knights_model_path() -> str:
    from pspo.tiny_knights import ensure_tiny_knights_model, tiny_knights_path
    if not os.path.isdir(tiny_knights_path()) and os.environ.get("PSPO_BUILD_KNIGHTS") != "1":
        pytest.skip("the trained tiny K&K model is not built (~20 min): `bash scripts/study.sh --task knights` "
                    "builds it and runs these tests (or set PSPO_BUILD_KNIGHTS=1)")
    return ensure_tiny_knights_model()
