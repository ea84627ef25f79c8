"""The tiny knights-and-knaves models (pspo/offline/tiny_knights.py): the warm-up target and learning
rate, the build lock and thread count, the untrained twin (the tests' stand-in: same tokenizer), the
presets' quick base (built here: it loads through from_pretrained like a hub model and writes the
released code's layout), and the study build (marked knights_model: run by `scripts/study.sh --task
knights`, skipped while it is not built): it writes the layout with the puzzle's own names, and its
greedy accuracy falls with the number of people."""
import json
import os
import subprocess
import sys
import threading

import fcntl
import importlib.util
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pspo.tasks.data import format_prompt
from pspo.training.config import load_config
from pspo.tasks.knights import KNIGHTS_INSTRUCTION, builtin_knights, warmup_examples
from pspo.tasks.knights_reward import knights_people, knights_reward
from pspo.offline.builtin import TINY_KNIGHTS_MODEL, TINY_KNIGHTS_QUICK, resolve_model_path
from pspo.offline.tiny import build_once
from pspo.offline.tiny_knights import (FIXED_TEXT, QUICK_STEPS, STUDY_STEPS, TAGS,
                                       build_knights_tokenizer, ensure_tiny_knights_model,
                                       greedy_accuracy_by_size, knights_completion, lr_factor,
                                       tiny_knights_path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_completion_lists_people_alphabetically_and_scores_full_reward():
    gold = "(1) Zoey is a knight\n(2) Aaron is a knave\n(3) Mia is a knave"
    completion = knights_completion(gold)
    # sorted by name: Aaron < Mia < Zoey, renumbered from 1
    assert completion == ("<think></think><answer>(1) Aaron is a knave\n(2) Mia is a knave\n"
                          "(3) Zoey is a knight</answer>")
    assert knights_reward("", completion, gold) == 3.0
    # a role swapped in the gold: the same completion parses but is wrong (-0.5)
    assert knights_reward("", completion, gold.replace("Mia is a knave", "Mia is a knight")) == -0.5


def test_the_learning_rate_ramps_then_decays_to_zero_at_the_builds_last_step():
    # LR_WARMUP 50: factor = min(1, (step + 1) / 50) x (1 + cos(π step / steps)) / 2
    # step 0: 1/50 x 1 = 0.02 in every build
    # step 49 of 100: 1 x (1 + cos(0.49π)) / 2 = (1 + 0.0314108) / 2 = 0.5157054
    # step 99 of 100: (1 + cos(0.99π)) / 2 = (1 - 0.9995066) / 2 = 0.0002467: the quick build ends near 0
    # step 49 of 1600: (1 + cos(0.0306250π)) / 2 = (1 + 0.9953753) / 2 = 0.9976876
    assert lr_factor(0, 100) == lr_factor(0, 1600) == 0.02
    assert lr_factor(49, 100) == pytest.approx(0.5157054, abs=1e-7)
    assert lr_factor(99, 100) == pytest.approx(0.0002467, abs=1e-7)
    assert lr_factor(49, 1600) == pytest.approx(0.9976876, abs=1e-7)


def test_the_prompts_fixed_text_is_one_token_each_and_every_prompt_round_trips():
    tokenizer = build_knights_tokenizer(warmup_examples({2: 10, 3: 10, 8: 10}))
    island, question = tokenizer.convert_tokens_to_ids(FIXED_TEXT)
    tags = set(tokenizer.convert_tokens_to_ids(TAGS))
    for ex in builtin_knights("test", test_per_size=3):
        prompt = format_prompt(tokenizer, ex.problem, "")
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        # <|im_start|> user \n ISLAND " You" ...: the rules are the 4th token; the question and the
        # instruction (which holds "<think>") one token, not cut at the tag: no tag id in the prompt
        assert ids[3] == island and ids.count(island) == 1 and ids.count(question) == 1
        assert not tags & set(ids)
        assert tokenizer.decode(ids) == prompt
    # a quiz worded otherwise (a hub file's) still tokenizes and round-trips, tags as tags
    quiz = f"On an island live knights and knaves. Ann says Bob is a knave. Who is who?\n{KNIGHTS_INSTRUCTION}"
    ids = tokenizer(quiz, add_special_tokens=False)["input_ids"]
    assert island not in ids and question not in ids and tokenizer.decode(ids) == quiz
    assert tokenizer.convert_tokens_to_ids("<think>") in ids


def test_every_builtin_prompt_fits_the_presets_prompt_cap(knights_standin_path):
    # the untrained twin's tokenizer is the trained model's (test_the_untrained_twin_matches_the_build)
    tokenizer = AutoTokenizer.from_pretrained(knights_standin_path)
    cap = load_config("configs/knights/grpo.yaml").data.max_prompt_tokens
    prompts = [format_prompt(tokenizer, ex.problem, "") for split in ("train", "test") for ex in builtin_knights(split)]
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    # 2100 prompts, the longest an 8-person one: none is dropped, and the cap is not far above it
    assert cap - 32 < longest <= cap, longest


def test_a_second_caller_waits_for_the_build_in_progress(tmp_path):
    path = tiny_knights_path(str(tmp_path))
    logged, result = [], []
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # "another process" is building
        waiter = threading.Thread(target=lambda: result.append(
            ensure_tiny_knights_model(str(tmp_path), log=logged.append)))
        waiter.start()
        waiter.join(timeout=2.0)
        assert waiter.is_alive() and any("waiting for another process" in m for m in logged)
        os.makedirs(path)                          # that build finishes, then releases the lock
    waiter.join(timeout=10.0)
    # the waiter used the finished folder instead of building again
    assert result == [path] and not any(m.startswith("building") for m in logged)


def test_a_build_runs_on_one_thread_and_restores_the_callers_count(tmp_path, monkeypatch):
    # tiny.build_once runs every offline build on one thread (tiny.one_thread), then gives the caller
    # (train.py, a test) back its own thread count, also when the build fails.
    # torch's thread count is stood for by a recorder: an in-process vLLM engine earlier in a test worker
    # leaves torch's own pool capped at one thread, where this check could not tell a restored count from a
    # lost one (a fresh interpreter to avoid that cost ~5 s of imports). What is checked is one_thread's use of
    # torch.get_num_threads / set_num_threads, which it calls through the torch module.
    threads = [2]                                           # the caller's count
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.__setitem__(0, n))
    path, seen = str(tmp_path / "model"), []

    def build():
        seen.append(torch.get_num_threads())
        os.makedirs(path)
        return path

    def broken():
        seen.append(torch.get_num_threads())
        raise RuntimeError("build failed")
    assert build_once(path, build, log=lambda _: None) == path and seen == [1] and threads == [2]
    with pytest.raises(RuntimeError, match="build failed"):
        build_once(str(tmp_path / "other"), broken, log=lambda _: None)
    assert seen == [1, 1] and threads == [2]


@pytest.mark.slow
def test_loading_a_model_does_not_import_the_puzzle_generator():
    # pspo.training.model resolves builtin: names lazily: neither builder, nor the K&K generator, is imported
    code = "import sys, pspo.training.model; print(sorted(m for m in sys.modules if m.startswith('pspo')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "pspo.tasks.knights" not in out and "pspo.offline.tiny" not in out and "pspo.tasks.data" not in out, out


def test_the_untrained_twin_is_the_builds_start(knights_standin_path, tmp_path):
    # cached apart from both builds (0, QUICK_STEPS and STUDY_STEPS warm-up steps: three folders), and
    # loads like them (from_pretrained, the K&K special tokens)
    assert 0 < QUICK_STEPS < STUDY_STEPS
    paths = [tiny_knights_path(warmup_steps=steps) for steps in (0, QUICK_STEPS, STUDY_STEPS)]
    assert knights_standin_path == paths[0] and len(set(paths)) == 3 and paths[2] == tiny_knights_path()
    assert ensure_tiny_knights_model(warmup_steps=0) == knights_standin_path        # cached: no rebuild
    tokenizer = AutoTokenizer.from_pretrained(knights_standin_path)
    model = AutoModelForCausalLM.from_pretrained(knights_standin_path, dtype=torch.float32)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert set(FIXED_TEXT + TAGS) <= set(tokenizer.get_vocab())                    # one token each
    assert model.config.vocab_size == len(tokenizer) and model.config.num_hidden_layers == 4
    with open(os.path.join(knights_standin_path, "pspo_build.json")) as f:
        assert json.load(f)["warmup_steps"] == 0


def greedy_rewards(tokenizer, model, puzzles, max_new_tokens: int) -> tuple[list[str], list[float]]:
    """Greedy answers of `model` to the puzzles under the chat template, and their K&K rewards."""
    prompts = [format_prompt(tokenizer, ex.problem, "") for ex in puzzles]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts, [knights_reward(p, t, ex.answer) for p, t, ex in zip(prompts, texts, puzzles)]


def _same_tokenizer_and_architecture(path: str, twin: str) -> None:
    """What the rehearsals on the twin rely on: its tokenizer and architecture are the build's."""
    built, stand_in = (AutoTokenizer.from_pretrained(p) for p in (path, twin))
    assert built.get_vocab() == stand_in.get_vocab() and built.chat_template == stand_in.chat_template
    configs = [AutoConfig.from_pretrained(p).to_dict() for p in (path, twin)]
    for config in configs:
        config.pop("_name_or_path")                                   # the folder
    assert configs[0] == configs[1]


@pytest.mark.slow
def test_the_presets_quick_base_builds_loads_and_writes_the_layout(knights_standin_path):
    # what a new user's first K&K preset run builds (~1 minute on 2 cores; README, "Offline models")
    path = resolve_model_path(TINY_KNIGHTS_QUICK)
    assert path == tiny_knights_path(warmup_steps=QUICK_STEPS) and resolve_model_path(TINY_KNIGHTS_QUICK) == path
    _same_tokenizer_and_architecture(path, knights_standin_path)
    with open(os.path.join(path, "pspo_build.json")) as f:
        info = json.load(f)
    assert info["warmup_steps"] == QUICK_STEPS
    # the build-time check on 20 test puzzles per size: the layout (format +1) on nearly every one
    layout = {int(n): rate for n, rate in info["greedy_test_format_by_size"].items()}
    assert sorted(layout) == list(range(2, 9)) and min(layout.values()) >= 0.9, layout
    # and from the saved folder, as a preset loads it: greedy answers to 2 puzzles per size pass the
    # format (reward -1, -0.5 or 3, never -3)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    texts, scores = greedy_rewards(tokenizer, model, builtin_knights("test", test_per_size=2), 80)
    assert sum(s != -3.0 for s in scores) >= 12, list(zip(texts, scores))[:4]


def test_the_knights_study_runs_on_the_study_build():
    # bench/convergence.py --task knights (scripts/study.sh): the presets with builtin:tiny-knights, the
    # build bench/RESULTS.md's K&K results are conditioned on; --quick keeps the presets' quick base
    spec = importlib.util.spec_from_file_location("convergence", os.path.join(ROOT, "bench", "convergence.py"))
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    study = convergence.parse_args(["--task", "knights", "--", "--optim.lr=3e-4"])
    assert study.overrides == [f"--model.name_or_path={TINY_KNIGHTS_MODEL}", "--optim.lr=3e-4"]
    for args in (["--task", "knights", "--quick"], []):                          # K&K smoke run, arithmetic
        assert not any(o.startswith("--model.") for o in convergence.parse_args(args).overrides)


@pytest.mark.slow
@pytest.mark.knights_model
def test_the_untrained_twin_matches_the_build(tiny_knights_model_path, knights_standin_path):
    _same_tokenizer_and_architecture(tiny_knights_model_path, knights_standin_path)


@pytest.mark.slow
@pytest.mark.knights_model
def test_resolves_to_the_cached_build(tiny_knights_model_path):
    assert resolve_model_path(TINY_KNIGHTS_MODEL) == tiny_knights_model_path == tiny_knights_path()
    with open(os.path.join(tiny_knights_model_path, "pspo_build.json")) as f:
        info = json.load(f)
    assert info["warmup_steps"] == STUDY_STEPS
    by_size = {int(n): acc for n, acc in info["greedy_test_accuracy_by_size"].items()}
    assert sorted(by_size) == list(range(2, 9))
    # the spread the presets rely on: 2-person puzzles right more often than 5+-person ones
    assert by_size[2] > max(by_size[n] for n in range(5, 9))


@pytest.mark.slow
@pytest.mark.knights_model
def test_writes_the_layout_with_the_puzzles_names(tiny_knights_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_knights_model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_knights_model_path, dtype=torch.float32)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.max_position_embeddings >= 256 + 80          # the presets' prompt + answer
    test = [ex for ex in builtin_knights("test", test_per_size=10) if knights_people(ex.answer) <= 3]
    texts, scores = greedy_rewards(tokenizer, model, test, 60)
    # the format passes (no -3) and many answers parse: every name of the puzzle, one role each (3 or
    # -0.5). Version 4 parses all 20 (3 right); a model that does not copy names parses none.
    assert -3.0 not in scores, list(zip(texts, scores))[:4]
    assert sum(s in (3.0, -0.5) for s in scores) >= 0.7 * len(test), list(zip(texts, scores))[:4]


@pytest.mark.slow
@pytest.mark.knights_model
def test_accuracy_spreads_by_size(tiny_knights_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_knights_model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_knights_model_path, dtype=torch.float32)
    test = builtin_knights("test", test_per_size=20)
    two = [ex for ex in test if knights_people(ex.answer) == 2]
    seven = [ex for ex in test if knights_people(ex.answer) == 7]
    accuracy = greedy_accuracy_by_size(model, tokenizer, two + seven, batch_size=40)
    assert accuracy[2] > accuracy[7]
