"""PSPO*'s process reward as pure math, docs/related.md §C: split a completion into steps, pair each
step with the one before it, accumulate the PRM's step scores by their geometric mean, and shape
that mean by the number of steps (the released code's `ff`, "wrs"; the adjusted Weibull it left
commented out, "weibull"; or nothing, "none").

Nothing here touches a model: pspo/related/prm.py scores the pairs with the PRM and calls `shaped_reward`.
Only the standard library is imported, so the formulas are tested on hand-worked numbers alone.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

# §C "Steps", the released code's split: five alternatives, each one group (so re.split returns the
# marker's five groups between the texts). Note `\n*1+\.` is "any newlines, then the digit 1":
# only "1." (or "11.") opens a list by itself; "k." for k > 1 needs a "." or "?" before it.
RELEASED_PATTERN = re.compile(r"(\.\s+\d+\.\s)|(\?\s+\d+\.\s)|(\n*1+\.\s+)|(\\n\s*\d+\.)|(\[\d\])")
RELEASED_GROUPS = 5
# The alternative split (prm.split: lines): a break at every newline and before every "Step k:" /
# "Step k." marker (any case), which stays at the head of its step.
LINES_PATTERN = re.compile(r"\n|(?=\bstep\s*\d+\s*[:.])", re.IGNORECASE)

# §C "Accumulation and shaping", the released code's constants
FF_K = 0.5             # k, growth rate up to the threshold: f = g·e^{k·n}
FF_M = 0.1             # m, growth rate past the threshold
FF_THRESHOLD = 4       # τ, steps
FF_E1 = 0.88433        # E1, a mean above it grows past τ
FF_E3 = 0.21159        # E3, the middle band grows by (g - E3) / E1
FF_LOW = 0.2           # a mean in (0, 0.2) shrinks past τ
FF_SHARPNESS = 10.0    # σ = 1 / (1 + e^{-10 (n - τ)})
# the adjusted Weibull: w(n) = C (κ/λ) (n/λ)^{κ-1} e^{-(n/λ)^κ}, peak ≈ 1 at n* ≈ 3.85
WEIBULL_KAPPA = 1.5
WEIBULL_LAMBDA = 8.0
WEIBULL_C = 10.735


def split_released(text: str) -> list[str]:
    """The released code's step split (§C, "Steps"), exactly: the text before the first marker is dropped;
    each step is "marker text", the marker with its newlines removed and then one leading "." and
    one leading space taken off; an empty text between two markers is no step.
    "x\\n1. A. 2. B. 3. C." -> ["1.  A", "2.  B", "3.  C."]; "Step\\n2. a\\n3. b" -> [] (no marker)."""
    parts = RELEASED_PATTERN.split(text)          # [text_0, 5 groups, text_1, 5 groups, text_2, ...]
    steps = []
    for j in range(RELEASED_GROUPS + 1, len(parts), RELEASED_GROUPS + 1):
        groups = parts[j - RELEASED_GROUPS:j]                    # one matched, the others are None
        marker = next(group for group in groups if group)
        marker = marker.replace("\n", "")
        if marker[0] == ".":
            marker = marker[1:]
        if marker[0] == " ":
            marker = marker[1:]
        if parts[j]:
            steps.append(f"{marker} {parts[j]}")
    return steps


def split_lines(text: str) -> list[str]:
    """The alternative split, for models that write one step per line or "Step k:": every non-blank
    line, stripped, also broken before each "Step k:" marker.
    "Step 1: 2 + 3 = 5. Step 2: 5 * 4 = 20." -> ["Step 1: 2 + 3 = 5.", "Step 2: 5 * 4 = 20."]."""
    return [part.strip() for part in LINES_PATTERN.split(text) if part.strip()]


def split_steps(text: str, rule: str) -> list[str]:
    """The steps of a completion under prm.split: released (the released code's) or lines."""
    if rule == "released":
        return split_released(text)
    if rule == "lines":
        return split_lines(text)
    raise ValueError(f"prm.split: no rule named {rule!r}")    # config.py validates the name first


def step_pairs(steps: Sequence[str]) -> list[tuple[str | None, str]]:
    """What the PRM scores (§C, "Step scores"): step 1 alone, then each step after the one before it.
    ["a", "b", "c"] -> [(None, "a"), ("a", "b"), ("b", "c")]."""
    return [(steps[j - 1] if j > 0 else None, step) for j, step in enumerate(steps)]


def geometric_mean(scores: Sequence[float]) -> float:
    """g = (Π s_j)^{1/n} (§C), as exp(mean log s_j): the same number without the product's underflow over
    many small scores; 0 if a score is 0."""
    if not scores:
        raise ValueError("geometric_mean: no scores")
    if min(scores) <= 0.0:
        return 0.0
    return math.exp(sum(math.log(s) for s in scores) / len(scores))


def ff(g: float, n: int) -> float:
    """The released code's shaping factor f(g, n) (§C; the reward is g·f):
    n <= τ: g·e^{k n};
    n > τ:  B(1 - σ) + σ·B·e^{m (n - τ) h(g)},  B = g·e^{k τ},  σ = 1/(1 + e^{-10 (n - τ)}),
            h = 1 if g > E1, -1 if 0 < g < 0.2, else (g - E3)/E1."""
    if n < 1:
        raise ValueError(f"ff: expected n >= 1 steps, got {n}")
    if n <= FF_THRESHOLD:
        return g * math.exp(FF_K * n)
    sigma = 1.0 / (1.0 + math.exp(-FF_SHARPNESS * (n - FF_THRESHOLD)))
    base = g * math.exp(FF_K * FF_THRESHOLD)                                  # B
    if g > FF_E1:
        h = 1.0
    elif 0.0 < g < FF_LOW:
        h = -1.0
    else:
        h = (g - FF_E3) / FF_E1
    growth = base * math.exp(FF_M * (n - FF_THRESHOLD) * h)
    return base * (1.0 - sigma) + sigma * growth


def weibull_weight(n: int) -> float:
    """The adjusted Weibull weight w(n) = C (κ/λ) (n/λ)^{κ-1} e^{-(n/λ)^κ} (§C)."""
    if n < 1:
        raise ValueError(f"weibull_weight: expected n >= 1 steps, got {n}")
    x = n / WEIBULL_LAMBDA
    density = (WEIBULL_KAPPA / WEIBULL_LAMBDA) * x ** (WEIBULL_KAPPA - 1) * math.exp(-x ** WEIBULL_KAPPA)
    return WEIBULL_C * density


def shaped_reward(scores: Sequence[float], shaping: str) -> float:
    """R from the step scores s_1..s_n (§C): 0 when n <= 1; else with g = geometric_mean(s),
    wrs: g·ff(g, n) (the released code's), weibull: g·w(n), none: g."""
    n = len(scores)
    if n <= 1:
        return 0.0
    g = geometric_mean(scores)
    if shaping == "wrs":
        return g * ff(g, n)
    if shaping == "weibull":
        return g * weibull_weight(n)
    if shaping == "none":
        return g
    raise ValueError(f"prm.shaping: no shaping named {shaping!r}")   # config.py validates the name first
