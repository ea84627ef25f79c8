"""What every dataset becomes: `Example(problem, answer)` rows, and `DataError` when it cannot.

The lowest module of the data path: pspo/tasks/knights.py builds K&K puzzles as Examples, pspo/tasks/data.py
loads every dataset (and re-exports both names, which the rest of the project imports from it).
"""
from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """A dataset cannot be used; the message is one line naming the file/field/dataset."""


@dataclass(frozen=True)
class Example:
    problem: str      # the question text the prompt is built from
    answer: str       # gold answer text, e.g. "82" or "\\frac{1}{2}"
    chat_formatted: bool = False   # problem is already the whole chat prompt (PaddleNLP K&K src): used as is
