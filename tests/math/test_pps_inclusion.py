"""The inclusion probability of PPS's batch draw (docs/methods.md §3, Departures), and bench/pps_inclusion.py's
fast draw of it, against the sampler's own code and a hand-worked case."""
import importlib.util
import os

import pytest
import torch

from pspo.priority_sampler import PrioritySampler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("pps_inclusion", os.path.join(ROOT, "bench", "pps_inclusion.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# P = [.1, .2, .3, .4], B = 2, successive sampling: P(i then j) = P_i · P_j / (1 - P_i), so
#   π_0 = .1 + .2·.1/.8 + .3·.1/.7 + .4·.1/.6 = .1 + .025 + .042857 + .066667 = .234524
#   π_1 = .2 + .1·.2/.9 + .3·.2/.7 + .4·.2/.6 = .2 + .022222 + .085714 + .133333 = .441270
#   π_2 = .3 + .1·.3/.9 + .2·.3/.8 + .4·.3/.6 = .3 + .033333 + .075 + .2 = .608333
#   π_3 = .4 + .1·.4/.9 + .2·.4/.8 + .3·.4/.7 = .4 + .044444 + .1 + .171429 = .715873      (Σ = 2 = B)
# against B·P = [.2, .4, .6, .8]: the likeliest prompt is included less often than B·P, the others more.
PI = torch.tensor([.234524, .441270, .608333, .715873], dtype=torch.float64)


def hand_sampler() -> PrioritySampler:
    s = PrioritySampler(4, alpha=1.0, beta=0.5, eps=0.0, seed=3)            # α=1, ε=0: P ∝ priorities
    s.set_priorities(torch.arange(4), torch.tensor([1., 2, 3, 4], dtype=torch.float64)[:, None].repeat(1, 4))
    return s


def test_sampler_inclusion_is_successive_sampling_hand_worked():
    # 10,000 batches of the sampler's own code: each π_q within 4 binomial standard errors (≤ .005)
    s = hand_sampler()
    torch.testing.assert_close(s.probabilities(), torch.tensor([.1, .2, .3, .4], dtype=torch.float64))
    idx, _ = bench.code_draws(s, 2, 10_000, seed=0)
    assert all(len(set(row)) == 2 for row in idx.tolist())
    counts = torch.bincount(idx.flatten(), minlength=4).double() / 10_000
    se = (PI * (1 - PI) / 10_000).sqrt()
    assert ((counts - PI).abs() < 4 * se).all(), counts
    # B·P (what the weights assume) is off by .084 for prompt 3, far outside 4 standard errors
    assert abs(float(counts[3]) - .8) > 10 * float(se[3])


def test_race_estimator_matches_the_exact_inclusion():
    # the bench's exponential race, Rao-Blackwellized: unbiased, so 20,000 races land within 4 SE of π
    pi, se = bench.inclusion(torch.tensor([.1, .2, .3, .4], dtype=torch.float64), 2, 20_000, seed=0)
    assert ((pi - PI).abs() < 4 * se + 1e-6).all(), (pi, se)
    assert float(se.max()) < 2e-3                                           # a precise estimate, not luck
    # the races' batches are pairs of distinct prompts with the same pair frequencies:
    #   {0,3}: .1·.4/.9 + .4·.1/.6 = .044444 + .066667 = .111111
    g = torch.Generator().manual_seed(1)
    batches = torch.cat([i for i, _, _ in bench.race_batches(torch.tensor([.1, .2, .3, .4]), 2, 20_000, g)])
    assert (batches[:, 0] != batches[:, 1]).all()
    pair03 = ((batches == 0).any(1) & (batches == 3).any(1)).double().mean()
    assert abs(float(pair03) - .111111) < 4 * (.111111 * .888889 / 20_000) ** 0.5


def test_weight_error_of_one_batch_hand_worked():
    # batch {0, 3}, β = .5, N = 4, B = 2:
    #   the code's   (N·P)^-β   = (.4)^-.5, (1.6)^-.5       = 1.58114, .79057  -> batch_max [1, .5]
    #   from π:  (N·π/B)^-β = (.469048)^-.5, (1.431746)^-.5 = 1.46013, .83573 -> batch_max [1, .57237]
    #   prompt 3's error: .5 / .57237 - 1 = -.12644
    s = hand_sampler()
    raw_code = (4 * s.probabilities()[torch.tensor([[0, 3]])]) ** -0.5
    raw_true = (4 * PI[torch.tensor([[0, 3]])] / 2) ** -0.5
    torch.testing.assert_close(raw_true, torch.tensor([[1.46013, .83573]], dtype=torch.float64), atol=1e-5, rtol=0)
    error = bench.normalise(raw_code, "batch_max") / bench.normalise(raw_true, "batch_max") - 1
    torch.testing.assert_close(error, torch.tensor([[0, -.12644]], dtype=torch.float64), atol=1e-5, rtol=0)
    # mean: code [1.33333, .66667], from π [1.27197, .72803] -> errors +.04825, -.08429
    error = bench.normalise(raw_code, "mean") / bench.normalise(raw_true, "mean") - 1
    torch.testing.assert_close(error, torch.tensor([[.04825, -.08429]], dtype=torch.float64), atol=1e-5, rtol=0)
