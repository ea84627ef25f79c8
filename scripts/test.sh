#!/usr/bin/env bash
# The test suite: set up .venv if needed, then run pytest. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m pytest tests -q "$@"
