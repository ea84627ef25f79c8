"""Fixed vs token-budget micro-batches on a length-skewed update (train.micro_batch_tokens).

    python bench/micro_batches.py                 # 2-core CPU: ~3 min; prints one table
    python bench/micro_batches.py --reps 5 --sequences 64     # longer, steadier

A random-weight Qwen2 of 8 layers x 512 (built from a config, nothing downloaded) runs
`policy_update` on one rollout batch whose completions spread from 10 to 512 tokens
(log-uniform; prompts 20-120 tokens), as a reasoning model's do. Fixed micro-batches of
`--micro` rows are padded to the step's longest prompt + completion; the token budget is set to
the same padded size (micro x the longest sequence), so the peak memory of a micro-batch is the
same and only the padding differs. The two modes alternate, `--reps` times each; the table has
the median update time, real tokens per second and the padded share of positions, then the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from pspo.config import load_config  # noqa: E402
from pspo.distributed import Dist  # noqa: E402
from pspo.model import build_policy  # noqa: E402
from pspo.update import plan_micro_batches, policy_update  # noqa: E402


def skewed_batch(n: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """input_ids, attention (n, P+T) left-padded prompts then completions; mask (n, T); advantages (n,)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(20, 121, (n,), generator=g)
    completions = torch.exp(torch.empty(n).uniform_(torch.log(torch.tensor(10.0)), torch.log(torch.tensor(512.0)),
                                                    generator=g)).round().long()
    P, T = int(prompts.max()), int(completions.max())
    input_ids = torch.randint(0, vocab, (n, P + T), generator=g)
    attention = torch.zeros(n, P + T, dtype=torch.long)
    mask = torch.zeros(n, T)
    for i, (p, c) in enumerate(zip(prompts.tolist(), completions.tolist())):
        attention[i, P - p:P + c] = 1
        mask[i, :c] = 1
    return input_ids, attention, mask, torch.randn(n, generator=g), completions


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4, help="rows per fixed micro-batch")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    folder = tempfile.mkdtemp(prefix="pspo-bench-")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    input_ids, attention, mask, advantages, lengths = skewed_batch(args.sequences, config.vocab_size)
    longest = input_ids.shape[1]
    budget = args.micro * longest
    modes = {"fixed": [f"--train.micro_batch_size={args.micro}"],
             "token budget": [f"--train.micro_batch_tokens={budget}"]}
    times: dict[str, list[float]] = {m: [] for m in modes}
    sums: dict[str, dict] = {}
    policy = build_policy(folder, False, 1024, False, False)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)              # the weights stay as built
    for _ in range(args.reps):
        for mode, overrides in modes.items():
            cfg = load_config("configs/grpo.yaml", ["--rollout.num_generations=2", *overrides])
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            start = time.perf_counter()
            sums[mode] = policy_update(policy, None, optimizer, scheduler, input_ids, attention, mask, advantages,
                                       cfg, Dist(0, 1, torch.device("cpu")))
            times[mode].append(time.perf_counter() - start)
    print(f"{args.sequences} sequences, completions {int(lengths.min())}-{int(lengths.max())} tokens "
          f"(median {int(lengths.median())}), longest sequence {longest}; random Qwen2 8 x 512; "
          f"{torch.get_num_threads()} threads; median of {args.reps}\n")
    print(f"| mode | micro-batches | padded share | update s | real tokens/s |\n|---|---:|---:|---:|---:|")
    for mode in modes:
        s = sums[mode]
        plan = plan_micro_batches(attention, mask, args.micro, budget if mode != "fixed" else 0)
        median = statistics.median(times[mode])
        print(f"| {mode} | {len(plan)} | {1 - s['update_tokens'] / s['update_positions']:.2f} | {median:.2f} | "
              f"{s['update_tokens'] / median:,.0f} |")
    ratio = statistics.median(times["fixed"]) / statistics.median(times["token budget"])
    print(f"\ntoken-budget updates are {ratio:.2f}x faster (fixed / token budget, medians; "
          f"per rep: {', '.join(f'{f / t:.2f}' for f, t in zip(times['fixed'], times['token budget']))})")


if __name__ == "__main__":
    main(sys.argv[1:])
