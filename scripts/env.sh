#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install requirements.txt.
# Sourced by demo.sh, test.sh and study.sh. torch is installed first and pinned: an unpinned torch would
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
# pip's status survives the filter (pipefail); the filter drops harmless notices about a
# missing local package index that some machines' pip configuration names.
pip_install() { "$venv/bin/pip" install -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing requirements into $venv (about a minute)"
  pip_install "$(grep -E '^torch==' "$root/requirements.txt")"
  pip_install -r "$root/requirements.txt"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
