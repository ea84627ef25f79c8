#!/usr/bin/env bash
# Download the wheels a bare GPU image lacks (docs/gpu.md#wheels), for Python 3.12 on x86-64 Linux, into
# DIR (default .whl), and write the commit being checked to DIR/COMMIT (the copy of the tree sent to a lent
# GPU has no .git). A DIR inside the checkout is added to git's local exclude list (it travels only where carried).
#   here:  bash scripts/gpu_wheels.sh .whl
#   there: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Brought: datasets and math-verify (train.py's data and rewards) as requirements.txt pins them, with the
# pure-Python packages they need at the versions the CPU environment resolves; TRL (the GPU check's `trl`
# section) as bench/requirements.txt pins it. Not brought, because the GPU image has them (its package
# list, 2026-11-17): torch, transformers, accelerate 1.15.0, peft, numpy, pyarrow, pandas, sympy, jinja2,
# xxhash, safetensors, tokenizers, tqdm, tensorboard, PyYAML. For an image without accelerate or peft:
# EXTRA="accelerate==1.15.0 peft==0.21.2" bash scripts/gpu_wheels.sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
pins() { grep -hE "^($1)==" requirements.txt bench/requirements.txt; }
mkdir -p "$DIR"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" $(pins 'datasets|math-verify|trl') \
  latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 dill==0.4.1 multiprocess==0.70.19 ${EXTRA:-}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit+changes"
echo "$commit" > "$DIR/COMMIT"
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
case "$DIR" in /*|../*) ;; *)                   # inside the checkout: keep it out of git's view
  if [ -n "$exclude" ] && ! grep -qxF "/${DIR#./}/" "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")" && echo "/${DIR#./}/" >> "$exclude"
  fi;;
esac
ls "$DIR"
du -sh "$DIR"
