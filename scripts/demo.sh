#!/usr/bin/env bash
# The demo: set up .venv, build the tiny base model if not cached, train it with PSPO (ERS + PPS) on the
# built-in arithmetic task, and print test accuracy before and after. Extra arguments are
# config overrides, e.g. `bash scripts/demo.sh --train.seed=1`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python train.py --config configs/pspo.yaml "$@"
