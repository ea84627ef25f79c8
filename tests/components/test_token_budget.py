"""The token budget that ends a run (train.max_generated_tokens; pspo/training/run.py:last_step) and the
prompts each draw logs (prompts.jsonl; pspo/training/metrics.py:MetricsLogger.log_prompts), which
bench/selection.py reads. train.py under a budget, end to end: tests/checks/test_selection_bench.py."""
import json
import os

import pytest
import torch

from pspo.training.config import ConfigError, load_config
from pspo.training.metrics import MetricsLogger
from pspo.training.run import last_step, summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(ROOT, "configs", "grpo.yaml")


def test_the_run_ends_at_max_steps_or_once_its_tokens_reach_the_budget():
    # max_steps 10, budget 1000 tokens: step 3 at 999 tokens goes on, at 1000 or 1200 it is the last;
    # step 10 is the last at any count; without a budget (0) only step 10 is
    cfg = load_config(GRPO, ["--train.max_steps=10", "--train.max_generated_tokens=1000"])
    assert not last_step(cfg, 3, 999.0)
    assert last_step(cfg, 3, 1000.0) and last_step(cfg, 3, 1200.0) and last_step(cfg, 10, 5.0)
    free = load_config(GRPO, ["--train.max_steps=10"])
    assert not last_step(free, 3, 1e12) and last_step(free, 10, 0.0)
    # the summary says the budget stopped it, and reads it as finished (before -> after)
    lines = summary(cfg, 3, 1200.0, {"eval_accuracy": 0.4}, {"eval_accuracy": 0.5}, 500).splitlines()
    assert lines[0] == "token budget reached: 1,200 tokens generated in 3 steps (train.max_generated_tokens=1,000)"
    assert lines[1] == "test accuracy: 0.400 before -> 0.500 after (greedy, 500 problems)"
    with pytest.raises(ConfigError) as e:
        load_config(GRPO, ["--train.max_generated_tokens=-1"])
    assert str(e.value) == "train.max_generated_tokens: expected >= 0 (0 = no token budget), got -1"


def test_each_draw_is_a_line_of_prompts_jsonl_and_a_resume_drops_the_later_ones(tmp_path):
    logger = MetricsLogger(str(tmp_path), True, report_to="none")
    # step 1 draws rows 4 and 1 of 6: groups [1,0,0,1] and [0,0,0,0] -> mean accuracy 0.5 and 0.0
    logger.log_prompts(1, torch.tensor([4, 1]), torch.tensor([[1., 0, 0, 1], [0, 0, 0, 0]]), 6)
    # step 2: a group of 3 with one right -> 1/3, kept to 4 places
    logger.log_prompts(2, torch.tensor([2]), torch.tensor([[0., 1, 0]]), 6)
    logger.log_prompts(3, torch.tensor([0]), torch.tensor([[1., 1, 1]]), 6)
    logger.close()

    def lines():
        with open(tmp_path / "prompts.jsonl") as f:
            return [json.loads(line) for line in f]
    assert lines()[0] == {"step": 1, "prompts": 6, "rows": [4, 1], "accuracy": [0.5, 0.0]}
    assert lines()[1]["accuracy"] == [0.3333] and [line["step"] for line in lines()] == [1, 2, 3]
    # resumed from step 2's checkpoint: step 3's line goes (its draw is redone), the new one follows
    again = MetricsLogger(str(tmp_path), True, resume_step=2, report_to="none")
    again.log_prompts(3, torch.tensor([5]), torch.tensor([[0., 0, 0]]), 6)
    again.close()
    assert [line["step"] for line in lines()] == [1, 2, 3] and lines()[-1]["rows"] == [5]
    # a rank other than 0 writes nothing
    other = tmp_path / "other"
    other.mkdir()
    MetricsLogger(str(other), False).log_prompts(1, torch.tensor([0]), torch.tensor([[1.]]), 6)
    assert not (other / "prompts.jsonl").exists()
