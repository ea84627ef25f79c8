"""The built-in offline models, by name: `model.name_or_path: builtin:tiny` (tiny.py, the arithmetic
demo), `builtin:tiny-knights-quick` (the K&K presets' base) or `builtin:tiny-knights` (the K&K study's
base; both tiny_knights.py), and `prm.model: builtin:tiny-prm` (tiny_prm.py, a process reward model),
each built in code on first use and cached under $PSPO_CACHE (tiny.py's `cache_folder`).

This module is the names' one home. A builder is imported only when its name is resolved, so that
resolving any other path (a local folder, a hub id) imports neither the builders nor the K&K puzzle
generator they train on."""
from __future__ import annotations

TINY_MODEL = "builtin:tiny"
TINY_KNIGHTS_QUICK = "builtin:tiny-knights-quick"    # tiny_knights.QUICK_STEPS warm-up steps: about a minute
TINY_KNIGHTS_MODEL = "builtin:tiny-knights"          # tiny_knights.STUDY_STEPS (version 4): ~16-20 minutes
KNIGHTS_MODELS = (TINY_KNIGHTS_QUICK, TINY_KNIGHTS_MODEL)
TINY_PRM = "builtin:tiny-prm"


def resolve_model_path(name_or_path: str) -> str:
    """`builtin:tiny` / `builtin:tiny-knights-quick` / `builtin:tiny-knights` / `builtin:tiny-prm` -> the
    cached built-in model (built on first use); anything else as given."""
    if name_or_path == TINY_MODEL:
        from pspo.offline.tiny import ensure_tiny_model
        return ensure_tiny_model()
    if name_or_path in KNIGHTS_MODELS:
        from pspo.offline.tiny_knights import QUICK_STEPS, STUDY_STEPS, ensure_tiny_knights_model
        quick = name_or_path == TINY_KNIGHTS_QUICK
        return ensure_tiny_knights_model(warmup_steps=QUICK_STEPS if quick else STUDY_STEPS)
    if name_or_path == TINY_PRM:
        from pspo.offline.tiny_prm import ensure_tiny_prm
        return ensure_tiny_prm()
    return name_or_path
