"""ERS: per-prompt EMA reward statistics and smoothed advantages (docs/methods.md §2)."""
import torch

from pspo.estimators import group_advantages, grpo_advantages
from pspo.ema_stats import EMAStats, prompt_key


def test_first_visit_is_grpo():
    # [1,0,0,1]: μ=.5, s=.57735 -> the GRPO advantages ±.86588; [3,3,3,3]: s=0 -> 0, not NaN
    ers = EMAStats(alpha=0.5)
    rewards = torch.tensor([[1., 0, 0, 1], [3, 3, 3, 3]])
    mean, std = ers.smooth(["p", "q"], rewards)
    torch.testing.assert_close(mean, torch.tensor([.5, 3.]))
    torch.testing.assert_close(std, torch.tensor([.57735, 0.]), atol=1e-5, rtol=0)
    torch.testing.assert_close(grpo_advantages(rewards, mean, std), group_advantages(rewards))


def test_second_visit_mixture_hand_worked():
    # α=.9. Visit 1 of "p": [1,0,0,1] -> m=.5, v=1/3.
    # Visit 2: [1,1,1,0]: μ=.75, s² = (3·.25² + .75²)/3 = .25
    #   m = .9·.75 + .1·.5 = .725
    #   v = .9·.25 + .1·(1/3) + .9·.1·(.75-.5)² = .225 + .033333 + .005625 = .263958, sqrt = .513768
    #   A(r=1) = .275/.513868 = .53516, A(r=0) = -.725/.513868 = -1.41087
    ers = EMAStats(alpha=0.9)
    ers.smooth(["p"], torch.tensor([[1., 0, 0, 1]]))
    rewards = torch.tensor([[1., 1, 1, 0]])
    mean, std = ers.smooth(["p"], rewards)
    torch.testing.assert_close(mean, torch.tensor([.725]))
    torch.testing.assert_close(std, torch.tensor([.513768]), atol=1e-5, rtol=0)
    adv = grpo_advantages(rewards, mean, std)
    torch.testing.assert_close(adv, torch.tensor([[.53516, .53516, .53516, -1.41087]]), atol=1e-4, rtol=0)
    # scale=False: r - m = [.275, .275, .275, -.725]
    torch.testing.assert_close(grpo_advantages(rewards, mean, std, scale=False),
                               torch.tensor([[.275, .275, .275, -.725]]))
    assert int(ers.visits[0]) == 2


def test_alpha_one_is_grpo_on_every_visit():
    ers = EMAStats(alpha=1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        rewards = torch.randint(0, 2, (4, 8), generator=g).float()
        mean, std = ers.smooth(["a", "b", "c", "d"], rewards)
        torch.testing.assert_close(grpo_advantages(rewards, mean, std), group_advantages(rewards))


def test_keys_merge_duplicates_and_are_order_independent():
    a, b = EMAStats(0.5), EMAStats(0.5)
    a.smooth(["x", "y"], torch.tensor([[1., 0], [0., 0]]))
    b.smooth(["y", "x"], torch.tensor([[0., 0], [1., 0]]))
    assert torch.equal(a.keys, b.keys) and torch.equal(a.mean, b.mean)
    # the same prompt twice in one batch: two visits, in order. α=.5:
    # visit 1 [1,1]: m=1, v=0; visit 2 [0,0]: m=.5, v=0 + 0 + .25·1 = .25 -> std .5
    c = EMAStats(0.5)
    mean, std = c.smooth(["z", "z"], torch.tensor([[1., 1], [0., 0]]))
    torch.testing.assert_close(mean, torch.tensor([1., .5]))
    torch.testing.assert_close(std, torch.tensor([0., .5]))
    assert len(c) == 1 and int(c.visits[0]) == 2
    assert prompt_key("x") == prompt_key("x") != prompt_key("x ")


def test_state_dict_round_trip(tmp_path):
    ers = EMAStats(0.8)
    ers.smooth(["a", "b"], torch.tensor([[1., 0, 1], [0., 0, 1]]))
    torch.save(ers.state_dict(), tmp_path / "ers.pt")
    again = EMAStats(0.8)
    again.load_state_dict(torch.load(tmp_path / "ers.pt", weights_only=True))
    rewards = torch.tensor([[0., 0, 1], [1., 1, 1]])
    for x, y in zip(ers.smooth(["a", "b"], rewards), again.smooth(["a", "b"], rewards)):
        assert torch.equal(x, y)


def test_trackers_loaded_from_one_state_do_not_share_storage():
    # Before the fix, load_state_dict adopted the tensors: after one visit of `first`, `second`
    # (loaded from the same dict) also showed visits 2 for "a". Now each has its own copy.
    ers = EMAStats(0.5)
    ers.smooth(["a"], torch.tensor([[1., 0]]))          # "a": visits 1, mean 0.5
    state = ers.state_dict()
    first, second = EMAStats(0.5), EMAStats(0.5)
    first.load_state_dict(state)
    second.load_state_dict(state)
    first.smooth(["a"], torch.tensor([[1., 1]]))        # first: mean 0.5*1 + 0.5*0.5 = 0.75, visits 2
    assert first.visits_of(["a"]).tolist() == [2]
    assert second.visits_of(["a"]).tolist() == [1] and float(second.mean[0]) == 0.5
    assert state["visits"].tolist() == [1] and float(state["mean"][0]) == 0.5   # the saved state is untouched
    ers.smooth(["a"], torch.tensor([[0., 0]]))          # nor does the source's own later visit reach it
    assert state["visits"].tolist() == [1]


def test_memory_per_prompt():
    # 10^6 distinct prompts must fit in well under ~100 MB: 8 (key) + 8 + 8 + 4 = 28 bytes each.
    ers = EMAStats(0.9)
    ers._rows(torch.randint(-2**62, 2**62, (1_000_000,), generator=torch.Generator().manual_seed(0)))
    total = sum(t.numel() * t.element_size() for t in (ers.keys, ers.mean, ers.var, ers.visits))
    assert len(ers) > 999_000 and total / len(ers) == 28
    assert bool((ers.keys[1:] > ers.keys[:-1]).all())        # sorted, no duplicates


def test_visits_of():
    # "p" twice, "q" once, "r" never: n = [2, 1, 0]
    ers = EMAStats(alpha=0.9)
    ers.smooth(["p", "q"], torch.ones(2, 4))
    ers.smooth(["p"], torch.zeros(1, 4))
    assert ers.visits_of(["p", "q", "r"]).tolist() == [2, 1, 0]
    assert EMAStats().visits_of(["p"]).tolist() == [0]


def test_batch_stats_hand_worked():
    # α=.9, the second-visit example above: "p" visit 2 gives m=.725 against μ=.75 -> gap .025;
    # "q" first visit [0,1,1,1]: m = μ = .75 -> gap 0. Mean gap (.025 + 0)/2 = .0125.
    # visits: p 2, q 1 -> 1.5. Two distinct prompts with statistics out of 8 -> seen_frac .25.
    ers = EMAStats(alpha=0.9)
    ers.smooth(["p"], torch.tensor([[1., 0, 0, 1]]))
    rewards = torch.tensor([[1., 1, 1, 0], [0., 1, 1, 1]])
    mean, _ = ers.smooth(["p", "q"], rewards)
    st = ers.batch_stats(["p", "q"], rewards, mean, num_prompts=8)
    assert abs(st["gap"] - 0.0125) < 1e-7 and st["visits"] == 1.5 and st["seen_frac"] == 0.25


def test_first_visit_of_an_all_equal_group_is_exactly_zero():
    # six rewards of 0.7 on a first visit: m_q = μ must be exactly 0.7 (as float32), v_q = 0,
    # so A = (0.7 - 0.7) / (0 + 1e-4) = 0 exactly, as GRPO gives.
    ers = EMAStats(0.99)
    rewards = torch.full((1, 6), 0.7)
    mean, std = ers.smooth(["q"], rewards)
    assert mean.item() == rewards[0, 0].item() and std.item() == 0
    assert torch.equal(grpo_advantages(rewards, mean, std), torch.zeros(1, 6))
