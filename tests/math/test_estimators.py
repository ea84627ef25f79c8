"""GRPO / Dr. GRPO / RLOO / MaxRL group advantages, docs/methods.md §1, checked against numbers worked by hand."""
import pytest
import torch

from pspo.estimators import (group_advantages, group_mean, group_statistics, maxrl_advantages, rloo_advantages,
                             zero_variance)


def test_group_advantages_hand_worked():
    # group [1,0,0,1]: μ=.5, sample std=sqrt(1/3)=.57735 -> ±.5/.57745 = ±.86588
    # group [3,3,3,3]: std 0 -> advantages 0, not NaN
    adv = group_advantages(torch.tensor([[1., 0, 0, 1], [3, 3, 3, 3]]))
    expected = torch.tensor([[.86588, -.86588, -.86588, .86588], [0, 0, 0, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_group_advantages_uses_sample_std():
    # group [0,1,2]: μ=1, sample std = sqrt((1+0+1)/(3-1)) = 1 -> A = [-1,0,1]/(1+1e-4) = ±.99990
    # (the population std sqrt(2/3)=.81650 would give ±1.22474 instead)
    adv = group_advantages(torch.tensor([[0., 1, 2]]))
    torch.testing.assert_close(adv, torch.tensor([[-.99990, 0, .99990]]), atol=1e-5, rtol=0)


def test_group_advantages_eps_is_configurable():
    # group [0,1,2] with ε = 1: A = [-1,0,1]/(1+1) = [-.5, 0, .5]
    adv = group_advantages(torch.tensor([[0., 1, 2]]), eps=1.0)
    torch.testing.assert_close(adv, torch.tensor([[-.5, 0, .5]]), atol=1e-6, rtol=0)


def test_group_advantages_without_scaling():
    # Dr. GRPO: A = r - μ only. [1,0,0,1] -> ±.5; [3,3,3,3] -> 0; [0,1,5]: μ=2 -> [-2,-1,3]
    adv = group_advantages(torch.tensor([[1., 0, 0, 1], [3, 3, 3, 3]]), scale=False)
    torch.testing.assert_close(adv, torch.tensor([[.5, -.5, -.5, .5], [0, 0, 0, 0]]), atol=1e-6, rtol=0)
    adv = group_advantages(torch.tensor([[0., 1, 5]]), scale=False)
    torch.testing.assert_close(adv, torch.tensor([[-2., -1, 3]]), atol=1e-6, rtol=0)


def test_group_of_one_gets_zero_advantage_not_nan():
    # G = 1: the sample std divides by G-1 = 0 (NaN in torch); we define A = r - μ = 0 instead.
    rewards = torch.tensor([[0.7], [2.0]])                                 # (B=2, G=1)
    for scale in (True, False):
        adv = group_advantages(rewards, scale=scale)
        assert adv.shape == (2, 1)
        torch.testing.assert_close(adv, torch.zeros(2, 1), atol=0, rtol=0)


def test_groups_are_independent_and_shape_is_kept():
    # each row is normalised on its own: shifting and scaling one row leaves its advantages
    # (up to ε) unchanged and does not touch the other rows.
    torch.manual_seed(0)
    rewards = torch.rand(5, 8)                                             # (B, G)
    adv = group_advantages(rewards)
    assert adv.shape == (5, 8)
    torch.testing.assert_close(adv.sum(1), torch.zeros(5), atol=1e-5, rtol=0)  # centred per group
    moved = rewards.clone()
    moved[2] = 10 * moved[2] + 3
    adv_moved = group_advantages(moved)
    torch.testing.assert_close(adv_moved[2], adv[2], atol=1e-3, rtol=0)
    torch.testing.assert_close(adv_moved[[0, 1, 3, 4]], adv[[0, 1, 3, 4]], atol=0, rtol=0)


def test_group_mean_hand_worked_and_exact_for_an_all_equal_group():
    # [1, 0, 0, 1] -> 2/4 = 0.5; [0, 1, 2] would be 1, here [0.5, 1, 3] -> 4.5/3 = 1.5;
    # eight 0.7s: the float32 mean is 0.69999993, group_mean gives the first value, float32 0.7, exactly
    torch.testing.assert_close(group_mean(torch.tensor([[1., 0, 0, 1]])), torch.tensor([0.5]), atol=0, rtol=0)
    torch.testing.assert_close(group_mean(torch.tensor([[0.5, 1, 3]])), torch.tensor([1.5]), atol=1e-7, rtol=0)
    sevens = torch.tensor([[0.7] * 8])
    assert sevens.mean(dim=1).item() != sevens[0, 0].item()            # what a plain mean gives
    assert group_mean(sevens).item() == sevens[0, 0].item()
    assert torch.equal(group_statistics(sevens)[0], group_mean(sevens))   # the estimators' μ is this one


def test_all_equal_group_gets_exactly_zero_for_any_reward_value():
    # eight rewards of 0.7 (the cosine reward's values are like this): in float32 their mean is
    # 0.69999993, not 0.69999999 (the float32 0.7), so r - μ = 5.96e-8 and s = 6.37e-8; divided by
    # s + ε = 1.00064e-4 that is A = 5.96e-4, and a PPS priority (5.97e-4)^0.6 = 46x the floor
    # (1e-6)^0.6 = 2.51e-4. Exact equality with the first reward decides instead.
    rewards = torch.tensor([[0.7] * 8, [-0.35] * 8, [1.0, 0, 0, 0, 0, 0, 0, 0]])   # (B=3, G=8)
    naive = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    assert naive[0].abs().max() > 1e-5                      # what std-based code gives: not 0
    assert zero_variance(rewards).tolist() == [True, True, False]
    for scale in (True, False):
        adv = group_advantages(rewards, scale=scale)
        assert torch.equal(adv[:2], torch.zeros(2, 8))      # exactly 0, not approximately
    # the mixed group is untouched: μ = 1/8, s = sqrt((49/64 + 7/64)/7) = 0.35355 ->
    # A = [0.875, -0.125 x7] / 0.35365 = [2.47420, -0.35346 x7]
    torch.testing.assert_close(group_advantages(rewards)[2, :2], torch.tensor([2.47420, -0.35346]),
                               atol=1e-4, rtol=0)


def test_group_statistics_hand_worked():
    # [1,0,0,1]: μ = .5, s = sqrt(1/3) = .57735; [0,1,5,2]: μ = 2, s = sqrt((4+1+9+0)/3) = sqrt(14/3) = 2.16025;
    # eight 0.7s: μ is the float32 0.7 itself (not the float32 mean .69999993), so r - μ = 0 exactly
    mean, std = group_statistics(torch.tensor([[1., 0, 0, 1], [0, 1, 5, 2]]))
    torch.testing.assert_close(mean, torch.tensor([.5, 2.]), atol=1e-6, rtol=0)
    torch.testing.assert_close(std, torch.tensor([.57735, 2.16025]), atol=1e-5, rtol=0)
    flat = torch.tensor([[0.7] * 8])
    assert group_statistics(flat)[0].item() == flat[0, 0].item()
    # G = 1: s = 0, not the NaN of a Bessel std over one value
    assert group_statistics(torch.tensor([[0.7], [2.0]]))[1].tolist() == [0.0, 0.0]


def test_rloo_advantages_hand_worked():
    # A_i = r_i - mean of the other G - 1 (docs/methods.md §1):
    # [1,0,0,1]: r=1 -> 1 - (0+0+1)/3 = 2/3; r=0 -> 0 - (1+0+1)/3 = -2/3
    # [1,0,0,0]: r=1 -> 1 - 0 = 1;          r=0 -> 0 - (1+0+0)/3 = -1/3
    # [3,3,3,3]: 3 - 3 = 0 exactly
    rewards = torch.tensor([[1., 0, 0, 1], [1, 0, 0, 0], [3, 3, 3, 3]])
    adv = rloo_advantages(rewards, group_statistics(rewards)[0])
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1, -1 / 3, -1 / 3, -1 / 3], [0, 0, 0, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert torch.equal(adv[2], torch.zeros(4))
    # G = 3, [0,1,5]: 0 - (1+5)/2 = -3; 1 - (0+5)/2 = -1.5; 5 - (0+1)/2 = 4.5 (= 3/2·(r - μ), μ = 2)
    rewards = torch.tensor([[0., 1, 5]])
    torch.testing.assert_close(rloo_advantages(rewards, group_statistics(rewards)[0]),
                               torch.tensor([[-3., -1.5, 4.5]]), atol=1e-6, rtol=0)


def test_rloo_equals_the_literal_leave_one_out_mean_on_random_groups():
    # the closed form G/(G-1)·(r_i - μ) against (Σ_j r_j - r_i)/(G-1) computed directly
    rewards = torch.rand(6, 5, generator=torch.Generator().manual_seed(0)) * 4 - 1           # (B, G)
    others = (rewards.sum(1, keepdim=True) - rewards) / (rewards.shape[1] - 1)               # (B, G)
    torch.testing.assert_close(rloo_advantages(rewards, group_statistics(rewards)[0]), rewards - others,
                               atol=1e-5, rtol=0)


def test_rloo_needs_two_completions():
    with pytest.raises(ValueError, match="G >= 2"):
        rloo_advantages(torch.tensor([[1.0]]), torch.tensor([1.0]))


def test_maxrl_advantages_hand_worked():
    # A_i = (r_i - μ)/(μ + ε), ε = 1e-4 (docs/methods.md §1, MaxRL):
    # [1,0,0,0]: μ = .25 -> 1: .75/.2501 = 2.998800, 0: -.25/.2501 = -.999600 (GRPO: ±/(s + ε), s = .5:
    #            1.499700 and -.499900; MaxRL weighs this hard prompt 2x GRPO's, s/μ = .5/.25)
    # [1,1,1,0]: μ = .75 -> 1: .25/.7501 = .333289, 0: -.75/.7501 = -.999867 (GRPO: .499900, -1.499700)
    # [0,0,0,0] and [1,1,1,1]: exactly 0 (μ is the first reward; 0/(0 + ε) = 0, never NaN)
    # Σ_i |A_i| = 2G(1 - p)·p/(p + ε): 5.997601 and 1.999733, against GRPO's 2Gp(1 - p)/(s + ε)
    rewards = torch.tensor([[1., 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    adv = maxrl_advantages(rewards, group_statistics(rewards)[0])
    expected = torch.tensor([[2.998800, -0.999600, -0.999600, -0.999600], [0.333289, 0.333289, 0.333289, -0.999867],
                             [0, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert torch.equal(adv[2:], torch.zeros(2, 4))
    torch.testing.assert_close(adv.abs().sum(1)[:2], torch.tensor([5.997601, 1.999733]), atol=1e-5, rtol=0)
    # the paper's code takes ε = 1e-6: .75/.250001 = 2.999988
    assert maxrl_advantages(rewards[:1], torch.tensor([0.25]), eps=1e-6)[0, 0].item() == pytest.approx(2.999988,
                                                                                                        abs=1e-6)
