"""Verifiable rewards of the released recipes, docs/methods.md §5: accuracy (math-verify), format
(`<think>..</think>` then a boxed answer) and cosine length-scaled accuracy; and PaddleNLP's
knights-and-knaves reward (docs/related.md §A), `knights` (pspo/tasks/knights_reward.py). PSPO*'s
process reward (`prm`, docs/related.md §C) is a model's, scored beside them on the whole batch
(`StepReward`, pspo/related/prm.py) and summed with them. DAPO's soft overlong punishment
(`overlong_penalty`, docs/methods.md §9) depends on a completion's token count, which the loop adds
after scoring (`with_overlong_penalty`); the random reward of the control reward.kind=random
(`with_random_reward`, docs/methods.md §5) on its seed.

Knights-and-knaves golds ("(1) Zoey is a knight\n(2) ..."; pspo/tasks/knights.py) are not math: for
them `accuracy` is the K&K exact match (1.0 iff `knights` scores 3: format passed and every role
right) and `format` the K&K tag check, so the logged accuracy and format rates, the data check
(pspo/tasks/data.py: `check_gold_answer`) and evaluation mean the same for both tasks, and a K&K
preset sets reward.accuracy 0 and reward.knights 1.

Every reward function is a pure function (prompt, completion, gold) -> float. `score_completions`
runs them on a batch, in the calling process or in a pool of worker processes
(pspo/tasks/reward_pool.py: the same calls under the same guard, so the same scores), and turns a raise
or a run past `timeout_s` into a score of 0 counted in `failures`, except `GoldAnswerError`: a
gold answer math-verify cannot parse is an error in the data and propagates (the released code
scored it a free 1.0). Data loading checks every gold first (pspo/tasks/data.py) and leaves such rows
out. A gold is first brought to what math-verify parses (pspo/tasks/golds.py: escaped dollars, `\\!`,
e-notation, `$...$` delimiters).

Time limits. math-verify's own `signal.alarm` guards are switched off (`parsing_timeout=None`,
`timeout_seconds=None`; its one-time warning saying so is silenced): every reward-function call
runs under one guard of ours instead, a per-call SIGALRM timer (pspo/tasks/reward_pool.py, which
also runs the calls in worker processes).

Input caps (cost of a pathological completion). math-verify sees only the answer part: the text
from the last `\\boxed` on, at most MAX_ANSWER_CHARS characters (else the last MAX_ANSWER_CHARS
characters), so a 100k-character completion costs what a short one does; a longer boxed answer
is cut, stops parsing, and scores 0. An answer part nesting brackets deeper than
MAX_BRACKET_DEPTH scores 0 unparsed: the LaTeX parser is exponential in bare nesting
(`{{{..1..}}}` 12 deep took 3 s, 15 deep 38 s). LRU caches memoize the parse of each gold and
of each answer part and the verdict of each (answer part, gold) pair: the identical answers of
a group cost one check, and an answer recurring under another gold is not parsed again.

torch is imported only where the result tensors are built: reward workers import this module for
its functions and guard, and start in ~0.7 s without torch instead of ~2 s with it.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from math_verify import parse, verify

from pspo.tasks.golds import answer_latex, parse_gold
from pspo.tasks.knights_reward import assistant_turn, knights_format_ok, knights_people, knights_reward
from pspo.tasks.reward_pool import RewardFn, RewardPool, score_calls

if TYPE_CHECKING:
    from torch import Tensor

    from pspo.tasks.data import PromptSet
    from pspo.training.config import RewardConfig

MAX_ANSWER_CHARS = 300       # characters of the answer part math-verify sees (a 300-char sum: ~0.5 s)
MAX_BRACKET_DEPTH = 10       # deeper ( [ { nesting in the answer part scores 0 without parsing
COSINE_MAX_LEN = 1000        # L_max of the cosine reward, characters (§5)


# ---- accuracy --------------------------------------------------------------------------------

def _answer_part(completion: str) -> str:
    """What math-verify sees of a completion: from the last \\boxed on, or the tail; capped."""
    start = completion.rfind("\\boxed")
    if start >= 0:
        return completion[start:start + MAX_ANSWER_CHARS]
    return completion[-MAX_ANSWER_CHARS:]


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return deepest


@functools.lru_cache(maxsize=65536)
def _parse_answer(answer: str) -> tuple:
    # Parsing (~2.4 ms) dominates verify (~0.1 ms), and one answer recurs under many golds.
    if _bracket_depth(answer) > MAX_BRACKET_DEPTH:
        return ()
    return tuple(parse(answer, parsing_timeout=None))


@functools.lru_cache(maxsize=65536)
def _is_correct(answer: str, gold: str) -> bool:
    """The pure, memoized check: verify(parse(gold), parse(answer)). Gold first: it is the target."""
    target = parse_gold(gold)                           # raises GoldAnswerError before any 0.0
    predicted = _parse_answer(answer_latex(answer, gold))
    return bool(predicted) and verify(list(target), list(predicted), timeout_seconds=None)


def accuracy_reward(prompt: str, completion: str, gold: str) -> float:
    """1.0 if math-verify finds the completion's final answer equal to `gold`, else 0.0.
    A knights-and-knaves gold: 1.0 iff the K&K reward is 3 (exact match)."""
    if knights_people(gold) is not None:
        return 1.0 if knights_reward(prompt, completion, gold) == 3.0 else 0.0
    return 1.0 if _is_correct(_answer_part(completion), gold) else 0.0


# ---- format ----------------------------------------------------------------------------------

_THINK_LAYOUT = re.compile(r"\s*<think>.*?</think>(.*)", re.DOTALL)


def _last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{` in `text` up to its matching `}`; None if unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start + len("\\boxed{"), len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            if depth == 0:
                return text[start + len("\\boxed{"):end]
            depth -= 1
    return None


def format_reward(prompt: str, completion: str, gold: str) -> float:
    """1.0 iff the completion is the layout the R1 prompt asks for, else 0.0. Exact rule:
    (1) `<think>` and `</think>` each occur exactly once; (2) the completion is optional
    whitespace, `<think>`, anything (possibly empty), `</think>`, then the answer part; (3) the
    last `\\boxed{` of the answer part has a matching `}` and non-blank content between them.
    Text around the box in the answer part is allowed; a box inside the think block does not count.
    A knights-and-knaves gold: 1.0 iff the K&K format check passes (pspo/tasks/knights_reward.py).
    """
    if knights_people(gold) is not None:
        return 1.0 if knights_format_ok(assistant_turn(prompt, completion)) else 0.0
    if completion.count("<think>") != 1 or completion.count("</think>") != 1:
        return 0.0
    layout = _THINK_LAYOUT.fullmatch(completion)
    if layout is None:                                   # text before <think>, or </think> first
        return 0.0
    boxed = _last_boxed_content(layout.group(1))
    return 1.0 if boxed is not None and boxed.strip() else 0.0


# ---- cosine ----------------------------------------------------------------------------------

def cosine_reward(prompt: str, completion: str, gold: str, max_len: int = COSINE_MAX_LEN) -> float:
    """Length-scaled accuracy, §5: correct 0.75 + 0.25·cos(π·min(L, L_max)/L_max) (1.0 -> 0.5),
    wrong -0.25 + 0.25·cos(...) (0.0 -> -0.5); L = len(completion) in characters."""
    # Departure from the released code: L is clamped at L_max, so the cosine does not wrap.
    cos = math.cos(math.pi * min(len(completion), max_len) / max_len)
    correct = accuracy_reward(prompt, completion, gold) == 1.0
    return 0.75 + 0.25 * cos if correct else -0.25 + 0.25 * cos


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "cosine": cosine_reward,
    "knights": knights_reward,
}


# ---- batch scoring with time limits ----------------------------------------------------------

@dataclass
class RewardResult:
    rewards: Tensor                  # (N,) float32, Σ_name weights[name] * components[name]
    components: dict[str, Tensor]    # name -> (N,) float32 raw values, 0 where the call failed
    failures: dict[str, int]         # name -> number of calls that raised or timed out


Score = Callable[[list[int], list[str]], RewardResult]   # (train rows, completion texts) -> their rewards


class StepReward(Protocol):
    """A reward computed beside the functions above, for the whole batch at once: pspo/related/prm.py's PRM
    (PSPO*'s process reward, docs/related.md §C: a model forward on the trainer's device, so neither in
    a worker nor under the alarm guard); named here so that this module needs nothing from it."""

    def __call__(self, completions: list[str]) -> list[float]: ...


def score_completions(prompts: list[str], completions: list[str], golds: list[str], *,
                      weights: dict[str, float], timeout_s: float = 5.0,
                      pool: RewardPool | None = None, prm: StepReward | None = None) -> RewardResult:
    """Score N completions with every function named in `weights`, in `pool`'s worker processes if
    one is given, else in this process (main thread only); the result is the same either way. The
    weight "prm" names the process reward `prm` (docs/related.md §C), scored here on the whole batch.

    A weight of 0 means "computed and logged, not rewarded": the training loop logs format and
    accuracy rates whatever their weights. A call that raises or runs past `timeout_s` seconds
    scores 0 and counts in failures[name]; GoldAnswerError propagates.
    """
    import torch                                         # here, not at the top: see the module docstring

    n = len(completions)
    if len(prompts) != n or len(golds) != n:
        raise ValueError(f"score_completions: expected equal lengths, got {len(prompts)} prompts, "
                         f"{n} completions, {len(golds)} golds")
    unknown = sorted(set(weights) - set(REWARD_FUNCTIONS) - {"prm"})
    if unknown:
        raise ValueError(f"reward weights: unknown reward {unknown}, expected names from "
                         f"{sorted(REWARD_FUNCTIONS)} or prm")
    if "prm" in weights and prm is None:
        raise ValueError("reward weights: 'prm' needs a process reward model (prm=...)")
    if not timeout_s > 0:
        raise ValueError(f"reward timeout_s: expected > 0, got {timeout_s}")
    # looked up per call: tests may swap them
    fns = {name: REWARD_FUNCTIONS[name] for name in weights if name != "prm"}
    score = pool.score if pool is not None else score_calls
    values, failures = score(fns, prompts, completions, golds, timeout_s)
    if "prm" in weights:                                 # a model: an error in it stops the run
        values["prm"] = prm(completions)
    components = {name: torch.tensor(v, dtype=torch.float32) for name, v in values.items()}  # (N,)
    rewards = torch.zeros(n, dtype=torch.float32)                                          # (N,)
    for name, weight in weights.items():
        if weight != 0:                                  # 0 * a logged value never enters the sum
            rewards += weight * components[name]
    return RewardResult(rewards, components, failures)


def reward_scorer(reward: RewardConfig, train: PromptSet, pool: RewardPool,
                  prm: StepReward | None) -> Score:
    """The run's score(rows, texts): the rewards of completions of these train rows under the config's
    reward section, in the pool's workers. Accuracy and format are always scored (logged even at
    weight 0; on K&K golds they are the K&K exact match and tag check); cosine, knights and the
    process reward (`prm`, docs/related.md §C) only when weighted."""
    weights = {"accuracy": reward.accuracy, "format": reward.format}
    optional = ("cosine", "knights", "prm")
    weights.update({k: getattr(reward, k) for k in optional if getattr(reward, k)})

    def score(rows: list[int], texts: list[str]) -> RewardResult:
        prompts, golds = [train.texts[i] for i in rows], [train.examples[i].answer for i in rows]
        return score_completions(prompts, texts, golds, weights=weights, timeout_s=reward.timeout_s, pool=pool,
                                 prm=prm)
    return score


def gather_scores(scored: RewardResult, G: int) -> tuple[Tensor, Tensor]:
    """This rank's rewards and successes (N,) -> every rank's, (B, G) each: the replicated ERS and PPS
    state sees the whole batch on every rank. The successes (PPS's Beta counts) are the accuracy, or with
    reward.kind=random the draw that replaced it: a control's sampler sees no verified accuracy. Collective."""
    from pspo.training import distributed                # torch: not in the reward workers' import
    rewards = distributed.all_gather_rows(scored.rewards.view(-1, G))
    success = scored.components.get("random", scored.components["accuracy"])
    return rewards, distributed.all_gather_rows(success.view(-1, G))


def with_random_reward(scored: RewardResult, seeds: Tensor, rate: float, weight: float) -> RewardResult:
    """reward.kind=random, a control (docs/methods.md §5): every reward becomes weight·b, b ~ Bernoulli(rate),
    drawn from a hash of the completion's seed (engines/sampling.py: a hash of the run's seed, the step, the
    prompt's key and the sample's index), so b depends on neither the ranks nor the batch, and a resume draws
    it again; b is kept as the component "random", the verified accuracy stays (logged). seeds (N,) int64."""
    import torch
    from pspo.engines.sampling import MUL2, mix, shr
    u = (shr(mix(seeds.to(torch.int64) ^ MUL2), 11).double() + 0.5) * 2.0 ** -53      # (N,) uniform in (0, 1)
    b = (u < rate).float()                                                             # (N,)
    return RewardResult(weight * b, {**scored.components, "random": b}, scored.failures)


# ---- soft overlong punishment (DAPO) -------------------------------------------------------------

def overlong_penalty(lengths: Tensor, max_len: int, cache: int) -> Tensor:
    """DAPO's soft overlong punishment, docs/methods.md §9 (Yu et al. 2025, eq. 13), per completion:

        R_length(y) = 0                                  |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                    = -1                                 |y| > L_max

    lengths (N,) |y| in tokens (the stop token included); max_len L_max (rollout.max_new_tokens); cache
    L_cache >= 1 (reward.overlong_cache). -> (N,) float32 in [-1, 0]."""
    excess = lengths.float() - (max_len - cache)                 # (N,) tokens past the expected length
    return -(excess.clamp(min=0) / cache).clamp(max=1.0)


def with_overlong_penalty(scored: RewardResult, lengths: Tensor, max_len: int, cache: int) -> RewardResult:
    """scored with R_length (`overlong_penalty`) added to every reward, weight 1 as DAPO adds it, and kept
    as the reward component "overlong" (logged as overlong_penalty). lengths (N,) tokens."""
    penalty = overlong_penalty(lengths, max_len, cache)          # (N,)
    return RewardResult(scored.rewards + penalty, {**scored.components, "overlong": penalty}, scored.failures)
