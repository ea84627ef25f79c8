"""Shared fixtures. The tiny arithmetic model is built once (a short supervised warm-up, cached under
$PSPO_CACHE or ~/.cache/pspo) and shared by the tests and the demo. The K&K presets are rehearsed on
the untrained twin of the tiny K&K model (same tokenizer and architecture, built in seconds); the
trained K&K model (~20 minutes to build) is used only by the tests marked `knights_model`, which run
when it is already built or PSPO_BUILD_KNIGHTS=1 asks for the build (`scripts/study.sh --task knights`
does both), and are skipped with a reason otherwise."""
import functools
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Under pytest-xdist (scripts/test.sh runs `-n 2`), each worker and the train.py / torchrun processes
# it starts get the cores divided among the workers, here before anything imports torch: two
# workers of two PyTorch threads each on two cores made the preset rehearsals 2x slower than one
# process, two of one thread each 1.5x faster.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


# Each model is resolved once per test process (functools.cache) and handed to tests by a fixture.

@functools.cache
def _tiny_model() -> str:
    from pspo.offline.tiny import ensure_tiny_model
    return ensure_tiny_model()


@functools.cache
def _knights_standin() -> str:
    from pspo.offline.tiny_knights import knights_standin
    return knights_standin()


@functools.cache
def _tiny_knights_model() -> str:
    from pspo.offline.tiny_knights import ensure_tiny_knights_model
    return ensure_tiny_knights_model()


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    return _tiny_model()


@pytest.fixture(scope="module")
def knights_standin_path() -> str:
    return _knights_standin()


@pytest.fixture(scope="module")
def tiny_knights_model_path() -> str:
    from pspo.offline.tiny_knights import tiny_knights_path
    if not os.path.isdir(tiny_knights_path()) and os.environ.get("PSPO_BUILD_KNIGHTS") != "1":
        pytest.skip("the trained tiny K&K model is not built (~20 min): `bash scripts/study.sh --task knights` "
                    "builds it and runs these tests (or set PSPO_BUILD_KNIGHTS=1)")
    return _tiny_knights_model()


def pytest_collection_modifyitems(config, items):
    """The slow tests first, so that under pytest-xdist no worker is left with a long one at the
    end; the tests sharing one vLLM engine (a module fixture) on one worker (--dist loadgroup)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)      # stable: file order kept
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if item.path.name == "test_vllm_engine.py":
                item.add_marker(pytest.mark.xdist_group("vllm"))
