"""The overlap of rollout.mode=async on a 2-core CPU: synchronous and one-step-off step times side by side.

    python bench/async_overlap.py [--steps 8] [--prompts 16] [--generations 8] [--max_new_tokens 32] [--gen_batch 8]

The tiny model (pspo/offline/tiny.py) trains GRPO with the IS correction (rollout.is_correction=token, in
every run, so that the trainer's work is the same) in three runs of train.py, one thread per process:
1. sync on core 0 (`taskset -c 0`): generate, then update, on one core;
2. async at lag 1 with the engine on core 1 (`--rollout.engine_cores=1`) and the trainer on core 0: the
   engine generates step s+1 while the trainer updates on step s;
3. sync on both cores with two threads, for honesty: what the second core buys without the overlap.
It shows the overlap, not GPU speed. Sync ≈ gen + update; async ≈ max(gen, update) + the transfer, so the
gain is largest where generation and update take similar times. On the tiny model generation is cheap next
to the update (ratio ~0.3 with one generate call per step); generating in calls of --gen_batch = 8
sequences (rollout.batch_size) balances them (ratio ~1.0 here). The first run's ratio gen_s / (the rest of
its step) is printed, and a ratio outside [0.7, 1.4] is refused (exit 2) unless --any_ratio, with a line
that says which way to move --max_new_tokens. The step time is the median over the steps after the
first two (start-up, the first load). The table is printed; nothing is written to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WARMUP = 2               # steps left out of the median: the engine's first load, the first compile-free passes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--prompts", type=int, default=16, help="train.prompts_per_step")
    p.add_argument("--generations", type=int, default=8, help="rollout.num_generations")
    p.add_argument("--max_new_tokens", type=int, default=32, help="rollout.max_new_tokens")
    p.add_argument("--micro_batch_size", type=int, default=32, help="train.micro_batch_size")
    p.add_argument("--gen_batch", type=int, default=8,
                   help="rollout.batch_size: sequences per generate call; small, the decoding batches less")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="rollout.temperature: above 1 the tiny model's completions run longer, to max_new_tokens")
    p.add_argument("--any_ratio", action="store_true", help="run whatever the sync run's gen/update ratio")
    args = p.parse_args(argv)
    if args.steps <= WARMUP:
        p.error(f"--steps must exceed the {WARMUP} warm-up steps")
    return args


def train(out: str, args: argparse.Namespace, *, cores: str, threads: int, extra: list[str]) -> list[dict]:
    """One run of train.py pinned to `cores` with `threads` torch threads; its per-step metrics."""
    from pspo.offline.tiny import ensure_tiny_model
    cmd = ["taskset", "-c", cores, sys.executable, "train.py", "--config", "configs/grpo.yaml",
           f"--model.name_or_path={ensure_tiny_model()}", f"--train.output_dir={out}",
           f"--train.max_steps={args.steps}", f"--train.prompts_per_step={args.prompts}",
           f"--rollout.num_generations={args.generations}", f"--rollout.max_new_tokens={args.max_new_tokens}",
           f"--train.micro_batch_size={args.micro_batch_size}", f"--rollout.temperature={args.temperature}",
           f"--rollout.batch_size={args.gen_batch}",
           "--rollout.is_correction=token",
           "--reward.workers=0", "--data.max_eval_examples=1", "--train.eval_steps=0", "--train.save_steps=0",
           "--train.progress=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["step"] > 0]


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows[WARMUP:])


def trainer_work(rows: list[dict]) -> float:
    """The median seconds of a step outside generation: rewards, π_old, advantages, update, bookkeeping."""
    return median(rows, "step_time_s") - median(rows, "gen_s")


def table(runs: list[tuple[str, str, list[dict]]]) -> list[str]:
    """Markdown rows: mode | cores | step_s | gen_s | trainer_s | engine_gen_s | engine_idle_s | weight_sync_s |
    step / sync on core 0."""
    base = median(runs[0][2], "step_time_s")
    lines = ["| mode | cores | step_s | gen_s (wait) | trainer_s | engine_gen_s | engine_idle_s | weight_sync_s "
             "| step / sync 1 core |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, cores, rows in runs:
        step = median(rows, "step_time_s")
        lines.append(f"| {mode} | {cores} | {step:.3f} | {median(rows, 'gen_s'):.3f} | {trainer_work(rows):.3f} | "
                     f"{median(rows, 'engine_gen_s'):.3f} | {median(rows, 'engine_idle_s'):.3f} | "
                     f"{median(rows, 'weight_sync_s'):.4f} | {step / base:.2f}x |")
    return lines


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        print("bench/async_overlap.py: needs cores 0 and 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        sync = train(os.path.join(tmp, "sync"), args, cores="0", threads=1, extra=[])
        ratio = median(sync, "gen_s") / max(trainer_work(sync), 1e-9)
        print(f"sync on core 0: gen_s {median(sync, 'gen_s'):.3f}, the rest of the step {trainer_work(sync):.3f} "
              f"(ratio {ratio:.2f})")
        if not 0.7 <= ratio <= 1.4 and not args.any_ratio:
            way = "lower" if ratio > 1.4 else "raise"
            print(f"bench/async_overlap.py: generation / the rest of the step = {ratio:.2f}, outside [0.7, 1.4]: "
                  f"{way} --max_new_tokens (or pass --any_ratio)", file=sys.stderr)
            return 2
        lag1 = train(os.path.join(tmp, "async"), args, cores="0,1", threads=1,
                     extra=["--rollout.mode=async", "--rollout.engine_cores=1"])
        both = train(os.path.join(tmp, "sync2"), args, cores="0,1", threads=2, extra=[])
    print("\n".join(table([("sync", "0", sync), ("async, lag 1", "trainer 0, engine 1", lag1),
                           ("sync, 2 threads", "0,1", both)])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
