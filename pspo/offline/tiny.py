"""The offline demo model: a tiny Qwen2, its tokenizer built in code, and a supervised warm-up.

Nothing can be downloaded here, so the demo and the tests build their own base model: a 4-layer
Qwen2 (~0.9M parameters) with a byte-level BPE tokenizer trained on the built-in task's text,
warmed up by supervised learning on additions that are in neither builtin split (pspo/tasks/data.py),
and stopped early so that it is right only some of the time and RL has room to improve it. It is
built once, saved with `save_pretrained` under $PSPO_CACHE (default ~/.cache/pspo) in a folder
named by a hash of its build parameters, and from then on loaded through the same
`from_pretrained` path as any hub model (`model.name_or_path: builtin:tiny`).

The tokenizer runs Qwen2's own pipeline (NFC, Qwen2 split regex, byte-level BPE) with vocab and
merges trained here: transformers rebuilds every tokenizer in a folder of model_type qwen2 as a
`Qwen2Tokenizer` from vocab + merges, and with the same pipeline that rebuild
tokenizes exactly as the tokenizer built here does (tests/components/test_tiny.py checks it).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from pspo.tasks.data import Example, builtin_arithmetic, format_prompt, warmup_examples
from pspo.training.config import R1_SYSTEM_PROMPT

VERSION = 2                   # part of the cache key: bump it whenever the build below changes
WARMUP_STEPS = 240            # supervised steps: greedy test accuracy ~0.3-0.4 (bench/RESULTS.md §1)
VOCAB_SIZE = 510              # BPE vocab cap; the small corpus runs out of merges at 403 (+ 2 tags = 405 ids)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]     # pad, turn start, eos
THINK_TOKENS = ["<think>", "</think>"]                                 # added, not special: decoded
CHAT_TEMPLATE = (   # Qwen's ChatML layout, without Qwen's default system message
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BOXED_INT = re.compile(r"\\boxed\{(-?\d+)\}")


def cache_folder(kind: str, params: dict, cache_dir: str | None = None) -> str:
    """Where a model built in code is cached: `<cache_dir>/<kind>-<first 10 hex digits of
    sha256(params as sorted JSON)>`; cache_dir defaults to $PSPO_CACHE, else ~/.cache/pspo. The
    folder may not exist yet."""
    root = cache_dir or os.environ.get("PSPO_CACHE") or os.path.expanduser("~/.cache/pspo")
    key = json.dumps(params, sort_keys=True)
    return os.path.join(root, f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")


def tiny_completion(answer: str) -> str:
    """What the warm-up teaches the model to write before <|im_end|>: the format reward's layout."""
    return f"<think></think>\\boxed{{{answer}}}"


def _tokenizer_corpus() -> list[str]:
    """Text the BPE merges are learned from: the task's prompts and completions, the chat roles and
    the R1 system prompt, so that words like "What", "assistant", "\\boxed" are single tokens."""
    # The <think> tags are added tokens, so they are left out here: with them, the pre-tokenizer
    # would see ">\\" and "boxed" instead of the "\\boxed" a completion produces.
    texts = [f"{ex.problem}\n\\boxed{{{ex.answer}}}" for ex in warmup_examples()]
    texts += ["system\n", "user\n", "assistant\n", R1_SYSTEM_PROMPT,
              "reasoning process here. The answer is \\boxed{82}."] * 100
    return texts


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2's byte-level BPE pipeline with vocab and merges trained on the task's text."""
    return train_qwen2_bpe(_tokenizer_corpus(), VOCAB_SIZE, THINK_TOKENS)


def train_qwen2_bpe(corpus: list[str], vocab_size: int, added: list[str]) -> PreTrainedTokenizerFast:
    """Qwen2's tokenizer pipeline (NFC, Qwen2 split regex, byte-level BPE) with vocab and merges
    learned from `corpus`, `added` as added (decoded, not special) tokens, and the ChatML template:
    the tokenizer of both offline models (this one and tiny_knights.py)."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())   # all 256 bytes
    bpe.train_from_iterator(corpus, trainer)
    bpe.add_tokens(added)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE, model_max_length=1024,
        padding_side="left")       # only a constructor argument survives save_pretrained + reload


def _build_model(tokenizer: PreTrainedTokenizerFast, tie_word_embeddings: bool,
                 seed: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):    # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return model


def _encode_warmup(tokenizer: PreTrainedTokenizerFast, examples: list[Example]) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt + completion + eos rows; labels are -100 except on completion tokens."""
    prompts = tokenizer([format_prompt(tokenizer, ex.problem, "") for ex in examples],
                        add_special_tokens=False)
    targets = tokenizer([tiny_completion(ex.answer) for ex in examples], add_special_tokens=False)
    rows = [(p, t + [tokenizer.eos_token_id]) for p, t in zip(prompts["input_ids"], targets["input_ids"])]
    return right_padded(rows, tokenizer.pad_token_id)


def right_padded(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(prompt ids, completion ids) rows -> ids, labels, attention mask, (B, T) each: right-padded
    (positions 0.. as in a left-padded generate), the labels the completion ids and -100 elsewhere."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id)                 # (B, T)
    labels = torch.full((len(rows), width), -100)                # (B, T)
    attention = torch.zeros(len(rows), width, dtype=torch.long)  # (B, T)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        attention[i, :len(p) + len(c)] = 1
    return ids, labels, attention


def _warmup(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int, log) -> None:
    """Supervised warm-up: AdamW lr 1e-3, batches of 128 drawn with replacement, loss = mean
    cross-entropy over the completion tokens only."""
    ids, labels, attention = _encode_warmup(tokenizer, warmup_examples())
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = torch.randint(len(ids), (128,), generator=generator)      # (128,)
        loss = model(input_ids=ids[batch], attention_mask=attention[batch], labels=labels[batch]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps:
            log(f"  warm-up step {step}/{steps}  loss {loss.item():.3f}  "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()


@torch.no_grad()
def greedy_completions(model, tokenizer, examples: list[Example], batch_size: int,
                       max_new_tokens: int) -> tuple[list[str], list[str]]:
    """(chat prompts, greedy completions) of the examples, generated batch_size at a time: the
    build-time check of both offline models (training evaluates with pspo/evaluation.py)."""
    prompts, texts = [], []
    for i in range(0, len(examples), batch_size):
        chunk = [format_prompt(tokenizer, ex.problem, "") for ex in examples[i:i + batch_size]]
        inputs = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)   # left-padded
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)   # (b, P + new)
        prompts += chunk
        texts += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return prompts, texts


def greedy_accuracy(model, tokenizer, examples: list[Example], batch_size: int = 250,
                    max_new_tokens: int = 12) -> float:
    """Fraction of examples whose greedy completion has \\boxed{n} with n == int(answer).
    A quick integer check for the built-in task; training scores with math-verify (rewards.py)."""
    correct = 0
    texts = greedy_completions(model, tokenizer, examples, batch_size, max_new_tokens)[1]
    for text, ex in zip(texts, examples):
        found = BOXED_INT.search(text)
        correct += found is not None and int(found.group(1)) == int(ex.answer)
    return correct / len(examples)


def tiny_model_path(cache_dir: str | None = None, tie_word_embeddings: bool = False,
                    warmup_steps: int = WARMUP_STEPS, seed: int = 0) -> str:
    """Where the tiny model with these build parameters lives (built or not): a folder under
    `cache_dir` (default $PSPO_CACHE, else ~/.cache/pspo) named by a hash of the parameters."""
    return cache_folder("tiny-qwen2", {"version": VERSION, "tie_word_embeddings": tie_word_embeddings,
                                       "warmup_steps": warmup_steps, "seed": seed}, cache_dir)


def ensure_tiny_model(cache_dir: str | None = None, tie_word_embeddings: bool = False,
                      warmup_steps: int = WARMUP_STEPS, seed: int = 0, log=print) -> str:
    """Build the tiny model once and return its folder; later calls return the cached folder.

    The folder is written under a temporary name and renamed into place, so it either is complete
    or does not exist; a process asking while another builds it waits for that build (build_once).
    With the defaults (240 steps) the build takes about a minute on 2 CPU
    cores and the model answers ~40% of the builtin test split right greedily (0.408 measured; the
    curve is steep: ~0.15 at 200 steps, ~0.55 at 260, ~0.8 at 300, and the seed moves it by ~+-30
    steps). Tied embeddings learn slower: ~0.09 at 240 steps, ~0.3 at 300-320."""
    path = tiny_model_path(cache_dir, tie_word_embeddings, warmup_steps, seed)
    return build_once(path, lambda: _build(path, tie_word_embeddings, warmup_steps, seed, log), log)


def _build(path: str, tie_word_embeddings: bool, warmup_steps: int, seed: int, log) -> str:
    log(f"building the tiny demo model in {path} (once: {warmup_steps} warm-up steps)")
    start = time.perf_counter()
    tokenizer = build_tiny_tokenizer()
    model = _build_model(tokenizer, tie_word_embeddings, seed)
    _warmup(model, tokenizer, warmup_steps, seed, log)
    accuracy = greedy_accuracy(model, tokenizer, builtin_arithmetic("test"))
    info = {"version": VERSION, "tie_word_embeddings": tie_word_embeddings, "warmup_steps": warmup_steps,
            "seed": seed, "parameters": sum(p.numel() for p in model.parameters()),
            "greedy_test_accuracy": accuracy, "build_seconds": round(time.perf_counter() - start, 1)}
    log(f"  tiny model built in {info['build_seconds']} s: greedy accuracy {accuracy:.3f} on builtin test")
    return save_model_folder(path, model, tokenizer, info_name="pspo_build.json", info=info, log=log)


@contextlib.contextmanager
def one_thread():
    """PyTorch on one CPU thread inside the block, its thread count restored after. A model this
    small gains little from a second thread on an idle 2-core machine and loses much when the other
    core is busy: a K&K warm-up step took 0.6-0.9 s on one thread, 2.8 s on two, with other jobs on the
    machine (bench/RESULTS.md §23). One thread also makes a build independent of the machine's core
    count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_once(path: str, build: Callable[[], str], log=print) -> str:
    """`path` if the folder exists, else `build()` (which saves it there, save_model_folder) on one
    thread (`one_thread`) under a lock file beside it: a second process asking meanwhile (two test
    workers, a background build started by scripts/env.sh) waits for that build and uses its folder
    instead of building again.

    The lock file is removed once the folder is in place: a process that opened it before sees the
    folder when its turn comes, and one that comes later finds the folder before looking for a lock."""
    if os.path.isdir(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:         # released when the file closes, also on a crash
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process to finish building {path}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(path):                     # built by the process we waited for
            return path
        with one_thread():
            built = build()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".lock")
        return built


def save_model_folder(path: str, model, tokenizer, *, info_name: str, info: dict, log=print) -> str:
    """save_pretrained of a built model, its tokenizer and a JSON of how it was built, atomically.

    The folder is written under a temporary name and renamed into place, so it either is complete
    or does not exist; when two processes build at once, the later rename fails and that process
    uses the folder that won."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=os.path.dirname(path))
    try:
        model.save_pretrained(tmp)                     # config, generation_config, safetensors
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, info_name), "w") as f:
            json.dump(info, f, indent=2)
        try:
            os.rename(tmp, path)                       # atomic: the folder appears complete
        except OSError:
            if not os.path.isdir(path):
                raise
            log(f"  another process built {path} first: using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)         # nothing left after a successful rename
    return path
