"""Knights-and-knaves: the puzzle generator and its splits, the two file layouts, the released code's
reward (docs/related.md §A) with adversarial completions, and per-size evaluation."""
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from pspo.tasks import knights
from pspo.tasks.data import DataError, Example, load_examples, prompt_set
from pspo.training.distributed import Dist
from pspo.evaluation import evaluate
from pspo.tasks.knights import (KNIGHTS_INSTRUCTION, SIZES, Puzzle, builtin_knights, puzzles, solutions,
                                warmup_examples)
from pspo.rewards import (REWARD_FUNCTIONS, accuracy_reward, format_reward, knights_people, knights_reward,
                          score_completions)
from pspo.tasks.data import check_gold_answer
from pspo.tasks.golds import GoldAnswerError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(ROOT, "data", "samples")
SAMPLE_SEED = 7             # data/samples/knights*.jsonl: our own puzzles from this seed (test below)
GOLD = "(1) Michael is a knight\n(2) Zoey is a knight\n(3) Ethan is a knight"
SEED_PROMPT = "<|im_start|>system\nsolve\n<|im_end|>\n<|im_start|>user\nq\n<|im_end|>\n<|im_start|>assistant\n<think>"
RIGHT = "(1) Michael is a knight\n(2) Zoey is a knight\n(3) Ethan is a knight"


# ---- generator --------------------------------------------------------------------------------


# ---- the two file layouts, written from built-in puzzles (data/samples/knights*.jsonl hold such rows)

# The released code's src: Qwen2.5's chat template around a system prompt asking for the layout (our
# wording), ending where the assistant starts, inside its opened <think>.
PADDLE_SYSTEM_PROMPT = (
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the mind and "
    "then provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively. Now the user asks you to solve a logical "
    "reasoning problem. After thinking, clearly state the identity of each character within <answer> "
    "</answer> tags, i.e., <answer> (1) Zoey is a knight\n(2) ... </answer>.")
_HUB_OPERATORS = {"not": "not", "and": "and", "or": "or", "if": "->", "iff": "<=>"}


def _hub_statement(statement: knights.Statement) -> tuple:
    """Our statement in the hub's `statements` vocabulary: ('telling-truth', i), ('lying', i),
    ('->', a, b), ..."""
    op, *claims = statement
    leaves = tuple(("telling-truth" if knight else "lying", person) for person, knight in claims)
    return leaves[0] if op == "claim" else (_HUB_OPERATORS[op],) + leaves


def hub_row(puzzle: Puzzle, index: int) -> dict:
    """The puzzle as a row of K-and-K/knights-and-knaves (every field, the hub's types)."""
    names, solution = list(puzzle.names), list(puzzle.solution)
    roles = [f"{name} is a {'knight' if knight else 'knave'}" for name, knight in zip(names, solution)]
    steps = [f"{role}, and {names[i]}'s claim that {knights.statement_text(s, puzzle.names)} is "
             f"{'true' if solution[i] else 'false'}."
             for i, (role, s) in enumerate(zip(roles, puzzle.statements))]
    return {"quiz": puzzle.text(), "names": names,
            "knight_knave": {"knight": "knight", "knave": "knave", "a_knight": "a knight",
                             "a_knave": "a knave", "Knight": "Knight", "Knave": "Knave"},
            "solution": solution, "solution_text": ", ".join(roles[:-1]) + ", and " + roles[-1] + ".",
            "solution_text_format": puzzle.gold(),
            "cot_head": "Let's check each person's statement against the only consistent assignment.",
            "cot_repeat_steps": steps, "cot_foot": "This leads to a feasible solution.",
            "statements": str(tuple(_hub_statement(s) for s in puzzle.statements)), "index": index}


def paddle_row(puzzle: Puzzle) -> dict:
    """The puzzle as a row of PaddleNLP's ppo-kk jsonl: src = [templated prompt], tgt = [gold]."""
    src = (f"<|im_start|>system\n{PADDLE_SYSTEM_PROMPT}\n<|im_end|>\n<|im_start|>user\n{puzzle.text()}\n"
           "<|im_end|>\n<|im_start|>assistant\n<think>")
    return {"src": [src], "tgt": [puzzle.gold()]}


def test_hand_checked_two_person_puzzle():
    # A (0) says "B is a knave"; B (1) says "A is a knight and B is a knight".
    # B a knight -> B's claim true -> A a knight -> A's claim "B is a knave" false: contradiction.
    # So B is a knave, B's claim is false (B is not a knight), A's claim is true: A is a knight.
    statements = (("claim", (1, False)), ("and", (0, True), (1, True)))
    assert solutions(statements) == [(True, False)]
    # bit a of the mask is assignment a (bit p of a: person p a knight): A knight, B knave = a 1 -> 0b10
    assert knights._solution_mask(statements) == 0b10
    # both say "A is a knight": (knight, knight) and (knave, knave) both fit -> two solutions, not kept
    both = (("claim", (0, True)), ("claim", (0, True)))
    assert solutions(both) == [(True, True), (False, False)] and knights._solution_mask(both) == 0b1001
    puzzle = Puzzle(("Ann", "Bob"), statements, (True, False), (1, 0))
    assert puzzle.text() == (
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and "
        "knaves always lie. You meet 2 inhabitants: Ann and Bob. Ann says that Bob is a knave. "
        'Bob says, "Ann is a knight and Bob is a knight." So who is a knight and who is a knave?')
    assert puzzle.gold() == "(1) Ann is a knight\n(2) Bob is a knave"
    assert puzzle.example() == Example(puzzle.text() + "\n" + KNIGHTS_INSTRUCTION, puzzle.gold())


def test_every_statement_kind_reads_and_evaluates_as_written():
    names = ("Ann", "Bob")
    cases = [  # statement, its text, its truth with Ann a knight and Bob a knave
        (("claim", (1, False)), "Bob is a knave", True),
        (("not", (0, True)), "Ann is not a knight", False),
        (("and", (0, True), (1, True)), "Ann is a knight and Bob is a knight", False),
        (("or", (0, True), (1, True)), "Ann is a knight or Bob is a knight", True),
        (("if", (0, True), (1, True)), "if Ann is a knight then Bob is a knight", False),
        (("iff", (0, False), (1, True)), "Ann is a knave if and only if Bob is a knight", True),
    ]
    for statement, text, truth in cases:
        assert knights.statement_text(statement, names) == text
        assert knights.holds(statement, (True, False)) is truth


def test_kept_puzzles_have_exactly_the_stated_solution_by_brute_force():
    # Re-solved with the plain 2^n loop, independent of the bit masks generation uses.
    for n in SIZES:
        for p in puzzles(n, 300):
            assert solutions(p.statements) == [p.solution]
            assert len(p.names) == len(set(p.names)) == n and all(name.isalpha() for name in p.names)
            assert all(s[1] != (i, False) and s[-1] != (i, False) for i, s in enumerate(p.statements))  # no "I am a knave"
            assert knights_people(p.gold()) == n


def test_generation_is_deterministic_and_leaves_the_global_rng_alone():
    random.seed(5)
    before = random.random()
    random.seed(5)
    stream = knights.puzzle_stream(5, 1234)                  # a fresh stream, not the cached `puzzles`
    first = [next(stream) for _ in range(40)]
    assert random.random() == before
    assert first == list(puzzles(5, 40)) and first != list(puzzles(5, 40, seed=99))
    # the same texts in another process (string hashing differs there)
    code = ("from pspo.tasks.knights import builtin_knights; import hashlib; "
            "print(hashlib.sha256(repr(builtin_knights('test')).encode()).hexdigest())")
    there = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONHASHSEED": "123"}).stdout.strip()
    assert there == hashlib.sha256(repr(builtin_knights("test")).encode()).hexdigest()


def test_splits_are_stratified_disjoint_and_the_warmup_pool_is_outside_both():
    test, train = builtin_knights("test"), builtin_knights("train")
    assert [knights_people(ex.answer) for ex in test[:14]] == list(SIZES) * 2      # interleaved by size
    for split, per_size in ((test, 100), (train, 200)):
        sizes = [knights_people(ex.answer) for ex in split]
        assert {n: sizes.count(n) for n in SIZES} == {n: per_size for n in SIZES}
    assert not {ex.problem for ex in test} & {ex.problem for ex in train}
    # disjoint as logical puzzles too (names aside): one stream per size, test first, then train, then warm-up
    for n in SIZES:
        stream = puzzles(n, 310)
        assert len({p.statements for p in stream}) == 310
    warm = warmup_examples({2: 50, 3: 60, 8: 10})
    assert [knights_people(ex.answer) for ex in warm[:3]] == [2, 3, 8]
    assert sorted(knights_people(ex.answer) for ex in warm) == [2] * 50 + [3] * 60 + [8] * 10
    assert not {ex.problem for ex in warm} & ({ex.problem for ex in test} | {ex.problem for ex in train})
    assert warm[0] == puzzles(2, 301)[300].example()
    # 2-person puzzles run out: 399 distinct with a unique solution, 300 in the splits
    with pytest.raises(DataError, match=r"^builtin:knights: only 399 distinct 2-person puzzles .* 400 were asked for$"):
        warmup_examples({2: 100})
    with pytest.raises(DataError, match="unknown split 'val'"):
        builtin_knights("val")


# ---- loading: builtin, the hub layout, the PaddleNLP layout ----------------------------------

def _sample_rows():
    hub = [hub_row(p, i) for i, p in enumerate(p for n in SIZES for p in puzzles(n, 2, SAMPLE_SEED))]
    paddle = [paddle_row(puzzles(n, 3, SAMPLE_SEED)[2]) for n in SIZES]
    return hub, paddle


def test_the_shipped_samples_are_the_generators_rows():
    hub, paddle = _sample_rows()
    for name, rows in (("knights.jsonl", hub), ("knights_paddle.jsonl", paddle)):
        with open(os.path.join(SAMPLES, name)) as f:
            assert [json.loads(line) for line in f] == rows


def test_builtin_and_both_file_layouts_load_through_load_examples(tmp_path):
    assert load_examples("builtin:knights", split="test", max_examples=10) == builtin_knights("test")[:10]
    hub_rows, paddle_rows = _sample_rows()
    hub = load_examples(os.path.join(SAMPLES, "knights.jsonl"))          # problem/answer fields ignored
    assert [ex.answer for ex in hub] == [r["solution_text_format"] for r in hub_rows]
    assert [ex.problem for ex in hub] == [r["quiz"] + "\n" + KNIGHTS_INSTRUCTION for r in hub_rows]
    assert not any(ex.chat_formatted for ex in hub)
    paddle = load_examples(os.path.join(SAMPLES, "knights_paddle.jsonl"))
    assert paddle == [Example(r["src"][0], r["tgt"][0], chat_formatted=True) for r in paddle_rows]
    # a hub row without solution_text_format: the gold is built from names and solution
    row = {k: v for k, v in hub_rows[3].items() if k != "solution_text_format"}
    (tmp_path / "kk.jsonl").write_text(json.dumps(row) + "\n")
    assert load_examples(str(tmp_path / "kk.jsonl"))[0].answer == hub_rows[3]["solution_text_format"]


def test_train_people_keeps_those_sizes_and_names_a_row_that_is_not_kk(tmp_path):
    from pspo.training.config import DataConfig
    assert DataConfig(train_people="2,4").people == (2, 4) and DataConfig().people == ()
    # the train split interleaves sizes 2..8, 200 each: sizes 2 and 4 keep rows 0, 2, 7, 9, 14, ...
    train = builtin_knights("train")
    kept = load_examples("builtin:knights", split="train", people=(2, 4))
    assert len(kept) == 400 and kept[:4] == [train[0], train[2], train[7], train[9]]
    assert {knights_people(ex.answer) for ex in kept} == {2, 4}
    assert (load_examples("builtin:knights", split="train", max_examples=3, people=(3,))
            == [train[1], train[8], train[15]])
    # a file with a non-K&K row: the filter names it instead of dropping it
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"row 0's gold is not a K&K answer"):
        load_examples(str(tmp_path / "mixed.jsonl"), people=(2,))
    hub_rows, _ = _sample_rows()                          # data/samples/knights.jsonl: sizes 2, 2, 3, 3, .., 8, 8
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hub_rows[:2]))
    assert len(load_examples(str(tmp_path / "two.jsonl"), people=(2, 3))) == 2
    with pytest.raises(DataError, match=r"no puzzle of 3, 4 people \(data.train_people\)"):
        load_examples(str(tmp_path / "two.jsonl"), people=(3, 4))


@pytest.mark.slow
def test_train_py_names_a_train_people_filter_on_a_task_without_kk_puzzles(tiny_model_path, tmp_path, run_main):
    # train.py passes data.train_people to the loader: on the arithmetic task it is one line (a DataError's,
    # which train.py prints, exit 2); train.py in this process (conftest's run_main)
    with pytest.raises(DataError) as e:
        run_main("train", "--config", "configs/grpo.yaml", "--data.train_people=2,3",
                 f"--model.name_or_path={tiny_model_path}", f"--train.output_dir={tmp_path}")
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "builtin:arithmetic: data.train_people keeps K&K puzzles by their number of people, but row 0's gold")


class _NoTemplate:
    """A tokenizer that counts chat-template calls: one word = one token."""
    def __init__(self):
        self.templated = 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        self.templated += 1
        return "<|im_start|>user\n" + messages[-1]["content"] + "<|im_end|>\n<|im_start|>assistant\n"

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        return {"input_ids": [[0] * len(t.split()) for t in texts]}


def test_a_templated_src_prompt_is_used_as_is_and_a_quiz_is_templated():
    tokenizer = _NoTemplate()
    paddle = load_examples(os.path.join(SAMPLES, "knights_paddle.jsonl"))
    kept = prompt_set("d", paddle, tokenizer, system_prompt="r1", max_prompt_tokens=10_000)
    assert tokenizer.templated == 0 and kept.texts == [ex.problem for ex in paddle]   # not templated again
    assert all(t.endswith("<|im_start|>assistant\n<think>") and t.count("<|im_start|>assistant") == 1
               for t in kept.texts)
    hub = load_examples(os.path.join(SAMPLES, "knights.jsonl"))
    kept = prompt_set("d", hub, tokenizer, system_prompt="", max_prompt_tokens=10_000)
    assert tokenizer.templated == len(hub) and kept.texts[0].endswith("<|im_start|>assistant\n")
    assert kept.skipped == 0                                  # K&K golds pass the data check


# ---- the reward ------------------------------------------------------------------------------

def test_the_seeds_cases_with_its_templated_prompt():
    # The released code's prompt ends inside the assistant's <think>: the completion starts with the reasoning.
    assert knights_reward(SEED_PROMPT, f"reasoning</think><answer>{RIGHT}</answer>", GOLD) == 3.0
    wrong = RIGHT.replace("Zoey is a knight", "Zoey is a knave")                 # format +1, answer -1.5
    assert knights_reward(SEED_PROMPT, f"r</think><answer>{wrong}</answer>", GOLD) == -0.5
    colons = "Michael: knight, Zoey: knight, Ethan: knight"                       # format +1, answer -2
    assert knights_reward(SEED_PROMPT, f"r</think><answer>{colons}</answer>", GOLD) == -1.0
    assert knights_reward(SEED_PROMPT, f"r<answer>{RIGHT}</answer>", GOLD) == -3.0   # no </think>: -1 - 2
    # a second <think> of its own is two <think> tags: the format fails
    assert knights_reward(SEED_PROMPT, f"<think>r</think><answer>{RIGHT}</answer>", GOLD) == -3.0


def test_our_prompts_end_where_the_assistant_starts_so_the_completion_opens_think():
    ours = "<|im_start|>user\nq\n<|im_end|>\n<|im_start|>assistant\n"
    assert knights_reward(ours, f"<think>r</think>\n<answer> {RIGHT} </answer>", GOLD) == 3.0
    assert knights_reward(ours, f"r</think><answer>{RIGHT}</answer>", GOLD) == -3.0
    # a whole decoded sequence (the released code's input) is scored after its first assistant mark
    assert knights_reward("", f"{SEED_PROMPT}r</think><answer>{RIGHT}</answer>", GOLD) == 3.0


@pytest.mark.parametrize("answer, total", [
    ("michael IS A Knight, zoey is a knight, ethan is  a\nknight", 3.0),     # case and spacing are free
    (RIGHT + "\nall three are knights", -1.0),                                 # 4 role words for 3 people
    ("(1) Michael is a knight\n(2) Zoey is a knight", -1.0),                  # 2 role words for 3 people
    ("Michael is a knight, Zoey is a knight, Ethan is knight", -1.0),         # "is knight": no "a"
    ("Michael is a knight, Zoey is a knight, Ethan is a knave", -0.5),
    ("", -1.0),                                                                # empty answer: -2
])
def test_answer_parsing(answer, total):
    assert knights_reward("", f"<think></think><answer>{answer}</answer>", GOLD) == total


def test_tag_order_and_counts():
    assert knights_reward("", f"<answer>{RIGHT}</answer><think></think>", GOLD) == -3.0
    assert knights_reward("", f"<think></think><answer>{RIGHT}</answer></answer>", GOLD) == -3.0
    assert knights_reward("", f"<think></answer></think><answer>{RIGHT}", GOLD) == -3.0


def test_accuracy_and_format_are_the_kk_exact_match_and_tag_check_on_kk_golds():
    ok, wrong = f"<think>r</think><answer>{RIGHT}</answer>", "<think>r</think><answer>nobody</answer>"
    assert [accuracy_reward("", c, GOLD) for c in (ok, wrong, "x")] == [1.0, 0.0, 0.0]
    assert [format_reward("", c, GOLD) for c in (ok, wrong, "x")] == [1.0, 1.0, 0.0]
    assert accuracy_reward("", "<think></think>\\boxed{82}", "82") == 1.0          # math golds unchanged
    check_gold_answer(GOLD)
    assert knights_people(GOLD) == 3 and knights_people("82") is None and knights_people("") is None
    with pytest.raises(GoldAnswerError, match="is not a knights-and-knaves solution"):
        knights_reward("", ok, "82")
    assert REWARD_FUNCTIONS["knights"] is knights_reward
    scored = score_completions(["", ""], [ok, wrong], [GOLD, GOLD],
                               weights={"accuracy": 0.0, "format": 0.0, "knights": 1.0})
    assert scored.rewards.tolist() == [3.0, -1.0] and scored.components["accuracy"].tolist() == [1.0, 0.0]
    assert sum(scored.failures.values()) == 0


ADVERSARIAL = {
    "1 MB of text": "<think>" + "knight knave <answer> " * 50_000 + "</think><answer>" + "x" * 10**6 + "</answer>",
    "1 MB answer with the right roles": f"<think></think><answer>{' ' * 10**6}{RIGHT}{' ' * 10**6}</answer>",
    "1 MB of one name": f"<think></think><answer>{'Michael ' * 130_000} is a knight x</answer>",
    "1000 nested tags": "<think>" * 1000 + "<answer>" * 1000 + "</answer>" * 1000 + "</think>" * 1000,
    "1000 nested, once each outside": "<think>" + "<b>" * 1000 + "</think><answer>" + RIGHT + "</b>" * 1000 + "</answer>",
    "unicode names": "<think>Zoë, Михаил, 山田</think><answer>(1) Михаил is a knight\n(2) Zoë is a knight\n(3) É is a knave</answer>",
    "regex-hostile": "<think>(.*?)+[\\b]{1,}$^\\</think><answer>Michael( is a knight|*+?\\1 Zoey is a knight[ Ethan is a knight\\</answer>",
    "mark inside": "<|im_start|>assistant" * 1000 + "<think></think><answer>" + RIGHT + "</answer>",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_completions_score_quickly_and_never_raise(name):
    completion = ADVERSARIAL[name]
    start = time.perf_counter()
    for prompt in ("", SEED_PROMPT):
        total = knights_reward(prompt, completion, GOLD)
        assert total in (3.0, -0.5, -1.0, -3.0)
        accuracy_reward(prompt, completion, GOLD), format_reward(prompt, completion, GOLD)
    assert time.perf_counter() - start < 1.0
    # a unicode gold name parses as the released code's ASCII-word rule reads it, without raising
    assert knights_reward("", completion, "(1) Zoë is a knight\n(2) Михаил is a knave") in (3.0, -0.5, -1.0, -3.0)


def test_the_1mb_answer_with_the_right_roles_is_right():
    assert knights_reward("", ADVERSARIAL["1 MB answer with the right roles"], GOLD) == 3.0


# ---- evaluation per size ---------------------------------------------------------------------

class _OracleForTwo:
    """An engine that answers every 2-person puzzle right and every other one wrong."""
    def __init__(self, examples):
        self.examples = examples

    def generate(self, ids, n, temperature, top_p, max_new_tokens, seeds=None):
        texts = []
        for row in ids:
            gold = self.examples[row[0]].answer
            texts += [f"<think></think><answer>{gold if knights_people(gold) == 2 else 'no'}</answer>"] * n
        return SimpleNamespace(texts=texts)


def test_evaluate_reports_greedy_accuracy_per_number_of_people():
    examples = builtin_knights("test")[:21]                          # 3 of each size 2..8
    ids = [[i] for i in range(len(examples))]
    result = evaluate(_OracleForTwo(examples), ids, [""] * 21, examples, max_new_tokens=8, num_samples=2,
                      temperature=1.0, top_p=1.0, seed=0, dist_=Dist(0, 1, torch.device("cpu")), batch_size=4,
                      progress=False)
    # 3 of 21 right (the 2-person ones): 1/7 overall, 1 for 2 people, 0 elsewhere
    assert result == pytest.approx({"greedy_accuracy": 1 / 7, "mean@2": 1 / 7, "pass@2": 1 / 7, "greedy_2ppl": 1.0,
                                    **{f"greedy_{n}ppl": 0.0 for n in range(3, 9)}})


@pytest.mark.slow
def test_eval_cli_on_the_kk_sample_has_a_column_per_size(tmp_path, tiny_model_path, run_main):
    # The tiny arithmetic model cannot solve K&K (accuracy ~0): this checks the table and the JSON.
    # eval.py in this process (conftest's run_main).
    out = tmp_path / "kk.json"
    ran = run_main("eval", "--config", "configs/grpo.yaml",
                   f"--model.name_or_path={tiny_model_path}", "--data.eval=data/samples/knights.jsonl",
                   "--rollout.engine=hf", "--eval.num_samples=0", "--data.max_prompt_tokens=1000",
                   "--rollout.max_new_tokens=16", f"--eval.output={out}", "--train.progress=false")
    columns = ["greedy_accuracy"] + [f"greedy_{n}ppl" for n in SIZES]
    header = next(line for line in ran.out.splitlines() if line.startswith("eval set"))
    assert header.split() == ["eval", "set", "n", "skipped"] + columns
    result = json.loads(out.read_text())
    assert result["n"] == 14 and result["skipped"] == 0 and all(0 <= result[c] <= 1 for c in columns)
