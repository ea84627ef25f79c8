"""The knights-and-knaves reward of PaddleNLP's recipe (docs/related.md §A), a pure function
(prompt, completion, gold) -> float registered in rewards.py as `knights`.

Format +1 / -1 (each of <think>, </think>, <answer>, </answer> exactly once, in that order);
answer +2 exact, -1.5 parsed but wrong, -2 unparsable or format failed: totals in {3, -0.5, -1, -3}.
The ground truth is read from the gold lines "(1) Zoey is a knight\n(2) ..." as the released code does.
"""
from __future__ import annotations

import functools
import re

from pspo.tasks.golds import GoldAnswerError

KNIGHTS_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
ASSISTANT_MARK = "<|im_start|>assistant"
# the released code's, per gold line
_GOLD_ROLE = re.compile(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", re.IGNORECASE)


@functools.lru_cache(maxsize=4096)
def _knights_gold(gold: str) -> tuple[tuple[str, str], ...] | None:
    """The released code's ground truth: on each line, the first alphabetic word followed later by knight or
    knave gives (name, role), a later line overriding an earlier one of the same name. None unless
    every non-blank line has one (a math gold never does)."""
    lines = [line.strip() for line in gold.split("\n") if line.strip()]
    matches = [_GOLD_ROLE.search(line) for line in lines]
    if not lines or not all(matches):
        return None
    return tuple({m.group(1): m.group(2).lower() for m in matches}.items())


def knights_people(gold: str) -> int | None:
    """Number of people of a knights-and-knaves gold ("(1) Zoey is a knight\n..."), None for any
    other gold."""
    roles = _knights_gold(gold)
    return None if roles is None else len(roles)


def assistant_turn(prompt: str, completion: str) -> str:
    """The text the released code scores: what follows "<|im_start|>assistant". The released code
    scores a whole decoded sequence and prepends "\n<|im_start|>assistant\n<think>" when that mark is
    absent, because its prompts end with "<|im_start|>assistant\n<think>". Our completions never hold
    the chat prefix and our prompts end where the assistant starts, so the equivalent is: a
    completion holding the mark (a whole sequence) is scored after its first one, as the released
    code does; otherwise the completion is scored, preceded by "<think>" only when the prompt ends
    with "<think>" (PaddleNLP's src). A model answering our own prompts writes its <think> itself."""
    if ASSISTANT_MARK in completion:
        return completion.split(ASSISTANT_MARK, 1)[1]
    return ("<think>" if prompt.rstrip().endswith("<think>") else "") + completion


def knights_format_ok(text: str) -> bool:
    """Each of <think>, </think>, <answer>, </answer> exactly once, in that order."""
    if any(text.count(tag) != 1 for tag in KNIGHTS_TAGS):
        return False
    positions = [text.find(tag) for tag in KNIGHTS_TAGS]
    return positions == sorted(positions)


def _knights_answer(answer: str, roles: tuple[tuple[str, str], ...]) -> bool | None:
    """None if the answer does not parse (the lower-case count of "knight" plus "knave" is not the
    number of people, or a name lacks "NAME is a knight|knave"); else whether every role is right."""
    lower = answer.lower()
    if lower.count("knight") + lower.count("knave") != len(roles):
        return None
    predicted = {}
    for name, _ in roles:
        found = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
        if found is None:
            return None
        predicted[name] = found.group(1).lower()
    return predicted == dict(roles)


def knights_reward(prompt: str, completion: str, gold: str) -> float:
    """The K&K reward, docs/related.md §A: format +1 / -1 (`knights_format_ok` on `assistant_turn`)
    plus answer +2 (exact), -1.5 (parses, wrong), -2 (does not parse, empty, or the format failed).
    Totals: 3, -0.5, -1, -3. The answer is the last <answer> block's stripped content: with the
    format passed there is exactly one. A gold that is not a K&K solution raises GoldAnswerError."""
    roles = _knights_gold(gold)
    if roles is None:
        shown = gold if len(gold) <= 200 else gold[:200] + "..."
        raise GoldAnswerError(f"gold answer {shown!r} is not a knights-and-knaves solution "
                              "(expected lines like '(1) Zoey is a knight')")
    text = assistant_turn(prompt, completion)
    if not knights_format_ok(text):
        return -1.0 - 2.0
    answer = text[text.find("<answer>") + len("<answer>"):text.find("</answer>")].strip()
    verdict = _knights_answer(answer, roles) if answer else None
    return 1.0 + (-2.0 if verdict is None else 2.0 if verdict else -1.5)
