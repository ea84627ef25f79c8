"""Prompt datasets: a hub name or a local jsonl/json/parquet file, and the built-in offline task.

Every dataset becomes a list of `Example(problem, answer)`; the prompt is the problem in the
model's chat template (with the reference recipes' system prompt, unless the config says
otherwise). The built-in task, `builtin:arithmetic`, is a FIXED seeded set of 2-digit additions
(500 train / 500 test, disjoint): prompts recur across epochs, and answers are checked by the
same math-verify reward as real math.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

BUILTIN_ARITHMETIC = "builtin:arithmetic"

# The open-rs / Open-R1 recipes' system prompt: reason in <think>, answer in \boxed{}.
DEFAULT_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process is enclosed within <think> </think>, followed by the final answer "
    "in \\boxed{}, i.e., <think> reasoning process here </think> The answer is \\boxed{answer here}."
)


class DataError(ValueError):
    """A dataset cannot be used; the message is one line naming the file/field/dataset."""


@dataclass(frozen=True)
class Example:
    problem: str      # the question the prompt is built from
    answer: str       # gold answer text, e.g. "82" or "\\frac{1}{2}"


def _arithmetic_pairs(seed: int) -> list[tuple[int, int]]:
    """All 8100 ordered pairs a, b in 10..99, in a fixed seeded order."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs


def builtin_arithmetic(split: str, num_examples: int = 500, seed: int = 1234) -> list[Example]:
    """The built-in task: "test" is the first num_examples pairs of the seeded order, "train" the
    next num_examples, "warmup" all the rest (what the tiny model's supervised warm-up sees)."""
    pairs = _arithmetic_pairs(seed)
    ranges = {"test": (0, num_examples), "train": (num_examples, 2 * num_examples),
              "warmup": (2 * num_examples, len(pairs))}
    if split not in ranges:
        raise DataError(f"{BUILTIN_ARITHMETIC}: unknown split {split!r}, expected one of {', '.join(ranges)}")
    lo, hi = ranges[split]
    return [Example(f"{a}+{b}=?", str(a + b)) for a, b in pairs[lo:hi]]


def load_examples(name: str, split: str = "train", problem_field: str = "problem",
                  answer_field: str = "answer", max_examples: int | None = None) -> list[Example]:
    """builtin:arithmetic | a local .jsonl/.json/.parquet file | a hub dataset name -> examples."""
    if name == BUILTIN_ARITHMETIC:
        examples = builtin_arithmetic(split)
    else:
        rows = _load_rows(name, split)
        columns = list(rows.column_names)
        for field in (problem_field, answer_field):
            if field not in columns:
                raise DataError(f"{name}: no field {field!r}; the fields are {', '.join(columns)}")
        examples = [Example(str(p), str(a)) for p, a in zip(rows[problem_field], rows[answer_field])]
    if max_examples:
        examples = examples[:max_examples]
    if not examples:
        raise DataError(f"{name}: the dataset (split {split!r}) is empty")
    return examples


def _load_rows(name: str, split: str):
    import datasets  # imported late: slow, and not needed for the built-in task

    datasets.disable_progress_bars()
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    ext = os.path.splitext(name)[1].lower()
    if ext in builders:
        if not os.path.isfile(name):
            raise DataError(f"{name}: file not found")
        try:   # a local file is one split, whatever its name
            return datasets.load_dataset(builders[ext], data_files=name, split="train")
        except Exception as e:  # noqa: BLE001 - datasets raises many types for a malformed file
            raise DataError(f"{name}: cannot read as {builders[ext]} ({_first_line(e)})") from None
    if os.path.exists(name):
        raise DataError(f"{name}: expected a .jsonl, .json or .parquet file or a hub dataset name")
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - hub errors: missing dataset, split, network
        raise DataError(f"{name}: cannot load split {split!r} from the hub ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def format_prompt(tokenizer, problem: str, system_prompt: str) -> str:
    """The problem as the model's chat prompt, ending where the assistant starts writing."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": problem})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
