"""Truncated and masked importance sampling against an engine's log-probs, docs/methods.md §7: the
weights with hand-worked numbers (token and sequence levels, truncated and masked, the bounds hit and
not, inclusive, padding), the logged mismatch sums, their config checks, and the weight entering the
batch's advantages in one place (methods.weigh, through methods.training_batch)."""
import glob
import os

import pytest
import torch

from pspo import methods
from pspo.training.config import ConfigError, load_config
from pspo.training.distributed import Dist
from pspo.is_correction import correction_weights, log_ratios, mismatch_sums
from pspo.methods import Context, MethodOutput, MethodState, StepRollouts, training_batch, weigh
from pspo.training.tokens import Rollout
from pspo.training.micro_batches import TokenRows

# Two completions, T = 3; the second has 2 tokens (padding at t = 2, where the engine reports 0
# and the trainer a pad token's log-prob). Δ = log π_old − log π_engine:
#   row 0: −1.0 − (−1.5) = 0.5,  −2.0 − (−2.0) = 0,  −0.1 − (−1.2) = 1.1
#   row 1: −0.7 − (−0.4) = −0.3, −3.0 − (−2.9) = −0.1, (padding: −5 − 0 = −5, ignored)
# r per token: e^0.5 = 1.648721, e^0 = 1, e^1.1 = 3.004166; e^−0.3 = 0.740818, e^−0.1 = 0.904837
# r per sequence: row 0 e^1.6 = 4.953032, row 1 e^−0.4 = 0.670320 (without the padding's −5: e^−5.4 = 0.004517)
OLD = torch.tensor([[-1.0, -2.0, -0.1], [-0.7, -3.0, -5.0]])
ENGINE = torch.tensor([[-1.5, -2.0, -1.2], [-0.4, -2.9, 0.0]])
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0]])


def test_token_weights_hand_worked():
    # exp(Δ): e^0.5 = 1.648721, e^0 = 1, e^1.1 = 3.004166 -> capped at C = 2; e^-0.3 = 0.740818,
    # e^-0.1 = 0.904837; padding Δ = 0 -> 1
    w = correction_weights(OLD, ENGINE, MASK, "token", cap=2.0)
    expected = torch.tensor([[1.648721, 1.0, 2.0], [0.740818, 0.904837, 1.0]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    # with C = 4 nothing is capped: 3.004166 stays
    assert abs(float(correction_weights(OLD, ENGINE, MASK, "token", cap=4.0)[0, 2]) - 3.004166) < 1e-5


def test_sequence_weights_hand_worked():
    # row 0: Σ Δ = 0.5 + 0 + 1.1 = 1.6, e^1.6 = 4.953032 -> C = 2 on all three tokens;
    # row 1: Σ Δ = −0.3 − 0.1 = −0.4 (the padding's −5 left out), e^−0.4 = 0.670320, on every column
    w = correction_weights(OLD, ENGINE, MASK, "sequence", cap=2.0)
    expected = torch.tensor([[2.0, 2.0, 2.0], [0.670320, 0.670320, 0.670320]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    # C = 5 > 4.953032: not hit
    torch.testing.assert_close(correction_weights(OLD, ENGINE, MASK, "sequence", cap=5.0)[0],
                               torch.full((3,), 4.953032), atol=1e-5, rtol=0)
    torch.testing.assert_close(log_ratios(OLD, ENGINE, MASK, "sequence")[:, 0], torch.tensor([1.6, -0.4]))


def test_equal_logprobs_give_weight_one_and_extremes_stay_finite():
    # the trainer's own engine: Δ = 0 everywhere -> r = 1 inside any [C_low, C] -> w = 1 exactly, in every mode
    for mode in ("token", "sequence", "token_mask", "sequence_mask"):
        assert torch.equal(correction_weights(OLD, OLD.clone(), MASK, mode, cap=2.0, floor=0.5), torch.ones(2, 3))
    # Δ = +200 overflows exp to inf -> min(inf, C) = C; Δ = −200 underflows to 0 (no gradient)
    old, engine, ones = torch.tensor([[0.0, -200.0]]), torch.tensor([[-200.0, 0.0]]), torch.ones(1, 2)
    assert correction_weights(old, engine, ones, "token", cap=2.0).tolist() == [[2.0, 0.0]]
    # masked, inf > C is dropped (0, not inf or nan) and 0 stays 0; with C_low = .5, 0 < C_low is dropped
    # too (0 either way), while truncation raises it to C_low
    assert correction_weights(old, engine, ones, "token_mask", cap=2.0).tolist() == [[0.0, 0.0]]
    assert correction_weights(old, engine, ones, "token_mask", cap=2.0, floor=0.5).tolist() == [[0.0, 0.0]]
    assert correction_weights(old, engine, ones, "token", cap=2.0, floor=0.5).tolist() == [[2.0, 0.5]]
    with pytest.raises(ValueError, match="rollout.is_correction"):
        correction_weights(OLD, ENGINE, MASK, "tokens", cap=2.0)


def test_mismatch_sums_hand_worked():
    # |Δ| on the 5 tokens: .5, 0, 1.1, .3, .1 -> sum 2.0, max 1.1 (padding's 5 ignored), 5 tokens.
    # token mode, C = 2: weights 1.648721 + 1 + 2 + .740818 + .904837 = 6.294376, 1 capped (e^1.1)
    s = mismatch_sums(OLD, ENGINE, MASK, "token", cap=2.0)
    assert abs(float(s["gap_sum"]) - 2.0) < 1e-6 and abs(float(s["gap_max"]) - 1.1) < 1e-6
    assert float(s["tokens"]) == 5 and float(s["capped"]) == 1
    assert abs(float(s["weight_sum"]) - 6.294376) < 1e-5
    # sequence mode: row 0's 3 tokens capped at 2, row 1's 2 at .670320 -> 6 + 1.340640 = 7.340640
    s = mismatch_sums(OLD, ENGINE, MASK, "sequence", cap=2.0)
    assert float(s["capped"]) == 3 and abs(float(s["weight_sum"]) - 7.340640) < 1e-5
    # none: the gap only
    assert set(mismatch_sums(OLD, ENGINE, MASK, "none", cap=2.0)) == {"gap_sum", "gap_max", "tokens"}


def test_token_lower_bound_truncates_hand_worked():
    # token, C_low = .8, C = 2: clip(r, .8, 2) -> row 0 [1.648721, 1, 2]; row 1 e^−0.3 = .740818 raised
    # to .8, .904837 kept; padding r = 1
    w = correction_weights(OLD, ENGINE, MASK, "token", cap=2.0, floor=0.8)
    torch.testing.assert_close(w, torch.tensor([[1.648721, 1.0, 2.0], [0.8, 0.904837, 1.0]]), atol=1e-6, rtol=0)
    # sequence, C_low = .7: row 0 e^1.6 -> 2, row 1 e^−0.4 = .670320 -> .7, on every column
    w = correction_weights(OLD, ENGINE, MASK, "sequence", cap=2.0, floor=0.7)
    torch.testing.assert_close(w, torch.tensor([[2.0] * 3, [0.7] * 3]), atol=1e-6, rtol=0)


def test_token_mask_hand_worked():
    # token_mask, C = 2, no lower bound: w = r if r ≤ 2 else 0 -> row 0 [1.648721, 1, 0] (e^1.1 = 3.004166
    # dropped); row 1 [.740818, .904837] kept; padding r = 1 (Δ zeroed there)
    w = correction_weights(OLD, ENGINE, MASK, "token_mask", cap=2.0)
    expected = torch.tensor([[1.648721, 1.0, 0.0], [0.740818, 0.904837, 1.0]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    # C_low = .8 also drops e^−0.3 = .740818 < .8 (row 1, t = 0); .904837 stays. The padding's own Δ = −5
    # (r = .0067 < .8) would have been dropped too: it is zeroed first, r = 1 there
    w = correction_weights(OLD, ENGINE, MASK, "token_mask", cap=2.0, floor=0.8)
    expected = torch.tensor([[1.648721, 1.0, 0.0], [0.0, 0.904837, 1.0]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    # C = 4 > 3.004166: nothing dropped, w = r untruncated
    w = correction_weights(OLD, ENGINE, MASK, "token_mask", cap=4.0)
    assert abs(float(w[0, 2]) - 3.004166) < 1e-5


def test_sequence_mask_hand_worked():
    # sequence_mask, C = 2: row 0 r = e^1.6 = 4.953032 > 2 -> 0 on all three tokens;
    # row 1 r = e^−0.4 = .670320 ≤ 2 -> .670320 on every column
    w = correction_weights(OLD, ENGINE, MASK, "sequence_mask", cap=2.0)
    expected = torch.tensor([[0.0, 0.0, 0.0], [0.670320, 0.670320, 0.670320]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    # C_low = .7 > .670320: row 1 dropped too. C_low = .6 keeps it; C = 5 keeps row 0 (4.953032)
    assert torch.equal(correction_weights(OLD, ENGINE, MASK, "sequence_mask", cap=2.0, floor=0.7), torch.zeros(2, 3))
    w = correction_weights(OLD, ENGINE, MASK, "sequence_mask", cap=5.0, floor=0.6)
    torch.testing.assert_close(w, torch.tensor([[4.953032] * 3, [0.670320] * 3]), atol=1e-5, rtol=0)


def test_mask_bounds_are_inclusive():
    # A ratio equal to a bound is kept (TRL drops r < C_low and r > C only). The bounds are set to the
    # very float32 ratios the function computes (e^0.5 = 1.648721 at row 0, t = 0; e^−0.1 = .904837 at
    # row 1, t = 1), so that equality is exact on any build.
    ratio = torch.exp(log_ratios(OLD, ENGINE, MASK, "token"))                         # (2, 3)
    cap, floor = float(ratio[0, 0]), float(ratio[1, 1])
    w = correction_weights(OLD, ENGINE, MASK, "token_mask", cap=cap, floor=floor)
    # kept: e^0.5 (= C), e^0 = 1, e^−0.1 (= C_low), padding 1; dropped: e^1.1 > C, e^−0.3 < C_low
    assert w[0, 0] == ratio[0, 0] and w[1, 1] == ratio[1, 1] and w[0, 1] == 1
    assert w[0, 2] == 0 and w[1, 0] == 0
    # one float32 step inside the bounds drops them
    below_cap = float(torch.nextafter(ratio[0, 0], torch.tensor(0.0)))
    above_floor = float(torch.nextafter(ratio[1, 1], torch.tensor(2.0)))
    tighter = correction_weights(OLD, ENGINE, MASK, "token_mask", cap=below_cap, floor=above_floor)
    assert tighter[0, 0] == 0 and tighter[1, 1] == 0 and tighter[0, 1] == 1
    # sequence level: C = row 0's own ratio e^1.6 keeps it
    seq = torch.exp(log_ratios(OLD, ENGINE, MASK, "sequence"))
    w = correction_weights(OLD, ENGINE, MASK, "sequence_mask", cap=float(seq[0, 0]))
    assert torch.equal(w, seq)


def test_masked_sums_hand_worked():
    # token_mask, C = 2: 1 token of 5 dropped (e^1.1), in 1 completion of 2 (row 0);
    # Σw = 1.648721 + 1 + 0 + .740818 + .904837 = 4.294376 (padding not counted)
    s = mismatch_sums(OLD, ENGINE, MASK, "token_mask", cap=2.0)
    assert (float(s["masked"]), float(s["masked_seqs"]), float(s["seqs"]), float(s["tokens"])) == (1, 1, 2, 5)
    assert abs(float(s["weight_sum"]) - 4.294376) < 1e-5 and "capped" not in s
    # C_low = .8: 2 tokens dropped (e^1.1, e^−0.3), in both completions; Σw = 1.648721 + 1 + .904837 = 3.553558.
    # The padding (Δ = −5 before zeroing) is not a dropped token: 2, not 3
    s = mismatch_sums(OLD, ENGINE, MASK, "token_mask", cap=2.0, floor=0.8)
    assert (float(s["masked"]), float(s["masked_seqs"])) == (2, 2)
    assert abs(float(s["weight_sum"]) - 3.553558) < 1e-5
    # sequence_mask, C = 2: row 0's 3 tokens dropped, 1 completion of 2; Σw = 2 × .670320 = 1.340640
    s = mismatch_sums(OLD, ENGINE, MASK, "sequence_mask", cap=2.0)
    assert (float(s["masked"]), float(s["masked_seqs"]), float(s["seqs"])) == (3, 1, 2)
    assert abs(float(s["weight_sum"]) - 1.340640) < 1e-5
    # C_low = .7: both completions dropped: 3 + 2 = 5 tokens (row 1's padding column, whose weight is
    # its completion's 0, is not counted: 5, not 6), Σw = 0
    s = mismatch_sums(OLD, ENGINE, MASK, "sequence_mask", cap=2.0, floor=0.7)
    assert (float(s["masked"]), float(s["masked_seqs"]), float(s["weight_sum"])) == (5, 2, 0)
    # truncated with C_low: the tokens moved to a bound count as capped: token C_low = .8 -> e^1.1 to 2
    # and e^−0.3 to .8: 2; Σw = 1.648721 + 1 + 2 + .8 + .904837 = 6.353558
    s = mismatch_sums(OLD, ENGINE, MASK, "token", cap=2.0, floor=0.8)
    assert float(s["capped"]) == 2 and abs(float(s["weight_sum"]) - 6.353558) < 1e-5 and "masked" not in s
    # an all-padding row is no completion: 1 completion, none dropped
    s = mismatch_sums(OLD, ENGINE, torch.tensor([[1.0, 1, 0], [0, 0, 0]]), "sequence_mask", cap=2.0)
    # row 0's Σ over t < 2 = 0.5 + 0 -> e^0.5 = 1.648721 kept
    assert (float(s["masked"]), float(s["masked_seqs"]), float(s["seqs"]), float(s["tokens"])) == (0, 0, 1, 2)


def _step(mode, monkeypatch, pps=(1.0, 0.5), old_read_first=False, floor=0.0):
    """One prompt of G = 2 completions (OLD/ENGINE above) with PPS weights `pps` and a method's A = [+1, −1]
    per token, ready for training_batch; the policy's log-probs of the two completions are OLD (scoring
    stubbed: the calls training_batch makes are recorded in `asked`)."""
    cfg = load_config(None, [f"--rollout.is_correction={mode}", "--rollout.is_cap=2.0",
                             f"--rollout.is_floor={floor}", "--algo.beta=0"])
    asked = []

    def score_policy(policy, ref, rows, *, cfg, need_old, need_ref):
        asked.append((need_old, need_ref))
        return (OLD.clone() if need_old else None), None
    monkeypatch.setattr(methods, "score_policy", score_policy)
    rollout = Rollout(torch.zeros(2, 3, dtype=torch.long), MASK, ENGINE, torch.tensor([False, False]), ["", ""], 0.0)
    s = StepRollouts(step=0, indices=torch.tensor([0]), rows=[0, 0], seeds=torch.zeros(2), rollout=rollout,
                     scored=None, rewards=torch.zeros(1, 2), is_weights=torch.tensor([pps]),
                     inputs=TokenRows(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), MASK),
                     old_logp=OLD.clone() if old_read_first else None)
    ctx = Context(cfg=cfg, policy=None, ref=None, engine=None, train_ids=[[1, 2]], problems=["p"],
                  dist=Dist(0, 1, torch.device("cpu")), mine=slice(0, 1), lockstep=False, score=None,
                  distinct_problems=1, state=MethodState())
    adv = MethodOutput(torch.tensor([[1.0], [-1.0]]).expand(2, 3), MASK, stats=None)
    return s, ctx, adv, asked


def test_training_batch_multiplies_pps_and_tis_weights_into_the_advantages(monkeypatch):
    # token mode, C = 2: A·w_PPS·w_IS =
    #   row 0: +1 · 1 · [1.648721, 1, 2];  row 1: −1 · .5 · [.740818, .904837, 1]
    s, ctx, adv, asked = _step("token", monkeypatch)
    batch, metrics = training_batch(adv, s, ctx)
    expected = torch.tensor([[1.648721, 1.0, 2.0], [-0.370409, -0.452419, -0.5]])
    torch.testing.assert_close(batch.advantages, expected, atol=1e-6, rtol=0)
    assert asked == [(True, False)]                   # π_old scored once, for the correction
    assert batch.old_logp is None                     # ... only: ρ ≡ 1 as without it
    # metrics: gap 2.0 / 5 = .4, max 1.1; weights 6.294376 / 5 = 1.258875; 1 of 5 capped
    assert metrics["engine_gap_mean"] == pytest.approx(0.4, abs=1e-6)
    assert metrics["engine_gap_max"] == pytest.approx(1.1, abs=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(1.258875, abs=1e-5)
    assert metrics["tis_capped_frac"] == pytest.approx(0.2)


@pytest.mark.parametrize("mode, floor, expected, logged", [
    # token_mask, C = 2: A·w_PPS·w = row 0: +1 · 1 · [1.648721, 1, 0];  row 1: −1 · .5 · [.740818, .904837, 1]
    # weights 4.294376 / 5 = .858875; 1 token of 5 dropped, in 1 completion of 2
    ("token_mask", 0.0, [[1.648721, 1.0, 0.0], [-0.370409, -0.452419, -0.5]],
     {"tis_weight_mean": 0.858875, "tis_masked_frac": 0.2, "tis_masked_seq_frac": 0.5}),
    # sequence_mask, C = 2: row 0 dropped (e^1.6 > 2); row 1: −1 · .5 · .670320 = −.335160 on every column
    # weights 1.340640 / 5 = .268128; 3 tokens of 5, 1 completion of 2
    ("sequence_mask", 0.0, [[0.0, 0.0, 0.0], [-0.335160] * 3],
     {"tis_weight_mean": 0.268128, "tis_masked_frac": 0.6, "tis_masked_seq_frac": 0.5}),
    # token_mask with C_low = .8: e^−0.3 dropped too -> row 1 [0, −.5 · .904837, −.5]; 3.553558 / 5 = .710712;
    # 2 tokens of 5, both completions
    ("token_mask", 0.8, [[1.648721, 1.0, 0.0], [0.0, -0.452419, -0.5]],
     {"tis_weight_mean": 0.710712, "tis_masked_frac": 0.4, "tis_masked_seq_frac": 1.0}),
])
def test_training_batch_applies_the_masked_weights(monkeypatch, mode, floor, expected, logged):
    s, ctx, adv, asked = _step(mode, monkeypatch, floor=floor)
    batch, metrics = training_batch(adv, s, ctx)
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), atol=1e-6, rtol=0)
    assert asked == [(True, False)] and batch.old_logp is None   # π_old scored for the correction only
    assert batch.loss_mask is adv.loss_mask                       # a dropped token stays in the loss mask
    # the gap as in the truncated modes: 2.0 / 5 = .4, max 1.1; no capped share (nothing is truncated)
    assert set(metrics) == {"engine_gap_mean", "engine_gap_max", *logged}
    assert metrics["engine_gap_mean"] == pytest.approx(0.4, abs=1e-6)
    for key, value in logged.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key


def test_without_correction_the_weight_is_the_pps_weight_alone(monkeypatch):
    # none: A·w_PPS = [+1, +1, +1], [−.5, −.5, −.5]; π_old kept when the method read it; the gap still logged
    s, ctx, adv, asked = _step("none", monkeypatch, old_read_first=True)
    batch, metrics = training_batch(adv, s, ctx)
    assert torch.equal(batch.advantages, torch.tensor([[1.0, 1, 1], [-0.5, -0.5, -0.5]]))
    assert batch.old_logp is not None and set(metrics) == {"engine_gap_mean", "engine_gap_max"}
    assert asked == [(False, False)]                  # nothing left to score
    # no π_old read (one iteration, no correction): nothing scored, nothing to compare, no metrics
    s, ctx, adv, asked = _step("none", monkeypatch)
    batch, metrics = training_batch(adv, s, ctx)
    assert metrics == {} and batch.old_logp is None and asked == [(False, False)]


def test_weigh_with_the_trainers_own_logprobs_is_a_no_op():
    # the engine IS the trainer (Δ = 0): the advantages equal the uncorrected ones bit for bit
    r = load_config(None, ["--rollout.is_correction=token"]).rollout
    adv, pps = torch.tensor([[1.0], [-1.0]]).expand(2, 3), torch.tensor([[1.0], [0.5]])
    corrected, _ = weigh(adv, pps_weights=pps, old_logp=OLD, engine_logp=OLD.clone(), mask=MASK, r=r)
    plain, _ = weigh(adv, pps_weights=pps, old_logp=None, engine_logp=ENGINE, mask=MASK, r=load_config(None).rollout)
    assert torch.equal(corrected, plain)


@pytest.mark.parametrize("overrides, message", [
    (["--rollout.is_correction=tokens"],
     "rollout.is_correction: expected none | token | sequence | token_mask | sequence_mask | geo_mask, got 'tokens'"),
    (["--rollout.is_correction=token_truncate"], "rollout.is_correction: expected none | token | sequence |"),
    (["--rollout.is_floor=-0.1"], "rollout.is_floor: expected a number in [0, 1)"),
    (["--rollout.is_floor=1.0"], "rollout.is_floor: expected a number in [0, 1)"),
    (["--rollout.is_floor=nan"], "rollout.is_floor: expected a number in [0, 1)"),
    (["--rollout.is_floor=0.5"], "rollout.is_floor: expected 0 with rollout.is_correction=none (there is no ratio "
     "to bound), got 0.5"),
    (["--rollout.is_correction=sequence_mask", "--rollout.top_p=0.9"], "rollout.top_p: expected 1 with rollout."),
    (["--rollout.is_correction=token_mask", "--algo.advantage=spo_tree"],
     "rollout.is_correction: expected none with algo.advantage=spo_tree"),
    (["--rollout.is_cap=1.0"], "rollout.is_cap: expected a finite number > 1"),
    (["--rollout.is_cap=nan"], "rollout.is_cap: expected a finite number > 1"),
    (["--rollout.is_correction=token", "--rollout.top_p=0.95"], "rollout.top_p: expected 1 with rollout.is_correction"),
    (["--rollout.is_correction=sequence", "--algo.advantage=spo_tree"],
     "rollout.is_correction: expected none with algo.advantage=spo_tree"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_defaults_and_the_presets():
    # off by default and on the CPU presets (the transformers engine samples from the trainer itself);
    # token level, C = 2, on the GPU presets (a folder with its model's config.json), whose engine is vLLM,
    # except SPO-tree's (refused there) and GSPO's (one weight per completion: the geometric mask, [.99, 1.01])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(None)
    assert (cfg.rollout.is_correction, cfg.rollout.is_cap, cfg.rollout.is_floor) == ("none", 2.0, 0.0)
    for path in sorted(glob.glob(os.path.join(root, "configs", "**", "*.yaml"), recursive=True)):
        loaded = load_config(path)
        r = loaded.rollout
        recipe = os.path.isfile(os.path.join(os.path.dirname(path), "model_config.json"))
        gpu = recipe and not path.endswith("spo_tree.yaml")
        want = ("token", 2.0, 0.0) if gpu else ("none", 2.0, 0.0)
        if gpu and loaded.algo.objective == "gspo":
            want = ("geo_mask", 1.01, 0.99)
        assert (r.is_correction, r.is_cap, r.is_floor) == want, path


def test_is_correction_is_a_pure_math_module():
    from tests.checks.test_imports_checks import project_imports
    assert project_imports()["is_correction"] == set()
