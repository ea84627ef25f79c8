"""Single-stream PO (docs/methods.md §10) by hand-worked numbers: the advantage normalised over the batch, the
KL-adaptive decay, the offline prior, the drift D, the tracker's visits through the method's interface (a stand-in
policy whose log-probs are known), its state's round trip, and the sampler's single_stream priority."""
import json

import pytest
import torch
from conftest import LinearLogprobs

from pspo.estimators import single_stream_advantages
from pspo.methods import Context, MethodState, StepRollouts, method_for, score_first, training_batch
from pspo.priority_sampler import PrioritySampler
from pspo.related.single_stream import ValueTracker, drift, kl_rho, offline_prior, prior_counts
from pspo.rewards import RewardResult
from pspo.training.checkpoint import state_digest
from pspo.training.config import ConfigError, load_config
from pspo.training.distributed import Dist
from pspo.training.micro_batches import token_rows
from pspo.training.tokens import Rollout

CPU = Dist(0, 1, torch.device("cpu"))


def test_single_stream_advantages_hand_worked():
    # r = [1, 0, 1, 0] (G = 1), v̂ = [.5, .5, .25, .75]: A = r - v̂ = [.5, -.5, .75, -.75], mean 0,
    # sample std sqrt((.25 + .25 + .5625 + .5625)/3) = sqrt(.541667) = .735980 -> ±.679366, ±1.019049
    adv = single_stream_advantages(torch.tensor([[1.0], [0], [1], [0]]), torch.tensor([.5, .5, .25, .75]))
    torch.testing.assert_close(adv, torch.tensor([[.679366], [-.679366], [1.019049], [-1.019049]]), atol=1e-6, rtol=0)
    # G = 2: every completion of the batch enters the one mean and std. r = [[1, 0], [1, 1]], v̂ = [.5, .75]:
    # A = [.5, -.5, .25, .25], mean .125, centred [.375, -.625, .125, .125], std sqrt(.5625/3) = .433013
    adv = single_stream_advantages(torch.tensor([[1.0, 0], [1, 1]]), torch.tensor([.5, .75]))
    torch.testing.assert_close(adv, torch.tensor([[.866025, -1.443376], [.288675, .288675]]), atol=1e-6, rtol=0)
    # one completion in all has no spread: 0, not NaN; an all-equal batch: 0 as well
    assert single_stream_advantages(torch.tensor([[1.0]]), torch.tensor([.3])).tolist() == [[0.0]]
    assert single_stream_advantages(torch.ones(3, 1), torch.full((3,), .5)).abs().max() == 0


def test_kl_rho_hand_worked():
    # ρ = clip(2^(-D/.06), .875, .96): D = 0 -> 1 -> .96 (ρ_max); D = .005 -> 2^(-1/12) = .943874 (inside);
    # D = .01 -> 2^(-1/6) = .890899 (inside); D = .03 -> 2^(-1/2) = .707107 -> .875 (ρ_min)
    rho = kl_rho(torch.tensor([0.0, .005, .01, .03]), 0.06, 0.875, 0.96)
    torch.testing.assert_close(rho, torch.tensor([.96, .943874, .890899, .875], dtype=torch.float64), atol=1e-6, rtol=0)
    # D = D_half halves it
    assert kl_rho(torch.tensor([0.06]), 0.06, 0.1, 1.0).item() == pytest.approx(0.5)


def test_prior_counts_hand_worked():
    # ρ_min = .875: N_init = 1/(1 - .875) = 8. s = 3 of n = 8: α0 = 8·3.5/9 = 3.111111, β0 = 8·5.5/9 = 4.888889
    # (v̂0 = 3.5/9 = .388889, worth 8 visits); 8 of 8: 8·8.5/9 = 7.555556 and 8·.5/9 = .444444; n = 0: .5, .5
    alpha, beta = prior_counts(torch.tensor([3.0, 8, 0]), torch.tensor([8.0, 8, 0]), 0.875)
    torch.testing.assert_close(alpha, torch.tensor([3.111111, 7.555556, 0.5], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(beta, torch.tensor([4.888889, 0.444444, 0.5], dtype=torch.float64), atol=1e-6, rtol=0)


def test_offline_prior_reads_the_recipes_file(tmp_path):
    # {problem: [offline rewards]}: a reward > 0 is a success, the first N_eff = 3 count, keys match stripped;
    # "a": [1, 0, .5, 1] -> s = 2 of n = 3 -> 8·2.5/4 = 5, 8·1.5/4 = 3; " b ": [0] -> 0 of 1 -> 8·.5/2 = 2,
    # 8·1.5/2 = 6; "c" is absent -> .5, .5
    path = tmp_path / "prior.json"
    path.write_text(json.dumps({"a": [1, 0, 0.5, 1], " b ": [0]}))
    alpha, beta = offline_prior(str(path), ["a", "b", "c"], samples=3, rho_min=0.875)
    assert alpha.tolist() == [5.0, 2.0, 0.5] and beta.tolist() == [3.0, 6.0, 0.5]
    for text in ("{not json", json.dumps(["a"]), json.dumps({"a": ["x"]})):
        path.write_text(text)
        with pytest.raises(ConfigError, match="^single_stream.prior_file: ") as e:
            offline_prior(str(path), ["a"], samples=3, rho_min=0.875)
        assert "\n" not in str(e.value)


def test_drift_hand_worked():
    # row 0: |-1 - -1.1| = .1 and |-2 - -1.9| = .1 over its 2 tokens (the third is padding, whatever it holds):
    # D = .1; row 1: no token -> 0
    then = torch.tensor([[-1.0, -2.0, 5.0], [0.0, 0.0, 0.0]])
    now = torch.tensor([[-1.1, -1.9, float("-inf")], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(drift(then, now, mask), torch.tensor([0.1, 0.0], dtype=torch.float64), atol=1e-6, rtol=0)




# 3 prompts x G = 1: completions [2, 2, 2], [6], [3, 3] (mean token ids 2, 6, 3)
TRAIN_IDS = [[1, 2], [3], [4]]
COMPLETIONS = torch.tensor([[2, 2, 2], [6, 0, 0], [3, 3, 0]])
MASK = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0]])


def single_stream_step(cfg, state, policy, rewards, step):
    """The loop's calls around the method (train.py) for B = 3 prompts [0, 1, 2] of G = 1 on one rank."""
    rollout = Rollout(COMPLETIONS, MASK, torch.zeros(3, 3), torch.zeros(3, dtype=torch.bool), ["a", "b", "c"], 0.0)
    flat = rewards.reshape(-1)
    scored = RewardResult(flat, {"accuracy": flat, "format": torch.zeros(3)}, {"accuracy": 0})
    inputs = token_rows(TRAIN_IDS, COMPLETIONS, MASK, 0, CPU.device)
    s = StepRollouts(step=step, indices=torch.tensor([0, 1, 2]), rows=[0, 1, 2], seeds=torch.arange(3),
                     rollout=rollout, scored=scored, rewards=rewards, is_weights=torch.ones(3, 1), inputs=inputs)
    ctx = Context(cfg=cfg, policy=policy, ref=None, engine=None, train_ids=TRAIN_IDS, problems=["p0", "p1", "p2"],
                  dist=CPU, mine=slice(0, 3), lockstep=False, score=None, distinct_problems=3, state=state)
    method = method_for(cfg, TRAIN_IDS, 0, CPU, False)          # the method reads its state from ctx
    s.old_logp, s.ref_logp = score_first(method, s, ctx)
    out = method.estimate(s, ctx)
    return out, training_batch(out, s, ctx)[0]


def single_stream_config(*over):
    return load_config("configs/single_stream.yaml", ["--train.prompts_per_step=3", "--pps.replacement=false",
                                                      "--single_stream.rho_min=0.5", *over])


def test_the_tracker_through_the_method_over_two_visits_hand_worked():
    # ρ_min = .5 (so that no drift below is clipped), ρ_max = .96, D_half = .06, prior .5, .5: v̂ = .5.
    # Step 1 (policy scale .1), r = [1, 0, 1]: A = r - .5 = [.5, -.5, .5], mean .166667, centred
    #   [.333333, -.666667, .333333], std sqrt(.666667/2) = .577350 -> [.577350, -1.154701, .577350].
    #   First visits: D = 0, ρ = .96: α = .96·.5 + r, β = .96·.5 + 1 - r -> (1.48, .48), (.48, 1.48), (1.48, .48),
    #   v̂ = 1.48/1.96 = .755102, .244898, .755102. Each completion is stored with π_then = π_old = -.1·t.
    # Step 2 (scale .105: every log-prob moves by .005·t), r = [0, 1, 1]: D = .005 x the mean token id
    #   [2, 6, 3] = [.01, .03, .015] -> ρ = 2^(-1/6), 2^(-1/2), 2^(-1/4) = .890899, .707107, .840896.
    #   A = r - v̂(before) = [-.755102, .755102, .244898], mean .081633, centred [-.836735, .673469, .163265],
    #   std sqrt(1.180342/2) = .768226 -> [-1.089178, .876656, .212523].
    #   α = ρα + r: .890899·1.48 = 1.318530, .707107·.48 + 1 = 1.339411, .840896·1.48 + 1 = 2.244527;
    #   β = ρβ + 1 - r: .890899·.48 + 1 = 1.427631, .707107·1.48 = 1.046518, .840896·.48 = .403630
    cfg = single_stream_config()
    state = MethodState(single_stream=method_for(cfg, TRAIN_IDS, 0, CPU, False).state.single_stream)
    out, batch = single_stream_step(cfg, state, LinearLogprobs(0.1), torch.tensor([[1.0], [0], [1]]), step=0)
    torch.testing.assert_close(batch.advantages, torch.tensor([.577350, -1.154701, .577350])[:, None].expand(3, 3),
                               atol=1e-5, rtol=0)
    assert torch.equal(batch.loss_mask, MASK)
    tracker = state.single_stream
    torch.testing.assert_close(tracker.alpha, torch.tensor([1.48, .48, 1.48], dtype=torch.float64))
    torch.testing.assert_close(tracker.beta, torch.tensor([.48, 1.48, .48], dtype=torch.float64))
    assert out.metrics["single_stream_rho"] == pytest.approx(0.96) and out.metrics["single_stream_value"] == 0.5
    assert out.metrics["single_stream_revisit_frac"] == 0.0
    # π_then of prompt 1 (one token, 6): -.6; the update's batch keeps π_old (the method read it)
    ids, then = tracker.last[1]
    assert ids.tolist() == [6] and then.tolist() == pytest.approx([-0.6])
    torch.testing.assert_close(batch.old_logp, -0.1 * COMPLETIONS.float() * MASK)
    saved = tracker.state_dict()

    out, batch = single_stream_step(cfg, state, LinearLogprobs(0.105), torch.tensor([[0.0], [1], [1]]), step=1)
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([-1.089178, .876656, .212523]), atol=1e-5, rtol=0)
    torch.testing.assert_close(tracker.alpha, torch.tensor([1.318530, 1.339411, 2.244527], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(tracker.beta, torch.tensor([1.427631, 1.046518, .403630], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    # the logged drift is the mean D of the revisited prompts: (.01 + .03 + .015)/3 = .018333; ρ's mean .812967
    assert out.metrics["single_stream_drift"] == pytest.approx(0.0183333, abs=1e-6)
    assert out.metrics["single_stream_rho"] == pytest.approx((0.890899 + 0.707107 + 0.840896) / 3, abs=1e-6)
    assert out.metrics["single_stream_revisit_frac"] == 1.0 and tracker.visits.tolist() == [2, 2, 2]

    # the state's round trip: a tracker loaded from step 1's state continues exactly as the original did
    fresh = MethodState(single_stream=method_for(cfg, TRAIN_IDS, 0, CPU, False).state.single_stream)
    fresh.load_state_dict({"single_stream": saved})
    assert state_digest(fresh.single_stream.state_dict()) == state_digest(saved)
    single_stream_step(cfg, fresh, LinearLogprobs(0.105), torch.tensor([[0.0], [1], [1]]), step=1)
    assert state_digest(fresh.single_stream.state_dict()) == state_digest(tracker.state_dict())
    with pytest.raises(ValueError, match="checkpoint sampler has 3 prompts, the dataset has 2"):
        ValueTracker(cfg, TRAIN_IDS[:2], 0, CPU).load_state_dict(saved)


def test_the_tracker_clips_rho_and_folds_a_prompt_drawn_twice_in_batch_order():
    # the default ρ_min = .875 clips step 2's ρ of prompts 1 and 2 (.707107, .840896) up to .875; prompt 0 keeps
    # .890899 (the steps of the test above).
    cfg = single_stream_config("--single_stream.rho_min=0.875")
    state = MethodState(single_stream=method_for(cfg, TRAIN_IDS, 0, CPU, False).state.single_stream)
    single_stream_step(cfg, state, LinearLogprobs(0.1), torch.tensor([[1.0], [0], [1]]), step=0)
    out, _ = single_stream_step(cfg, state, LinearLogprobs(0.105), torch.tensor([[0.0], [1], [1]]), step=1)
    assert out.metrics["single_stream_rho"] == pytest.approx((0.890899 + 0.875 + 0.875) / 3, abs=1e-6)
    constant = single_stream_config("--single_stream.rho=constant", "--single_stream.rho_value=0.5")
    method = method_for(constant, TRAIN_IDS, 0, CPU, False)
    assert not method.reads_old                                   # nothing to score: no π_old read first
    single_stream_step(constant, method.state, None, torch.tensor([[1.0], [0], [1]]), step=0)
    single_stream_step(constant, method.state, None, torch.tensor([[0.0], [1], [1]]), step=1)
    # a constant ρ = .5 scores nothing and stores nothing; prompt 0: α = .5·.5 + 1 = 1.25, then .5·1.25 + 0 = .625
    assert method.state.single_stream.alpha[0].item() == pytest.approx(0.625) and not method.state.single_stream.last
    # a prompt twice in one batch (draws with replacement): both visits use v̂ before the step, and are folded in
    # batch order with the same ρ, r = 1 then 0: α = .5·(.5·.5 + 1) + 0 = .625, β = .5·(.5·.5 + 0) + 1 = 1.125
    tracker = ValueTracker(constant, TRAIN_IDS, 0, CPU)
    rollout = Rollout(COMPLETIONS[:2], MASK[:2], torch.zeros(2, 3), torch.zeros(2, dtype=torch.bool), ["a", "b"], 0)
    tracker.visit(None, indices=torch.tensor([0, 0]), mine=slice(0, 2), rewards=torch.tensor([[1.0], [0]]),
                  rollout=rollout, old_logp=None)
    assert (tracker.alpha[0].item(), tracker.beta[0].item(), tracker.visits[0].item()) == (0.625, 1.125, 2)


def test_sampler_single_stream_priority_hand_worked():
    # pps.priority single_stream: the posterior's Beta counts (a = b = 1 at the start), p = (sqrt(p̂(1-p̂)) + ε)^α.
    # α = 1, ε = .05, λ = .5, G = 1. Unseen: p̂ = .5 -> .5 + .05 = .55, the largest possible.
    # Visit 1, success: a = .5 + 1 = 1.5, b = .5, p̂ = .75 -> sqrt(.1875) + .05 = .483013
    # Visit 2, failure: a = .75, b = .25 + 1 = 1.25, p̂ = .375 -> sqrt(.234375) + .05 = .534123
    s = PrioritySampler(2, alpha=1.0, eps=0.05, priority="single_stream", posterior_decay=0.5)
    assert s.priorities().tolist() == pytest.approx([0.55, 0.55])
    s.set_priorities(torch.tensor([1]), torch.zeros(1, 1), torch.tensor([[1.0]]))
    assert s.priorities()[1].item() == pytest.approx(0.483013, abs=1e-6)
    s.set_priorities(torch.tensor([1]), torch.zeros(1, 1), torch.tensor([[0.0]]))
    assert (s.posterior_a[1].item(), s.posterior_b[1].item()) == (0.75, 1.25)
    assert s.priorities()[1].item() == pytest.approx(0.534123, abs=1e-6)
    # observe hands it the accuracy; with β = 0 every importance weight is 1 (the recipe applies none)
    t = PrioritySampler(4, alpha=1.0, eps=0.05, beta=0.0, priority="single_stream", posterior_decay=0.5, seed=0)
    drawn = t.sample(2)
    weights = t.observe(drawn, torch.tensor([[1.0], [0.0]]), torch.tensor([[1.0], [0.0]]))
    assert weights.tolist() == [[1.0], [1.0]]
    assert sorted(t.priorities()[drawn].tolist()) == pytest.approx([0.483013, 0.483013], abs=1e-6)
