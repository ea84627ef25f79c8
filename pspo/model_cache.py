"""Where the models built in code are cached: under $PSPO_CACHE (default ~/.cache/pspo), one folder
per build, named by its kind and a hash of the parameters the build depends on (the demo models of
tiny.py, tiny_knights.py and tiny_prm.py, and standin.py's stand-ins of real configs)."""
from __future__ import annotations

import hashlib
import json
import os


def cache_folder(kind: str, params: dict, cache_dir: str | None = None) -> str:
    """`<cache_dir>/<kind>-<first 10 hex digits of sha256(params as sorted JSON)>`; cache_dir defaults
    to $PSPO_CACHE, else ~/.cache/pspo. The folder may not exist yet."""
    root = cache_dir or os.environ.get("PSPO_CACHE") or os.path.expanduser("~/.cache/pspo")
    key = json.dumps(params, sort_keys=True)
    return os.path.join(root, f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")
