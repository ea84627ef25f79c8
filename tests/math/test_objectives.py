"""The policy objectives of docs/methods.md §11 (GSPO, GSPO-token, CISPO, SAPO) beside PPO's clip, with
hand-worked values and gradients; their agreement with PPO's gradient on-policy; the step gradient's
independence of the micro-batch and rank split for every objective and aggregation; their statistics as
logged; their config checks and presets."""
import os

import pytest
import torch

from pspo.loss import AGGREGATIONS, GATED, OBJECTIVES, k3_kl, policy_loss, sequence_weights
from pspo.training.config import ConfigError, load_config
from pspo.training.token_logprobs import token_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPS = dict(eps_low=0.2, eps_high=0.28)                                     # clip range [.8, 1.28]


def _loss(objective, logp, advantages, *, old=None, weights=None, beta=0.0, **settings):
    """policy_loss of one or more sequences with no padding; old_logp 0 (ρ = exp(logp)) unless given; the
    grpo aggregation's weights unless given. Returns (loss, stats, d loss / d logp)."""
    logp = logp.clone().requires_grad_()
    mask = torch.ones_like(logp)
    w = sequence_weights(mask, "grpo", logp.shape[0], int(mask.sum()), logp.shape[1]) if weights is None else weights
    loss, stats = policy_loss(logp, old_logp=torch.zeros_like(logp) if old is None else old, ref_logp=None,
                              advantages=advantages, mask=mask, seq_weights=w, beta=beta, objective=objective,
                              **(EPS | settings))
    loss.backward()
    return loss.item(), stats, logp.grad


# ---------------------------------------------------------------- GSPO and GSPO-token, hand-worked

def test_gspo_one_ratio_per_sequence_hand_worked():
    # one completion of 2 tokens, log ratios [.2, 0], Â = +1, grpo weight 1/(1·2):
    # log s = (.2 + 0)/2 = .1, s = e^.1 = 1.105171 inside [.8, 1.28]: pg = -1.105171 on each token,
    # loss = 2 · 1/2 · -1.105171 = -1.105171 (the sequence's term once); d loss / d logp_t = -Â·s/|o| = -.552585
    # on both tokens. PPO's clip: (1/2)(-e^.2 - e^0) = (-1.221403 - 1)/2 = -1.110701, grads -ρ_t/2 = [-.610701, -.5]
    logp = torch.tensor([[0.2, 0.0]])
    loss, stats, grad = _loss("gspo", logp, torch.tensor([1.0]))
    assert loss == pytest.approx(-1.105171, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.552585, -0.552585]]), atol=1e-6, rtol=0)
    assert stats["clipped_tokens"] == 0 and stats["clipped_seqs"] == 0 and stats["seqs"] == 1
    loss, _, grad = _loss("ppo_clip", logp, torch.tensor([1.0]))
    assert loss == pytest.approx(-1.110701, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.610701, -0.5]]), atol=1e-6, rtol=0)


def test_gspo_clips_the_whole_sequence_hand_worked():
    # log ratios [.8, 0]: s = e^.4 = 1.491825 > 1.28. Â = +1: -min(1.491825, 1.28) = -1.28 on each token, loss
    # -1.28, and no gradient on either token (PPO's clip would still train the second, ρ = 1: -.5); both tokens
    # and the one completion count as clipped. Â = -1: -min(-1.491825, -1.28) = 1.491825, the pessimistic side
    # is never clipped: d/d logp_t = s/|o| = .745912 on each
    logp = torch.tensor([[0.8, 0.0]])
    loss, stats, grad = _loss("gspo", logp, torch.tensor([1.0]))
    assert loss == pytest.approx(-1.28, abs=1e-6) and torch.equal(grad, torch.zeros(1, 2))
    assert (stats["clipped_tokens"], stats["clipped_seqs"], stats["seqs"]) == (2, 1, 1)
    loss, stats, grad = _loss("gspo", logp, torch.tensor([-1.0]))
    assert loss == pytest.approx(1.491825, abs=1e-6) and stats["clipped_tokens"] == 0
    torch.testing.assert_close(grad, torch.tensor([[0.745912, 0.745912]]), atol=1e-6, rtol=0)
    _, _, grad = _loss("ppo_clip", logp, torch.tensor([1.0]))
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5]]), atol=1e-6, rtol=0)


def test_gspo_paper_epsilon_is_per_token_sized():
    # the paper's ε_low 3e-4, ε_high 4e-4: log ratios [.001, 0] give s = e^.0005 = 1.000500 > 1.0004: clipped,
    # loss -1.0004, no gradient; the same change on one token of a 2-token sequence under PPO's clip with these ε
    # clips that token (e^.001 = 1.001) and trains the other: grads [0, -.5]
    paper = dict(eps_low=3e-4, eps_high=4e-4)
    logp = torch.tensor([[0.001, 0.0]])
    loss, stats, grad = _loss("gspo", logp, torch.tensor([1.0]), **paper)
    assert loss == pytest.approx(-1.0004, abs=1e-6) and torch.equal(grad, torch.zeros(1, 2))
    _, _, grad = _loss("ppo_clip", logp, torch.tensor([1.0]), **paper)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5]]), atol=1e-6, rtol=0)


def test_gspo_token_lets_per_token_advantages_through_hand_worked():
    # log ratios [.2, 0], Â_it = [+1, -1]: s_it has the value s = e^.1 = 1.105171 on both (inside the range),
    # pg = [-1.105171, +1.105171], loss = (1/2)(0) = 0; d s_it / d logp_t = s on its own token only, so
    # d loss / d logp = -(1/2)·Â_t·s = [-.552585, +.552585]. With Â = +1 on both it is gspo's gradient exactly.
    logp = torch.tensor([[0.2, 0.0]])
    loss, _, grad = _loss("gspo_token", logp, torch.tensor([[1.0, -1.0]]))
    assert loss == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.552585, 0.552585]]), atol=1e-6, rtol=0)
    loss, _, grad = _loss("gspo_token", logp, torch.tensor([1.0]))
    assert loss == pytest.approx(-1.105171, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.552585, -0.552585]]), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- CISPO, hand-worked

def test_cispo_clips_the_weight_not_the_token_hand_worked():
    # π_old [-1, -1, -3], π_θ [-1 + ln .5, -1, -3 + ln 10] = [-1.693147, -1, -.697415]: ρ = [.5, 1, 10]; Â = +1,
    # weight 1/3 each. ε_low 1 (no lower bound), ε_high 4: sg(clip(ρ, 0, 5)) = [.5, 1, 5], the third clipped.
    # pg = -w·Â·log π_θ = [.846574, 1, 3.487075], loss = 5.333649/3 = 1.777883; d loss / d log π_θ = -w·Â/3
    # = [-.166667, -.333333, -1.666667]: the third token keeps a gradient where PPO's clip zeroes it
    old, logp = torch.tensor([[-1.0, -1.0, -3.0]]), torch.tensor([[-1.693147, -1.0, -0.697415]])
    loss, stats, grad = _loss("cispo", logp, torch.tensor([1.0]), old=old, eps_low=1.0, eps_high=4.0)
    assert loss == pytest.approx(1.777883, abs=1e-5) and stats["clipped_tokens"] == 1
    torch.testing.assert_close(grad, torch.tensor([[-0.166667, -0.333333, -1.666667]]), atol=1e-5, rtol=0)
    _, _, grad = _loss("ppo_clip", logp, torch.tensor([1.0]), old=old)
    torch.testing.assert_close(grad, torch.tensor([[-0.166667, -0.333333, 0.0]]), atol=1e-5, rtol=0)
    # with PPO's ε (.2, .28) as its bounds: weights [.8, 1, 1.28], two clipped, grads [-.266667, -.333333, -.426667]
    _, stats, grad = _loss("cispo", logp, torch.tensor([1.0]), old=old)
    assert stats["clipped_tokens"] == 2 and stats["clipped_seqs"] == 1
    torch.testing.assert_close(grad, torch.tensor([[-0.266667, -0.333333, -0.426667]]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- SAPO, hand-worked

def test_sapo_soft_gate_hand_worked():
    # three tokens, weight 1 each (to read the terms), τ_pos 1, τ_neg 1.05, pg = -σ(τ(ρ-1))·(4/τ)·Â,
    # d pg / d logp = -Â·g·ρ with the gate g = 4σ(1-σ):
    #  ρ = 1,              Â = +1, τ = 1:    σ(0) = .5, pg = -2, g = 1, grad -1 (PPO's, on-policy)
    #  ρ = e^.5 = 1.648721, Â = -1, τ = 1.05: τ(ρ-1) = .681157, σ = 1/(1 + e^-.681157) = 1/1.506031 = .663997,
    #                      pg = +.663997·4/1.05 = 2.529512, g = 4·.663997·.336003 = .892420, grad +.892420·1.648721
    #                      = 1.471352 (PPO: 1.648721, the pessimistic side unclipped)
    #  ρ = e^-.5 = .606531, Â = +1, τ = 1:    τ(ρ-1) = -.393469, σ = 1/(1 + e^.393469) = 1/2.482114 = .402882,
    #                      pg = -4·.402882 = -1.611530, g = 4·.402882·.597118 = .962273, grad -.962273·.606531
    #                      = -.583648 (PPO: -.606531)
    # loss = -2 + 2.529512 - 1.611530 = -1.082018; Σ gate = 1 + .892420 + .962273 = 2.854693
    logp = torch.tensor([[0.0, 0.5, -0.5]])
    loss, stats, grad = _loss("sapo", logp, torch.tensor([[1.0, -1.0, 1.0]]), weights=torch.ones(1), tau_pos=1.0,
                              tau_neg=1.05)
    assert loss == pytest.approx(-1.082018, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 1.471352, -0.583648]]), atol=1e-5, rtol=0)
    assert stats["gate"].item() == pytest.approx(2.854693, abs=1e-5) and "clipped_tokens" not in stats
    # the negative side's larger τ damps sooner: the same ρ = e^.5 with Â = -1 under τ = 1 would keep more,
    # σ(.648721) = .656721, g = 4·.656721·.343279 = .901752 > .892420
    _, stats, _ = _loss("sapo", torch.tensor([[0.5]]), torch.tensor([-1.0]), weights=torch.ones(1), tau_neg=1.0)
    assert stats["gate"].item() == pytest.approx(0.901752, abs=1e-5)


# ---------------------------------------------------------------- every objective: on-policy, split, KL

N, T, H, V, L_MAX = 8, 6, 5, 13, 8
LENGTHS = torch.tensor([1, 6, 3, 4, 2, 6, 5, 1])                           # T_i, 28 tokens in all
SETTINGS = {name: dict(eps_low=0.05, eps_high=0.05) for name in ("gspo", "gspo_token")}   # a band some leave


def _rollout(per_token: bool):
    """A tiny lm_head's log-probs of 8 rows with lengths LENGTHS, and an off-policy π_old (ρ = exp(±~.3))."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(N, T, H, generator=g)                             # (N, T, H)
    weight = torch.randn(V, H, generator=g) * 0.5                          # (V, H)
    targets = torch.randint(0, V, (N, T), generator=g)                     # (N, T)
    mask = (torch.arange(T) < LENGTHS[:, None]).float()                    # (N, T)
    advantages = torch.randn(N, T, generator=g) if per_token else torch.randn(N, generator=g)
    with torch.no_grad():
        logp0, _ = token_logprobs(hidden, weight, targets, temperature=0.7)
    old_logp = logp0 + 0.3 * torch.randn(N, T, generator=g)
    ref_logp = logp0 + 0.2 * torch.randn(N, T, generator=g)
    return hidden, weight, targets, mask, advantages, old_logp, ref_logp


def _grads(objective, aggregation, ranks, *, per_token=False, on_policy=False):
    """Gradients of the hidden states and the head, and the summed stats, of one optimizer step split into
    ranks of micro-batches (lists of row slices), the ranks' gradients summed as an all-reduce would."""
    hidden0, weight0, targets, mask, advantages, old_logp, ref_logp = _rollout(per_token)
    grad_h, grad_w, sums = torch.zeros_like(hidden0), torch.zeros_like(weight0), {}
    for micro_batches in ranks:
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        for rows in micro_batches:
            m = mask[rows]
            w = sequence_weights(m, aggregation, N, int(mask.sum()), L_MAX)
            logp, _ = token_logprobs(hidden[rows], weight, targets[rows], temperature=0.7, chunk_tokens=5)
            old = logp.detach() if on_policy else old_logp[rows]
            loss, stats = policy_loss(logp, old_logp=old, ref_logp=ref_logp[rows], advantages=advantages[rows], mask=m,
                                      seq_weights=w, beta=0.04, objective=objective,
                                      **(EPS | SETTINGS.get(objective, {})))
            loss.backward()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_h += hidden.grad
        grad_w += weight.grad
    return grad_h, grad_w, sums


ONE_CALL = [[slice(0, N)]]
SPLITS = ([[slice(i, i + 2) for i in range(0, N, 2)]],                    # 4 micro-batches
          [[slice(0, 3), slice(3, 4)], [slice(4, 7), slice(7, 8)]])        # 2 ranks of 2 unequal ones


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_objective_is_independent_of_the_split(objective, aggregation):
    # the sequence weights come from global counts and a micro-batch holds whole rows, so GSPO's s_i (a mean
    # over the row) and every per-token term are the same however the step is cut; per-token advantages where
    # the objective takes them (gspo: one per completion)
    per_token = objective != "gspo"
    grad_h, grad_w, sums = _grads(objective, aggregation, ONE_CALL, per_token=per_token)
    assert grad_w.abs().max() > 1e-3                                             # a gradient to compare
    if objective not in GATED:
        assert 0 < sums["clipped_tokens"] < sums["tokens"]                   # the bound is exercised, not total
    for split in SPLITS:
        got_h, got_w, got_sums = _grads(objective, aggregation, split, per_token=per_token)
        torch.testing.assert_close(got_h, grad_h, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_w, grad_w, atol=1e-6, rtol=0)
        for key in sums:
            torch.testing.assert_close(got_sums[key], sums[key], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_on_policy_every_objective_has_the_clipped_surrogates_gradient(objective):
    # with one iteration π_old is the current policy detached: ρ = s = 1, inside every clip, and SAPO's gate is
    # 4·.5·.5 = 1, so each objective's gradient is -Â·∇logπ per token weighted as the aggregation says, PPO's
    # (GSPO: -Â·∇s_i = -Â·(1/|o_i|)Σ_t ∇logπ_t on the sequence's term; grpo: the 1/|o_i| of each token's
    # weight)
    for aggregation in AGGREGATIONS:
        want_h, want_w, _ = _grads("ppo_clip", aggregation, ONE_CALL, on_policy=True)
        got_h, got_w, sums = _grads(objective, aggregation, ONE_CALL, on_policy=True)
        torch.testing.assert_close(got_h, want_h, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
        assert sums["ratio"] == pytest.approx(float(LENGTHS.sum()))          # Σ ρ over 28 tokens of ρ = 1
        if objective in GATED:
            assert sums["gate"] == pytest.approx(float(LENGTHS.sum()))       # the gate is 1 on every token
        else:
            assert sums["clipped_tokens"] == 0


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_kl_term_adds_to_every_objective_unweighted(objective):
    # ℓ = pg + β·kl for every objective: the loss with β = .5 minus the loss with β = 0 is .5·Σ_i w_i Σ_t kl_it
    hidden, weight, targets, mask, advantages, old_logp, ref_logp = _rollout(per_token=objective != "gspo")
    logp, _ = token_logprobs(hidden, weight, targets, temperature=0.7)
    w = sequence_weights(mask, "grpo", N, int(mask.sum()), L_MAX)
    kw = dict(old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, mask=mask, seq_weights=w, **EPS,
              objective=objective)
    with_kl, _ = policy_loss(logp, beta=0.5, **kw)
    without, _ = policy_loss(logp, beta=0.0, **kw)
    kl = ((k3_kl(logp, ref_logp) * mask).sum(1) * w).sum()
    torch.testing.assert_close(with_kl - without, 0.5 * kl, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- logged as the objective says

def test_each_objectives_statistics_are_logged():
    # a clipping objective: 10 tokens, 2 clipped, in 1 of 4 completions -> clip_frac .2, clip_seq_frac .25;
    # Σρ = 11 -> ratio_mean 1.1. SAPO: Σ gate 9 over 10 tokens -> gate_mean .9, and no clip_frac (it clips nothing)
    from pspo.training.metrics import (AdvantageSums, GenerationCounts, MethodStats, RolloutSums, UpdateSums,
                                       step_metrics)
    method = MethodStats(RolloutSums(completions=4, groups=2, completion_tokens=10, reward=2, reward_sq=2, accuracy=2,
                                     format=0, zero_std_groups=0, truncated=0, reward_failures=0),
                         AdvantageSums(adv_abs=4, adv_sq=4, adv_count=4))
    update = UpdateSums(skipped_steps=0, update_positions=20, update_tokens=20, grad_norm=1, pg_loss=0, kl=0,
                        clipped_tokens=2, tokens=10, entropy=0, ratio=11, clipped_seqs=1, seqs=4)
    _, _, m = step_metrics(method, update, GenerationCounts(), load_config(None), torch.device("cpu"))
    assert (m["clip_frac"], m["clip_seq_frac"], m["ratio_mean"]) == (0.2, 0.25, 1.1) and "gate_mean" not in m
    update = UpdateSums(skipped_steps=0, update_positions=20, update_tokens=20, grad_norm=1, pg_loss=0, kl=0,
                        clipped_tokens=0, tokens=10, entropy=0, ratio=11, gate=9)
    _, _, m = step_metrics(method, update, GenerationCounts(), load_config(None, ["--algo.objective=sapo"]),
                           torch.device("cpu"))
    assert m["gate_mean"] == 0.9 and "clip_frac" not in m and "clip_seq_frac" not in m


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("overrides, message", [
    (["--algo.objective=ppo"], "algo.objective: expected ppo_clip | gspo | gspo_token"),
    (["--algo.objective=gspo", "--algo.advantage=reinforce_pp", "--algo.beta=0"],
     "algo.objective: expected gspo_token with algo.advantage=reinforce_pp (its advantages are per token"),
    (["--algo.objective=gspo", "--rollout.is_correction=token"], "rollout.is_correction: expected none | sequence | "
     "sequence_mask | geo_mask with algo.objective=gspo"),
    (["--algo.objective=gspo", "--rollout.mode=async", "--rollout.is_correction=token_mask"],
     "rollout.is_correction: expected none | sequence | sequence_mask | geo_mask with algo.objective=gspo"),
    (["--algo.sapo_tau_neg=2"], "algo.sapo_tau_neg: expected 1.05 (unset) unless algo.objective=sapo"),
    (["--algo.objective=sapo", "--algo.sapo_tau_pos=0"], "algo.sapo_tau_pos: expected a finite number > 0"),
    (["--algo.objective=sapo", "--algo.eps_high=0.2"], "algo.eps_high: expected 0.28 (unset) with "
     "algo.objective=sapo (its soft gate has no clip"),
    (["--algo.eps_low=1.5"], "algo.eps_low: expected in [0, 1] (1: no lower bound)"),
])
def test_objective_refusals_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_objectives_compose_where_they_have_a_meaning():
    # gspo_token takes per-token advantages and weights; gspo takes a per-completion weight, at lag 1 the geometric
    # mask; an ε_low of 1 is no lower bound (the IS weight's, for CISPO); the names are loss.OBJECTIVES'
    assert load_config(None, ["--algo.objective=gspo_token", "--algo.advantage=reinforce_pp", "--algo.beta=0",
                              "--rollout.is_correction=token_mask"]).algo.objective == "gspo_token"
    for correction in ("sequence", "sequence_mask", "geo_mask"):
        assert load_config(None, ["--algo.objective=gspo", f"--rollout.is_correction={correction}"])
    assert load_config(None, ["--algo.objective=gspo", "--rollout.mode=async", "--rollout.is_correction=geo_mask"])
    assert load_config(None, ["--algo.eps_low=1"]).algo.eps_low == 1.0
    cfg = load_config(None, ["--algo.objective=sapo", "--algo.sapo_tau_pos=0.5", "--algo.sapo_tau_neg=2"])
    assert (cfg.algo.sapo_tau_pos, cfg.algo.sapo_tau_neg) == (0.5, 2.0)


# ---------------------------------------------------------------- presets

# each objective's presets (configs/ and the 1.5B recipe's folder): its paper's values (docs/methods.md §11 says
# where the papers leave room); 4 optimizer steps per rollout batch and grpo.yaml's warm-up in them (5 x 4)
PAPERS = {
    "gspo": {"algo.objective": "gspo", "algo.aggregation": "grpo", "algo.beta": 0.0, "algo.eps_low": 3e-4,
             "algo.eps_high": 4e-4},
    "cispo": {"algo.objective": "cispo", "algo.aggregation": "token_mean", "algo.beta": 0.0, "algo.eps_low": 1.0,
              "algo.eps_high": 4.0},
    "sapo": {"algo.objective": "sapo", "algo.aggregation": "grpo", "algo.beta": 0.0, "algo.sapo_tau_pos": 1.0,
             "algo.sapo_tau_neg": 1.05},
}


@pytest.mark.parametrize("name", PAPERS)
@pytest.mark.parametrize("folder", ["configs", "configs/qwen2.5-math-1.5b"])
def test_presets_carry_the_papers_values(name, folder):
    cfg = load_config(os.path.join(ROOT, folder, f"{name}.yaml"))
    want = PAPERS[name] | {"algo.num_iterations": 4, "optim.warmup_steps": 20}
    got = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in want}
    assert got == want
