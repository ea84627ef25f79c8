"""Time to score a rollout batch with math-verify in the trainer vs a pool of workers (reward.workers).

    python bench/reward_pool.py                      # 2-core CPU: ~1 min; prints one table
    python bench/reward_pool.py --workers 0,1,2,4 --reps 5

One batch is 64 prompts x 8 completions (512), scored with accuracy (math-verify) and format as
train.py does. Each prompt's gold is an integer or a fraction; its 8 completions draw their boxed
answer from 4 candidates (the gold, another form of it, two wrong ones), so a group repeats
answers as a real one does and the memo of pspo/rewards.py helps within a group. Every
measurement scores a batch of new numbers (nothing memoized from an earlier one), after the
pool has started and loaded the functions (start-up is timed apart). The modes alternate, `--reps`
times each; the table has the median seconds, the spread, and the speed-up over workers=0.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.tasks.reward_pool import RewardPool  # noqa: E402
from pspo.rewards import score_completions  # noqa: E402

WEIGHTS = {"accuracy": 1.0, "format": 0.0}


def batch(prompts: int, group: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """(prompts, completions, golds), prompt-major, group completions per prompt."""
    rng = random.Random(seed)
    texts, completions, golds = [], [], []
    for q in range(prompts):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        if q % 2:                                                    # a fraction gold, 3 forms
            gold, forms = f"\\frac{{{a}}}{{{b}}}", [f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"\\frac{{{a + 1}}}{{{b}}}"]
        else:                                                        # an integer gold
            gold, forms = str(a * b), [str(a * b), f"{a} \\times {b}", str(a * b + rng.randint(1, 9))]
        candidates = forms + [f"{rng.randint(2, 99)}\\sqrt{{{rng.randint(2, 99)}}}"]
        prompt = f"<|im_start|>user\nWhat is {a} times {b}? Put the answer in \\boxed{{}}.<|im_end|>"
        for _ in range(group):
            think = " ".join(str(rng.randint(0, 10**6)) for _ in range(rng.randint(5, 80)))
            texts.append(prompt)
            completions.append(f"<think>{think}</think> The answer is \\boxed{{{rng.choice(candidates)}}}.")
            golds.append(gold)
    return texts, completions, golds


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="0,1,2", help="comma-separated pool sizes (0 = in the trainer)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(w) for w in args.workers.split(",")]
    pools, startup = {}, {}
    for w in sizes:                                      # start, then warm up on a throw-away batch
        t0 = time.perf_counter()
        pools[w] = RewardPool(w)
        score_completions(*batch(2 * max(w, 1), 4, seed=-1 - w), weights=WEIGHTS, pool=pools[w])
        startup[w] = time.perf_counter() - t0
    times: dict[int, list[float]] = {w: [] for w in sizes}
    seed = 0
    for _ in range(args.reps):
        for w in sizes:                                  # alternate the modes
            seed += 1
            prompts, completions, golds = batch(args.prompts, args.group, seed)
            t0 = time.perf_counter()
            scored = score_completions(prompts, completions, golds, weights=WEIGHTS, pool=pools[w])
            times[w].append(time.perf_counter() - t0)
            assert sum(scored.failures.values()) == 0, scored.failures
    for pool in pools.values():
        pool.close()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = args.prompts * args.group
    print(f"\n{n} completions ({args.prompts} prompts x {args.group}), accuracy + format, {cores} cores, "
          f"median of {args.reps}")
    print(f"{'workers':>8} {'start-up s':>11} {'score s':>9} {'min-max s':>13} {'completions/s':>14} {'speed-up':>9}")
    base = statistics.median(times[sizes[0]])
    for w in sizes:
        med = statistics.median(times[w])
        print(f"{w:>8} {startup[w]:>11.2f} {med:>9.2f} {min(times[w]):>6.2f}-{max(times[w]):<6.2f} "
              f"{n / med:>14.0f} {base / med:>8.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
