"""pspo/tasks/data.py: the fixed built-in splits, local file loading, one-line DataErrors, prompts, and
which rows a run uses (bad golds and too-long prompts left out, reported in one line each)."""
import hashlib
import json
import os
import random
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pspo.tasks import data
from pspo.training.config import R1_SYSTEM_PROMPT
from pspo.tasks.data import (DataError, Example, builtin_arithmetic, format_prompt, load_examples,
                             prompt_set, resolve_system_prompt, warmup_examples)
from pspo.rewards import format_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBLEM = re.compile(r"What is (\d\d) \+ (\d\d)\?")


def _digest(examples: list[Example]) -> str:
    return hashlib.sha256(json.dumps([[e.problem, e.answer] for e in examples]).encode()).hexdigest()


def test_builtin_splits_are_fixed_disjoint_and_correct():
    train, test = builtin_arithmetic("train"), builtin_arithmetic("test")
    assert len(train) == len(test) == 500
    assert len({e.problem for e in train}) == 500 and len({e.problem for e in test}) == 500
    assert not {e.problem for e in train} & {e.problem for e in test}
    for ex in train + test:      # "What is 47 + 35?" -> "82", both operands 2-digit
        a, b = map(int, PROBLEM.fullmatch(ex.problem).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99 and ex.answer == str(a + b)
    assert builtin_arithmetic("train") == train and builtin_arithmetic("test") == test
    assert builtin_arithmetic("test", seed=1) != test                  # the seed picks the sets
    assert builtin_arithmetic("test", num_examples=20) == test[:20]    # a prefix of the same order


@pytest.mark.slow
def test_builtin_splits_leave_the_global_rng_alone_and_match_across_processes():
    random.seed(7)
    expected = random.random()
    random.seed(7)
    test = builtin_arithmetic("test")
    assert random.random() == expected
    code = ("import hashlib, json; from pspo.tasks.data import builtin_arithmetic as b; "
            "print(hashlib.sha256(json.dumps([[e.problem, e.answer] for e in b('test')]).encode()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _digest(test)


def test_warmup_examples_avoid_both_builtin_splits():
    # 90 * 90 = 8100 ordered pairs, minus 500 test and 500 train = 7100
    warm = {e.problem for e in warmup_examples()}
    assert len(warm) == 7100
    assert not warm & {e.problem for e in builtin_arithmetic("test")}
    assert not warm & {e.problem for e in builtin_arithmetic("train")}


def test_builtin_through_load_examples_and_its_errors():
    assert load_examples("builtin:arithmetic", split="test") == builtin_arithmetic("test")
    assert load_examples("builtin:arithmetic", split="train", max_examples=3) == builtin_arithmetic("train")[:3]
    with pytest.raises(DataError, match=r"builtin:arithmetic: unknown split 'validation'.*train, test"):
        load_examples("builtin:arithmetic", split="validation")
    with pytest.raises(DataError, match="num_examples"):
        builtin_arithmetic("train", num_examples=5000)    # 2 x 5000 > 8100: splits would overlap
    with pytest.raises(DataError, match="max_examples"):
        load_examples("builtin:arithmetic", max_examples=0)


def test_local_jsonl_with_custom_fields_coerces_answers_to_str(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"question": "1+1?", "solution": 2, "extra": "x"}, {"question": "half?", "solution": "\\frac{1}{2}"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_examples(str(path), problem_field="question", answer_field="solution")
    assert examples == [Example("1+1?", "2"), Example("half?", "\\frac{1}{2}")]
    # a local file is one split: the split name is ignored; max_examples keeps the first rows
    assert load_examples(str(path), split="test", problem_field="question", answer_field="solution",
                         max_examples=1) == examples[:1]


def test_local_json_array_and_parquet(tmp_path):
    json_path = tmp_path / "data.json"
    json_path.write_text(json.dumps([{"problem": "p1", "answer": "a1"}, {"problem": "p2", "answer": "a2"}]))
    assert load_examples(str(json_path)) == [Example("p1", "a1"), Example("p2", "a2")]
    parquet_path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["3+4?", "5+6?"], "gold": [7, 11]}), parquet_path)
    assert load_examples(str(parquet_path), problem_field="prompt", answer_field="gold") == [
        Example("3+4?", "7"), Example("5+6?", "11")]


def test_missing_field_names_the_field_and_lists_the_existing_ones(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q", "solution": "s"}) + "\n")
    with pytest.raises(DataError) as err:
        load_examples(str(path), problem_field="question", answer_field="answer")
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and "'answer'" in message and "question, solution" in message


@pytest.mark.parametrize("name, content, message", [
    ("nope.jsonl", None, "{path}: file not found"),
    ("empty.jsonl", "", "{path}: the file is empty"),
    ("blank.jsonl", "\n\n", "{path}: no rows (blank lines only)"),
    ("d.csv", "problem,answer\n1+1,2\n", "{path}: expected a .jsonl, .json, .parquet file or a hub dataset name"),
    # a JSON syntax error is named by line: line 3 after a blank line 2, its column 19 the space after "3+3"
    # ('{"problem": "3+3" "answer"': 18 characters, then the missing ',')
    ("broken.jsonl", '{"problem": "1+1", "answer": "2"}\n\n{"problem": "3+3" "answer": "6"}\n',
     "{path}:3: not valid JSON (Expecting ',' delimiter, column 19); expected one JSON object per line"),
    ("broken2.jsonl", "{not json\n", "{path}:1: not valid JSON (Expecting property name enclosed in double quotes, "
                                      "column 2)"),
    ("list.jsonl", '{"problem": "q", "answer": "1"}\n[1, 2]\n', "{path}:2: expected one JSON object per line, "
                                                                  "got a list"),
    # one JSON document over several lines: its own line and column (the '"' after '  {"problem": "q2" ')
    ("doc.json", '[\n  {"problem": "q", "answer": "1"},\n  {"problem": "q2" "answer": "2"}\n]\n',
     "{path}:3: not valid JSON (Expecting ',' delimiter, column 20)"),
])
def test_missing_empty_broken_and_unsupported_files(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as err:
        load_examples(str(path))
    assert str(err.value) == message.format(path=path)


def test_a_folder_or_a_path_that_is_not_there(tmp_path):
    # a folder named like a data file; a path (not a hub id "org/name") that does not exist; a folder of
    # data files is datasets' (a hub dataset's layout: the file names give the splits)
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'd.jsonl'}: a folder, expected a .jsonl, .json, "
                                                  ".parquet file")):
        load_examples(str(tmp_path / "d.jsonl"))
    for missing in (str(tmp_path / "nope"), "./nope-folder"):
        with pytest.raises(DataError, match=re.escape(f"{missing}: no such file or folder, expected a .jsonl, "
                                                      ".json, .parquet file, a folder of them or a hub dataset "
                                                      "name")):
            load_examples(missing)
    folder = tmp_path / "set"
    folder.mkdir()
    with pytest.raises(DataError, match=re.escape(f"{folder}: cannot load split 'train' (EmptyDatasetError: ")):
        load_examples(str(folder))
    (folder / "train.jsonl").write_text(json.dumps({"problem": "q", "answer": "1"}) + "\n")
    assert load_examples(str(folder), split="train") == [Example("q", "1")]
    with pytest.raises(DataError, match=re.escape(f"{folder}: cannot load split 'test' (ValueError: Unknown split "
                                                  "\"test\". Should be one of ['train'].)")):
        load_examples(str(folder), split="test")


def test_a_file_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path, monkeypatch):
    # line 1 '{"problem": "1+1?", "answer": "2"}\n' is 35 bytes; line 2 starts '{"problem": "caf' (16 bytes),
    # then the Latin-1 byte 0xe9 of "é": offset 35 + 16 = 51, line 2. (datasets read it and pyarrow
    # failed on the row, a 38-line traceback.)
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"problem": "1+1?", "answer": "2"}\n{"problem": "caf\xe9?", "answer": "3"}\n')
    message = f"{path}: not valid UTF-8 at byte 51 (line 2): byte 0xe9, invalid continuation byte"
    with pytest.raises(DataError, match=re.escape(message)) as err:
        load_examples(str(path))
    assert "\n" not in str(err.value)
    # read in 4-byte chunks: "é" in UTF-8 (c3 a9) straddles two chunks and is fine; the bad byte is
    # found in a later chunk at the same offset. A character cut off by the end of the file: its first byte.
    monkeypatch.setattr(data, "UTF8_CHUNK_BYTES", 4)
    good = tmp_path / "utf8.json"
    good.write_bytes(json.dumps([{"problem": "caf\u00e9?", "answer": "3"}], ensure_ascii=False).encode())
    assert load_examples(str(good)) == [Example("caf\u00e9?", "3")]
    with pytest.raises(DataError, match=re.escape(message)):
        load_examples(str(path))
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b'{"problem": "1+1?", "answer": "2"}\n\xc3')                  # 35 bytes, then half an "é"
    with pytest.raises(DataError, match=re.escape(f"{cut}: not valid UTF-8 at byte 35 (line 2): byte 0xc3")):
        load_examples(str(cut))


def test_a_parquet_string_that_is_not_utf8_is_one_line(tmp_path):
    # parquet is binary: no byte offset to name, the bad byte is found when the rows are read
    path = tmp_path / "bad.parquet"
    bad = pa.array([b"caf\xe9?"], type=pa.binary()).view(pa.string())   # skips pyarrow's UTF-8 check
    pq.write_table(pa.table({"problem": bad, "answer": ["3"]}), path)
    with pytest.raises(DataError, match=re.escape(f"{path}: a text field is not valid UTF-8 (invalid continuation "
                                                  "byte, byte 0xe9)")):
        load_examples(str(path))


@pytest.mark.slow
def test_train_py_stops_on_a_file_that_is_not_utf8_with_one_line(tmp_path, tiny_model_path, run_main):
    # train.py in this process (conftest's run_main): a DataError, whose line train.py prints, exit 2
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"problem": "1+1?", "answer": "2"}\n{"problem": "caf\xe9?", "answer": "3"}\n')
    with pytest.raises(DataError) as e:
        run_main("train", "--config", "configs/grpo.yaml", f"--data.train={path}",
                 f"--model.name_or_path={tiny_model_path}", f"--train.output_dir={tmp_path / 'run'}",
                 "--data.eval=", "--train.progress=false")
    assert f"error: {e.value}".splitlines() == [
        f"error: {path}: not valid UTF-8 at byte 51 (line 2): byte 0xe9, invalid continuation byte; "
        "save the file as UTF-8"]


def test_other_names_go_to_the_hub_with_the_split(monkeypatch):
    import datasets
    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, split) if config is None else (name, config, split))
        if split == "nope":
            raise ValueError('Unknown split "nope". Should be one of [\'train\'].')
        n = 0 if split == "empty" else 1
        return datasets.Dataset.from_dict({"problem": ["q"] * n, "answer": [1] * n})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_examples("org/math", split="test") == [Example("q", "1")]
    with pytest.raises(DataError, match=r"^org/math: cannot load split 'nope' \(ValueError: Unknown split"):
        load_examples("org/math", split="nope")
    with pytest.raises(DataError, match=r"^org/math: the dataset \(split 'empty'\) is empty$"):
        load_examples("org/math", split="empty")
    load_examples("org/math", split="test", config="main")                    # a hub configuration (gsm8k: main)
    assert calls == [("org/math", "test"), ("org/math", "nope"), ("org/math", "empty"), ("org/math", "main", "test")]


class _ChatML:
    """A stand-in tokenizer: ChatML as Qwen writes it, rendered by hand."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
            "<|im_start|>assistant\n"


def test_format_prompt_omits_an_empty_system_prompt():
    assert format_prompt(_ChatML(), "What is 47 + 35?", "") == \
        "<|im_start|>user\nWhat is 47 + 35?<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt(_ChatML(), "Q", "Be brief.") == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_r1_system_prompt_asks_for_the_layout_the_format_reward_pays_for():
    assert resolve_system_prompt("r1") == R1_SYSTEM_PROMPT
    assert resolve_system_prompt("Be brief.") == "Be brief." and resolve_system_prompt("") == ""
    assert format_prompt(_ChatML(), "Q", "r1") == format_prompt(_ChatML(), "Q", R1_SYSTEM_PROMPT)
    # it asks for <think> ... </think> and then \boxed{}, and its own example earns the format reward
    assert R1_SYSTEM_PROMPT.index("<think> </think>") < R1_SYSTEM_PROMPT.index("\\boxed{}")
    example = R1_SYSTEM_PROMPT[R1_SYSTEM_PROMPT.index("<think> reasoning"):].rstrip(".")
    assert example == "<think> reasoning process here </think> The answer is \\boxed{answer here}"
    assert format_reward("", example, "") == 1.0
    assert data.BUILTIN_ARITHMETIC == "builtin:arithmetic"


class _Words(_ChatML):
    """ChatML + one token per whitespace-separated word: a prompt is (words in the problem) + 2 tokens
    ("<|im_start|>user" and "<|im_start|>assistant"; the problem's last word carries "<|im_end|>")."""

    def __call__(self, texts, add_special_tokens, verbose):
        return {"input_ids": [list(range(len(text.split()))) for text in texts]}


def _problem(words: int) -> str:
    return " ".join(["w"] * words)


def test_prompt_set_drops_prompts_over_the_limit_in_one_line(capsys):
    # problems of 3, 11, 4, 20, 5 words -> prompts of 5, 13, 6, 22, 7 tokens; limit 10 drops rows 1 and 3
    examples = [Example(_problem(n), "1") for n in (3, 11, 4, 20, 5)]
    out = prompt_set("data.train x.jsonl", examples, _Words(), system_prompt="", max_prompt_tokens=10)
    assert capsys.readouterr().out == \
        "data.train x.jsonl: dropped 2 of 5 prompts longer than data.max_prompt_tokens=10 (rows 1, 3)\n"
    assert out.examples == [examples[0], examples[2], examples[4]] and out.skipped == 2
    assert [len(ids) for ids in out.ids] == [5, 6, 7] and out.texts[0].endswith("<|im_start|>assistant\n")
    # a prompt exactly at the limit stays (5 tokens, limit 5); never truncated
    assert prompt_set("d", examples[:1], _Words(), system_prompt="", max_prompt_tokens=5).ids == [[0, 1, 2, 3, 4]]
    # 12 rows too long: the line names 10 of them, then "..."
    prompt_set("d", [Example(_problem(9), "1")] * 12 + [Example("w", "1")], _Words(), system_prompt="",
               max_prompt_tokens=10)
    assert capsys.readouterr().out == ("d: dropped 12 of 13 prompts longer than data.max_prompt_tokens=10 "
                                       "(rows 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ...)\n")


def test_prompt_set_with_nothing_left_is_one_line():
    with pytest.raises(DataError, match=r"^data.eval e.jsonl: no rows left of 2 \(1 without a usable gold answer, "
                                        r"1 prompts longer than data.max_prompt_tokens=4\)$"):
        prompt_set("data.eval e.jsonl", [Example(_problem(3), "1"), Example("w", "\\frac{2}{")], _Words(),
                   system_prompt="", max_prompt_tokens=4)


def test_bad_golds_skip_reports_once_and_error_names_the_row(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    rows = [{"problem": "q0", "answer": "7"}, {"problem": "q1", "answer": None}, {"problem": "q2", "answer": "\\frac{2}{"},
            {"problem": None, "answer": "3"}, {"problem": "q4", "answer": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_examples(str(path))               # missing values load as "": no crash
    assert examples[1] == Example("q1", "") and examples[3] == Example("", "3") and examples[4] == Example("q4", "0.5")
    out = prompt_set("data.train d.jsonl", examples, _Words(), system_prompt="", max_prompt_tokens=512)
    assert [ex.problem for ex in out.examples] == ["q0", "q4"] and out.skipped == 3
    assert capsys.readouterr().out == (
        "data.train d.jsonl: left out 3 of 5 rows without a usable problem and gold answer (data.bad_gold=skip): "
        "rows 1 (no gold answer), 2 (gold answer '\\frac{2}{' does not parse with math-verify), 3 (no problem text)\n")
    with pytest.raises(DataError) as err:
        prompt_set("data.train d.jsonl", examples, _Words(), system_prompt="", max_prompt_tokens=512,
                   bad_gold="error")
    assert str(err.value) == "data.train d.jsonl: row 1: no gold answer (data.bad_gold=error; 'skip' leaves such rows out)"
    with pytest.raises(DataError, match=r"^data.train d.jsonl: row 0: gold answer '\\frac\{2\}\{' does not parse"):
        prompt_set("data.train d.jsonl", examples[2:3], _Words(), system_prompt="", max_prompt_tokens=512,
                   bad_gold="error")
