"""pspo/offline/tiny.py: the tokenizer survives save + AutoTokenizer unchanged; the model builds once, atomically."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from pspo.offline import tiny
from pspo.tasks.data import format_prompt
from pspo.training.config import R1_SYSTEM_PROMPT
from pspo.offline.tiny import build_tiny_tokenizer, ensure_tiny_model, tiny_completion, tiny_model_path

TEXTS = [   # prompts + completions as the trainer sees them, and text with odd whitespace/unicode
    format_prompt(build_tiny_tokenizer(), "What is 47 + 35?", "") + tiny_completion("82") + "<|im_end|>",
    format_prompt(build_tiny_tokenizer(), "What is 99 + 10?", R1_SYSTEM_PROMPT) + tiny_completion("109"),
    "<think>\n47 + 35:  7+5 = 12, carry 1\n\n4+3+1 = 8\n</think>\n\nThe answer is \\boxed{82}.<|im_end|>",
    "  leading spaces\ttab\r\nCRLF   trailing   \n\n\n café 中文 😀 <think> x </think><|endoftext|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One 2-step build (~2 s; its cost is the steps) shared by the tests below, and what it logged."""
    cache, logs = str(tmp_path_factory.mktemp("cache")), []
    return ensure_tiny_model(cache_dir=cache, warmup_steps=2, log=logs.append), cache, logs


def test_tokenizer_reloads_identically_through_autotokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(tmp_path)   # a qwen2 folder: the rebuild path
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
        assert reloaded.decode(ids) == tokenizer.decode(ids) == text           # lossless byte-level BPE
        # what a reward function sees: <think> tags kept, <|im_end|> / <|endoftext|> dropped
        assert reloaded.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "<think>" in reloaded.decode(tokenizer(TEXTS[2])["input_ids"], skip_special_tokens=True)
    assert "<|im_end|>" not in reloaded.decode(tokenizer(TEXTS[2])["input_ids"], skip_special_tokens=True)
    assert reloaded.padding_side == "left"
    assert reloaded.chat_template == tokenizer.chat_template == tiny.CHAT_TEMPLATE
    assert (reloaded.eos_token, reloaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len(reloaded) == len(tokenizer)
    batch = reloaded(["What is 1 + 2?", "What"], padding=True, add_special_tokens=False)["input_ids"]
    assert batch[1][0] == reloaded.pad_token_id and batch[1][-1] != reloaded.pad_token_id   # padded on the left


def test_task_text_is_cheap(tokenizer):
    # prompt: <|im_start|> user \n What ' is' ' ' 4 7 ' +' ' ' 3 5 ? <|im_end|> \n <|im_start|> assistant \n = 18
    # completion: <think> </think> \boxed { 8 2 } <|im_end|> = 8 (Qwen2's regex splits numbers into digits)
    prompt = format_prompt(tokenizer, "What is 47 + 35?", "")
    assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == 18
    completion = tokenizer(tiny_completion("82") + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(completion) == [
        "<think>", "</think>", "\\boxed", "{", "8", "2", "}", "<|im_end|>"]
    # the R1 system prompt fits the 256-position context with room for a completion
    with_system = format_prompt(tokenizer, "What is 47 + 35?", R1_SYSTEM_PROMPT)
    assert len(tokenizer(with_system, add_special_tokens=False)["input_ids"]) < 128


def test_built_folder_loads_and_generates(built):
    path, cache, logs = built
    assert os.path.dirname(path) == cache and os.path.basename(path).startswith("tiny-qwen2-")
    assert os.listdir(cache) == [os.path.basename(path)]                 # no temporary folder left
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "pspo_build.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    assert json.load(open(os.path.join(path, "pspo_build.json")))["warmup_steps"] == 2
    assert any("building" in line for line in logs)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tokenizer.pad_token_id
    prompts = [format_prompt(tokenizer, "What is 12 + 34?", ""), format_prompt(tokenizer, "What is 5?", "Be brief.")]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (inputs["attention_mask"][:, -1] == 1).all()                  # left-padded: prompts end together
    out = model.generate(**inputs, do_sample=False, max_new_tokens=4)
    assert out.shape[0] == 2 and inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 4


def test_second_call_returns_the_cached_folder_without_building(built):
    path, cache, _ = built
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    logs = []
    assert ensure_tiny_model(cache_dir=cache, warmup_steps=2, log=logs.append) == path
    assert logs == [] and os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp


@pytest.mark.slow
def test_build_is_deterministic_and_a_lost_race_uses_the_winner(built, tmp_path, monkeypatch):
    path, _, _ = built
    winner = tiny_model_path(str(tmp_path), warmup_steps=2)
    real_rename, ours = os.rename, {}

    def rename_after_another_process(src, dst):
        if dst == winner:    # another process renames its complete folder into place first
            ours.update(load_file(os.path.join(src, "model.safetensors")))
            shutil.copytree(path, dst)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_after_another_process)
    logs = []
    assert ensure_tiny_model(cache_dir=str(tmp_path), warmup_steps=2, log=logs.append) == winner
    assert os.listdir(tmp_path) == [os.path.basename(winner)]             # our temporary folder is gone
    assert any("another process" in line for line in logs)
    # same seed and steps -> bit-identical weights in the two builds
    first = load_file(os.path.join(path, "model.safetensors"))
    assert ours.keys() == first.keys() and all(torch.equal(first[k], v) for k, v in ours.items())


def test_cache_location_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("PSPO_CACHE", str(tmp_path))
    default = tiny_model_path()
    assert os.path.dirname(default) == str(tmp_path)
    assert default == tiny_model_path(str(tmp_path), tie_word_embeddings=False, warmup_steps=tiny.WARMUP_STEPS, seed=0)
    others = {tiny_model_path(tie_word_embeddings=True), tiny_model_path(warmup_steps=1), tiny_model_path(seed=1)}
    assert len(others) == 3 and default not in others                   # changing a parameter rebuilds
