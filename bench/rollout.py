"""Generation throughput of the two rollout engines on the same prompts and lengths.

    python bench/rollout.py [--model PATH] [--prompts 64] [--n 8] [--max-new-tokens 12 64]
    python bench/rollout.py --random 8,512 --max-new-tokens 64     # a bigger random-weight Qwen2

For each setting both engines generate n completions for each of the same prompts (built-in
task, chat template), and the table gives completion tokens per second (tokens up to and
including the stop token), the median of --repeats calls after one warm-up call. The vLLM
engine is the colocated in-process one train.py uses; the transformers engine is `HFEngine` on
the same weights. Run it on an otherwise idle machine (CPU timings suffer from contention).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.data import builtin_arithmetic, format_prompt  # noqa: E402
from pspo.model import build_policy, load_tokenizer  # noqa: E402
from pspo.rollout import HFEngine  # noqa: E402
from pspo.sequences import sequence_seeds  # noqa: E402
from pspo.tiny import ensure_tiny_model  # noqa: E402
from pspo.vllm_engine import VLLMEngine  # noqa: E402


def tokens_per_s(engine, prompts, n: int, max_new_tokens: int, repeats: int) -> tuple[float, float]:
    """(median completion tokens/s, mean completion length) over `repeats` calls after a warm-up."""
    seeds = sequence_seeds(0, 0, torch.arange(len(prompts)), n)
    engine.generate(prompts, n, 1.0, 1.0, max_new_tokens, seeds)                  # warm-up
    rates, lengths = [], []
    for step in range(repeats):
        seeds = sequence_seeds(0, step + 1, torch.arange(len(prompts)), n)
        start = time.perf_counter()
        r = engine.generate(prompts, n, 1.0, 1.0, max_new_tokens, seeds)
        rates.append(r.mask.sum().item() / (time.perf_counter() - start))
        lengths.append(r.mask.sum(1).mean().item())
    return statistics.median(rates), statistics.mean(lengths)


def random_model(size: str) -> str:
    """Save a random Qwen2 (LAYERS,HIDDEN) with the tiny model's tokenizer to a temporary folder."""
    layers, hidden = (int(x) for x in size.split(","))
    tokenizer = load_tokenizer(ensure_tiny_model(), False)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="pspo-bench-model-")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a from_pretrained folder (default: the tiny demo model)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[12, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random", default="", metavar="LAYERS,HIDDEN",
                    help="a random-weight Qwen2 of this size with the tiny tokenizer (completions run long)")
    args = ap.parse_args(argv)
    path = random_model(args.random) if args.random else (args.model or ensure_tiny_model())
    tokenizer = load_tokenizer(path, False)
    prompts = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
               for ex in builtin_arithmetic("train")[:args.prompts]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = HFEngine(build_policy(path, False, 2048, False, False, trainable=False).to(device), tokenizer,
                  batch_size=args.prompts * args.n)
    vllm = VLLMEngine(path, tokenizer, max(map(len, prompts)) + max(args.max_new_tokens), seed=0)
    print(f"{args.prompts} prompts x {args.n} completions, {device}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} calls")
    print("| max new tokens | mean length | transformers tok/s | vLLM tok/s | vLLM / transformers |")
    print("|---:|---:|---:|---:|---:|")
    for max_new in args.max_new_tokens:
        hf_rate, hf_len = tokens_per_s(hf, prompts, args.n, max_new, args.repeats)
        vllm_rate, vllm_len = tokens_per_s(vllm, prompts, args.n, max_new, args.repeats)
        print(f"| {max_new} | {hf_len:.1f} / {vllm_len:.1f} | {hf_rate:,.0f} | {vllm_rate:,.0f} | "
              f"{vllm_rate / hf_rate:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
