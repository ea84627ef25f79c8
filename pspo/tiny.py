"""The offline demo model: a tiny Qwen2, its tokenizer built in code, and a supervised warm-up.

Nothing can be downloaded here, so the demo and the tests build their own base model: a 4-layer
Qwen2 (~1M parameters) with a byte-level BPE tokenizer trained on the built-in task's text,
warmed up with supervised learning on additions that are NOT in the test split, and stopped early
so it is right only sometimes and RL has room to improve it. It is built once, saved with
`save_pretrained` under $PSPO_CACHE (default ~/.cache/pspo), and from then on loaded through the
same `from_pretrained` path as any hub model (`model.name_or_path: builtin:tiny`).

The tokenizer is a `Qwen2Tokenizer` (vocab + merges trained here): transformers rebuilds any
folder with model_type qwen2 as Qwen2Tokenizer, so building it as one keeps that rebuild exact.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from pspo.data import builtin_arithmetic, format_prompt

TINY_MODEL = "builtin:tiny"
VERSION = 1                       # bump when the build below changes: old caches are not reused
WARMUP_STEPS = 350                # supervised steps; ~0.3-0.4 greedy test accuracy (README)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_completion(answer: str) -> str:
    """What the warm-up teaches the model to write (then <|im_end|>): the format reward's layout."""
    return f"<think></think>\\boxed{{{answer}}}"


def build_tiny_tokenizer() -> Qwen2Tokenizer:
    """Qwen2's byte-level BPE pipeline, with vocab and merges trained on the task's text."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    corpus = [ex.problem + " " + tiny_completion(ex.answer) for ex in builtin_arithmetic("warmup")[:2000]]
    corpus += ["user assistant system The answer is boxed think Assistant User"] * 50
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL[:1], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", additional_special_tokens=SPECIAL[1:],
                               padding_side="left", model_max_length=256)
    tokenizer.add_tokens(THINK)                       # single tokens, kept when decoding
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(tokenizer, tie_word_embeddings: bool, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return model


def _warmup(model, tokenizer, steps: int, seed: int, log) -> None:
    """Supervised learning on prompt -> completion<|im_end|>, loss on the completion only."""
    examples = builtin_arithmetic("warmup")
    rows = []
    for ex in examples:
        prompt = tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
        target = tokenizer(tiny_completion(ex.answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, target))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, t) in enumerate(rows):                 # right-padded: positions start at 0
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
        attention[i, :len(p) + len(t)] = 1
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = torch.randint(len(rows), (128,), generator=g)
        loss = model(input_ids=ids[batch], attention_mask=attention[batch], labels=labels[batch]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps:
            log(f"  warm-up step {step}/{steps}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f}s)")
    model.eval()


def tiny_model_path(cache_dir: str | None = None, tie_word_embeddings: bool = False,
                    warmup_steps: int = WARMUP_STEPS, seed: int = 0) -> str:
    """Where the tiny model with these build parameters lives (built or not)."""
    cache_dir = cache_dir or os.environ.get("PSPO_CACHE") or os.path.expanduser("~/.cache/pspo")
    key = json.dumps([VERSION, tie_word_embeddings, warmup_steps, seed])
    return os.path.join(cache_dir, f"tiny-qwen2-{hashlib.sha256(key.encode()).hexdigest()[:10]}")


def ensure_tiny_model(cache_dir: str | None = None, tie_word_embeddings: bool = False,
                      warmup_steps: int = WARMUP_STEPS, seed: int = 0, log=print) -> str:
    """Build the tiny model once (atomically: temp folder, then rename) and return its folder."""
    path = tiny_model_path(cache_dir, tie_word_embeddings, warmup_steps, seed)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log(f"building the tiny demo model in {path} (once; about a minute)")
    tokenizer = build_tiny_tokenizer()
    model = _build_model(tokenizer, tie_word_embeddings, seed)
    _warmup(model, tokenizer, warmup_steps, seed, log)
    tmp = tempfile.mkdtemp(prefix=".tmp-tiny-", dir=os.path.dirname(path))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:                                   # another process finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_tiny(path: str):
    """(model, tokenizer) from a built folder, through the ordinary from_pretrained path."""
    from transformers import AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
