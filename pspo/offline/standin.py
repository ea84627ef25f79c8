"""A CPU stand-in for a real checkpoint: its config.json with the widths shrunk and the limits kept.

The GPU recipes (configs/qwen2.5-math-1.5b/) name a 1.5B model that cannot be downloaded here and
would not train on two CPU cores anyway. To rehearse them (tests/e2e/test_presets.py), the real
model's config.json (shipped beside the recipe as model_config.json) is copied with what makes it
slow shrunk (hidden size, MLP width, layers, heads) and what a recipe can trip over kept:

    kept    : model class and type, vocab_size (151936), max_position_embeddings (4096),
              tie_word_embeddings, rope_theta, rms_norm_eps, the GQA ratio (query heads per KV head)
    shrunk  : hidden_size 192, intermediate_size 384, 2 layers, head_dim 32 (6 query heads and
              1 KV head for Qwen2.5-Math-1.5B's ratio 12 / 2); 32 is the smallest head size vLLM's
              CPU attention kernels take, and vLLM derives head_dim as hidden_size / heads
    replaced: the tokenizer (pspo.offline.tiny's byte-level BPE, 405 ids, all < vocab_size, with Qwen's
              ChatML template; eos <|im_end|>, pad <|endoftext|>), so the special-token ids in
              config.json are set to the stand-in tokenizer's

The weights are random (seeded) and stored in bf16, as the real checkpoint is. A random model
samples mostly ids the small tokenizer does not have; they decode to "" and the rewards are ~0,
which is all a rehearsal of the plumbing needs. Built once under $PSPO_CACHE (default
~/.cache/pspo) in a folder named by a hash of the real config and the build parameters, written
under a temporary name and renamed into place (as pspo/offline/tiny.py does), then loaded through
`from_pretrained` like any checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from pspo.offline.tiny import CHAT_TEMPLATE, build_tiny_tokenizer, cache_folder, save_model_folder

VERSION = 1                   # part of the cache key: bump it whenever the build below changes
HIDDEN_SIZE = 192
INTERMEDIATE_SIZE = 384
NUM_LAYERS = 2
HEAD_DIM = 32


class StandinError(ValueError):
    """The real config cannot be shrunk into a stand-in; the message is one line naming the file."""


def standin_config(real: dict, hidden_size: int = HIDDEN_SIZE, intermediate_size: int = INTERMEDIATE_SIZE,
                   num_layers: int = NUM_LAYERS, head_dim: int = HEAD_DIM) -> dict:
    """The real config.json (as a dict) with its widths shrunk; every other key is kept as is."""
    for key in ("model_type", "vocab_size", "max_position_embeddings", "num_attention_heads"):
        if key not in real:
            raise StandinError(f"the real model config has no {key!r}")
    kv_heads = real.get("num_key_value_heads", real["num_attention_heads"])
    ratio = real["num_attention_heads"] // kv_heads                  # query heads per KV head (GQA)
    if hidden_size % head_dim or real["num_attention_heads"] % kv_heads:
        raise StandinError(f"hidden_size {hidden_size} is not a multiple of head_dim {head_dim}, or "
                           f"{real['num_attention_heads']} heads are not a multiple of {kv_heads} KV heads")
    # keep the GQA ratio: round the head count up to a multiple of it (1.5B: 12/2 -> 6 heads, hidden
    # 192 as asked; 7B: 28/4 -> 7 heads, hidden 224)
    heads = ratio * -(-(hidden_size // head_dim) // ratio)
    hidden_size = heads * head_dim
    config = dict(real)
    config.update(hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_attention_heads=heads, num_key_value_heads=heads // ratio)
    if "head_dim" in config:
        config["head_dim"] = head_dim
    return _truncate(config, num_layers)            # Qwen2's max_window_layers, layer_types: per layer


def build_standin_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """pspo.offline.tiny's byte-level BPE (Qwen2's pipeline) with Qwen's ChatML template."""
    bpe = build_tiny_tokenizer().backend_tokenizer
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length, padding_side="left")   # constructor arguments survive a reload


def standin_path(real_config_path: str, cache_dir: str | None = None, seed: int = 0) -> str:
    """Where the stand-in for this config.json lives (built or not), named by a hash of its inputs."""
    with open(real_config_path, "rb") as f:
        real_digest = hashlib.sha256(f.read()).hexdigest()
    params = {"version": VERSION, "real": real_digest, "seed": seed, "hidden": HIDDEN_SIZE,
              "intermediate": INTERMEDIATE_SIZE, "layers": NUM_LAYERS, "head_dim": HEAD_DIM}
    return cache_folder("standin", params, cache_dir)


def ensure_standin_model(real_config_path: str, cache_dir: str | None = None, seed: int = 0,
                         log=print) -> str:
    """Build the stand-in for `real_config_path` (a config.json) once and return its folder."""
    path = standin_path(real_config_path, cache_dir, seed)
    if os.path.isdir(path):
        return path
    return build_random_model(real_config_path, path, seed=seed, shrink=True, log=log)


def build_random_model(real_config_path: str, path: str, *, seed: int = 0, shrink: bool = True,
                       num_layers: int | None = None, log=print) -> str:
    """A seeded random-weight model with the stand-in tokenizer, saved to `path`.

    shrink=True: the CPU stand-in above. shrink=False: the real widths (a GPU check of the real
    architecture without a download), `num_layers` of them if given (a depth that fits one GPU).
    """
    try:
        with open(real_config_path) as f:
            real = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise StandinError(f"{real_config_path}: cannot read it as a config.json ({e})") from None
    if not isinstance(real, dict):
        raise StandinError(f"{real_config_path}: expected a JSON object")
    try:
        missing = [k for k in ("model_type", "max_position_embeddings") if k not in real]
        if missing:
            raise StandinError(f"the real model config has no {missing[0]!r}")
        config = standin_config(real) if shrink else dict(real)
    except StandinError as e:
        raise StandinError(f"{real_config_path}: {e}") from None
    if num_layers is not None:
        if not 1 <= num_layers <= real.get("num_hidden_layers", 0):             # of the real model's layers
            raise StandinError(f"{real_config_path}: --layers {num_layers}: expected 1 to the model's "
                               f"num_hidden_layers ({real.get('num_hidden_layers')})")
        config = _truncate(config, num_layers)
    tokenizer = build_standin_tokenizer(config["max_position_embeddings"])
    special = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    # ids of the stand-in tokenizer, not Qwen's
    config.update(special)
    model_type = config.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = config.get("architectures")
    dtype = getattr(torch, str(real.get("torch_dtype") or real.get("dtype") or "float32"))
    with torch.random.fork_rng(devices=[]):                          # seeded init, caller's RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32 if shrink else dtype)
    model.generation_config = GenerationConfig(**special)
    model.to(dtype)                                                  # stored like the real checkpoint (bf16)
    info = {"version": VERSION, "real_config": os.path.abspath(real_config_path), "seed": seed,
            "shrunk": shrink, "parameters": sum(p.numel() for p in model.parameters())}
    return save_model_folder(path, model, tokenizer, info_name="pspo_standin.json", info=info, log=log)


def _truncate(config: dict, num_layers: int) -> dict:
    """The config with its first `num_layers` decoder layers only."""
    config = dict(config, num_hidden_layers=num_layers)
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    return config


def main(argv: list[str]) -> None:
    """python -m pspo.offline.standin CONFIG.json OUT_DIR [--full] [--layers N]: build a random-weight
    model."""
    import argparse
    ap = argparse.ArgumentParser(description="a random-weight model from a config.json, "
                                             "with the stand-in tokenizer")
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--full", action="store_true", help="keep the real widths (default: the CPU stand-in's)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if os.path.exists(args.out):
        print(f"pspo.offline.standin: {args.out} exists; remove it or name another folder", file=sys.stderr)
        raise SystemExit(2)
    try:
        build_random_model(args.config, os.path.abspath(args.out), seed=args.seed, shrink=not args.full,
                           num_layers=args.layers)
    except StandinError as e:
        print(f"pspo.offline.standin: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
