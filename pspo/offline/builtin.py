"""The built-in offline models, by name: `model.name_or_path: builtin:tiny` (tiny.py, the arithmetic
demo) or `builtin:tiny-knights` (tiny_knights.py), and `prm.model: builtin:tiny-prm` (tiny_prm.py, a
process reward model), each built in code on first use and cached under $PSPO_CACHE
(tiny.py's `cache_folder`).

This module is the names' one home. A builder is imported only when its name is resolved, so that
resolving any other path (a local folder, a hub id) imports neither the builders nor the K&K puzzle
generator they train on."""
from __future__ import annotations

TINY_MODEL = "builtin:tiny"
TINY_KNIGHTS_MODEL = "builtin:tiny-knights"
TINY_PRM = "builtin:tiny-prm"


def resolve_model_path(name_or_path: str) -> str:
    """`builtin:tiny` / `builtin:tiny-knights` / `builtin:tiny-prm` -> the cached built-in model (built on
    first use); anything else as given."""
    if name_or_path == TINY_MODEL:
        from pspo.offline.tiny import ensure_tiny_model
        return ensure_tiny_model()
    if name_or_path == TINY_KNIGHTS_MODEL:
        from pspo.offline.tiny_knights import ensure_tiny_knights_model
        return ensure_tiny_knights_model()
    if name_or_path == TINY_PRM:
        from pspo.offline.tiny_prm import ensure_tiny_prm
        return ensure_tiny_prm()
    return name_or_path
