"""LoRA end to end on the tiny model: a run that trains only the adapters (the KL reference the base
itself), saves peft's adapter, resumes exactly, is evaluated by eval.py (merged),
refuses a resume under the other setting in one line, trains under FSDP2 on two ranks, and syncs
its adapter to vLLM."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from pspo.training.checkpoint import CheckpointError
from test_loop import ROOT, SMALL, metrics

pytestmark = pytest.mark.slow        # end to end: real runs of the loop

LORA = ["--model.lora.rank=8", "--model.lora.alpha=16", "--algo.beta=0.04"]      # β > 0: a reference is used


@pytest.fixture(scope="module")
def lora_run(launch_train, tiny_model_path, tmp_path_factory):
    """train(out, *overrides, nproc=1): LoRA on the tiny model, SMALL settings."""
    def train(out, *overrides, nproc=1):
        return launch_train(["--config", "configs/grpo.yaml", f"--train.output_dir={out}",
                             f"--model.name_or_path={tiny_model_path}", *SMALL, *LORA, *overrides], nproc)
    return train


@pytest.fixture(scope="module")
def four_steps(lora_run, tmp_path_factory):
    """4 LoRA steps with checkpoints at 2 and 4: shared by the tests that read it."""
    out = str(tmp_path_factory.mktemp("lora") / "full")
    lora_run(out, "--train.max_steps=4", "--train.save_steps=2", "--train.keep_checkpoints=0")
    return out


def test_a_lora_run_saves_the_adapter_and_trains_only_it(four_steps, tiny_model_path):
    ckpt = os.path.join(four_steps, "checkpoint-4")
    files = set(os.listdir(ckpt))
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.pt"} <= files
    assert "model.safetensors" not in files                                 # the base is not copied
    adapter = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)   # B left 0: it trained
    rows = metrics(four_steps)
    assert rows[1]["kl"] == pytest.approx(0, abs=1e-6)        # step 1: the policy is the base (B = 0)
    assert rows[4]["kl"] > 0                                  # the adapters moved it from the reference
    optimizer = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False)
    assert len(optimizer["state"]) == len(adapter)             # AdamW holds the adapters only


def test_a_lora_run_resumes_exactly(four_steps, lora_run, tmp_path):
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(four_steps, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    shutil.copy(os.path.join(four_steps, "metrics.jsonl"), resumed)
    lora_run(resumed, "--train.max_steps=4", "--train.save_steps=2", "--train.resume=auto")
    a, b = metrics(four_steps), metrics(resumed)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a[3:5], b[3:5]):
        for key in ("reward_mean", "loss", "kl", "grad_norm", "lr", "response_length"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), key
    wa = load_file(os.path.join(four_steps, "checkpoint-4", "adapter_model.safetensors"))
    wb = load_file(os.path.join(resumed, "checkpoint-4", "adapter_model.safetensors"))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0)


def test_resuming_under_other_lora_settings_is_one_line(four_steps, lora_run, tmp_path):
    from pspo.training.lora import LoraError
    out = str(tmp_path / "run")
    shutil.copytree(four_steps, out)
    for override, message in (("--model.lora.alpha=8", "model.lora.alpha: the checkpoint"),
                              ("--model.lora.rank=4", "model.lora.rank: the checkpoint")):
        with pytest.raises(LoraError) as e:
            lora_run(out, "--train.max_steps=5", "--train.resume=auto", override)
        assert str(e.value).startswith(message) and "trained with" in str(e.value) and "\n" not in str(e.value)


def test_resuming_under_the_other_setting_is_one_line(four_steps, launch_train, tiny_model_path, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(four_steps, out)
    with pytest.raises(CheckpointError) as e:          # full fine-tuning on an adapter checkpoint
        launch_train(["--config", "configs/grpo.yaml", f"--train.output_dir={out}",
                      f"--model.name_or_path={tiny_model_path}", *SMALL, "--train.max_steps=5",
                      "--train.resume=auto"])
    assert str(e.value).startswith("train.resume: ") and "holds a LoRA adapter" in str(e.value)
    assert "\n" not in str(e.value)


def test_eval_reads_an_adapter_checkpoint(four_steps, run_main, tmp_path):
    # eval.py merges the adapter into its base: the greedy accuracy the run measured at its last step. The
    # merged folder is a plain model, which the vLLM engine loads as any (tests/e2e/test_eval_cli.py)
    out = run_main("eval", "--config", "configs/grpo.yaml", f"--model.name_or_path={four_steps}/checkpoint-4",
                   "--data.max_eval_examples=16", "--rollout.engine=hf", "--train.progress=false",
                   f"--eval.output={tmp_path / 'result.json'}").out
    merged = re.search(r"a LoRA adapter, merged into its base for evaluation \((.+)\)", out).group(1)
    result = json.loads((tmp_path / "result.json").read_text())
    last = [r for r in metrics(four_steps) if "eval_accuracy" in r][-1]
    assert result["greedy_accuracy"] == pytest.approx(last["eval_accuracy"]) and result["n"] == 16
    assert merged.startswith(tempfile.gettempdir()) and not os.path.exists(merged)        # removed after


def test_lora_under_fsdp2_on_two_ranks(lora_run, tmp_path):
    # a bf16 base with float32 adapters in one FSDP2 unit, and the reference (adapters off) scored before
    # the policy's first forward of a step (β > 0, one iteration: no π_old pass): FSDP2 must still see the
    # adapters as trainable
    out = str(tmp_path / "fsdp")
    lora_run(out, "--train.max_steps=2", "--train.save_steps=2", "--model.bf16=true", nproc=2)
    adapter = load_file(os.path.join(out, "checkpoint-2", "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert metrics(out)[2]["kl"] > 0


# train.py ending as a rank of several does (distributed.finish: os._exit, which runs no finalizer), in a world of one
AS_A_RANK = ("import os, runpy, sys; from pspo.training import distributed; "
             "distributed.finish = lambda code, clean: (sys.stdout.flush(), sys.stderr.flush(), os._exit(code)); "
             "sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', run_name='__main__')")


def test_lora_with_vllm_syncs_the_adapter_and_passes_the_sync_check(tiny_model_path, tmp_path):
    # the engine serves the base + the policy's adapter, a new version after every step; the sync check (every
    # step) finds the engine's base and served adapter equal to the trainer's, and its log-probs too (float32).
    # The run ends as a rank of several would, by os._exit: its adapter folder is removed before, none is left
    pytest.importorskip("vllm", reason="vLLM is not installed (PSPO_WITH_VLLM=1 bash scripts/test.sh installs it)")
    out, temp = str(tmp_path / "run"), tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.run([sys.executable, "-c", AS_A_RANK, "--config", "configs/grpo.yaml",
                           f"--train.output_dir={out}",
                           f"--model.name_or_path={tiny_model_path}", "--rollout.engine=vllm", "--data.eval=",
                           "--train.prompts_per_step=4", "--rollout.num_generations=4", "--train.progress=false",
                           *LORA, "--train.max_steps=3", "--rollout.sync_check_steps=1", "--optim.lr=1e-2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [name for name in os.listdir(temp) if name.startswith("pspo-adapter-")]
    steps = metrics(out)[1:]
    assert all(r["sync_stale_rows"] == 0 and r["sync_gap_mean"] < 1e-4 and r["weight_sync_s"] > 0 for r in steps)
    assert steps[-1]["kl"] > 1e-4                             # the adapters really moved the policy
