"""The methods beside GRPO and the engine correction in the real loop on the tiny model, train.py in this
process (conftest's run_main): RLOO is G/(G-1) times Dr. GRPO on the same step and ERS runs over it
(their math: tests/math/test_estimators.py, test_methods.py), REINFORCE++ and REINFORCE++-baseline run
and log whitened token advantages and the KL against the reference (their math:
tests/math/test_reinforce_pp.py), and truncated IS is a no-op with the transformers engine (its math:
tests/math/test_is_correction.py)."""
import json
import os

import pytest

from pspo.training.config import ConfigError

# ---------------------------------------------------------------- REINFORCE++

SMALL = ["--train.prompts_per_step=8", "--rollout.num_generations=4", "--train.micro_batch_size=12",
         "--data.max_eval_examples=8", "--train.progress=false", "--optim.lr=1e-3", "--train.max_steps=2"]


def train(run_main, out, model, *overrides):
    """train.py in this process (conftest's run_main)."""
    return run_main("train", "--config", "configs/grpo.yaml", f"--train.output_dir={out}",
                    f"--model.name_or_path={model}", *SMALL, *overrides)


@pytest.mark.slow
def test_rloo_and_ers_over_it_in_the_loop(tmp_path, tiny_model_path, run_main):
    # One seed, so the first step's completions and rewards are the same in the three runs. RLOO's
    # advantage is G/(G-1) = 4/3 times Dr. GRPO's (docs/methods.md §1), and so is its logged mean |A|.
    # ERS over RLOO at the prompts' first visit is RLOO itself (§2); 8 training prompts drawn 8 a step
    # are all visited a second time at step 2.
    def run(name, *overrides):
        out = tmp_path / name
        train(run_main, str(out), tiny_model_path, "--algo.scale_rewards=false", "--data.max_train_examples=8",
              *overrides)
        with open(out / "metrics.jsonl") as f:
            return [r for r in map(json.loads, f) if "reward_mean" in r]

    dr_grpo, rloo = run("dr_grpo", "--algo.advantage=grpo"), run("rloo", "--algo.advantage=rloo")
    ers = run("ers", "--algo.advantage=rloo", "--ers.enabled=true")
    assert rloo[0]["reward_mean"] == dr_grpo[0]["reward_mean"] and rloo[0]["zero_std_frac"] < 1
    assert rloo[0]["adv_abs_mean"] == pytest.approx(4 / 3 * dr_grpo[0]["adv_abs_mean"], rel=1e-5)
    assert rloo[0]["adv_abs_mean"] > 0
    assert ers[0]["reward_mean"] == rloo[0]["reward_mean"]
    assert ers[0]["adv_abs_mean"] == pytest.approx(rloo[0]["adv_abs_mean"], rel=1e-6)
    assert [r["ers_visits"] for r in ers] == [1.0, 2.0] and "ers_visits" not in rloo[0]


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["reinforce_pp", "reinforce_pp_baseline"])
def test_loop_runs_and_logs(tmp_path, tiny_model_path, run_main, advantage):
    out = str(tmp_path / "run")
    train(run_main, out, tiny_model_path, f"--algo.advantage={advantage}", "--algo.beta=0", "--algo.kl_coef=0.001",
          "--algo.aggregation=token_mean")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        # token advantages whitened over the whole batch with Bessel's variance: their RMS over the
        # n valid tokens is sqrt((n-1)/n), n = response_length x 32 completions
        n = row["response_length"] * 32
        assert row["adv_std"] == pytest.approx(((n - 1) / n) ** 0.5, rel=1e-4)
        assert 0 < row["adv_abs_mean"] < row["adv_std"] and row["grad_norm"] > 0
    assert rows[1]["kl"] == pytest.approx(0, abs=1e-6)                     # the reference is built: policy == ref
    assert rows[2]["kl"] > 0                                               # ... and the policy has moved from it


@pytest.mark.slow
def test_beta_with_reinforce_pp_is_one_line(tmp_path, tiny_model_path, run_main):
    with pytest.raises(ConfigError) as e:                                   # train.py: its one line, exit 2
        train(run_main, str(tmp_path / "x"), tiny_model_path, "--algo.advantage=reinforce_pp", "--algo.beta=0.04")
    message = str(e.value)
    assert "\n" not in message and message.startswith("algo.beta: expected 0 with algo.advantage=reinforce_pp")


# ---------------------------------------------------------------- truncated IS (docs/methods.md §7)

@pytest.mark.slow
def test_with_the_transformers_engine_the_correction_is_a_no_op(tmp_path, tiny_model_path, run_main):
    # The transformers engine samples from the trainer's own weights: its log-probs are π_old up to
    # float32 noise (KV-cached generate against one full forward), so token and sequence TIS leave
    # the run as it is without the correction: the same completions, losses and gradient norms.
    def run(mode):                                # train.py in this process (conftest's run_main)
        out = tmp_path / mode
        run_main("train", "--config", "configs/grpo.yaml", f"--train.output_dir={out}",
                 f"--model.name_or_path={tiny_model_path}", "--rollout.engine=hf", "--train.max_steps=3",
                 "--train.prompts_per_step=8", "--rollout.num_generations=4", "--data.eval=",
                 "--optim.lr=1e-3", f"--rollout.is_correction={mode}", "--train.progress=false")
        return [json.loads(line) for line in open(out / "metrics.jsonl")]

    plain = run("none")
    assert "engine_gap_mean" not in plain[0]            # one iteration, no correction: π_old is not scored
    for mode in ("token", "sequence"):
        rows = run(mode)
        for a, b in zip(plain, rows):
            assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)     # |loss| ~1e-7: Σ A ≈ 0
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert b["engine_gap_max"] < 1e-4 and abs(b["tis_weight_mean"] - 1) < 1e-4 and b["tis_capped_frac"] == 0
