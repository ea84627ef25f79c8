"""Step time of train.py against TRL's GRPOTrainer on the same workload.

    pip install -r bench/requirements.txt         # TRL and accelerate: bench-only, not project dependencies
    python bench/step_time.py [--reps 3] [--steps 15] [--warmup 3] [--threads 2]      # CPU, the tiny workload

or, leaving the project's environment untouched:

    pip install --target DIR --no-deps trl==1.16.0 accelerate==1.15.0
    PYTHONPATH=DIR python bench/step_time.py

A workload is a train.py config and its overrides: `--config FILE [-- --section.key=value ...]` (the
GPU check's `recipe` and `trl` sections: the 1.5B recipe on a GPU; `--trl-only FILE` runs the TRL
side alone, once, and writes its steps to FILE after every step). train.py runs it as given; the TRL
worker loads the same config (pspo/training/config.py) and sets GRPOConfig from it (trl_args), so
one file says what both sides run: the model, the train prompts (data.*: the same chat-formatted
text, which the worker checks tokenizes to train.py's ids), B = train.prompts_per_step prompts x G =
rollout.num_generations completions per step, rollout.max_new_tokens, temperature and top_p
(full-vocabulary sampling), β (TRL builds its own reference model when β > 0), clip ε_low / ε_high,
num_iterations, std-scaled group advantages (algo.scale_rewards), grpo aggregation (TRL's loss_type
"grpo"), the reward weights of pspo/rewards.py (one TRL reward function returning the weighted sum
that train.py's scorer computes, accuracy and format always scored), AdamW (lr, betas, weight
decay, warm-up then cosine to lr x min_lr_ratio, max_grad_norm), bf16 autocast and gradient
checkpointing (model.*; on a GPU), one optimizer step per rollout batch. Settings TRL cannot run
(another advantage method, aggregation or objective, ERS, PPS, a PRM, LoRA) are refused in one line.
Both sides use transformers for generation (train.py's static-cache loop, rollout.engine=hf; TRL's
`generate`), score rewards in the trainer's process (reward.workers=0), and neither evaluates nor
saves between steps. The default workload, the tiny CPU one (bench/RESULTS.md §19): the offline
tiny model, builtin:arithmetic, B = 16 x G = 8, at most 12 new tokens, T = 1, β = 0, lr 1e-4 with 5
warm-up steps, fp32 on CPU, all 128 completions in one micro-batch on both sides.

A step's time is, for train.py, `step_time_s` of metrics.jsonl (from sampling the prompts to the
step's metrics; writing them is outside it); for TRL, on_step_begin to on_step_end of a
TrainerCallback (generation, reward, loss, backward, clip, AdamW and scheduler step; its logging is
off), with the time inside `generate` beside it. What differs: TRL fetches the step's prompts from
its dataloader before on_step_begin, and each side samples with its own RNG and prompt order, so
completions (and their lengths: shown) differ.

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
CPU_CONFIG = "configs/grpo.yaml"
# What a timed run has on either side: no evaluation, no saving between steps (train.py saves once at
# the end, after its last step's time), no progress bar or TensorBoard, transformers generation, the
# rewards in the trainer's process.
TIMED = ("--train.eval_steps=0", "--train.save_steps=0", "--train.progress=false", "--train.report_to=none",
         "--data.eval=", "--rollout.engine=hf", "--reward.workers=0")


@dataclass(frozen=True)
class Workload:
    """What both sides run: train.py's `config` with `overrides` (--section.key=value), `steps` optimizer
    steps per run; TIMED is added on both sides."""
    config: str = CPU_CONFIG
    overrides: tuple[str, ...] = ()
    steps: int = 15


@dataclass(frozen=True)
class CpuWorkload:
    """The tiny CPU workload's knobs (bench/RESULTS.md §19), as overrides of configs/grpo.yaml."""
    prompts: int = 16             # B, prompts per step
    G: int = 8                    # completions per prompt
    max_new_tokens: int = 12      # L_max
    lr: float = 1e-4              # peak AdamW lr (configs/grpo.yaml)
    lr_warmup: int = 5            # linear lr warm-up steps, then cosine to 0 (configs/grpo.yaml)
    seed: int = 0

    def overrides(self) -> tuple[str, ...]:
        return (f"--train.prompts_per_step={self.prompts}", "--train.micro_batch_size=256",
                f"--rollout.num_generations={self.G}", f"--rollout.max_new_tokens={self.max_new_tokens}",
                "--rollout.temperature=1.0", "--algo.beta=0", "--algo.num_iterations=1", f"--optim.lr={self.lr}",
                f"--optim.warmup_steps={self.lr_warmup}", f"--train.seed={self.seed}")


@dataclass
class Run:
    """One run's per-step times (seconds) and mean completion length (tokens, stop token included)."""
    times: list[float]
    length: float


def subprocess_env(threads: int) -> dict[str, str]:
    """The caller's environment (PYTHONPATH included) with the torch thread count pinned."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}


def train_argv(w: Workload, output_dir: str, python: str = sys.executable) -> list[str]:
    """train.py's command line for the workload, its run in output_dir (run from the project's root)."""
    return [python, "train.py", "--config", w.config, *w.overrides, *TIMED, f"--train.output_dir={output_dir}",
            f"--train.max_steps={w.steps}"]


def run_ours(w: Workload, threads: int) -> Run:
    """train.py on the workload; step_time_s from metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="pspo-step-time-") as out:
        proc = subprocess.run(train_argv(w, out), cwd=ROOT, env=subprocess_env(threads), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"train.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "step_time_s" in r]
    return Run([r["step_time_s"] for r in rows], statistics.mean(r["response_length"] for r in rows))


def worker_argv(w: Workload, result: str, micro: int) -> list[str]:
    """This file as a TRL worker process for the workload, writing its steps to `result`."""
    return [sys.executable, os.path.abspath(__file__), "--trl-only", result, "--config", w.config,
            "--steps", str(w.steps), "--trl-micro", str(micro), "--", *w.overrides]


def run_trl(w: Workload, threads: int, micro: int) -> Run:
    """This file as a TRL worker process (`--trl-only`), which writes its Run as JSON."""
    with tempfile.TemporaryDirectory(prefix="pspo-step-time-trl-") as out:
        result = os.path.join(out, "run.json")
        proc = subprocess.run(worker_argv(w, result, micro), cwd=ROOT, env=subprocess_env(threads),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"TRL worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(result) as f:
            r = json.load(f)
        return Run(r["times"], r["length"])


def trl_refusal(cfg) -> str | None:
    """The first setting of the config TRL's GRPOTrainer cannot run as train.py does, or None."""
    checks = (("algo.advantage", cfg.algo.advantage, "grpo"), ("algo.aggregation", cfg.algo.aggregation, "grpo"),
              ("algo.objective", cfg.algo.objective, "ppo_clip"),
              ("ers.enabled", cfg.ers.enabled, False), ("pps.enabled", cfg.pps.enabled, False),
              ("reward.prm", cfg.reward.prm, 0.0), ("model.lora.rank", cfg.model.lora.rank, 0))
    return next((f"{key}={value}: TRL's side runs {key}={expected} only" for key, value, expected in checks
                 if value != expected), None)


def trl_args(cfg, output_dir: str, micro: int, cuda: bool) -> dict:
    """GRPOConfig's arguments for a train.py config: one optimizer step per rollout batch of B x G
    completions, `micro` of them per forward/backward (0: all)."""
    per_step = cfg.train.prompts_per_step * cfg.rollout.num_generations
    micro = micro or per_step
    if per_step % micro:
        raise ValueError(f"--trl-micro {micro} must divide the step's {per_step} completions")
    o = cfg.optim
    schedule = ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": o.min_lr_ratio}}
                if o.min_lr_ratio > 0 else {"lr_scheduler_type": "cosine"})
    return dict(
        output_dir=output_dir, seed=cfg.train.seed, use_cpu=not cuda, bf16=cfg.model.bf16 and cuda,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,   # one step per batch
        num_generations=cfg.rollout.num_generations, max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=0,
        beta=cfg.algo.beta, num_iterations=cfg.algo.num_iterations, epsilon=cfg.algo.eps_low,
        epsilon_high=cfg.algo.eps_high, loss_type="grpo", scale_rewards="group" if cfg.algo.scale_rewards else "none",
        learning_rate=o.lr, warmup_steps=o.warmup_steps, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm, **schedule,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0)


def trl_worker(w: Workload, result_path: str, micro: int) -> None:
    """GRPOTrainer on the workload for w.steps steps; after every step, writes {"times": [...],
    "gen_s": [...], "length": ...} to result_path (a run stopped midway keeps its steps)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pspo.offline.builtin import resolve_model_path
    from pspo.rewards import reward_scorer
    from pspo.tasks.data import prompt_sets
    from pspo.training.config import load_config
    from pspo.training.model import load_tokenizer

    cfg = load_config(w.config, [*w.overrides, *TIMED, f"--train.max_steps={w.steps}"])
    refused = trl_refusal(cfg)
    if refused:
        print(f"bench/step_time.py: {w.config}: {refused}", file=sys.stderr)
        raise SystemExit(2)
    path = resolve_model_path(cfg.model.name_or_path)
    tokenizer = load_tokenizer(path, cfg.model.trust_remote_code)
    train, _ = prompt_sets(cfg, tokenizer)
    # TRL tokenizes a plain-text prompt with processing_class(text=...): it must give train.py's ids
    assert tokenizer(text=train.texts)["input_ids"] == train.ids, "TRL would see other prompt token ids"
    dataset = Dataset.from_dict({"prompt": train.texts, "row": list(range(len(train.texts)))})
    score = reward_scorer(cfg.reward, train, None, None)          # train.py's rewards, in this process
    per_step = cfg.train.prompts_per_step * cfg.rollout.num_generations
    record: dict = {"times": [], "gen_s": [], "lengths": [], "length": None,
                    "workload": {"config": w.config, "overrides": list(w.overrides)}}

    def reward(prompts: list[str], completions: list[str], row: list[int], completion_ids, **_) -> list[float]:
        assert len(completions) == per_step, "TRL would not score one step's B x G completions per call"
        record["lengths"].append(sum(map(len, completion_ids)) / len(completion_ids))
        return score(row, completions).rewards.tolist()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:
            self.start, self.gen = time.perf_counter(), generated[0]

        def on_step_end(self, args, state, control, **kwargs) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            record["times"].append(time.perf_counter() - self.start)
            record["gen_s"].append(generated[0] - self.gen)
            record["length"] = statistics.mean(record["lengths"])
            with open(result_path + ".tmp", "w") as f:
                json.dump(record, f, indent=1)
            os.replace(result_path + ".tmp", result_path)

    generated = [0.0]                  # seconds inside the model's generate, summed
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)   # float32 weights, as train.py's
    plain_generate = model.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = plain_generate(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        generated[0] += time.perf_counter() - start
        return out

    model.generate = timed_generate
    with tempfile.TemporaryDirectory(prefix="pspo-trl-out-") as out:
        config = GRPOConfig(max_steps=w.steps, **trl_args(cfg, out, micro, cuda))
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StepTimer()])
        trainer.train()


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
    ap.add_argument("--steps", type=int, default=Workload.steps, help="optimizer steps per run")
    ap.add_argument("--config", default="", help="a train.py config, its overrides after -- (default: the "
                    "tiny CPU workload on configs/grpo.yaml, set by the options below)")
    ap.add_argument("--trl-micro", type=int, default=0, help="completions per TRL forward/backward (0: the whole "
                    "step's in one)")
    ap.add_argument("--trl-only", default="", metavar="FILE", help="run the TRL side once, in this process, and "
                    "write its steps to FILE (JSON) after each")
    for name, default in asdict(CpuWorkload()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None,
                        help=f"the tiny CPU workload's (default {default})")
    ap.add_argument("overrides", nargs="*", help="after --: train.py overrides (--section.key=value)")
    args = ap.parse_args(argv)
    if not args.trl_only and args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.config and any(getattr(args, k) is not None for k in asdict(CpuWorkload())):
        ap.error("--prompts, --G, --max-new-tokens, --lr, --lr-warmup and --seed set the tiny CPU workload; "
                 "with --config, give train.py overrides after --")
    return args


def workload(args: argparse.Namespace) -> Workload:
    if args.config:
        return Workload(args.config, tuple(args.overrides), args.steps)
    cpu = CpuWorkload(**{k: getattr(args, k) for k in asdict(CpuWorkload()) if getattr(args, k) is not None})
    return Workload(CPU_CONFIG, cpu.overrides() + tuple(args.overrides), args.steps)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    w = workload(args)
    missing = missing_trl()
    if missing is not None:
        print(f"bench/step_time.py: TRL's GRPOTrainer is not importable (no module {missing!r}); install "
              f"it with `pip install -r bench/requirements.txt`, or `pip install --target DIR --no-deps "
              f"{TRL_PINS}` and PYTHONPATH=DIR", file=sys.stderr)
        return 2
    from pspo.offline.builtin import resolve_model_path
    from pspo.training.config import ConfigError, load_config
    try:
        cfg = load_config(w.config, [*w.overrides, *TIMED])
    except ConfigError as e:
        print(f"bench/step_time.py: {e}", file=sys.stderr)
        return 2
    if args.trl_only:
        trl_worker(w, args.trl_only, args.trl_micro)
        return 0
    import accelerate
    import torch
    import transformers
    import trl

    resolve_model_path(cfg.model.name_or_path)   # a built-in model built once, before any timed run
    print(f"{os.cpu_count()} CPUs, {args.threads} torch threads per side, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, trl {trl.__version__}, accelerate {accelerate.__version__}; "
          f"{w.config} {' '.join(w.overrides)}: {cfg.train.prompts_per_step} prompts x {cfg.rollout.num_generations} "
          f"completions, <= {cfg.rollout.max_new_tokens} new tokens, {w.steps} steps per run, first {args.warmup} "
          f"left out; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    ours, trl_runs = [], []
    for rep in range(args.reps):
        for side, runner, runs in (("train.py", lambda: run_ours(w, args.threads), ours),
                                   ("TRL", lambda: run_trl(w, args.threads, args.trl_micro), trl_runs)):
            start = time.perf_counter()
            runs.append(runner())
            print(f"rep {rep + 1}: {side} median {statistics.median(runs[-1].times[args.warmup:]):.3f} s/step "
                  f"({time.perf_counter() - start:.0f} s with start-up)", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end\n")
    print("\n".join(summary(ours, trl_runs, args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
