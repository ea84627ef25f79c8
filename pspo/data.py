"""Prompt datasets: the built-in offline task, a local jsonl/json/parquet file, or a hub dataset.

Every dataset becomes a list of `Example(problem, answer)`; `format_prompt` turns a problem into
the model's chat prompt (with the reference recipes' R1 system prompt, or none). Answers are
checked by the math-verify accuracy reward (ALGORITHMS.md §5), so an answer is plain text such as
"82" or "\\frac{1}{2}".

The built-in task, `builtin:arithmetic`, needs nothing downloaded: 2-digit additions
"What is 47 + 35?" with a, b in 10..99 (8100 ordered pairs). One seeded shuffle of all pairs fixes
every split: "test" is its head, "train" its tail, and the tiny model's supervised warm-up
(pspo/tiny.py) uses everything in between, so the warm-up sees neither the RL training prompts nor
the test prompts and an RL gain on "test" is generalisation, not recall.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

BUILTIN_ARITHMETIC = "builtin:arithmetic"
BUILTIN_SPLITS = ("train", "test")
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}   # extension -> datasets builder

# The R1 prompt of the open-rs / Open-R1 recipes: reason in <think> </think>, answer in \boxed{}.
# Departure from the recipes' text: they also ask for <answer> </answer> tags (and print a literal
# "\boxed{{}}"); our format reward (ALGORITHMS.md §5) wants <think>..</think> then \boxed{...}.
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
    problem: str      # the question text the prompt is built from
    answer: str       # gold answer text, e.g. "82" or "\\frac{1}{2}"


def _arithmetic_example(a: int, b: int) -> Example:
    return Example(f"What is {a} + {b}?", str(a + b))


def _shuffled_pairs(seed: int) -> list[tuple[int, int]]:
    """All 8100 ordered pairs (a, b), a, b in 10..99, in one order fixed by `seed`."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)         # a private RNG: the global one is never touched
    return pairs


def builtin_arithmetic(split: str, num_examples: int = 500, seed: int = 1234) -> list[Example]:
    """The built-in task's fixed split: "test" = the first `num_examples` pairs of the seeded order,
    "train" = the last `num_examples` (disjoint whenever 2 * num_examples <= 8100)."""
    if split not in BUILTIN_SPLITS:
        raise DataError(f"{BUILTIN_ARITHMETIC}: unknown split {split!r}, expected one of {', '.join(BUILTIN_SPLITS)}")
    if not 1 <= num_examples <= 4050:
        raise DataError(f"{BUILTIN_ARITHMETIC}: num_examples must be in 1..4050 (disjoint splits), got {num_examples}")
    pairs = _shuffled_pairs(seed)
    chosen = pairs[:num_examples] if split == "test" else pairs[-num_examples:]
    return [_arithmetic_example(a, b) for a, b in chosen]


def warmup_examples(num_examples: int = 500, seed: int = 1234) -> list[Example]:
    """The pairs in neither builtin split (7100 with the defaults): the tiny model's warm-up data."""
    pairs = _shuffled_pairs(seed)
    return [_arithmetic_example(a, b) for a, b in pairs[num_examples:len(pairs) - num_examples]]


def load_examples(name: str, split: str = "train", problem_field: str = "problem",
                  answer_field: str = "answer", max_examples: int | None = None,
                  config: str | None = None) -> list[Example]:
    """`builtin:arithmetic` | a local .jsonl/.json/.parquet file | a hub dataset name -> examples.

    A local file is a single split: `split` is ignored for it. Answers are coerced to str
    (datasets often store numeric answers as int or float). `config` is a hub dataset's
    configuration name (e.g. "main" for openai/gsm8k)."""
    if max_examples is not None and max_examples < 1:
        raise DataError(f"{name}: max_examples must be >= 1 or None (all), got {max_examples}")
    if name == BUILTIN_ARITHMETIC:
        examples = builtin_arithmetic(split)
    else:
        rows = _load_rows(name, split, config)
        columns = list(rows.column_names)
        for field in (problem_field, answer_field):
            if field not in columns:
                raise DataError(f"{name}: no field {field!r}; the fields are: {', '.join(columns) or '(none)'}")
        problems, answers = rows[problem_field], rows[answer_field]
        for i, (problem, answer) in enumerate(zip(problems, answers)):
            if problem is None or answer is None:
                field = problem_field if problem is None else answer_field
                raise DataError(f"{name}: row {i} has no value in field {field!r}")
        examples = [Example(str(p), str(a)) for p, a in zip(problems, answers)]
    if max_examples is not None:
        examples = examples[:max_examples]
    if not examples:
        raise DataError(f"{name}: the dataset (split {split!r}) is empty")
    return examples


def _load_rows(name: str, split: str, config: str | None = None):
    """A `datasets.Dataset` for a local file (by extension) or a hub name (or a local folder)."""
    import datasets  # imported here: slow to import, and the built-in task does not need it

    datasets.disable_progress_bars()
    ext = os.path.splitext(name)[1].lower()
    if ext in LOCAL_BUILDERS:
        if not os.path.isfile(name):
            raise DataError(f"{name}: file not found")
        if os.path.getsize(name) == 0:   # datasets' own error for this is an unhelpful StopIteration
            raise DataError(f"{name}: the file is empty")
        builder = LOCAL_BUILDERS[ext]
        try:   # datasets puts a plain data file in a split called "train", whatever it holds
            return datasets.load_dataset(builder, data_files=os.path.abspath(name), split="train")
        except Exception as e:  # noqa: BLE001 - datasets raises many types for a malformed file
            raise DataError(f"{name}: cannot read it as {builder} ({_first_line(_root_cause(e))})") from None
    if os.path.isfile(name):
        raise DataError(f"{name}: expected a {', '.join(LOCAL_BUILDERS)} file or a hub dataset name")
    try:   # a hub name, or a local folder of data files; HF_DATASETS_OFFLINE / HF_HUB_OFFLINE apply
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - missing dataset, unknown split, no network, ...
        raise DataError(f"{name}: cannot load split {split!r} ({_first_line(e)})") from None


def _root_cause(e: BaseException) -> BaseException:
    """datasets wraps a parse error in a generic "An error occurred while generating the dataset"."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def prepare_prompts(examples: list[Example], tokenizer, system_prompt: str) -> tuple[list[str], list[list[int]]]:
    """Chat-formatted prompt text and token ids, computed once for the whole dataset."""
    texts = [format_prompt(tokenizer, ex.problem, system_prompt) for ex in examples]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return texts, ids


def check_golds(examples: list[Example], name: str) -> None:
    """A gold answer math-verify cannot parse is a data error, reported before any training or eval."""
    from pspo.rewards import GoldAnswerError, check_gold_answer   # math-verify is slow to import
    for row, ex in enumerate(examples):
        try:
            check_gold_answer(ex.answer)
        except GoldAnswerError as e:
            raise DataError(f"{name}: row {row}: {e}") from None


def format_prompt(tokenizer, problem: str, system_prompt: str) -> str:
    """The problem as the model's chat prompt, ending where the assistant starts writing.
    The system message is left out when `system_prompt` is ""."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": problem})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
