"""The math benchmarks the PSPO paper reports (plus GSM8K): where they live and how to read them.

Each is a hub dataset with its own field names and answer format. `load_benchmark("math500")`
reads the hub copy; `load_benchmark("math500=path/to/file.jsonl")` reads a local copy with the
same fields (.jsonl / .json / .parquet), for offline machines; data/samples/ holds one small copy
of each format. Stored answers become gold text as for any dataset (pspo/tasks/golds.py: AMC23's
numbers, OlympiadBench's lists); GSM8K keeps the number after "####". Field names follow the
dataset cards as of 2026; if a hub copy changes, point `name=FILE` at a local copy.
"""
from __future__ import annotations

from dataclasses import dataclass

from pspo.tasks.data import DataError, Example, load_examples


@dataclass(frozen=True)
class Benchmark:
    hub: str                      # hub dataset name
    split: str
    problem_field: str
    answer_field: str
    config: str | None = None     # hub configuration name


BENCHMARKS = {
    "aime24": Benchmark("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "math500": Benchmark("HuggingFaceH4/MATH-500", "test", "problem", "answer"),
    "amc23": Benchmark("math-ai/amc23", "test", "question", "answer"),
    "minerva": Benchmark("math-ai/minervamath", "test", "question", "answer"),
    "olympiadbench": Benchmark("math-ai/olympiadbench", "test", "question", "final_answer"),
    "gsm8k": Benchmark("openai/gsm8k", "test", "question", "answer", config="main"),
}


def gold_answer(benchmark: str, stored: str) -> str:
    """The part of a benchmark's stored answer text that is the answer. GSM8K: the number after
    "####" without thousands commas, or "" (a row without a gold, reported and left out)."""
    if benchmark == "gsm8k":                         # "...reasoning...\n#### 1,234"
        return stored.rsplit("####", 1)[1].strip().replace(",", "") if "####" in stored else ""
    return stored


def load_benchmark(spec: str, max_examples: int | None = None) -> tuple[str, str, list[Example]]:
    """"name" (hub copy) or "name=FILE" (local copy, same fields) -> (name, source, examples);
    source is the hub name or FILE. Rows are not checked here: `data.prompt_set` does that."""
    name, _, path = spec.partition("=")
    if name not in BENCHMARKS:
        raise DataError(f"--benchmarks: unknown benchmark {name!r}; expected {', '.join(BENCHMARKS)} "
                        "(optionally name=FILE for a local copy)")
    b = BENCHMARKS[name]
    source = path or b.hub
    rows = load_examples(source, split=b.split, problem_field=b.problem_field, answer_field=b.answer_field,
                         max_examples=max_examples, config=None if path else b.config)
    return name, source, [Example(ex.problem, gold_answer(name, ex.answer)) for ex in rows]
