"""The docs (docs/README.md's equation table, the `Code:` lines of docs/methods.md, related.md and
gpu.md, README.md's tables) name code and tests that exist: every `path.py:Name` (or `Class.method`)
is defined in that file, every `tests/...py::test` (and each `::test` after it, in the same file) is
a test function there."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def definitions(path: str) -> set[str]:
    """"name" of each top-level function and class, "Class.method" of each method."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def references(text: str) -> list[tuple[str, str]]:
    """(file, name) for each `file.py:name` and `tests/....py::name`, a bare `::name` read against the
    file named before it."""
    found, last = [], None
    for m in re.finditer(r"`(?:((?:pspo|tests|bench)/[\w/]+\.py|train\.py|eval\.py)::?|::)(\w[\w.]*)`", text):
        if m.group(1):
            last = m.group(1)
        if last:
            found.append((last, m.group(2)))
    return found


def test_the_tables_name_code_and_tests_that_exist():
    missing = []
    for doc in ("docs/README.md", "docs/methods.md", "docs/related.md", "docs/gpu.md", "README.md"):
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        refs = references(text)
        assert refs, doc
        for path, name in refs:
            if not os.path.isfile(os.path.join(ROOT, path)) or name not in definitions(path):
                missing.append(f"{doc}: {path}:{name}")
    assert missing == [], missing
