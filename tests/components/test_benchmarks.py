"""eval.py on the paper's benchmarks, from small local copies in the hub formats (offline)."""
import json
import os

import pytest

from pspo.tasks.benchmarks import BENCHMARKS, gold_answer, load_benchmark
from pspo.tasks.data import DataError, builtin_arithmetic, prompt_set
from pspo.training.model import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# data/samples/<name>.jsonl: rows kept, rows left out, and golds at some row numbers of the kept rows
SAMPLES = {
    "math500": (18, 2, {0: "\\$18.90", 1: "32,\\!348", 2: "\\$32,\\!348", 3: "90^\\circ", 17: "x^2+7x+10"}),
    "aime24": (20, 0, {0: "130", 15: "033"}),
    "amc23": (20, 0, {0: "7", 9: "2.5"}),                                  # stored 7.0 and 2.5
    "minerva": (20, 0, {0: "7.2e-7", 1: "1.3 \\times 10^{-2}", 19: "8 \\mathrm{~g/cm^3}"}),
    "olympiadbench": (20, 0, {0: "2,3", 2: "\\frac{9}{10}", 11: "1, -1"}),  # lists ['$2,3$'], ['$1$', '$-1$']
    "gsm8k": (20, 0, {0: "29", 1: "1740", 19: "37500"}),                    # "#### 1,740", "#### 37,500"
}


def test_gold_answers_in_each_format():
    assert gold_answer("gsm8k", "Natalia sold 48 + 24 = 72 clips.\n#### 1,072") == "1072"
    assert gold_answer("gsm8k", "72") == ""                # no "####": no gold, reported and left out
    assert gold_answer("math500", "\\frac{1}{2}") == "\\frac{1}{2}"
    with pytest.raises(DataError, match="unknown benchmark 'aime'; expected aime24, math500"):
        load_benchmark("aime=x.jsonl")


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_loads_through_its_sample(name, tiny_model_path, capsys):
    assert set(SAMPLES) == set(BENCHMARKS)
    kept, skipped, golds = SAMPLES[name]
    path = os.path.join(ROOT, "data", "samples", f"{name}.jsonl")
    got_name, source, examples = load_benchmark(f"{name}={path}")
    assert (got_name, source, len(examples)) == (name, path, 20)
    prompts = prompt_set(name, examples, load_tokenizer(tiny_model_path), system_prompt="r1", max_prompt_tokens=512)
    assert (len(prompts.examples), prompts.skipped) == (kept, skipped)
    assert {i: prompts.examples[i].answer for i in golds} == golds
    lines = capsys.readouterr().out.splitlines()
    if name == "math500":   # row 12: a ~2800-character problem; row 17: a cut-off gold
        assert lines == ["math500: left out 1 of 20 rows without a usable problem and gold answer (data.bad_gold=skip): "
                         "row 17 (gold answer '\\frac{2}{' does not parse with math-verify)",
                         "math500: dropped 1 of 20 prompts longer than data.max_prompt_tokens=512 (row 12)"]
    else:
        assert lines == []


@pytest.mark.slow
def test_eval_py_benchmark_table_and_json(tmp_path, tiny_model_path, run_main):
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
    ran = run_main("eval", "--config", "configs/grpo.yaml",              # eval.py in this process
                   f"--model.name_or_path={tiny_model_path}", f"--benchmarks={','.join(specs)}",
                   "--engine=hf", "--eval.num_samples=2", f"--eval.output={out}", "--train.progress=false")
    result = json.loads(out.read_text())
    rows = result["benchmarks"]
    assert list(rows) == ["gsm8k", "olympiadbench", "math500", "average"] and result["engine"] == "hf"
    first = rows["gsm8k"]
    assert first["n"] == 16 and first["skipped"] == 0 and 0 < first["greedy_accuracy"] < 1
    for name in ("olympiadbench", "math500", "average"):
        for key in ("greedy_accuracy", "mean@2", "pass@2"):
            assert rows[name][key] == pytest.approx(first[key]), (name, key)
    assert "average" in ran.out and "greedy_accuracy" in ran.out


@pytest.mark.slow
def test_unknown_benchmark_is_one_line(tmp_path, tiny_model_path, run_main, capsys):
    # a DataError before anything is printed: eval.py prints its one line and exits 2
    with pytest.raises(DataError) as e:
        run_main("eval", "--config", "configs/grpo.yaml", f"--model.name_or_path={tiny_model_path}",
                 "--benchmarks=aime2024")
    printed = capsys.readouterr()
    lines = (printed.out + printed.err + f"error: {e.value}").strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --benchmarks: unknown benchmark")
