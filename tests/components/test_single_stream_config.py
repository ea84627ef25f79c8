"""The single_stream section and a group of one (rollout.num_generations = 1), docs/methods.md §10: what the
config takes, and what it refuses, each in one line naming the key."""
import pytest

from pspo.training.config import ConfigError, load_config


def test_the_presets_load_with_a_group_of_one():
    cfg = load_config("configs/single_stream.yaml")
    assert (cfg.rollout.num_generations, cfg.algo.advantage, cfg.pps.priority, cfg.pps.beta) == (1, "single_stream",
                                                                                                   "single_stream", 0.0)
    # 512 prompts x 1 = the GRPO demo's 64 x 8 completions per step
    grpo = load_config("configs/grpo.yaml")
    assert cfg.train.prompts_per_step == grpo.train.prompts_per_step * grpo.rollout.num_generations
    # a group of one also takes the learnability priority, and G > 1 is Single-stream PO too
    load_config("configs/single_stream.yaml", ["--pps.priority=learnability"])
    load_config("configs/grpo.yaml", ["--algo.advantage=single_stream", "--single_stream.rho=constant"])
    # its prioritized sampling is a sampler option of any method
    assert load_config("configs/pspo.yaml", ["--pps.priority=single_stream"]).pps.priority == "single_stream"


@pytest.mark.parametrize("config, overrides, message", [
    ("grpo", ["--rollout.num_generations=1"], "rollout.num_generations: expected G >= 2 (a group needs two samples; "
     "G = 1 is algo.advantage=single_stream's alone), got 1"),
    ("grpo", ["--single_stream.rho_min=0.5"], "single_stream.rho_min: expected 0.875 (unset) unless "
     "algo.advantage=single_stream, got 0.5"),
    ("single_stream", ["--rollout.num_generations=4", "--rollout.dynamic_sampling=true"],
     "rollout.dynamic_sampling: expected false with algo.advantage=single_stream"),
    ("single_stream", ["--algo.scale_rewards=false"], "algo.scale_rewards: expected true with "
     "algo.advantage=single_stream"),
    ("single_stream", ["--pps.priority=mean_abs"], "pps.priority: expected learnability | thompson | single_stream "
     "with rollout.num_generations=1 (the |A| of a group of one is 0), got 'mean_abs'"),
    ("single_stream", ["--pps.mode=released"], "pps.mode: expected paper with rollout.num_generations=1"),
    ("single_stream", ["--pps.skip=true", "--pps.replacement=false"], "pps.skip: expected false with "
     "rollout.num_generations=1"),
    ("single_stream", ["--ers.enabled=true"], "ers.enabled: expected false with algo.advantage=single_stream"),
    ("single_stream", ["--single_stream.rho=adaptive"], "single_stream.rho: expected kl | constant, got 'adaptive'"),
    ("single_stream", ["--single_stream.rho_max=0.8"], "single_stream.rho_max: expected in [rho_min = 0.875, 1]"),
    ("single_stream", ["--single_stream.rho_min=1"], "single_stream.rho_min: expected in (0, 1)"),
    ("single_stream", ["--single_stream.d_half=0"], "single_stream.d_half: expected > 0"),
    ("single_stream", ["--single_stream.prior_samples=0"], "single_stream.prior_samples: expected >= 1"),
    ("single_stream", ["--single_stream.prior_file=/no/such.json"], "single_stream.prior_file: expected a JSON "
     "file of {problem: [offline rewards]}"),
])
def test_refusals_name_the_key(config, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(f"configs/{config}.yaml", overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_gpu_preset_has_the_recipes_values():
    # the authors' verl recipe (recipe/spo: train.sh, spo_trainer.yaml, spo_ray_trainer.py): n = 1 with 8x the GRPO
    # batch, ρ clipped to [clip_lower 0.875, 0.96], D_half 0.06, offline_N 8, priority sqrt(p̂(1-p̂)) + 0.05, no
    # KL, (A - mean)/(std + 1e-8), verl's token-mean loss; the binary reward
    cfg = load_config("configs/qwen2.5-math-1.5b/single_stream.yaml")
    grpo = load_config("configs/qwen2.5-math-1.5b/grpo.yaml")
    s, p, a = cfg.single_stream, cfg.pps, cfg.algo
    assert cfg.rollout.num_generations == 1
    assert cfg.train.prompts_per_step == grpo.train.prompts_per_step * grpo.rollout.num_generations == 48
    assert (s.rho, s.rho_min, s.rho_max, s.d_half, s.prior_samples, s.prior_file) == ("kl", 0.875, 0.96, 0.06, 8, "")
    assert (p.enabled, p.priority, p.alpha, p.eps, p.beta) == (True, "single_stream", 1.0, 0.05, 0.0)
    assert (a.advantage, a.adv_eps, a.beta, a.aggregation) == ("single_stream", 1e-8, 0.0, "token_mean")
    assert (cfg.reward.accuracy, cfg.reward.format, cfg.reward.cosine) == (1.0, 0.0, 0.0)
