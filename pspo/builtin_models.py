"""The built-in offline models, by name: `model.name_or_path: builtin:tiny` (tiny.py, the arithmetic demo)
or `builtin:tiny-knights` (tiny_knights.py), and `prm.model: builtin:tiny-prm` (tiny_prm.py, a process
reward model), each built in code on first use and cached. Kept apart from model.py, so that loading a
model imports neither builder nor the K&K puzzle generator."""
from __future__ import annotations

from pspo.tiny import TINY_MODEL, ensure_tiny_model
from pspo.tiny_knights import TINY_KNIGHTS_MODEL, ensure_tiny_knights_model
from pspo.tiny_prm import TINY_PRM, ensure_tiny_prm


def resolve_model_path(name_or_path: str) -> str:
    """`builtin:tiny` / `builtin:tiny-knights` / `builtin:tiny-prm` -> the cached built-in model (built on
    first use); anything else as given."""
    if name_or_path == TINY_MODEL:
        return ensure_tiny_model()
    if name_or_path == TINY_KNIGHTS_MODEL:
        return ensure_tiny_knights_model()
    if name_or_path == TINY_PRM:
        return ensure_tiny_prm()
    return name_or_path
