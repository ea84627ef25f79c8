#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install requirements.txt.
# Sourced by demo.sh and test.sh. torch is installed first and pinned: an unpinned torch would
# pull a different build. Re-installs only when requirements.txt changes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$root/requirements.txt" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv"
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing requirements into $venv (about a minute)"
  "$venv/bin/pip" install -q "$(grep -E '^torch==' "$root/requirements.txt")"
  "$venv/bin/pip" install -q -r "$root/requirements.txt"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
