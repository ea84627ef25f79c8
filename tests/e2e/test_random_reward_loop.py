"""End to end: the random-reward control (reward.kind=random, docs/methods.md §5) in the real loop on the tiny
model. The same run with verified and with random rewards, PPS's learnability priority on (so that the sampler's
Beta counts show which successes it read), 2 steps of 4 prompts x 4 on the 6-prompt set."""
import json
import os

import pytest
import torch

from pspo.engines.sampling import prompt_keys, sequence_seeds
from pspo.rewards import RewardResult, with_random_reward

pytestmark = pytest.mark.slow        # end to end: real runs of the loop

B, G, RATE = 4, 4, 0.9


@pytest.fixture(scope="module")
def runs(run_main, tiny_model_path, six_prompts, tmp_path_factory):
    """{"verified": out, "random": out}: the two runs' output folders."""
    outs = {}
    for kind in ("verified", "random"):
        out = str(tmp_path_factory.mktemp(kind) / "run")
        extra = ["--reward.kind=random", f"--reward.random_rate={RATE}"] if kind == "random" else []
        run_main("train", "--config", "configs/pps_learnability.yaml", f"--train.output_dir={out}",
                 f"--model.name_or_path={tiny_model_path}", f"--data.train={six_prompts}", "--train.max_steps=2",
                 f"--train.prompts_per_step={B}", f"--rollout.num_generations={G}", "--train.micro_batch_size=16",
                 "--data.max_eval_examples=8", "--train.progress=false", "--pps.posterior_decay=1", *extra)
        outs[kind] = out
    return outs


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "reward_mean" in r]


def drawn(step: int) -> torch.Tensor:
    """b of the step's B x G completions, from the seeds the loop gives them (run seed 0). (B·G,)"""
    seeds = sequence_seeds(0, step, prompt_keys(0, B, B, slice(None)), G)
    zeros = torch.zeros(B * G)
    return with_random_reward(RewardResult(zeros, {"accuracy": zeros}, {}), seeds, RATE, 1.0).rewards


def test_random_rewards_train_while_the_logged_accuracy_stays_verified(runs):
    verified, random = rows(runs["verified"]), rows(runs["random"])
    # step 1: the same prompts (PPS's first draw, all at the prior) and the same completions (the same base
    # model and seeds), so the same verified accuracy; the reward is the draw b of those seeds instead
    assert random[0]["accuracy"] == verified[0]["accuracy"]
    assert verified[0]["reward_mean"] == verified[0]["accuracy"]
    for step in (0, 1):
        assert random[step]["reward_mean"] == pytest.approx(float(drawn(step).mean()), abs=1e-7)
    assert random[0]["reward_mean"] != random[0]["accuracy"]


def test_the_sampler_counts_the_draws(runs):
    # λ = 1: a prompt's counts are a = 1 + its successes, b = 1 + its failures, over the 2 steps' 8 groups:
    # Σ_q (a_q - 1) is the number of successes the sampler read, the draws' 1s under reward.kind=random
    state = torch.load(os.path.join(runs["random"], "checkpoint-2", "trainer_state.pt"), weights_only=True)
    a, b = state["sampler"]["posterior_a"], state["sampler"]["posterior_b"]
    ones = float(drawn(0).sum() + drawn(1).sum())
    assert float((a - 1).sum()) == ones and float((a + b - 2).sum()) == 2 * B * G
    verified = torch.load(os.path.join(runs["verified"], "checkpoint-2", "trainer_state.pt"), weights_only=True)
    assert float((verified["sampler"]["posterior_a"] - 1).sum()) != ones    # the verified successes are others
