"""End to end: the real loop on the tiny model, its logs and checkpoints, exact resume, and
2-process FSDP2 runs: one rank on each of two nodes, launched as Slurm would (scripts/slurm.sbatch,
torchrun on each node), reproduces a 1-process run; two ranks on one node train in bf16 over float32
master weights. One-process runs are train.main in this process (conftest's run_main); the ranks on
one node are forked from it as torchrun would start them (conftest's launch_train)."""
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pspo.tasks.data import DataError, builtin_arithmetic
from pspo.released_sampler import ReleasedSampler
from pspo.training.checkpoint import state_digest
from pspo.training.config import ConfigError

pytestmark = pytest.mark.slow        # end to end: real runs of the loop or the engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--train.prompts_per_step=8", "--rollout.num_generations=4", "--train.micro_batch_size=12",
         "--data.max_eval_examples=16", "--train.progress=false", "--optim.lr=1e-3"]


@pytest.fixture(scope="module")
def train_argv(tiny_model_path):
    """train_argv(out, *overrides, config=...): train.py's arguments on the tiny model, SMALL settings."""
    def train_argv(out, *overrides, config="configs/grpo.yaml"):
        return ["--config", config, f"--train.output_dir={out}", f"--model.name_or_path={tiny_model_path}",
                *SMALL, *overrides]
    return train_argv


@pytest.fixture(scope="module")
def train(launch_train, train_argv):
    """train(out, *overrides, nproc=1, config=...): train.py on the tiny model, SMALL settings; one
    process runs in this one (a user mistake raises its error), nproc > 1 under torchrun (it must
    exit 0). Module-scoped, so that a module fixture can share one run among tests."""
    def train(out, *overrides, nproc=1, config="configs/grpo.yaml"):
        return launch_train(train_argv(out, *overrides, config=config), nproc)
    return train


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_loop_logs_evaluates_and_saves(tmp_path, tiny_model_path, train):
    out = str(tmp_path / "run")
    train(out, "--train.max_steps=3", "--train.eval_steps=2", "--algo.beta=0.04")
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2] and "eval_accuracy" in rows[3]
    for key in ("reward_mean", "reward_std", "accuracy", "format_rate", "adv_abs_mean", "zero_std_frac", "kl",
                "clip_frac", "entropy", "response_length", "truncation_rate", "grad_norm", "lr", "step_time_s",
                "gen_tokens_per_s", "loss"):
        assert key in rows[1], key
    # nothing compiled on CPU (train.compile, rollout.compile and model.logprob_head auto): counted all the same
    assert [(r["compile_recompiles"], r["compile_fallbacks"]) for r in rows[1:]] == [(0, 0)] * 3
    assert 0 <= rows[1]["accuracy"] <= 1 and rows[1]["grad_norm"] > 0
    assert rows[1]["kl"] == pytest.approx(0, abs=1e-6)      # the first step: policy == reference
    assert rows[3]["kl"] > 0                                  # after updates it has moved
    # where the step went: the parts fit inside the step; the evaluation is timed apart
    parts = ("gen_s", "reward_s", "update_s", "sync_s")
    assert all(rows[1][k] >= 0 for k in parts) and sum(rows[1][k] for k in parts) <= rows[1]["step_time_s"]
    assert rows[1]["update_s"] > 0 and rows[1]["gen_s"] > 0 and "eval_s" in rows[2] and "eval_s" not in rows[1]
    assert 0 <= rows[1]["padding_frac"] < 1 and rows[1]["update_tokens_per_s"] > 0
    assert os.path.exists(os.path.join(out, "config.yaml")) and os.listdir(os.path.join(out, "tb"))
    ckpt = os.path.join(out, "checkpoint-3")
    model = AutoModelForCausalLM.from_pretrained(ckpt)        # a plain Hugging Face folder
    saved = weights(ckpt)
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], saved["model.norm.weight"])
    base = weights(tiny_model_path)
    assert not torch.equal(saved["model.norm.weight"], base["model.norm.weight"])   # it trained
    assert not any(name.startswith(".tmp") for name in os.listdir(out))


@pytest.fixture(scope="module")
def few_prompts(six_prompts):
    """The 6-prompt train set with B = 4: prompts revisit within a few steps, so ERS and PPS state matter."""
    return [f"--data.train={six_prompts}", "--train.prompts_per_step=4"]


@pytest.fixture(scope="module")
def pspo(train, few_prompts):
    def pspo(out, *overrides, nproc=1):
        return train(out, *few_prompts, *overrides, nproc=nproc, config="configs/pspo.yaml")
    return pspo


# the KL term (the reference model, sharded over ranks too) and 2 micro-batches a rank (gradient accumulation)
PSPO_3_STEPS = ["--train.max_steps=3", "--pps.is_norm=batch_max", "--algo.beta=0.04", "--train.micro_batch_size=6"]


@pytest.fixture(scope="module")
def pspo_3_steps(pspo, tmp_path_factory):
    """PSPO on the 6 prompts for 3 steps (pps.is_norm=batch_max, its default), β 0.04, micro-batches of 6 rows:
    shared by the tests that read it."""
    out = str(tmp_path_factory.mktemp("pspo") / "run")
    pspo(out, *PSPO_3_STEPS)
    return out


def test_max_train_examples_keeps_the_first_rows(tmp_path, train):
    # 8 train rows and 8 prompts per step: PSPO's step 1 draws 8 distinct prompts, all of the set
    # (ers_seen_frac 8/8 = 1); the whole builtin set would give 8/N with N in the thousands
    out = str(tmp_path / "run")
    train(out, "--data.max_train_examples=8", "--train.max_steps=1", config="configs/pspo.yaml")
    assert metrics(out)[1]["ers_seen_frac"] == 1.0
    with pytest.raises(ConfigError) as e:
        train(out, "--data.max_train_examples=-1")
    assert str(e.value).startswith("data.max_train_examples")


def trainer_state(path):
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)


def assert_same_state(a, b, atol=0.0):
    """Sampler (PPS priorities, seen, RNG, the last draw) and ERS statistics equal (floats to atol)."""
    def same(va, vb, where):
        if isinstance(va, dict):
            assert va.keys() == vb.keys(), where
            for key in va:
                same(va[key], vb[key], f"{where}.{key}")
        elif isinstance(va, torch.Tensor) and va.is_floating_point():
            torch.testing.assert_close(va, vb, atol=atol, rtol=0, msg=where)
        elif isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), where
        else:
            assert va == vb, where
    for part in ("sampler", "ers"):
        same(a[part], b[part], part)


def test_pps_is_norm_reaches_the_update(tmp_path, pspo, pspo_3_steps):
    # Step 1: every prompt is unseen at priority 1, so P = 1/N and every raw weight (N·P)^-β is 1:
    # batch_max and none give the same weights, hence the same grad norm. Later steps have raw
    # weights != 1, which batch_max divides by their max and none leaves as they are.
    pspo(str(tmp_path / "none"), *PSPO_3_STEPS, "--pps.is_norm=none")
    runs = {norm: [row["grad_norm"] for row in metrics(out) if "grad_norm" in row]
            for norm, out in (("batch_max", pspo_3_steps), ("none", str(tmp_path / "none")))}
    assert runs["batch_max"][0] == pytest.approx(runs["none"][0], rel=1e-5)
    assert runs["batch_max"][1:] != pytest.approx(runs["none"][1:], rel=1e-3)


def test_pspo_logs_ers_and_pps_diagnostics(tmp_path, pspo, pspo_3_steps):
    out = pspo_3_steps
    rows = metrics(out)
    for key in ("ers_gap", "ers_visits", "ers_seen_frac", "pps_entropy", "pps_is_max", "pps_is_min", "pps_ess",
                "pps_repeat_frac", "pps_revisit_frac", "bookkeeping_s"):
        assert key in rows[3], key
    # 4 distinct of 6 prompts per step: step 1 sees 4 for the first time; step 3 cannot be all
    # first visits (steps 1-2 already covered at least 4 prompts), so its mean visit count is > 1
    assert rows[1]["ers_seen_frac"] == pytest.approx(4 / 6) and rows[1]["ers_visits"] == 1
    assert rows[3]["ers_seen_frac"] >= 4 / 6 and rows[3]["ers_visits"] > 1
    assert 0 < rows[3]["pps_entropy"] <= 1 and 0 < rows[3]["pps_is_min"] <= rows[3]["pps_is_max"]
    state = trainer_state(os.path.join(out, "checkpoint-3"))
    assert int(state["ers"]["visits"].sum()) == 12 and state["sampler"]["steps"] == 3
    # a resumed run may not switch PPS (or ERS) off: one line (a ConfigError's, train.py's exit code 2);
    # tried on a copy, which the attempt may write to (its config.yaml)
    shutil.copytree(out, tmp_path / "run")
    with pytest.raises(ConfigError) as e:
        pspo(str(tmp_path / "run"), "--train.max_steps=4", "--train.resume=auto", "--pps.enabled=false")
    assert str(e.value).startswith("pps.enabled: the checkpoint was trained with") and "\n" not in str(e.value)


@pytest.mark.parametrize("config", ["configs/pspo.yaml", "configs/grpo.yaml", "configs/pspo_released.yaml",
                                    "configs/pps_skip.yaml"])
def test_resume_continues_exactly(tmp_path, train, few_prompts, config):
    # Uninterrupted 4 steps with a checkpoint at step 2, vs. a run resumed from that checkpoint: the same metrics
    # at every step, and the same weights, AdamW, sampler and ERS state at the end, bit for bit.
    # PSPO: the PPS priorities and RNG, the ERS statistics and the optimizer must all come back; the released
    # code's sampler: its epoch's draws with replacement; skipping: the zero-variance streaks and the skips' RNG.
    # GRPO: the uniform order, which crosses epoch boundaries here (4 of 6 prompts per step).
    full = str(tmp_path / "full")
    args = [*few_prompts, "--train.max_steps=4", "--train.save_steps=2", "--data.eval="]
    train(full, *args, "--train.keep_checkpoints=0", config=config)
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    shutil.copy(os.path.join(full, "metrics.jsonl"), resumed)          # truncated back to step 2 on resume
    train(resumed, *args, "--train.resume=auto", config=config)
    a, b = metrics(full), metrics(resumed)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a, b):
        timings = {k for k in ra if k.endswith(("_s", "_per_s"))}
        assert {k: v for k, v in ra.items() if k not in timings} == {k: v for k, v in rb.items() if k not in timings}
    sa, sb = trainer_state(os.path.join(full, "checkpoint-4")), trainer_state(os.path.join(resumed, "checkpoint-4"))
    assert state_digest(sa) == state_digest(sb)
    assert state_digest(weights(os.path.join(full, "checkpoint-4"))) == \
        state_digest(weights(os.path.join(resumed, "checkpoint-4")))
    if config == "configs/grpo.yaml":
        assert sa["sampler"]["epoch"] >= 1 and sa["ers"] is None
    elif config == "configs/pspo.yaml":
        assert int(sa["ers"]["visits"].max()) >= 2                      # ERS really smoothed a revisit
        assert a[-1]["pps_is_min"] < a[-1]["pps_is_max"]                 # and PPS weighed the prompts apart


def test_resume_under_another_method_or_sampler_is_one_line(tmp_path, train, few_prompts):
    # A GRPO checkpoint with uniform sampling: resuming it as REINFORCE++ or with PPS would load state
    # that means something else (or none at all): one line naming both values (train.py: exit code 2).
    out = str(tmp_path / "run")
    train(out, *few_prompts, "--train.max_steps=1")
    cases = {
        ("--algo.advantage=reinforce_pp", "--algo.beta=0"): "error: algo.advantage: the checkpoint was trained "
        "with algo.advantage=grpo, this run has algo.advantage=reinforce_pp; resume with the same setting",
        ("--pps.enabled=true", "--pps.mode=released"): "error: pps.enabled: the checkpoint was trained with "
        "pps.enabled=false, this run has pps.enabled=true; resume with the same setting",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as e:
            train(out, *few_prompts, "--train.max_steps=2", "--train.resume=auto", *overrides)
        assert f"error: {e.value}" == message


# Slurm on one machine, for scripts/slurm.sbatch: srun runs its command once per node of the job (SLURM_NODEID
# 0, 1, ...) and, as --kill-on-bad-exit=1 asks, stops the others when one fails; scontrol puts every node at
# 127.0.0.1
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
  pids+=($!)
done
for _ in "${pids[@]}"; do
  wait -n || { kill "${pids[@]}" 2>/dev/null; wait; exit 1; }
done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
for ((node = 0; node < SLURM_NNODES; node++)); do echo 127.0.0.1; done
"""


def marked(token: str) -> list[int]:
    """The live processes whose environment holds PSPO_TEST_RUN=token: a command's whole tree, wherever its
    processes went (torchrun starts each rank under setsid, in a process group of its own; an orphan is
    re-parented)."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                found = f"PSPO_TEST_RUN={token}".encode() in f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue                                          # gone meanwhile, or not ours
        if found and not zombie:
            pids.append(int(entry))
    return pids


def test_two_nodes_match_one_process(tmp_path, train_argv, few_prompts, pspo_3_steps):
    # scripts/slurm.sbatch as Slurm would run it on two nodes of one rank each (FAKE_SRUN): on each node
    # scripts/launch_nodes.sh, the command docs/gpu.md gives for a node, starts torchrun; the two meet by
    # c10d rendezvous at 127.0.0.1 on a free port and train over gloo. PSPO with the same global batch and
    # seed: FSDP2 over the 2 ranks (the KL term's reference sharded too, 2 micro-batches a rank) must
    # reproduce pspo_3_steps's one process, and both ranks must hold identical ERS/PPS state (the rank
    # digests agree). A watchdog kills the whole tree if it outlives its deadline; a failed node stops the
    # other (srun's --kill-on-bad-exit); nothing may be left.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token, two = uuid.uuid4().hex, str(tmp_path / "two")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_GPUS_ON_NODE": "1",
           "SLURM_SUBMIT_DIR": ROOT, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PSPO_TEST_RUN": token}
    argv = train_argv(two, *few_prompts, *PSPO_3_STEPS, config="configs/pspo.yaml")
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(["bash", os.path.join(ROOT, "scripts/slurm.sbatch"), *argv], cwd=tmp_path, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        code = proc.wait(timeout=400)
    except subprocess.TimeoutExpired:
        code = "none: still running after 400 s"
    finally:
        left = marked(token)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    output = (tmp_path / "log").read_text()
    assert code == 0 and left == [], f"exit {code}, left behind {left}:\n{output[-4000:]}"
    a, b = metrics(pspo_3_steps), metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("reward_mean", "accuracy", "loss", "grad_norm", "kl", "eval_accuracy", "ers_gap", "pps_entropy"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    ckpt_one, ckpt_two = os.path.join(pspo_3_steps, "checkpoint-3"), os.path.join(two, "checkpoint-3")
    digests = [torch.load(os.path.join(ckpt_two, f"rng-rank{r}.pt"), weights_only=True)["trainer_state_sha256"]
               for r in (0, 1)]
    assert digests[0] == digests[1]
    s1, s2 = trainer_state(ckpt_one), trainer_state(ckpt_two)
    assert_same_state(s1, s2, atol=1e-6)
    assert int(s2["ers"]["visits"].max()) >= 2 and a[1]["grad_norm"] > 0 and a[3]["kl"] > 0
    wa, wb = weights(ckpt_one), weights(ckpt_two)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=2e-5, rtol=0)


@pytest.mark.slow
def test_two_processes_in_bf16_train_float32_master_weights(tmp_path, tiny_model_path, pspo):
    # model.bf16 over 2 gloo ranks is FSDP2's mixed precision (distributed.shard): bf16 all-gathered
    # weights for compute, float32 gradient reduction into float32 shards. The step must run, move
    # the weights, and save them in float32 with both ranks' state identical.
    out = str(tmp_path / "two")
    pspo(out, "--train.max_steps=1", "--model.bf16=true", "--optim.lr=1e-2", nproc=2)
    assert metrics(out)[-1]["grad_norm"] > 0
    saved, start = weights(os.path.join(out, "checkpoint-1")), load_file(os.path.join(tiny_model_path,
                                                                                          "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in saved.values())
    assert any(not torch.equal(saved[k], start[k].float()) for k in saved if k in start)
    digests = [torch.load(os.path.join(out, "checkpoint-1", f"rng-rank{r}.pt"), weights_only=True)
               ["trainer_state_sha256"] for r in (0, 1)]
    assert digests[0] == digests[1]


def test_bad_data_file_is_one_line(tmp_path, train):
    # a DataError: train.py prints "error: " + its one line on stderr and exits 2
    with pytest.raises(DataError) as e:
        train(str(tmp_path / "x"), f"--data.train={tmp_path / 'missing.jsonl'}")
    assert "\n" not in str(e.value) and "missing.jsonl" in str(e.value)


@pytest.fixture
def nine_prompts(tmp_path):
    """9 rows, the last repeating the first's problem, 4 prompts per step: an epoch of pps.mode=released
    draws 9 rows and serves 2 steps (the 9th draw is dropped)."""
    path = tmp_path / "nine.jsonl"
    examples = builtin_arithmetic("train")[:8]
    with open(path, "w") as f:
        for ex in examples + examples[:1]:
            f.write(json.dumps({"problem": ex.problem, "answer": ex.answer}) + "\n")
    return [f"--data.train={path}", "--train.prompts_per_step=4"]


def test_released_mode_resumes_exactly_mid_epoch(tmp_path, train, nine_prompts):
    # pspo_released (docs/methods.md §3a): 3 steps, then resumed to step 4, against 4 steps in one go.
    # Epoch 0 serves steps 1-2, epoch 1 steps 3-4: the checkpoint at step 3 is mid-epoch (position 4 of
    # its 9 draws), so the resume must bring back the frozen draws and the position, not just the RNG.
    config = "configs/pspo_released.yaml"
    part, full = str(tmp_path / "part"), str(tmp_path / "full")
    train(part, *nine_prompts, "--train.max_steps=3", config=config)
    state3 = trainer_state(os.path.join(part, "checkpoint-3"))["sampler"]
    assert (state3["position"], state3["epoch"], len(state3["order"])) == (4, 1, 9)
    # row 8 repeats row 0's problem: its groups write row 0's priority (the released code keys priorities by
    # problem), row 8's own stays 1. Seed 0's first epoch serves row 8 (checked here, so that the
    # assertion below means something: a write of (|A| + 1e-6)^.6 is 1 only if |A| = 1 - 1e-6).
    first = ReleasedSampler(9, seed=0)
    assert 8 in first.sample(4).tolist() + first.sample(4).tolist()
    assert state3["released_priorities"][8].item() == 1.0 and state3["released_priorities"][0].item() != 1.0
    train(part, *nine_prompts, "--train.max_steps=4", "--train.resume=auto", config=config)
    train(full, *nine_prompts, "--train.max_steps=4", config=config)
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert [r["pps_epoch"] for r in a[1:]] == [0, 0, 1, 1]
    for key in ("reward_mean", "loss", "grad_norm", "ers_gap", "pps_epoch", "pps_repeat_frac"):
        assert a[4][key] == pytest.approx(b[4][key], rel=1e-6, abs=1e-9), key
    sa, sb = trainer_state(os.path.join(full, "checkpoint-4")), trainer_state(os.path.join(part, "checkpoint-4"))
    assert_same_state(sa, sb, atol=1e-9)
    assert sa["sampler"]["position"] == 8 and torch.equal(sa["sampler"]["order"], state3["order"])
    # a released-mode checkpoint does not resume under pps.mode=paper: one line (train.py: exit code 2)
    with pytest.raises(ConfigError) as e:
        train(part, *nine_prompts, "--train.max_steps=5", "--train.resume=auto", "--pps.mode=paper", config=config)
    assert f"error: {e.value}" == ("error: pps.mode: the checkpoint was trained with pps.mode=released, this run "
                                   "has pps.mode=paper; resume with the same setting")


def test_pps_replacement_trains_on_a_prompt_drawn_twice(tmp_path, train):
    # 3 prompts, 4 per step, pps.replacement: every batch repeats a prompt (B > N), and the loop trains on
    # it: each of the 2 steps' 4 groups is folded into ERS (visits sum to 8) and scored by PPS
    path = tmp_path / "three.jsonl"
    with open(path, "w") as f:
        for ex in builtin_arithmetic("train")[:3]:
            f.write(json.dumps({"problem": ex.problem, "answer": ex.answer}) + "\n")
    out = str(tmp_path / "run")
    train(out, f"--data.train={path}", "--train.prompts_per_step=4", "--train.max_steps=2",
          "--pps.replacement=true", config="configs/pspo.yaml")
    rows = metrics(out)[1:]
    assert [r["step"] for r in rows[:2]] == [1, 2]
    assert all(r["pps_repeat_frac"] >= 0.25 and math.isfinite(r["loss"]) for r in rows[:2])
    state = trainer_state(os.path.join(out, "checkpoint-2"))
    assert int(state["ers"]["visits"].sum()) == 8


def test_pps_options_run_and_log_skips(tmp_path, pspo):
    # §3b options together: learnability priorities (λ = .9 default), GRESO-style skipping with ρ = .01
    # (a prompt after a zero-variance group is kept 1% of the time), uniform_mix .1. 6 prompts, 4 per step.
    out = str(tmp_path / "run")
    G, lam = 4, 0.9
    pspo(out, "--train.max_steps=4", "--pps.priority=learnability", "--pps.skip=true",
         "--pps.uniform_mix=0.1", "--pps.skip_rho=0.01")
    rows = metrics(out)[1:]
    for r in rows:
        assert r["rollouts_saved"] == G * r["pps_skipped"]
        # skipped prompts are replaced by others, or taken back: at most N - B = 2 per step
        assert r["pps_skipped"] in (0.0, 1.0, 2.0)
    # about half the groups of this model have zero variance, so with ρ = .01 skips happen
    assert any(r["zero_std_frac"] > 0 for r in rows) and sum(r["pps_skipped"] for r in rows) > 0
    s = trainer_state(os.path.join(out, "checkpoint-4"))["sampler"]
    # The Beta counts: a prompt scored k times has a + b = 2·λ^k + G·(1 + λ + ... + λ^(k-1)).
    # Solve for k: every prompt's k is a whole number, and the k sum to the 4·4 = 16 groups scored.
    a, b = s["posterior_a"], s["posterior_b"]
    visits = []
    for total in (a + b).tolist():
        k = next(k for k in range(5) if abs(2 * lam ** k + G * (1 - lam ** k) / (1 - lam) - total) < 1e-9)
        visits.append(k)
    assert sum(visits) == 16 and s["seen"].tolist() == [k > 0 for k in visits]
    assert all(int(z) <= k for z, k in zip(s["zero_streak"].tolist(), visits))
    mean = a / (a + b)
    torch.testing.assert_close(s["priorities"], (mean * (1 - mean) + 1e-6) ** 0.6, atol=1e-12, rtol=0)
