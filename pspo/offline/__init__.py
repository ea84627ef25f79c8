"""Models built in code, for machines without a model hub: the tiny demo models (tiny.py,
tiny_knights.py, tiny_prm.py), CPU stand-ins of real configs (standin.py), and their names and
cache (builtin.py)."""
