"""End to end: the real loop on the tiny model, its logs and checkpoints, exact resume, and a
2-process FSDP2 run that reproduces a 1-process run."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--train.prompts_per_step=8", "--rollout.num_generations=4", "--train.micro_batch_size=12",
         "--data.max_eval_examples=16", "--train.progress=false", "--optim.lr=1e-3"]


@pytest.fixture(autouse=True)
def _model(tiny_model_path, monkeypatch):
    monkeypatch.setenv("PSPO_TEST_MODEL", tiny_model_path)


def train(out, *overrides, nproc=1, config="configs/grpo.yaml", check=True):
    cmd = [sys.executable, "train.py"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    model = f"--model.name_or_path={os.environ['PSPO_TEST_MODEL']}"
    proc = subprocess.run(cmd + ["--config", config, f"--train.output_dir={out}", model, *SMALL, *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_loop_logs_evaluates_and_saves(tmp_path, tiny_model_path):
    out = str(tmp_path / "run")
    train(out, "--train.max_steps=3", "--train.eval_steps=2", "--algo.beta=0.04")
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2] and "eval_accuracy" in rows[3]
    for key in ("reward_mean", "reward_std", "accuracy", "format_rate", "adv_abs_mean", "zero_std_frac", "kl",
                "clip_frac", "entropy", "response_length", "truncation_rate", "grad_norm", "lr", "step_time_s",
                "gen_tokens_per_s", "loss"):
        assert key in rows[1], key
    assert 0 <= rows[1]["accuracy"] <= 1 and rows[1]["grad_norm"] > 0
    assert rows[1]["kl"] == pytest.approx(0, abs=1e-6)      # the first step: policy == reference
    assert rows[3]["kl"] > 0                                  # after updates it has moved
    assert os.path.exists(os.path.join(out, "config.yaml")) and os.listdir(os.path.join(out, "tb"))
    ckpt = os.path.join(out, "checkpoint-3")
    model = AutoModelForCausalLM.from_pretrained(ckpt)        # a plain Hugging Face folder
    saved = weights(ckpt)
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], saved["model.norm.weight"])
    base = weights(tiny_model_path)
    assert not torch.equal(saved["model.norm.weight"], base["model.norm.weight"])   # it trained
    assert not any(name.startswith(".tmp") for name in os.listdir(out))


def test_resume_continues_exactly(tmp_path, tiny_model_path):
    # Uninterrupted 4 steps with a checkpoint at step 2, vs. a run resumed from that checkpoint.
    full = str(tmp_path / "full")
    train(full, "--train.max_steps=4", "--train.save_steps=2", "--train.keep_checkpoints=0")
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    shutil.copy(os.path.join(full, "metrics.jsonl"), resumed)          # truncated back to step 2 on resume
    train(resumed, "--train.max_steps=4", "--train.save_steps=2", "--train.resume=auto")
    a, b = metrics(full), metrics(resumed)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a[3:5], b[3:5]):                                 # steps 3 and 4
        for key in ("reward_mean", "loss", "grad_norm", "lr", "response_length"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), key
    wa, wb = weights(os.path.join(full, "checkpoint-4")), weights(os.path.join(resumed, "checkpoint-4"))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0)


def test_two_processes_match_one(tmp_path, tiny_model_path):
    # Same global batch and seed: FSDP2 over 2 gloo ranks must reproduce the 1-process run.
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    args = ["--train.max_steps=2", "--algo.beta=0.04", "--train.micro_batch_size=6"]
    train(one, *args)
    train(two, *args, nproc=2)
    a, b = metrics(one), metrics(two)
    for ra, rb in zip(a, b):
        for key in ("reward_mean", "accuracy", "loss", "grad_norm", "kl", "eval_accuracy"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    assert a[1]["grad_norm"] > 0
    wa, wb = weights(os.path.join(one, "checkpoint-2")), weights(os.path.join(two, "checkpoint-2"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=2e-5, rtol=0)


def test_bad_data_file_is_one_line_exit_2(tmp_path):
    proc = train(str(tmp_path / "x"), f"--data.train={tmp_path / 'missing.jsonl'}", check=False)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing.jsonl" in lines[0]
