"""Masked importance sampling in the real loop on the tiny model (train.py in this process, conftest's
run_main), docs/methods.md §7: with an engine whose log-probs are off on half the completions, the
token_mask and sequence_mask modes drop exactly those, and the run logs the dropped shares (the
math: tests/math/test_is_correction.py)."""
import json

import pytest

from pspo.engines.hf_engine import HFEngine

pytestmark = pytest.mark.slow        # end to end: real runs of the loop


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_a_stale_engine_half_the_time_is_masked_and_logged(tmp_path, tiny_model_path, run_main, monkeypatch, mode):
    # The transformers engine samples from the trainer itself (|Δ| ~1e-6 nats per token). Here every odd
    # completion's engine log-probs are lowered by 1 nat per token, as an engine with other weights
    # would report them: there Δ = log π_old − log π_engine ≈ 1, r ≈ e = 2.718 per token and ≥ e per
    # completion, above C = 2: every token of it is dropped, in both modes; the even completions keep
    # r ≈ 1 (inside [0, 2]), w ≈ 1. So each step's logged shares are, whatever the completions' lengths:
    #   tis_masked_frac = (tokens of odd completions) / (all tokens), tis_masked_seq_frac = 1/2,
    #   tis_weight_mean ≈ (tokens of even completions) / (all tokens)
    generate, shares = HFEngine.generate, []

    def stale_on_odd_rows(self, *args, **kwargs):
        rollout = generate(self, *args, **kwargs)
        odd = rollout.mask[1::2]                                                  # (N/2, T)
        rollout.logprobs[1::2] -= odd                                             # 1 nat lower, padding stays 0
        shares.append((float(odd.sum()), float(rollout.mask.sum()), rollout.mask.shape[0]))
        return rollout
    monkeypatch.setattr(HFEngine, "generate", stale_on_odd_rows)

    out = tmp_path / mode
    run_main("train", "--config", "configs/grpo.yaml", f"--train.output_dir={out}",
             f"--model.name_or_path={tiny_model_path}", "--rollout.engine=hf", "--train.max_steps=2",
             "--train.prompts_per_step=8", "--rollout.num_generations=4", "--data.eval=", "--optim.lr=1e-3",
             f"--rollout.is_correction={mode}", "--rollout.is_cap=2.0", "--train.progress=false")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == len(shares) == 2 and all(n == 32 for _, _, n in shares)      # one generate call a step
    for row, (odd_tokens, tokens, _) in zip(rows, shares):
        assert row["tis_masked_frac"] == pytest.approx(odd_tokens / tokens, abs=1e-12)
        assert row["tis_masked_seq_frac"] == 0.5
        assert row["tis_weight_mean"] == pytest.approx(1 - odd_tokens / tokens, abs=1e-4)
        assert "tis_capped_frac" not in row
        assert 0.5 < row["engine_gap_max"] < 1.5                                  # the odd rows' ~1 nat
        assert row["grad_norm"] > 0                                               # the even half still trains
