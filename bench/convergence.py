"""The convergence study: GRPO, Dr. GRPO, ERS, PPS and PSPO on a built-in task, several seeds.

    python bench/convergence.py            # the study: 5 methods x 3 seeds x 100 steps (~35 min, 2-core CPU)
    python bench/convergence.py --quick    # a 2-minute smoke version for CI (does not touch RESULTS.md)
    python bench/convergence.py --task knights   # grpo, reinforce_pp(_baseline), pspo on K&K puzzles
    python bench/convergence.py --methods pps,pspo --section pps-floor -- --pps.eps=0.05   # a side study
    python bench/convergence.py --section pps-study --steps 60 \
        --methods grpo,pspo,pspo_released,pps_mix,pps_learnability,pps_skip,grpo_skip     # the sampler study
    python bench/convergence.py --section ers-alpha --steps 60 \
        --methods grpo,ers@ers.alpha=0.1,ers@ers.alpha=0.5,ers     # a sweep: preset@key=value[@key=value]

Every run is `train.py --config configs/<method>.yaml` (`configs/knights/<method>.yaml` with --task
knights, on the study's base `builtin:tiny-knights` instead of the presets' quick one, except with
--quick; pspo/offline/tiny_knights.py) with the same seed, steps, batch, engine (`--engine`,
default hf: faster than vLLM on CPU for the tiny models, and what the tables were measured with) and
evaluation schedule, so all
methods consume the same rollouts (steps x B x G). From each run's metrics.jsonl, over seeds:
  final    test accuracy after the last step: greedy, or --metric eval_mean@K (sampled, K per prompt)
  AUC      area under the accuracy-vs-rollouts curve / rollouts (= mean accuracy over training)
  to thr   rollouts consumed until test accuracy first reaches --threshold (at an eval point)
  R_X      (rollouts --baseline needs to reach its own final accuracy) / (rollouts this method
           needs to reach it), interpolated between evaluations; > 1 is faster (mean ± sd over seeds)
  train time to it   summed step times (evaluations excluded) to that accuracy, and its ratio
  rollouts saved     prompts skipped before generation (pps.skip) x G, per run
  Nppl     (K&K) final greedy accuracy on the test puzzles of N people, as K&K results are reported
  bookkeeping  drawing prompts + advantages + the ERS/PPS updates, as a fraction of step time
               (for grpo/dr_grpo: the uniform sampler and group advantages; the rest is ERS/PPS)
  gen tokens   every token training generated (rollouts, SPO's Monte Carlo continuations and tree
               branches), mean over seeds; the plot's second panel puts accuracy against it. SPO-tree's
               G is its b0 (branches are not rollouts): compare it with the others by generated tokens
It prints the table, writes it into bench/RESULTS.md (between the convergence markers) and
plots test accuracy against rollouts to bench/convergence.png. matplotlib is needed here only
(bench/requirements.txt). Finished runs are reused: delete --out to start over.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.plot_runs import combine, draw_band  # noqa: E402
from pspo.offline.builtin import TINY_KNIGHTS_MODEL  # noqa: E402

TASKS = {   # task -> (preset folder, default methods, default threshold)
    "arithmetic": ("configs", ("grpo", "dr_grpo", "ers", "pps", "pspo"), 0.70),
    "knights": ("configs/knights", ("grpo", "reinforce_pp", "reinforce_pp_baseline", "pspo"), 0.09),   # mean@4
}
# The model a task's study runs on when it is not the presets' own: the K&K presets start on a base that
# builds in a minute; the K&K results in bench/RESULTS.md are conditioned on the study build.
STUDY_MODEL = {"knights": TINY_KNIGHTS_MODEL}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="arithmetic", choices=sorted(TASKS), help="built-in task (preset folder)")
    ap.add_argument("--methods", default="",
                    help="presets in the task's folder, comma-separated (default: all); preset@key=value adds "
                         "--key=value to that method's runs only (a sweep)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100, help="rollout steps per run")
    ap.add_argument("--eval-every", type=int, default=10, help="greedy test accuracy every N steps")
    ap.add_argument("--metric", default="auto", help="the accuracy every column reads: eval_accuracy (greedy) or "
                    "eval_mean@K (sampled); auto: eval_mean@K when the runs logged it (the K&K presets), else greedy")
    ap.add_argument("--threshold", type=float, default=None,
                    help="accuracy for the rollouts-to-threshold column (default: arithmetic 0.70, knights 0.09 on mean@4)")
    ap.add_argument("--baseline", default="grpo", help="the method whose final accuracy the R_X column targets")
    ap.add_argument("--engine", default="hf", help="rollout.engine of every run (the tables were measured with hf)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each gets cores/jobs threads)")
    ap.add_argument("--out", default="", help="run folders (default runs/<section>, runs/<section>-quick)")
    ap.add_argument("--section", default="",
                    help="name of the RESULTS.md block and of the plot bench/<section>.png (side studies use their own)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny version for CI: 4 steps, B 16, 64 test problems, the presets' own models")
    ap.add_argument("overrides", nargs="*", help="extra --section.key=value for every run (after a lone --)")
    args = ap.parse_args(argv)
    args.folder, methods, threshold = TASKS[args.task]
    args.methods = args.methods or ",".join(methods)
    args.threshold = threshold if args.threshold is None else args.threshold
    args.section = args.section or ("convergence" if args.task == "arithmetic" else f"convergence-{args.task}")
    if args.quick:
        args.steps, args.eval_every = 4, 2
        quick = (["--train.prompts_per_step=16", "--data.max_eval_examples=64"] if args.task == "arithmetic"
                 else ["--train.prompts_per_step=2", "--data.max_eval_examples=14"])   # 2 puzzles per size
        args.overrides = [*quick, *args.overrides]
    elif args.task in STUDY_MODEL:          # first, so that a --model.name_or_path after -- wins
        args.overrides = [f"--model.name_or_path={STUDY_MODEL[args.task]}", *args.overrides]
    args.out = args.out or os.path.join(ROOT, "runs", args.section + ("-quick" if args.quick else ""))
    return args


def split_method(method: str) -> tuple[str, list[str]]:
    """"ers@ers.alpha=0.5" -> ("ers", ["--ers.alpha=0.5"]): the preset and this method's own overrides."""
    preset, *pairs = method.split("@")
    return preset, [f"--{p}" for p in pairs]


def run_one(method: str, seed: int, args: argparse.Namespace, threads: int) -> str:
    """Train one (method, seed); returns its output folder. Reuses a run finished with the same command."""
    out = os.path.join(args.out, f"{method.replace('@', '-')}-s{seed}")
    preset, own = split_method(method)
    cmd = ["train.py", "--config", f"{args.folder}/{preset}.yaml", f"--train.seed={seed}",
           f"--train.output_dir={out}", f"--train.max_steps={args.steps}", f"--train.eval_steps={args.eval_every}",
           "--train.progress=false", "--train.keep_checkpoints=1", f"--rollout.engine={args.engine}",
           *args.overrides, *own]
    stamp = os.path.join(out, "bench_run.json")
    if _finished(out, args.steps) and os.path.exists(stamp) and json.load(open(stamp))["command"] == cmd:
        return out
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} seed {seed} failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    with open(stamp, "w") as f:
        json.dump({"command": cmd, "wall_s": wall}, f)
    print(f"  {method:8s} seed {seed}: {wall:6.1f} s", flush=True)
    return out


def _finished(out: str, steps: int) -> bool:
    rows = _read(out) if os.path.exists(os.path.join(out, "metrics.jsonl")) else []
    return bool(rows) and rows[-1]["step"] == steps and "eval_accuracy" in rows[-1]


def metric_name(metric: str) -> str:
    """"eval_accuracy" -> "greedy test accuracy"; "eval_mean@4" -> "test mean@4 (sampled)"."""
    return "greedy test accuracy" if metric == "eval_accuracy" else f"test {metric[len('eval_'):]} (sampled)"


def _read(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def curve(rows: list[dict], rollouts_per_step: int, metric: str = "eval_accuracy") -> tuple[list[int], list[float]]:
    """(rollouts consumed, test accuracy `metric`) at every evaluation, step 0 included."""
    points = [(r["step"] * rollouts_per_step, r[metric]) for r in rows if r.get(metric) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def token_curve(rows: list[dict]) -> list[float] | None:
    """Generated tokens so far at every evaluation (0 at step 0); None for a run logged without them."""
    points = [0.0 if r["step"] == 0 else r.get("generated_tokens") for r in rows if r.get("eval_accuracy") is not None]
    return None if None in points else points


def auc(x: list[int], y: list[float]) -> float:
    """Trapezoid area under y(x) divided by the x range: the mean accuracy over training."""
    area = sum((x[i + 1] - x[i]) * (y[i + 1] + y[i]) / 2 for i in range(len(x) - 1))
    return area / (x[-1] - x[0])


def rollouts_to(x: list[int], y: list[float], threshold: float) -> int | None:
    return next((xi for xi, yi in zip(x, y) if yi >= threshold), None)


def crossing(x: list[float], y: list[float], target: float) -> float | None:
    """Where y first reaches target, linearly interpolated between evaluation points (None: never)."""
    for i, (xi, yi) in enumerate(zip(x, y)):
        if yi >= target:
            if i == 0:
                return xi
            return x[i - 1] + (xi - x[i - 1]) * (target - y[i - 1]) / (yi - y[i - 1])
    return None


def elapsed(rows: list[dict], rollouts_per_step: int, rollouts: float) -> float:
    """Training wall time (the sum of step_time_s, evaluations excluded) until `rollouts` were
    generated, interpolated within the step."""
    steps = rollouts / rollouts_per_step
    times = [r["step_time_s"] for r in rows if r["step"] > 0]
    whole = int(steps)
    return sum(times[:whole]) + (steps - whole) * (times[whole] if whole < len(times) else 0.0)


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def speedups(runs: dict[str, list[str]], baseline: str, metric: str = "eval_accuracy") -> dict[str, str]:
    """R_X and time to the baseline's final accuracy, per method.

    target = the baseline's final test accuracy (mean over its seeds); R_X of a seed = the rollouts
    the baseline needs to first reach target (mean over its seeds) / the rollouts this seed needs
    (interpolated between evaluations), so > 1 is faster; reported as mean ± sd over the seeds that
    reach target. The same for training wall time (step times summed, evaluations excluded)."""
    if baseline not in runs:
        return {}
    rows = {m: [_read(o) for o in outs] for m, outs in runs.items()}
    per_step = {m: [_rollouts_per_step(o) for o in outs] for m, outs in runs.items()}
    target = statistics.mean(curve(r, k, metric)[1][-1] for r, k in zip(rows[baseline], per_step[baseline]))
    base_x = [crossing(*curve(r, k, metric), target) for r, k in zip(rows[baseline], per_step[baseline])]
    base_t = [elapsed(r, k, x) for r, k, x in zip(rows[baseline], per_step[baseline], base_x) if x is not None]
    base_x = [x for x in base_x if x is not None]
    if base_x and max(base_x) == 0:     # the baseline ends at or below its step-0 accuracy: no speed-up to measure
        return {**{m: (f"undefined: {baseline}'s final ≤ its step 0", "-") for m in runs}, "_target": f"{target:.3f}"}
    out = {}
    for m in runs:
        xs = [crossing(*curve(r, k, metric), target) for r, k in zip(rows[m], per_step[m])]
        ts = [elapsed(r, k, x) for r, k, x in zip(rows[m], per_step[m], xs) if x is not None]
        xs = [x for x in xs if x is not None]
        if not xs or not base_x:
            out[m] = (f"not reached (0/{len(rows[m])})", "-")
            continue
        ratio = [statistics.mean(base_x) / max(x, 1.0) for x in xs]
        tratio = [statistics.mean(base_t) / max(t, 1e-9) for t in ts]
        out[m] = (f"{_mean_sd(ratio)} ({len(xs)}/{len(rows[m])})", f"{statistics.mean(ts):.0f} s, x{statistics.mean(tratio):.2f}")
    out["_target"] = f"{target:.3f}"
    return out


def resolve_metric(metric: str, outs: list[str]) -> str:
    """--metric as a metrics.jsonl key (auto: eval_mean@K if logged at step 0, else greedy); a key a run lacks: exit 2."""
    if metric == "auto":
        metric = next((k for k in _read(outs[0])[0] if k.startswith("eval_mean@")), "eval_accuracy")
    if missing := [o for o in outs if metric not in _read(o)[0]]:
        print(f"error: --metric {metric}: not in {missing[0]}/metrics.jsonl (evaluate it: the presets' "
              "eval.num_samples, or -- --eval.num_samples=K)", file=sys.stderr)
        sys.exit(2)
    return metric


def summarize(runs: dict[str, list[str]], args: argparse.Namespace) -> tuple[str, dict]:
    """The markdown table and the per-method curves for the plot (args.metric resolved here)."""
    args.metric = resolve_metric(args.metric, [o for outs in runs.values() for o in outs])
    fast = speedups(runs, args.baseline, args.metric)
    target = fast.pop("_target", None)
    extra = (f" R_X to {args.baseline}'s final {target} | train time to it |" if target else "")
    sizes = sorted(int(k[len("eval_greedy_"):-3]) for k in _read(next(iter(runs.values()))[0])[-1]
                   if k.startswith("eval_greedy_") and k.endswith("ppl"))                  # K&K: 2..8
    lines = [f"| method | final test acc | AUC | rollouts to {args.threshold:.2f} |{extra} step time (s) | "
             "bookkeeping / step | rollouts saved | gen tokens |" + "".join(f" {n}ppl |" for n in sizes),
             "|---|---|---|---|" + ("---|---|" if target else "") + "---|---|---|---|" + "---|" * len(sizes)]
    curves = {}
    for method, outs in runs.items():
        finals, aucs, reached, step_s, book_s, per_seed, saved, tokens = [], [], [], [], [], [], [], []
        for out in outs:
            rows = _read(out)
            train_rows = [r for r in rows if r["step"] > 0]
            cfg_rollouts = _rollouts_per_step(out)
            x, y = curve(rows, cfg_rollouts, args.metric)
            per_seed.append((x, y))
            tokens.append(token_curve(rows))
            finals.append(y[-1])
            aucs.append(auc(x, y))
            hit = rollouts_to(x, y, args.threshold)
            if hit is not None:
                reached.append(hit)
            step_s.append(statistics.mean(r["step_time_s"] for r in train_rows))
            book_s.append(statistics.mean(r["bookkeeping_s"] for r in train_rows))
            saved.append(sum(r.get("rollouts_saved", 0.0) for r in train_rows))
        to_thr = (f"{statistics.mean(reached) / 1000:.1f}k ({len(reached)}/{len(outs)} seeds)" if reached
                  else f"not reached (0/{len(outs)})")
        overhead = statistics.mean(book_s) / statistics.mean(step_s)
        speed = f" {fast[method][0]} | {fast[method][1]} |" if target else ""
        by_size = [_mean_sd([_read(out)[-1][f"eval_greedy_{n}ppl"] for out in outs]) for n in sizes]
        lines.append(f"| {method} | {_mean_sd(finals)} | {_mean_sd(aucs)} | {to_thr} |{speed} "
                     f"{statistics.mean(step_s):.2f} | {100 * overhead:.2f}% | {statistics.mean(saved) / 1000:.1f}k | "
                     + (f"{statistics.mean(t[-1] for t in tokens) / 1000:.0f}k |" if None not in tokens else "- |")
                     + "".join(f" {v} |" for v in by_size))
        curves[method] = (per_seed, tokens)
    return "\n".join(lines), curves


def _rollouts_per_step(out: str) -> int:
    import yaml
    with open(os.path.join(out, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    return cfg["train"]["prompts_per_step"] * cfg["rollout"]["num_generations"]


def plot(curves: dict, path: str, threshold: float, task: str, metric: str = "eval_accuracy") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_tokens = all(None not in tokens for _, tokens in curves.values())   # a second panel: x = generated tokens
    fig, axes = plt.subplots(1, 2 if by_tokens else 1, figsize=(13 if by_tokens else 7, 4.5), squeeze=False)
    for method, (per_seed, tokens) in curves.items():
        band = combine([x for x, _ in per_seed], [y for _, y in per_seed])   # mean and min..max per eval point
        xs = [[v / 1000 for v in band.x]]                                # rollouts; then tokens, mean over seeds
        xs += [[statistics.mean(v) / 1e6 for v in zip(*tokens)]] if by_tokens else []
        for ax, x in zip(axes[0], xs):
            draw_band(ax, x, band, f"{method} ({len(per_seed)} seeds)")
    labels = ["rollouts consumed (thousands of completions)", "generated tokens (millions, mean over seeds)"]
    for ax, label in zip(axes[0], labels):
        ax.axhline(threshold, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel(f"{metric_name(metric)} ({'built-in task' if task == 'arithmetic' else 'K&K, all sizes'})")
        ax.set_title("mean over seeds; band = min..max")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markers(section: str) -> tuple[str, str]:
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def write_results(path: str, block: str, section: str = "convergence") -> None:
    """Replace the text between the section's markers in RESULTS.md (append them if absent)."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    begin, end = markers(section)
    section = f"{begin}\n{block}\n{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    methods, seeds = args.methods.split(","), [int(s) for s in args.seeds.split(",")]
    for m in methods:
        preset, own = split_method(m)
        if not os.path.exists(os.path.join(ROOT, args.folder, f"{preset}.yaml")):
            print(f"error: --methods: {args.folder}/{preset}.yaml does not exist", file=sys.stderr)
            sys.exit(2)
        if any("=" not in o for o in own):
            print(f"error: --methods: {m}: expected preset@section.key=value", file=sys.stderr)
            sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    print(f"{len(methods)} methods x {len(seeds)} seeds x {args.steps} steps, {args.jobs} parallel runs "
          f"x {threads} threads -> {args.out}", flush=True)
    jobs = [(m, s) for s in seeds for m in methods]
    with ThreadPoolExecutor(args.jobs) as pool:
        outs = list(pool.map(lambda job: run_one(job[0], job[1], args, threads), jobs))
    runs = {m: [o for (jm, _), o in zip(jobs, outs) if jm == m] for m in methods}
    table, curves = summarize(runs, args)
    png = os.path.join(args.out if args.quick else os.path.join(ROOT, "bench"), f"{args.section}.png")
    plot(curves, png, args.threshold, args.task, args.metric)
    rows_per_step = _rollouts_per_step(outs[0])
    run_s = sum(json.load(open(os.path.join(o, "bench_run.json")))["wall_s"] for o in outs)
    header = (f"{args.steps} steps x {rows_per_step} rollouts/step ({args.steps * rows_per_step / 1000:.1f}k rollouts "
              f"per run), seeds {args.seeds}, {metric_name(args.metric)} every {args.eval_every} steps; mean ± sd over "
              f"seeds. {len(outs)} runs, {run_s / 60:.0f} min of run time in all, {args.jobs} at a time "
              f"({threads} thread{'s' if threads > 1 else ''} each).")
    print(f"\n{header}\n\n{table}\n\nplot: {png}")
    if not args.quick:
        command = " ".join(["python bench/convergence.py", *argv])
        block = (f"Command: `{command}`\n\n{header}\n\n{table}\n\n"
                 f"![test accuracy vs rollouts]({args.section}.png)")
        write_results(os.path.join(ROOT, "bench", "RESULTS.md"), block, args.section)
        print("written: bench/RESULTS.md")


if __name__ == "__main__":
    main(sys.argv[1:])
