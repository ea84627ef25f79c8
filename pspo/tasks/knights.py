"""Knights-and-knaves (K&K) logic puzzles, PaddleNLP's task (docs/related.md §A).

An island's inhabitants are knights (every statement true) or knaves (every statement false);
each of n people (2..8) makes one statement, and the solver names who is which. Statements are
the public K&K set's kinds (K-and-K/knights-and-knaves, depth 2, width 2), in our own wording:
a claim "X is a knight" / "X is a knave", its negation "X is not a knight", and "and", "or",
"if .. then", "if and only if" between two different claims. A speaker never claims to be a
knave (a knight cannot say it and a knave would be telling the truth). Only puzzles with exactly
one consistent assignment are kept: person i's statement S_i must hold iff i is a knight, and the
solver checks all 2^n assignments (`solutions`, a plain loop; `_solution_mask`, the same check
on all assignments at once as bit masks, which generation uses).

`builtin:knights` (pspo/tasks/data.py) needs nothing downloaded. For each size n, one stream of
distinct puzzles seeded by (seed, n) fixes every split: its first `test_per_size` puzzles are
"test", the next `train_per_size` "train", and everything after them the warm-up pool of a
supervised K&K model (`warmup_examples`), so neither split is ever seen in warm-up. Distinct
means distinct statements (names aside): a logical puzzle never recurs under other names. Sizes
are interleaved (2, 3, .., 8, 2, 3, ..), so any prefix of a split is stratified by size.

Each puzzle becomes an `Example`: the problem is the puzzle text followed by KNIGHTS_INSTRUCTION
(a problem suffix, not a system prompt: the prompt asks for the released code's `<think>..</think>
<answer>..</answer>` layout under any data.system_prompt, and the arithmetic task is untouched);
the gold is the released code's `tgt` text "(1) Michael is a knight\\n(2) Zoey is a knave", one line per
person, so the number of people is its line count (knights_reward.knights_people). Local files in the
hub data set's layout and in PaddleNLP's src/tgt layout are read by knights_files.py.
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass
from typing import Iterator

from pspo.tasks.example import DataError, Example

BUILTIN_KNIGHTS = "builtin:knights"
SIZES = tuple(range(2, 9))              # people per puzzle
MAX_ATTEMPTS = 20_000                   # draws in a row without a new unique puzzle: the size is used up
KNIGHTS_INSTRUCTION = (
    "Think it through within <think> </think> tags, then state the identity of each character "
    "within <answer> </answer> tags, i.e., <answer> (1) Zoey is a knight\n(2) ... </answer>.")
# The fixed text that opens and closes every built-in puzzle (tiny_knights.py makes each one token).
ISLAND = ("A very special island is inhabited only by knights and knaves. Knights always tell the truth, "
          "and knaves always lie.")
QUESTION = "So who is a knight and who is a knave?"
NAMES = ("Michael", "Zoey", "Ethan", "Olivia", "Noah", "Emma", "Liam", "Sofia", "Lucas", "Mia",
         "Henry", "Grace", "Jack", "Chloe", "Owen", "Lily", "Samuel", "Aria", "David", "Nora",
         "Oliver", "Ruby", "Daniel", "Hazel", "Isaac", "Violet", "Leo", "Stella", "Caleb", "Alice",
         "Jacob", "Ivy", "Victor", "Elena", "Aaron", "Clara", "Felix", "Naomi", "Oscar", "Julia")
SAYINGS = ('{name} says, "{content}."', '{name} says that {content}.', '"{content}," {name} claims.',
           '{name} tells you that {content}.', 'According to {name}, "{content}."',
           '{name} states: "{content}."', 'In {name}\'s words: "{content}."',
           '{name} remarks that {content}.')
OPERATORS = ("claim", "not", "and", "or", "if", "iff")   # drawn uniformly, as the public generator does

Claim = tuple[int, bool]          # (person, knight): "person is a knight" (True) / "a knave" (False)
Statement = tuple                 # ("claim", c) | ("not", c) | (op, c1, c2) for op in and, or, if, iff


@dataclass(frozen=True)
class Puzzle:
    names: tuple[str, ...]             # n distinct names, the speakers in order
    statements: tuple[Statement, ...]  # statements[i] is said by names[i]
    solution: tuple[bool, ...]         # solution[i]: names[i] is a knight
    sayings: tuple[int, ...]           # index into SAYINGS of each person's sentence

    def text(self) -> str:
        """The puzzle as the public set words it (our own sentences)."""
        n, names = len(self.names), self.names
        people = f"{names[0]} and {names[1]}" if n == 2 else ", ".join(names[:-1]) + ", and " + names[-1]
        said = " ".join(_said(SAYINGS[k], names[i], statement_text(s, names))
                        for i, (s, k) in enumerate(zip(self.statements, self.sayings)))
        return f"{ISLAND} You meet {n} inhabitants: {people}. {said} {QUESTION}"

    def gold(self) -> str:
        """The released code's tgt text: "(1) Michael is a knight\\n(2) Zoey is a knave"."""
        return solution_text(self.names, self.solution)

    def example(self) -> Example:
        return Example(f"{self.text()}\n{KNIGHTS_INSTRUCTION}", self.gold())


def _said(saying: str, name: str, content: str) -> str:
    """One person's sentence; a quotation starts with a capital ("If Zoey is a knight then ...")."""
    if '"{content}' in saying:
        content = content[0].upper() + content[1:]
    return saying.format(name=name, content=content)


def solution_text(names: tuple[str, ...] | list[str], solution: tuple[bool, ...] | list[bool]) -> str:
    return "\n".join(f"({i + 1}) {name} is a {'knight' if knight else 'knave'}"
                     for i, (name, knight) in enumerate(zip(names, solution)))


def _claim_text(claim: Claim, names: tuple[str, ...], negated: bool = False) -> str:
    person, knight = claim
    return f"{names[person]} is {'not ' if negated else ''}a {'knight' if knight else 'knave'}"


def statement_text(statement: Statement, names: tuple[str, ...]) -> str:
    op, *claims = statement
    a = _claim_text(claims[0], names, negated=op == "not")
    if op in ("claim", "not"):
        return a
    b = _claim_text(claims[1], names)
    return {"and": f"{a} and {b}", "or": f"{a} or {b}",
            "if": f"if {a} then {b}", "iff": f"{a} if and only if {b}"}[op]


# ---- solver ----------------------------------------------------------------------------------

def holds(statement: Statement, knights: tuple[bool, ...]) -> bool:
    """Truth of one statement under an assignment (knights[i]: person i is a knight)."""
    op, *claims = statement
    a = knights[claims[0][0]] == claims[0][1]
    if op == "claim":
        return a
    if op == "not":
        return not a
    b = knights[claims[1][0]] == claims[1][1]
    return {"and": a and b, "or": a or b, "if": (not a) or b, "iff": a == b}[op]


def solutions(statements: tuple[Statement, ...]) -> list[tuple[bool, ...]]:
    """Every consistent assignment, by brute force over the 2^n: a knight's statement is true,
    a knave's false."""
    n = len(statements)
    return [knights for knights in itertools.product((True, False), repeat=n)
            if all(holds(s, knights) == knights[i] for i, s in enumerate(statements))]


@functools.lru_cache(maxsize=None)
def _knight_masks(n: int) -> tuple[int, ...]:
    """masks[p]: bit a set iff person p is a knight in assignment a (bit p of a), a < 2^n."""
    return tuple(sum(1 << a for a in range(2 ** n) if a >> p & 1) for p in range(n))


def _solution_mask(statements: tuple[Statement, ...]) -> int:
    """`solutions` on all 2^n assignments at once: bit a is set iff assignment a is consistent."""
    n = len(statements)
    masks, every = _knight_masks(n), (1 << 2 ** n) - 1
    truth = lambda c: masks[c[0]] if c[1] else every ^ masks[c[0]]   # noqa: E731  claim -> mask
    consistent = every
    for i, (op, *claims) in enumerate(statements):
        a = truth(claims[0])
        b = truth(claims[1]) if len(claims) > 1 else 0
        s = {"claim": a, "not": every ^ a, "and": a & b, "or": a | b,
             "if": (every ^ a) | b, "iff": every ^ (a ^ b)}[op]
        consistent &= every ^ (masks[i] ^ s)                 # S_i holds iff person i is a knight
    return consistent


# ---- generation ------------------------------------------------------------------------------

def _sample_claim(rng: random.Random, n: int, speaker: int) -> Claim:
    while True:
        claim = (rng.randrange(n), rng.random() < 0.5)
        if claim != (speaker, False):                        # "I am a knave" cannot be said
            return claim


def _sample_statement(rng: random.Random, n: int, speaker: int) -> Statement:
    op = OPERATORS[rng.randrange(len(OPERATORS))]
    first = _sample_claim(rng, n, speaker)
    if op in ("claim", "not"):
        return (op, first)
    while (second := _sample_claim(rng, n, speaker)) == first:  # two different claims
        pass
    return (op, first, second)


def puzzle_stream(n: int, seed: int) -> Iterator[Puzzle]:
    """Distinct puzzles of n people with a unique solution, in an order fixed by (seed, n).
    Ends when MAX_ATTEMPTS draws in a row find no new one (the 2-person kinds run out)."""
    if n not in SIZES:
        raise DataError(f"{BUILTIN_KNIGHTS}: puzzles have {SIZES[0]}..{SIZES[-1]} people, got {n}")
    rng = random.Random(seed * 100 + n)                      # a private RNG: the global one is untouched
    seen: set[tuple[Statement, ...]] = set()
    misses = 0
    while misses < MAX_ATTEMPTS:
        statements = tuple(_sample_statement(rng, n, i) for i in range(n))
        mask = _solution_mask(statements)
        if statements in seen or mask == 0 or mask & (mask - 1):   # seen, no solution, or several
            misses += 1
            continue
        misses = 0
        seen.add(statements)
        a = mask.bit_length() - 1                            # the one consistent assignment
        names = tuple(rng.sample(NAMES, n))
        sayings = tuple(rng.randrange(len(SAYINGS)) for _ in range(n))
        yield Puzzle(names, statements, tuple(bool(a >> p & 1) for p in range(n)), sayings)


@functools.lru_cache(maxsize=64)
def puzzles(n: int, count: int, seed: int = 1234) -> tuple[Puzzle, ...]:
    """The first `count` puzzles of `puzzle_stream(n, seed)`."""
    found = tuple(itertools.islice(puzzle_stream(n, seed), count))
    if len(found) < count:
        raise DataError(f"{BUILTIN_KNIGHTS}: only {len(found)} distinct {n}-person puzzles with a unique "
                        f"solution were found, {count} were asked for")
    return found


def _interleaved(per_size: dict[int, tuple[Puzzle, ...]]) -> list[Example]:
    """Round-robin over the sizes (2, 3, .., 8, 2, ..): every prefix is stratified."""
    rounds = itertools.zip_longest(*per_size.values())
    return [p.example() for row in rounds for p in row if p is not None]


def builtin_knights(split: str, test_per_size: int = 100, train_per_size: int = 200,
                    seed: int = 1234) -> list[Example]:
    """The fixed splits of `builtin:knights` (module docstring): "test" = puzzles
    [0, test_per_size) of each size's stream, "train" = the next train_per_size."""
    if split not in ("train", "test"):
        raise DataError(f"{BUILTIN_KNIGHTS}: unknown split {split!r}, expected one of train, test")
    return _interleaved({n: split_puzzles(n, split, test_per_size, train_per_size, seed) for n in SIZES})


def split_puzzles(n: int, split: str, test_per_size: int = 100, train_per_size: int = 200,
                  seed: int = 1234) -> tuple[Puzzle, ...]:
    """The n-person puzzles of one split: "test" = [0, test_per_size) of the size's stream, "train"
    the next train_per_size."""
    start, count = (0, test_per_size) if split == "test" else (test_per_size, train_per_size)
    return puzzles(n, start + count, seed)[start:]


def warmup_examples(per_size: dict[int, int], test_per_size: int = 100, train_per_size: int = 200,
                    seed: int = 1234) -> list[Example]:
    """The warm-up pool: per_size[n] puzzles of n people from after both splits of the same
    streams (pass the splits' sizes if they are not the defaults), interleaved by size."""
    skip = test_per_size + train_per_size
    return _interleaved({n: puzzles(n, skip + k, seed)[skip:] for n, k in sorted(per_size.items())})
