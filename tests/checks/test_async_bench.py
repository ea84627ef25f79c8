"""bench/async_overlap.py's table and its refusal of an unbalanced workload (the runs themselves are bench-only)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("async_overlap", os.path.join(ROOT, "bench", "async_overlap.py"))
async_overlap = importlib.util.module_from_spec(spec)
sys.modules["async_overlap"] = async_overlap
spec.loader.exec_module(async_overlap)


def rows(steps, gens):
    return [{"step": i + 1, "step_time_s": s, "gen_s": g, "engine_gen_s": 0.5, "engine_idle_s": 0.1,
             "weight_sync_s": 0.002} for i, (s, g) in enumerate(zip(steps, gens))]


def test_table_medians_after_warmup_and_ratio():
    # the first 2 steps are left out. sync: steps [9, 9, 2, 2.2, 1.8] -> median 2.0, gen [.., 1, 1.1, .9] -> 1.0,
    # trainer 2.0 - 1.0 = 1.0; async: steps [9, 9, 1.2, 1.3, 1.1] -> 1.2, gen .1 -> trainer 1.1; 1.2 / 2.0 = 0.60x
    sync = rows([9, 9, 2.0, 2.2, 1.8], [5, 5, 1.0, 1.1, 0.9])
    lag1 = rows([9, 9, 1.2, 1.3, 1.1], [5, 5, 0.1, 0.1, 0.1])
    lines = async_overlap.table([("sync", "0", sync), ("async, lag 1", "trainer 0, engine 1", lag1)])
    assert lines[2] == "| sync | 0 | 2.000 | 1.000 | 1.000 | 0.500 | 0.100 | 0.0020 | 1.00x |"
    assert lines[3] == "| async, lag 1 | trainer 0, engine 1 | 1.200 | 0.100 | 1.100 | 0.500 | 0.100 | 0.0020 | 0.60x |"


def test_unbalanced_workload_is_refused(monkeypatch, capsys):
    # generation 3 s against 1 s of the rest: ratio 3 > 1.4 -> exit 2, one line saying which way to move
    monkeypatch.setattr(async_overlap, "train", lambda *a, **k: rows([4] * 5, [3] * 5))
    monkeypatch.setattr(async_overlap.os, "sched_getaffinity", lambda pid: {0, 1})
    assert async_overlap.main(["--steps", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "outside [0.7, 1.4]: lower --max_new_tokens" in err[0]
    with pytest.raises(SystemExit):
        async_overlap.parse_args(["--steps", "2"])
