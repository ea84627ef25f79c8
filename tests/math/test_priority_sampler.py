"""PPS: priorities, probabilities, normalized IS weights, unseen prompts, β annealing, resume."""
import pytest
import numpy as np
import torch

from pspo.priority_sampler import PrioritySampler, occurrence


def rows(*means, G=4):
    """abs_advantages rows whose mean is each given value. (B, G)"""
    return torch.tensor(means, dtype=torch.float64)[:, None].repeat(1, G)


def test_probabilities_and_normalized_weights_hand_worked():
    # α=1, ε=0: priorities [1,2,3,4] -> P = [.1,.2,.3,.4]
    # β=.5: (N·P)^-β = [.4,.8,1.2,1.6]^-.5 = [1.58114, 1.11803, .91287, .79057]
    # normalized by the batch max (all 4 drawn): [1, .70711, .57735, .5]
    s = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0)
    s.set_priorities(torch.arange(4), rows(1, 2, 3, 4))
    torch.testing.assert_close(s.probabilities(), torch.tensor([.1, .2, .3, .4], dtype=torch.float64))
    idx = s.sample(4)
    w = s.weights
    assert sorted(idx.tolist()) == [0, 1, 2, 3]
    expected = torch.tensor([1, .70711, .57735, .5])[idx]
    torch.testing.assert_close(w, expected, atol=1e-5, rtol=0)


def test_is_norm_mean_and_none_hand_worked():
    # The same P = [.1,.2,.3,.4], β=.5: raw (N·P)^-β = [1.58114, 1.11803, .91287, .79057]
    #   none: as is;  mean: / 1.10065 (their mean) = [1.43655, 1.01579, .82939, .71827] (mean 1)
    raw = torch.tensor([1.58114, 1.11803, .91287, .79057])
    for norm, expected in (("none", raw), ("mean", torch.tensor([1.43655, 1.01579, .82939, .71827]))):
        s = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0, is_norm=norm)
        s.set_priorities(torch.arange(4), rows(1, 2, 3, 4))
        idx = s.sample(4)
        w = s.weights
        torch.testing.assert_close(w, expected[idx], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="pps.is_norm: expected one of batch_max, mean, none, got 'max'"):
        PrioritySampler(4, is_norm="max")


def test_alpha_and_eps_shape_the_priority():
    # α=.6, ε=1e-6: mean |A| = [0, .5, 2] -> (x+1e-6)^.6 = [2.5e-4, .65975, 1.51572]
    s = PrioritySampler(3, alpha=0.6, eps=1e-6)
    s.set_priorities(torch.arange(3), torch.tensor([[0., 0], [1., 0], [2., 2]]))
    torch.testing.assert_close(s.priorities(), torch.tensor([2.5119e-4, .65975, 1.51572], dtype=torch.float64),
                               atol=1e-5, rtol=0)
    # max_abs / last_abs read the group differently: [1,0] -> max 1, last 0
    m = PrioritySampler(1, alpha=1.0, eps=0.0, priority="max_abs")
    m.set_priorities(torch.tensor([0]), torch.tensor([[1., 0]]))
    last = PrioritySampler(1, alpha=1.0, eps=0.0, priority="last_abs")
    last.set_priorities(torch.tensor([0]), torch.tensor([[1., 0]]))
    assert m.priorities().item() == 1.0 and last.priorities().item() == 0.0


def test_unseen_prompts_carry_the_running_max():
    # N=3, α=1, ε=0. Start: all 1.0. Prompt 0 gets 3 -> the max rises to 3, unseen 1, 2 follow.
    s = PrioritySampler(3, alpha=1.0, eps=0.0)
    assert s.priorities().tolist() == [1.0, 1.0, 1.0]
    s.set_priorities(torch.tensor([0]), rows(3))
    assert s.priorities().tolist() == [3.0, 3.0, 3.0]
    # prompt 0's group goes all-correct (|A| = 0): its priority falls, the running max stays 3
    s.set_priorities(torch.tensor([0]), rows(0))
    torch.testing.assert_close(s.probabilities(), torch.tensor([0, .5, .5], dtype=torch.float64))
    s.set_priorities(torch.tensor([1]), rows(2))                                 # seen prompts keep their own
    assert s.priorities().tolist() == [0.0, 2.0, 3.0]


def test_draws_follow_the_priorities_chi_square():
    # priorities 1..10 (α=1): P = k/55. 10^5 draws; chi-square with 9 dof < 27.88 (p = .001).
    s = PrioritySampler(10, alpha=1.0, eps=0.0, seed=0)
    s.set_priorities(torch.arange(10), rows(*range(1, 11)))
    n = 100_000
    counts = torch.bincount(s._draw(n), minlength=10).double()
    expected = torch.arange(1, 11, dtype=torch.float64) / 55 * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.88, chi2
    # and a skewed vector is not uniform: the same test against uniform expectations fails
    assert (((counts - n / 10) ** 2) / (n / 10)).sum().item() > 1000


def test_sample_without_replacement_follows_successive_sampling_chi_square():
    # Priorities 1, 2, 3 (α = 1, Σ = 6), B = 2. Successive sampling gives each pair
    #   P{i,j} = (p_i/6)·p_j/(6 - p_i) + (p_j/6)·p_i/(6 - p_j):
    #   {0,1}: (1/6)(2/5) + (2/6)(1/4) = 1/15 + 1/12 = 0.15
    #   {0,2}: (1/6)(3/5) + (3/6)(1/3) = 1/10 + 1/6  = 0.26667
    #   {1,2}: (2/6)(3/4) + (3/6)(2/3) = 1/4 + 1/3   = 0.58333
    # and the first index alone is p_i/6 = 1/6, 2/6, 3/6. 6,000 samples; chi-square, 2 dof < 13.82 (p = .001).
    s = PrioritySampler(3, alpha=1.0, eps=0.0, seed=0)
    s.set_priorities(torch.arange(3), rows(1.0, 2.0, 3.0))
    n = 6_000
    pairs, firsts = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for _ in range(n):
        idx = s.sample(2)
        pairs[int(idx.sum()) - 1] += 1                     # {0,1} -> 0, {0,2} -> 1, {1,2} -> 2
        firsts[int(idx[0])] += 1
    for counts, probs in ((pairs, [0.15, 4 / 15, 7 / 12]), (firsts, [1 / 6, 2 / 6, 3 / 6])):
        expected = torch.tensor(probs, dtype=torch.float64) * n
        assert ((counts - expected) ** 2 / expected).sum().item() < 13.82, counts
    # drawing with replacement and keeping the draw order would give {0,1} 2·(1/6)(2/6) / (1 - Σp²) = 0.2;
    # the 0.15 above is what distinguishes successive sampling
    assert abs(pairs[0] / n - 0.15) < abs(pairs[0] / n - 0.2)


def test_sample_refuses_more_prompts_than_have_a_priority():
    # With eps = 0 a prompt can reach priority 0 and is never drawn: asking for more distinct
    # prompts than have p > 0 is an error, not an endless loop. Priorities [1, 0, 0]: 1 drawable.
    s = PrioritySampler(3, alpha=1.0, eps=0.0)
    s.set_priorities(torch.arange(3), rows(1.0, 0.0, 0.0))
    assert s.sample(1).tolist() == [0]
    before = s.tree.clone()
    with pytest.raises(ValueError, match="2 distinct prompts asked, but only 1 have a priority above 0"):
        s.sample(2)
    assert torch.equal(s.tree, before)                      # prompt 0's priority is back
    none = PrioritySampler(2, alpha=1.0, eps=0.0)
    none.set_priorities(torch.arange(2), rows(0.0, 0.0))
    with pytest.raises(ValueError, match="but only 0 have a priority above 0"):
        none.sample(1)


def test_sample_is_distinct_and_never_padding():
    s = PrioritySampler(5, seed=1)                                       # S = 8: three padding leaves
    for _ in range(50):
        idx = s.sample(5)
        w = s.weights
        assert sorted(idx.tolist()) == [0, 1, 2, 3, 4] and w.max().item() == 1.0


def test_beta_anneals_linearly():
    # β .4 -> 1 over 11 steps: draw k (0-based) uses .4 + .6·k/10: draw 5 -> .7, draw 10 (the last) -> 1
    s = PrioritySampler(4, beta=0.4, beta_end=1.0, total_steps=11)
    assert s.current_beta() == 0.4
    for _ in range(5):
        s.sample(2)
    assert abs(s.current_beta() - 0.7) < 1e-12
    for _ in range(5):
        s.sample(2)
    assert s.current_beta() == 1.0
    for _ in range(5):                                                  # past the end it stays at beta_end
        s.sample(2)
    assert s.current_beta() == 1.0


def test_beta_anneals_per_step_not_per_draw():
    # A further draw of the same step (dynamic sampling's extra rounds) keeps the step's β. β .4 -> 1 over 3
    # steps: step 0 .4, step 1 .7, step 2 1. Priorities [1, 3] over N = 2: P = [.25, .75], N·P = [.5, 1.5]; a
    # batch of both, raw w = (N·P)^-β: step 0 [.5^-.4, 1.5^-.4] = [1.319508, .850283]; at step 1 (β .7)
    # [1.624505, .752898]. batch_max: / the first = 3^-β -> step 0 [1, .644394], step 1 [1, .463463]
    s = PrioritySampler(2, beta=0.4, beta_end=1.0, total_steps=3, seed=0)
    s._set(np.array([0, 1]), np.array([1.0, 3.0]))                     # priorities 1 and 3
    first = s.sample(2)
    torch.testing.assert_close(s.weights[first.argsort()], torch.tensor([1.0, 0.644394]), atol=1e-6, rtol=0)
    again = s.sample(2, same_step=True)                                 # the same step: β stays .4
    torch.testing.assert_close(s.weights[again.argsort()], torch.tensor([1.0, 0.644394]), atol=1e-6, rtol=0)
    assert s.steps == 1 and abs(s.current_beta() - 0.7) < 1e-12
    nxt = s.sample(2)                                                   # step 1: β .7
    torch.testing.assert_close(s.weights[nxt.argsort()], torch.tensor([1.0, 0.463463]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("is_norm, expected", [
    # raw per prompt [2, .5, 1]: batch_max / 2 -> [1, .25, .5]; mean / (3.5 / 3 = 1.166667) -> [1.714286,
    # .428571, .857143]; none as they are
    ("batch_max", [1.0, 0.25, 0.5]), ("mean", [1.714286, 0.428571, 0.857143]), ("none", [2.0, 0.5, 1.0])])
def test_normalize_treats_the_prompts_given_as_one_batch(is_norm, expected):
    s = PrioritySampler(4, is_norm=is_norm)
    raw = torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64)[:, None].expand(3, 2)       # (P, G)
    w = s.normalize(raw)
    assert w.dtype == torch.float32 and w.shape == (3, 2)
    torch.testing.assert_close(w, torch.tensor(expected)[:, None].expand(3, 2), atol=1e-6, rtol=0)


def test_observe_gives_the_raw_weights_when_asked():
    # priorities [1, 3] over N = 2, β .4: a batch of both, raw (N·P)^-β = [.5^-.4, 1.5^-.4] = [1.319508, .850283]
    # (whatever the rewards then write); normalized (batch_max) [1, .644394]
    s = PrioritySampler(2, beta=0.4, seed=0)
    s._set(np.array([0, 1]), np.array([1.0, 3.0]))
    idx = s.sample(2)
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    raw = s.observe(idx, rewards, rewards, normalized=False)                    # (2, 2) float64
    torch.testing.assert_close(raw[idx.argsort()], torch.tensor([[1.319508] * 2, [0.850283] * 2], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(s.normalize(raw)[idx.argsort()], torch.tensor([[1.0] * 2, [0.644394] * 2]),
                               atol=1e-6, rtol=0)


def test_state_dict_round_trip(tmp_path):
    s = PrioritySampler(50, seed=3)
    s.set_priorities(torch.arange(10), torch.rand(10, 4, generator=torch.Generator().manual_seed(0)))
    s.sample(8)
    torch.save(s.state_dict(), tmp_path / "pps.pt")
    t = PrioritySampler(50, seed=99)
    t.load_state_dict(torch.load(tmp_path / "pps.pt", weights_only=True))
    for _ in range(3):
        i1, i2 = s.sample(8), t.sample(8)
        w1, w2 = s.weights, t.weights
        assert torch.equal(i1, i2) and torch.equal(w1, w2)


def test_a_draw_saved_before_it_is_observed_keeps_its_weights_and_stats(tmp_path):
    # One step off, the next step is drawn before the checkpoint and observed after the resume: the draw's
    # weights and statistics are part of the state. Priorities [1, 2, 3, 4] (α = 1, ε = 0), β = .5, all 4
    # drawn: w = [1, .70711, .57735, .5] by prompt (test_probabilities_and_normalized_weights_hand_worked),
    # not the ones a sampler with no draw gives.
    s = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0)
    s.set_priorities(torch.arange(4), rows(1, 2, 3, 4))
    idx = s.sample(4)
    torch.save(s.state_dict(), tmp_path / "pps.pt")
    t = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0)
    t.load_state_dict(torch.load(tmp_path / "pps.pt", weights_only=True))
    assert t.batch_stats() == s.batch_stats() and abs(t.batch_stats()["is_max"] - 1.58114) < 1e-5
    expected = torch.tensor([1, .70711, .57735, .5])[idx][:, None].expand(4, 2)
    torch.testing.assert_close(t.observe(idx, torch.zeros(4, 2), torch.zeros(4, 2)), expected, atol=1e-5, rtol=0)
    # raw (dynamic sampling's rounds): (N·P)^-β = [1.58114, 1.11803, .91287, .79057] by prompt
    raw = t.observe(idx, torch.zeros(4, 2), torch.zeros(4, 2), normalized=False)[:, 0]
    torch.testing.assert_close(raw, torch.tensor([1.58114, 1.11803, .91287, .79057], dtype=torch.float64)[idx],
                               atol=1e-5, rtol=0)


def test_occurrence_counts_earlier_equal_indices_hand_worked():
    # [5, 2, 5, 5, 2]: the first 5 and the first 2 have none before them, the second 5 one, the third 5 two,
    # the second 2 one
    assert occurrence(torch.tensor([5, 2, 5, 5, 2])).tolist() == [0, 0, 1, 2, 1]
    assert occurrence(torch.tensor([], dtype=torch.int64)).tolist() == []
    # against a count kept in a dict, on 65,536 draws of 1,000 prompts (a (B, B) comparison would need 34 GB)
    indices = torch.randint(0, 1000, (65536,), generator=torch.Generator().manual_seed(0))
    seen: dict[int, int] = {}
    expected = []
    for i in indices.tolist():
        expected.append(seen.get(i, 0))
        seen[i] = seen.get(i, 0) + 1
    assert occurrence(indices).tolist() == expected


def test_batch_stats_hand_worked():
    # priorities [1,2,3,4] (α=1, ε=0), β=.5, all 4 drawn:
    #   raw (N·P)^-β = [1.58114, 1.11803, .91287, .79057] -> is_max 1.58114, is_min .79057
    #   ess = (Σw)²/Σw² = 4.40261² / (2.5 + 1.25 + .83333 + .625) = 19.38298 / 5.20833 = 3.72153
    #   entropy = -Σ P ln P / ln 4 = (.23026 + .32189 + .36119 + .36652) / 1.38629 = .92322
    s = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0)
    s.set_priorities(torch.arange(4), rows(1, 2, 3, 4))
    s.sample(4)
    st = s.batch_stats()
    assert abs(st["is_max"] - 1.58114) < 1e-5 and abs(st["is_min"] - 0.79057) < 1e-5
    assert abs(st["ess"] - 3.72153) < 1e-4 and abs(st["entropy"] - 0.92322) < 1e-4
    assert 0 <= st["repeat_frac"] < 1                    # 4 distinct of 4 needs >= 4 raw draws
    assert st["revisit_frac"] == 1                        # all 4 were scored by the priorities set above
    # one prompt drawn: nothing to repeat, ess 1, and uniform priorities have entropy 1
    u = PrioritySampler(8)
    u.sample(1)
    st = u.batch_stats()
    assert st["repeat_frac"] == 0 and st["ess"] == 1 and abs(st["entropy"] - 1) < 1e-12
    assert st["revisit_frac"] == 0


def test_repeat_fraction_counts_redrawn_duplicates():
    # One prompt holds almost all the mass (p = 1 and 1e-3). Round 1 draws 2 prompts: both are
    # prompt 0 with probability (1/1.001)^2 = 0.998; the first is kept, the second is a repeat.
    # Prompt 0's leaf is then 0, so round 2's single draw is prompt 1. Draws 3, kept 2:
    # repeat_frac = 1 - 2/3 = 1/3.
    s = PrioritySampler(2, alpha=1.0, eps=0.0, seed=0)
    s.set_priorities(torch.arange(2), rows(1.0, 1e-3))
    indices = s.sample(2)
    assert sorted(indices.tolist()) == [0, 1]
    assert s.batch_stats()["repeat_frac"] == pytest.approx(1 / 3)


def test_sampling_with_mass_on_few_prompts_is_bounded_and_restores_the_tree():
    # The case that took 13 s before: N = B = 100, half the prompts at the floor (1e-6 ** 0.6 ≈ 2.5e-4
    # against ~1). Every round keeps at least one new prompt, so at most B rounds of draws happen:
    # the raw draws are at most B + B(B-1)/2 = 5050 (each round draws what is still missing).
    s = PrioritySampler(100, alpha=0.6, seed=3)
    s.set_priorities(torch.arange(50), torch.zeros(50, 4))          # floor: (0 + 1e-6) ** 0.6
    s.set_priorities(torch.arange(50, 100), torch.ones(50, 4))      # 1.0
    before = s.tree.clone()
    indices = s.sample(100)
    weights = s.weights
    assert sorted(indices.tolist()) == list(range(100))
    assert s.last_sample["draws"] <= 5050
    assert torch.equal(s.tree, before)                      # zeroed leaves got their priorities back
    assert weights.max() == 1.0 and bool((weights > 0).all())


def test_observing_another_batch_than_the_last_sample_is_an_error():
    # The last sample drew 2 prompts; observing 3 would hand out weights of other prompts (or,
    # silently, all ones). Before any sample, the weights are ones (priorities set directly).
    s = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0)
    assert s.set_priorities(torch.arange(3), rows(1, 2, 3)).tolist() == [[1.0] * 4] * 3
    idx = s.sample(2)
    w = s.weights
    before = s.priorities()
    with pytest.raises(ValueError, match=r"3 prompts scored, but the last sample drew 2"):
        s.set_priorities(torch.arange(3), rows(4, 4, 4))
    torch.testing.assert_close(s.priorities(), before)                                  # nothing changed
    # the drawn batch: its weights
    torch.testing.assert_close(s.set_priorities(idx, rows(1, 2)), w[:, None].expand(2, 4))


def test_observe_sets_the_priority_from_the_groups_raw_grpo_advantage_hand_worked():
    # rewards [1, 0]: μ = .5, s = .70711; GRPO |A| = .5 / (.70711 + 1e-4) = .70700 for both completions,
    # p = (.70700 + 1e-6)^.6 = exp(.6 ln .70700) = .81218; with adv_eps .5, |A| = .5 / 1.20711 = .41421,
    # p = .58930. Dr. GRPO (no std scaling): |A| = .5, p = (.5 + 1e-6)^.6 = exp(.6 ln .5) = .65975.
    # Learnability reads the accuracy [1, 1] instead: a = 1 + 2, b = 1 + 0, p̂ = .75,
    # p = (.75·.25 + 1e-6)^.6 = .1875^.6 = .36627 (below the starting .25^.6 = .43528).
    for scale, adv_eps, expected in ((True, 1e-4, 0.81218), (True, 0.5, 0.58930), (False, 0.5, 0.65975)):
        s = PrioritySampler(2, alpha=0.6, beta=0.4, eps=1e-6, scale_rewards=scale, adv_eps=adv_eps)
        weights = s.observe(torch.tensor([0]), torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]))
        assert float(s.priorities()[0]) == pytest.approx(expected, rel=1e-4)
        assert weights.tolist() == [[1.0, 1.0]]                          # nothing drawn yet: ones
    s = PrioritySampler(2, alpha=0.6, eps=1e-6, priority="learnability")
    s.observe(torch.tensor([0]), torch.tensor([[5.0, 5.0]]), torch.tensor([[1.0, 1.0]]))
    assert float(s.priorities()[0]) == pytest.approx(0.36627, rel=1e-4)


def test_build_sampler_hands_the_algo_sections_advantage_settings_to_pps():
    from pspo.sampler import build_sampler
    from pspo.training.config import load_config
    for mode in ("paper", "released"):
        cfg = load_config(None, ["--pps.enabled=true", f"--pps.mode={mode}", "--algo.scale_rewards=false",
                                 "--algo.adv_eps=0.5", "--train.prompts_per_step=2"])
        s = build_sampler(cfg, ["p0", "p1", "p2"], "test")
        assert (s.scale_rewards, s.adv_eps) == (False, 0.5), mode


def test_uniform_sampling_weighs_every_completion_one():
    from pspo.sampler import UniformSampler
    s = UniformSampler(5, seed=0)
    idx = s.sample(2)
    rewards = torch.tensor([[1.0, 0.0, 3.0], [2.0, 2.0, 2.0]])
    assert s.observe(idx, rewards, torch.zeros(2, 3)).tolist() == [[1.0] * 3] * 2
