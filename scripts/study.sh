#!/usr/bin/env bash
# The convergence study (bench/convergence.py): set up .venv plus the bench-only plotting
# dependency, then train grpo, dr_grpo, ers, pps and pspo over 3 seeds. Arguments go to the
# script, e.g. `bash scripts/study.sh --quick` (the 2-minute version CI runs).
#
# `--task knights` runs the K&K presets on the study's base, builtin:tiny-knights (version 4 of the
# tiny K&K model, pspo/offline/tiny_knights.py: ~16-20 minutes to build, once), not on the quick base
# the presets name: the K&K results in bench/RESULTS.md are conditioned on it. It is built here first,
# and the tests that need its trained weights (tests/components/test_tiny_knights.py, marked knights_model: the
# names, the accuracy spread by size, its tokenizer equal to the stand-in's the presets' rehearsals
# use) must pass before the study runs. `--quick` runs on the presets' own bases and builds nothing.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
pip_install -r bench/requirements.txt
if [[ " $* " == *" --task knights "* || " $* " == *" --task=knights "* ]] && [[ " $* " != *" --quick "* ]]; then
  PSPO_BUILD_KNIGHTS=1 python -m pytest tests/components/test_tiny_knights.py -q -m knights_model
fi
python bench/convergence.py "$@"
