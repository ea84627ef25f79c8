"""The related methods and the engine correction in the real loop on the tiny model, train.py in this
process (conftest's run_main): REINFORCE++ and REINFORCE++-baseline run and log whitened token
advantages and the KL against the reference (their math: tests/math/test_reinforce_pp.py), and
truncated IS is a no-op with the transformers engine (its math: tests/math/test_is_correction.py)."""
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
