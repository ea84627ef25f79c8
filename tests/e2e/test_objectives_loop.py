"""An objective of docs/methods.md §11 through the real loop with what it composes with: GSPO one step off
(rollout.mode=async, lag 1) under the geometric-mean mask, on LoRA adapters, with packed micro-batches, on the
tiny model; its own statistics logged. (Each objective's preset runs too: tests/e2e/test_presets.py.)"""
import json
import math
import os

import pytest

pytestmark = pytest.mark.slow        # end to end: a real run of the loop and its engine process


def test_gspo_one_step_off_with_the_geometric_mask_lora_and_packing(tmp_path, tiny_model_path, run_main):
    out = str(tmp_path / "run")
    run_main("train", "--config", "configs/gspo.yaml", f"--train.output_dir={out}",
             f"--model.name_or_path={tiny_model_path}", "--train.prompts_per_step=8", "--rollout.num_generations=4",
             "--data.eval=", "--train.progress=false", "--reward.workers=0", "--train.max_steps=2",
             "--rollout.mode=async", "--rollout.is_correction=geo_mask", "--rollout.is_floor=0.5",
             "--model.lora.rank=4", "--model.lora.alpha=8", "--train.micro_batch_tokens=64", "--train.packing=true",
             "--optim.lr=1e-3", "--optim.warmup_steps=0")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["rollout_lag"] == 1
    for r in rows:
        for key in ("loss", "clip_frac", "clip_seq_frac", "ratio_mean", "tis_masked_seq_frac", "engine_gap_mean"):
            assert math.isfinite(r[key]), (r["step"], key)
        assert "gate_mean" not in r and 0 <= r["clip_seq_frac"] <= 1
    # 4 optimizer steps per batch: after the first, completions leave GSPO's [1 - 3e-4, 1 + 4e-4] and are clipped
    assert all(r["clip_seq_frac"] > 0 for r in rows)
