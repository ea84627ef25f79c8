"""DAPO's parts in the real loop on the tiny model (docs/methods.md §9): PSPO with dynamic sampling, overlong
filtering and the soft overlong punishment, its counts in the metrics, exact resume, and 2 gloo ranks.
Their math: tests/math/test_dynamic_sampling.py, test_methods.py, test_rewards.py."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pspo.training.checkpoint import state_digest


pytestmark = pytest.mark.slow        # end to end: real runs of the loop

# PSPO (PPS + ERS) on 6 prompts, B = 4 of G = 4, no eval: the PPS state the rounds leave is what resumes
DAPO = ["--rollout.dynamic_sampling=true", "--rollout.max_sampling_rounds=3", "--algo.overlong_filter=true",
        "--reward.overlong_cache=3", "--algo.aggregation=token_mean", "--algo.beta=0"]
SMALL = ["--train.prompts_per_step=4", "--rollout.num_generations=4", "--train.micro_batch_size=16",
         "--data.eval=", "--train.progress=false", "--optim.lr=1e-3", *DAPO]


@pytest.fixture(scope="module")
def train(launch_train, tiny_model_path, six_prompts):
    def train(out, *overrides, nproc=1):
        return launch_train(["--config", "configs/pspo.yaml", f"--train.output_dir={out}",
                             f"--model.name_or_path={tiny_model_path}", f"--data.train={six_prompts}", *SMALL,
                             *overrides], nproc)
    return train


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "reward_mean" in line]


def state(path):
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)


@pytest.fixture(scope="module")
def full_run(train, tmp_path_factory):
    """4 steps, a checkpoint at step 2 (kept)."""
    out = str(tmp_path_factory.mktemp("dapo") / "full")
    train(out, "--train.max_steps=4", "--train.save_steps=2", "--train.keep_checkpoints=0")
    return out


def test_dynamic_sampling_counts_every_round(full_run):
    rows = metrics(full_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    tokens = 0.0
    for r in rows:
        # every scored group is trained, set aside (all rewards equal) or unused; at most B = 4 trained
        assert r["ds_trained_groups"] + r["ds_set_aside_groups"] + r["ds_unused_groups"] == r["ds_scored_groups"]
        assert 1 <= r["ds_rounds"] <= 3 and r["ds_trained_groups"] <= 4
        assert r["ds_short"] == float(r["ds_trained_groups"] < 4)
        if r["ds_trained_groups"]:
            assert r["zero_std_frac"] == 0                                   # no all-equal group was trained
            assert -1 <= r["overlong_penalty"] <= 0 and r["overlong_filtered_frac"] == r["truncation_rate"]
        # generated_tokens counts every round's completions, set-aside ones included
        tokens += r["rollout_tokens"]
        assert r["generated_tokens"] == tokens
    assert any(r["ds_rounds"] > 1 for r in rows), "no step drew an extra round: the test shows nothing"
    # PPS's β anneals per step: the sampler counts 4 steps, not the rounds' draws
    assert state(os.path.join(full_run, "checkpoint-4"))["sampler"]["steps"] == 4


def test_resume_with_dynamic_sampling_continues_exactly(train, full_run, tmp_path):
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full_run, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    shutil.copy(os.path.join(full_run, "metrics.jsonl"), resumed)
    train(resumed, "--train.max_steps=4", "--train.save_steps=2", "--train.resume=auto")
    a, b = metrics(full_run), metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):                                                 # every metric but the timings
        timings = {k for k in ra if k.endswith(("_s", "_per_s"))}
        assert {k: v for k, v in ra.items() if k not in timings} == {k: v for k, v in rb.items() if k not in timings}
    # bit for bit: the trainer state (PPS, its last draw, ERS, the schedule) and the weights
    sa, sb = state(os.path.join(full_run, "checkpoint-4")), state(os.path.join(resumed, "checkpoint-4"))
    assert state_digest(sa) == state_digest(sb)
    wa = load_file(os.path.join(full_run, "checkpoint-4", "model.safetensors"))
    wb = load_file(os.path.join(resumed, "checkpoint-4", "model.safetensors"))
    assert state_digest(wa) == state_digest(wb)


def test_two_ranks_with_dynamic_sampling(train, tmp_path):
    # FSDP2 over 2 gloo ranks: the rounds' choices are made from the gathered rewards on each rank alike
    # (the replicated PPS and ERS state agrees: the ranks' digests), and each rank trains as many groups
    out = str(tmp_path / "two")
    train(out, "--train.max_steps=2", nproc=2)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ds_trained_groups"] % 2 == 0 and r["ds_trained_groups"] <= 4
        assert r["ds_trained_groups"] + r["ds_set_aside_groups"] + r["ds_unused_groups"] == r["ds_scored_groups"]
    ckpt = os.path.join(out, "checkpoint-2")
    digests = [torch.load(os.path.join(ckpt, f"rng-rank{r}.pt"), weights_only=True)["trainer_state_sha256"]
               for r in (0, 1)]
    assert digests[0] == digests[1]
