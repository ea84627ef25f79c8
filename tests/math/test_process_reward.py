"""PSPO*'s process reward math (pspo/related/process_reward.py, docs/related.md §C) on hand-worked numbers: the
released code's step split and its odd cases, the alternative split, the step pairs, the geometric
mean, every branch of ff, the adjusted Weibull and the three shapings."""
import ast
import math
import os

import pytest

from pspo.related import process_reward as pr
from pspo.related.process_reward import (ff, geometric_mean, shaped_reward, split_lines, split_released,
                                         split_steps, step_pairs, weibull_weight)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
E2 = math.exp(2.0)                     # e^{k τ} = e^{0.5 · 4} = 7.389056


# ---- the released code's split ----

@pytest.mark.parametrize("text, steps", [
    # "\n1. " (newlines then 1.), then ". 2. " and ". 3. " (a period, the number, a period): 3 steps; the
    # text before the first marker ("x") is dropped; each step is marker + " " + text, the marker's
    # newline removed and its leading "." and " " taken off (". 2. " -> "2. "), hence two spaces
    ("x\n1. A. 2. B. 3. C.", ["1.  A", "2.  B", "3.  C."]),
    ("[1] a [2] b [3] c", ["[1]  a ", "[2]  b ", "[3]  c"]),
    ("Step\n2. a\n3. b", []),                               # "2." after a newline is no marker: only 1. is
    ("1. First\n2. Second", ["1.  First\n2. Second"]),       # no period before "2.": one step (R = 0)
    ("1. First.\n2. Second.", ["1.  First", "2.  Second."]),  # ".\n2. " is a marker (\s+ takes the newline)
    ("Why? 2. Because. 3. So.", ["? 2.  Because", "3.  So."]),   # "?" keeps its mark: only "." is taken off
    ("a\\n2. b\\n3. c", ["\\n2.  b", "\\n3.  c"]),            # a literal backslash-n (escaped text) then k.
    ("[1][2] b", ["[2]  b"]),                                # an empty text between markers is no step
    ("[1] a [2] ", ["[1]  a ", "[2]  "]),                    # ... but a blank one is (the code: `if text`)
    ("no markers at all", []),
])
def test_released_split(text, steps):
    assert split_released(text) == steps
    assert split_steps(text, "released") == steps


def test_released_split_finds_no_steps_in_modern_chains_of_thought():
    # paragraphs, one step a line, "Step k:" lines: none has "1." followed by ". k. " markers
    paragraphs = "First compute 3 + 4 = 7.\nThen multiply by 2 to get 14.\nSo the answer is 14."
    step_lines = "Step 1: 3 + 4 = 7.\nStep 2: 7 * 2 = 14.\nThe answer is \\boxed{14}."
    knights = "<think></think><answer>(1) Zoey is a knight\n(2) Ethan is a knave</answer>"
    for text in (paragraphs, step_lines, knights):
        assert split_released(text) == []
    assert split_lines(paragraphs) == ["First compute 3 + 4 = 7.", "Then multiply by 2 to get 14.",
                                       "So the answer is 14."]
    assert len(split_lines(step_lines)) == 3 and len(split_lines(knights)) == 2


@pytest.mark.parametrize("text, steps", [
    ("Step 1: 2 + 3 = 5. Step 2: 5 * 4 = 20.", ["Step 1: 2 + 3 = 5.", "Step 2: 5 * 4 = 20."]),
    ("a\n\n  b  \n\nstep 3. c", ["a", "b", "step 3. c"]),     # blank lines dropped, any case of "step k."
    ("one line", ["one line"]),
    ("", []),
])
def test_lines_split(text, steps):
    assert split_lines(text) == steps
    assert split_steps(text, "lines") == steps


def test_unknown_split_rule_raises():
    with pytest.raises(ValueError, match="prm.split"):
        split_steps("a", "sentences")


def test_step_pairs_first_alone_then_previous_step():
    assert step_pairs(["a", "b", "c"]) == [(None, "a"), ("a", "b"), ("b", "c")]
    assert step_pairs([]) == []


# ---- the geometric mean ----

def test_geometric_mean_hand_worked():
    # (.9 · .8 · .5)^{1/3} = .36^{1/3} = .71138
    assert geometric_mean([.9, .8, .5]) == pytest.approx(.71138, abs=1e-5)
    assert geometric_mean([.9, 0.0, .5]) == 0.0
    # 400 scores of .01: the product 1e-800 underflows to 0 in floating point, exp(mean log) does not
    assert math.prod([.01] * 400) == 0.0
    assert geometric_mean([.01] * 400) == pytest.approx(.01, rel=1e-9)
    with pytest.raises(ValueError):
        geometric_mean([])


# ---- ff, every branch ----

def test_ff_up_to_the_threshold():
    # n <= 4: g·e^{n/2}; n = 1: .5·e^.5 = .82436; n = 4: .5·e^2 = 3.69453
    assert ff(.5, 1) == pytest.approx(.5 * math.exp(.5))
    assert ff(.5, 4) == pytest.approx(3.694528, abs=1e-6)
    with pytest.raises(ValueError):
        ff(.5, 0)


@pytest.mark.parametrize("g, h", [
    (.9, 1.0),                                  # g > E1 = .88433: grows e^{0.1 (n-4)}
    (.1, -1.0),                                 # 0 < g < 0.2: shrinks
    (.5, (.5 - .21159) / .88433),               # the middle band: h = (g - E3)/E1 = .32613
    (.88433, (.88433 - .21159) / .88433),       # g = E1 exactly is the middle band: h = .76074
    (.2, (.2 - .21159) / .88433),               # g = 0.2 exactly too: h = -.01311
    (0.0, (0.0 - .21159) / .88433),             # g = 0: the middle band, B = 0 so f = 0
])
def test_ff_past_the_threshold_each_band(g, h):
    # n = 6: σ = 1/(1 + e^{-20}) = 1 - 2.06e-9, B = g·e^2, f = B(1 - σ) + σ·B·e^{0.2 h}
    sigma = 1 / (1 + math.exp(-20))
    base = g * E2
    assert ff(g, 6) == pytest.approx(base * (1 - sigma) + sigma * base * math.exp(0.2 * h), abs=1e-12)


def test_ff_transition_at_five_steps():
    # n = 5, g = .9: σ = 1/(1 + e^{-10}) = .9999546, B = 6.650150, growth = B·e^{0.1} = 7.349568,
    # f = B·4.54e-5 + σ·7.349568 = 7.349522
    assert ff(.9, 5) == pytest.approx(7.349522, abs=1e-6)


# ---- the reward ----

def test_reward_hand_worked():
    # (.9, .8, .5): g = .71138, n = 3 <= 4: R = g·g·e^{1.5} = .50606 · 4.48169 = 2.2680
    assert shaped_reward([.9, .8, .5], "wrs") == pytest.approx(2.2680, abs=1e-4)
    # R(.9, n): n = 2: .81·e = 2.2018; n = 4: .81·e^2 = 5.9851; n = 5: .9 · 7.349522 = 6.6146;
    # n = 6: .9·B·e^{0.2} (σ ~ 1) = .9 · 8.122512 = 7.3103
    for n, expected in ((2, 2.2018), (4, 5.9851), (5, 6.6146), (6, 7.3103)):
        assert shaped_reward([.9] * n, "wrs") == pytest.approx(expected, abs=1e-4), n
    # R(.5, 6) = .5 · 3.694528 · e^{0.2 · .32613} = .5 · 3.943549 = 1.9718
    assert shaped_reward([.5] * 6, "wrs") == pytest.approx(1.9718, abs=1e-4)
    # R(.1, 6) = .1 · .7389056 · e^{-0.2} = .1 · .604965 = .0605
    assert shaped_reward([.1] * 6, "wrs") == pytest.approx(.0605, abs=1e-4)


@pytest.mark.parametrize("shaping", ["wrs", "weibull", "none"])
def test_one_step_or_none_scores_zero(shaping):
    assert shaped_reward([.9], shaping) == 0.0
    assert shaped_reward([], shaping) == 0.0


def test_weibull_weights_hand_worked():
    # w(n) = 10.735 · (1.5/8) · (n/8)^{.5} · e^{-(n/8)^{1.5}} = 2.0128125 · (n/8)^{.5} · e^{-(n/8)^{1.5}}:
    # n = 1: 2.0128125 · .353553 · e^{-.044194} = .6809; n = 8: 2.0128125 · 1 · e^{-1} = .7405 (the peak, 1 at
    # n* = 8 · (1/3)^{2/3} = 3.85, makes w(4) = .9994)
    expected = {1: .6809, 2: .8882, 3: .9797, 4: .9994, 5: .9709, 6: .9104, 8: .7405}
    for n, w in expected.items():
        assert weibull_weight(n) == pytest.approx(w, abs=1e-4), n
    with pytest.raises(ValueError):
        weibull_weight(0)


def test_the_other_shapings():
    # weibull: R = g·w(n) = .9 · .99942 (n = 4) = .89948; none: R = g = .71138
    assert shaped_reward([.9] * 4, "weibull") == pytest.approx(.9 * weibull_weight(4))
    assert shaped_reward([.9] * 4, "weibull") == pytest.approx(.89948, abs=1e-4)
    assert shaped_reward([.9, .8, .5], "none") == pytest.approx(.71138, abs=1e-5)
    with pytest.raises(ValueError, match="prm.shaping"):
        shaped_reward([.9, .9], "linear")


def test_config_names_match_the_implementations():
    from pspo.training.config import PRM_SHAPINGS, PRM_SPLITS
    for rule in PRM_SPLITS:
        split_steps("a\nb", rule)
    for shaping in PRM_SHAPINGS:
        shaped_reward([.5, .5], shaping)


def test_the_math_module_imports_only_the_standard_library():
    tree = ast.parse(open(pr.__file__, encoding="utf-8").read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "re", "collections"}, imported
