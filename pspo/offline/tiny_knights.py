"""The offline knights-and-knaves model: pspo/offline/tiny.py's recipe on K&K puzzles
(`builtin:tiny-knights`).

Like `builtin:tiny`, it is built in code once and cached under $PSPO_CACHE (default ~/.cache/pspo)
in a folder named by a hash of its build parameters, then loaded through `from_pretrained` as any
hub model. The pieces are tiny.py's: Qwen2's tokenizer pipeline (NFC, Qwen2 split regex, byte-level
BPE) with vocab and merges trained here on K&K text, so that every name and word of the puzzles is
one token; the same 4-layer Qwen2 and ChatML template; `save_model_folder`. <think>, </think>,
<answer>, </answer> are added tokens, and so is the text every built-in prompt shares (the island's
rules, and the question with the instruction: ~70 BPE tokens as 2), so a prompt is 46-165 tokens
instead of 126-240 and a warm-up step costs about half (bench/RESULTS.md). A puzzle
worded otherwise (a hub file's quiz) is tokenized word by word.

The supervised warm-up teaches the reference code's layout with an empty think block,
"<think></think><answer>(1) Aaron is a knave\\n(2) Zoey is a knight</answer>" + <|im_end|>, on
puzzles of `knights.warmup_examples` (after both builtin:knights splits, so neither is seen), with
the loss on the completion only. The answer lists the people in alphabetical order, not the
puzzle's: the reward reads each name's role wherever it stands (knights_reward.py), and in that
order writing the names is a set operation (the puzzle's names not yet written, first in the
alphabet), which this model learns in ~500 steps, while the puzzle's order needs an ordinal copy
("the k-th name of the list") that it had not learned after 2000 steps (notes in
bench/RESULTS.md). The warm-up stops early: the model writes the names and the layout but decides
roles only partly, so its accuracy falls with the number of people and RL has room on every size.
The accuracy per size measured at build time is in the folder's pspo_build.json.

Two processes that need the model at once (two study runs starting together) serialise on a lock
file beside the folder: the second waits for the first build and uses it.

The build takes ~16-20 minutes on one CPU thread, so nothing in the test suite builds it. The tests
rehearse the K&K presets on its untrained twin (`trained=False`, `knights_standin`): the same
tokenizer (built from the same warm-up puzzles, so the same ids and prompt lengths), the same
architecture, seeded random weights, built in seconds. What needs the trained weights (the layout,
the accuracy spread by size) is checked by tests marked `knights_model`, which `scripts/study.sh
--task knights` runs after building the model, before the study itself.
"""
from __future__ import annotations

import math
import random
import time

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from pspo.tasks.data import Example, format_prompt
from pspo.tasks.knights import (ISLAND, KNIGHTS_INSTRUCTION, NAMES, QUESTION, SIZES, builtin_knights,
                                warmup_examples)
from pspo.tasks.knights_reward import _knights_gold, knights_people, knights_reward
from pspo.offline.tiny import (_build_model, build_once, cache_folder, greedy_completions, right_padded,
                               save_model_folder, train_qwen2_bpe)

VERSION = 4                   # part of the cache key: bump it whenever the build below changes
# supervised steps (964 s on one thread beside a pip install); accuracy by size in bench/RESULTS.md §8
WARMUP_STEPS = 1600
# puzzles per step, all of one size (drawn with SIZE_WEIGHTS) so padding stays small
BATCH = 32
# the small sizes, where the logic is learnable, twice
SIZE_WEIGHTS = {2: 2, 3: 2, 4: 2, 5: 1, 6: 1, 7: 1, 8: 1}
LR, LR_WARMUP = 3e-3, 50      # AdamW (β2 0.98): linear warm-up over LR_WARMUP steps, then cosine decay to 0
# fresh puzzles, each seen ~1-2 times in the warm-up (2-person: all the stream has left after the splits)
WARMUP_PER_SIZE = {2: 99, 3: 2000, 4: 2000, 5: 2000, 6: 1500, 7: 1500, 8: 1500}
VOCAB_SIZE = 1024             # BPE vocab cap
EVAL_PER_SIZE = 20            # build-time check: the first 20 test puzzles of each size
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]     # added, not special: decoded
# added too: the text every built-in prompt shares, one token each (the longest match wins over <think>)
FIXED_TEXT = [ISLAND, f"{QUESTION}\n{KNIGHTS_INSTRUCTION}"]


def knights_completion(gold: str) -> str:
    """What the warm-up teaches the model to write before <|im_end|>: the reference code's layout, the people
    in alphabetical order (module docstring), numbered from 1."""
    roles = sorted(_knights_gold(gold))                       # ((name, "knight" | "knave"), ...)
    lines = [f"({i + 1}) {name} is a {role}" for i, (name, role) in enumerate(roles)]
    return "<think></think><answer>" + "\n".join(lines) + "</answer>"


def build_knights_tokenizer(examples: list[Example]) -> PreTrainedTokenizerFast:
    """tiny.py's byte-level BPE pipeline, merges learned from the puzzles, names, instruction and
    answers, so that every name and the words of the puzzles are single tokens."""
    # the tags are added tokens, so they stay out of the corpus (as in tiny.py)
    corpus = [f"{ex.problem}\n{ex.answer}" for ex in examples]
    corpus += ["system\n", "user\n", "assistant\n", KNIGHTS_INSTRUCTION, " ".join(NAMES)] * 50
    return train_qwen2_bpe(corpus, VOCAB_SIZE, TAGS + FIXED_TEXT)


def _rows(tokenizer: PreTrainedTokenizerFast,
          examples: list[Example]) -> dict[int, list[tuple[list[int], list[int]]]]:
    """(chat prompt ids, completion ids + eos) per number of people."""
    prompts = tokenizer([format_prompt(tokenizer, ex.problem, "") for ex in examples],
                        add_special_tokens=False)
    answers = tokenizer([knights_completion(ex.answer) for ex in examples], add_special_tokens=False)
    rows: dict[int, list[tuple[list[int], list[int]]]] = {}
    for p, c, ex in zip(prompts["input_ids"], answers["input_ids"], examples):
        rows.setdefault(knights_people(ex.answer), []).append((p, c + [tokenizer.eos_token_id]))
    return rows


def _warmup(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example], seed: int,
            log) -> None:
    """WARMUP_STEPS of AdamW on the completion's cross-entropy, batches of BATCH puzzles of one size
    (sizes drawn with SIZE_WEIGHTS), LR after a linear warm-up, cosine decay to 0 at the end."""
    rows = _rows(tokenizer, examples)
    sizes = sorted(rows)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / LR_WARMUP)
                                                 * 0.5 * (1 + math.cos(math.pi * step / WARMUP_STEPS)))
    model.train()
    start = time.perf_counter()
    for step in range(1, WARMUP_STEPS + 1):
        size = rng.choices(sizes, [SIZE_WEIGHTS[n] for n in sizes])[0]
        ids, labels, attention = right_padded([rng.choice(rows[size]) for _ in range(BATCH)],
                                              tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            log(f"  warm-up step {step}/{WARMUP_STEPS}  loss {loss.item():.3f}  "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()


def greedy_accuracy_by_size(model, tokenizer, examples: list[Example], batch_size: int = 50,
                            max_new_tokens: int = 96) -> dict[int, float]:
    """Exact-match rate of greedy completions (knights_reward == 3, as training's accuracy), per
    number of people."""
    correct = {n: 0 for n in SIZES}
    count = {n: 0 for n in SIZES}
    model.eval()
    prompts, texts = greedy_completions(model, tokenizer, examples, batch_size, max_new_tokens)
    for prompt, text, ex in zip(prompts, texts, examples):
        n = knights_people(ex.answer)
        count[n] += 1
        correct[n] += knights_reward(prompt, text, ex.answer) == 3.0
    return {n: round(correct[n] / count[n], 3) for n in SIZES if count[n]}


def tiny_knights_path(cache_dir: str | None = None, seed: int = 0, trained: bool = True) -> str:
    """Where the K&K model with these build parameters lives (built or not), as tiny.tiny_model_path.
    trained=False: its untrained twin (module docstring), in a folder of its own."""
    kind = "tiny-knights" if trained else "tiny-knights-untrained"
    return cache_folder(kind, {"version": VERSION, "seed": seed}, cache_dir)


def knights_standin(cache_dir: str | None = None, seed: int = 0, log=print) -> str:
    """The untrained twin of `builtin:tiny-knights` (module docstring): built in seconds, cached."""
    return ensure_tiny_knights_model(cache_dir, seed, log, trained=False)


def ensure_tiny_knights_model(cache_dir: str | None = None, seed: int = 0, log=print,
                              trained: bool = True) -> str:
    """Build the K&K model once and return its folder; later calls return the cached folder. A call
    while another process builds it waits for that build (tiny.build_once: a lock beside the folder)."""
    path = tiny_knights_path(cache_dir, seed, trained)
    return build_once(path, lambda: _build(path, seed, log) if trained else _build_untrained(path, seed, log),
                      log)


def _build_untrained(path: str, seed: int, log) -> str:
    """The tokenizer and the seeded initial weights of `_build`, saved without the warm-up."""
    start = time.perf_counter()
    tokenizer = build_knights_tokenizer(warmup_examples(WARMUP_PER_SIZE))
    model = _build_model(tokenizer, False, seed)
    info = {"version": VERSION, "seed": seed, "warmup_steps": 0, "warmup_per_size": WARMUP_PER_SIZE,
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.perf_counter() - start, 1)}
    return save_model_folder(path, model, tokenizer, "pspo_build.json", info, log)


def _build(path: str, seed: int, log) -> str:
    log(f"building the tiny K&K model in {path} (once: {WARMUP_STEPS} warm-up steps, "
        "~16 minutes on one thread)")
    start = time.perf_counter()
    examples = warmup_examples(WARMUP_PER_SIZE)
    tokenizer = build_knights_tokenizer(examples)
    model = _build_model(tokenizer, False, seed)
    with torch.random.fork_rng(devices=[]):
        _warmup(model, tokenizer, examples, seed, log)
    accuracy = greedy_accuracy_by_size(model, tokenizer, builtin_knights("test", test_per_size=EVAL_PER_SIZE))
    info = {"version": VERSION, "seed": seed, "warmup_steps": WARMUP_STEPS, "batch": BATCH, "lr": LR,
            "size_weights": SIZE_WEIGHTS, "warmup_per_size": WARMUP_PER_SIZE,
            "parameters": sum(p.numel() for p in model.parameters()),
            "greedy_test_accuracy_by_size": accuracy, "build_seconds": round(time.perf_counter() - start, 1)}
    log(f"  tiny K&K model built in {info['build_seconds']} s: greedy accuracy by size {accuracy}")
    return save_model_folder(path, model, tokenizer, "pspo_build.json", info, log)
