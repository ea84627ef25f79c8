"""Imports flow one way between pspo's modules: no module imports, directly or through others, a
module that imports it back. Every import counts: at the top, inside a function (a lazy import)
and under `if TYPE_CHECKING:`, since each one ties the two modules together all the same."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PSPO = os.path.join(ROOT, "pspo")


def project_imports() -> dict[str, set[str]]:
    """module name (without "pspo.") -> the pspo modules it imports anywhere in its file."""
    modules = {f[:-3] for f in os.listdir(PSPO) if f.endswith(".py") and f != "__init__.py"}
    graph = {}
    for name in modules:
        tree = ast.parse(open(os.path.join(PSPO, f"{name}.py"), encoding="utf-8").read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "pspo":           # from pspo import x
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pspo."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("pspo.")}
        graph[name] = deps - {name}
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


def test_data_builds_on_knights_and_rewards_below_the_pool():
    # Two pairs that could close a circle: data and knights (Example and DataError live below both, in
    # pspo/example.py) and rewards and reward_pool (rewards names a Protocol, Scorer, not RewardPool).
    graph = project_imports()
    assert "knights" in graph["data"] and reaches(graph, "knights", "data") is None
    assert "rewards" in graph["reward_pool"] and reaches(graph, "rewards", "reward_pool") is None
    assert graph["example"] == set()


@pytest.mark.slow
def test_each_module_imports_first_on_its_own():
    # Importing either module of such a pair first works (no partly initialised module).
    code = ("import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; "
            "from pspo.data import DataError, Example; from pspo import example; "
            "assert (DataError, Example) == (example.DataError, example.Example)")
    for order in (["pspo.knights", "pspo.data"], ["pspo.data", "pspo.knights"],
                  ["pspo.rewards", "pspo.reward_pool"], ["pspo.reward_pool", "pspo.rewards"]):
        proc = subprocess.run([sys.executable, "-c", code, *order], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (order, proc.stderr[-2000:])


def test_math_modules_and_config_import_no_components():
    # The math layer (advantages, loss and its log-prob head, segments, the samplers, ERS) imports
    # nothing of the project but itself: segments and ema_stats take whiten / zero_variance from
    # advantages. config.py imports no algorithm module, only its own checks, the spo section and the
    # prompt names it validates.
    imports = project_imports()
    math_layer = {"advantages", "loss", "segments", "priority_sampler", "reference_sampler",
                  "uniform_sampler", "ema_stats", "token_logprobs", "is_correction", "process_reward"}
    for module in math_layer:
        assert imports[module] <= math_layer, (module, imports[module] - math_layer)
    assert imports["config"] <= {"config_check", "spo_config", "prompts"}, imports["config"]


def test_model_loading_reaches_no_builder_nor_the_knights_generator():
    # model.py (loading, log-probs) imports neither a built-in model's builder nor the K&K generator,
    # through any chain of imports; builtin_models.py imports a builder only inside the branch that
    # resolves its name.
    graph = project_imports()
    for module in ("knights", "data", "tiny", "tiny_knights", "tiny_prm"):
        assert reaches(graph, "model", module) is None, (module, reaches(graph, "model", module))


@pytest.mark.slow
def test_resolving_and_loading_a_local_model_imports_no_builder(tiny_model_path):
    code = ("import sys; from pspo.builtin_models import resolve_model_path; "
            "from pspo.model import build_policy; "
            "path = resolve_model_path(sys.argv[1]); build_policy(path, False, 64, False, False); "
            "builders = ('pspo.knights', 'pspo.data', 'pspo.tiny', 'pspo.tiny_knights', 'pspo.tiny_prm'); "
            "loaded = [m for m in builders if m in sys.modules]; assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code, tiny_model_path], cwd=ROOT, check=True, timeout=120)
