"""Verifiable rewards, ALGORITHMS.md §5: each a pure function (prompt, completion, gold) -> float.

- accuracy: math-verify `verify(parse(gold), parse(answer))` -> 1 or 0. A gold answer that does not
  parse is a data error (`GoldAnswerError`), never a free 1.0 as in the reference code.
- format:   1 if the completion is `<think>...</think>` (one block, at the start) followed by an
  answer that contains `\\boxed{...}`, as the prompt asks; else 0.
- cosine:   length-scaled accuracy with L = completion characters clamped at L_max (default 1000):
  correct 0.75 + 0.25·cos(π·L/L_max), wrong -0.25 + 0.25·cos(π·L/L_max). (The reference code does
  not clamp L, so its cosine wraps around; we clamp.)

`score_completions` runs every function named in `weights` (weight 0 = computed for logging
only) under a per-call time limit: a call that raises or runs past `timeout_s` scores 0 and is
counted in `failures`. The limit is a SIGALRM timer, so it needs the main thread (train.py and
eval.py score there); math-verify's own alarm-based limits are switched off so the two cannot
clash. Only the end of a completion is parsed (from its last `\\boxed`, at most
`ANSWER_CHARS` characters), so 100k-character completions cost no more than short ones.
"""
from __future__ import annotations

import logging
import math
import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
from math_verify import parse, verify
from torch import Tensor

ANSWER_CHARS = 1000           # characters of a completion that reach the parser
COSINE_MAX_LEN = 1000         # L_max of the cosine reward, in characters (§5)
# Our own timer replaces math-verify's; its one-time "timeout disabled" notice and its per-call
# parse-failure warnings would only be noise (failures are counted in RewardResult instead).
logging.getLogger("math_verify").setLevel(logging.ERROR)
_FORMAT = re.compile(r"\s*<think>((?:(?!</?think>).)*)</think>((?:(?!</?think>).)*)", re.DOTALL)


class GoldAnswerError(ValueError):
    """A gold answer math-verify cannot parse: an error in the data, reported, never scored."""


class RewardTimeout(Exception):
    pass


def _wrap_gold(gold: str) -> str:
    """math-verify reads LaTeX inside $...$; a bare `\\frac{1}{2}` would parse to nothing."""
    return gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"


@lru_cache(maxsize=1 << 14)
def _parsed_gold(gold: str) -> tuple:
    parsed = parse(_wrap_gold(gold.strip()), parsing_timeout=None)
    if not parsed:
        raise GoldAnswerError(f"gold answer {gold!r} does not parse with math-verify")
    return tuple(parsed)


def check_gold_answer(gold: str) -> None:
    """Raise GoldAnswerError if `gold` cannot be parsed (train.py checks every row up front)."""
    _parsed_gold(gold)


def _answer_part(completion: str) -> str:
    start = completion.rfind("\\boxed")
    return completion[start:start + ANSWER_CHARS] if start >= 0 else completion[-ANSWER_CHARS:]


@lru_cache(maxsize=1 << 16)
def _is_correct(answer: str, gold: str) -> bool:
    """Memoized: the same (answer, gold) pair recurs often within and across steps."""
    gold_parsed = list(_parsed_gold(gold))
    predicted = parse(answer, parsing_timeout=None)
    return bool(predicted) and bool(verify(gold_parsed, predicted, timeout_seconds=None))


def accuracy_reward(prompt: str, completion: str, gold: str) -> float:
    return 1.0 if _is_correct(_answer_part(completion), gold) else 0.0


def format_reward(prompt: str, completion: str, gold: str) -> float:
    m = _FORMAT.fullmatch(completion)
    return 1.0 if m is not None and "\\boxed{" in m.group(2) else 0.0


def cosine_reward(prompt: str, completion: str, gold: str, max_len: int = COSINE_MAX_LEN) -> float:
    cos = math.cos(math.pi * min(len(completion), max_len) / max_len)
    if accuracy_reward(prompt, completion, gold) == 1.0:
        return 0.75 + 0.25 * cos
    return -0.25 + 0.25 * cos


REWARD_FUNCTIONS: dict[str, Callable[[str, str, str], float]] = {
    "accuracy": accuracy_reward, "format": format_reward, "cosine": cosine_reward}


@dataclass
class RewardResult:
    rewards: Tensor                   # (N,) float32, Σ_k weight_k · component_k
    components: dict[str, Tensor]     # name -> (N,) raw values (0 where the call failed)
    failures: dict[str, int]          # name -> calls that raised or timed out


@contextmanager
def _time_limit(seconds: float):
    """Raise RewardTimeout in the main thread after `seconds` (no limit in other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise RewardTimeout()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score_completions(prompts: list[str], completions: list[str], golds: list[str],
                      weights: dict[str, float], timeout_s: float = 5.0) -> RewardResult:
    """Score N completions with every function named in `weights`; weighted sum -> rewards."""
    unknown = set(weights) - set(REWARD_FUNCTIONS)
    if unknown:
        raise ValueError(f"reward: unknown reward function(s) {sorted(unknown)}, expected {sorted(REWARD_FUNCTIONS)}")
    n = len(completions)
    components: dict[str, Tensor] = {}
    failures: dict[str, int] = {}
    total = torch.zeros(n)
    for name, weight in weights.items():
        fn, values, failed = REWARD_FUNCTIONS[name], torch.zeros(n), 0
        for i, (prompt, completion, gold) in enumerate(zip(prompts, completions, golds)):
            try:
                with _time_limit(timeout_s):
                    values[i] = fn(prompt, completion, gold)
            except GoldAnswerError:
                raise
            except (Exception, RewardTimeout):  # noqa: BLE001 - any failure of a scorer scores 0
                failed += 1
        components[name], failures[name] = values, failed
        total += weight * values
    return RewardResult(total, components, failures)
