"""The random-reward control, reward.kind=random (docs/methods.md §5): each completion's reward is
accuracy-weight · b, b ~ Bernoulli(rate) drawn from a hash of its counter-based seed; the verified
accuracy stays beside it for the logs, and the sampler's Beta counts read b."""
import torch

from pspo.engines.sampling import prompt_keys, sequence_seeds
from pspo.rewards import RewardResult, gather_scores, with_random_reward


def scored_as(accuracy: torch.Tensor) -> RewardResult:
    """A verified scoring of len(accuracy) completions, reward = accuracy (weight 1)."""
    return RewardResult(accuracy.clone(), {"accuracy": accuracy, "format": torch.zeros_like(accuracy)},
                        {"accuracy": 0})


def draws(seed: int, steps: int, prompts: int, G: int, rate: float) -> torch.Tensor:
    """b of every completion of `steps` steps of `prompts` prompts x G, as the loop seeds them. (steps, P·G)"""
    out = []
    for step in range(steps):
        seeds = sequence_seeds(seed, step, prompt_keys(0, prompts, prompts, slice(None)), G)    # (P·G,)
        out.append(with_random_reward(scored_as(torch.zeros(len(seeds))), seeds, rate, 1.0).rewards)
    return torch.stack(out)


def test_the_rate_over_many_draws_and_pairs_of_draws():
    # 64 steps x 500 prompts x 8 = 256,000 draws at rate .21: sd of the mean sqrt(.21·.79/256000) = .000805,
    # within 4 sd. Consecutive draws of a group (sample j, j+1 of one prompt) are independent:
    # P(1,1) = .21² = .0441, P(1,0) = P(0,1) = .21·.79 = .1659, P(0,0) = .79² = .6241; chi-square 3 dof < 16.27
    b = draws(seed=0, steps=64, prompts=500, G=8, rate=0.21)
    assert set(b.unique().tolist()) == {0.0, 1.0}
    assert abs(b.mean().item() - 0.21) < 4 * 0.000805, b.mean()
    pairs = b.view(64, 500, 8)[..., ::2] * 2 + b.view(64, 500, 8)[..., 1::2]       # 0: (0,0) 1: (0,1) 2: (1,0) 3: (1,1)
    counts = torch.bincount(pairs.long().reshape(-1), minlength=4).double()
    expected = torch.tensor([0.6241, 0.1659, 0.1659, 0.0441], dtype=torch.float64) * counts.sum()
    assert ((counts - expected) ** 2 / expected).sum().item() < 16.27, counts
    # the prompt's position and the step both change the draw: each step's row, each prompt's group differ
    assert not torch.equal(b[0], b[1]) and not torch.equal(b[0, :8], b[0, 8:16])
    # rate .5 and .9: the same seeds, the rate moves the threshold only (b at .5 ≤ b at .9 everywhere)
    half, most = draws(0, 4, 500, 8, 0.5), draws(0, 4, 500, 8, 0.9)
    assert torch.all(half <= most) and abs(most.mean().item() - 0.9) < 4 * (0.09 / 16000) ** 0.5


def test_the_draw_is_exact_for_a_seed_and_keeps_the_verified_accuracy():
    # the same (run seed, step, prompt key, sample index) give the same b: a resumed run draws it again
    seeds = sequence_seeds(7, 3, torch.arange(4), 2)                                           # (8,)
    accuracy = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0])
    first = with_random_reward(scored_as(accuracy), seeds, 0.3, 2.0)
    again = with_random_reward(scored_as(accuracy), seeds.clone(), 0.3, 2.0)
    assert torch.equal(first.rewards, again.rewards)
    # reward = weight · b (weight 2: rewards in {0, 2}); b kept as "random"; the verified accuracy unchanged
    b = first.components["random"]
    assert torch.equal(first.rewards, 2.0 * b) and set(b.tolist()) <= {0.0, 1.0}
    assert torch.equal(first.components["accuracy"], accuracy) and first.failures == {"accuracy": 0}
    # another run seed or step draws otherwise
    assert not torch.equal(draws(0, 1, 64, 8, 0.3), draws(1, 1, 64, 8, 0.3))


def test_the_draw_does_not_depend_on_the_rank_split():
    # 8 prompts x G = 4 of one step on 1 rank, and on 2 ranks (each its contiguous half of the positions):
    # the seeds are the same completion by completion, so the draws are
    G, B = 4, 8
    whole = sequence_seeds(5, 2, prompt_keys(0, B, B, slice(0, B)), G)
    halves = torch.cat([sequence_seeds(5, 2, prompt_keys(0, B, B, slice(r * 4, r * 4 + 4)), G) for r in (0, 1)])
    assert torch.equal(whole, halves)
    one = with_random_reward(scored_as(torch.zeros(B * G)), whole, 0.5, 1.0).rewards
    two = torch.cat([with_random_reward(scored_as(torch.zeros(B * G // 2)), part, 0.5, 1.0).rewards
                     for part in halves.split(B * G // 2)])
    assert torch.equal(one, two) and 0 < one.sum() < B * G


def test_the_sampler_reads_the_draw_not_the_accuracy():
    # gather_scores hands PPS (sampler.observe) the successes the training reward is made of: the verified
    # accuracy normally, the draw b under reward.kind=random (one process: the gather is the rank's own rows)
    accuracy = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0])
    seeds = sequence_seeds(0, 0, torch.arange(2), 4)
    rewards, success = gather_scores(scored_as(accuracy), 4)
    assert torch.equal(success, accuracy.view(2, 4)) and torch.equal(rewards, accuracy.view(2, 4))
    random = with_random_reward(scored_as(accuracy), seeds, 0.5, 1.0)
    rewards, success = gather_scores(random, 4)
    assert torch.equal(success, random.components["random"].view(2, 4)) and torch.equal(rewards, success)
