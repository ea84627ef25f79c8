"""The step metrics from rank sums (pspo/training/metrics.py), by hand-worked numbers."""
import pytest

from pspo.training.config import load_config


def test_step_metrics_from_rank_sums_hand_worked():
    # 4 completions in 2 groups, rewards [1,0 | 1,1]: Σr = 3, Σr² = 3 -> mean .75,
    # std = sqrt(3/4 - .75²) = sqrt(.1875) = .43301; one group of two has zero variance -> .5.
    # 10 tokens, 2 clipped, Σkl = 1 -> clip_frac .2, kl .1; 2 iterations -> loss = Σpg / 2,
    # response_length = completion tokens / completions = 5 / 4 = 1.25 (the update saw them twice: 10).
    # 100 tokens generated in 1 s -> 100 tokens/s; the generation counts are logged as they are
    import torch
    from pspo.training.metrics import (AdvantageSums, GenerationCounts, MethodStats, RolloutSums, UpdateSums,
                                       step_metrics)
    cfg = load_config(None, ["--algo.num_iterations=2"])
    method = MethodStats(RolloutSums(completions=4, groups=2, completion_tokens=5, reward=3, reward_sq=3,
                                     accuracy=3, format=4, zero_std_groups=1, truncated=1, reward_failures=0),
                         AdvantageSums(adv_abs=2, adv_sq=2, adv_count=4))
    update = UpdateSums(skipped_steps=1, update_positions=40, update_tokens=30, grad_norm=3, pg_loss=.6, kl=1,
                        clipped_tokens=2, tokens=10, entropy=5)
    counts = GenerationCounts(rollout_tokens=100, rollout_calls=1, rollout_gen_s=1.0)
    _, _, m = step_metrics(method, update, counts, cfg, torch.device("cpu"))
    assert m["gen_tokens_per_s"] == 100 and m["rollout_tokens"] == 100 and m["mc_calls"] == 0
    assert m["padding_frac"] == .25                     # 1 - 30 real tokens / 40 positions in the micro-batches
    assert m["skipped_steps"] == 1                     # one of the 2 optimizer steps was non-finite
    assert m["reward_mean"] == .75 and m["reward_std"] == pytest.approx(.43301, abs=1e-5)
    assert m["zero_std_frac"] == .5 and m["clip_frac"] == .2 and m["kl"] == .1
    assert m["loss"] == pytest.approx(.3) and m["response_length"] == 1.25 and m["grad_norm"] == 1.5
    assert m["adv_abs_mean"] == .5 and m["adv_std"] == pytest.approx(.70711, abs=1e-5)
