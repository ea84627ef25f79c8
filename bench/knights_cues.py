"""How far surface cues go on knights-and-knaves: a yardstick for what the tiny K&K model has learned.

    python bench/knights_cues.py            # the table of bench/RESULTS.md (a few seconds, no model)
    # adds a model's greedy accuracy per size (a folder, or builtin:tiny-knights):
    python bench/knights_cues.py --model PATH

A cue predictor names each person's role from that person's own statement alone, never solving the
puzzle: it looks up the statement's shape (`cue`) in a table counted on the train split of
builtin:knights and answers the role seen more often with that shape (ties: knight). Two shapes:
  op      the operator, whether the first claim is about the speaker, and its polarity
  full    the operator and, for each claim, whether it is about the speaker and its polarity
Its exact-match rate on the test split (every person right, as knights_reward's +3) is what a
model can get without any logic; chance is 2^-n. Version 3 of the tiny K&K model scored below the op
row on every size (bench/RESULTS.md, section 10): it had not learned even this cue, and RL on it found
none.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pspo.tasks.knights import SIZES, Puzzle, split_puzzles  # noqa: E402

SHAPES = ("op", "full")


def cue(puzzle: Puzzle, person: int, shape: str) -> tuple:
    """The surface features of person's own statement: ("and", True, False) = an "and" whose first
    claim is "<speaker> is a knave" (op shape); the full shape lists (about self, knight) per claim."""
    op, *claims = puzzle.statements[person]
    if shape == "op":
        return (op, claims[0][0] == person, claims[0][1])
    return (op, *((who == person, knight) for who, knight in claims))


def fit(train: list[Puzzle], shape: str) -> dict[tuple, bool]:
    """cue -> the role (True = knight) seen more often with it on `train`; ties go to knight."""
    counts: dict[tuple, Counter] = {}
    for p in train:
        for i, knight in enumerate(p.solution):
            counts.setdefault(cue(p, i, shape), Counter())[knight] += 1
    return {key: c[True] >= c[False] for key, c in counts.items()}


def exact_match(table: dict[tuple, bool], test: list[Puzzle], shape: str) -> float:
    """Share of `test` puzzles whose every role the table gets right (an unseen cue: knight)."""
    right = sum(all(table.get(cue(p, i, shape), True) == knight for i, knight in enumerate(p.solution))
                for p in test)
    return right / len(test)


def splits(n: int, test_per_size: int = 100, train_per_size: int = 200) -> tuple[list[Puzzle], list[Puzzle]]:
    """(train, test) puzzles of n people: the builtin:knights splits."""
    return tuple(list(split_puzzles(n, split, test_per_size, train_per_size)) for split in ("train", "test"))


def _model_accuracy(path: str) -> dict[int, float]:
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from pspo.tasks.knights import builtin_knights
    from pspo.offline.builtin import resolve_model_path
    from pspo.offline.tiny_knights import greedy_accuracy_by_size
    path = resolve_model_path(path)
    model, tokenizer = Qwen2ForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    return greedy_accuracy_by_size(model, tokenizer, builtin_knights("test", test_per_size=100))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="also score this K&K model's greedy answers (100 test puzzles per size)")
    args = ap.parse_args()
    model = _model_accuracy(args.model) if args.model else {}
    print("| people | chance | cue: op | cue: full |" + (" model (greedy) |" if model else ""))
    print("|---|---|---|---|" + ("---|" if model else ""))
    for n in SIZES:
        train, test = splits(n)
        cells = [f"{0.5 ** n:.3f}"] + [f"{exact_match(fit(train, s), test, s):.2f}" for s in SHAPES]
        cells += [f"{model[n]:.2f}"] if model else []
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\nExact match on the 100 test puzzles per size; the cue tables are counted on the 200 train "
          "puzzles per size (builtin:knights splits).")


if __name__ == "__main__":
    main()
