"""bench/rollout.py at a tiny size: the figures the GPU check reads, the loops' agreement, what each static
loop reads of the cache, and its refusal of per-row budgets for engines that cannot take them."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("rollout_bench", os.path.join(ROOT, "bench", "rollout.py"))
rollout_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rollout_bench)


def test_recipe_lengths_side_by_side(tmp_path, capsys):
    # 3 prompts x 2 on a random 2 x 64 Qwen2 (it rarely stops), budgets log-uniform in [10, 40], a 128-position
    # cache: static-full attends over 6 rows x 128 columns at every step (768); windows and compaction each
    # read less, both together least; every loop draws the same tokens
    out = tmp_path / "decode.json"
    rollout_bench.main(["--random", "2,64", "--engines", "static-full", "static-window", "static-compact",
                        "static", "--prompts", "3", "--n", "2", "--max-new-tokens", "40", "--cache-len", "128",
                        "--lengths", "recipe", "--repeats", "1", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert (figures["rows"], figures["cache_len"], figures["reference"]) == (6, 128, "static-full")
    runs = {r["engine"]: r for r in figures["runs"]}
    for r in runs.values():
        assert {"ms_per_step", "tokens_per_s", "first_call_s", "compiles", "recompiles", "skips"} <= set(r)
        assert r["rows_equal"] == 6 and r["mean_length"] == runs["static-full"]["mean_length"] <= 40
    reads = {name: r["cache_positions_per_step"] for name, r in runs.items()}
    assert reads["static-full"] == 6 * 128
    assert reads["static"] < min(reads["static-window"], reads["static-compact"]) < reads["static-full"]
    table = capsys.readouterr().out
    assert "| engine / static-full, max new tokens 40 | wall time | CPU time | cache positions read |" in table
    assert table.count("| static-window |") == 2                             # in both tables


def test_per_row_budgets_are_for_the_static_loops_only(capsys):
    too_short = ["--engines", "static", "--lengths", "recipe", "--max-new-tokens", "8"]
    for argv, message in ((["--engines", "generate", "static", "--lengths", "recipe"], "not generate"),
                          (too_short, "start at 10")):
        with pytest.raises(SystemExit) as stop:
            rollout_bench.main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --lengths recipe") and message in err[0]
