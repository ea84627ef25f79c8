"""PSPO*'s PRM scoring: every step of a training step's completions in batched, length-sorted
forwards (pspo/related/prm.py) against one step at a time (as the released code scores them).

    python bench/prm_scoring.py                        # a GPU: a BERT-base-sized PRM, 48 completions x 20 steps
    python bench/prm_scoring.py --small --completions 8 --steps 5      # CPU: a 2-layer stand-in, seconds

The PRM is a randomly initialised BertForSequenceClassification with 3 labels (the PSPO* authors'
PRM is a BERT step classifier; --small keeps 2 layers of width 64) over the tiny PRM's word
vocabulary (pspo/offline/tiny_prm.py), bf16 on a GPU, float32 on CPU. Each completion has --steps lines of
1 to 9 repeated K&K clauses, split per line (prm.split: lines) and paired with the step before. The
table gives the steps scored, seconds batched and one at a time, the ratio, steps per second, the
largest |batched - one at a time| score and, on a GPU, the peak memory. The PRM's share of a
training step is logged by train.py as prm_share.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

from pspo.training.config import load_config  # noqa: E402
from pspo.related.prm import PRM  # noqa: E402
from pspo.related.process_reward import split_lines, step_pairs  # noqa: E402
from pspo.offline.tiny_prm import build_prm_tokenizer  # noqa: E402

CLAUSE = "Zoey is a knight and Mia says that Leo is a knave"


def completions(n: int, steps: int) -> list[str]:
    """n completions of `steps` lines each; line k of completion c repeats CLAUSE 1 + (k + c) % 9 times."""
    return ["\n".join(f"({k}) " + " ".join([CLAUSE] * (1 + (k + c) % 9)) for k in range(1, steps + 1))
            for c in range(n)]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--completions", type=int, default=48)
    ap.add_argument("--steps", type=int, default=20, help="steps (lines) per completion")
    ap.add_argument("--small", action="store_true", help="a 2-layer, width-64 stand-in (CPU)")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokenizer = build_prm_tokenizer()
    torch.manual_seed(0)
    widths = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) \
        if args.small else {}
    model = BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), num_labels=3, **widths))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(device, dtype).eval().requires_grad_(False)
    prm = PRM(model, tokenizer, load_config(None, ["--reward.prm=1", "--prm.model=x", "--prm.split=lines"]).prm)
    texts = completions(args.completions, args.steps)
    pairs = [p for text in texts for p in step_pairs(split_lines(text))]
    prm(texts[:2])                                                       # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    prm(texts)
    sync()
    batched = time.perf_counter() - start
    start = time.perf_counter()
    one = [prm.step_scores([pair])[0] for pair in pairs]
    sync()
    single = time.perf_counter() - start
    gap = max(abs(a - b) for a, b in zip(prm.step_scores(pairs), one))
    params = sum(p.numel() for p in model.parameters())
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.completions} completions x {args.steps} steps; PRM: BERT, {params / 1e6:.1f}M parameters, "
          f"{str(dtype).removeprefix('torch.')}; {where}\n")
    print("| steps | batched s | one at a time s | ratio | steps/s batched | max abs diff |"
          + (" peak GiB |" if device.type == "cuda" else ""))
    print("|---:|---:|---:|---:|---:|---:|" + ("---:|" if device.type == "cuda" else ""))
    row = (f"| {len(pairs)} | {batched:.3f} | {single:.3f} | {single / batched:.1f} | {len(pairs) / batched:,.0f} | "
           f"{gap:.1e} |")
    if device.type == "cuda":
        row += f" {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} |"
    print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "parameters": params, "steps": len(pairs), "batched_s": batched,
                       "one_at_a_time_s": single, "steps_per_s": len(pairs) / batched, "max_abs_diff": gap,
                       "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None},
                      f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
