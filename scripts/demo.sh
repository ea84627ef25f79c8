#!/usr/bin/env bash
# The demo: set up .venv, build the tiny base model if not cached, train it with PSPO (ERS + PPS)
# on the built-in arithmetic task, and print test accuracy before and after. `--config FILE`
# first picks another preset (e.g. configs/grpo.yaml); the other arguments are config
# overrides, e.g. `bash scripts/demo.sh --train.seed=1`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
config=configs/pspo.yaml
if [ "${1:-}" = "--config" ]; then
  config="$2"
  shift 2
fi
python train.py --config "$config" "$@"
