"""Single-stream PO end to end (configs/single_stream.yaml, docs/methods.md §10): one completion per prompt through
the whole loop, and a run resumed from its checkpoint continues exactly: the tracker (α, β, visits and the stored
completions), the sampler's Beta counts, the weights and AdamW."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pspo.training.checkpoint import state_digest

pytestmark = pytest.mark.slow        # end to end: real runs of the loop


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_preset_resumes_exactly(tmp_path, tiny_model_path, six_prompts, launch_train):
    # the 6-prompt train set with B = 4 of G = 1: prompts revisit within a step or two, so the drifts are scored
    def train(out, *overrides):
        launch_train(["--config", "configs/single_stream.yaml", f"--train.output_dir={out}",
                      f"--model.name_or_path={tiny_model_path}", f"--data.train={six_prompts}", "--data.eval=",
                      "--train.prompts_per_step=4", "--train.progress=false", "--optim.lr=1e-3",
                      "--train.max_steps=4", "--train.save_steps=2", *overrides])

    full = str(tmp_path / "full")
    train(full, "--train.keep_checkpoints=0")
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    shutil.copy(os.path.join(full, "metrics.jsonl"), resumed)          # truncated back to step 2 on resume
    train(resumed, "--train.resume=auto")
    a, b = metrics(full), metrics(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        timings = {k for k in ra if k.endswith(("_s", "_per_s"))}
        assert {k: v for k, v in ra.items() if k not in timings} == {k: v for k, v in rb.items() if k not in timings}
    state = lambda run: torch.load(os.path.join(run, "checkpoint-4", "trainer_state.pt"), weights_only=True)  # noqa
    sa, sb = state(full), state(resumed)
    assert state_digest(sa) == state_digest(sb)
    weights = lambda run: load_file(os.path.join(run, "checkpoint-4", "model.safetensors"))   # noqa: E731
    assert state_digest(weights(full)) == state_digest(weights(resumed))
    # what the run did: 4 completions a step, no group statistics (zero_std_frac null), revisits whose drift was
    # scored and moved ρ off ρ_max, every prompt's last completion kept
    assert all(r["zero_std_frac"] is None for r in a)
    assert a[0]["single_stream_revisit_frac"] == 0.0 and a[0]["single_stream_rho"] == pytest.approx(0.96)
    later = [r for r in a[1:] if r["single_stream_drift"] is not None]
    assert later and all(0.875 <= r["single_stream_rho"] <= 0.96 for r in a)
    assert any(r["single_stream_rho"] < 0.96 for r in later)
    tracker = sa["single_stream"]
    assert int(tracker["visits"].sum()) == 16 and int(tracker["visits"].max()) >= 2
    assert tracker["rows"].tolist() == sorted(set(torch.nonzero(tracker["visits"]).flatten().tolist()))
