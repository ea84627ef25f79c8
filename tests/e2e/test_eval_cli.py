"""eval.py on a local jsonl file with custom field names: greedy + mean@k, printed and saved.

eval.py runs in this process (conftest's run_main), except with the vLLM engine (vLLM's state is
per process) and where its exit code is the point (a user mistake: one line on stderr, exit 2)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from pspo.tasks.data import DataError, builtin_arithmetic, format_prompt, load_examples
from pspo.training.distributed import Dist
from pspo.evaluation import evaluate
from pspo.training.model import build_policy, load_tokenizer
from pspo.engines.hf_engine import HFEngine

pytestmark = pytest.mark.slow        # end to end: real runs of the loop or the engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_eval_cli(run_main, tmp_path, model_path, engine):
    """eval.py on 24 builtin test problems stored as a jsonl file with custom field names: (its
    stdout, its JSON, the data file). The vLLM engine in a process of its own, hf in this one."""
    data = tmp_path / "bench.jsonl"
    rows = [{"question": ex.problem, "final": ex.answer} for ex in builtin_arithmetic("test")[:24]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"result-{engine}.json"
    args = ["--config", "configs/grpo.yaml", f"--model.name_or_path={model_path}", f"--data.eval={data}",
            "--data.problem_field=question", "--data.answer_field=final", "--eval.num_samples=3",
            f"--eval.output={out}", "--train.progress=false", f"--rollout.engine={engine}"]
    if engine == "hf":
        return run_main("eval", *args).out, json.loads(out.read_text()), data
    proc = subprocess.run([sys.executable, "eval.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), data


@pytest.fixture(scope="module")
def with_hf(run_main, tiny_model_path, tmp_path_factory):
    """run_eval_cli with the transformers engine, shared by the tests that read it."""
    return run_eval_cli(run_main, tmp_path_factory.mktemp("eval"), tiny_model_path, "hf")


def test_eval_cli_vllm_gives_the_same_greedy_answers(tmp_path, tiny_model_path, run_main, with_hf):
    pytest.importorskip("vllm", reason="vLLM is not installed (PSPO_WITH_VLLM=1 bash scripts/test.sh installs it)")
    # It samples with its own seeded generator, so mean@k differs; greedy answers must not.
    _, with_vllm, _ = run_eval_cli(run_main, tmp_path, tiny_model_path, "vllm")
    assert with_vllm["greedy_accuracy"] == with_hf[1]["greedy_accuracy"] and with_vllm["n"] == 24


def test_eval_cli_writes_json(tiny_model_path, with_hf):
    stdout, result, data = with_hf
    assert result["n"] == 24 and set(result) >= {"greedy_accuracy", "mean@3", "pass@3"}
    assert 0 <= result["mean@3"] <= result["pass@3"] <= 1
    assert "greedy_accuracy" in stdout

    # The same numbers as the in-process evaluation train.py runs periodically.
    tokenizer = load_tokenizer(tiny_model_path)
    engine = HFEngine(build_policy(tiny_model_path, chunk_tokens=64, trainable=False), tokenizer, 256)
    examples = load_examples(str(data), problem_field="question", answer_field="final")
    texts = [format_prompt(tokenizer, ex.problem, "") for ex in examples]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    again = evaluate(engine, ids, texts, examples, max_new_tokens=12, num_samples=3, temperature=0.6, top_p=0.95,
                     seed=0, dist_=Dist(0, 1, torch.device("cpu")), batch_size=256, progress=False)
    assert again == {k: result[k] for k in again}


def test_eval_cli_missing_field_is_one_line(tmp_path, tiny_model_path):
    # eval.py's way out on a user mistake, in a process of its own: one line on stderr, exit code 2
    data = tmp_path / "bench.jsonl"
    data.write_text(json.dumps({"question": "1+1", "final": "2"}) + "\n")
    proc = subprocess.run([sys.executable, "eval.py", "--config", "configs/grpo.yaml",
                           f"--model.name_or_path={tiny_model_path}", f"--data.eval={data}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == [f"error: {data}: no field 'problem'; the fields are: question, final"]


def test_eval_cli_on_the_math500_sample_counts_skipped_rows(tmp_path, tiny_model_path, run_main):
    # data/samples/math500.jsonl: 20 rows, row 12 too long for data.max_prompt_tokens=512, row 17's gold cut off
    out = tmp_path / "bench.json"
    lines = run_main("eval", "--config", "configs/grpo.yaml",
                     f"--model.name_or_path={tiny_model_path}", "--benchmarks=math500=data/samples/math500.jsonl",
                     "--rollout.engine=hf", "--data.system_prompt=r1", "--eval.num_samples=0",
                     f"--eval.output={out}", "--train.progress=false").out.splitlines()
    assert "math500 (data/samples/math500.jsonl): dropped 1 of 20 prompts longer than data.max_prompt_tokens=512 " \
           "(row 12)" in lines
    assert any(line.startswith("math500 (data/samples/math500.jsonl): left out 1 of 20 rows") and "row 17" in line
               for line in lines)
    header = next(line for line in lines if line.startswith("eval set"))
    row = lines[lines.index(header) + 1]                                        # the table's one row
    assert header.split()[:4] == ["eval", "set", "n", "skipped"] and row.split()[1:3] == ["18", "2"]
    result = json.loads(out.read_text())["benchmarks"]["math500"]
    assert result["n"] == 18 and result["skipped"] == 2 and 0 <= result["greedy_accuracy"] <= 1


def test_eval_cli_bad_gold_error_is_one_line(tiny_model_path, run_main, capsys):
    # a DataError before anything is printed (eval.py: its one line, exit 2)
    with pytest.raises(DataError) as e:
        run_main("eval", "--config", "configs/grpo.yaml", f"--model.name_or_path={tiny_model_path}",
                 "--benchmarks=math500=data/samples/math500.jsonl", "--rollout.engine=hf", "--data.bad_gold=error")
    printed = capsys.readouterr()
    assert (printed.out + printed.err + f"error: {e.value}").strip().splitlines() == [
        "error: math500 (data/samples/math500.jsonl): row 17: gold answer '\\frac{2}{' does not parse with math-verify "
        "(data.bad_gold=error; 'skip' leaves such rows out)"]
