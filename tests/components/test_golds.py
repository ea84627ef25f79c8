"""pspo/tasks/golds.py: the answer forms of MATH-500, AIME, AMC, Minerva, OlympiadBench and GSM8K, scored
both ways by the real math-verify: natural right boxed answers get 1.0, near misses 0.0."""
import pytest

from pspo.tasks.golds import answer_latex, gold_latex, gold_text
from pspo.rewards import accuracy_reward
from pspo.tasks.data import check_gold_answer

# (gold as the dataset stores it, right boxed answers, wrong boxed answers)
ANSWER_FORMS = [
    # MATH-500
    ("\\$18.90", ["18.90", "\\$18.90", "18.9"], ["18.19", "19.80"]),                   # escaped dollar
    ("32,\\!348", ["32348", "32,348", "32,\\!348"], ["32", "348", "32,349"]),          # thousands, \!
    ("\\$32,\\!348", ["32348", "\\$32,348", "\\$32,\\!348"], ["32347"]),
    ("\\$1.25", ["1.25", "\\$1.25"], ["125"]),
    ("90^\\circ", ["90", "90^\\circ", "90^{\\circ}"], ["45", "45^\\circ"]),             # degrees
    ("\\text{(C)}", ["C", "(C)", "\\text{(C)}", "\\text{C}", "\\textbf{(C)}"], ["B", "\\text{(B)}", "(D)"]),
    ("\\text{Evelyn}", ["\\text{Evelyn}", "Evelyn"], ["\\text{Bob}", "Bob"]),
    ("(-\\infty, 3]", ["(-\\infty, 3]", "(-\\infty,3]"], ["(-\\infty, 3)", "[3, \\infty)"]),   # intervals
    ("[2,5)", ["[2,5)", "[2, 5)"], ["[2,5]", "(2,5)"]),
    ("\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}",
     ["\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\-2\\end{pmatrix}"],
     ["\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ 1 \\end{pmatrix}"]),
    ("\\dfrac{3}{4}", ["\\frac{3}{4}", "\\dfrac{3}{4}", "0.75", "3/4"], ["\\frac{4}{3}"]),
    ("2\\sqrt{5}", ["2\\sqrt{5}", "\\sqrt{20}"], ["\\sqrt{5}", "5\\sqrt{2}"]),
    ("25\\%", ["25\\%", "25"], ["26\\%", "26"]),                                       # percent
    ("4\\text{ inches}", ["4", "4\\text{ inches}", "4 \\text{ inches}"], ["5", "5\\text{ inches}"]),   # units
    ("10\\mbox{ cm}", ["10", "10\\text{ cm}", "10\\mbox{ cm}"], ["11"]),
    ("2, -3", ["2, -3", "-3, 2", "2,-3"], ["2", "2, 3"]),                              # several answers
    ("6-5i", ["6-5i", "6 - 5i"], ["6+5i", "5-6i"]),                                    # complex
    ("\\left( 3, \\frac{\\pi}{2} \\right)", ["(3, \\frac{\\pi}{2})"], ["(3, \\pi)"]),
    ("x^2+7x+10", ["x^2+7x+10", "(x+2)(x+5)"], ["x^2+7x+12"]),
    # AIME (a string, sometimes zero-padded)
    ("033", ["33", "033"], ["34"]),
    # Minerva: e-notation and powers of ten
    ("7.2e-7", ["7.2 \\times 10^{-7}", "7.2e-7", "7.2\\cdot10^{-7}", "0.00000072"], ["7.2 \\times 10^{-6}", "7.3e-7", "7.2"]),
    ("3.8e26", ["3.8 \\times 10^{26}", "3.8e26"], ["3.8 \\times 10^{25}"]),
    ("1.3 \\times 10^{-2}", ["0.013", "1.3 \\times 10^{-2}", "1.3e-2"], ["1.3", "0.13"]),
    ("8 \\mathrm{~g/cm^3}", ["8", "8 \\text{ g/cm}^3"], ["9"]),
    # AMC23 stores numbers; OlympiadBench a list of $...$ strings
    (27.0, ["27", "27.0"], ["28"]),
    (2.5, ["2.5", "\\frac{5}{2}"], ["2"]),
    (["$\\frac{1}{2}$"], ["\\frac{1}{2}", "0.5"], ["2"]),
    (["$1$", "$-1$"], ["1, -1", "-1, 1"], ["1"]),
    (["$(1,6),(2,3)$"], ["(1,6),(2,3)", "(2,3), (1,6)"], ["(1,6)"]),
    # GSM8K after "####" (benchmarks.gold_answer drops the commas)
    ("1740", ["1740", "1,740"], ["174"]),
]


@pytest.mark.parametrize("stored, right, wrong", ANSWER_FORMS, ids=[str(f[0]) for f in ANSWER_FORMS])
def test_answer_forms_score_right_and_wrong_answers(stored, right, wrong):
    gold = gold_text(stored)
    check_gold_answer(gold)                                     # passes the start-up check
    for answer in right:
        completion = f"<think>work</think> The answer is $\\boxed{{{answer}}}$."
        assert accuracy_reward("", completion, gold) == 1.0, answer
    for answer in wrong:
        completion = f"<think>work</think> The answer is $\\boxed{{{answer}}}$."
        assert accuracy_reward("", completion, gold) == 0.0, answer


def test_gold_text_of_stored_values():
    assert gold_text(None) == ""                                # missing: reported and left out
    assert gold_text(27.0) == "27" and gold_text(2.5) == "2.5" and gold_text(204) == "204"
    assert gold_text(["$\\frac{1}{2}$"]) == "\\frac{1}{2}"
    assert gold_text(["$1$", "$-1$"]) == "1, -1"
    assert gold_text(["$x$ and $y$"]) == "$x$ and $y$"         # inner $: not one $...$ item, kept
    assert gold_text([]) == "" and gold_text("  7 ") == "7"


def test_gold_latex_rewrites():
    assert gold_latex("\\$32,\\!348") == "$32,\\!348$"          # escaped $ removed, delimited
    assert gold_latex("7.2e-7") == "$7.2\\times10^{-7}$"
    assert gold_latex("2e-1x") == "$2e-1x$"                     # not a bare number: left alone
    assert gold_latex("$\\frac{1}{2}$") == "$\\frac{1}{2}$"      # already delimited
    assert gold_latex("\\boxed{7}") == "\\boxed{7}"
    assert answer_latex("so \\boxed{ 7.2e-7 } m", "7.2e-7") == "so \\boxed{ 7.2\\times10^{-7} } m"
    assert answer_latex("\\boxed{2e-1x}", "7.2e-7") == "\\boxed{2e-1x}"
    assert answer_latex("\\boxed{2e-1}", "0.2") == "\\boxed{2e-1}"      # gold not in e-notation: untouched


def test_e_notation_is_read_as_a_power_of_ten_only_against_an_e_notation_gold():
    # \boxed{2e-1} against gold 0.2: as written it is 2e - 1 (Euler's e) = 4.44, wrong; reading it
    # as 2 x 10^-1 would make it right by our rewrite alone. Against gold 2e-1 (a Minerva-style
    # number, 0.2) it is read as 0.2.
    assert accuracy_reward("", "\\boxed{2e-1}", "0.2") == 0.0
    assert accuracy_reward("", "\\boxed{2e-1}", "2e-1") == 1.0
    assert accuracy_reward("", "\\boxed{0.2}", "2e-1") == 1.0


def test_a_missing_float_is_no_gold():
    # parquet / pandas store a missing number as NaN: it must not become the gold "nan"
    assert gold_text(float("nan")) == "" and gold_text(float("inf")) == ""
