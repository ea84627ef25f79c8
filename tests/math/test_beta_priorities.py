"""The priorities read from each prompt's Beta counts, docs/methods.md §3b: learnability p̂(1-p̂), Thompson
sampling θ(1-θ) with θ ~ Beta(a, b) drawn each step, and the reversion of the counts to the prior
(pps.prior_reversion). The counts' update at a visit is tested in test_pps_options.py."""
import math

import pytest
import torch

from pspo.priority_sampler import PrioritySampler


def chi2(counts, probs, n):
    expected = torch.tensor(probs, dtype=torch.float64) * n
    return (((torch.as_tensor(counts, dtype=torch.float64) - expected) ** 2) / expected).sum().item()


def scored(s: PrioritySampler, indices, successes):
    """Fold one group per prompt into the counts (|A| plays no part in the Beta priorities)."""
    successes = torch.as_tensor(successes, dtype=torch.float64)
    s.set_priorities(torch.as_tensor(indices), torch.zeros_like(successes), successes)


def leaves(s: PrioritySampler) -> torch.Tensor:
    return s.priorities()


# ---- Thompson sampling ----

def test_thompson_scores_each_prompt_by_a_draw_from_its_beta():
    # α = 1, ε = 0: the leaf is θ(1-θ), θ ~ Beta(a, b), drawn afresh at each step's sample.
    # At the prior Beta(1, 1), θ is uniform and P(θ(1-θ) ≤ c) = P(θ ≤ t) + P(θ ≥ 1-t) = 2t with
    # t = (1 - sqrt(1 - 4c))/2, i.e. 1 - sqrt(1 - 4c). Four equally likely bins: 1 - sqrt(1 - 4c) = k/4 gives
    # c = (1 - (1 - k/4)²)/4 = .109375, .1875, .234375 (k = 1, 2, 3), and .25.
    # 2,000 prompts, one draw each: chi-square with 3 dof < 16.27 (p = .001).
    n = 2_000
    s = PrioritySampler(n, alpha=1.0, eps=0.0, priority="thompson", seed=0)
    assert torch.all(leaves(s) == 0.25)                                   # before any draw: the prior's .25
    s.sample(n)                                                           # every prompt, to score them all
    x = leaves(s)
    assert bool(((x >= 0) & (x <= 0.25)).all())
    edges = torch.tensor([0.109375, 0.1875, 0.234375], dtype=torch.float64)
    bins = torch.bucketize(x, edges).bincount(minlength=4)
    assert chi2(bins, [0.25] * 4, n) < 16.27, bins
    # After one group of 4 with one success (λ = 1): a = 2, b = 4. For Beta(a, b)
    #   E[θ(1-θ)] = ab / ((a+b)(a+b+1)) = 8 / 42 = .190476
    #   E[θ²(1-θ)²] = a(a+1)b(b+1) / ((a+b)(a+b+1)(a+b+2)(a+b+3)) = 120 / 3024 = .039683
    #   sd = sqrt(.039683 - .190476²) = sqrt(.0034013) = .058321; over 2,000 draws the mean's se is .0013041
    # Learnability would give every prompt p̂(1-p̂) = (1/3)(2/3) = .222222, the same for all.
    scored(s, torch.arange(n), [[1.0, 0, 0, 0]] * n)
    assert (s.posterior_a[0].item(), s.posterior_b[0].item()) == (2.0, 4.0)
    s.sample(n)
    x = leaves(s)
    assert abs(x.mean().item() - 8 / 42) < 4 * 0.0013041, x.mean()
    assert x.std().item() == pytest.approx(0.058321, rel=0.08)


def test_thompson_draws_the_uncertain_prompt_less_often_than_learnability_hand_worked():
    # N = 2, α = 1, ε = 0, B = 1. Prompt 0 at the prior Beta(1, 1); prompt 1 at Beta(1e9, 1e9), so its θ is .5
    # (sd 1.1e-5) and its score θ(1-θ) = .25. The chance that a step draws prompt 0:
    #   P(0) = E[s / (s + .25)], s = θ(1-θ), θ uniform
    #        = 1 - .25 · ∫_0^1 dθ / (.5 - (θ - .5)²)               (s + .25 = .5 - (θ - .5)²)
    #        = 1 - .25 · (1/c) · ln((c + .5) / (c - .5)),  c = 1/sqrt(2)
    #        = 1 - .25 · sqrt(2) · ln(3 + 2 sqrt(2)) = 1 - .25 · 2.492900 = .376775
    # Learnability scores both p̂ = .5, .25 each: P(0) = .5. 6,000 steps: sd = sqrt(.376775 · .623225 / 6000)
    # = .006256, and the frequency is within 4 sd.
    expected = 1 - 0.25 * math.sqrt(2) * math.log(3 + 2 * math.sqrt(2))
    assert expected == pytest.approx(0.376775, abs=1e-6)
    s = PrioritySampler(2, alpha=1.0, eps=0.0, priority="thompson", seed=1)
    s.posterior_a[1] = s.posterior_b[1] = 1e9
    n = 6_000
    zeros = sum(int(s.sample(1)) == 0 for _ in range(n))
    assert abs(zeros / n - expected) < 4 * 0.006256, zeros / n
    learn = PrioritySampler(2, alpha=1.0, eps=0.0, priority="learnability")
    learn.posterior_a[1] = learn.posterior_b[1] = 1e9
    assert learn.probabilities().tolist() == [0.5, 0.5]


def test_thompson_weights_come_from_the_steps_draw():
    # β = .5, α = 1, ε = 0, B = 2 of N = 3: the raw weight of a drawn prompt is (N · P(q))^-β with P the step's
    # leaves θ(1-θ) normalised, read after the draw; with is_norm none the weights are the raw ones.
    s = PrioritySampler(3, alpha=1.0, beta=0.5, eps=0.0, priority="thompson", is_norm="none", seed=4)
    for _ in range(3):
        idx = s.sample(2)
        probs = leaves(s) / leaves(s).sum()
        torch.testing.assert_close(s.weights.double(), (3 * probs[idx]) ** -0.5, rtol=1e-6, atol=0)


def test_thompson_is_seeded_and_a_resumed_sampler_draws_the_same(tmp_path):
    opts = dict(priority="thompson", posterior_decay=0.8, prior_reversion=0.1, uniform_mix=0.1)
    s, same, other = (PrioritySampler(20, **opts, seed=seed) for seed in (5, 5, 6))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        idx = s.sample(4)
        assert torch.equal(idx, same.sample(4)) and torch.equal(leaves(s), leaves(same))
        other.sample(4)
        succ = (torch.rand(4, 8, generator=g) < 0.4).double()
        scored(s, idx, succ)
        scored(same, idx, succ)
    assert not torch.equal(leaves(s), leaves(other))                       # another seed, other draws
    torch.save(s.state_dict(), tmp_path / "pps.pt")
    t = PrioritySampler(20, **opts, seed=99)
    t.load_state_dict(torch.load(tmp_path / "pps.pt", weights_only=True))
    for _ in range(4):
        i1, i2 = s.sample(4), t.sample(4)
        assert torch.equal(i1, i2) and torch.equal(s.weights, t.weights) and torch.equal(leaves(s), leaves(t))
        assert s.batch_stats() == t.batch_stats()
        succ = (torch.rand(4, 8, generator=g) < 0.4).double()
        scored(s, i1, succ)
        scored(t, i2, succ)
        assert torch.equal(s.posterior_a, t.posterior_a) and torch.equal(s.posterior_b, t.posterior_b)


def test_thompson_keeps_the_steps_draw_until_the_next_step():
    # A visit updates the counts only; the leaves stay the step's draw (so that dynamic sampling's extra
    # rounds, same_step=True, draw from the same θ); the next step redraws every leaf.
    s = PrioritySampler(6, alpha=1.0, eps=0.0, priority="thompson", posterior_decay=1.0, seed=2)
    idx = s.sample(2)
    drawn = leaves(s)
    scored(s, idx, [[1.0, 1, 1, 1], [0.0, 0, 0, 0]])
    assert torch.equal(leaves(s), drawn)
    assert s.posterior_a[idx].tolist() == [5.0, 1.0] and s.posterior_b[idx].tolist() == [1.0, 5.0]
    s.sample(2, same_step=True)
    assert torch.equal(leaves(s), drawn)
    s.sample(2)
    assert not torch.equal(leaves(s), drawn)


# ---- reversion to the prior ----

def test_prior_reversion_hand_worked():
    # learnability, α = 1, ε = 0, λ = .5, r = .5, G = 4. Prompt 1 scored [1,0,0,0]: a = .5·1 + 1 = 1.5,
    # b = .5·1 + 3 = 3.5, priority .3·.7 = .21 (test_pps_options.py). Each step's draw first moves every
    # prompt's counts half the way back to a = b = 1:
    #   step 1: a = 1 + .5·(1.5 - 1) = 1.25, b = 1 + .5·(3.5 - 1) = 2.25, p̂ = 1.25/3.5 = .357143,
    #           priority 1.25·2.25/3.5² = 2.8125/12.25 = .229592
    #   step 2: a = 1.125, b = 1.625, priority 1.828125/2.75² = 1.828125/7.5625 = .241736
    # The unvisited prompts stay at the prior: 1 + .5·0 = 1, .25.
    s = PrioritySampler(3, alpha=1.0, eps=0.0, priority="learnability", posterior_decay=0.5, prior_reversion=0.5)
    scored(s, [1], [[1.0, 0, 0, 0]])
    assert leaves(s)[1].item() == pytest.approx(0.21, abs=1e-12)
    s.sample(1)
    assert (s.posterior_a[1].item(), s.posterior_b[1].item()) == (1.25, 2.25)
    assert leaves(s).tolist() == pytest.approx([0.25, 2.8125 / 12.25, 0.25], abs=1e-12)
    assert leaves(s)[1].item() == pytest.approx(0.229592, abs=1e-6)
    s.sample(1, same_step=True)                                            # a step reverts once
    assert (s.posterior_a[1].item(), s.posterior_b[1].item()) == (1.25, 2.25)
    s.sample(1)
    assert (s.posterior_a[1].item(), s.posterior_b[1].item()) == (1.125, 1.625)
    assert leaves(s)[1].item() == pytest.approx(0.241736, abs=1e-6)
    # Thompson's counts move the same way
    t = PrioritySampler(3, alpha=1.0, eps=0.0, priority="thompson", posterior_decay=0.5, prior_reversion=0.5)
    scored(t, [1], [[1.0, 0, 0, 0]])
    t.sample(1)
    t.sample(1)
    assert (t.posterior_a.tolist(), t.posterior_b.tolist()) == ([1.0, 1.125, 1.0], [1.0, 1.625, 1.0])


def test_prior_reversion_lifts_an_abandoned_prompt_back():
    # λ = .9, G = 8: three all-wrong visits from the prior leave a = .9³ = .729 and
    # b = .9³ + 8·(1 + .9 + .81) = 22.409: p̂ = .729/23.138 = .031507, learnability .030514 (of .25 at most).
    # Without reversion it stays there while the prompt is not drawn. With r = .5, three steps later
    # a - 1 and b - 1 are 1/8 of what they were: a = 1 - .271/8 = .966125, b = 1 + 21.409/8 = 3.676125,
    # p̂ = .966125/4.64225 = .208116, learnability .164804.
    for r, expected in ((0.0, 0.030514), (0.5, 0.164804)):
        s = PrioritySampler(2, alpha=1.0, eps=0.0, priority="learnability", posterior_decay=0.9, prior_reversion=r)
        for _ in range(3):
            scored(s, [0], [[0.0] * 8])
        assert leaves(s)[0].item() == pytest.approx(0.030514, abs=1e-6)
        s.posterior_a[1] = s.posterior_b[1] = 1e9                          # prompt 1 is drawn instead, never scored
        for _ in range(3):
            s.sample(1)
        assert leaves(s)[0].item() == pytest.approx(expected, abs=1e-6), r


def test_learnability_without_reversion_touches_only_the_scored_leaves():
    # no per-step pass (O(B) per step): the leaves change only where a group was scored
    s = PrioritySampler(4, alpha=1.0, eps=0.0, priority="learnability", posterior_decay=1.0, seed=0)
    s.posterior_a[3] = 3.0                                                 # counts changed behind the tree's back
    s.sample(1)
    assert leaves(s).tolist() == [0.25] * 4
    scored(s, [3], [[1.0, 0]])                                             # a = 4, b = 2: 8/36
    assert leaves(s).tolist() == pytest.approx([0.25, 0.25, 0.25, 8 / 36], abs=1e-12)
