r"""Gold answers as the real benchmarks store them, brought to what math-verify parses (docs/methods.md §5).

The accuracy reward is `verify(parse(gold), parse(answer))`. math-verify parses most benchmark
answers as written: `90^\circ`, `\text{(C)}`, `\text{Evelyn}`, intervals `(-\infty, 3]` and
`[2,5)`, `\begin{pmatrix} 1 \\ -2 \end{pmatrix}`, `\dfrac`, `\sqrt`, `25\%`, units in
`4\text{ inches}` / `10\mbox{ cm}`, several answers `2, -3`, `1.3 \times 10^{-2}`, `6-5i`, and
thousands written `32,\!348`. What it does not parse as meant, and what we give it instead:
- `\$18.90`, `\$32,\!348` (MATH-500): its `$` reads as a math delimiter -> `\$` removed;
- `7.2e-7` (Minerva): read as 7.2·e − 7 -> `7.2\times10^{-7}` (a whole-answer number only);
- `27.0`, a number (AMC23) -> `27`;
- `['$\frac{1}{2}$']`, a list of `$...$` items (OlympiadBench) -> `\frac{1}{2}` (items joined by ", ");
- bare LaTeX or a number: its extractor looks for delimiters -> wrapped in `$...$`.
Against an e-notation gold, the rewrite is applied to a completion's boxed answer too
(`answer_latex`), so `\boxed{7.2e-7}` and `\boxed{7.2 \times 10^{-7}}` both match the gold `7.2e-7`.
tests/components/test_golds.py scores every form above with right and wrong boxed answers.
"""
from __future__ import annotations

import functools
import logging
import math
import re
from typing import Any

# The reward guard (reward_pool.py) replaces math-verify's, so its "timeout is disabled" notice is noise
logging.getLogger("math_verify").setLevel(logging.ERROR)

_E_NOTATION = r"(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)"                        # 7.2e-7, 3E8, -1.5e+03
_GOLD_E_NOTATION = re.compile(_E_NOTATION)
_BOXED_E_NOTATION = re.compile(r"(\\boxed\{\s*)" + _E_NOTATION + r"(\s*\})")
_SCIENTIFIC_GOLD = re.compile(r"-?\d+(?:\.\d+)?\s*(?:[eE][+-]?\d|\\(?:times|cdot)\s*10\s*\^)")
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")



class GoldAnswerError(ValueError):
    """A gold answer math-verify cannot parse (or not a K&K solution): an error in the data, never scored."""

def gold_text(value: Any) -> str:
    """A dataset's stored answer as text: "" for a missing value (None, NaN), a whole float without
    its ".0", a list as its items without their `$...$`, joined with ", "."""
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return ""                                                       # a missing value in a float column
    if isinstance(value, float) and value.is_integer():
        return str(int(value))                                          # AMC23 stores 27.0
    if isinstance(value, (list, tuple)):                                # OlympiadBench final_answer
        return ", ".join(_strip_dollars(gold_text(item)) for item in value)
    return str(value).strip()


def _strip_dollars(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$" and _UNESCAPED_DOLLAR.search(text[1:-1]) is None:
        return text[1:-1].strip()
    return text


def gold_latex(gold: str) -> str:
    """The text math-verify parses for a gold answer (the list in the module docstring)."""
    gold = gold.strip().replace("\\$", "").strip()
    if _GOLD_E_NOTATION.fullmatch(gold):
        gold = _GOLD_E_NOTATION.sub(r"\1\\times10^{\2}", gold)
    if _UNESCAPED_DOLLAR.search(gold) or any(mark in gold for mark in ("\\boxed", "\\(", "\\[")):
        return gold                                                     # already delimited
    return f"${gold}$"


@functools.lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
    """math-verify's parse of a gold answer (as `gold_latex` gives it); GoldAnswerError when it does not
    parse. A parse holding only strings is math-verify's fallback for LaTeX it could not read
    (`\\frac{1}{` -> ['\\frac{1}{']): it would match by string equality alone, so it counts as unparsed."""
    from math_verify import parse                   # slow to import: loaded with the first gold parsed
    parsed = parse(gold_latex(gold), parsing_timeout=None)
    if not any(not isinstance(item, str) for item in parsed):
        shown = gold if len(gold) <= 200 else gold[:200] + "..."
        raise GoldAnswerError(f"gold answer {shown!r} does not parse with math-verify "
                              "(expected a number or a LaTeX expression)")
    return tuple(parsed)


def answer_latex(answer: str, gold: str) -> str:
    """A completion's answer part, with a boxed e-notation number written as `a\\times10^{b}` when
    the gold itself is in scientific notation (7.2e-7, 1.3 \\times 10^{-2}). Only then:
    `\\boxed{2e-1}` may mean 2e - 1 (Euler's e), and rewriting it against any gold could turn a
    wrong answer into a right one."""
    if not _SCIENTIFIC_GOLD.match(gold.strip()):
        return answer
    return _BOXED_E_NOTATION.sub(r"\1\2\\times10^{\3}\4", answer)
