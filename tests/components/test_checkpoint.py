"""The replicated-state digest that checkpoints compare across ranks, unreadable checkpoint files, and the
checkpoint to resume checked before any model."""
import json

import torch

from pspo.training.checkpoint import state_digest
from pspo.ema_stats import EMAStats
from pspo.priority_sampler import PrioritySampler


def state(sampler, ers):
    return {"step": 3, "sampler": sampler.state_dict(), "ers": ers.state_dict()}


def test_digest_is_equal_for_equal_state_and_sensitive_to_any_change():
    def build():
        s, e = PrioritySampler(10, seed=1), EMAStats(0.9)
        idx = s.sample(4)
        s.set_priorities(idx, torch.rand(4, 3, generator=torch.Generator().manual_seed(0)))
        e.smooth(["a", "b"], torch.tensor([[1., 0, 1], [0, 0, 1]]))
        return s, e
    s1, e1 = build()
    s2, e2 = build()
    d = state_digest(state(s1, e1))
    assert d == state_digest(state(s2, e2)) and len(d) == 32
    assert d == state_digest(dict(reversed(list(state(s2, e2).items()))))   # key order does not matter
    e2.mean[0] = torch.nextafter(e2.mean[0], torch.tensor(2.0, dtype=torch.float64))   # one ulp
    assert state_digest(state(s2, e2)) != d
    s3, e3 = build()
    s3.sample(1)                                                             # RNG and step counter move
    assert state_digest(state(s3, e3)) != d


def test_a_corrupt_checkpoint_file_is_one_line(tmp_path):
    # a truncated/garbage trainer_state.pt must not end in a traceback: one line naming the file
    import pytest
    from pspo.training.checkpoint import CheckpointError, load_trainer_state
    (tmp_path / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="train.resume: cannot read .*trainer_state.pt") as e:
        load_trainer_state(str(tmp_path), 0)
    assert "\n" not in str(e.value)
    torch.save({"something": 1}, tmp_path / "trainer_state.pt")      # readable, but not ours
    with pytest.raises(CheckpointError, match="is not a pspo trainer state"):
        load_trainer_state(str(tmp_path), 0)


def test_resolve_resume_reads_and_checks_the_checkpoint_before_any_model(tmp_path):
    # "" -> None; auto in a folder without complete checkpoints -> None (a fresh run); auto -> the newest
    # complete one, whose trainer state is read and checked against the run's method and sampler
    import pytest
    from pspo.training.checkpoint import CheckpointError, resolve_resume
    from pspo.training.config import ConfigError, load_config
    from pspo.training.lora import LoraError
    out = tmp_path / "run"

    def cfg(*overrides):
        return load_config("configs/grpo.yaml", [f"--train.output_dir={out}", *overrides])
    assert resolve_resume(cfg(), "uniform") is None
    assert resolve_resume(cfg("--train.resume=auto"), "uniform") is None
    state = {"step": 2, "scheduler": {}, "sampler": {}, "advantage": "grpo", "sampler_mode": "uniform", "ers": None}
    for step, advantage in ((2, "grpo"), (10, "reinforce_pp")):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        torch.save({**state, "advantage": advantage}, out / f"checkpoint-{step}" / "trainer_state.pt")
    (out / ".tmp-checkpoint-12").mkdir()                          # a save cut short: never resumed
    with pytest.raises(ConfigError, match="^algo.advantage: the checkpoint was trained with "
                                          "algo.advantage=reinforce_pp, this run has algo.advantage=grpo"):
        resolve_resume(cfg("--train.resume=auto"), "uniform")
    assert resolve_resume(cfg(f"--train.resume={out}/checkpoint-2"), "uniform") == f"{out}/checkpoint-2"
    with pytest.raises(ConfigError, match="^pps.enabled: the checkpoint was trained with pps.enabled=false"):
        resolve_resume(cfg(f"--train.resume={out}/checkpoint-2", "--pps.enabled=true"), "paper")
    with pytest.raises(CheckpointError, match=r"holds full weights; model.lora.rank 4 needs adapters"):
        resolve_resume(cfg(f"--train.resume={out}/checkpoint-2", "--model.lora.rank=4"), "uniform")
    adapter = {"r": 4, "lora_alpha": 32, "target_modules": "all-linear"}
    (out / "checkpoint-2" / "adapter_config.json").write_text(json.dumps(adapter))
    assert resolve_resume(cfg(f"--train.resume={out}/checkpoint-2", "--model.lora.rank=4"), "uniform")
    with pytest.raises(LoraError, match="^model.lora.alpha: the checkpoint .* was trained with 32, this run has 16.0"):
        resolve_resume(cfg(f"--train.resume={out}/checkpoint-2", "--model.lora.rank=4", "--model.lora.alpha=16"),
                       "uniform")


def test_a_checkpoint_of_another_rollout_mode_is_refused_in_one_line():
    # async at lag 1 saves with the next step drawn already (inflight.pt): the sampler's state assumes it
    import pytest
    from pspo.training.checkpoint import check_modes
    from pspo.training.config import ConfigError, load_config
    cfg = load_config(None, ["--rollout.mode=async", "--rollout.is_correction=token"])
    state = {"sampler": {}, "sampler_mode": "uniform", "advantage": "grpo", "rollout_mode": "sync"}
    with pytest.raises(ConfigError) as e:
        check_modes(state, cfg, "uniform")
    assert str(e.value) == ("rollout.mode: the checkpoint was trained with rollout.mode=sync, this run has "
                            "rollout.mode=async-lag1; resume with the same setting")
    check_modes({**state, "rollout_mode": "async-lag1"}, cfg, "uniform")
    check_modes({k: v for k, v in state.items() if k != "rollout_mode"}, load_config(None, []), "uniform")   # older


def test_an_async_resume_with_other_generation_settings_is_refused_in_one_line():
    # One step off, the checkpoint's step in flight was generated already: 64 prompts of G = 8 at temperature 1.0
    # (the defaults) cannot become G = 4 (the step would hold twice its completions) or temperature 0.7 (the
    # engine's log-probs, the IS weights' denominator, are at 1.0); in sync mode nothing is in flight
    import pytest
    from pspo.training.checkpoint import check_modes, generation_settings
    from pspo.training.config import ConfigError, load_config
    lag1 = ["--rollout.mode=async", "--rollout.is_correction=token"]
    was = load_config(None, lag1)
    state = {"sampler": {}, "sampler_mode": "uniform", "advantage": "grpo", "rollout_mode": "async-lag1",
             "generation": generation_settings(was)}
    check_modes(state, was, "uniform")
    for override, key, before, after in (("--rollout.num_generations=4", "rollout.num_generations", "8", "4"),
                                         ("--rollout.temperature=0.7", "rollout.temperature", "1", "0.7"),
                                         ("--rollout.max_new_tokens=24", "rollout.max_new_tokens", "16", "24"),
                                         ("--train.prompts_per_step=16", "train.prompts_per_step", "64", "16")):
        with pytest.raises(ConfigError) as e:
            check_modes(state, load_config(None, [*lag1, override]), "uniform")
        assert str(e.value) == (f"{key}: the checkpoint's step in flight was generated with {key}={before}, this "
                                f"run has {key}={after}; resume with the same setting")
    sync = load_config(None, ["--rollout.temperature=0.7"])
    check_modes({**state, "rollout_mode": "sync"}, sync, "uniform")
