"""The advantage methods through their one interface (pspo/methods.py): what each hands the update
after the calls the loop makes around it, with hand-worked numbers, and the one dispatch on
algo.advantage. Runs without a model: with one iteration, β = 0 and no KL reward, no log-prob needs
scoring."""
import pytest
import torch

from pspo.training.config import ADVANTAGES, load_config
from pspo.training.distributed import Dist
from pspo.methods import Context, MethodState, StepRollouts, group_baseline, method_for, score_first, training_batch
from pspo.rewards import RewardResult
from pspo.training.tokens import Rollout
from pspo.training.micro_batches import token_rows
from pspo.loss import sequence_weights

CPU = Dist(0, 1, torch.device("cpu"))
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])        # (N, T) 4 completions: 3, 2, 1, 3 tokens


def step_and_context(advantage: str, rewards: torch.Tensor, is_weights: torch.Tensor):
    """B = 2 prompts x G = 2 completions on one rank."""
    cfg = load_config("configs/grpo.yaml", [f"--algo.advantage={advantage}", "--rollout.num_generations=2",
                                            "--train.prompts_per_step=2", "--algo.beta=0",
                                            f"--algo.scale_rewards={advantage != 'rloo'}"])     # RLOO's own
    rollout = Rollout(torch.tensor([[4, 5, 6], [4, 6, 0], [7, 0, 0], [4, 4, 4]]), MASK, torch.zeros(4, 3),
                      torch.tensor([True, False, False, True]), ["a", "b", "c", "d"], 0.0)
    flat = rewards.reshape(-1)
    scored = RewardResult(flat, {"accuracy": flat, "format": torch.zeros(4)}, {"accuracy": 0})
    train_ids, rows = [[1, 2], [3]], [0, 0, 1, 1]
    inputs = token_rows([train_ids[i] for i in rows], rollout.completion_ids, MASK, 0, CPU.device)
    rollouts = StepRollouts(step=0, indices=torch.tensor([0, 1]), rows=rows, seeds=torch.arange(4),
                            rollout=rollout, scored=scored, rewards=rewards, is_weights=is_weights, inputs=inputs)
    ctx = Context(cfg=cfg, policy=None, ref=None, engine=None, train_ids=train_ids, problems=["p0", "p1"],
                  dist=CPU, mine=slice(0, 2), lockstep=False, score=None, distinct_problems=2,
                  state=MethodState())
    return cfg, rollouts, ctx


def step_through(method, rollouts, ctx):
    """The loop's calls around a method (train.py): what it reads first, its group's statistics (or ERS's),
    the method, the update's batch. Returns the method's output and the batch."""
    rollouts.old_logp, rollouts.ref_logp = score_first(method, rollouts, ctx)
    rollouts.baseline = group_baseline(method, rollouts, ctx)
    out = method.estimate(rollouts, ctx)
    return out, training_batch(out, rollouts, ctx)[0]


def test_grpo_hands_a_times_w_on_every_token():
    # group [1, 0]: μ = .5, sample std sqrt(.5) = .70711 -> A = ±.5/(.70711 + 1e-4) = ±.70700;
    # group [1, 1]: no spread -> 0. IS weights 1 and .5 per prompt: A·w = [.70700, -.70700, 0, 0],
    # broadcast over each completion's 3 columns; the loss mask is the completion mask.
    rewards, w = torch.tensor([[1.0, 0], [1, 1]]), torch.tensor([[1.0, 1], [.5, .5]])
    cfg, rollouts, ctx = step_and_context("grpo", rewards, w)
    out, batch = step_through(method_for(cfg, ctx.train_ids, 0, CPU, False), rollouts, ctx)
    want = torch.tensor([0.70700, -0.70700, 0, 0])[:, None].expand(4, 3)
    torch.testing.assert_close(batch.advantages, want, atol=1e-5, rtol=0)
    assert torch.equal(batch.loss_mask, MASK) and batch.old_logp is None and batch.ref_logp is None
    # prompts [1, 2] then [3], left-padded with 0, then the completion tokens
    assert batch.input_ids[0].tolist() == [1, 2, 4, 5, 6] and batch.input_ids[2].tolist() == [0, 3, 7, 0, 0]
    assert batch.attention_mask[2].tolist() == [0, 1, 1, 0, 0]
    # statistics before the IS weight: Σ|A| = 1.414, ΣA² = 2·.49985 = .99970, over 4 completions; 1 flat group
    sums, rollout = out.stats.advantages, out.stats.rollout
    assert sums.adv_abs == pytest.approx(1.41400, abs=1e-4) and sums.adv_count == 4
    assert sums.adv_sq == pytest.approx(0.99970, abs=1e-4) and int(rollout.zero_std_groups) == 1
    assert rollout.completion_tokens == 9 and int(rollout.truncated) == 2


def test_dr_grpo_does_not_divide_by_the_std():
    # Dr. GRPO: A = r - μ: group [1, 0] -> ±.5
    rewards = torch.tensor([[1.0, 0], [1, 1]])
    cfg, rollouts, ctx = step_and_context("grpo", rewards, torch.ones(2, 2))
    cfg.algo.scale_rewards = False
    _, batch = step_through(method_for(cfg, ctx.train_ids, 0, CPU, False), rollouts, ctx)
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([0.5, -0.5, 0, 0]), atol=1e-6, rtol=0)


def test_reinforce_pp_whitens_tokens_then_applies_w():
    # no KL: G_t = R on every valid token: 7 tokens of 1 (rows 0, 2, 3) and 2 of 0 (row 1).
    # mean 7/9 = .77778; Bessel var = (7·.22222² + 2·.77778²)/8 = .19444, std .44096:
    # A(1) = .22222/.44096 = .50395, A(0) = -.77778/.44096 = -1.76383. Prompt 1's w = .5 halves rows 2-3.
    rewards, w = torch.tensor([[1.0, 0], [1, 1]]), torch.tensor([[1.0, 1], [.5, .5]])
    cfg, rollouts, ctx = step_and_context("reinforce_pp", rewards, w)
    out, batch = step_through(method_for(cfg, ctx.train_ids, 0, CPU, False), rollouts, ctx)
    a, b = 0.50395, -1.76383
    want = torch.tensor([[a, a, a], [b, b, 0], [a / 2, 0, 0], [a / 2, a / 2, a / 2]])
    torch.testing.assert_close(batch.advantages, want, atol=1e-4, rtol=0)
    sums = out.stats.advantages
    assert sums.adv_count == 9 and sums.adv_sq == pytest.approx(8.0, abs=1e-4)   # Σ A² = n - 1


def test_reinforce_pp_baseline_subtracts_the_group_mean():
    # group [1, 0] -> [.5, -.5]; group [1, 1] -> [0, 0]: tokens .5 x3, -.5 x2, 0 x4; mean 1.5-1 = .5/9 = .05556
    # Σ(x - m)² = 3·.44444² + 2·.55556² + 4·.05556² = .59259 + .61728 + .01235 = 1.22222;
    # var /8 = .15278, std .39087
    # A(.5) = .44444/.39087 = 1.13706, A(-.5) = -1.42134, A(0) = -.14213
    rewards = torch.tensor([[1.0, 0], [1, 1]])
    cfg, rollouts, ctx = step_and_context("reinforce_pp_baseline", rewards, torch.ones(2, 2))
    _, batch = step_through(method_for(cfg, ctx.train_ids, 0, CPU, False), rollouts, ctx)
    p, n, z = 1.13706, -1.42134, -0.14213
    want = torch.tensor([[p, p, p], [n, n, 0], [z, 0, 0], [z, z, z]])
    torch.testing.assert_close(batch.advantages, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("advantage", ADVANTAGES)
def test_every_configured_name_has_its_method(advantage):
    over = [f"--algo.advantage={advantage}", "--algo.beta=0", f"--algo.scale_rewards={advantage != 'rloo'}"]
    if advantage == "spo_tree":
        over += ["--rollout.num_generations=6", "--spo.segment_tokens=3"]
    cfg = load_config("configs/grpo.yaml", over)
    method = method_for(cfg, [[1]], 0, CPU, False)
    assert method.name == advantage and method.estimate.__name__ == advantage
    # the step's generation budget: SPO-tree generates the trees' first level, M0 tokens
    assert method.max_new_tokens == (3 if advantage == "spo_tree" else cfg.rollout.max_new_tokens)
    assert (method.state.tree is not None) == (advantage == "spo_tree") and method.state.ers is None
    assert (method.state.single_stream is not None) == (advantage == "single_stream")
    # SPO generates in its method (the engine is released after it); SPO-chain's cuts read π_old first, and
    # Single-stream PO's tracker stores it (its KL-adaptive decay, the default single_stream.rho)
    assert method.generates == advantage.startswith("spo_")
    assert method.reads_old == (advantage in ("spo_chain", "single_stream"))
    # the methods whose baseline is their group read its statistics (ERS may smooth them)
    assert method.reads_group == (advantage in ("grpo", "rloo", "maxrl", "reinforce_pp_baseline"))


def test_rloo_is_r_minus_the_mean_of_the_other_completions():
    # RLOO (docs/methods.md §1), G = 2: the other completion is the whole leave-one-out baseline.
    # group [1, 0]: A = [1 - 0, 0 - 1] = [1, -1] (= G/(G-1)·(r - μ) = 2·(±.5)); group [1, 1]: [0, 0].
    # IS weights 1 and .5 per prompt: A·w = [1, -1, 0, 0], broadcast over each completion's 3 columns.
    rewards, w = torch.tensor([[1.0, 0], [1, 1]]), torch.tensor([[1.0, 1], [.5, .5]])
    cfg, rollouts, ctx = step_and_context("rloo", rewards, w)
    out, batch = step_through(method_for(cfg, ctx.train_ids, 0, CPU, False), rollouts, ctx)
    torch.testing.assert_close(batch.advantages, torch.tensor([1.0, -1, 0, 0])[:, None].expand(4, 3), atol=1e-6,
                               rtol=0)
    assert torch.equal(batch.loss_mask, MASK) and batch.old_logp is None
    # per completion before the IS weights: Σ|A| = 2, ΣA² = 2 over 4 completions
    sums = out.stats.advantages
    assert (sums.adv_abs, sums.adv_sq, sums.adv_count) == pytest.approx((2.0, 2.0, 4.0))


def test_maxrl_divides_by_the_group_mean_whatever_scale_rewards():
    # MaxRL (docs/methods.md §1), G = 2: group [1, 0]: μ = .5, A = ±.5/(.5 + 1e-4) = ±.99980; group [1, 1]: 0.
    # IS weights 1 and .5 per prompt: A·w = [.99980, -.99980, 0, 0] on every column. The std never enters:
    # algo.scale_rewards true or false, the same batch (it only sets PPS's priority).
    rewards, w = torch.tensor([[1.0, 0], [1, 1]]), torch.tensor([[1.0, 1], [.5, .5]])
    batches = []
    for scale in (True, False):
        cfg, rollouts, ctx = step_and_context("maxrl", rewards, w)
        cfg.algo.scale_rewards = scale
        out, batch = step_through(method_for(cfg, ctx.train_ids, 0, CPU, False), rollouts, ctx)
        batches.append(batch.advantages)
    torch.testing.assert_close(batches[0], torch.tensor([0.99980, -0.99980, 0, 0])[:, None].expand(4, 3),
                               atol=1e-5, rtol=0)
    assert torch.equal(batches[0], batches[1]) and torch.equal(batch.loss_mask, MASK)
    sums = out.stats.advantages                                        # before the IS weights: Σ|A|, ΣA², count
    assert (sums.adv_abs, sums.adv_sq, sums.adv_count) == pytest.approx((1.99960, 1.99920, 4.0), abs=1e-4)


def test_overlong_filtering_takes_truncated_completions_out_of_the_loss():
    # DAPO's overlong filtering (docs/methods.md §9): completions 0 and 3 hit max_new_tokens (truncated).
    # GRPO on [[1, 0], [1, 1]]: completion 0's reward still sets its group's μ = .5, so completion 1 keeps
    # A = -.70700; only the loss mask changes: rows 0 and 3 zeroed, 2 of 4 completions filtered.
    rewards = torch.tensor([[1.0, 0], [1, 1]])
    cfg, rollouts, ctx = step_and_context("grpo", rewards, torch.ones(2, 2))
    cfg.algo.overlong_filter = True
    method = method_for(cfg, ctx.train_ids, 0, CPU, False)
    rollouts.old_logp, rollouts.ref_logp = score_first(method, rollouts, ctx)
    rollouts.baseline = group_baseline(method, rollouts, ctx)
    batch, metrics = training_batch(method.estimate(rollouts, ctx), rollouts, ctx)
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([0.70700, -0.70700, 0, 0]), atol=1e-5, rtol=0)
    assert batch.loss_mask.tolist() == [[0, 0, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]]
    assert metrics["overlong_filtered_frac"] == 0.5
    # token_mean then averages over the 2 + 1 tokens left: w = 1/3 on every row
    weights = sequence_weights(batch.loss_mask, "token_mean", 4, int(batch.loss_mask.sum()), 3)
    torch.testing.assert_close(weights, torch.full((4,), 1 / 3))


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_overlong_filtering_is_the_same_step_for_every_method(advantage):
    # the one place it happens (training_batch): the batch without the filter, with rows 0 and 3's loss mask
    # zeroed and nothing else changed
    rewards, w = torch.tensor([[1.0, 0], [0, 1]]), torch.tensor([[1.0, 1], [.5, .5]])
    batches = []
    for on in (False, True):
        cfg, rollouts, ctx = step_and_context(advantage, rewards, w)
        cfg.algo.overlong_filter = on
        batches.append(step_through(method_for(cfg, ctx.train_ids, 0, CPU, False), rollouts, ctx)[1])
    plain, filtered = batches
    assert torch.equal(filtered.advantages, plain.advantages)
    assert torch.equal(filtered.loss_mask, plain.loss_mask * torch.tensor([0.0, 1, 1, 0])[:, None])
    assert filtered.loss_mask[1:3].sum() == 3 and filtered.loss_mask[[0, 3]].sum() == 0


def two_ers_visits(advantage: str, scale: bool):
    """ERS (α = .5) over `advantage`: the batches of two steps on prompts p0, p1, rewards p0 [1, 0] then
    [1, 1], p1 [1, 1] both times; IS weights 1. Returns the two steps' batches.

    p0, visit 1: m = μ = .5, v = s² = .5 (first visit: the group's own statistics).
    p0, visit 2 (μ2 = 1, s2² = 0): m = .5·1 + .5·.5 = .75; v = .5·0 + .5·.5 + .5·.5·(1 - .5)² = .3125
    (docs/methods.md §2, the mixture variance), sqrt(v) = .55902. p1: m = 1, v = 0 on both visits."""
    cfg, rollouts, ctx = step_and_context(advantage, torch.tensor([[1.0, 0], [1, 1]]), torch.ones(2, 2))
    cfg.ers.enabled, cfg.ers.alpha, cfg.algo.scale_rewards = True, 0.5, scale
    method = method_for(cfg, ctx.train_ids, 0, CPU, False)
    ctx.state = method.state
    first = step_through(method, rollouts, ctx)[1]
    assert rollouts.baseline.metrics["ers_visits"] == 1 and rollouts.baseline.metrics["ers_seen_frac"] == 1.0
    rollouts.rewards = torch.tensor([[1.0, 1], [1, 1]])
    second = step_through(method, rollouts, ctx)[1]
    assert rollouts.baseline.metrics["ers_visits"] == 2
    torch.testing.assert_close(rollouts.baseline.mean, torch.tensor([0.75, 1.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rollouts.baseline.std, torch.tensor([0.55902, 0.0]), atol=1e-5, rtol=0)
    return first, second


def test_grpo_with_ers_smooths_the_second_visit():
    # visit 1 as GRPO: ±.5/(.70711 + 1e-4) = ±.70700; visit 2: A = (1 - .75)/(.55902 + 1e-4) = .44713 for both
    # completions of p0 (plain GRPO: 0, the group is all-equal); p1: (1 - 1)/(0 + 1e-4) = 0.
    first, second = two_ers_visits("grpo", scale=True)
    torch.testing.assert_close(first.advantages[:, 0], torch.tensor([0.70700, -0.70700, 0, 0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(second.advantages[:, 0], torch.tensor([0.44713, 0.44713, 0, 0]), atol=1e-4, rtol=0)


def test_dr_grpo_with_ers_centres_on_the_smoothed_mean():
    # Dr. GRPO: visit 1 ±.5; visit 2: A = 1 - m = 1 - .75 = .25 for both completions of p0
    first, second = two_ers_visits("grpo", scale=False)
    torch.testing.assert_close(first.advantages[:, 0], torch.tensor([0.5, -0.5, 0, 0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(second.advantages[:, 0], torch.tensor([0.25, 0.25, 0, 0]), atol=1e-6, rtol=0)


def test_rloo_with_ers_takes_the_leave_one_out_mean_of_a_group_of_mean_m():
    # RLOO under ERS (docs/methods.md §2): A_i = G/(G-1)·(r_i - m), i.e. the baseline of completion i is
    # (G·m - r_i)/(G-1), the mean of the other G - 1 in a group whose mean were m.
    # visit 1 (m = μ): RLOO's own, 2·(±.5) = ±1 (= r_i - r_j). Visit 2, p0: baseline (2·.75 - 1)/1 = .5,
    # A = 1 - .5 = .5 = 2·(1 - .75) for both. p1: 0.
    first, second = two_ers_visits("rloo", scale=False)
    torch.testing.assert_close(first.advantages[:, 0], torch.tensor([1.0, -1.0, 0, 0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(second.advantages[:, 0], torch.tensor([0.5, 0.5, 0, 0]), atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_with_ers_subtracts_the_smoothed_mean():
    # REINFORCE++-baseline under ERS: R_i - m_q, then the return and the token whitening (no std to replace).
    # Visit 1 = the plain method (test_reinforce_pp_baseline_subtracts_the_group_mean): 1.13706, -1.42134, -.14213.
    # Visit 2: p0 R - m = 1 - .75 = .25 on rows 0-1 (3 + 2 tokens), p1 1 - 1 = 0 on rows 2-3 (1 + 3 tokens);
    # mean 1.25/9 = .13889, deviations .11111 x5 and -.13889 x4, Σd² = .06173 + .07716 = .13889,
    # Bessel var .13889/8 = .017361, std .13176: A(.25) = .11111/.13176 = .84327, A(0) = -.13889/.13176 = -1.05409.
    # (Plain REINFORCE++-baseline gives 0 on every token at visit 2: both groups are all-equal.)
    first, second = two_ers_visits("reinforce_pp_baseline", scale=True)
    p, n, z = 1.13706, -1.42134, -0.14213
    torch.testing.assert_close(first.advantages, torch.tensor([[p, p, p], [n, n, 0], [z, 0, 0], [z, z, z]]),
                               atol=1e-4, rtol=0)
    a, b = 0.84327, -1.05409
    torch.testing.assert_close(second.advantages, torch.tensor([[a, a, a], [a, a, 0], [b, 0, 0], [b, b, b]]),
                               atol=1e-4, rtol=0)


def test_maxrl_with_ers_divides_by_the_smoothed_mean():
    # visit 1 as MaxRL: ±.5/(.5 + 1e-4) = ±.99980; visit 2: A = (1 - .75)/(.75 + 1e-4) = .33329 for both completions
    # of p0 (plain MaxRL: 0, the group is all-equal); p1: (1 - 1)/(1 + 1e-4) = 0.
    first, second = two_ers_visits("maxrl", scale=True)
    torch.testing.assert_close(first.advantages[:, 0], torch.tensor([0.99980, -0.99980, 0, 0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(second.advantages[:, 0], torch.tensor([0.33329, 0.33329, 0, 0]), atol=1e-5, rtol=0)


def test_pspo_with_ers_and_pps_on_at_once():
    # PSPO = ERS advantages + PPS (docs/methods.md §4): the update trains on ERS's smoothed A, while the
    # PPS priority is set from the RAW GRPO |A| of the current group, not from the smoothed one.
    # α_ERS = .5, α_PPS = .6, ε_p = 1e-6; prompts p0, p1 of 3 (N = 3, B = 2, G = 2).
    # Visit 1, rewards p0 [1, 0], p1 [1, 1]: ERS = GRPO here, A(p0) = ±.5/(.70711 + 1e-4) = ±.70700, A(p1) = 0.
    #   priorities: p0 = (.70700 + 1e-6)^.6 = exp(.6 ln .70700) = .81218; p1 = (0 + 1e-6)^.6 = 10^-3.6 = 2.5119e-4;
    #   the unseen p2 keeps the running max, which starts at 1.0 and .81218 does not raise.
    # Visit 2, rewards p0 [1, 1]: ERS gives A = .44713 for both (test_grpo_with_ers_smooths_the_second_visit),
    #   but the raw GRPO group is all-equal: |A| = 0, so p0's priority drops to 2.5119e-4 (not .44713^.6 = .61693).
    from pspo.sampler import build_sampler
    cfg, rollouts, ctx = step_and_context("grpo", torch.tensor([[1.0, 0], [1, 1]]), torch.ones(2, 2))
    cfg.ers.enabled, cfg.ers.alpha = True, 0.5
    cfg.pps.enabled, cfg.pps.alpha, cfg.pps.eps = True, 0.6, 1e-6
    sampler = build_sampler(cfg, ["p0", "p1", "p2"], "test")
    method = method_for(cfg, ctx.train_ids, 0, CPU, False)
    ctx.state = method.state
    first = step_through(method, rollouts, ctx)[0]
    sampler.observe(rollouts.indices, rollouts.rewards, rollouts.rewards)
    torch.testing.assert_close(first.advantages[:2, 0], torch.tensor([0.70700, -0.70700]), atol=1e-4, rtol=0)
    torch.testing.assert_close(sampler.priorities(), torch.tensor([0.81218, 2.5119e-4, 1.0], dtype=torch.float64),
                               atol=1e-5, rtol=1e-4)
    rollouts.rewards = torch.tensor([[1.0, 1], [1, 1]])
    second = step_through(method, rollouts, ctx)[0]
    sampler.observe(rollouts.indices, rollouts.rewards, rollouts.rewards)
    torch.testing.assert_close(second.advantages[:2, 0], torch.tensor([0.44713, 0.44713]), atol=1e-4, rtol=0)
    assert float(sampler.priorities()[0]) == pytest.approx(2.5119e-4, rel=1e-4)
