"""One step off (docs/methods.md §7b): the schedule g(s) = max(s − lag, 0) and the decoupled objective at
lag 1, where the engine's log-probs come from θ_{s−1} and π_old is the trainer's θ_s, worked by hand through
the IS weight (methods.weigh), its logged sums and the loss."""
import pytest
import torch

from pspo.is_correction import correction_weights, mismatch_sums
from pspo.loss import policy_loss, sequence_weights
from pspo.methods import weigh
from pspo.engines.schedule import generating_version, rank_rows, split
from pspo.training.config import RolloutConfig

# One completion of 3 tokens, Â = +1, one iteration (ρ ≡ 1), aggregation grpo, C = 2, C_low = 0:
#   log π_engine (θ_{s−1}) = [−1.0, −0.5, −2.0];  log π_old (θ_s) = [−0.8, −0.6, −1.0]
#   Δ = [0.2, −0.1, 1.0];  r = [e^0.2, e^−0.1, e^1] = [1.2214028, 0.9048374, 2.7182818]
ENGINE = torch.tensor([[-1.0, -0.5, -2.0]])
OLD = torch.tensor([[-0.8, -0.6, -1.0]])
MASK = torch.ones(1, 3)


def test_generating_version_table():
    # lag 1: step 0 by θ_0 (nothing older exists), then step s by θ_{s−1}; lag 0: θ_s, the sync schedule
    assert [generating_version(s, 1) for s in range(5)] == [0, 0, 1, 2, 3]
    assert [generating_version(s, 0) for s in range(5)] == [0, 1, 2, 3, 4]


def test_prompts_split_over_engines_and_rows_over_ranks():
    # 5 prompts over 2 engines: [0, 2) and [2, 5); 4 over 4: one each
    assert split(5, 2) == [slice(0, 2), slice(2, 5)]
    assert split(4, 4) == [slice(i, i + 1) for i in range(4)]
    # rank 1 of 2 holds prompts 2, 3 of (P,) = 4 and their G = 2 completions each, prompt-major
    mine, rows = rank_rows(torch.tensor([7, 8, 9, 10]), 1, 2, 2)
    assert mine == slice(2, 4) and rows == [9, 9, 10, 10]


def test_token_truncated_weight_and_loss_at_lag_1():
    # token: w = [1.2214028, 0.9048374, 2.0 (capped)]; tis_capped_frac = 1/3; Σw = 4.1262402, mean 1.3754134
    r = RolloutConfig(is_correction="token", is_cap=2.0)
    adv, _ = weigh(torch.ones(1, 3), pps_weights=torch.ones(1, 1), old_logp=OLD, engine_logp=ENGINE, mask=MASK, r=r)
    torch.testing.assert_close(adv, torch.tensor([[1.2214028, 0.9048374, 2.0]]), atol=1e-6, rtol=0)
    sums = mismatch_sums(OLD, ENGINE, MASK, "token", cap=2.0)
    assert float(sums["capped"]) == 1 and abs(float(sums["weight_sum"]) / 3 - 1.3754134) < 1e-6
    # grpo: seq weight 1/(N_seq·T_i) = 1/3; ρ ≡ 1 at the first iteration (logp = π_old):
    # loss = (1/3)·Σ −w·Â = −4.1262402/3 = −1.3754134
    loss, _ = policy_loss(OLD.clone(), old_logp=OLD, ref_logp=None, advantages=adv, mask=MASK,
                          seq_weights=sequence_weights(MASK, "grpo", 1, 3, 3), beta=0.0, eps_low=0.2, eps_high=0.2)
    assert float(loss) == pytest.approx(-1.3754134, abs=1e-6)


def test_masked_and_sequence_weights_at_lag_1():
    # token_mask: the third token's r = e > C is zeroed: w = [1.2214028, 0.9048374, 0]; 1 of 3 tokens masked,
    # its completion holds a masked token (1 of 1)
    w = correction_weights(OLD, ENGINE, MASK, "token_mask", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.2214028, 0.9048374, 0.0]]), atol=1e-6, rtol=0)
    sums = mismatch_sums(OLD, ENGINE, MASK, "token_mask", cap=2.0)
    assert (float(sums["masked"]), float(sums["masked_seqs"]), float(sums["seqs"])) == (1, 1, 1)
    # sequence: ΣΔ = 1.1, r = e^1.1 = 3.0041660 > C -> w = 2 on every token, all 3 tokens capped
    torch.testing.assert_close(correction_weights(OLD, ENGINE, MASK, "sequence", cap=2.0), torch.full((1, 3), 2.0))
    assert float(mismatch_sums(OLD, ENGINE, MASK, "sequence", cap=2.0)["capped"]) == 3
    # sequence_mask: the whole completion is dropped
    assert torch.equal(correction_weights(OLD, ENGINE, MASK, "sequence_mask", cap=2.0), torch.zeros(1, 3))
