"""The selection bench's measures (bench/selection.py) on hand-made runs, and the bench end to end on the tiny
model: its table's numbers recomputed from the runs' own logs."""
import importlib.util
import json
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("selection", os.path.join(ROOT, "bench", "selection.py"))
selection = importlib.util.module_from_spec(spec)
sys.modules["selection"] = selection              # its dataclasses look their module up by name
spec.loader.exec_module(selection)


def test_gini_hand_worked():
    # [0, 0, 1, 3]: Σ|c_i − c_j| over ordered pairs = 2·(1 + 3 + 1 + 3 + 2) = 20; 2·n²·mean = 2·16·1 = 32
    # -> 0.625    # (sorted formula: 2·(3·1 + 4·3)/(4·4) − 5/4 = 1.875 − 1.25 = 0.625)
    assert selection.gini([0, 3, 1, 0]) == pytest.approx(0.625, abs=1e-12)
    # one prompt takes all 4 draws of 4 prompts: 2·3·4 = 24 over 32 -> 0.75; equal counts, or none, -> 0
    assert selection.gini([0, 0, 0, 4]) == pytest.approx(0.75, abs=1e-12)
    assert selection.gini([2, 2, 2]) == 0.0 and selection.gini([0, 0]) == 0.0


def test_starvation_hand_worked():
    # 5 prompts, 4 steps ending at 100, 200, 300, 400 tokens: the last quarter (> 0.75 · 400 = 300) is step 4
    draws = [{"step": 1, "prompts": 5, "rows": [0, 1], "accuracy": [0.0, 0.5]},
             {"step": 2, "prompts": 5, "rows": [2, 3], "accuracy": [0.0, 1.0]},
             {"step": 3, "prompts": 5, "rows": [0, 2], "accuracy": [0.5, 0.0]},
             {"step": 4, "prompts": 5, "rows": [1, 3], "accuracy": [0.0, 0.25]}]
    s = selection.starvation(draws, {1: 100.0, 2: 200.0, 3: 300.0, 4: 400.0}, 400.0)
    # drawn in step 4: rows 1 and 3 -> 3 of 5 not drawn late = 0.6
    assert s.not_drawn_late == pytest.approx(0.6)
    # visits [2, 2, 2, 2, 0]: 2·(4 pairs x 2) = 16 over 2·25·1.6 = 80 -> 0.2
    assert s.gini == pytest.approx(0.2)
    # last visits: row 0 at 0.5, row 1 at 0 but in step 4 (retried late), row 2 at 0 in step 3 and never again,
    # row 3 at 0.25, row 4 never drawn -> only row 2: 1/5
    assert s.abandoned == pytest.approx(0.2)


def write_run(folder, evals, steps, draws=None, budget=2500.0, max_steps=100):
    """A finished run: metrics.jsonl (evals: {step: accuracy}; steps: [(tokens, zero_std_frac, adv_abs_mean)]),
    prompts.jsonl and the bench's stamp."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "eval_accuracy": evals[0]}]
    for step, (tokens, zero, adv) in enumerate(steps, start=1):
        row = {"step": step, "generated_tokens": tokens, "zero_std_frac": zero, "adv_abs_mean": adv}
        if step in evals:
            row["eval_accuracy"] = evals[step]
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    draws = draws or [{"step": s, "prompts": 2, "rows": [0, 1], "accuracy": [0.5, 0.5]}
                      for s in range(1, len(steps) + 1)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in draws))
    (folder / "bench_run.json").write_text(json.dumps({"command": [], "budget": budget, "max_steps": max_steps}))
    return str(folder)


def test_tokens_to_target_auc_and_the_step_means(tmp_path):
    # evaluations at 0, 1000 and 2500 tokens: 0.40, 0.60, 0.80. Target 0.70 is crossed between 1000 (0.60)
    # and 2500 (0.80): 1000 + 1500 · (0.70 − 0.60)/(0.80 − 0.60) = 1750 tokens.
    # AUC: 1000·(0.4 + 0.6)/2 + 1500·(0.6 + 0.8)/2 = 500 + 1050 = 1550, / 2500 = 0.62
    out = write_run(tmp_path / "a", {0: 0.40, 1: 0.60, 2: 0.80}, [(1000.0, 0.25, 0.5), (2500.0, 0.75, 0.7)])
    m = selection.measure(out, 0.70)
    assert m.to_target == pytest.approx(1750.0) and m.auc == pytest.approx(0.62)
    assert (m.final, m.tokens) == (0.80, 2500.0)
    # step means: zero_std_frac (0.25 + 0.75)/2 = 0.5, adv_abs_mean (0.5 + 0.7)/2 = 0.6
    assert m.zero_std == pytest.approx(0.5) and m.adv_abs == pytest.approx(0.6)
    assert selection.measure(out, 0.90).to_target is None
    assert selection.complete(out)


def test_table_is_mean_and_sd_over_seeds(tmp_path):
    # seed 0 ends at 0.80 after 3000 tokens and crosses 0.70 at 1000 + 2000 · 0.1/0.2 = 2000; seed 1 ends at
    # 0.60 after 2000 and never does. final: mean 0.70, sd sqrt(2 · 0.1² / 1) = 0.141; tokens (3000 + 2000)/2
    # -> 2.5k; to 0.70: 2.0k, reached by 1 of 2
    a = write_run(tmp_path / "m-s0", {0: 0.40, 1: 0.60, 2: 0.80}, [(1000.0, 0.2, 0.5), (3000.0, 0.2, 0.5)])
    b = write_run(tmp_path / "m-s1", {0: 0.40, 2: 0.60}, [(1000.0, 0.4, 0.5), (2000.0, 0.4, 0.5)])
    header, _, row = selection.table({"m": [a, b]}, 0.70).splitlines()
    assert header.startswith("| method | runs | final test acc | gen tokens | tokens to 0.70 | AUC |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["m", "2", "0.700 ± 0.141", "2.5k", "2.0k (1/2)"]
    assert cells[6] == "0.300 ± 0.141"               # zero-var groups: 0.2 and 0.4
    # a method without groups (Single-stream PO, G = 1) logs no zero_std_frac: its cell says so
    c = write_run(tmp_path / "one-s0", {0: 0.40, 1: 0.50}, [(1000.0, None, 0.5)])
    cells = [c.strip() for c in selection.table({"one": [c]}, 0.70).splitlines()[2].strip("|").split("|")]
    assert cells[6] == "n/a" and cells[7] == "0.500 ± 0.000"


def test_a_run_is_reused_only_when_complete_and_run_with_the_same_command(tmp_path):
    args = selection.parse_args(["--methods", "grpo,pspo@pps.uniform_mix=0.2", "--out", str(tmp_path),
                                 "--budget", "5000", "--", "--ers.alpha=0.9"])
    cmd = selection.command(args, "pspo@pps.uniform_mix=0.2", 1, 128)
    assert cmd[:3] == ["train.py", "--config", "configs/pspo.yaml"]
    assert "--train.max_generated_tokens=5000" in cmd and "--data.max_train_examples=128" in cmd
    assert "--optim.min_lr_ratio=1.0" in cmd and cmd[-2:] == ["--ers.alpha=0.9", "--pps.uniform_mix=0.2"]
    assert f"--train.output_dir={tmp_path}/n128/pspo-pps.uniform_mix=0.2-s1" in cmd
    assert "--data.max_train_examples=128" not in selection.command(args, "grpo", 1, 0)    # 0: the preset's set
    # stopped at 1,000 tokens short of a 2,500-token budget, and not at its step cap: not complete
    short = write_run(tmp_path / "short", {0: 0.4, 1: 0.5}, [(1000.0, 0.2, 0.5)], budget=2500.0, max_steps=100)
    capped = write_run(tmp_path / "capped", {0: 0.4, 1: 0.5}, [(1000.0, 0.2, 0.5)], budget=2500.0, max_steps=1)
    assert not selection.complete(short) and selection.complete(capped)
    assert not selection.complete(capped, ["train.py", "another command"])


@pytest.mark.parametrize("methods, why", [
    ("nosuch", "--methods: configs/nosuch.yaml does not exist"),
    ("grpo@alpha", "--methods: grpo@alpha: expected preset@section.key=value"),
    ("grpo@train.max_generated_tokens=-1", "--methods: grpo@train.max_generated_tokens=-1: "
                                           "train.max_generated_tokens: expected >= 0"),
])
def test_a_bad_method_is_one_line_before_any_run(methods, why, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        selection.main(["--methods", methods, "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith(f"error: {why}") and "\n" not in err
    assert not (tmp_path / "runs").exists()


def test_a_failed_run_stops_the_bench_with_its_exit_code_and_output(tmp_path, capsys):
    # `false` in place of python: the run "fails" at once with exit code 1 and prints nothing
    with pytest.raises(SystemExit) as e:
        selection.main(["--methods", "grpo", "--seeds", "0", "--train-sizes", "0", "--launch", "false",
                        "--out", str(tmp_path)])
    err = capsys.readouterr().err
    log = tmp_path / "all" / "grpo-s0" / "train.log"
    assert e.value.code == 1 and f"error: grpo seed 0 (all) failed with exit code 1 ({log}): train.py " in err
    assert log.read_text() == "" and not (tmp_path / "all" / "grpo-s0" / "bench_run.json").exists()


@pytest.fixture(scope="module")
def quick(tmp_path_factory, tiny_model_path):
    """The bench's --quick on GRPO and PPS, 48 train prompts (3 steps of 16 per pass), one seed; what it printed."""
    out = str(tmp_path_factory.mktemp("selection"))
    argv = ["--quick", "--methods", "grpo,pps", "--train-sizes", "48", "--out", out]
    printed = run_and_capture(argv)
    return out, argv, printed


def run_and_capture(argv):
    import contextlib
    import io
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        selection.main(argv)
    return buffer.getvalue()


def table_row(printed, method):
    row = next(line for line in printed.splitlines() if line.startswith(f"| {method} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def logs(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(folder, "prompts.jsonl")) as f:
        draws = [json.loads(line) for line in f]
    return rows, draws


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "pps"])
def test_quick_table_is_what_the_logs_say(quick, method):
    out, _, printed = quick
    rows, draws = logs(os.path.join(out, "n48", f"{method}-s0"))
    steps = [r for r in rows if r["step"] > 0]
    # the run stopped at the first step whose tokens reached the 4,000-token budget, and was evaluated there
    assert steps[-2]["generated_tokens"] < 4000 <= steps[-1]["generated_tokens"] and "eval_accuracy" in steps[-1]
    # prompts.jsonl: 16 prompts a step (PPS: distinct), and each step's groups average to its logged accuracy
    for r in steps:
        drawn = [d for d in draws if d["step"] == r["step"]]
        assert len(drawn) == 1 and len(drawn[0]["rows"]) == 16 and drawn[0]["prompts"] == 48
        assert statistics.mean(drawn[0]["accuracy"]) == pytest.approx(r["accuracy"], abs=1e-4)
    if method == "pps":
        assert all(len(set(d["rows"])) == 16 for d in draws)

    # the table's cells, recomputed here from the logs
    cells = table_row(printed, method)
    evals = [(0.0 if r["step"] == 0 else r["generated_tokens"], r["eval_accuracy"])
             for r in rows if "eval_accuracy" in r]
    total = steps[-1]["generated_tokens"]
    assert cells[1] == "1" and cells[2] == f"{evals[-1][1]:.3f} ± 0.000" and cells[3] == f"{total / 1000:.1f}k"
    hit = next((i for i, (_, y) in enumerate(evals) if y >= 0.5), None)
    if hit is None:
        assert cells[4] == "not reached (0/1)"
    else:
        (x0, y0), (x1, y1) = evals[max(hit - 1, 0)], evals[hit]
        x = x1 if hit == 0 else x0 + (x1 - x0) * (0.5 - y0) / (y1 - y0)
        assert cells[4] == f"{x / 1000:.1f}k (1/1)"
    area = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(evals, evals[1:]))
    assert cells[5] == f"{area / total:.3f} ± 0.000"
    assert cells[6] == f"{statistics.mean(r['zero_std_frac'] for r in steps):.3f} ± 0.000"
    assert cells[7] == f"{statistics.mean(r['adv_abs_mean'] for r in steps):.3f} ± 0.000"
    late_steps = {r["step"] for r in steps if r["generated_tokens"] > 0.75 * total}
    late = {q for d in draws if d["step"] in late_steps for q in d["rows"]}
    assert cells[8] == f"{(48 - len(late)) / 48:.3f} ± 0.000"
    visits = [sum(d["rows"].count(q) for d in draws) for q in range(48)]
    pairs = sum(abs(a - b) for a in visits for b in visits)               # Σ_i Σ_j |c_i − c_j|
    assert cells[9] == f"{pairs / (2 * 48 * sum(visits)):.3f} ± 0.000"    # / (2 n² mean) = / (2 n Σc)
    last = {}
    for d in draws:
        last.update(zip(d["rows"], d["accuracy"]))
    abandoned = [q for q, a in last.items() if a == 0 and q not in late]
    assert cells[10] == f"{len(abandoned) / 48:.3f} ± 0.000"
    if method == "grpo":
        # uniform epochs: the 16·S draws of S steps cover the 48 prompts evenly, k of them once more than the
        # rest; Gini = 2·k·(48 − k) pairs differing by 1 / (2 · 48 · 16·S) = k(48 − k)/(48 · 16S).
        # 4 steps: 64 draws, k = 16 -> 16·32/(48·64) = 1/6
        k, S = (16 * len(steps)) % 48, len(steps)
        assert max(visits) - min(visits) <= 1 and cells[9] == f"{k * (48 - k) / (48 * 16 * S):.3f} ± 0.000"


@pytest.mark.slow
def test_quick_reuses_complete_runs_and_summarises_them_alone(quick):
    out, argv, printed = quick
    stamps = {m: os.path.getmtime(os.path.join(out, "n48", f"{m}-s0", "bench_run.json")) for m in ("grpo", "pps")}
    again = run_and_capture(argv)                                    # every run complete: none is run again
    assert " seed 0: " not in again and table_row(again, "grpo") == table_row(printed, "grpo")
    assert stamps == {m: os.path.getmtime(os.path.join(out, "n48", f"{m}-s0", "bench_run.json")) for m in stamps}
    only = run_and_capture([*argv, "--summarise-only"])
    assert table_row(only, "pps") == table_row(printed, "pps")
    figure = os.path.join(out, "selection-n48.png")
    assert f"figure: {figure}" in printed or "not drawn, matplotlib is not installed" in printed


@pytest.mark.slow
def test_base_rate_is_the_first_steps_accuracy_over_the_train_set(tmp_path, tiny_model_path):
    # 24 train prompts (fewer than 512): one step draws all 24, G = 8, generated by the base model; the printed
    # rate is that step's logged accuracy, which is the mean of its groups' accuracies in prompts.jsonl (the rate
    # printed to 3 decimals, the groups' to 4: within 1e-3)
    printed = run_and_capture(["--base-rate", "grpo", "--out", str(tmp_path), "--",
                               f"--model.name_or_path={tiny_model_path}", "--data.max_train_examples=24"])
    rows, draws = logs(str(tmp_path / "base-rate-grpo"))
    assert [r["step"] for r in rows] == [1] and len(draws[0]["rows"]) == 24
    assert float(printed) == pytest.approx(statistics.fmean(draws[0]["accuracy"]), abs=1e-3)
    assert float(printed) == pytest.approx(rows[0]["accuracy"], abs=1e-3)


def test_the_gpu_protocol_command_in_docs_loads_every_method_in_both_recipes():
    # docs/gpu.md's one command for the GPU protocol: each of its methods (the random-reward control at a rate
    # the command measures, 0.2 here) loads in each recipe folder it loops over, with the bench's overrides
    import re
    text = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    block = text[text.index("for recipe in "):]
    block = block[:block.index("done")]
    recipes = re.search(r"for recipe in ([^;]+);", block).group(1).split()
    control = re.search(r"control=(\S+)", block).group(1).replace("$rate", "0.2")
    methods = re.search(r"--methods (\S+)", block).group(1).replace("$control", control)
    assert recipes == ["qwen2.5-math-1.5b", "llama-3.2-1b-instruct"] and "reward.kind=random" in methods
    for recipe in recipes:
        args = selection.parse_args(["--folder", f"configs/{recipe}", "--methods", methods, "--train-sizes", "0,64",
                                     "--engine", "auto", "--budget", "4e6"])
        assert len(args.methods) == 5                 # parse_args loaded each (check_methods): a refusal exits 2
