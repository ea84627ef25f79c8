#!/usr/bin/env bash
# The convergence study (bench/convergence.py): set up .venv plus the bench-only plotting
# dependency, then train grpo, dr_grpo, ers, pps and pspo over 3 seeds. Arguments go to the
# script, e.g. `bash scripts/study.sh --quick` (the 2-minute version CI runs).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
pip_install -r bench/requirements.txt
python bench/convergence.py "$@"
