"""The reward pool (pspo/tasks/reward_pool.py): the trainer's scores and failure counts from worker
processes, the per-call limit kept in the worker, a hang the guard cannot end or a dead worker
costing exactly one call, and no process left behind.

This module imports no torch at the top: workers import it to load the test rewards below, and
start faster without it."""
import gc
import json
import os
import signal
import sys
import time
import types

import pytest

from pspo import rewards
from pspo.tasks.reward_pool import GRACE_S, RewardPool, resolve_workers
from pspo.rewards import score_completions
from pspo.tasks.golds import GoldAnswerError

KK_GOLD = "(1) Michael is a knight\n(2) Zoey is a knave"
KK_RIGHT = "<think>r</think><answer>(1) Michael is a knight\n(2) Zoey is a knave</answer>"


# Test rewards, at module level so that workers load them by reference (the module and the name).
def _raises(prompt: str, completion: str, gold: str) -> float:
    if "7" in completion:
        raise KeyError("boom")
    return float(len(completion) % 5)


def _sleepy(prompt: str, completion: str, gold: str) -> float:
    if completion == "HANG":
        time.sleep(60)                   # a Python-level hang: the worker's own SIGALRM ends it
    return 1.0


def _stuck(prompt: str, completion: str, gold: str) -> float:
    if completion == "HANG":             # beyond the guard's reach, like one long C call
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)
    return 1.0


def _crash(prompt: str, completion: str, gold: str) -> float:
    if completion == "CRASH":
        os._exit(3)
    return 1.0


def _hang_once(prompt: str, completion: str, gold: str) -> float:
    """format_reward, except that the first call of a run hangs beyond the guard's reach."""
    marker = os.environ["PSPO_TEST_HANG_MARKER"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        _stuck(prompt, "HANG", gold)
    return rewards.format_reward(prompt, completion, gold)


@pytest.fixture(scope="module")
def pool():
    with_workers = RewardPool(2)
    yield with_workers
    with_workers.close()


def _same(a: rewards.RewardResult, b: rewards.RewardResult) -> None:
    assert a.rewards.tolist() == b.rewards.tolist()
    assert {k: v.tolist() for k, v in a.components.items()} == {k: v.tolist() for k, v in b.components.items()}
    assert a.failures == b.failures


def _workers(env_text: str = "") -> set[int]:
    """Running reward workers (from /proc) whose environment contains `env_text`."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as f, open(f"/proc/{pid}/environ") as g:
                if "reward_pool" in f.read() and env_text in g.read():
                    found.add(int(pid))
        except OSError:                  # exited meanwhile, or not ours
            continue
    return found


def test_pool_scores_equal_the_trainers(pool, monkeypatch):
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "raises", _raises)
    math_cases = [
        ("<think>2+2</think>\\boxed{4}", "4"),                               # right
        ("<think>2+2</think>\\boxed{5}", "4"),                               # wrong
        ("<think>x</think>\\boxed{0.5}", "\\frac{1}{2}"),                    # right, another form
        ("\\boxed{\\frac{1}{", "1"),                                         # unparsable answer
        ("the answer is 17", "17"),                                          # no box: the tail is read
        ("", "3"),
        ("<think>" + "blah " * 20000 + "</think>\\boxed{57}", "57"),         # 100k characters
        ("\\boxed{" + "{" * 15 + "1" + "}" * 15 + "}", "1"),                 # nesting past the cap
        ("I think <think>x</think>\\boxed{7}", "7"),                         # right, bad layout
    ]
    kk_cases = [(KK_RIGHT, KK_GOLD), ("<think>r</think><answer>nobody</answer>", KK_GOLD), ("x", KK_GOLD)]
    cases = (math_cases + kk_cases) * 4                                      # 48: chunks of 6 over 2 workers
    prompts, completions, golds = ["p"] * len(cases), [c for c, _ in cases], [g for _, g in cases]
    weights = {"accuracy": 1.0, "format": 0.5, "cosine": 2.0, "raises": 0.1}
    alone = score_completions(prompts, completions, golds, weights=weights)
    pooled = score_completions(prompts, completions, golds, weights=weights, pool=pool)
    _same(pooled, alone)
    assert pooled.components["accuracy"].tolist()[:12] == [1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 0]
    assert pooled.failures == {"accuracy": 0, "format": 0, "cosine": 0, "raises": 4 * 3}   # the 3 sevens
    kk = {"accuracy": 0.0, "format": 0.0, "knights": 1.0}
    n = len(kk_cases)
    kk_alone = score_completions(["p"] * n, [c for c, _ in kk_cases], [KK_GOLD] * n, weights=kk)
    kk_pooled = score_completions(["p"] * n, [c for c, _ in kk_cases], [KK_GOLD] * n, weights=kk, pool=pool)
    _same(kk_pooled, kk_alone)
    assert kk_pooled.rewards.tolist() == [3.0, -1.0, -3.0]    # format ±1 + answer 2 / -2 / -2


def test_a_bad_gold_raises_the_same_error_from_the_pool(pool):
    # knights on a math gold is a data error: the first one (by reward, then row) propagates
    args = (["p"] * 3, [KK_RIGHT] * 3, [KK_GOLD, "82", "83"])
    weights = {"format": 1.0, "knights": 1.0}
    with pytest.raises(GoldAnswerError) as alone:
        score_completions(*args, weights=weights)
    with pytest.raises(GoldAnswerError) as pooled:
        score_completions(*args, weights=weights, pool=pool)
    assert str(pooled.value) == str(alone.value) and "'82'" in str(pooled.value)


def test_the_worker_times_out_a_slow_call_itself(pool, monkeypatch):
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "sleepy", _sleepy)
    replaced, t0 = pool.replaced, time.perf_counter()
    out = score_completions(["p"] * 3, ["a", "HANG", "b"], ["1"] * 3, weights={"sleepy": 1.0}, timeout_s=0.3, pool=pool)
    assert time.perf_counter() - t0 < 3.0                      # 0.3 s, not 60 s
    assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.failures == {"sleepy": 1}
    assert pool.replaced == replaced                           # the worker's guard did it: nobody killed


def test_a_hang_beyond_the_guard_is_killed_and_costs_one_call(pool, monkeypatch, capfd):
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "stuck", _stuck)
    replaced, t0 = pool.replaced, time.perf_counter()
    completions = ["a", "HANG", "b", "c", "d", "e"]
    out = score_completions(["p"] * 6, completions, ["1"] * 6, weights={"stuck": 1.0, "format": 0.0}, timeout_s=0.3,
                            pool=pool)
    elapsed = time.perf_counter() - t0
    assert 0.3 + GRACE_S <= elapsed < 10.0                     # the trainer's deadline, then a new worker
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert out.failures == {"stuck": 1, "format": 0}           # format of "HANG" was still scored
    assert pool.replaced == replaced + 1
    assert "was silent past timeout_s=0.3 s" in capfd.readouterr().err
    again = score_completions(["p"] * 6, completions[:1] * 6, ["1"] * 6, weights={"stuck": 1.0}, timeout_s=0.3,
                              pool=pool)
    assert again.rewards.tolist() == [1.0] * 6 and pool.replaced == replaced + 1


def test_a_dead_worker_costs_one_call_and_is_replaced(pool, monkeypatch, capfd):
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "crash", _crash)
    replaced = pool.replaced
    out = score_completions(["p"] * 4, ["a", "CRASH", "b", "c"], ["1"] * 4, weights={"crash": 1.0}, pool=pool)
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 1.0] and out.failures == {"crash": 1}
    assert pool.replaced == replaced + 1 and "died (exit code 3)" in capfd.readouterr().err
    before = score_completions(["p"], ["<think>x</think>\\boxed{4}"], ["4"], weights={"accuracy": 1.0})
    after = score_completions(["p"], ["<think>x</think>\\boxed{4}"], ["4"], weights={"accuracy": 1.0}, pool=pool)
    _same(after, before)


def test_functions_a_worker_cannot_load_are_scored_here(pool, monkeypatch):
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "local", lambda p, c, g: float(len(c)))
    with pytest.warns(UserWarning, match="cannot be sent to a worker"):           # does not pickle
        out = score_completions(["p"] * 2, ["ab", "abc"], ["1"] * 2, weights={"local": 1.0}, pool=pool)
    assert out.rewards.tolist() == [2.0, 3.0]
    module = types.ModuleType("only_in_the_trainer")                               # pickles, does not load
    exec("def reward(prompt, completion, gold):\n    return 2.0", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "here", module.reward)
    with pytest.warns(UserWarning, match="No module named 'only_in_the_trainer'"):
        out = score_completions(["p"] * 8, ["c"] * 8, ["1"] * 8, weights={"here": 1.0}, pool=pool)
    assert out.rewards.tolist() == [2.0] * 8 and out.failures == {"here": 0}
    replaced = pool.replaced
    out = score_completions(["p"] * 8, ["c"] * 8, ["1"] * 8, weights={"here": 1.0}, pool=pool)   # not tried again
    assert out.rewards.tolist() == [2.0] * 8 and pool.replaced == replaced
    _same(score_completions(["p"], ["\\boxed{1}"], ["1"], weights={"accuracy": 1.0}, pool=pool),  # the pool still works
          score_completions(["p"], ["\\boxed{1}"], ["1"], weights={"accuracy": 1.0}))


def test_close_and_garbage_collection_leave_no_process():
    closed, dropped = RewardPool(1), RewardPool(1)
    pids = closed.pids + dropped.pids
    deadline = time.monotonic() + 30        # a worker just forked shows the parent's command line until its exec
    while not _workers() >= set(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _workers() >= set(pids)
    closed.close()
    closed.close()                                             # idempotent
    del dropped
    gc.collect()
    assert not _workers() & set(pids)
    out = score_completions(["p"], ["\\boxed{1}"], ["1"], weights={"accuracy": 1.0}, pool=closed)
    assert out.rewards.tolist() == [1.0]                       # a closed pool scores in this process


def test_auto_workers_are_the_cores_left_per_rank(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_workers(-1, train_threads=1) == 7             # 64 cores / 8 ranks - 1 thread
    assert resolve_workers(3, train_threads=1) == 3              # as given
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve_workers(-1, train_threads=2) == 0             # this machine: score in the trainer


def test_reward_workers_config_is_checked():
    from pspo.training.config import ConfigError, load_config
    assert load_config(None).reward.workers == -1
    assert load_config(None, ["--reward.workers=2"]).reward.workers == 2
    with pytest.raises(ConfigError, match=r"^reward\.workers: expected >= 0 processes, or -1 for auto"):
        load_config(None, ["--reward.workers=-2"])


@pytest.mark.slow
def test_a_run_survives_a_reward_that_hangs(tmp_path, tiny_model_path, run_main, monkeypatch):
    # A run of train.py (in this process: conftest's run_main) whose format reward is _hang_once: its
    # first call blocks SIGALRM and sleeps, so the trainer kills the worker after 0.5 + 1 s; that
    # call scores 0 and counts, the run goes on and leaves no worker behind.
    marker = str(tmp_path / "hung")
    monkeypatch.setenv("PSPO_TEST_HANG_MARKER", marker)                   # the workers inherit it
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "format", _hang_once)
    out = str(tmp_path / "run")
    ran = run_main("train", "--config", "configs/grpo.yaml", f"--train.output_dir={out}",
                   f"--model.name_or_path={tiny_model_path}", "--train.max_steps=2", "--train.prompts_per_step=4",
                   "--rollout.num_generations=4", "--data.eval=", "--train.progress=false", "--reward.workers=1",
                   "--reward.timeout_s=0.5")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2] and os.path.exists(marker)
    assert sum(r["reward_failures"] for r in rows) == 1         # the hung call, once
    assert "reward pool: a worker was silent past timeout_s=0.5 s" in ran.err
    assert not _workers(marker)                                # the run's workers are gone
