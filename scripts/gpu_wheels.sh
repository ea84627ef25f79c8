#!/usr/bin/env bash
# Download the wheels a bare GPU image lacks (docs/gpu.md#wheels): datasets and math-verify with the
# dependencies the image does not have, for Python 3.12 on x86-64 Linux, into DIR (default .whl).
# There: pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
pins() { grep -E "^($1)==" requirements.txt; }
# datasets and math-verify as requirements.txt pins them; their pure-Python dependencies at the versions
# the CPU environment resolves (pip show); the rest (numpy, pyarrow, pandas, sympy...) is on the image
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" $(pins 'datasets|math-verify') \
  latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 dill==0.4.1 multiprocess==0.70.19
ls "$DIR"
