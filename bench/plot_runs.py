"""Draw runs' metrics.jsonl to a PNG: per method, the mean over its seeds and their spread, one panel per metric.

    python bench/plot_runs.py OUT.png RUN... [--group LABEL=PATH[,PATH...]]... [--x steps|generated_tokens]
                              [--metrics reward,accuracy,eval_accuracy] [--spread minmax|sd] [--smooth N]

    python bench/plot_runs.py runs.png runs/convergence/*                  # one line per method, its seeds banded
    python bench/plot_runs.py runs.png --group GRPO='runs/a/grpo-s*' --group PSPO=runs/b/s0,runs/b/s1 \\
        --x generated_tokens --metrics accuracy,eval_accuracy --spread sd

Runs and methods: a RUN is a train.py output folder (it holds metrics.jsonl). A RUN named <label>-s<seed>
(bench/convergence.py's names) or <label>_seed<seed> is one seed of the method <label>; any other RUN is a
method of one seed. --group LABEL=PATH,PATH names a method's runs itself (a PATH may be a quoted glob
pattern, expanded here). Methods are drawn and listed in the order given, the --group ones first.
Metrics: metrics.jsonl keys (docs/README.md, "Metrics"); `reward` means reward_mean. Default: reward_mean, accuracy
(both over the step's training rollouts) and eval_accuracy (greedy test accuracy, drawn at the steps it was
logged, step 0 included). Any other logged key works (eval_mean@4, response_length, ...).
x: the step, or the tokens training has generated so far (`generated_tokens`, 0 at step 0).
Seeds: where a method's seeds logged the metric at the same x (steps, usually), the line is the mean at each
point; where their x differ (generated tokens, or runs of different lengths) each seed is interpolated
linearly onto the union of the seeds' x within the range every seed covers (no extrapolation: the line ends
where the shortest seed ends). The band is min..max over seeds (--spread minmax), or mean ± the sample
standard deviation (n-1; --spread sd); the figure's title says which.
--smooth N replaces each seed's training metrics by their trailing mean over N logged steps before seeds are
combined; eval_* metrics (a few points each) are drawn as logged.
The table on stdout: each run's last logged value of each metric (not interpolated), mean ± sd over the
method's runs. matplotlib: pip install -r bench/requirements.txt.
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass

ALIASES = {"reward": "reward_mean"}
DEFAULT_METRICS = "reward_mean,accuracy,eval_accuracy"
SEED_SUFFIX = re.compile(r"^(?P<label>.+?)(?:-s|_seed)(?P<seed>\d+)$")     # grpo-s0, pspo_seed2
PANELS_PER_ROW = 3


class PlotError(Exception):
    """A user mistake: printed as one line, exit 2."""


@dataclass
class Run:
    """One train.py run: its folder and its metrics.jsonl rows, each with its line number."""
    folder: str
    file: str
    rows: list[tuple[int, dict]]


@dataclass
class Group:
    """A method: the label it is drawn under and its runs (one per seed)."""
    label: str
    runs: list[Run]


@dataclass
class Band:
    """A method's curve of one metric: x, the mean over seeds and the band's lower and upper edges."""
    x: list[float]
    mean: list[float]
    lo: list[float]
    hi: list[float]
    interpolated: bool            # the seeds' x differed: each was interpolated onto the common grid


def read_run(folder: str) -> Run:
    """A run folder -> its rows (blank lines skipped); a missing folder or file, no rows, a line that is
    not a JSON object or a step that does not increase: PlotError naming the file (and line)."""
    if not os.path.isdir(folder):
        raise PlotError(f"{folder}: no such folder (give train.py's output folder)")
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file (is {folder} a train.py output folder?)")
    rows, last = [], -1
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(f"{path}:{number}: not JSON ({e.msg}, column {e.colno})") from None
            step = row.get("step") if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise PlotError(f"{path}:{number}: expected a JSON object with an integer \"step\" >= 0")
            if step <= last:
                raise PlotError(f"{path}:{number}: step {step} after step {last}: steps must increase "
                                "(two runs written into one folder?)")
            rows.append((number, row))
            last = step
    if not rows:
        raise PlotError(f"{path}: no rows (the run has not logged a step)")
    return Run(folder=folder, file=path, rows=rows)


def group_runs(paths: list[str], groups: list[str]) -> list[Group]:
    """RUN folders (grouped by their name's seed suffix) and --group LABEL=PATH,PATH specs -> the methods:
    the --group ones, then the RUN folders' in the order each is first named."""
    named: dict[str, list[str]] = {}
    for spec in groups:
        label, sep, listed = spec.partition("=")
        folders = [p for p in listed.split(",") if p]
        if not sep or not label or not folders:
            raise PlotError(f"--group {spec}: expected LABEL=PATH[,PATH...]")
        if label in named:
            raise PlotError(f"--group {label}: label given twice")
        named[label] = [f for p in folders for f in _expand(p, f"--group {label}")]
    auto: dict[str, list[str]] = {}
    seeds: dict[tuple[str, str], str] = {}
    for path in paths:
        name = os.path.basename(os.path.normpath(path))
        match = SEED_SUFFIX.match(name)
        label, seed = (match["label"], match["seed"]) if match else (name, "")
        if (label, seed) in seeds:
            raise PlotError(f"{seeds[label, seed]} and {path} are both {label!r}"
                            + (f" seed {seed}" if seed else "") + ": name the methods with --group LABEL=PATH,...")
        if label in named:
            raise PlotError(f"{path}: its method {label!r} is also a --group label: put it in that --group")
        seeds[label, seed] = path
        auto.setdefault(label, []).append(path)
    folders = {**named, **auto}
    everything = [os.path.normpath(f) for fs in folders.values() for f in fs]
    if not everything:
        raise PlotError("no runs: give RUN folders or --group LABEL=PATH,...")
    if twice := next((f for f in everything if everything.count(f) > 1), None):
        raise PlotError(f"{twice}: given twice")
    return [Group(label=label, runs=[read_run(f) for f in fs]) for label, fs in folders.items()]


def _expand(path: str, where: str) -> list[str]:
    """A PATH of --group: a glob pattern -> the folders it matches, sorted (none: PlotError); else itself."""
    if not any(c in path for c in "*?["):
        return [path]
    found = sorted(p for p in glob.glob(path) if os.path.isdir(p))
    if not found:
        raise PlotError(f"{where}: {path} matches no folder")
    return found


def resolve_metrics(text: str, groups: list[Group]) -> list[str]:
    """--metrics as metrics.jsonl keys (aliases resolved); a key no run logged, or one that some of a
    method's runs logged and others not: PlotError."""
    metrics = [ALIASES.get(m.strip(), m.strip()) for m in text.split(",")]
    if not all(metrics):
        raise PlotError(f"--metrics {text}: expected comma-separated metrics.jsonl keys")
    runs = [run for g in groups for run in g.runs]
    for metric in metrics:
        if not any(logged(run, metric) for run in runs):
            keys = sorted({k for run in runs for _, row in run.rows for k in row} - {"step"})
            raise PlotError(f"--metrics: {metric} is logged by none of the {len(runs)} runs "
                            f"(they log: {', '.join(keys)})")
        for g in groups:
            has = [logged(run, metric) for run in g.runs]
            if any(has) and not all(has):
                with_it, without = g.runs[has.index(True)].file, g.runs[has.index(False)].file
                raise PlotError(f"{metric}: logged by {with_it} but not by {without} ({g.label!r}): "
                                "compare such runs in groups of their own")
    return metrics


def logged(run: Run, metric: str) -> bool:
    return any(row.get(metric) is not None for _, row in run.rows)


def series(run: Run, metric: str, x_key: str) -> tuple[list[float], list[float]]:
    """(x, y) at the rows where `metric` is logged (null: a non-finite value, left out); x is the step, or
    the tokens generated so far (0 at step 0: nothing generated before training)."""
    xs, ys = [], []
    for number, row in run.rows:
        value = row.get(metric)
        if value is None:
            continue
        if not _is_number(value):
            raise PlotError(f"{run.file}:{number}: {metric}: expected a number or null, got {value!r}")
        if x_key == "steps":
            x = row["step"]
        elif row["step"] == 0:
            x = 0.0
        else:
            x = row.get("generated_tokens")
            if not _is_number(x):
                raise PlotError(f"{run.file}:{number}: no generated_tokens number at step {row['step']} "
                                "(plot this run against --x steps)")
            if xs and x < xs[-1]:
                raise PlotError(f"{run.file}:{number}: generated_tokens {x} below the previous row's {xs[-1]}")
        xs.append(float(x))
        ys.append(float(value))
    return xs, ys


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def trailing_mean(y: list[float], n: int) -> list[float]:
    """Each value replaced by the mean of the last n values up to it (fewer at the start). n = 1: y."""
    return [statistics.mean(y[max(0, i - n + 1):i + 1]) for i in range(len(y))]


def interpolate(x: list[float], xp: list[float], fp: list[float]) -> list[float]:
    """fp(xp) read at x (each inside [xp[0], xp[-1]]) by linear interpolation; where xp repeats a value
    the later point wins."""
    out = []
    for v in x:
        i = bisect.bisect_right(xp, v)           # xp[i-1] <= v < xp[i]
        if i == len(xp):
            out.append(fp[-1])
        elif i == 0 or xp[i - 1] == v:
            out.append(fp[max(i - 1, 0)])
        else:
            t = (v - xp[i - 1]) / (xp[i] - xp[i - 1])
            out.append(fp[i - 1] + t * (fp[i] - fp[i - 1]))
    return out


def combine(xs: list[list[float]], ys: list[list[float]], spread: str = "minmax") -> Band:
    """Seeds' curves -> mean and band at each x. Seeds logged at the same x are combined point by point;
    otherwise each is interpolated onto the union of their x within [the latest start, the earliest end]."""
    interpolated = any(x != xs[0] for x in xs)
    if interpolated:
        start, end = max(x[0] for x in xs), min(x[-1] for x in xs)
        if start > end:
            raise ValueError("the seeds' x ranges do not overlap")
        grid = sorted({v for x in xs for v in x if start <= v <= end})
        ys = [interpolate(grid, x, y) for x, y in zip(xs, ys)]
    else:
        grid = list(xs[0])
    mean, lo, hi = [], [], []
    for values in zip(*ys):                      # one value per seed at this x
        m = statistics.mean(values)
        if spread == "sd":
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            lo.append(m - sd)
            hi.append(m + sd)
        else:
            lo.append(min(values))
            hi.append(max(values))
        mean.append(m)
    return Band(x=grid, mean=mean, lo=lo, hi=hi, interpolated=interpolated)


def curves(groups: list[Group], metrics: list[str], *, x_key: str = "steps", spread: str = "minmax",
           smooth: int = 1) -> dict[str, dict[str, Band]]:
    """metric -> method label -> its Band; a method that did not log the metric is left out of its panel."""
    out = {}
    for metric in metrics:
        out[metric] = {}
        for g in groups:
            per_seed = [series(run, metric, x_key) for run in g.runs]
            if not per_seed[0][0]:
                continue
            window = 1 if metric.startswith("eval_") else smooth
            xs, ys = [x for x, _ in per_seed], [trailing_mean(y, window) for _, y in per_seed]
            try:
                out[metric][g.label] = combine(xs, ys, spread)
            except ValueError as e:
                folders = ", ".join(r.folder for r in g.runs)
                raise PlotError(f"{g.label!r}, {metric} against {x_key}: {e} ({folders})") from None
    return out


def mean_sd(values: list[float]) -> str:
    """"0.600 ± 0.141": the mean and the sample standard deviation (0 for one value); "n/a" when no run has a
    value (NaN: e.g. zero-variance groups of a method without groups, G = 1)."""
    if any(math.isnan(v) for v in values):
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def final_table(groups: list[Group], metrics: list[str]) -> str:
    """Markdown: per method, its runs, last step, generated tokens and each metric's final value (each run's
    last logged one), mean ± sd over its runs."""
    lines = ["| method | runs | last step | generated tokens | " + " | ".join(metrics) + " |",
             "|---|---|---|---|" + "---|" * len(metrics)]
    for g in groups:
        last = [run.rows[-1][1]["step"] for run in g.runs]
        steps = str(last[0]) if min(last) == max(last) else f"{min(last)}-{max(last)}"
        tokens = [run.rows[-1][1].get("generated_tokens") for run in g.runs]
        tokens = f"{statistics.mean(tokens) / 1000:.1f}k" if all(_is_number(t) for t in tokens) else "-"
        cells = []
        for metric in metrics:
            finals = [series(run, metric, "steps")[1] for run in g.runs]
            cells.append(mean_sd([y[-1] for y in finals]) if finals[0] else "-")
        lines.append(f"| {g.label} | {len(g.runs)} | {steps} | {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def metric_label(metric: str) -> str:
    """The panel's y label."""
    known = {"reward_mean": "reward (training rollouts, mean)", "accuracy": "accuracy (training rollouts)",
             "eval_accuracy": "test accuracy (greedy)"}
    if metric in known:
        return known[metric]
    if metric.startswith("eval_mean@"):
        return f"test {metric[len('eval_'):]} (sampled)"
    return metric


def draw_band(ax, x: list[float], band: Band, label: str, color: str | None = None, marker: str | None = "o") -> None:
    """One method's mean line over x and its shaded band (the one place curves are drawn: bench/convergence.py too)."""
    line, = ax.plot(x, band.mean, marker=marker, markersize=3, label=label, color=color)
    ax.fill_between(x, band.lo, band.hi, color=line.get_color(), alpha=0.15)


def draw(panels: dict[str, dict[str, Band]], groups: list[Group], path: str, *, x_key: str, spread: str,
         smooth: int) -> None:
    """The figure: a panel per metric (PANELS_PER_ROW to a row), a color per method, to `path` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(panels)
    cols, rows = min(n, PANELS_PER_ROW), math.ceil(n / PANELS_PER_ROW)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    top = max((max(b.x) for bands in panels.values() for b in bands.values()), default=0.0)
    scale, unit = (1e6, "millions") if top >= 1e6 else (1e3, "thousands")
    color = {g.label: f"C{i % 10}" for i, g in enumerate(groups)}
    size = {g.label: len(g.runs) for g in groups}
    for ax, (metric, bands) in zip(axes.flat, panels.items()):
        for label, band in bands.items():
            x = band.x if x_key == "steps" else [v / scale for v in band.x]
            few = metric.startswith("eval_") or len(x) <= 30          # markers where points are few
            draw_band(ax, x, band, f"{label} ({size[label]} seed{'s' if size[label] > 1 else ''})",
                      color=color[label], marker="o" if few else None)
        ax.set_xlabel("step" if x_key == "steps" else f"generated tokens ({unit})")
        ax.set_ylabel(metric_label(metric))
        smoothed = smooth > 1 and not metric.startswith("eval_")
        ax.set_title(metric + (f" (trailing mean of {smooth} steps)" if smoothed else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    band_text = "min..max over seeds" if spread == "minmax" else "mean ± sd over seeds (sample, n-1)"
    interpolated = any(b.interpolated for bands in panels.values() for b in bands.values())
    fig.suptitle(f"line: mean over seeds; band: {band_text}"
                 + ("; seeds interpolated onto their common x range" if interpolated else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("out", metavar="OUT.png", help="the PNG to write")
    ap.add_argument("runs", nargs="*", metavar="RUN", help="run folders; <label>-s<seed> folders group by label")
    ap.add_argument("--group", action="append", default=[], metavar="LABEL=PATH[,PATH...]",
                    help="a method's runs (PATH may be a quoted glob pattern); repeat for each method")
    ap.add_argument("--x", default="steps", choices=("steps", "generated_tokens"), help="the x axis")
    ap.add_argument("--metrics", default=DEFAULT_METRICS,
                    help=f"metrics.jsonl keys, comma-separated, a panel each (reward = reward_mean; "
                         f"default {DEFAULT_METRICS})")
    ap.add_argument("--spread", default="minmax", choices=("minmax", "sd"),
                    help="the band: min..max over seeds, or mean ± sample sd")
    ap.add_argument("--smooth", type=int, default=1, metavar="N",
                    help="trailing mean over N steps of the training metrics (1: none)")
    return ap.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    try:
        if not args.out.lower().endswith(".png"):
            raise PlotError(f"{args.out}: expected a .png path")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise PlotError(f"{args.out}: folder {os.path.dirname(args.out)} does not exist")
        if args.smooth < 1:
            raise PlotError(f"--smooth {args.smooth}: expected an integer >= 1")
        groups = group_runs(args.runs, args.group)
        metrics = resolve_metrics(args.metrics, groups)
        panels = curves(groups, metrics, x_key=args.x, spread=args.spread, smooth=args.smooth)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise PlotError("matplotlib is not installed: pip install -r bench/requirements.txt") from None
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for metric, bands in panels.items():
        for g in groups:
            if g.label not in bands:
                print(f"note: {g.label} did not log {metric}: not in its panel")
    print("Final value of each run (its last logged one), mean ± sd over a method's runs:\n")
    print(final_table(groups, metrics))
    draw(panels, groups, args.out, x_key=args.x, spread=args.spread, smooth=args.smooth)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
