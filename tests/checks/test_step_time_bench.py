"""bench/step_time.py's table and its refusal without TRL (the TRL runs themselves are bench-only)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("step_time", os.path.join(ROOT, "bench", "step_time.py"))
step_time = importlib.util.module_from_spec(spec)
sys.modules["step_time"] = step_time          # dataclasses look their module up there
spec.loader.exec_module(step_time)


def test_summary_medians_spread_and_ratios():
    # warm-up 1 drops the 9.0s. rep 1: ours [1,2,3] -> 2, TRL [4,4,4] -> 4, ratio .5;
    # rep 2: ours [3,3] -> 3, TRL [2,4] -> 3, ratio 1. All kept: ours [1,2,3,3,3] -> 3, TRL [4,4,4,2,4] -> 4: .75
    ours = [step_time.Run([9.0, 1.0, 2.0, 3.0], 8.0), step_time.Run([9.0, 3.0, 3.0], 9.0)]
    trl = [step_time.Run([9.0, 4.0, 4.0, 4.0], 7.0), step_time.Run([9.0, 2.0, 4.0], 8.0)]
    lines = step_time.summary(ours, trl, warmup=1)
    assert lines[2] == "| 1 | 2.000 | 4.000 | 0.50x | 8.0 / 7.0 |"
    assert lines[3] == "| 2 | 3.000 | 3.000 | 1.00x | 9.0 / 8.0 |"
    assert lines[4] == "| all | 3.000 [2.000-3.000] | 4.000 [3.000-4.000] | 0.75x [0.50-1.00] | 8.5 / 7.5 |"


def test_without_trl_one_line_and_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(step_time, "missing_trl", lambda: "accelerate")
    assert step_time.main(["--reps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no module 'accelerate'" in err[0] and "bench/requirements.txt" in err[0]


def test_steps_must_exceed_warmup():
    with pytest.raises(SystemExit):
        step_time.parse_args(["--steps", "3", "--warmup", "3"])
    assert step_time.parse_args(["--steps", "4", "--lr", "2e-4"]).lr == 2e-4
