"""The prompt-selection bench: methods compared at one budget of generated tokens, with starvation measures.

    python bench/selection.py                # the study: its methods x 3 seeds x 2 train-set sizes (CPU: hours)
    python bench/selection.py --quick        # a smoke version in a few minutes (does not touch RESULTS.md)
    python bench/selection.py --summarise-only --out runs/selection     # the table and figure of finished runs
    python bench/selection.py --methods grpo,pspo,pspo@pps.uniform_mix=0.2 --budget 2e5 --train-sizes 0,64
    python bench/selection.py --folder configs/llama-3.2-1b-instruct --methods grpo,pspo --budget 4e6 \\
        --train-sizes 0 --engine auto --launch "torchrun --nproc_per_node=8" --target 0.4   # GPUs: docs/gpu.md

Protocol. Every run is `train.py --config <folder>/<preset>.yaml` (a method is a preset, or
preset@key=value[@key=value] for that method's own overrides) with one seed, one train-set size and one
token budget: `train.max_generated_tokens` stops it after the step at which the tokens its training
generated (rollouts and continuations, every rank's) reach the budget, and evaluates it there. Methods
are compared at equal generated tokens, not steps: a method that generates more per step (DAPO's extra
rounds, longer completions) takes fewer steps. The learning rate is constant after warm-up in every run
(`optim.min_lr_ratio=1`): a cosine over train.max_steps would stop each method at another point of its
schedule; --max-steps is only a cap. A train-set size N > 0 keeps the first N prompts
(`data.max_train_examples`; the built-in sets stratified), so they are revisited more often; 0 keeps the
preset's. Runs go one at a time, one process each (--launch prefixes train.py, e.g. torchrun); a run whose
folder is complete (same command, its last step evaluated at the budget or at the cap) is reused, any other
is started over. What train.py prints goes to <run folder>/train.log.

From each run's metrics.jsonl and prompts.jsonl (the train rows each step drew and each group's mean
accuracy, written by the training loop), over seeds (mean ± sample sd):
  final test acc   the evaluation at the run's last step (greedy, or eval_mean@K with --metric)
  gen tokens       generated tokens at the last step (the budget, passed by less than one step's tokens)
  tokens to X      generated tokens when test accuracy first reaches --target, interpolated linearly between
                   evaluations; mean over the seeds that reach it (k/n)
  AUC              area under test accuracy vs generated tokens / the tokens (the mean accuracy over the run)
  zero-var groups  the mean over steps of zero_std_frac: groups whose rewards are all equal (no signal)
  mean |A|         the mean over steps of adv_abs_mean
  not drawn, last ¼   share of the N train prompts drawn in no step of the last quarter of the run (the steps
                   that ended after 3/4 of the run's generated tokens: some of their tokens are in it)
  Gini of visits   Gini coefficient of the N prompts' visit counts (unvisited ones count 0): 0 = every prompt
                   drawn equally often, -> 1 = a few prompts take every draw
  all-wrong, not retried   share of the N prompts whose last visit's group was all wrong (mean accuracy 0)
                   and that were not drawn again in the last quarter: prompts the sampler gave up on failing
A table per train-set size, and a figure per size (test accuracy, zero-variance groups and mean |A| against
generated tokens, mean ± sd over seeds): matplotlib, bench/requirements.txt. Without --quick, the tables go
into bench/RESULTS.md between the section's markers and the figures to bench/<section>-<size>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.convergence import auc, crossing, metric_name, split_method, write_results  # noqa: E402
from bench.plot_runs import Group, PlotError, curves, draw, mean_sd, read_run  # noqa: E402

# The study on the CPU demo task: uniform GRPO, DAPO, PSPO, PSPO with the uniform mix, Single-stream PO,
# the learnability and Thompson samplers, MaxRL, GRESO-style skipping and the random-reward control.
STUDY_METHODS = ("grpo", "dapo", "pspo", "pspo@pps.uniform_mix=0.2", "single_stream", "pps_learnability",
                 "pps_thompson", "maxrl", "grpo_skip", "grpo_random_reward")
STUDY_BUDGET = 400_000          # tokens: about 90 steps of GRPO's 64 x 8 completions on the demo task
SMALL_TRAIN_SET = 128           # prompts: 2 steps of 64 per pass, where the default 500 take 7.8
FIGURE_METRICS = ("zero_std_frac", "adv_abs_mean")      # beside the test accuracy, against generated tokens
LATE = 0.75                     # the last quarter of a run: the steps that ended after this share of its tokens


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default="configs", help="the presets' folder (a GPU recipe's: configs/<model>)")
    ap.add_argument("--methods", default="", help="presets in --folder, comma-separated; preset@key=value adds "
                    "--key=value to that method's runs (default: the study's; --quick: grpo,pspo)")
    ap.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; --quick: 0)")
    ap.add_argument("--budget", type=float, default=None, help="generated tokens per run, train.max_generated_"
                    f"tokens (default {STUDY_BUDGET:,}; --quick: 4,000)")
    ap.add_argument("--train-sizes", default=None, help="train-set sizes, comma-separated: N keeps the first N "
                    f"prompts, 0 the preset's set (default 0,{SMALL_TRAIN_SET}; --quick: 0,32)")
    ap.add_argument("--target", type=float, default=None, help="test accuracy of the tokens-to-target column "
                    "(default 0.70; --quick: 0.5)")
    ap.add_argument("--metric", default="eval_accuracy", help="the test accuracy every column reads: "
                    "eval_accuracy (greedy) or eval_mean@K (sampled: add -- --eval.num_samples=K)")
    ap.add_argument("--eval-every", type=int, default=None, help="test accuracy every N steps, and at the last "
                    "(default 10; --quick: 2)")
    ap.add_argument("--max-steps", type=int, default=10_000, help="a cap on each run's steps (train.max_steps)")
    ap.add_argument("--engine", default="hf", help="rollout.engine of every run (auto: vLLM on a GPU)")
    ap.add_argument("--launch", default="", help='what runs train.py, e.g. "torchrun --nproc_per_node=8" '
                    "(default: this Python)")
    ap.add_argument("--out", default="", help="run folders (default runs/<section>, runs/<section>-quick)")
    ap.add_argument("--section", default="selection", help="the RESULTS.md block and the figures' name")
    ap.add_argument("--summarise-only", action="store_true", help="run nothing: summarise the complete runs "
                    "under --out")
    ap.add_argument("--quick", action="store_true", help="a smoke version: 16 prompts per step, 64 test problems, "
                    "the defaults marked --quick above")
    ap.add_argument("--base-rate", default="", metavar="PRESET", help="run nothing else: print the accuracy of "
                    "PRESET's first step over up to 512 train prompts (the base model's), the reward.random_rate of "
                    "a random-reward control (docs/methods.md §5)")
    ap.add_argument("overrides", nargs="*", help="extra --section.key=value for every run (after a lone --)")
    args = ap.parse_args(argv)
    quick = args.quick
    args.methods = [m for m in (args.methods or ("grpo,pspo" if quick else ",".join(STUDY_METHODS))).split(",") if m]
    args.budget = args.budget if args.budget is not None else (4000.0 if quick else float(STUDY_BUDGET))
    args.target = args.target if args.target is not None else (0.5 if quick else 0.70)
    args.eval_every = args.eval_every if args.eval_every is not None else (2 if quick else 10)
    if quick:
        args.overrides = ["--train.prompts_per_step=16", "--data.max_eval_examples=64", *args.overrides]
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "runs", args.section + ("-quick" if quick else "")))
    try:
        args.seeds = [int(s) for s in (args.seeds or ("0" if quick else "0,1,2")).split(",")]
        args.train_sizes = [int(n) for n in (args.train_sizes or ("0,32" if quick else f"0,{SMALL_TRAIN_SET}"))
                            .split(",")]
    except ValueError:
        fail("--seeds, --train-sizes: expected comma-separated integers")
    if min(args.train_sizes) < 0 or args.budget <= 0 or args.eval_every < 1 or args.max_steps < 1:
        fail("expected --train-sizes >= 0, --budget > 0, --eval-every >= 1 and --max-steps >= 1")
    if not args.summarise_only and not args.base_rate:
        check_methods(args)
    return args


def check_methods(args: argparse.Namespace) -> None:
    """Every method's preset loads with every run's overrides (config.py's checks), before anything runs: a
    mistake is one line and exit 2, not a failure hours in."""
    from pspo.training.config import ConfigError, load_config
    for method in args.methods:
        preset, own = split_method(method)
        path = os.path.join(ROOT, args.folder, f"{preset}.yaml")
        if not os.path.isfile(path):
            fail(f"--methods: {args.folder}/{preset}.yaml does not exist")
        if any("=" not in o for o in own):
            fail(f"--methods: {method}: expected preset@section.key=value")
        for size in args.train_sizes:
            try:
                load_config(path, command(args, method, args.seeds[0], size)[3:])
            except ConfigError as e:
                fail(f"--methods: {method}: {e}")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def size_label(size: int) -> str:
    """A train-set size as a folder name: 0 -> "all", 128 -> "n128"."""
    return "all" if size == 0 else f"n{size}"


def run_folder(args: argparse.Namespace, method: str, seed: int, size: int) -> str:
    return os.path.join(args.out, size_label(size), f"{method.replace('@', '-').replace('/', '-')}-s{seed}")


def command(args: argparse.Namespace, method: str, seed: int, size: int) -> list[str]:
    """One run's train.py command (without what launches it); the method's own overrides come last and win."""
    preset, own = split_method(method)
    return ["train.py", "--config", f"{args.folder}/{preset}.yaml", f"--train.seed={seed}",
            f"--train.output_dir={run_folder(args, method, seed, size)}",
            f"--train.max_generated_tokens={int(args.budget)}", f"--train.max_steps={args.max_steps}",
            f"--train.eval_steps={args.eval_every}", "--optim.min_lr_ratio=1.0", "--train.progress=false",
            "--train.keep_checkpoints=1", f"--rollout.engine={args.engine}",
            *([f"--data.max_train_examples={size}"] if size else []), *args.overrides, *own]


def complete(out: str, cmd: list[str] | None = None) -> bool:
    """The run in `out` finished (stamped with `cmd` when given): its last step was evaluated and it reached its
    token budget or its step cap, and its prompts.jsonl is there."""
    stamp, metrics = os.path.join(out, "bench_run.json"), os.path.join(out, "metrics.jsonl")
    if not (os.path.isfile(stamp) and os.path.isfile(metrics) and os.path.isfile(os.path.join(out, "prompts.jsonl"))):
        return False
    with open(stamp) as f:
        ran = json.load(f)
    if cmd is not None and ran["command"] != cmd:
        return False
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    last = rows[-1] if rows else {}
    return ("eval_accuracy" in last and last.get("step", 0) > 0
            and (last.get("generated_tokens", 0) >= ran["budget"] or last["step"] == ran["max_steps"]))


def run_one(args: argparse.Namespace, method: str, seed: int, size: int) -> str:
    """Train one (method, seed, train-set size) unless its folder is complete; returns the folder."""
    out, cmd = run_folder(args, method, seed, size), command(args, method, seed, size)
    if complete(out, cmd):
        return out
    if os.path.isdir(out):
        shutil.rmtree(out)                          # an unfinished or different run: started over
    launch = shlex.split(args.launch) if args.launch else [sys.executable]
    os.makedirs(out)
    log = os.path.join(out, "train.log")           # what train.py prints, as it prints it (tail -f)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run([*launch, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:                                   # its output's end, and train.py's exit code
        with open(log) as f:
            print(f"{f.read()[-4000:]}\nerror: {method} seed {seed} ({size_label(size)}) failed with exit code "
                  f"{code} ({log}): {' '.join(cmd)}", file=sys.stderr)
        sys.exit(code)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "bench_run.json"), "w") as f:
        json.dump({"command": cmd, "budget": args.budget, "max_steps": args.max_steps, "wall_s": wall}, f)
    print(f"  {size_label(size):5s} {method:30s} seed {seed}: {wall:7.1f} s", flush=True)
    return out


# ---- the measures of one run -----------------------------------------------------------------------------

def gini(counts: list[int]) -> float:
    """Gini coefficient of non-negative counts: Σ_i Σ_j |c_i − c_j| / (2 n² mean), from the sorted counts as
    2 Σ_i i·c_(i) / (n Σ c) − (n + 1) / n (i = 1..n). 0 when all are equal (or all 0)."""
    n, total = len(counts), sum(counts)
    if total == 0:
        return 0.0
    ranked = sum(i * c for i, c in enumerate(sorted(counts), start=1))
    return 2 * ranked / (n * total) - (n + 1) / n


@dataclass
class Starvation:
    """Which prompts a run kept drawing and which it left (prompts.jsonl), as shares of the N train prompts."""
    not_drawn_late: float         # drawn in no step of the last quarter
    gini: float                   # Gini of the visit counts
    abandoned: float              # last visit all wrong, not drawn in the last quarter


def starvation(draws: list[dict], tokens_at: dict[int, float], total: float) -> Starvation:
    """draws: prompts.jsonl's lines (step, prompts N, rows, accuracy); tokens_at: step -> the tokens generated by
    its end; total: the run's generated tokens. A step is in the last quarter when it ended after LATE · total."""
    n = draws[0]["prompts"]
    visits, last_accuracy, late = [0] * n, {}, set()
    for draw_ in draws:
        in_late = tokens_at[draw_["step"]] > LATE * total
        for row, accuracy in zip(draw_["rows"], draw_["accuracy"]):
            visits[row] += 1
            last_accuracy[row] = accuracy                  # draws are in step order: the last one wins
            if in_late:
                late.add(row)
    abandoned = sum(1 for row, accuracy in last_accuracy.items() if accuracy == 0 and row not in late)
    return Starvation(not_drawn_late=(n - len(late)) / n, gini=gini(visits), abandoned=abandoned / n)


@dataclass
class RunMeasures:
    final: float                  # test accuracy at the last step
    tokens: float                 # generated tokens at the last step
    to_target: float | None       # generated tokens when test accuracy first reached the target (None: never)
    auc: float
    zero_std: float               # mean over steps of zero_std_frac
    adv_abs: float                # mean over steps of adv_abs_mean
    starved: Starvation


def measure(out: str, target: float, metric: str = "eval_accuracy") -> RunMeasures:
    """One complete run's measures from its metrics.jsonl and prompts.jsonl."""
    rows = [row for _, row in read_run(out).rows]
    train_rows = [r for r in rows if r["step"] > 0]
    evals = [r for r in rows if r.get(metric) is not None]
    x = [0.0 if r["step"] == 0 else r["generated_tokens"] for r in evals]      # (evaluations,) tokens so far
    y = [r[metric] for r in evals]
    tokens = train_rows[-1]["generated_tokens"]
    with open(os.path.join(out, "prompts.jsonl")) as f:
        draws = [json.loads(line) for line in f if line.strip()]
    return RunMeasures(final=y[-1], tokens=tokens, to_target=crossing(x, y, target), auc=auc(x, y),
                       zero_std=_step_mean(train_rows, "zero_std_frac"),
                       adv_abs=_step_mean(train_rows, "adv_abs_mean"),
                       starved=starvation(draws, {r["step"]: r["generated_tokens"] for r in train_rows}, tokens))


def _step_mean(rows: list[dict], key: str) -> float:
    """The mean of `key` over the steps that logged a number (a step that trained nothing logs null)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else float("nan")


# ---- the table and the figure ------------------------------------------------------------------------------

def table(runs: dict[str, list[str]], target: float, metric: str = "eval_accuracy") -> str:
    """Markdown: a row per method, mean ± sd over its runs (folders)."""
    lines = [f"| method | runs | final test acc | gen tokens | tokens to {target:.2f} | AUC | zero-var groups | "
             "mean \\|A\\| | not drawn, last ¼ | Gini of visits | all-wrong, not retried |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, outs in runs.items():
        m = [measure(out, target, metric) for out in outs]
        reached = [r.to_target for r in m if r.to_target is not None]
        to_target = (f"{statistics.mean(reached) / 1000:.1f}k ({len(reached)}/{len(m)})" if reached
                     else f"not reached (0/{len(m)})")
        cells = [mean_sd([r.final for r in m]), f"{statistics.mean(r.tokens for r in m) / 1000:.1f}k", to_target,
                 mean_sd([r.auc for r in m]), mean_sd([r.zero_std for r in m]), mean_sd([r.adv_abs for r in m]),
                 mean_sd([r.starved.not_drawn_late for r in m]), mean_sd([r.starved.gini for r in m]),
                 mean_sd([r.starved.abandoned for r in m])]
        lines.append(f"| {method} | {len(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(runs: dict[str, list[str]], path: str, metric: str = "eval_accuracy") -> str | None:
    """Test accuracy, zero-variance groups and mean |A| against generated tokens, a line per method (mean over
    seeds, band ± sd), to `path`; None when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    groups = [Group(label=method, runs=[read_run(out) for out in outs]) for method, outs in runs.items()]
    panels = curves(groups, [metric, *FIGURE_METRICS], x_key="generated_tokens", spread="sd")
    draw(panels, groups, path, x_key="generated_tokens", spread="sd", smooth=1)
    return path


def summarise(args: argparse.Namespace) -> tuple[str, list[str]]:
    """Every train-set size's table (and figure) from the complete runs under --out: (the text block, notes)."""
    blocks, notes = [], []
    for size in args.train_sizes:
        runs, missing = {}, []
        for method in args.methods:
            outs = [run_folder(args, method, seed, size) for seed in args.seeds]
            done = [out for out in outs if complete(out)]
            missing += [os.path.relpath(out, args.out) for out in outs if out not in done]
            if done:
                runs[method] = done
        if not runs:
            blocks.append(f"**Train set {size_label(size)}**: no complete runs under {args.out}.")
            continue
        with open(os.path.join(next(iter(runs.values()))[0], "prompts.jsonl")) as f:
            n = json.loads(f.readline())["prompts"]
        png = os.path.join(args.out if args.quick else os.path.join(ROOT, "bench"),
                           f"{args.section}-{size_label(size)}.png")
        try:
            drawn = figure(runs, png, args.metric)
            notes.append(f"figure: {png}" if drawn else f"figure {png}: not drawn, matplotlib is not installed "
                         "(pip install -r bench/requirements.txt)")
        except PlotError as e:
            drawn = None
            notes.append(f"figure {png}: not drawn ({e})")
        left_out = f"\n\nNot complete, left out: {', '.join(missing)}." if missing else ""
        image = f"\n\n![{args.section}, {size_label(size)}]({os.path.basename(png)})" if drawn else ""
        what = "the preset's train set" if size == 0 else f"the first {size} train prompts"
        blocks.append(f"**Train set: {n} prompts** ({what}).\n\n{table(runs, args.target, args.metric)}"
                      f"{left_out}{image}")
    header = (f"Budget {args.budget:,.0f} generated tokens per run, seeds {','.join(map(str, args.seeds))}, "
              f"{metric_name(args.metric)} every {args.eval_every} steps and at the last; mean ± sd over seeds.")
    return header + "\n\n" + "\n\n".join(blocks), notes


BASE_RATE_PROMPTS = 512         # prompts of the one step that measures a base rate: its sd is ≤ 0.5/sqrt(512·G)


def base_rate(args: argparse.Namespace) -> float:
    """The accuracy of the preset's first step, generated by the base model before any update, over
    min(N, BASE_RATE_PROMPTS) train prompts: the base rate a random-reward control draws at."""
    from pspo.tasks.data import data_rows
    from pspo.training.config import ConfigError, load_config
    path = os.path.join(ROOT, args.folder, f"{args.base_rate}.yaml")
    if not os.path.isfile(path):
        fail(f"--base-rate: {args.folder}/{args.base_rate}.yaml does not exist")
    out = os.path.join(args.out, f"base-rate-{args.base_rate}")
    try:
        prompts = min(len(data_rows(load_config(path, args.overrides))[0].usable), BASE_RATE_PROMPTS)
    except ConfigError as e:
        fail(f"--base-rate: {e}")
    cmd = ["train.py", "--config", f"{args.folder}/{args.base_rate}.yaml", f"--train.output_dir={out}",
           "--train.max_steps=1", f"--train.prompts_per_step={prompts}", "--data.eval=", "--train.save_steps=0",
           "--train.progress=false", f"--rollout.engine={args.engine}", *args.overrides]
    if os.path.isdir(out):
        shutil.rmtree(out)
    launch = shlex.split(args.launch) if args.launch else [sys.executable]
    done = subprocess.run([*launch, *cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        print(done.stdout[-4000:], file=sys.stderr)
        fail(f"--base-rate: {' '.join(cmd)} failed with exit code {done.returncode}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return float(rows[-1]["accuracy"])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.base_rate:
        print(f"{base_rate(args):.3f}")
        return
    if not args.summarise_only:
        jobs = [(size, seed, m) for size in args.train_sizes for seed in args.seeds for m in args.methods]
        print(f"{len(args.methods)} methods x {len(args.seeds)} seeds x {len(args.train_sizes)} train-set sizes, "
              f"{args.budget:,.0f} generated tokens each, one at a time -> {args.out}", flush=True)
        for size, seed, method in jobs:
            run_one(args, method, seed, size)
    block, notes = summarise(args)
    print("\n" + block + "".join(f"\n{note}" for note in notes))
    if not args.quick:
        line = " ".join(["python bench/selection.py", *map(shlex.quote, argv)])
        write_results(os.path.join(ROOT, "bench", "RESULTS.md"), f"Command: `{line}`\n\n{block}", args.section)
        print("written: bench/RESULTS.md")


if __name__ == "__main__":
    main(sys.argv[1:])
