"""GRPO / Dr. GRPO group advantages, docs/methods.md §1, checked against numbers worked by hand."""
import torch

from pspo.advantages import group_advantages, zero_variance


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
