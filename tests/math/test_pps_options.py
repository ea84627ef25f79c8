"""PPS options of docs/methods.md §3b: uniform_mix, priority=learnability, skip (PrioritySampler), and
their state in checkpoints."""
import pytest
import torch

from pspo.priority_sampler import PrioritySampler
from pspo.released_sampler import ReleasedSampler


def rows(*means, G=4):
    """abs_advantages rows whose mean is each given value. (B, G)"""
    return torch.tensor(means, dtype=torch.float64)[:, None].repeat(1, G)


def chi2(counts, probs, n):
    expected = torch.tensor(probs, dtype=torch.float64) * n
    return (((torch.as_tensor(counts, dtype=torch.float64) - expected) ** 2) / expected).sum().item()


# ---- uniform_mix ----

def test_uniform_mix_probabilities_and_weights_hand_worked():
    # α=1, ε=0: priorities [1,2,3,4], Σp = 10, P = [.1,.2,.3,.4]; u = .2, N = 4:
    #   P' = .8·P + .2/4 = [.13, .21, .29, .37]
    #   drawn as p + c with c = u·Σp / ((1-u)·N) = .2·10 / (.8·4) = .625:
    #   [1.625, 2.625, 3.625, 4.625] / 12.5 = [.13, .21, .29, .37]  (the same)
    # β=.5: N·P' = [.52, .84, 1.16, 1.48] -> (N·P')^-.5 = [1.38675, 1.09109, .92848, .82199]
    #   batch_max (all 4 drawn): / 1.38675 = [1, .78680, .66953, .59275]
    # without the mix the same priorities give [1, .70711, .57735, .5] (test_priority_sampler.py)
    s = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0, uniform_mix=0.2)
    s.set_priorities(torch.arange(4), rows(1, 2, 3, 4))
    assert s._mix_constant() == pytest.approx(0.625, abs=1e-12)
    torch.testing.assert_close(s.probabilities(), torch.tensor([.13, .21, .29, .37], dtype=torch.float64))
    idx = s.sample(4)
    w = s.weights
    assert sorted(idx.tolist()) == [0, 1, 2, 3]
    torch.testing.assert_close(w, torch.tensor([1, .78680, .66953, .59275])[idx], atol=1e-5, rtol=0)
    st = s.batch_stats()
    assert st["is_max"] == pytest.approx(1.38675, abs=1e-5) and st["is_min"] == pytest.approx(.82199, abs=1e-5)
    # update returns the last sample's weights, one per completion (B, G): each group shares its prompt's
    out = s.set_priorities(idx, rows(1, 2, 3, 4))
    assert out.shape == (4, 4) and torch.equal(out, w[:, None].expand(4, 4))
    # is_norm=none keeps the raw (N·P')^-β
    n = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0, uniform_mix=0.2, is_norm="none")
    n.set_priorities(torch.arange(4), rows(1, 2, 3, 4))
    idx = n.sample(4)
    w = n.weights
    torch.testing.assert_close(w, torch.tensor([1.38675, 1.09109, .92848, .82199])[idx], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"pps.uniform_mix: expected a value in \[0, 1\), got 1"):
        PrioritySampler(4, uniform_mix=1.0)


def test_uniform_mix_draws_follow_p_plus_c_chi_square():
    # α=1, ε=0: priorities [0, 1, 3] (prompt 0's group had |A| = 0: without the mix it is never
    # drawn), Σp = 4, u = .25, N = 3: c = .25·4 / (.75·3) = 4/9, so in ninths p + c = [4, 13, 31], Σ 48:
    #   first draw P' = [4, 13, 31]/48 = [.08333, .27083, .64583]   (= .75·P + .25/3)
    # B = 2, successive sampling over p + c:
    #   {0,1}: (4/48)(13/44) + (13/48)(4/35) = .024621 + .030952 = .055574
    #   {0,2}: (4/48)(31/44) + (31/48)(4/17) = .058712 + .151961 = .210673
    #   {1,2}: (13/48)(31/35) + (31/48)(13/17) = .239881 + .493873 = .733754
    # 6,000 samples; chi-square 2 dof < 13.82 (p = .001).
    s = PrioritySampler(3, alpha=1.0, eps=0.0, uniform_mix=0.25, seed=0)
    s.set_priorities(torch.arange(3), rows(0.0, 1.0, 3.0))
    assert s.priorities().tolist() == [0.0, 1.0, 3.0]
    n = 6_000
    pairs, firsts = torch.zeros(3), torch.zeros(3)
    for _ in range(n):
        idx = s.sample(2)
        pairs[int(idx.sum()) - 1] += 1                   # {0,1} -> 0, {0,2} -> 1, {1,2} -> 2
        firsts[int(idx[0])] += 1
    assert chi2(firsts, [4 / 48, 13 / 48, 31 / 48], n) < 13.82, firsts
    assert chi2(pairs, [.055574, .210673, .733754], n) < 13.82, pairs
    # without the mix prompt 0 would never come: the pair {1,2} every time
    plain = PrioritySampler(3, alpha=1.0, eps=0.0, seed=0)
    plain.set_priorities(torch.arange(3), rows(0.0, 1.0, 3.0))
    assert all(sorted(plain.sample(2).tolist()) == [1, 2] for _ in range(50))


# ---- priority = learnability ----

def test_learnability_update_over_two_visits_hand_worked():
    # α=1, ε=0, λ=.5, G=4. Start a = b = 1 (p̂ = .5): every prompt's priority is .5·.5 = .25.
    # Visit 1, successes [1,0,0,0]: a = .5·1 + 1 = 1.5, b = .5·1 + 3 = 3.5, p̂ = 1.5/5 = .3,
    #   priority p̂(1-p̂) = .3·.7 = .21
    # Visit 2, successes [1,1,1,1]: a = .5·1.5 + 4 = 4.75, b = .5·3.5 + 0 = 1.75, p̂ = 4.75/6.5 = .730769,
    #   priority 4.75·1.75 / 6.5² = 8.3125/42.25 = .196746   (an all-correct group: not abandoned)
    s = PrioritySampler(3, alpha=1.0, eps=0.0, priority="learnability", posterior_decay=0.5)
    assert s.priorities().tolist() == [0.25, 0.25, 0.25]
    s.set_priorities(torch.tensor([1]), torch.tensor([[.75, .25, .25, .25]]), torch.tensor([[1., 0, 0, 0]]))
    assert (s.posterior_a[1].item(), s.posterior_b[1].item()) == (1.5, 3.5)
    assert s.priorities()[1].item() == pytest.approx(0.21, abs=1e-12)
    s.set_priorities(torch.tensor([1]), torch.zeros(1, 4), torch.ones(1, 4))
    assert (s.posterior_a[1].item(), s.posterior_b[1].item()) == (4.75, 1.75)
    assert s.priorities()[1].item() == pytest.approx(0.196746, abs=1e-6)
    # the others are untouched: counts 1, 1 and the prior's .25 (the running max, never exceeded)
    assert s.priorities()[[0, 2]].tolist() == [0.25, 0.25] and s.posterior_a[[0, 2]].tolist() == [1.0, 1.0]
    # α = .6, ε = 1e-6 shape it as (p̂(1-p̂) + ε)^α: visit 1 -> (.21 + 1e-6)^.6 = .392042, prior .435276
    t = PrioritySampler(2, priority="learnability", posterior_decay=0.5)
    assert t.priorities()[1].item() == pytest.approx(0.435276, abs=1e-6)
    t.set_priorities(torch.tensor([0]), torch.zeros(1, 4), torch.tensor([[1., 0, 0, 0]]))
    assert t.priorities()[0].item() == pytest.approx(0.392042, abs=1e-6)
    # successes are clamped to [0, 1], and the Beta counts need them
    u = PrioritySampler(1, alpha=1.0, eps=0.0, priority="learnability", posterior_decay=1.0)
    u.set_priorities(torch.tensor([0]), torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]))     # -> [1, 0]
    assert (u.posterior_a[0].item(), u.posterior_b[0].item()) == (2.0, 2.0)
    with pytest.raises(ValueError, match="set_priorities needs the completions' successes"):
        u.set_priorities(torch.tensor([0]), torch.zeros(1, 2))


def test_learnability_priorities_drive_the_draws_chi_square():
    # α=1, ε=0, λ=1, G=4. Prompt 0 scored [1,0,0,0]: a=2, b=4, p̂=1/3, p̂(1-p̂) = 2/9 = 8/36;
    # prompt 1 scored [1,1,1,1]: a=5, b=1, p̂=5/6, 5/36; prompt 2 unseen: the prior's 1/4 = 9/36.
    # P = [8, 5, 9]/22 = [.36364, .22727, .40909]. 6,000 first draws; chi-square 2 dof < 13.82.
    s = PrioritySampler(3, alpha=1.0, eps=0.0, priority="learnability", posterior_decay=1.0, seed=0)
    s.set_priorities(torch.tensor([0, 1]), torch.tensor([[.75, .25, .25, .25], [0., 0, 0, 0]]),
             torch.tensor([[1., 0, 0, 0], [1., 1, 1, 1]]))
    torch.testing.assert_close(s.probabilities(), torch.tensor([8 / 22, 5 / 22, 9 / 22], dtype=torch.float64))
    n = 6_000
    firsts = torch.zeros(3)
    for _ in range(n):
        firsts[int(s.sample(1))] += 1
    assert chi2(firsts, [8 / 22, 5 / 22, 9 / 22], n) < 13.82, firsts
    # mean_abs on the same groups would starve prompt 1 (|A| = 0): the draws differ
    assert chi2(firsts, [.5, 0.0001, .4999], n) > 1000


# ---- skip ----

def test_zero_variance_streak_counts_and_resets():
    # zero_streak: consecutive groups with every |A| = 0; any non-zero |A| resets it to 0.
    s = PrioritySampler(3, alpha=1.0, eps=0.0)
    assert s.zero_streak.tolist() == [0, 0, 0]
    s.set_priorities(torch.tensor([0, 1]), torch.tensor([[0., 0, 0, 0], [0., 1, 0, 1]]))
    assert s.zero_streak.tolist() == [1, 0, 0]
    s.set_priorities(torch.tensor([0, 1]), torch.zeros(2, 4))
    assert s.zero_streak.tolist() == [2, 1, 0]
    s.set_priorities(torch.tensor([1, 0]), torch.tensor([[0., 0, 0, 0], [0., .5, 0, 0]]))   # one non-zero |A|: mixed
    assert s.zero_streak.tolist() == [0, 2, 0]
    # learnability counts the streak from |A| too, not from the successes
    p = PrioritySampler(2, priority="learnability")
    p.set_priorities(torch.tensor([0, 1]), torch.tensor([[0., 0], [.5, .5]]), torch.tensor([[1., 1], [1., 0]]))
    assert p.zero_streak.tolist() == [1, 0]


def test_skip_keeps_a_streak_prompt_with_probability_rho_k_chi_square():
    # N=2, equal priorities, B=1, ρ=.5. Prompt 0 has streak 1 (kept with probability .5), prompt 1 none.
    #   first draw 0 (.5): kept (.5) -> 0, skipped 0     .25
    #                      skipped (.5) -> round 2 draws 1, kept -> 1, skipped 1   .25
    #   first draw 1 (.5): kept -> 1, skipped 0          .5
    # outcomes (index, skipped): (0,0) .25, (1,1) .25, (1,0) .5. 8,000 samples; 2 dof < 13.82.
    s = PrioritySampler(2, skip=True, skip_rho=0.5, skip_min=0.01, seed=0)
    s.zero_streak[0] = 1                                 # as after one zero-variance group
    n = 8_000
    counts = {(0, 0): 0, (1, 1): 0, (1, 0): 0}
    for _ in range(n):
        idx = s.sample(1)
        counts[(int(idx[0]), int(s.batch_stats()["skipped"]))] += 1
    assert chi2(list(counts.values()), [.25, .25, .5], n) < 13.82, counts
    # without skip, the same streak changes nothing: prompt 0 half the time
    plain = PrioritySampler(2, seed=0)
    plain.zero_streak[0] = 1
    zeros = sum(int(plain.sample(1)[0]) == 0 for _ in range(2_000))
    assert abs(zeros / 2_000 - 0.5) < 0.05 and plain.batch_stats()["skipped"] == 0


def test_skip_with_every_prompt_on_a_streak_chi_square():
    # N=2, equal priorities, B=1, ρ=.5: prompt 0 streak 1 (kept .5), prompt 1 streak 2 (kept .25).
    # If both are drawn and skipped, the skipped ones are taken back in draw order: the first one.
    #   draw 0 (.5): kept .5 -> (0, skipped 0)                                   .25
    #                skipped .5 -> draw 1: kept .25 -> (1, skipped 1)            .0625
    #                                      skipped .75 -> take back 0: (0, 1)    .1875
    #   draw 1 (.5): kept .25 -> (1, 0)                                          .125
    #                skipped .75 -> draw 0: kept .5 -> (0, 1)                    .1875
    #                                       skipped .5 -> take back 1: (1, 1)   .1875
    # (0,0) .25, (0,1) .375, (1,0) .125, (1,1) .25. 8,000 samples; 3 dof < 16.27 (p = .001).
    s = PrioritySampler(2, skip=True, skip_rho=0.5, skip_min=0.01, seed=1)
    s.zero_streak[:] = torch.tensor([1, 2])
    n = 8_000
    counts = {(0, 0): 0, (0, 1): 0, (1, 0): 0, (1, 1): 0}
    for _ in range(n):
        idx = s.sample(1)
        counts[(int(idx[0]), int(s.batch_stats()["skipped"]))] += 1
    assert chi2(list(counts.values()), [.25, .375, .125, .25], n) < 16.27, counts
    # s_min floors the keep probability: streak 10 at ρ=.5 would be kept 1/1024 of the time, s_min=.5 keeps half
    f = PrioritySampler(2, skip=True, skip_rho=0.5, skip_min=0.5, seed=2)
    f.zero_streak[0] = 10
    zeros = sum(int(f.sample(1)[0]) == 0 for _ in range(4_000))        # P(0) = .5·.5 = .25
    assert abs(zeros / 4_000 - 0.25) < 0.03


def test_skip_counts_the_skipped_prompts():
    # N=4, B=3, prompt 3 on a long streak with keep probability max(ρ^3, s_min) = max(1e-9, 1e-6):
    # it is skipped whenever drawn, so the batch is always {0,1,2}, and skipped = 1 exactly when
    # prompt 3 was drawn before the batch filled: 1 - P(3 is the last of the 4 in successive
    # sampling) = 1 - 1/4 = .75. 4,000 samples: within 4 standard deviations (.0068 each).
    s = PrioritySampler(4, skip=True, skip_rho=1e-3, skip_min=1e-6, seed=0)
    s.zero_streak[3] = 3
    n, hits = 4_000, 0
    for _ in range(n):
        idx = s.sample(3)
        assert sorted(idx.tolist()) == [0, 1, 2]
        st = s.batch_stats()
        assert st["skipped"] in (0.0, 1.0)
        hits += int(st["skipped"])
        # repeat_frac counts only repeated raw draws: every draw was either kept or skipped here or a repeat
        assert 0 <= st["repeat_frac"] < 1
    assert abs(hits / n - 0.75) < 4 * 0.0068


@pytest.mark.parametrize("mix", [0.0, 0.1])
def test_skip_takes_the_skipped_back_when_the_prompts_run_out(mix):
    # Every prompt on a streak with keep probability 1e-12: all 5 are drawn and skipped, then the
    # first 3 skipped come back, so sample(3) still returns 3 distinct prompts and 2 are counted
    # as skipped. The trees (priorities and live counts) are restored afterwards.
    s = PrioritySampler(5, alpha=1.0, eps=0.0, skip=True, skip_rho=1e-3, skip_min=1e-12, uniform_mix=mix, seed=0)
    s.set_priorities(torch.arange(5), rows(1, 2, 3, 4, 5))
    s.zero_streak[:] = 5
    tree, count = s.tree.clone(), s.count.clone()
    for _ in range(30):
        idx = s.sample(3)
        w = s.weights
        assert len(set(idx.tolist())) == 3 and all(0 <= i < 5 for i in idx.tolist())
        assert s.batch_stats()["skipped"] == 2
        assert torch.equal(s.tree, tree) and torch.equal(s.count, count)
        assert w.max().item() == 1.0 and bool((w > 0).all())
    # one prompt without a streak is always in the batch, the rest come from the taken-back skips
    s.zero_streak[4] = 0
    for _ in range(30):
        idx = s.sample(3)
        assert 4 in idx.tolist() and len(set(idx.tolist())) == 3
        assert s.batch_stats()["skipped"] == 2                             # 4 skipped, 2 of them taken back
    # too few drawable prompts even with the skipped ones back: an error, trees restored
    z = PrioritySampler(3, alpha=1.0, eps=0.0, skip=True, skip_rho=1e-3, skip_min=1e-12)
    z.set_priorities(torch.arange(3), rows(1.0, 0.0, 0.0))
    z.zero_streak[:] = 5
    before = z.tree.clone()
    with pytest.raises(ValueError, match="2 distinct prompts asked, but only 1 have a priority above 0"):
        z.sample(2)
    assert torch.equal(z.tree, before)



# ---- replacement ----

def test_replacement_draws_iid_pairs_chi_square():
    # α=1, ε=0: priorities [1,2,3], P = [1/6, 2/6, 3/6]; B = 2 independent draws, so a batch is the
    # multiset {i, j} with probability P_i² (i = j) or 2·P_i·P_j:
    #   {0,0} 1/36 = .027778   {0,1} 4/36 = .111111   {0,2} 6/36 = .166667
    #   {1,1} 4/36 = .111111   {1,2} 12/36 = .333333  {2,2} 9/36 = .25
    # (the default draw never repeats a prompt: chi-square on 5 degrees of freedom, 99.9% point 20.5)
    s = PrioritySampler(3, alpha=1.0, eps=0.0, seed=0, replacement=True)
    s.set_priorities(torch.arange(3), rows(1, 2, 3))
    pairs = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2)]
    counts = dict.fromkeys(pairs, 0)
    for _ in range(6000):
        counts[tuple(sorted(s.sample(2).tolist()))] += 1
    assert chi2([counts[k] for k in pairs], [1 / 36, 4 / 36, 6 / 36, 4 / 36, 12 / 36, 9 / 36], 6000) < 20.5
    assert counts[(2, 2)] > 1000                                           # duplicates are kept, ~1500
    assert s.batch_stats()["repeat_frac"] in (0.0, 0.5)                    # one repeat of 2 draws, or none


def test_replacement_makes_the_weighted_mean_unbiased_hand_worked():
    # β = 1, is_norm none: w = (N·P)^-1, so mean over the batch of w·f estimates the uniform mean of f.
    # P = [1/6, 2/6, 3/6], N = 3, f = [1, 10, 100]: the uniform mean is 111/3 = 37.
    # With replacement each slot is q with probability P_q: E = Σ P_q · f_q / (N·P_q) = Σ f_q / N = 37.
    # Without replacement (B = 2), q is in the batch with π_q, P(i then j) = P_i·P_j / (1 - P_i):
    #   π_0 = 1/6 + (2/6)(1/6)/(4/6) + (3/6)(1/6)/(3/6) = .166667 + .083333 + .166667 = .416667
    #   π_1 = 2/6 + (1/6)(2/6)/(5/6) + (3/6)(2/6)/(3/6) = .333333 + .066667 + .333333 = .733333
    #   π_2 = 3/6 + (1/6)(3/6)/(5/6) + (2/6)(3/6)/(4/6) = .5 + .1 + .25 = .85                     (Σ = 2)
    #   E = Σ π_q · f_q / (N·P_q·B) = .416667·1/1 + .733333·10/2 + .85·100/3 = .416667 + 3.666667 + 28.333333
    #     = 32.416667: the single-draw weight undercounts the likeliest prompt (π_2 = .85 < B·P_2 = 1).
    # Per batch the estimate's sd is about 21 (slots: 2, 10, 66.7 with P): over 10,000 batches SE ≈ .21.
    f = torch.tensor([1.0, 10.0, 100.0])
    for replacement, expected in ((True, 37.0), (False, 32.416667)):
        s = PrioritySampler(3, alpha=1.0, beta=1.0, eps=0.0, seed=1, is_norm="none", replacement=replacement)
        s.set_priorities(torch.arange(3), rows(1, 2, 3))
        estimates = torch.empty(10_000)
        for m in range(10_000):
            idx = s.sample(2)
            estimates[m] = (s.weights * f[idx]).mean()
        se = float(estimates.std()) / 100
        assert abs(float(estimates.mean()) - expected) < 4 * se, (replacement, float(estimates.mean()), se)
        assert 0.1 < se < 0.35


def test_a_prompt_drawn_twice_is_scored_in_batch_order():
    # learnability, α=1, ε=0, λ=.5, G=4: prompt 1 twice in one batch, successes [1,0,0,0] then [1,1,1,1],
    # folds like two visits (test_learnability_update_over_two_visits_hand_worked):
    #   a = .5·(.5·1 + 1) + 4 = 4.75, b = .5·(.5·1 + 3) + 0 = 1.75, priority 4.75·1.75/6.5² = .196746
    s = PrioritySampler(3, alpha=1.0, eps=0.0, priority="learnability", posterior_decay=0.5)
    succ = torch.tensor([[1., 0, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]])
    s.set_priorities(torch.tensor([1, 0, 1]), grpo_abs(succ), succ)
    assert (s.posterior_a[1].item(), s.posterior_b[1].item()) == (4.75, 1.75)
    assert s.priorities()[1].item() == pytest.approx(0.196746, abs=1e-6)
    assert (s.posterior_a[0].item(), s.posterior_b[0].item()) == (2.5, 2.5)   # .5·1 + 2 each
    # mean_abs: the later group's priority stays; the streak counts both groups, in order:
    #   prompt 0: zero-variance then mixed -> 0; prompt 2: zero-variance twice -> 2; mixed then zero -> 1
    m = PrioritySampler(4, alpha=1.0, eps=0.0)
    out = m.set_priorities(torch.tensor([1, 0, 2, 1, 0, 2, 3, 3]), rows(0.5, 0, 0, 2, 0.25, 0, 0.5, 0))
    assert m.priorities().tolist() == [0.25, 2.0, 0.0, 0.0]
    assert m.zero_streak.tolist() == [0, 0, 2, 1]
    assert out.shape == (8, 4) and torch.equal(out, torch.ones(8, 4))      # nothing sampled yet: ones
    with pytest.raises(ValueError, match="pps.replacement: false with pps.skip"):
        PrioritySampler(4, replacement=True, skip=True)


# ---- state ----

def grpo_abs(successes):
    """|A| of GRPO without std scaling, from (B, G) 0/1 rewards: zero exactly for zero-variance groups."""
    return (successes - successes.mean(1, keepdim=True)).abs()


def test_state_round_trip_with_the_new_options(tmp_path):
    opts = dict(priority="learnability", posterior_decay=0.7, uniform_mix=0.1, skip=True, skip_rho=0.3)
    s = PrioritySampler(12, **opts, seed=3)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        idx = s.sample(5)
        succ = (torch.rand(5, 4, generator=g) < 0.5).double()
        succ[step % 5] = 0.0                                               # a zero-variance group each step
        s.set_priorities(idx, grpo_abs(succ), succ)
    assert int(s.zero_streak.max()) >= 1 and not torch.all(s.posterior_a == 1)
    torch.save(s.state_dict(), tmp_path / "pps.pt")
    t = PrioritySampler(12, **opts, seed=99)
    t.load_state_dict(torch.load(tmp_path / "pps.pt", weights_only=True))
    for key in ("posterior_a", "posterior_b", "zero_streak", "seen"):
        assert torch.equal(getattr(t, key), getattr(s, key)), key
    for step in range(5):
        i1, i2 = s.sample(5), t.sample(5)
        w1, w2 = s.weights, t.weights
        assert torch.equal(i1, i2) and torch.equal(w1, w2)
        assert s.batch_stats() == t.batch_stats()
        succ = (torch.rand(5, 4, generator=g) < 0.3).double()
        u1, u2 = s.set_priorities(i1, grpo_abs(succ), succ), t.set_priorities(i2, grpo_abs(succ), succ)
        assert torch.equal(u1, u2) and torch.equal(s.priorities(), t.priorities())
        assert torch.equal(s.zero_streak, t.zero_streak)


def test_paper_and_released_states_refuse_each_other():
    paper, released = PrioritySampler(5), ReleasedSampler(5)
    with pytest.raises(ValueError, match="trained with pps.mode=released; resume with the same mode"):
        paper.load_state_dict(ReleasedSampler(5).state_dict())
    with pytest.raises(ValueError, match="trained with pps.mode=paper; resume with the same mode"):
        released.load_state_dict(PrioritySampler(5).state_dict())
    with pytest.raises(ValueError, match="checkpoint sampler has 4 prompts, the dataset has 5"):
        released.load_state_dict(ReleasedSampler(4).state_dict())
