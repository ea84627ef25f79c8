"""Clipped surrogate, k3 KL and aggregation, docs/methods.md §1, with hand-worked numbers, and the
invariance of the step gradient to micro-batch / rank splitting (log-probs: test_token_logprobs.py)."""
import math

import pytest
import torch

from pspo.loss import AGGREGATIONS, clipped_surrogate, k3_kl, policy_loss, sequence_weights
from pspo.training.token_logprobs import token_logprobs


# ---------------------------------------------------------------- k3 KL and the clipped surrogate

def test_k3_kl_hand_worked():
    # logp=-1, ref=-2: d = ref - logp = -1 -> e^-1 + 1 - 1 = .367879
    # logp=-2, ref=-1: d = 1 -> e - 1 - 1 = .718282 (k3 is not symmetric); equal -> 0
    kl = k3_kl(torch.tensor([-1., -2., -0.3]), torch.tensor([-2., -1., -0.3]))
    torch.testing.assert_close(kl, torch.tensor([.367879, .718282, 0.]), atol=1e-6, rtol=0)


def test_clipped_surrogate_both_sides_and_gradients():
    # ε_low .2, ε_high .28 -> clip range [.8, 1.28]; old_logp = 0 so ρ = exp(logp).
    # pg = -min(ρA, clip(ρ)A);  where unclipped, d pg / d logp = -A·ρ (dρ/dlogp = ρ).
    #  ρ=1.5, A=+1: -min(1.5, 1.28)   = -1.28, clipped, grad 0
    #  ρ=0.5, A=-1: -min(-.5, -.8)    =  0.8,  clipped, grad 0
    #  ρ=0.5, A=+1: -min(.5, .8)      = -0.5,  grad -.5  (clip would not raise a low ρ·A>0)
    #  ρ=1.5, A=-1: -min(-1.5, -1.28) =  1.5,  grad 1.5  (pessimistic: no clip for ρ·A<0 high)
    #  ρ=1.1, A=+2: inside the range  = -2.2,  grad -2.2
    #  ρ=0.9, A=0 : 0, not clipped,            grad 0
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1, 0.9])
    advantages = torch.tensor([1., -1, 1, -1, 2, 0])                       # (N=6,), T = 1 each
    logp = ratio.log()[:, None].requires_grad_()                           # (6, 1)
    pg, is_clipped = clipped_surrogate(logp, torch.zeros(6, 1), advantages, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(pg[:, 0], torch.tensor([-1.28, 0.8, -0.5, 1.5, -2.2, 0.]), atol=1e-6, rtol=0)
    assert is_clipped[:, 0].tolist() == [True, True, False, False, False, False]
    pg.sum().backward()
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([0., 0, -0.5, 1.5, -2.2, 0]), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- aggregation, hand-worked

def _two_sequences():
    # seq 0: 1 token,  A=+1, ρ=[1.2]          -> pg = -ρA = [-1.2]             Σ = -1.2
    # seq 1: 3 tokens, A=-2, ρ=[1.0, .9, 1.1] -> pg = -ρA = [2.0, 1.8, 2.2]    Σ =  6.0
    # (all ρ inside [.8, 1.28]: nothing clipped). Padding of seq 0 has ρ = 3, which would add
    # a large clipped term if the mask were ignored.
    ratio = torch.tensor([[1.2, 3.0, 3.0], [1.0, 0.9, 1.1]])               # (N=2, T=3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)          # T_i = [1, 3]
    return ratio.log(), torch.zeros(2, 3), torch.tensor([1., -2.]), mask


@pytest.mark.parametrize("aggregation, weights, loss", [
    ("grpo", [1 / 2, 1 / 6], 0.4),          # (1/2)(-1.2/1 + 6.0/3) = (1/2)(.8) = .4
    ("token_mean", [1 / 4, 1 / 4], 1.2),    # (-1.2 + 6.0) / (1+3) = 4.8/4 = 1.2
    ("dr_grpo", [1 / 8, 1 / 8], 0.6),       # (-1.2 + 6.0) / (2·L_max=4) = 4.8/8 = .6
])
def test_aggregation_hand_worked(aggregation, weights, loss):
    logp, old_logp, advantages, mask = _two_sequences()
    w = sequence_weights(mask, aggregation, num_seqs=2, num_tokens=4, max_len=4)
    torch.testing.assert_close(w, torch.tensor(weights), atol=1e-7, rtol=0)
    got, stats = policy_loss(logp, old_logp=old_logp, ref_logp=None, advantages=advantages, mask=mask, seq_weights=w,
                             beta=0.04, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(got, torch.tensor(loss), atol=1e-6, rtol=0)
    torch.testing.assert_close(stats["pg_loss"], torch.tensor(loss), atol=1e-6, rtol=0)
    # ρ sum over the 4 real tokens: 1.2 + 1.0 + .9 + 1.1 = 4.2
    assert stats["tokens"].item() == 4 and stats["clipped_tokens"].item() == 0
    assert stats["kl"].item() == 0 and abs(stats["ratio"].item() - 4.2) < 1e-6


def test_kl_term_enters_only_with_beta_and_ref():
    # one token, ρ = 1 (logp = old = -1), A = 1 -> pg = -1; ref = -2 -> kl = .367879 (above).
    # β = .5: ℓ = -1 + .5·.367879 = -.816060; β = 0 or no ref: ℓ = -1. Weight 1.
    logp, old, ref = torch.tensor([[-1.]]), torch.tensor([[-1.]]), torch.tensor([[-2.]])
    kw = dict(advantages=torch.tensor([1.]), mask=torch.ones(1, 1), seq_weights=torch.ones(1), eps_low=0.2,
              eps_high=0.28)
    loss, stats = policy_loss(logp, old_logp=old, ref_logp=ref, beta=0.5, **kw)
    assert abs(loss.item() - -0.816060) < 1e-6 and abs(stats["kl"].item() - 0.367879) < 1e-6
    assert abs(stats["pg_loss"].item() - -1.0) < 1e-6                     # pg alone, for logging
    loss, stats = policy_loss(logp, old_logp=old, ref_logp=ref, beta=0.0, **kw)
    assert abs(loss.item() - -1.0) < 1e-6 and abs(stats["kl"].item() - 0.367879) < 1e-6
    loss, stats = policy_loss(logp, old_logp=old, ref_logp=None, beta=0.5, **kw)
    assert abs(loss.item() - -1.0) < 1e-6 and stats["kl"].item() == 0
    # β = 0 keeps the KL out entirely: an overflowing kl (exp(99) > float32 max) must not turn
    # the loss into 0·inf = NaN.
    far_ref = torch.tensor([[98.]])                                        # d = 98 - (-1) = 99
    loss, _ = policy_loss(logp, old_logp=old, ref_logp=far_ref, beta=0.0, **kw)
    assert abs(loss.item() - -1.0) < 1e-6


def test_pps_weight_scales_the_policy_gradient_term_only():
    # train.py passes A·w (w = PPS importance weight) as the advantage: only pg scales, the KL does not.
    # Same token as above with w = .5: pg = -.5, kl = .367879; β = .5: ℓ = -.5 + .183940 = -.316060.
    logp, old, ref = torch.tensor([[-1.]], requires_grad=True), torch.tensor([[-1.]]), torch.tensor([[-2.]])
    loss, stats = policy_loss(logp, old_logp=old, ref_logp=ref, advantages=torch.tensor([1.]) * 0.5,
                              mask=torch.ones(1, 1), seq_weights=torch.ones(1), beta=0.5, eps_low=0.2, eps_high=0.28)
    assert abs(loss.item() - -0.316060) < 1e-6 and abs(stats["pg_loss"].item() - -0.5) < 1e-6
    # dℓ/dlogp = -w·A·ρ + β·(1 - exp(ref - logp)) = -.5 + .5·(1 - e^-1) = -.5 + .316060 = -.183940
    loss.backward()
    assert abs(logp.grad.item() - -0.183940) < 1e-6


def test_padding_overflow_never_turns_the_loss_or_gradient_into_nan():
    # Two tokens, the second is padding (mask 0). The real token as above: logp = old = -1, A = 1,
    # ref = -2 -> ℓ = -1 + .5·.367879 = -.816060, dℓ/dlogp = -1 + .5·(1 - e^-1) = -.683940.
    # At the padding position logπ_ref - logπ_θ = 150 - (-150) = 300: exp(300) = inf in float32,
    # and inf·0 (the mask) is NaN, in the loss and in the gradient, unless padding is removed first.
    logp = torch.tensor([[-1., -150.]], requires_grad=True)
    old, ref = torch.tensor([[-1., 90.]]), torch.tensor([[-2., 150.]])     # old: ρ = e^-240 there too
    mask = torch.tensor([[1., 0.]])
    loss, stats = policy_loss(logp, old_logp=old, ref_logp=ref, advantages=torch.tensor([1.]), mask=mask,
                              seq_weights=torch.ones(1), beta=0.5, eps_low=0.2, eps_high=0.28)
    loss.backward()
    assert abs(loss.item() - -0.816060) < 1e-6 and abs(stats["kl"].item() - 0.367879) < 1e-6
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.683940, 0.0]]), atol=1e-6, rtol=0)
    assert all(math.isfinite(v.item()) for v in stats.values())


def test_unknown_aggregation_is_a_one_line_value_error():
    with pytest.raises(ValueError, match="algo.aggregation.*grpo, token_mean, dr_grpo.*'mean'"):
        sequence_weights(torch.ones(2, 3), "mean", num_seqs=2, num_tokens=6, max_len=3)


# ---------------------------------------------------------------- invariance to splitting

N, T, H, V, L_MAX = 8, 6, 5, 13, 8
LENGTHS = torch.tensor([1, 6, 3, 4, 2, 6, 5, 1])                           # T_i, 28 tokens in all


def _rollout():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(N, T, H, generator=g)                             # (N, T, H)
    weight = torch.randn(V, H, generator=g) * 0.5                          # (V, H) a tiny lm_head
    targets = torch.randint(0, V, (N, T), generator=g)                     # (N, T)
    mask = (torch.arange(T) < LENGTHS[:, None]).float()                    # (N, T)
    advantages = torch.randn(N, generator=g)                               # (N,)
    with torch.no_grad():
        logp0, _ = token_logprobs(hidden, weight, targets, temperature=0.7)
    # ρ = exp(±~.3) reaches outside [.8, 1.28], so clipping is exercised; ref differs too.
    old_logp = logp0 + 0.3 * torch.randn(N, T, generator=g)
    ref_logp = logp0 + 0.2 * torch.randn(N, T, generator=g)
    return hidden, weight, targets, mask, advantages, old_logp, ref_logp


def _step_grads(aggregation, ranks, global_counts=True):
    """Gradients (hidden, weight) and summed stats of one optimizer step. ranks: a list (one per
    rank, each with its own copy of the parameters) of lists of micro-batch row slices; the
    ranks' gradients are summed as an all-reduce would."""
    hidden0, weight0, targets, mask, advantages, old_logp, ref_logp = _rollout()
    grad_h, grad_w, sums = torch.zeros_like(hidden0), torch.zeros_like(weight0), {}
    for micro_batches in ranks:
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        for rows in micro_batches:
            m = mask[rows]
            num_seqs, num_tokens = (N, int(mask.sum())) if global_counts else (m.shape[0], int(m.sum()))
            w = sequence_weights(m, aggregation, num_seqs, num_tokens, L_MAX)
            logp, _ = token_logprobs(hidden[rows], weight, targets[rows], temperature=0.7, chunk_tokens=5)
            loss, stats = policy_loss(logp, old_logp=old_logp[rows], ref_logp=ref_logp[rows],
                                      advantages=advantages[rows], mask=m, seq_weights=w, beta=0.04, eps_low=0.2,
                                      eps_high=0.28)
            loss.backward()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_h += hidden.grad
        grad_w += weight.grad
    return grad_h, grad_w, sums


def _explicit_step_loss(aggregation):
    """The aggregation written out as in docs/methods.md §1, for the one-call loss to match."""
    hidden, weight, targets, mask, advantages, old_logp, ref_logp = _rollout()
    logp, _ = token_logprobs(hidden, weight, targets, temperature=0.7)
    ratio = torch.exp(logp - old_logp)
    A = advantages[:, None]
    ell = -torch.min(ratio * A, ratio.clamp(0.8, 1.28) * A) + 0.04 * k3_kl(logp, ref_logp)
    per_seq = (ell * mask).sum(1)                                          # Σ_t ℓ_it, (N,)
    return {"grpo": (per_seq / LENGTHS).mean(), "token_mean": per_seq.sum() / LENGTHS.sum(),
            "dr_grpo": per_seq.sum() / (N * L_MAX)}[aggregation]


ONE_CALL = [[slice(0, N)]]
MICRO_4x2 = [[slice(i, i + 2) for i in range(0, N, 2)]]
TWO_RANKS = [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradient_is_invariant_to_micro_batches_and_ranks(aggregation):
    grad_h, grad_w, sums = _step_grads(aggregation, ONE_CALL)
    assert sums["clipped_tokens"] > 0 and sums["tokens"] == LENGTHS.sum()     # the clip is exercised
    for split in (MICRO_4x2, TWO_RANKS):
        got_h, got_w, got_sums = _step_grads(aggregation, split)
        torch.testing.assert_close(got_h, grad_h, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_w, grad_w, atol=1e-6, rtol=0)
        for key in sums:                                                       # sums add up too
            torch.testing.assert_close(got_sums[key], sums[key], atol=1e-6, rtol=1e-6)
    # control: per-micro-batch (local) counts change the gradient, so the test above has teeth
    local_h, _, _ = _step_grads(aggregation, MICRO_4x2, global_counts=False)
    assert (local_h - grad_h).abs().max() > 1e-3


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_one_call_loss_equals_the_written_out_aggregation(aggregation):
    hidden, weight, targets, mask, advantages, old_logp, ref_logp = _rollout()
    w = sequence_weights(mask, aggregation, N, int(mask.sum()), L_MAX)
    logp, _ = token_logprobs(hidden, weight, targets, temperature=0.7)
    loss, _ = policy_loss(logp, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, mask=mask, seq_weights=w,
                          beta=0.04, eps_low=0.2, eps_high=0.28)
    want = _explicit_step_loss(aggregation)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=0)
    assert not math.isclose(want.item(), 0.0, abs_tol=1e-3)                   # a non-trivial value
