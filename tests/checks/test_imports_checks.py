"""The house rules of pspo/, read from the code.

- The top of pspo/ is what a reader of the paper opens (TOP below); everything else lives one
  folder down, in the folder of its role (FOLDERS).
- Imports flow one way: no module imports, directly or through others, a module that imports it
  back. Every import counts: at the top, inside a function (a lazy import) and under
  `if TYPE_CHECKING:`, since each one ties the two modules together all the same.
- The math (the formulas the docs state) imports nothing of the project but other math and torch.compile's
  rule (training/compiled.py, which imports nothing of the project); the config imports nothing but the
  math (the names its formulas accept).
- The machinery in the folders never imports the loop's steps at the top (LOOP_STEPS).
- The rooms stand in layers (LAYERS): a module imports only modules of its own layer or a lower one,
  so no import climbs back up, between folders as between files.
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PSPO = os.path.join(ROOT, "pspo")

# The paper and the loop's steps (docs/README.md's table names their formulas).
TOP = {"estimators", "ema_stats", "priority_sampler", "released_sampler", "sampler", "loss", "is_correction",
       "rollout", "rewards", "methods", "update", "evaluation", "dynamic_sampling"}
FOLDERS = {"engines", "tasks", "related", "training", "offline"}
MATH = {"estimators", "ema_stats", "priority_sampler", "released_sampler", "loss", "is_correction",
        "related.spo_segments", "related.process_reward", "training.token_logprobs"}
LOOP_STEPS = {"sampler", "rollout", "methods", "update", "evaluation", "dynamic_sampling"}
# Lowest first: the paper's formulas; the training infrastructure (config, processes, the model, token
# rows); the tasks and the engines built on it; the rewards on the tasks and the models built offline
# (trained on the tasks); the related methods on all of these; the loop's steps; the method choice.
LAYERS = [{"estimators", "ema_stats", "priority_sampler", "released_sampler", "loss", "is_correction"},
          {"training"}, {"tasks", "engines"}, {"rewards", "offline"}, {"related"},
          {"sampler", "rollout", "update", "evaluation", "dynamic_sampling"}, {"methods"}]


def module_files() -> dict[str, str]:
    """module name without "pspo." (folders dotted: "engines.decode") -> its file."""
    out = {}
    for folder, _, files in os.walk(PSPO):
        rel = os.path.relpath(folder, PSPO)
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                name = f[:-3] if rel == "." else f"{rel.replace(os.sep, '.')}.{f[:-3]}"
                out[name] = os.path.join(folder, f)
    return out


def project_imports() -> dict[str, set[str]]:
    """module name (without "pspo.") -> the pspo modules it imports anywhere in its file."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pspo"):
                base = node.module[len("pspo."):] if node.module != "pspo" else ""
                for a in node.names:                                     # from pspo.training import config
                    full = f"{base}.{a.name}" if base else a.name
                    deps.add(full if full in files else base)
            elif isinstance(node, ast.Import):
                deps |= {a.name[len("pspo."):] for a in node.names if a.name.startswith("pspo.")}
        graph[name] = {d for d in deps if d in files} - {name}
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """An import path start -> ... -> goal, or None."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop()
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == goal:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    return None


def test_no_import_cycles():
    graph = project_imports()
    cycles = {m: path for m in sorted(graph) if (path := reaches(graph, m, m))}
    assert cycles == {}, cycles


def test_data_builds_on_knights_and_rewards_on_the_pool():
    # Two pairs that could close a circle: data and knights (Example and DataError live below both, in
    # pspo/tasks/example.py) and rewards and the reward pool (the pool runs the functions it is handed).
    graph = project_imports()
    assert "tasks.knights" in graph["tasks.data"] and reaches(graph, "tasks.knights", "tasks.data") is None
    assert "tasks.reward_pool" in graph["rewards"] and reaches(graph, "tasks.reward_pool", "rewards") is None


def test_the_top_of_pspo_is_the_paper_and_the_rest_is_in_folders():
    top = {f[:-3] for f in os.listdir(PSPO) if f.endswith(".py") and f != "__init__.py"}
    folders = {d for d in os.listdir(PSPO) if os.path.isdir(os.path.join(PSPO, d)) and d != "__pycache__"}
    assert top == TOP, f"a new module goes into the folder of its role, not beside the paper's: {top ^ TOP}"
    assert folders == FOLDERS, folders ^ FOLDERS
    for folder in folders:                       # each folder says what its role is
        doc = ast.get_docstring(ast.parse(open(os.path.join(PSPO, folder, "__init__.py")).read()))
        assert doc, folder


def test_the_math_imports_only_math_and_the_config_no_component():
    # The formulas (the advantage estimators, ERS, the samplers' math, the loss and its log-prob head, the IS
    # correction, SPO's segments, PSPO*'s process reward) import nothing of the project but each other and
    # the rule every compiled function follows (the log-prob head's), itself importing nothing of the project;
    # the config imports only the math (the names a formula accepts, e.g. loss.AGGREGATIONS).
    imports = project_imports()
    assert imports["training.compiled"] == set()
    for module in MATH:
        assert imports[module] <= MATH | {"training.compiled"}, (module, imports[module] - MATH)
    assert imports["training.config"] <= MATH, imports["training.config"] - MATH


def test_the_rooms_stand_in_layers_and_no_import_climbs_back_up():
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    imports = project_imports()
    assert {m.split(".")[0] for m in imports} == set(layer), set(layer) ^ {m.split(".")[0] for m in imports}
    climbs = {(m, d) for m, deps in imports.items() for d in deps
              if layer[d.split(".")[0]] > layer[m.split(".")[0]]}
    assert climbs == set(), sorted(climbs)


def test_the_machinery_never_imports_the_loops_steps():
    imports = project_imports()
    offenders = {m: deps & LOOP_STEPS for m, deps in imports.items() if "." in m and deps & LOOP_STEPS}
    assert offenders == {}, offenders


def test_model_loading_reaches_no_builder_nor_the_knights_generator():
    # training/model.py (loading, log-probs) imports neither a built-in model's builder nor the K&K
    # generator, through any chain of imports; offline/builtin.py imports a builder only inside the
    # branch that resolves its name.
    graph = project_imports()
    for module in ("tasks.knights", "tasks.data", "offline.tiny", "offline.tiny_knights", "offline.tiny_prm"):
        assert reaches(graph, "training.model", module) is None, (module, reaches(graph, "training.model", module))


def test_the_reward_workers_import_no_torch():
    # rewards.py is what a reward worker imports (tasks/reward_pool.py): without torch it starts in
    # ~0.7 s instead of ~2 s, so torch is imported only where result tensors are built
    code = "import sys, pspo.rewards; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.slow
def test_resolving_and_loading_a_local_model_imports_no_builder(tiny_model_path):
    code = ("import sys; from pspo.offline.builtin import resolve_model_path; "
            "from pspo.training.model import build_policy; "
            "path = resolve_model_path(sys.argv[1]); build_policy(path, chunk_tokens=64); "
            "builders = ('pspo.tasks.knights', 'pspo.tasks.data', 'pspo.offline.tiny', "
            "'pspo.offline.tiny_knights', 'pspo.offline.tiny_prm'); "
            "loaded = [m for m in builders if m in sys.modules]; assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code, tiny_model_path], cwd=ROOT, check=True, timeout=120)
