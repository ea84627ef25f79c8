"""Step time of train.py against TRL's GRPOTrainer on the same tiny workload.

    pip install -r bench/requirements.txt         # TRL and accelerate: bench-only, not project dependencies
    python bench/step_time.py [--reps 3] [--steps 15] [--warmup 3] [--threads 2]

or, leaving the project's environment untouched:

    pip install --target DIR --no-deps trl==1.16.0 accelerate==1.15.0
    PYTHONPATH=DIR python bench/step_time.py

The same on both sides: the offline tiny model (pspo/offline/tiny.py), the builtin:arithmetic train split,
B = 16 prompts x G = 8 completions per step, at most 12 new tokens, T = 1, full-vocabulary sampling,
one AdamW step per rollout batch (num_iterations 1, all 128 completions in one micro-batch),
β = 0 (no reference model), lr 1e-4 with 5 warm-up steps then cosine, AdamW β2 0.99, clip ε
0.2 / 0.28, grpo aggregation (TRL loss_type "grpo"), std-scaled group advantages, the math-verify
accuracy reward of pspo/rewards.py, fp32 on CPU, transformers `generate`, one process each with
the same torch threads, no evaluation, no saving. Both tokenize the same chat-formatted prompt
text (no system prompt); the TRL worker checks that its prompt ids are ours.

A step's time is, for train.py, `step_time_s` of metrics.jsonl (from sampling the prompts to the
step's metrics; writing them to JSON and TensorBoard is outside it); for TRL, on_step_begin to
on_step_end of a TrainerCallback (generation, reward, loss, backward, clip, AdamW and scheduler
step; its logging is off). What differs: train.py also scores the format reward (it logs it at
weight 0), TRL fetches the step's prompts from its dataloader before on_step_begin, and each
side samples with its own RNG, so completions (and their lengths: shown) differ.

The runs alternate, train.py then TRL, --reps times, each a fresh process; the first --warmup
steps of every run are left out. The table gives each side's median step time per rep, the
median over all kept steps with the min-max of the per-rep medians, and ours / TRL per rep and
overall. Without TRL it prints one line naming the missing package and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TRL_PINS = "trl==1.16.0 accelerate==1.15.0"     # as in bench/requirements.txt


@dataclass
class Workload:
    """What both sides run; every field is passed to train.py and to the TRL worker alike."""
    steps: int = 15               # optimizer steps per run (= rollout batches)
    prompts: int = 16             # B, prompts per step
    G: int = 8                    # completions per prompt
    max_new_tokens: int = 12      # L_max
    lr: float = 1e-4              # peak AdamW lr (configs/grpo.yaml)
    lr_warmup: int = 5            # linear lr warm-up steps, then cosine to 0 (configs/grpo.yaml)
    seed: int = 0


@dataclass
class Run:
    """One run's per-step times (seconds) and mean completion length (tokens, stop token included)."""
    times: list[float]
    length: float


def subprocess_env(threads: int) -> dict[str, str]:
    """The caller's environment (PYTHONPATH included) with the torch thread count pinned."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}


def run_ours(w: Workload, threads: int) -> Run:
    """train.py on configs/grpo.yaml with the workload's overrides; step_time_s from metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="pspo-step-time-") as out:
        overrides = [f"--train.output_dir={out}", f"--train.max_steps={w.steps}", f"--train.seed={w.seed}",
                     f"--train.prompts_per_step={w.prompts}", "--train.micro_batch_size=256",
                     "--train.eval_steps=0", "--train.save_steps=0", "--train.progress=false", "--data.eval=",
                     f"--rollout.num_generations={w.G}", f"--rollout.max_new_tokens={w.max_new_tokens}",
                     "--rollout.engine=hf", "--rollout.temperature=1.0", "--algo.beta=0", "--algo.num_iterations=1",
                     f"--optim.lr={w.lr}", f"--optim.warmup_steps={w.lr_warmup}", "--reward.workers=0"]
        proc = subprocess.run([sys.executable, "train.py", "--config", "configs/grpo.yaml", *overrides], cwd=ROOT,
                              env=subprocess_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"train.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "step_time_s" in r]
    return Run([r["step_time_s"] for r in rows], statistics.mean(r["response_length"] for r in rows))


def run_trl(w: Workload, threads: int) -> Run:
    """This file as a TRL worker process (`--trl-worker`), which writes its Run as JSON."""
    with tempfile.TemporaryDirectory(prefix="pspo-step-time-trl-") as out:
        result = os.path.join(out, "run.json")
        args = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(w).items()]
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker", result, *args], cwd=ROOT,
                              env=subprocess_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"TRL worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(result) as f:
            return Run(**json.load(f))


def trl_worker(w: Workload, result_path: str) -> None:
    """GRPOTrainer on the workload; writes {"times": [...], "length": ...} to result_path."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pspo.tasks.data import builtin_arithmetic, prompt_set
    from pspo.training.model import load_tokenizer
    from pspo.rewards import accuracy_reward
    from pspo.offline.tiny import ensure_tiny_model

    path = ensure_tiny_model()
    tokenizer = load_tokenizer(path)
    prompts = prompt_set("data.train builtin:arithmetic", builtin_arithmetic("train"), tokenizer, system_prompt="",
                         max_prompt_tokens=512)
    # TRL tokenizes a plain-text prompt with processing_class(text=...): it must give train.py's ids
    assert tokenizer(text=prompts.texts)["input_ids"] == prompts.ids, "TRL would see other prompt token ids"
    dataset = Dataset.from_dict({"prompt": prompts.texts, "answer": [ex.answer for ex in prompts.examples]})
    lengths: list[float] = []                     # mean completion length of each reward call (= each step)

    def accuracy(prompts: list[str], completions: list[str], answer: list[str], completion_ids, **_) -> list[float]:
        assert len(completions) == w.prompts * w.G, "TRL would not score one step's B x G completions per call"
        lengths.append(sum(map(len, completion_ids)) / len(completion_ids))
        return [accuracy_reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="pspo-trl-out-") as out:
        config = GRPOConfig(
            output_dir=out, max_steps=w.steps, seed=w.seed, use_cpu=True, bf16=False, gradient_checkpointing=False,
            per_device_train_batch_size=w.prompts * w.G, gradient_accumulation_steps=1,   # one step, one micro-batch
            num_generations=w.G, max_completion_length=w.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, loss_type="grpo", scale_rewards="group",
            learning_rate=w.lr, lr_scheduler_type="cosine", warmup_steps=w.lr_warmup, adam_beta2=0.99,
            weight_decay=0.0, max_grad_norm=1.0, report_to="none", logging_strategy="no", save_strategy="no",
            eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=accuracy, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    with open(result_path, "w") as f:
        json.dump({"times": timer.times, "length": statistics.mean(lengths)}, f)


def missing_trl() -> str | None:
    """The module that stops `from trl import GRPOTrainer` here (e.g. "trl", "accelerate"), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # TRL warns about the vLLM version it finds
            from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except ModuleNotFoundError as e:
        return e.name or str(e)
    return None


def summary(ours: list[Run], trl: list[Run], warmup: int) -> list[str]:
    """Markdown table: per rep, each side's median step time (steps after `warmup`) and ours / TRL;
    then the median over every kept step with [min-max of the per-rep values]."""
    kept_ours, kept_trl = [r.times[warmup:] for r in ours], [r.times[warmup:] for r in trl]
    med_ours, med_trl = [statistics.median(t) for t in kept_ours], [statistics.median(t) for t in kept_trl]
    ratios = [o / t for o, t in zip(med_ours, med_trl)]
    lines = ["| rep | train.py s/step | TRL s/step | ours / TRL | completion tokens (ours / TRL) |",
             "|---|---:|---:|---:|---:|"]
    for i, (o, t, q) in enumerate(zip(med_ours, med_trl, ratios)):
        lines.append(f"| {i + 1} | {o:.3f} | {t:.3f} | {q:.2f}x | {ours[i].length:.1f} / {trl[i].length:.1f} |")
    all_ours, all_trl = [x for t in kept_ours for x in t], [x for t in kept_trl for x in t]
    lines.append(f"| all | {statistics.median(all_ours):.3f} [{min(med_ours):.3f}-{max(med_ours):.3f}] | "
                 f"{statistics.median(all_trl):.3f} [{min(med_trl):.3f}-{max(med_trl):.3f}] | "
                 f"{statistics.median(all_ours) / statistics.median(all_trl):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
                 f"{statistics.mean(r.length for r in ours):.1f} / {statistics.mean(r.length for r in trl):.1f} |")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="alternating pairs of runs (train.py, then TRL)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each side (OMP_NUM_THREADS)")
    ap.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)     # internal: run the TRL side, write here
    for name, default in asdict(Workload()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    w = Workload(**{k: getattr(args, k) for k in asdict(Workload())})
    if args.trl_worker:
        trl_worker(w, args.trl_worker)
        return 0
    missing = missing_trl()
    if missing is not None:
        print(f"bench/step_time.py: TRL's GRPOTrainer is not importable (no module {missing!r}); install "
              f"it with `pip install -r bench/requirements.txt`, or `pip install --target DIR --no-deps "
              f"{TRL_PINS}` and PYTHONPATH=DIR", file=sys.stderr)
        return 2
    import accelerate
    import torch
    import transformers
    import trl

    from pspo.offline.tiny import ensure_tiny_model
    ensure_tiny_model()                           # built once, before any timed run
    print(f"{os.cpu_count()} CPUs, {args.threads} torch threads per side, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, trl {trl.__version__}, accelerate {accelerate.__version__}; "
          f"{w.prompts} prompts x {w.G} completions, <= {w.max_new_tokens} new tokens, {w.steps} steps per run, "
          f"first {args.warmup} left out; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    ours, trl_runs = [], []
    for rep in range(args.reps):
        for side, runner, runs in (("train.py", run_ours, ours), ("TRL", run_trl, trl_runs)):
            start = time.perf_counter()
            runs.append(runner(w, args.threads))
            print(f"rep {rep + 1}: {side} median {statistics.median(runs[-1].times[args.warmup:]):.3f} s/step "
                  f"({time.perf_counter() - start:.0f} s with start-up)", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end\n")
    print("\n".join(summary(ours, trl_runs, args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
