"""The docs (README.md and docs/*.md) point at code, tests, files and sections that exist, so that a
rename or a move shows here instead of in a reader's search:
- every code pointer `path.py:name` or `path.py:Class.method` (the path whole, or the end of one, as
  `engines/decode.py:window`), and each bare `name` joined to it by a comma, "+" or "→", is defined in
  that file (a top-level function or class, a method of a class; a bare name after `Class.method`
  may be another method of that class); every `tests/...py::test` (and each `::test` after it) is a
  test function there;
- no pointer names a line (`file.py:120`, `#L120`): lines move with every edit, names do not;
- every path in backticks under one of the repository's folders (`pspo/update.py`, `configs/*.yaml`,
  `scripts/launch_nodes.sh`) exists, and each preset of README.md's method table is in configs/;
- every link to a file of the repository reaches it, its `#anchor` is there, and a `§` in the link's
  text names a section of that file (docs/methods.md §3a, docs/related.md §A, bench/RESULTS.md §21);
- every section of docs/methods.md or docs/related.md that the code's docstrings and comments cite exists."""
import ast
import fnmatch
import functools
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FOLDERS = ("pspo", "tests", "bench", "configs", "scripts", "docs", "data", ".ci")     # the repository's own


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


@functools.cache
def python_files() -> tuple[str, ...]:
    """Every .py file of the repository, relative to its root (the virtual environment and caches left out)."""
    found = []
    for folder, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in ("__pycache__", "runs")]
        found += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names if n.endswith(".py")]
    return tuple(found)


def resolve(path: str) -> str | None:
    """The repository's file `path` names: itself, or the one file whose path ends with it (`engines/decode.py`)."""
    if os.path.isfile(os.path.join(ROOT, path)):
        return path
    ends = [p for p in python_files() if p.endswith("/" + path)]
    return ends[0] if len(ends) == 1 else None


@functools.cache
def definitions(path: str) -> frozenset[str]:
    """"name" of each top-level function and class, "Class.method" of each method."""
    names, functions = set(), (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.parse(read(path)).body:
        if isinstance(node, (*functions, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, functions)}
    return frozenset(names)


POINTER = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*\w+\.py)(::?)([A-Za-z_]\w*(?:\.\w+)*)")
# a bare `name` joined to the pointer before it: "`file.py:a`, `b`", "`file.py:A.a` → `b`", "`file.py:a` + `b`"
JOINED = re.compile(r"`?\s*(?:,|\+|→)\s*`([A-Za-z_]\w*(?:\.\w+)*)`")
TEST_ONLY = re.compile(r"`::(\w+)`")                    # `::test_name`: another test of the file named before it


def pointers(text: str) -> list[tuple[str, str, str]]:
    """(path as written, name, the pointer as written) for each code pointer, the bare names joined to one,
    and each `::test` read against the test file named before it."""
    found, spans = [], []
    for m in POINTER.finditer(text):
        path, name = m.group(1), m.group(3)
        found.append((path, name, m.group(0)))
        spans.append((m.start(), path))
        cls = name.rsplit(".", 1)[0] if "." in name else ""
        end = m.end()
        while (j := JOINED.match(text, end)) is not None:
            bare = j.group(1)
            found.append((path, f"{cls}.{bare}" if cls and "." not in bare else bare, f"{m.group(0)} ... {bare}"))
            end = j.end()
    for m in TEST_ONLY.finditer(text):
        before = [path for start, path in spans if start < m.start() and path.startswith("tests/")]
        if before:
            found.append((before[-1], m.group(1), f"{before[-1]}::{m.group(1)}"))
    return found


def pointer_errors(doc: str, text: str) -> list[str]:
    errors = []
    for path, name, written in pointers(text):
        file = resolve(path)
        if file is None:                               # (another project's code: its path without `:name`)
            errors.append(f"{doc}: {written}: no such file in the repository (or more than one)")
            continue
        cls, _, method = name.rpartition(".")
        if name not in definitions(file) and not (cls and cls not in definitions(file)
                                                  and f"{cls}.{method}" in definitions(file)):
            errors.append(f"{doc}: {written}: {file} defines no {name}")
    return errors


def test_code_pointers_name_definitions_that_exist():
    errors = []
    for doc in DOCS:
        text = read(doc)
        assert pointers(text) or doc == "docs/gpu.md", doc
        errors += pointer_errors(doc, text)
    assert errors == [], "\n".join(errors)


def test_the_pointer_reader_catches_a_stale_pointer():
    # the reader itself: a renamed function, a method of the wrong class, a bare name joined to a pointer, a
    # partial path and a test id each resolved, or refused with the file named
    text = ("`pspo/loss.py:policy_loss`, `k3_kl`; `pspo/ema_stats.py:EMAStats.smooth` → `no_such_method`; "
            "`engines/decode.py:window`; `pspo/loss.py:policy_loss_v2`; `tests/checks/test_docs_references.py::"
            "test_code_pointers_name_definitions_that_exist`, `::test_gone`")
    assert pointer_errors("x.md", text) == [
        "x.md: pspo/ema_stats.py:EMAStats.smooth ... no_such_method: pspo/ema_stats.py defines no "
        "EMAStats.no_such_method",
        "x.md: pspo/loss.py:policy_loss_v2: pspo/loss.py defines no policy_loss_v2",
        "x.md: tests/checks/test_docs_references.py::test_gone: tests/checks/test_docs_references.py defines no "
        "test_gone"]
    assert pointer_errors("x.md", "`engines/nowhere.py:f` and `rollout.py:x`") == [
        "x.md: engines/nowhere.py:f: no such file in the repository (or more than one)",
        "x.md: rollout.py:x: no such file in the repository (or more than one)"]   # pspo/ and bench/ have one


LINE_POINTER = re.compile(r"(?<![\w/.-])(?:[\w.-]+/)*[\w.-]+\.(?:py|sh|md|yaml|json|txt)(?::\d+\b|#L\d+)")


def test_no_pointer_names_a_line():
    found = [f"{doc}: {m.group(0)}" for doc in DOCS for m in LINE_POINTER.finditer(read(doc))]
    assert found == [], "name the function or class instead of the line: " + ", ".join(found)
    assert [m.group(0) for m in LINE_POINTER.finditer("see decode.py:1, train.py#L23 and `pspo/x.py:f`")] == [
        "decode.py:1", "train.py#L23"]


PATH = re.compile(r"`((?:" + "|".join(re.escape(f) for f in FOLDERS) + r")/[\w./*-]*|train\.py|eval\.py)`")


def test_paths_in_backticks_exist():
    missing = [f"{doc}: {m.group(1)}" for doc in DOCS for m in PATH.finditer(read(doc))
               if not glob.glob(os.path.join(ROOT, m.group(1)))]
    assert missing == [], missing


def test_the_method_tables_presets_are_in_configs():
    # README.md's method table: its third column names presets relative to configs/
    table = read("README.md").split("## Methods", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    presets = [name for row in rows for name in re.findall(r"`([\w/.-]+\.yaml)`", row[2])]
    assert len(presets) > 30
    assert [p for p in presets if not os.path.isfile(os.path.join(ROOT, "configs", p))] == []


def anchors(path: str) -> set[str]:
    """The anchors of a markdown file: its `<a id>`s and its headings' GitHub slugs."""
    text = read(path)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}
    return set(re.findall(r'<a id="([^"]+)"', text)) | slugs


def sections(path: str) -> set[str]:
    """The sections a `§` may name in a file: "3a" for docs/methods.md's "§3a" or bench/RESULTS.md's "## 3a."."""
    text = read(path)
    return set(re.findall(r"^#+ §(\w+)", text, flags=re.M)) | set(re.findall(r"^#+ (\d+\w?)\. ", text, flags=re.M))


LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def link_errors(doc: str, text: str) -> list[str]:
    errors = []
    for label, target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue                                   # https:, mailto:
        file, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(doc), file)) if file else doc
        if not os.path.exists(os.path.join(ROOT, path)):
            errors.append(f"{doc}: ({target}): no such file")
            continue
        if anchor and path.endswith(".md") and anchor not in anchors(path):
            errors.append(f"{doc}: ({target}): no anchor #{anchor} in {path}")
        for section in re.findall(r"§(\w+)", label):
            if path.endswith(".md") and section not in sections(path):
                errors.append(f"{doc}: [{label}]({target}): {path} has no §{section}")
    return errors


def test_links_reach_their_files_anchors_and_sections():
    errors = [e for doc in DOCS for e in link_errors(doc, read(doc))]
    assert errors == [], "\n".join(errors)
    assert link_errors("README.md", "[docs/methods.md §3a](docs/methods.md#s3a), [§99](bench/RESULTS.md), "
                                    "[x](docs/methods.md#nowhere), [y](docs/none.md)") == [
        "README.md: [§99](bench/RESULTS.md): bench/RESULTS.md has no §99",
        "README.md: (docs/methods.md#nowhere): no anchor #nowhere in docs/methods.md",
        "README.md: (docs/none.md): no such file"]


def test_the_codes_section_references_exist():
    # "docs/methods.md §7b", "related.md §A" in docstrings and comments: the section is there
    wanted = {"methods.md": sections("docs/methods.md"), "related.md": sections("docs/related.md")}
    missing = []
    for path in python_files():
        if path.startswith(("pspo/", "tests/", "bench/")) or path in ("train.py", "eval.py"):
            for doc, section in re.findall(r"(methods\.md|related\.md),? §(\w+)", read(path)):
                if section not in wanted[doc]:
                    missing.append(f"{path}: {doc} §{section}")
    assert missing == [], missing


def test_the_loops_lines_quoted_in_readme_are_in_train_py():
    # README.md's "PSPO's part" table quotes the loop's calls (up to a "..."): each is in train.py as written
    table = read("README.md").split("| PSPO's part |", 1)[1].split("\n\n", 1)[0]
    quotes = [q.split("...")[0] for row in table.splitlines()[2:] for q in re.findall(r"`([^`]+)`", row.split(" | ")[2])
              if "(" in q]
    assert len(quotes) == 5, quotes
    assert [q for q in quotes if q not in read("train.py")] == []


def layout() -> dict[str, set[str]]:
    """README.md's Layout block: for each folder of pspo/, the .py files it lists (a `knights*.py` as written)."""
    block = read("README.md").split("## Layout", 1)[1].split("```", 2)[1]
    listed, folder = {}, None
    for line in block.splitlines():
        if m := re.match(r"(pspo/[\w/]*)\s", line):        # a folder's entry: its files in the description
            folder = m.group(1)
            listed[folder] = set(re.findall(r"[\w*]+\.py", line[m.end():]))
        elif m := re.match(r"  ([\w*]+\.py)\s", line):     # a file of pspo/, an entry of its own
            listed["pspo/"].add(m.group(1))
        elif re.match(r"\S", line):                        # train.py, eval.py, tests/, ...: another entry
            folder = None
        elif folder:                                       # the description goes on
            listed[folder] |= set(re.findall(r"[\w*]+\.py", line))
    return listed


def test_the_layout_lists_every_file_of_pspo():
    listed = layout()
    assert set(listed) == {"pspo/", "pspo/engines/", "pspo/tasks/", "pspo/related/", "pspo/training/", "pspo/offline/"}
    for folder, names in listed.items():
        present = {n for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith(".py") and n != "__init__.py"}
        covered = {n for pattern in names for n in present if fnmatch.fnmatch(n, pattern)}
        assert present - covered == set(), f"README.md's layout leaves out {folder}: {sorted(present - covered)}"
        assert [p for p in names if not any(fnmatch.fnmatch(n, p) for n in present)] == [], folder
