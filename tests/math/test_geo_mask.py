"""Geometric-mean masking of the engine/trainer mismatch (rollout.is_correction: geo_mask, docs/methods.md §7 and
§7b): hand-worked weights and logged sums, its ratio's independence of the completion's length where the
sequence-level product collapses, and its place among the corrections allowed one step off."""
import math

import pytest
import torch

from pspo.is_correction import correction_weights, log_ratios, mismatch_sums
from pspo.training.config import load_config

# Δ = log π_old − log π_engine (as tests/math/test_is_correction.py): row 0 [0.5, 0, 1.1]; row 1 [−0.3, −0.1]
# and a padding column (the engine's 0 against the trainer's −5, never counted).
# geometric mean: row 0 exp(1.6/3) = exp(.533333) = 1.704605; row 1 exp(−.4/2) = exp(−.2) = .818731
# (the padding counted would give exp(−5.4/3) = .165299)
OLD = torch.tensor([[-1.0, -2.0, -0.1], [-0.7, -3.0, -5.0]])
ENGINE = torch.tensor([[-1.5, -2.0, -1.2], [-0.4, -2.9, 0.0]])
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0]])


def test_geo_mask_weights_hand_worked():
    torch.testing.assert_close(log_ratios(OLD, ENGINE, MASK, "geo_mask")[:, 0], torch.tensor([0.533333, -0.2]))
    # [0, 2]: both kept, each with its geometric ratio on every column
    w = correction_weights(OLD, ENGINE, MASK, "geo_mask", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.704605] * 3, [0.818731] * 3]), atol=1e-6, rtol=0)
    # [.85, 2]: row 1's .818731 < .85 -> all its tokens 0; [.9, 1.5]: row 0's 1.704605 > 1.5 too -> nothing kept
    w = correction_weights(OLD, ENGINE, MASK, "geo_mask", cap=2.0, floor=0.85)
    torch.testing.assert_close(w, torch.tensor([[1.704605] * 3, [0.0] * 3]), atol=1e-6, rtol=0)
    assert torch.equal(correction_weights(OLD, ENGINE, MASK, "geo_mask", cap=1.5, floor=0.9), torch.zeros(2, 3))
    # the engine the trainer itself: ratio 1, weight 1 inside any bounds around 1
    assert torch.equal(correction_weights(OLD, OLD.clone(), MASK, "geo_mask", cap=1.01, floor=0.99), torch.ones(2, 3))


def test_geo_mask_sums_hand_worked():
    # [.85, 2]: row 1 dropped, its 2 tokens of 5 -> tis_masked_frac .4, 1 completion of 2 -> tis_masked_seq_frac .5;
    # Σw over the 5 tokens = 3 x 1.704605 = 5.113815 -> tis_weight_mean 1.022763; the gap is the token gap of §7
    # (Σ|Δ| = .5 + 0 + 1.1 + .3 + .1 = 2.0 over 5 tokens)
    s = mismatch_sums(OLD, ENGINE, MASK, "geo_mask", cap=2.0, floor=0.85)
    assert (s["masked"], s["masked_seqs"], s["seqs"], s["tokens"]) == (2, 1, 2, 5)
    assert float(s["weight_sum"]) == pytest.approx(5.113815, abs=1e-5) and float(s["gap_sum"]) == pytest.approx(2.0)


def test_geometric_ratio_does_not_grow_with_the_length():
    # every token of a completion moved by δ = 2e-4 nats (a kernel gap, or a small step one off): the product of
    # its ratios is e^(Tδ), 12 tokens e^.0024 = 1.002403, 3584 tokens e^.7168 = 2.047815 > C = 2 (sequence_mask
    # drops it, sequence caps it to 2); the geometric mean is e^δ = 1.000200 for both, inside [.99, 1.01]
    mask = torch.zeros(2, 3584)
    mask[0, :12], mask[1] = 1, 1
    old, engine = torch.full((2, 3584), 2e-4) * mask, torch.zeros(2, 3584)
    seq = correction_weights(old, engine, mask, "sequence_mask", cap=2.0)[:, 0]
    assert seq[0].item() == pytest.approx(1.002403, abs=1e-5) and seq[1].item() == 0.0
    geo = correction_weights(old, engine, mask, "geo_mask", cap=1.01, floor=0.99)[:, 0]
    torch.testing.assert_close(geo, torch.full((2,), math.exp(2e-4)), atol=1e-6, rtol=0)


def test_geo_mask_is_allowed_one_step_off():
    # at lag 1 the sequence-level product is refused, the geometric mean accepted (and named first in the refusal)
    cfg = load_config(None, ["--rollout.mode=async", "--rollout.is_correction=geo_mask", "--rollout.is_floor=0.5"])
    assert (cfg.rollout.lag, cfg.rollout.is_correction, cfg.rollout.is_floor) == (1, "geo_mask", 0.5)
    with pytest.raises(ValueError, match=r"rollout.is_correction: expected geo_mask \| token \| token_mask with "
                                         r"rollout.mode=async at rollout.lag=1"):
        load_config(None, ["--rollout.mode=async", "--rollout.is_correction=sequence"])


def test_one_step_off_worked_case():
    # docs/methods.md §7b's completion of 3 tokens: log π_engine (θ_{s−1}) [−1, −.5, −2], log π_old (θ_s)
    # [−.8, −.6, −1]: Δ = [.2, −.1, 1], mean 1.1/3 = .366667, r = e^.366667 = 1.442917, kept in [.5, 2] (the
    # product e^1.1 = 3.004166 > 2 would be dropped by sequence_mask)
    old, engine, mask = torch.tensor([[-0.8, -0.6, -1.0]]), torch.tensor([[-1.0, -0.5, -2.0]]), torch.ones(1, 3)
    w = correction_weights(old, engine, mask, "geo_mask", cap=2.0, floor=0.5)
    torch.testing.assert_close(w, torch.full((1, 3), 1.442917), atol=1e-6, rtol=0)
    assert torch.equal(correction_weights(old, engine, mask, "sequence_mask", cap=2.0), torch.zeros(1, 3))
