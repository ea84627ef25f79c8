"""Prompt datasets: the built-in offline task, a local jsonl/json/parquet file, or a hub dataset.

Every dataset becomes a list of `Example(problem, answer)` (pspo/tasks/example.py, beside DataError);
`format_prompt` turns a problem into the model's chat prompt (with the released recipes' R1
system prompt, or none). Answers are checked by the math-verify accuracy reward (docs/methods.md
§5), so an answer is plain text such as "82" or "\\frac{1}{2}" (pspo/tasks/golds.py turns stored numbers
and lists into such text).
The second built-in task, `builtin:knights` (knights-and-knaves puzzles, pspo/tasks/knights.py), has
golds "(1) Zoey is a knight\\n(2) ..." that the K&K reward checks instead (pspo/rewards.py).

`prompt_set` then decides, once at load time, which rows are used (row numbers count from 0), in
two passes:
- `usable_rows`, with no model: a row without a problem, or whose gold answer is missing or does not
  parse with math-verify, is left out and reported in one line per dataset (`data.bad_gold: skip`),
  or stops the run with a one-line DataError (`data.bad_gold: error`); it is never scored;
- `tokenized`, with the model's tokenizer: a prompt (chat template + system prompt, tokenized) longer
  than `data.max_prompt_tokens` is dropped, again reported in one line per dataset; prompts are never
  truncated mid-problem.
Reading a dataset and the first pass need no model: train.py and eval.py run them (`data_rows`) before
a model is built or loaded, so a mistake in the data stops a run in seconds.

The built-in task, `builtin:arithmetic`, needs nothing downloaded: 2-digit additions
"What is 47 + 35?" with a, b in 10..99 (8100 ordered pairs). One seeded shuffle of all pairs fixes
every split: "test" is its head, "train" its tail, and the tiny model's supervised warm-up
(pspo/offline/tiny.py) uses everything in between, so the warm-up sees neither the RL training prompts nor
the test prompts and an RL gain on "test" is generalisation, not recall.
"""
from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import random
from dataclasses import dataclass

from pspo.tasks import knights, knights_files
from pspo.training.distributed import print0
from pspo.tasks.example import DataError, Example
from pspo.tasks.golds import GoldAnswerError, gold_text, parse_gold
from pspo.tasks.knights_reward import knights_people
from pspo.training.config import SYSTEM_PROMPTS, Config, error_line

BUILTIN_ARITHMETIC = "builtin:arithmetic"
BUILTIN_SPLITS = ("train", "test")
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}   # extension -> datasets builder
TEXT_EXTENSIONS = (".jsonl", ".json")                                         # read as UTF-8 text
# read this much at a time to check UTF-8
UTF8_CHUNK_BYTES = 1 << 20

MAX_LISTED_ROWS = 10                          # row numbers named in a report line, then "..."


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
        raise DataError(f"{BUILTIN_ARITHMETIC}: unknown split {split!r}, "
                        f"expected one of {', '.join(BUILTIN_SPLITS)}")
    if not 1 <= num_examples <= 4050:
        raise DataError(f"{BUILTIN_ARITHMETIC}: num_examples must be in 1..4050 (disjoint splits), "
                        f"got {num_examples}")
    pairs = _shuffled_pairs(seed)
    chosen = pairs[:num_examples] if split == "test" else pairs[-num_examples:]
    return [_arithmetic_example(a, b) for a, b in chosen]


def warmup_examples(num_examples: int = 500, seed: int = 1234) -> list[Example]:
    """The pairs in neither builtin split (7100 with the defaults): the tiny model's warm-up data."""
    pairs = _shuffled_pairs(seed)
    return [_arithmetic_example(a, b) for a, b in pairs[num_examples:len(pairs) - num_examples]]


def load_examples(name: str, *, split: str = "train", problem_field: str = "problem",
                  answer_field: str = "answer", max_examples: int | None = None,
                  config: str | None = None, people: tuple[int, ...] = ()) -> list[Example]:
    """`builtin:arithmetic` | `builtin:knights` | a local .jsonl/.json/.parquet file | a hub dataset
    name -> examples.

    A local file is a single split: `split` is ignored for it. A file (or hub dataset) whose fields
    are a knights-and-knaves layout (the hub's quiz/names/solution, PaddleNLP's src/tgt) is read as
    K&K whatever problem_field/answer_field say (pspo/tasks/knights_files.py). Answers become text by `gold_text`
    (datasets store numeric answers as int or float, OlympiadBench a list); a missing value (None)
    becomes "", which `prompt_set` reports and leaves out. `config` is a hub dataset's
    configuration name (e.g. "main" for openai/gsm8k). `people` (data.train_people) keeps only the
    K&K puzzles of those numbers of people, before max_examples; any other row is a DataError."""
    if max_examples is not None and max_examples < 1:
        raise DataError(f"{name}: max_examples must be >= 1 or None (all), got {max_examples}")
    if name == BUILTIN_ARITHMETIC:
        examples = builtin_arithmetic(split)
    elif name == knights.BUILTIN_KNIGHTS:
        examples = knights.builtin_knights(split)
    else:
        rows = _load_rows(name, split, config)
        layout = knights_files.file_layout(list(rows.column_names))
        try:    # pyarrow decodes strings only here: a hub dataset or parquet file with bad bytes
            examples = (knights_files.examples_from_rows(rows, layout) if layout is not None
                        else _field_examples(name, rows, problem_field, answer_field))
        except UnicodeDecodeError as e:
            raise DataError(f"{name}: a text field is not valid UTF-8 "
                            f"({e.reason}, byte 0x{e.object[e.start]:02x})") from None
    if people:
        examples = knights_files.with_people(name, examples, people)
    if max_examples is not None:
        examples = examples[:max_examples]
    if not examples:
        raise DataError(f"{name}: the dataset (split {split!r}) is empty")
    return examples


def _field_examples(name: str, rows, problem_field: str, answer_field: str) -> list[Example]:
    columns = list(rows.column_names)
    for field in (problem_field, answer_field):
        if field not in columns:
            raise DataError(f"{name}: no field {field!r}; the fields are: {', '.join(columns) or '(none)'}")
    return [Example("" if p is None else str(p), gold_text(a))
            for p, a in zip(rows[problem_field], rows[answer_field])]


def _load_rows(name: str, split: str, config: str | None = None):
    """A `datasets.Dataset` for a local file (by extension) or a hub name (or a local folder).

    A local path is checked before datasets is imported (seconds): it exists, a data file is a file of a
    known extension, not empty, UTF-8 text (.jsonl/.json); a JSON syntax error is then named by file
    and line (`json_error`)."""
    ext = os.path.splitext(name)[1].lower()
    local = os.path.exists(name)
    if ext in LOCAL_BUILDERS or os.path.isfile(name):
        if os.path.isdir(name):
            raise DataError(f"{name}: a folder, expected a {', '.join(LOCAL_BUILDERS)} file")
        if not local:
            raise DataError(f"{name}: file not found")
        if ext not in LOCAL_BUILDERS:
            raise DataError(f"{name}: expected a {', '.join(LOCAL_BUILDERS)} file or a hub dataset name")
        if os.path.getsize(name) == 0:   # datasets' own error for this is an unhelpful StopIteration
            raise DataError(f"{name}: the file is empty")
        if ext in TEXT_EXTENSIONS:
            check_utf8(name)
    elif not local and (os.path.isabs(name) or name.startswith((".", "~"))):    # a path, not a hub id
        raise DataError(f"{name}: no such file or folder, expected a {', '.join(LOCAL_BUILDERS)} file, "
                        "a folder of them or a hub dataset name")
    import datasets  # imported here: slow to import, and the built-in task does not need it

    datasets.disable_progress_bars()
    with _datasets_quiet():
        if ext in LOCAL_BUILDERS:
            builder = LOCAL_BUILDERS[ext]
            try:   # datasets puts a plain data file in a split called "train", whatever it holds
                return datasets.load_dataset(builder, data_files=os.path.abspath(name), split="train")
            except Exception as e:  # noqa: BLE001 - datasets raises many types for a malformed file
                where = json_error(name) if builder == "json" else None
                raise DataError(where or f"{name}: cannot read it as {builder} "
                                f"({error_line(_root_cause(e))})") from None
        try:   # a hub name, or a local folder of data files; HF_DATASETS_OFFLINE / HF_HUB_OFFLINE apply
            return datasets.load_dataset(name, config, split=split)
        except Exception as e:  # noqa: BLE001 - missing dataset, unknown split, no network, ...
            raise DataError(f"{name}: cannot load split {split!r} ({error_line(e)})") from None


@contextlib.contextmanager
def _datasets_quiet():
    """datasets logs a malformed file on stderr before it raises; its error becomes one DataError line."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def json_error(path: str) -> str | None:
    """"path:line: ..." naming the first line of `path` that is not JSON (JSON lines: one object per
    line, blank lines allowed; or one JSON document), or None when it parses. Read only after datasets
    failed on the file, whose pyarrow error names a row of a block instead of a line of the file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return f"{path}: no rows (blank lines only)"
    try:
        json.loads(lines[first])
        as_lines = True
    except json.JSONDecodeError:
        as_lines = False                  # "[" or "{" alone on the first line: one document
    if not as_lines:
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        return None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return (f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno}); "
                    "expected one JSON object per line")
        if not isinstance(row, dict):
            return f"{path}:{number}: expected one JSON object per line, got a {type(row).__name__}"
    return None


def check_utf8(path: str) -> None:
    """DataError naming the byte offset and line of the first byte of `path` that is not UTF-8.

    datasets' json reader keeps such bytes and pyarrow fails on the row later, a long traceback
    from deep inside the reader; this reads the file once more, in chunks, before it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1                       # bytes and lines before the chunk
    with open(path, "rb") as f:
        while True:
            chunk = f.read(UTF8_CHUNK_BYTES)
            # a character's first bytes, from the last chunk
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:                      # e.object: the pending bytes + chunk
                where = offset - pending + e.start
                lines = line + e.object[:e.start].count(b"\n")
                raise DataError(f"{path}: not valid UTF-8 at byte {where} (line {lines}): byte "
                                f"0x{e.object[e.start]:02x}, {e.reason}; save the file as UTF-8") from None
            if not chunk:
                return
            offset, line = offset + len(chunk), line + chunk.count(b"\n")


def _root_cause(e: BaseException) -> BaseException:
    """datasets wraps a parse error in a generic "An error occurred while generating the dataset"."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def resolve_system_prompt(value: str) -> str:
    """`data.system_prompt`: "r1" -> R1_SYSTEM_PROMPT; any other value is the text itself ("" = none)."""
    return SYSTEM_PROMPTS.get(value, value)


def format_prompt(tokenizer, problem: str, system_prompt: str) -> str:
    """The problem as the model's chat prompt, ending where the assistant starts writing.
    `system_prompt` goes through `resolve_system_prompt`; the system message is left out when it is ""."""
    system_prompt = resolve_system_prompt(system_prompt)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": problem})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass
class Rows:
    """A dataset's rows as read, and those with a problem and a usable gold answer (`usable_rows`)."""
    label: str                     # names the dataset in reports and errors, e.g. "data.train x.jsonl"
    examples: list[Example]        # every row read, in file order
    usable: list[int]              # row numbers (from 0) with a problem and a gold that parses
    left_out: list[str]            # "row (why)" of each other row, reported by `tokenized`


@dataclass
class PromptSet:
    """The rows of a dataset a run uses, with their prompts, and how many rows were left out."""
    examples: list[Example]        # the kept rows, in file order
    texts: list[str]               # chat-formatted prompt of each kept row
    ids: list[list[int]]           # its token ids, each at most data.max_prompt_tokens long
    skipped: int = 0               # rows left out: no usable problem or gold answer + prompts too long


def data_rows(cfg: Config) -> tuple[Rows, Rows | None]:
    """The run's train and eval rows (the config's data section), read and their golds checked: every
    check of the data that needs no model, so train.py runs it before a model is built or loaded."""
    d = cfg.data
    rows = load_examples(d.train, split=d.train_split, problem_field=d.problem_field, answer_field=d.answer_field,
                         max_examples=d.max_train_examples or None, people=d.people)
    train = usable_rows(f"data.train {d.train}", rows, bad_gold=d.bad_gold)
    if not d.eval:
        return train, None
    rows = load_examples(d.eval, split=d.eval_split, problem_field=d.problem_field, answer_field=d.answer_field,
                         max_examples=d.max_eval_examples or None)
    return train, usable_rows(f"data.eval {d.eval}", rows, bad_gold=d.bad_gold)


def prompt_sets(cfg: Config, tokenizer,
                rows: tuple[Rows, Rows | None] | None = None) -> tuple[PromptSet, PromptSet]:
    """The run's train and eval prompts, formatted and tokenized from `rows` (`data_rows`; read here when
    None); prompts over data.max_prompt_tokens are left out and reported."""
    d = cfg.data
    train, evals = rows or data_rows(cfg)
    kwargs = dict(system_prompt=d.system_prompt, max_prompt_tokens=d.max_prompt_tokens)
    return (tokenized(train, tokenizer, **kwargs),
            PromptSet([], [], []) if evals is None else tokenized(evals, tokenizer, **kwargs))


def check_gold_answer(gold: str) -> None:
    """Raise GoldAnswerError unless `gold` is a K&K solution or parses with math-verify: the check each
    row passes before it is used (golds.py; the rewards score such a gold, docs/methods.md §5)."""
    if knights_people(gold) is None:
        parse_gold(gold)


def prompt_set(label: str, examples: list[Example], tokenizer, *, system_prompt: str, max_prompt_tokens: int,
               bad_gold: str = "skip") -> PromptSet:
    """The usable rows of `examples` with their prompts, tokenized once (module docstring): `usable_rows`
    then `tokenized`.

    `label` names the dataset in reports and errors, e.g. "data.train knoveleng/open-rs".
    bad_gold: "skip" (report in one line, leave out) | "error" (DataError at the first bad row)."""
    return tokenized(usable_rows(label, examples, bad_gold=bad_gold), tokenizer, system_prompt=system_prompt,
                     max_prompt_tokens=max_prompt_tokens)


def usable_rows(label: str, examples: list[Example], *, bad_gold: str = "skip") -> Rows:
    """The rows with a problem and a gold answer that parses; the others left out (bad_gold "skip": kept in
    Rows.left_out, reported by `tokenized`, so that nothing is printed before a later input is refused)
    or the first one a DataError ("error"). No tokenizer: checked before a model is loaded."""
    usable, bad = [], []                    # row numbers; "row (why)" of each unusable row
    for row, ex in enumerate(examples):
        why = ("no problem text" if not ex.problem.strip()
               else "no gold answer" if not ex.answer.strip() else None)
        if why is None:
            try:
                check_gold_answer(ex.answer)
            except GoldAnswerError:
                why = f"gold answer {_shown(ex.answer)} does not parse with math-verify"
        if why is None:
            usable.append(row)
        elif bad_gold == "error":
            raise DataError(f"{label}: row {row}: {why} (data.bad_gold=error; 'skip' leaves such rows out)")
        else:
            bad.append(f"{row} ({why})")
    if not usable:
        raise DataError(f"{label}: no rows left of {len(examples)} ({len(bad)} without a usable gold answer)")
    return Rows(label, examples, usable, bad)


def tokenized(rows: Rows, tokenizer, *, system_prompt: str, max_prompt_tokens: int) -> PromptSet:
    """The usable rows' chat prompts, tokenized once; a prompt longer than `max_prompt_tokens` is left
    out; each kind of row left out is reported in one line (module docstring)."""
    label, examples, usable = rows.label, rows.examples, rows.usable
    if rows.left_out:
        print0(f"{label}: left out {len(rows.left_out)} of {len(examples)} rows without a usable problem and "
               f"gold answer (data.bad_gold=skip): {_listed(rows.left_out)}")
    # a chat-formatted problem (PaddleNLP's K&K src) is the prompt itself: never templated twice
    texts = [examples[row].problem if examples[row].chat_formatted else
             format_prompt(tokenizer, examples[row].problem, system_prompt) for row in usable]
    # verbose=False: transformers would warn about prompts longer than the model; they are dropped next
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    kept = [i for i, prompt in enumerate(ids) if len(prompt) <= max_prompt_tokens]
    too_long = [usable[i] for i, prompt in enumerate(ids) if len(prompt) > max_prompt_tokens]
    if too_long:
        print0(f"{label}: dropped {len(too_long)} of {len(examples)} prompts longer than "
               f"data.max_prompt_tokens={max_prompt_tokens} ({_listed(too_long)})")
    bad = len(examples) - len(usable)
    if not kept:
        raise DataError(f"{label}: no rows left of {len(examples)} ({bad} without a usable gold answer, "
                        f"{len(too_long)} prompts longer than data.max_prompt_tokens={max_prompt_tokens})")
    return PromptSet([examples[usable[i]] for i in kept], [texts[i] for i in kept], [ids[i] for i in kept],
                     bad + len(too_long))


def _shown(text: str, limit: int = 40) -> str:
    """A gold answer quoted as written (backslashes single), on one line, at most `limit` characters."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return "'" + text.replace("\n", "\\n") + "'"


def _listed(rows: list) -> str:
    """"row 7" | "rows 7, 19, ..." (at most MAX_LISTED_ROWS named)."""
    shown = ", ".join(str(row) for row in rows[:MAX_LISTED_ROWS])
    return ("row " if len(rows) == 1 else "rows ") + shown + (", ..." if len(rows) > MAX_LISTED_ROWS else "")
