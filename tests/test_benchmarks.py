"""eval.py on the paper's benchmarks, from small local copies in the hub formats (offline)."""
import json
import os
import subprocess
import sys

import pytest

from pspo.benchmarks import gold_answer, load_benchmark
from pspo.data import DataError, builtin_arithmetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gold_answers_in_each_format():
    assert gold_answer("gsm8k", "Natalia sold 48 + 24 = 72 clips.\n#### 1,072") == "1072"
    assert gold_answer("olympiadbench", "['$\\\\frac{1}{2}$']") == "$\\frac{1}{2}$"
    assert gold_answer("math500", "\\frac{1}{2}") == "\\frac{1}{2}"
    with pytest.raises(DataError, match="gsm8k: answer without '####'"):
        gold_answer("gsm8k", "72")
    with pytest.raises(DataError, match="unknown benchmark 'aime'; expected aime24, math500"):
        load_benchmark("aime=x.jsonl")


def test_eval_py_benchmark_table_and_json(tmp_path, tiny_model_path):
    # The same 16 problems written in three benchmarks' formats: every table row must agree.
    examples = builtin_arithmetic("test")[:16]
    files = {
        "gsm8k": [{"question": ex.problem, "answer": f"It is {ex.answer}.\n#### {ex.answer}"} for ex in examples],
        "olympiadbench": [{"question": ex.problem, "final_answer": [ex.answer]} for ex in examples],
        "math500": [{"problem": ex.problem, "answer": ex.answer} for ex in examples],
    }
    specs = []
    for name, rows in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        specs.append(f"{name}={path}")
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "eval.py", "--config", "configs/grpo.yaml",
                           f"--model.name_or_path={tiny_model_path}", f"--benchmarks={','.join(specs)}",
                           "--engine=hf", "--eval.num_samples=2", f"--eval.output={out}", "--train.progress=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["benchmarks"]
    assert list(rows) == ["gsm8k", "olympiadbench", "math500", "average"] and result["engine"] == "hf"
    first = rows["gsm8k"]
    assert first["n"] == 16 and 0 < first["greedy_accuracy"] < 1
    for name in ("olympiadbench", "math500", "average"):
        for key in ("greedy_accuracy", "mean@2", "pass@2"):
            assert rows[name][key] == pytest.approx(first[key]), (name, key)
    assert "average" in proc.stdout and "greedy_accuracy" in proc.stdout


def test_unknown_benchmark_is_one_line(tmp_path, tiny_model_path):
    proc = subprocess.run([sys.executable, "eval.py", "--config", "configs/grpo.yaml",
                           f"--model.name_or_path={tiny_model_path}", "--benchmarks=aime2024"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --benchmarks: unknown benchmark")
