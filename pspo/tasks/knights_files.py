"""Knights-and-knaves puzzles in files (docs/related.md §A): the two layouts a local K&K file may have,
read as `Example`s, and the data.train_people filter.

- the hub data set's (K-and-K/knights-and-knaves): `quiz`, `names`, `solution` (+ solution_text_format);
  the problem is the quiz followed by knights.KNIGHTS_INSTRUCTION, as for a built-in puzzle;
- PaddleNLP's ppo-kk jsonl: `src` (a prompt already in the chat template) and `tgt` (the gold text).

data/samples/knights.jsonl and knights_paddle.jsonl hold rows of each (tests/components/test_knights.py
writes them from built-in puzzles and checks they load back).
"""
from __future__ import annotations

from pspo.tasks.example import DataError, Example
from pspo.tasks.knights import KNIGHTS_INSTRUCTION, solution_text
from pspo.tasks.knights_reward import knights_people

HUB_FIELDS = ("quiz", "names", "solution")     # K-and-K/knights-and-knaves (+ solution_text_format, ...)
PADDLE_FIELDS = ("src", "tgt")                 # {"src": [chat-templated prompt], "tgt": [gold text]}


def file_layout(columns: list[str]) -> str | None:
    """"paddle" | "hub" when a file's fields are one of the K&K layouts, else None."""
    if all(f in columns for f in PADDLE_FIELDS):
        return "paddle"
    if all(f in columns for f in HUB_FIELDS):
        return "hub"
    return None


def _first(value) -> str:
    """src/tgt hold a one-item list; a plain string is accepted too; None -> ""."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return "" if value is None else str(value)


def examples_from_rows(rows, layout: str) -> list[Example]:
    """Examples from a `datasets.Dataset` in a K&K layout.

    hub: problem = quiz + KNIGHTS_INSTRUCTION (as builtin puzzles); gold = solution_text_format
    when present, else built from names and solution (bools).
    paddle: problem = src[0], a prompt already in the chat template (the released code's ends with
    "<|im_start|>assistant\\n<think>"): `chat_formatted=True`, so `prompt_set` uses it as it is,
    never templated again (and without data.system_prompt); gold = tgt[0]."""
    if layout == "paddle":
        return [Example(_first(src), _first(tgt), chat_formatted=True)
                for src, tgt in zip(rows["src"], rows["tgt"])]
    formatted = rows["solution_text_format"] if "solution_text_format" in rows.column_names else None
    examples = []
    for i, (quiz, names, solution) in enumerate(zip(rows["quiz"], rows["names"], rows["solution"])):
        gold = formatted[i] if formatted is not None and formatted[i] else (
            solution_text(names, solution) if names and solution and len(names) == len(solution) else "")
        examples.append(Example(f"{quiz}\n{KNIGHTS_INSTRUCTION}" if quiz else "", gold))
    return examples


def with_people(name: str, examples: list[Example], people: tuple[int, ...]) -> list[Example]:
    """The examples whose gold names `people` persons (data.train_people: an RL curriculum on the
    sizes a model can learn). A row that is not a K&K puzzle (its gold is not "(1) X is a knight
    ...") is a DataError naming it: the filter would otherwise drop it silently."""
    kept = []
    for row, ex in enumerate(examples):
        n = knights_people(ex.answer)
        if n is None:
            raise DataError(f"{name}: data.train_people keeps K&K puzzles by their number of people, "
                            f"but row {row}'s gold is not a K&K answer ('(1) Zoey is a knight ...'): "
                            f"{ex.answer[:40]!r}")
        if n in people:
            kept.append(ex)
    if not kept:
        raise DataError(f"{name}: no puzzle of {', '.join(map(str, people))} people (data.train_people)")
    return kept
