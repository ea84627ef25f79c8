#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py; docs/gpu.md "GPU check"): run it first on any new GPU machine.
#
#   bash scripts/gpu_check.sh OUT [SECTION ...]        # one NVIDIA GPU: the default sections, <= 8 min with the wheels
#   bash scripts/gpu_check.sh --dry-run                # any machine: the time budget, every section's plan and commands
#   bash scripts/gpu_check.sh --small OUT [SECTION ...] # any machine: the script itself at CPU stand-in widths
#
# Packages the GPU image lacks (datasets, math-verify, TRL) come as wheels: scripts/gpu_wheels.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
