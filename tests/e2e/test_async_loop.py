"""End to end, rollout.mode=async (docs/methods.md §7b): the real loop with an hf engine process on the tiny
model. Lag 0 reproduces the synchronous run exactly. At lag 1: a run stopped by SIGTERM exits 0 with no engine
left, having logged the metrics and saved the checkpoint of an uninterrupted run of the same seed bit for bit,
its step in flight included; a run resumed from a checkpoint logs exactly the metrics of the uninterrupted run
and ends with its weights; 2 gloo ranks reproduce 1; the engine's log-probs are those of the previous step's
weights; and a killed engine ends the run with one line and exit code 2. Every run in a process of its own is
killed after a time limit, so a hang fails its test. The runs do not evaluate: evaluation generates in the
trainer's process in both modes (test_loop.py), and the weights themselves are compared."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from pspo.engines.schedule import INFLIGHT
from pspo.engines.staging import layout, policy_shapes, stage, total_bytes
from pspo.engines.vllm_engine import full_params
from pspo.training.checkpoint import state_digest
from pspo.training.model import build_policy
from pspo.training.tokens import batch_inputs

pytestmark = pytest.mark.slow        # end to end: real runs of the loop and its engine process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--train.prompts_per_step=8", "--rollout.num_generations=4", "--train.micro_batch_size=12",
         "--data.eval=", "--train.progress=false", "--optim.lr=1e-3",
         "--reward.workers=0"]                  # 32 completions scored in the trainer, no worker process to start
LAG1 = ["--rollout.mode=async", "--rollout.is_correction=token", "--train.max_steps=3", "--train.save_steps=1",
        "--train.keep_checkpoints=0"]
TIMING = re.compile(r"(_s|_per_s)$")


def args(model: str, out: str, *more: str, config: str = "configs/grpo.yaml") -> list[str]:
    return ["--config", config, f"--train.output_dir={out}", f"--model.name_or_path={model}", *SMALL, *more]


def metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same(a: list[dict], b: list[dict], rel: float = 0.0, aside: tuple[str, ...] = ()) -> None:
    """The same steps with the same values (timings, the per-process sync check's count and `aside` aside)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    skip = {"sync_stale_rows", *aside}
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not TIMING.search(k) and k not in skip}
        assert keys == {k for k in rb if not TIMING.search(k) and k not in skip}, ra["step"]
        close = lambda x, y: x == pytest.approx(y, rel=rel, abs=1e-6 if rel else 0)   # noqa: E731
        differ = [(k, ra[k], rb[k]) for k in sorted(keys) if not close(ra[k], rb[k])]
        assert not differ, (ra["step"], differ)


@contextlib.contextmanager
def training(argv: list[str], limit_s: float = 300.0):
    """train.py in a process of its own, its output piped; killed after limit_s (a hang fails the test instead
    of stalling it) and on the way out."""
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(limit_s, proc.kill)
    watchdog.start()
    try:
        yield proc
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()


def read_until(proc: subprocess.Popen, pattern: str) -> re.Match:
    for line in proc.stdout:
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"the run ended before printing {pattern!r}: {proc.stderr.read()[-2000:]}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_path, run_main):
    """Async at lag 1, 1 rank, 3 steps, a checkpoint after each: the reference run."""
    out = str(tmp_path_factory.mktemp("async") / "full")
    run_main("train", *args(tiny_model_path, out, *LAG1))
    return out


def test_lag0_equals_sync(tmp_path, tiny_model_path, six_prompts, run_main):
    # lag 0 runs the synchronous schedule through the engine process: with the trainer's thread count the
    # completions are the sync run's bit for bit, so every metric is, PSPO's sampler and ERS diagnostics included
    sync, lag0 = str(tmp_path / "sync"), str(tmp_path / "lag0")
    pspo = [f"--data.train={six_prompts}", "--train.prompts_per_step=4"]
    run_main("train", *args(tiny_model_path, sync, "--train.max_steps=2", *pspo, config="configs/pspo.yaml"))
    ran = run_main("train", *args(tiny_model_path, lag0, "--train.max_steps=2", "--rollout.mode=async",
                                  "--rollout.lag=0", *pspo, config="configs/pspo.yaml"))
    assert "engines: 1 × hf (pid " in ran.out
    a, b = metrics(sync), metrics(lag0)
    assert all(r["rollout_lag"] == 0 for r in b) and b[0]["sync_stale_rows"] == 0      # θ_0 checked
    for r in b:                                             # the async metrics, beside the sync run's
        for k in ("engine_gen_s", "engine_idle_s", "engine_load_s", "weight_sync_s", "weight_sync_bytes",
                  "rollout_lag"):
            r.pop(k, None)
    assert_same(a, b)
    weights = [load_file(os.path.join(out, "checkpoint-2", "model.safetensors")) for out in (sync, lag0)]
    assert state_digest(weights[0]) == state_digest(weights[1])           # and they end with the same weights


def same_checkpoint(a: str, b: str, aside: tuple[str, ...] = ()) -> None:
    """Two checkpoints hold the same run state bit for bit: weights, AdamW, trainer state, RNG and the step in
    flight (its engine timings aside), the files `aside` aside."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in sorted(os.listdir(a)):
        if name in aside:
            continue
        if name.endswith(".safetensors"):
            read = load_file
        elif name.endswith(".pt"):
            read = lambda path: torch.load(path, weights_only=True)     # noqa: E731
        else:
            continue                                                    # config and tokenizer files
        x, y = read(os.path.join(a, name)), read(os.path.join(b, name))
        if name == INFLIGHT:
            x, y = ({k: v for k, v in state.items() if k != "metrics"} for state in (x, y))
        assert state_digest(x) == state_digest(y), name


def test_sigterm_abandons_the_step_in_flight_then_resume_matches(tmp_path, tiny_model_path, run_main, uninterrupted,
                                                                  gone):
    # SIGTERM (a scheduler's warning) once checkpoint-1 is saved: the run finishes the step it is in (step 2),
    # kills its engine without waiting for the step launched after it, saves that step unanswered with the weights
    # generating it (inflight.pt) and exits 0.
    out = str(tmp_path / "stopped")
    with training(args(tiny_model_path, out, *LAG1)) as proc:
        engine = int(read_until(proc, r"engines: 1 × hf \(pid (\d+)\)").group(1))
        read_until(proc, r"^saved .*checkpoint-1$")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    stopped = re.search(r"SIGTERM received: stopped after step (\d+) with a checkpoint", stdout)
    assert stopped and int(stopped.group(1)) < 3, stdout[-2000:]         # 3: the signal came after the last step
    k = int(stopped.group(1))
    assert gone(engine)
    # what it saved is what the uninterrupted run held after step k, but for its step in flight (step k, generated
    # by θ_{k-1}): unanswered, with θ_{k-1} (checkpoint-(k-1)'s weights, as staged: float32 here); what it logged,
    # the same metrics (the same seed twice)
    state = torch.load(os.path.join(out, f"checkpoint-{k}", INFLIGHT), weights_only=True)
    answered = torch.load(os.path.join(uninterrupted, f"checkpoint-{k}", INFLIGHT), weights_only=True)
    assert (state["step"], state["version"]) == (k, k - 1) and "completion_ids" not in state
    assert torch.equal(state["indices"], answered["indices"])
    previous = build_policy(os.path.join(uninterrupted, f"checkpoint-{k - 1}"), chunk_tokens=2048).lm
    entries = layout(policy_shapes(previous, lora=False), torch.float32)
    expected = torch.zeros(total_bytes(entries), dtype=torch.uint8)
    stage(expected, full_params(previous), entries)
    assert torch.equal(state["staged"], expected)
    same_checkpoint(os.path.join(out, f"checkpoint-{k}"), os.path.join(uninterrupted, f"checkpoint-{k}"),
                    aside=(INFLIGHT,))
    assert_same([r for r in metrics(uninterrupted) if r["step"] <= k], metrics(out))
    # Resumed from that checkpoint: step k is generated again by θ_{k-1} with its seeds, and the run ends as the
    # uninterrupted run did
    again = str(tmp_path / "again")
    os.makedirs(again)
    shutil.copytree(os.path.join(out, f"checkpoint-{k}"), os.path.join(again, f"checkpoint-{k}"))
    shutil.copy(os.path.join(out, "metrics.jsonl"), again)
    run_main("train", *args(tiny_model_path, again, *LAG1, "--train.resume=auto"))
    assert_same(metrics(uninterrupted), metrics(again))
    same_checkpoint(os.path.join(again, "checkpoint-3"), os.path.join(uninterrupted, "checkpoint-3"))
    # Resumed from checkpoint-1 (saved when step 1 ended, as before a kill -9, whose engine dies with the
    # trainer: test_engine_process.py::test_trainer_killed_leaves_no_engine), with a log that goes on past it
    # (the uninterrupted run's, equal up to step k: what a kill -9 during step 3 leaves), cut back to step 1 on
    # resume: step 1 comes from inflight.pt (generated by θ_0, which the checkpoint does not hold), step 2 from
    # the engine with θ_1 staged after the resume. The run must log exactly what the uninterrupted run logged
    # and end with its weights.
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(out, "checkpoint-1"), os.path.join(resumed, "checkpoint-1"))
    shutil.copy(os.path.join(uninterrupted, "metrics.jsonl"), resumed)
    run_main("train", *args(tiny_model_path, resumed, *LAG1, "--train.resume=auto"))
    assert_same(metrics(uninterrupted), metrics(resumed))
    same_checkpoint(os.path.join(resumed, "checkpoint-3"), os.path.join(uninterrupted, "checkpoint-3"))


# Every PPS sampler one step off, on 6 prompts: with B = 4 prompts revisit from step 2, so the priorities, the draw's
# IS weights and its statistics differ from a fresh sampler's
SIX = ["--train.prompts_per_step=4", "--rollout.num_generations=4", "--train.micro_batch_size=16", "--data.eval=",
       "--train.progress=false", "--optim.lr=1e-3", "--reward.workers=0"]
SAMPLERS = {"pspo": "configs/pspo.yaml", "pspo_released": "configs/pspo_released.yaml",
            "pps_skip": "configs/pps_skip.yaml"}


@pytest.fixture(scope="module", params=sorted(SAMPLERS))
def sampler_run(request, tmp_path_factory, tiny_model_path, six_prompts, run_main):
    """(name, argv(out, *more), folder): async at lag 1 with a PPS sampler, 3 steps, a checkpoint after each."""
    name = request.param

    def argv(out: str, *more: str) -> list[str]:
        return ["--config", SAMPLERS[name], f"--train.output_dir={out}", f"--model.name_or_path={tiny_model_path}",
                f"--data.train={six_prompts}", *SIX, *LAG1, *more]
    out = str(tmp_path_factory.mktemp(name) / "full")
    run_main("train", *argv(out))
    return name, argv, out


@pytest.mark.parametrize("checkpoint", [1, 2])
def test_every_sampler_resumes_exactly_one_step_off(sampler_run, checkpoint, run_main, tmp_path):
    # checkpoint-1 holds step 2 in flight, checkpoint-2 the run's last step: their prompts were drawn (the PPS
    # draw: its IS weights and statistics) before the checkpoint and are trained after the resume. The resumed run
    # logs the uninterrupted run's metrics and ends with its weights, AdamW, sampler and ERS state bit for bit.
    name, argv, full = sampler_run
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full, f"checkpoint-{checkpoint}"), os.path.join(resumed, f"checkpoint-{checkpoint}"))
    shutil.copy(os.path.join(full, "metrics.jsonl"), resumed)
    run_main("train", *argv(resumed, "--train.resume=auto"))
    assert_same(metrics(full), metrics(resumed))
    same_checkpoint(os.path.join(resumed, "checkpoint-3"), os.path.join(full, "checkpoint-3"))


def test_sampler_metrics_describe_the_step_they_are_logged_with(sampler_run):
    # One step off, step k+1 is drawn during step k: its draw, saved in checkpoint-k's sampler state, is what
    # step k+1 logs (not step k), as in sync mode
    name, _, full = sampler_run
    rows = {r["step"]: r for r in metrics(full)}
    differ = False
    for k in (1, 2):
        state = torch.load(os.path.join(full, f"checkpoint-{k}", "trainer_state.pt"), weights_only=True)
        draw = state["sampler"]["last_sample"]
        if name == "pspo_released":
            assert (rows[k + 1]["pps_epoch"], rows[k + 1]["pps_repeat_frac"]) == (draw["epoch"], draw["repeat_frac"])
            continue
        raw = draw["raw_weights"]
        assert (rows[k + 1]["pps_is_max"], rows[k + 1]["pps_is_min"]) == (float(raw.max()), float(raw.min()))
        assert rows[k + 1]["pps_skipped"] == draw["skipped"]
        differ |= float(raw.min()) < float(raw.max())
    assert differ or name == "pspo_released", "every draw weighed its prompts alike: the test shows nothing"


def test_engine_logprobs_are_the_previous_weights(tiny_model_path, uninterrupted):
    # checkpoint-2's step in flight (step 2) was generated by θ_1: scored with checkpoint-1's weights it gives
    # the engine's log-probs (up to the kernels); with checkpoint-2's (θ_2, an lr 1e-3 step later) it does not
    state = torch.load(os.path.join(uninterrupted, "checkpoint-2", "inflight.pt"), weights_only=True)
    assert (state["step"], state["version"]) == (2, 1)
    from pspo.training.model import load_tokenizer
    from pspo.tasks.data import prompt_sets, data_rows
    from pspo.training.config import load_config
    cfg = load_config(None, args(tiny_model_path, "unused", *LAG1)[2:])
    tok = load_tokenizer(tiny_model_path)
    train, _ = prompt_sets(cfg, tok, data_rows(cfg))
    prompts = [train.ids[i] for i in state["indices"].tolist() for _ in range(4)]
    gaps = []
    for ckpt in ("checkpoint-1", "checkpoint-2"):
        policy = build_policy(os.path.join(uninterrupted, ckpt), chunk_tokens=2048)
        ids, attention = batch_inputs(prompts, state["completion_ids"], state["mask"], tok.pad_token_id)
        with torch.no_grad():
            logp, _ = policy(ids, attention, state["mask"].shape[1], cfg.rollout.temperature)
        gaps.append(float(((logp - state["logprobs"]).abs() * state["mask"]).max()))
    # θ_1: the decoding loop's kernels against one forward over the whole completion, ~1e-5 nats here
    assert gaps[0] < 1e-4 and gaps[1] > 1e-2, gaps


def test_two_ranks_match_one(tmp_path, tiny_model_path, uninterrupted, launch_train):
    # FSDP2 over 2 gloo ranks, one engine: rank 0 stages and hands each rank its rows; the update is
    # rank-invariant up to the order of the gradient sums (as in sync mode, test_loop.test_two_nodes_match_one_process)
    out = str(tmp_path / "two")
    launch_train(args(tiny_model_path, out, *LAG1), nproc=2)
    assert_same(metrics(uninterrupted), metrics(out), rel=1e-4, aside=("rollout_calls", "padding_frac"))
    # (a call per rank; each rank pads its own micro-batches)


def test_engine_killed_is_one_line_exit_2(tmp_path, tiny_model_path, gone):
    with training(args(tiny_model_path, str(tmp_path / "run"), *LAG1)) as proc:
        engine = int(read_until(proc, r"engines: 1 × hf \(pid (\d+)\)").group(1))
        os.kill(engine, signal.SIGKILL)
        start_s = time.monotonic()
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - start_s
    err = proc.stderr.read()
    assert code == 2 and elapsed < 5, (code, elapsed, err[-2000:])
    assert err.strip().splitlines()[-1] == (f"error: rollout.engines: engine 0 (pid {engine}) was killed by SIGKILL "
                                            "while starting") and "Traceback" not in err
    assert gone(engine) and not os.path.exists(tmp_path / "run" / "config.yaml")   # refused before its folder
