"""eval.py on a local jsonl file with custom field names: greedy + mean@k, printed and saved."""
import json
import os
import subprocess
import sys

import torch

from pspo.data import builtin_arithmetic, format_prompt, load_examples
from pspo.distributed import Dist
from pspo.evaluation import evaluate
from pspo.model import build_policy, load_tokenizer
from pspo.rollout import HFEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_eval_cli_writes_json(tmp_path, tiny_model_path):
    data = tmp_path / "bench.jsonl"
    rows = [{"question": ex.problem, "final": ex.answer} for ex in builtin_arithmetic("test")[:24]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    def run(engine):
        out = tmp_path / f"result-{engine}.json"
        proc = subprocess.run([sys.executable, "eval.py", "--config", "configs/grpo.yaml",
                               f"--model.name_or_path={tiny_model_path}", f"--data.eval={data}",
                               "--data.problem_field=question", "--data.answer_field=final", "--eval.num_samples=3",
                               f"--eval.output={out}", "--train.progress=false", f"--rollout.engine={engine}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, json.loads(out.read_text())
    proc, result = run("hf")
    assert result["n"] == 24 and set(result) >= {"greedy_accuracy", "mean@3", "pass@3"}
    assert 0 <= result["mean@3"] <= result["pass@3"] <= 1
    assert "greedy_accuracy" in proc.stdout
    # vLLM: the same greedy answers (it samples with its own seeded generator, so mean@k differs)
    _, with_vllm = run("vllm")
    assert with_vllm["greedy_accuracy"] == result["greedy_accuracy"] and with_vllm["n"] == 24

    # The same numbers as the in-process evaluation train.py runs periodically.
    tokenizer = load_tokenizer(tiny_model_path)
    engine = HFEngine(build_policy(tiny_model_path, False, 64, False, False, trainable=False), tokenizer, 256)
    examples = load_examples(str(data), problem_field="question", answer_field="final")
    texts = [format_prompt(tokenizer, ex.problem, "") for ex in examples]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    again = evaluate(engine, ids, texts, examples, 12, 3, 0.6, 0.95, 0, Dist(0, 1, torch.device("cpu")), 256,
                     progress=False)
    assert again == {k: result[k] for k in again}


def test_eval_cli_missing_field_is_one_line(tmp_path, tiny_model_path):
    data = tmp_path / "bench.jsonl"
    data.write_text(json.dumps({"question": "1+1", "final": "2"}) + "\n")
    proc = subprocess.run([sys.executable, "eval.py", "--config", "configs/grpo.yaml",
                           f"--model.name_or_path={tiny_model_path}", f"--data.eval={data}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == [f"error: {data}: no field 'problem'; the fields are: question, final"]
