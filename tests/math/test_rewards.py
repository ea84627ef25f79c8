"""Rewards, docs/methods.md §5: hand-worked values, the format rule, time limits, adversarial input."""
import math
import signal
import threading
import time

import pytest
import torch

from pspo import rewards
from pspo.rewards import (RewardResult, accuracy_reward, cosine_reward, format_reward, overlong_penalty,
                          score_completions, with_overlong_penalty)
from pspo.tasks.data import check_gold_answer
from pspo.tasks.golds import GoldAnswerError, parse_gold


def clear_memo() -> None:
    for cached in (rewards._is_correct, rewards._parse_answer, parse_gold):
        cached.cache_clear()


@pytest.mark.parametrize("gold, completion, expected", [
    ("\\frac{1}{2}", "<think></think>\\boxed{\\frac{1}{2}}", 1.0),   # bare LaTeX gold gets $...$
    ("\\frac{1}{2}", "<think></think>\\boxed{0.5}", 1.0),            # numeric equality
    ("\\frac{1}{2}", "<think></think>\\boxed{2}", 0.0),
    ("82", "<think></think>\\boxed{82}", 1.0),
    ("82", "<think></think>\\boxed{83}", 0.0),
    ("$\\frac{1}{2}$", "the answer is \\boxed{1/2}", 1.0),           # already delimited gold
    ("\\boxed{7}", "<think>3+4</think>\\boxed{7}", 1.0),
    ("82", "<think>\\boxed{82}</think>\\boxed{81}", 0.0),            # the LAST box is the answer
    ("82", "no answer here", 0.0),                                   # nothing parsable -> 0
    ("82", "", 0.0),
    ("82", "<think></think>\\boxed{}", 0.0),
])
def test_accuracy_reward(gold, completion, expected):
    assert accuracy_reward("", completion, gold) == expected


# math-verify "parses" broken LaTeX to the raw string only ("\\frac{2}{" -> ['\\frac{2}{']): that counts as unparsed
@pytest.mark.parametrize("gold", ["", "   ", "\\boxed{}", "\\frac{2}{", "???", "\\sqrt{"])
def test_unparsable_gold_raises_naming_it(gold):
    with pytest.raises(GoldAnswerError, match="does not parse") as info:
        accuracy_reward("", "\\boxed{1}", gold)
    assert repr(gold) in str(info.value)                          # the message names the gold
    with pytest.raises(GoldAnswerError):
        check_gold_answer(gold)
    # a data error must surface through the batch scorer, never be scored 0 (or a free 1.0)
    with pytest.raises(GoldAnswerError):
        score_completions(["p"], ["\\boxed{1}"], [gold], weights={"accuracy": 1.0})
    check_gold_answer("\\frac{1}{2}")                                 # a good gold passes


@pytest.mark.parametrize("completion, expected", [
    ("<think>7+8=15</think>\\boxed{15}", 1.0),
    ("<think></think>\\boxed{82}", 1.0),                  # what the tiny model's warm-up teaches
    ("  \n<think>x</think>\nso \\boxed{\\frac{1}{2}} done", 1.0),  # leading space, text around box
    ("<think>x</think>\\boxed{15}<|im_end|>", 1.0),
    ("I think <think>x</think>\\boxed{15}", 0.0),         # text before <think>
    ("<think>x</think>15", 0.0),                          # no box
    ("<think>\\boxed{15}</think>", 0.0),                  # box only inside the think block
    ("<think>x</think>\\boxed{}", 0.0),                   # empty box
    ("<think>x</think>\\boxed{  }", 0.0),                 # blank box
    ("<think>x</think>\\boxed{15", 0.0),                  # unbalanced
    ("<think>a</think><think>b</think>\\boxed{1}", 0.0),  # two think blocks
    ("</think><think>x\\boxed{1}", 0.0),                  # wrong order
    ("\\boxed{15}", 0.0),                                 # no think block
])
def test_format_reward(completion, expected):
    assert format_reward("", completion, "15") == expected


def test_cosine_reward_hand_worked():
    # correct: .75 + .25cos(πL/1000): L=0 -> 1.0, L=500 -> .75 (cos π/2 = 0), L>=1000 -> .5 (clamped)
    # wrong: -.25 + .25cos(πL/1000): L=0 -> 0.0, L=500 -> -.25, L=2000 -> -.5 (clamped, no wrap)
    box = "\\boxed{7}"                                    # 9 characters
    pad = lambda L: " " * (L - len(box)) + box            # noqa: E731, completion of length L
    assert cosine_reward("", "", "7") == pytest.approx(0.0)          # L=0, wrong (no answer)
    assert cosine_reward("", pad(500), "7") == pytest.approx(0.75)
    assert cosine_reward("", pad(1000), "7") == pytest.approx(0.5)
    assert cosine_reward("", pad(2000), "7") == pytest.approx(0.5)
    assert cosine_reward("", pad(500), "8") == pytest.approx(-0.25)
    assert cosine_reward("", pad(2000), "8") == pytest.approx(-0.5)
    # L=9 correct: .75 + .25cos(.009π) = .75 + .25*.99960 = .99990; L=0 correct is the limit 1.0
    assert cosine_reward("", box, "7") == pytest.approx(0.75 + 0.25 * math.cos(math.pi * 0.009))
    assert cosine_reward("", box, "7", max_len=9) == pytest.approx(0.5)   # L = L_max


def test_score_completions_weighted_sum():
    completions = ["<think></think>\\boxed{5}", "<think></think>\\boxed{4}", "\\boxed{5}"]
    weights = {"accuracy": 2.0, "format": 1.0, "cosine": 0.0}
    out = score_completions(["p"] * 3, completions, ["5"] * 3, weights=weights)
    # accuracy [1,0,1], format [1,1,0] -> rewards 2*acc + 1*fmt = [3, 1, 2]; cosine logged only
    torch.testing.assert_close(out.components["accuracy"], torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(out.components["format"], torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(out.rewards, torch.tensor([3.0, 1.0, 2.0]))
    assert out.rewards.dtype == torch.float32 and out.rewards.shape == (3,)
    # cosine of the 24-char correct one: .75 + .25cos(.024π) = .99929
    assert out.components["cosine"][0].item() == pytest.approx(0.99929, abs=1e-5)
    assert out.failures == {"accuracy": 0, "format": 0, "cosine": 0}


def test_score_completions_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown reward"):
        score_completions(["p"], ["c"], ["1"], weights={"acuracy": 1.0})
    with pytest.raises(ValueError, match="equal lengths"):
        score_completions(["p"], ["c", "d"], ["1"], weights={"accuracy": 1.0})
    with pytest.raises(ValueError, match="timeout_s"):
        score_completions(["p"], ["c"], ["1"], weights={"accuracy": 1.0}, timeout_s=0)


def test_slow_and_raising_functions_score_zero_and_count(monkeypatch):
    def slow(prompt, completion, gold):
        time.sleep(5)
        return 1.0

    def broken(prompt, completion, gold):
        raise KeyError("boom")

    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "slow", slow)
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "broken", broken)
    t0 = time.perf_counter()
    out = score_completions(["p"] * 3, ["<think></think>\\boxed{1}"] * 3, ["1"] * 3,
                            weights={"slow": 1.0, "broken": 1.0, "accuracy": 1.0}, timeout_s=0.05)
    assert time.perf_counter() - t0 < 2.0                # 3 x 0.05 s, not 3 x 5 s
    assert out.failures == {"slow": 3, "broken": 3, "accuracy": 0}
    torch.testing.assert_close(out.components["slow"], torch.zeros(3))
    torch.testing.assert_close(out.rewards, torch.ones(3))   # only accuracy contributes


def test_outer_timer_and_handler_are_restored():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        score_completions(["p"], ["\\boxed{1}"], ["1"], weights={"accuracy": 1.0})
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0                  # re-armed with what was left
        signal.setitimer(signal.ITIMER_REAL, 0.01)       # our handler is back: it, not
        time.sleep(0.1)                                  # _RewardTimeout, runs on SIGALRM
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_score_completions_outside_main_thread_fails_clearly():
    errors = []

    def run():
        try:
            score_completions(["p"], ["\\boxed{1}"], ["1"], weights={"accuracy": 1.0})
        except RuntimeError as e:
            errors.append(str(e))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "main thread" in errors[0]
    assert accuracy_reward("", "\\boxed{1}", "1") == 1.0      # the pure function works anywhere


def test_long_completion_is_capped_and_fast():
    completion = "<think>" + "blah " * 20000 + "</think>\\boxed{57}"   # ~100k characters
    t0 = time.perf_counter()
    assert accuracy_reward("", completion, "57") == 1.0
    assert format_reward("", completion, "57") == 1.0
    assert time.perf_counter() - t0 < 1.0


def test_adversarial_completions_do_not_break_the_batch():
    clear_memo()                                         # measure real parsing, not the memo
    nasty = [
        "\\boxed{" * 5000,                                          # deeply nested, unbalanced
        "\\boxed{" + "{" * 15 + "1" + "}" * 15 + "}",               # exponential for the parser
        "\\boxed{" + "(" * 30 + "1" + ")" * 30 + "}",
        "\\boxed{" + "x^2+" * 25000 + "1}",                         # 100k characters of LaTeX
        "x" * 100_000,
        "}" * 1000 + "{" * 1000,                                    # unbalanced
        "<think></think>\\boxed{}",                                 # empty box
        "<think>数学</think>\\boxed{π}  é ü \u202e \x00",            # non-ASCII, control chars
        "$$" * 5000 + "\\frac{" * 3000,
        "<think></think>\\boxed{42}",                               # a normal one, still scored
    ]
    n = len(nasty)
    t0 = time.perf_counter()
    out = score_completions(["p"] * n, nasty, ["42"] * n,
                            weights={"accuracy": 1.0, "format": 1.0, "cosine": 1.0}, timeout_s=1.0)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, elapsed
    assert out.rewards.shape == (n,) and torch.isfinite(out.rewards).all()
    torch.testing.assert_close(out.components["accuracy"], torch.tensor([0.0] * (n - 1) + [1.0]))
    # only the non-ASCII one (a well-formed layout, wrong answer) and the normal one are formatted
    torch.testing.assert_close(out.components["format"], torch.tensor([0.0] * 7 + [1.0, 0.0, 1.0]))


def test_repeated_answers_hit_the_memo():
    clear_memo()
    completions = ["<think></think>\\boxed{57}"] * 8 + ["<think>long</think>\\boxed{57}"] * 8
    score_completions(["p"] * 16, completions, ["57"] * 16, weights={"accuracy": 1.0, "cosine": 1.0})
    info = rewards._is_correct.cache_info()
    # both completions have the same answer part "\boxed{57}": 1 miss, 31 hits (16 acc + 16 cos)
    assert (info.misses, info.hits) == (1, 31)


def test_timeout_interrupts_math_verify_itself(monkeypatch):
    # with the depth cap lifted, 15 bare nested braces take ~40 s in math-verify's LaTeX parser;
    # our BaseException must get through its `except Exception` blocks and count as a failure
    monkeypatch.setattr(rewards, "MAX_BRACKET_DEPTH", 100)
    clear_memo()
    completion = "\\boxed{" + "{" * 15 + "1" + "}" * 15 + "}"
    t0 = time.perf_counter()
    out = score_completions(["p"], [completion], ["1"], weights={"accuracy": 1.0}, timeout_s=0.2)
    assert time.perf_counter() - t0 < 2.0
    assert out.failures == {"accuracy": 1} and out.rewards.item() == 0.0


def test_overlong_penalty_is_dapos_eq_13_by_hand():
    # L_max = 20, L_cache = 5: no penalty up to 20 - 5 = 15 tokens; then (15 - |y|)/5: 16 -> -.2,
    # 18 -> -.6, 20 -> -1; past L_max -1 (an engine never returns more, the formula's third case)
    lengths = torch.tensor([3, 15, 16, 18, 20, 25])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 5), torch.tensor([0, 0, -0.2, -0.6, -1.0, -1.0]))
    # the paper's sizes: L_max = 20480, L_cache = 4096: 16384 -> 0, 18432 -> -2048/4096 = -.5
    torch.testing.assert_close(overlong_penalty(torch.tensor([16384, 18432]), 20480, 4096), torch.tensor([0.0, -0.5]))


def test_overlong_penalty_is_added_to_the_reward_and_kept_as_a_component():
    # rewards [1, 0] of completions of 18 and 4 tokens (L_max 20, L_cache 5): [1 - .6, 0 + 0]
    scored = RewardResult(torch.tensor([1.0, 0.0]), {"accuracy": torch.tensor([1.0, 0.0])}, {"accuracy": 0})
    shaped = with_overlong_penalty(scored, torch.tensor([18, 4]), 20, 5)
    torch.testing.assert_close(shaped.rewards, torch.tensor([0.4, 0.0]))
    torch.testing.assert_close(shaped.components["overlong"], torch.tensor([-0.6, 0.0]))
    assert shaped.components["accuracy"] is scored.components["accuracy"] and shaped.failures == {"accuracy": 0}
