"""Config of the prompt-selection methods: the Beta priorities (pps.priority learnability | thompson,
pps.prior_reversion), MaxRL (algo.advantage maxrl) and the random-reward control (reward.kind random):
their presets load, and each mistake is one line naming the key."""
import os

import pytest

from pspo.training.config import Config, ConfigError, load_config, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def refused(overrides: list[str], path: str | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_old_priority_name_is_refused_naming_the_new_one(tmp_path):
    expected = "pps.priority: expected learnability, the name of the p̂(1-p̂) priority once called posterior"
    assert refused(["--pps.enabled=true", "--pps.priority=posterior"]).startswith(expected)
    # a run's own saved config.yaml, as a resume would read it (train.py --config runs/x/config.yaml)
    cfg = Config()
    cfg.pps.enabled, cfg.pps.priority = True, "posterior"
    saved = str(tmp_path / "config.yaml")
    save_config(cfg, saved)
    assert refused(["--train.resume=auto"], saved).startswith(expected)


def test_beta_priority_options():
    cfg = load_config(None, ["--pps.enabled=true", "--pps.priority=thompson", "--pps.prior_reversion=0.01"])
    assert (cfg.pps.priority, cfg.pps.prior_reversion) == ("thompson", 0.01)
    assert Config().pps.prior_reversion == 0.0                          # off by default
    assert refused(["--pps.prior_reversion=1"]) == "pps.prior_reversion: expected in [0, 1), got 1.0"
    assert refused(["--pps.prior_reversion=-0.1"]) == "pps.prior_reversion: expected in [0, 1), got -0.1"
    assert refused(["--pps.prior_reversion=0.1"]).startswith(
        "pps.prior_reversion: expected 0 with pps.priority=mean_abs (it moves the Beta counts of learnability | "
        "thompson | single_stream)")


def test_beta_priority_presets():
    learn = load_config(os.path.join(ROOT, "configs/pps_learnability.yaml"))
    thompson = load_config(os.path.join(ROOT, "configs/pps_thompson.yaml"))
    skip = load_config(os.path.join(ROOT, "configs/pps_skip.yaml"))
    assert (learn.pps.enabled, learn.pps.priority, learn.pps.posterior_decay, learn.pps.is_norm) == \
        (True, "learnability", 0.9, "mean")
    assert (thompson.pps.priority, thompson.pps.posterior_decay, thompson.pps.is_norm) == ("thompson", 0.9, "mean")
    assert (skip.pps.priority, skip.pps.skip) == ("learnability", True)


def test_maxrl_needs_rewards_that_are_never_negative():
    cfg = load_config(os.path.join(ROOT, "configs/maxrl.yaml"))
    grpo = load_config(os.path.join(ROOT, "configs/grpo.yaml"))
    assert cfg.algo.advantage == "maxrl" and (cfg.reward, cfg.pps, cfg.ers) == (grpo.reward, grpo.pps, grpo.ers)
    assert load_config(None, ["--algo.advantage=maxrl", "--ers.enabled=true"]).ers.enabled   # a group baseline
    assert refused(["--algo.advantage=maxrl", "--reward.cosine=2"]).startswith(
        "reward.cosine: expected 0 with algo.advantage=maxrl (it divides by the group's mean reward")
    assert refused(["--algo.advantage=maxrl", "--reward.knights=1"]).startswith("reward.knights: expected 0 with")
    assert refused(["--algo.advantage=maxrl", "--reward.overlong_cache=2"]).startswith(
        "reward.overlong_cache: expected 0 with")
    assert refused(["--algo.advantage=maxrl", "--reward.format=-1"]).startswith(
        "reward.format: expected >= 0 with algo.advantage=maxrl")


def test_random_reward_control_settings():
    cfg = load_config(os.path.join(ROOT, "configs/grpo_random_reward.yaml"))
    assert (cfg.reward.kind, cfg.reward.random_rate, cfg.reward.accuracy) == ("random", 0.21, 1.0)
    assert (Config().reward.kind, Config().reward.random_rate) == ("verified", 0.0)
    assert refused(["--reward.kind=spurious"]) == "reward.kind: expected verified | random, got 'spurious'"
    assert refused(["--reward.random_rate=0.3"]) == \
        "reward.random_rate: expected 0 (unset) with reward.kind=verified, got 0.3"
    assert refused(["--reward.kind=random"]).startswith(
        "reward.random_rate: expected the task's measured base rate in (0, 1) with reward.kind=random")
    assert refused(["--reward.kind=random", "--reward.random_rate=1"]).startswith("reward.random_rate: expected")
    rand = ["--reward.kind=random", "--reward.random_rate=0.2"]
    assert refused([*rand, "--reward.accuracy=0", "--reward.format=1"]).startswith(
        "reward.accuracy: expected a non-zero weight with reward.kind=random")
    for key, value in (("format", "1"), ("cosine", "2"), ("overlong_cache", "2")):
        assert refused([*rand, f"--reward.{key}={value}"]).startswith(
            f"reward.{key}: expected 0 with reward.kind=random (the control's reward is the random draw alone)")
    assert refused([*rand, "--algo.advantage=spo_chain", "--algo.beta=0"]).startswith(
        "reward.kind: expected verified with algo.advantage=spo_chain")
    assert load_config(None, [*rand, "--algo.advantage=maxrl"]).reward.kind == "random"   # 0/1 · weight >= 0
