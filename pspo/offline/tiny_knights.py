"""The offline knights-and-knaves models: pspo/offline/tiny.py's recipe on K&K puzzles, in two builds.

- `builtin:tiny-knights-quick`, the base of the shipped K&K presets (configs/knights/): QUICK_STEPS
  warm-up steps, about a minute on 2 CPU cores (README, "Offline models"). It writes the layout
  below for puzzles of every size, but not yet the puzzle's names, so its answers parse rarely and
  its rewards are mostly -1 (format right, answer unparsable).
- `builtin:tiny-knights`, the K&K study's base (`scripts/study.sh --task knights`): STUDY_STEPS
  warm-up steps, ~16-20 minutes on one CPU thread. It writes the names and decides roles partly;
  bench/RESULTS.md's K&K results were measured on it (version 4; version 3 was a 1000-step recipe).

Like `builtin:tiny`, each is built in code once and cached under $PSPO_CACHE (default ~/.cache/pspo)
in a folder named by a hash of its build parameters (the warm-up steps among them), then loaded
through `from_pretrained` as any hub model. The pieces are tiny.py's: Qwen2's tokenizer pipeline
(NFC, Qwen2 split regex, byte-level BPE) with vocab and merges trained here on K&K text, so that
every name and word of the puzzles is one token; the same 4-layer Qwen2 and ChatML template;
`save_model_folder`. <think>, </think>, <answer>, </answer> are added tokens, and so is the text
every built-in prompt shares (the island's rules, and the question with the instruction: ~70 BPE
tokens as 2), so a prompt is 46-165 tokens instead of 126-240 and a warm-up step costs about half
(bench/RESULTS.md). A puzzle worded otherwise (a hub file's quiz) is tokenized word by word. The two
builds differ only in the number of warm-up steps (the learning rate's cosine decays to 0 at the
last): the same tokenizer, architecture, initial weights and batches.

The supervised warm-up teaches the released code's layout with an empty think block,
"<think></think><answer>(1) Aaron is a knave\\n(2) Zoey is a knight</answer>" + <|im_end|>, on
puzzles of `knights.warmup_examples` (after both builtin:knights splits, so neither is seen), with
the loss on the completion only. The answer lists the people in alphabetical order, not the
puzzle's: the reward reads each name's role wherever it stands (knights_reward.py), and in that
order writing the names is a set operation (the puzzle's names not yet written, first in the
alphabet), which this model learns in ~500 steps, while the puzzle's order needs an ordinal copy
("the k-th name of the list") that it had not learned after 2000 steps (notes in
bench/RESULTS.md). The study build's warm-up stops early: the model writes the names and the layout
but decides roles only partly, so its accuracy falls with the number of people and RL has room on
every size. The accuracy per size measured at build time is in the folder's pspo_build.json.

Two processes that need a build at once (two study runs starting together) serialise on a lock
file beside its folder: the second waits for the first build and uses it.

Nothing in the test suite builds the study model. The tests rehearse the K&K presets on the untrained
twin (0 warm-up steps, `knights_standin`): the same tokenizer (built from the same warm-up puzzles,
so the same ids and prompt lengths), the same architecture, seeded random weights, built in
seconds; one slow test builds the quick base the presets name. What needs the study build's weights
(the names, the accuracy spread by size) is checked by tests marked `knights_model`, which
`scripts/study.sh --task knights` runs after building it, before the study itself.
"""
from __future__ import annotations

import math
import random
import time

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from pspo.tasks.data import Example, format_prompt
from pspo.tasks.knights import (ISLAND, KNIGHTS_INSTRUCTION, NAMES, QUESTION, builtin_knights,
                                warmup_examples)
from pspo.tasks.knights_reward import _knights_gold, knights_people, knights_reward
from pspo.offline.tiny import (_build_model, build_once, cache_folder, greedy_completions, right_padded,
                               save_model_folder, train_qwen2_bpe)

VERSION = 4                   # part of the cache key: bump it whenever the build below changes
# The builds' supervised steps (module docstring), part of the cache key too:
STUDY_STEPS = 1600            # builtin:tiny-knights: 964 s on one thread beside a pip install; bench/RESULTS.md §8
QUICK_STEPS = 100             # builtin:tiny-knights-quick: the layout, not the names; bench/RESULTS.md §23
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
    """What the warm-up teaches the model to write before <|im_end|>: the released code's layout, the people
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


def lr_factor(step: int, steps: int) -> float:
    """The warm-up's learning rate at optimizer step `step` (0-based) of `steps`, as a fraction of LR:
    a linear ramp over LR_WARMUP steps times a cosine decay that reaches 0 at `steps`."""
    return min(1.0, (step + 1) / LR_WARMUP) * 0.5 * (1 + math.cos(math.pi * step / steps))


def _warmup(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example], steps: int,
            seed: int, log) -> None:
    """`steps` of AdamW on the completion's cross-entropy, batches of BATCH puzzles of one size
    (sizes drawn with SIZE_WEIGHTS), the learning rate LR x lr_factor. The batches do not depend on
    `steps`: a shorter build sees the first batches of a longer one."""
    rows = _rows(tokenizer, examples)
    sizes = sorted(rows)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    model.train()
    start = time.perf_counter()
    for step in range(1, steps + 1):
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
            log(f"  warm-up step {step}/{steps}  loss {loss.item():.3f}  "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()


def greedy_rewards_by_size(model, tokenizer, examples: list[Example], batch_size: int = 50,
                           max_new_tokens: int = 96) -> dict[int, list[float]]:
    """The K&K reward (knights_reward: 3, -0.5, -1 or -3) of each example's greedy completion, per
    number of people."""
    model.eval()
    prompts, texts = greedy_completions(model, tokenizer, examples, batch_size, max_new_tokens)
    rewards: dict[int, list[float]] = {}
    for prompt, text, ex in zip(prompts, texts, examples):
        rewards.setdefault(knights_people(ex.answer), []).append(knights_reward(prompt, text, ex.answer))
    return dict(sorted(rewards.items()))


def _rate(rewards: dict[int, list[float]], hit) -> dict[int, float]:
    """{people: the fraction of that size's rewards r with hit(r)}, to 3 decimals."""
    return {n: round(sum(map(hit, rs)) / len(rs), 3) for n, rs in rewards.items()}


def greedy_accuracy_by_size(model, tokenizer, examples: list[Example], batch_size: int = 50,
                            max_new_tokens: int = 96) -> dict[int, float]:
    """Exact-match rate of greedy completions (knights_reward == 3, as training's accuracy), per
    number of people."""
    return _rate(greedy_rewards_by_size(model, tokenizer, examples, batch_size, max_new_tokens), lambda r: r == 3.0)


def tiny_knights_path(cache_dir: str | None = None, seed: int = 0, warmup_steps: int = STUDY_STEPS) -> str:
    """Where the K&K build with these parameters lives (built or not), as tiny.tiny_model_path:
    STUDY_STEPS (`builtin:tiny-knights`), QUICK_STEPS (`builtin:tiny-knights-quick`) or 0 (the
    untrained twin) warm-up steps, each in a folder of its own."""
    return cache_folder("tiny-knights", {"version": VERSION, "seed": seed, "warmup_steps": warmup_steps}, cache_dir)


def knights_standin(cache_dir: str | None = None, seed: int = 0, log=print) -> str:
    """The untrained twin of the K&K builds (module docstring): built in seconds, cached."""
    return ensure_tiny_knights_model(cache_dir, seed, log, warmup_steps=0)


def ensure_tiny_knights_model(cache_dir: str | None = None, seed: int = 0, log=print,
                              warmup_steps: int = STUDY_STEPS) -> str:
    """Build the K&K model with `warmup_steps` once and return its folder; later calls return the cached
    folder. A call while another process builds it waits for that build (tiny.build_once: a lock beside
    the folder)."""
    path = tiny_knights_path(cache_dir, seed, warmup_steps)
    return build_once(path, lambda: _build(path, seed, warmup_steps, log), log)


def _build(path: str, seed: int, warmup_steps: int, log) -> str:
    """The tokenizer, the seeded initial weights and `warmup_steps` of warm-up, checked greedily on
    EVAL_PER_SIZE test puzzles of each size and saved with pspo_build.json. The untrained twin (0
    steps) is saved as initialised, unchecked."""
    start = time.perf_counter()
    examples = warmup_examples(WARMUP_PER_SIZE)
    tokenizer = build_knights_tokenizer(examples)
    model = _build_model(tokenizer, False, seed)
    info = {"version": VERSION, "seed": seed, "warmup_steps": warmup_steps, "batch": BATCH, "lr": LR,
            "size_weights": SIZE_WEIGHTS, "warmup_per_size": WARMUP_PER_SIZE,
            "parameters": sum(p.numel() for p in model.parameters())}
    if warmup_steps:
        log(f"building the tiny K&K model in {path} (once: {warmup_steps} warm-up steps)")
        with torch.random.fork_rng(devices=[]):
            _warmup(model, tokenizer, examples, warmup_steps, seed, log)
        rewards = greedy_rewards_by_size(model, tokenizer, builtin_knights("test", test_per_size=EVAL_PER_SIZE))
        info["greedy_test_accuracy_by_size"] = _rate(rewards, lambda r: r == 3.0)
        info["greedy_test_format_by_size"] = _rate(rewards, lambda r: r != -3.0)
        log(f"  tiny K&K model built in {time.perf_counter() - start:.0f} s: greedy accuracy by size "
            f"{info['greedy_test_accuracy_by_size']}, layout (format reward +1) {info['greedy_test_format_by_size']}")
    info["build_seconds"] = round(time.perf_counter() - start, 1)
    return save_model_folder(path, model, tokenizer, info_name="pspo_build.json", info=info, log=log)
