"""bench/plot_runs.py: the means, bands and final values it draws and prints, on hand-made metrics.jsonl
files, and its one-line errors."""
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("plot_runs", os.path.join(ROOT, "bench", "plot_runs.py"))
plot_runs = importlib.util.module_from_spec(spec)
sys.modules["plot_runs"] = plot_runs              # its dataclasses look their module up by name
spec.loader.exec_module(plot_runs)


def write_run(folder, rows) -> str:
    """A run folder whose metrics.jsonl holds `rows` (dicts, one JSON line each; a str: the file's text)."""
    os.makedirs(folder, exist_ok=True)
    text = rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write(text)
    return str(folder)


# Two seeds of grpo and one of pspo: step 0 is the evaluation before training; pspo's accuracy is null
# (non-finite) at step 1.
RUNS = {
    "grpo-s0": [{"step": 0, "eval_accuracy": 0.2},
                {"step": 1, "reward_mean": 0.1, "accuracy": 0.1, "generated_tokens": 100.0},
                {"step": 2, "reward_mean": 0.3, "accuracy": 0.3, "generated_tokens": 250.0, "eval_accuracy": 0.4}],
    "grpo-s1": [{"step": 0, "eval_accuracy": 0.4},
                {"step": 1, "reward_mean": 0.3, "accuracy": 0.2, "generated_tokens": 120.0},
                {"step": 2, "reward_mean": 0.5, "accuracy": 0.6, "generated_tokens": 300.0, "eval_accuracy": 0.6}],
    "pspo-s0": [{"step": 0, "eval_accuracy": 0.3},
                {"step": 1, "reward_mean": 0.2, "accuracy": None, "generated_tokens": 90.0},
                {"step": 2, "reward_mean": 0.4, "accuracy": 0.4, "generated_tokens": 200.0, "eval_accuracy": 0.5}],
}


@pytest.fixture
def runs(tmp_path):
    return [write_run(tmp_path / name, rows) for name, rows in RUNS.items()]


def close(a, b):
    return len(a) == len(b) and all(abs(x - y) < 1e-9 for x, y in zip(a, b))


def test_seeds_logged_at_the_same_x_combine_point_by_point():
    # three seeds at x = 1, 2: x=1 -> .2 .4 .6, mean .4, sample var (.04 + 0 + .04) / 2 = .04, sd .2;
    #                          x=2 -> .4 .8 .6, mean .6, sample var (.04 + .04 + 0) / 2 = .04, sd .2
    xs, ys = [[1, 2]] * 3, [[0.2, 0.4], [0.4, 0.8], [0.6, 0.6]]
    band = plot_runs.combine(xs, ys, "minmax")
    assert band.x == [1, 2] and not band.interpolated
    assert close(band.mean, [0.4, 0.6]) and close(band.lo, [0.2, 0.4]) and close(band.hi, [0.6, 0.8])
    band = plot_runs.combine(xs, ys, "sd")
    assert close(band.mean, [0.4, 0.6]) and close(band.lo, [0.2, 0.4]) and close(band.hi, [0.6, 0.8])
    one = plot_runs.combine([[1, 2]], [[0.2, 0.4]], "sd")        # one seed: no spread
    assert close(one.lo, [0.2, 0.4]) and close(one.hi, [0.2, 0.4])


def test_seeds_at_different_x_are_interpolated_onto_their_common_range():
    # A: (0, 0) (100, .5) (300, .9); B: (0, .2) (200, .6) (250, .7). Common range [0, 250] (B ends there;
    # A's 300 is left out), grid = union [0, 100, 200, 250].
    # A at 200: .5 + .4·100/200 = .7; at 250: .5 + .4·150/200 = .8.  B at 100: .2 + .4·100/200 = .4.
    # means (0+.2)/2 = .1, (.5+.4)/2 = .45, (.7+.6)/2 = .65, (.8+.7)/2 = .75
    band = plot_runs.combine([[0, 100, 300], [0, 200, 250]], [[0.0, 0.5, 0.9], [0.2, 0.6, 0.7]])
    assert band.interpolated and band.x == [0, 100, 200, 250]
    assert close(band.mean, [0.1, 0.45, 0.65, 0.75])
    assert close(band.lo, [0.0, 0.4, 0.6, 0.7]) and close(band.hi, [0.2, 0.5, 0.7, 0.8])
    with pytest.raises(ValueError, match="do not overlap"):
        plot_runs.combine([[0, 10], [20, 30]], [[0, 1], [0, 1]])


def test_interpolation_at_and_between_points():
    # between: 1 + (3-1)·(5-0)/(10-0) = 2; at a repeated x the later point wins; the ends as logged
    assert close(plot_runs.interpolate([0, 5, 10, 20], [0, 10, 10, 20], [1, 3, 4, 6]), [1, 2, 4, 6])


def test_trailing_mean():
    # n=2: 1, (1+3)/2, (3+5)/2, (5+7)/2;  n=3: 1, 2, (1+3+5)/3, (3+5+7)/3
    assert plot_runs.trailing_mean([1, 3, 5, 7], 2) == [1, 2, 4, 6]
    assert plot_runs.trailing_mean([1, 3, 5, 7], 3) == [1, 2, 3, 5]
    assert plot_runs.trailing_mean([1, 3, 5, 7], 1) == [1, 3, 5, 7]


def test_folders_group_by_their_seed_suffix_and_group_labels_come_first(tmp_path):
    for name in ("grpo-s0", "pspo_seed1", "grpo-s1", "single", "x/a", "x/b"):
        write_run(tmp_path / name, [{"step": 0, "eval_accuracy": 0.1}])
    groups = plot_runs.group_runs([str(tmp_path / n) for n in ("grpo-s0", "pspo_seed1", "grpo-s1", "single")],
                                  [f"mine={tmp_path}/x/*"])
    assert [(g.label, [os.path.basename(r.folder) for r in g.runs]) for g in groups] == [
        ("mine", ["a", "b"]), ("grpo", ["grpo-s0", "grpo-s1"]), ("pspo", ["pspo_seed1"]), ("single", ["single"])]


def test_curves_against_steps_and_generated_tokens(runs):
    groups = plot_runs.group_runs(runs, [])
    metrics = plot_runs.resolve_metrics("reward,accuracy,eval_accuracy", groups)
    assert metrics == ["reward_mean", "accuracy", "eval_accuracy"]
    steps = plot_runs.curves(groups, metrics)
    # grpo reward: step 1 -> .1 .3 (mean .2), step 2 -> .3 .5 (mean .4)
    grpo = steps["reward_mean"]["grpo"]
    assert grpo.x == [1, 2] and close(grpo.mean, [0.2, 0.4])
    assert close(grpo.lo, [0.1, 0.3]) and close(grpo.hi, [0.3, 0.5])
    # eval at its own steps, 0 included: (.2 + .4)/2 = .3, (.4 + .6)/2 = .5
    ev = steps["eval_accuracy"]["grpo"]
    assert ev.x == [0, 2] and close(ev.mean, [0.3, 0.5])
    assert steps["accuracy"]["pspo"].x == [2]                 # the null at step 1 is left out
    tokens = plot_runs.curves(groups, metrics, x_key="generated_tokens")
    # eval against tokens: s0 (0, .2) (250, .4); s1 (0, .4) (300, .6); common range [0, 250];
    # s1 at 250: .4 + .2·250/300 = .56667; mean (.4 + .56667)/2 = .48333
    ev = tokens["eval_accuracy"]["grpo"]
    assert ev.interpolated and ev.x == [0, 250]
    assert close(ev.mean, [0.3, 0.48333333333333334]) and close(ev.hi, [0.4, 0.5666666666666667])
    # reward against tokens: s0 (100, .1) (250, .3); s1 (120, .3) (300, .5); range [120, 250], grid 120, 250
    # s0 at 120: .1 + .2·20/150 = .12667; s1 at 250: .3 + .2·130/180 = .44444 -> means .21333, .37222
    rw = tokens["reward_mean"]["grpo"]
    assert rw.x == [120, 250] and close(rw.mean, [0.21333333333333335, 0.37222222222222223])


def test_smoothing_leaves_the_evaluations_as_logged(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.0}] + [
        {"step": s, "reward_mean": r, "eval_accuracy": e} for s, r, e in ((1, 1.0, 0.1), (2, 3.0, 0.5), (3, 5.0, 0.3))]
    groups = plot_runs.group_runs([write_run(tmp_path / "a", rows)], [])
    out = plot_runs.curves(groups, ["reward_mean", "eval_accuracy"], smooth=2)
    assert out["reward_mean"]["a"].mean == [1.0, 2.0, 4.0]      # 1, (1+3)/2, (3+5)/2
    assert out["eval_accuracy"]["a"].mean == [0.0, 0.1, 0.5, 0.3]


def test_table_and_png(runs, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (bench/requirements.txt) draws the PNG")
    out = tmp_path / "runs.png"
    plot_runs.main([str(out), *runs, "--x", "generated_tokens", "--spread", "sd"])
    text = capsys.readouterr().out
    # grpo finals: reward .3 .5 -> .400 ± sqrt(2·.1²/1) = .141; accuracy .3 .6 -> .450 ± sqrt(2·.15²) = .212;
    # eval .4 .6 -> .500 ± .141; tokens (250 + 300)/2 = 275 -> 0.3k. pspo: one run, sd 0.
    assert "| method | runs | last step | generated tokens | reward_mean | accuracy | eval_accuracy |" in text
    assert "| grpo | 2 | 2 | 0.3k | 0.400 ± 0.141 | 0.450 ± 0.212 | 0.500 ± 0.141 |" in text
    assert "| pspo | 1 | 2 | 0.2k | 0.400 ± 0.000 | 0.400 ± 0.000 | 0.500 ± 0.000 |" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_method_without_a_metric_is_noted_and_left_out_of_its_panel(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (bench/requirements.txt) draws the PNG")
    a = write_run(tmp_path / "a", [{"step": 0, "eval_accuracy": 0.1, "eval_mean@4": 0.2}])
    b = write_run(tmp_path / "b", [{"step": 0, "eval_accuracy": 0.3}])
    plot_runs.main([str(tmp_path / "p.png"), a, b, "--metrics", "eval_accuracy,eval_mean@4"])
    text = capsys.readouterr().out
    assert "note: b did not log eval_mean@4: not in its panel" in text
    assert "| b | 1 | 0 | - | 0.300 ± 0.000 | - |" in text


BAD = [  # (runs: name -> rows, extra arguments, what the one line says; {d} = the runs' folder)
    ({}, ["{d}/nosuch"], "{d}/nosuch: no such folder"),
    ({"empty/": None}, ["{d}/empty"], "{d}/empty/metrics.jsonl: no such file"),
    ({"a": "\n\n"}, ["{d}/a"], "{d}/a/metrics.jsonl: no rows"),
    ({"a": '{"step": 0}\n{"step": 1, "reward_mean": 0.1\n'}, ["{d}/a"], "{d}/a/metrics.jsonl:2: not JSON"),
    ({"a": '[1, 2]\n'}, ["{d}/a"], "{d}/a/metrics.jsonl:1: expected a JSON object with an integer \"step\""),
    ({"a": [{"step": 2}, {"step": 1}]}, ["{d}/a"], "{d}/a/metrics.jsonl:2: step 1 after step 2"),
    ({"a": [{"step": 0, "eval_accuracy": 0.1}]}, ["{d}/a", "--metrics", "eval_accuracy,eval_mean@4"],
     "--metrics: eval_mean@4 is logged by none of the 1 runs (they log: eval_accuracy)"),
    ({"a": [{"step": 1, "reward_mean": "high"}]}, ["{d}/a", "--metrics", "reward"],
     "{d}/a/metrics.jsonl:1: reward_mean: expected a number or null, got 'high'"),
    ({"g-s0": [{"step": 0, "eval_accuracy": 0.1}], "g-s1": [{"step": 1, "reward_mean": 0.1}]},
     ["{d}/g-s0", "{d}/g-s1", "--metrics", "eval_accuracy"],
     "eval_accuracy: logged by {d}/g-s0/metrics.jsonl but not by {d}/g-s1/metrics.jsonl ('g')"),
    ({"a": [{"step": 1, "reward_mean": 0.1}]}, ["{d}/a", "--metrics", "reward", "--x", "generated_tokens"],
     "{d}/a/metrics.jsonl:1: no generated_tokens number at step 1"),
    ({"x/g-s0": [{"step": 0}], "y/g-s0": [{"step": 0}]}, ["{d}/x/g-s0", "{d}/y/g-s0"],
     "{d}/x/g-s0 and {d}/y/g-s0 are both 'g' seed 0: name the methods with --group"),
    ({"a": [{"step": 0}]}, ["{d}/a", "--group", "G={d}/a"], "{d}/a: given twice"),
    ({}, ["--group", "G"], "--group G: expected LABEL=PATH[,PATH...]"),
    ({}, ["--group", "G={d}/none-*"], "--group G: {d}/none-* matches no folder"),
    ({}, [], "no runs: give RUN folders or --group LABEL=PATH,..."),
    ({"a": [{"step": 1, "reward_mean": 0.1}]}, ["{d}/a", "--metrics", "reward", "--smooth", "0"],
     "--smooth 0: expected an integer >= 1"),
]


@pytest.mark.parametrize("files, argv, message", BAD, ids=[m.split(":")[-1].strip()[:40] for _, _, m in BAD])
def test_bad_input_is_one_line_and_exit_2(files, argv, message, tmp_path, capsys):
    for name, rows in files.items():
        if rows is None:
            os.makedirs(tmp_path / name)
        else:
            write_run(tmp_path / name, rows)
    argv = [a.format(d=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as stop:
        plot_runs.main([str(tmp_path / "out.png"), *argv])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message.format(d=tmp_path) in err


def test_the_output_path_is_checked(runs, tmp_path, capsys):
    for out, message in ((tmp_path / "plot.pdf", "expected a .png path"),
                         (tmp_path / "no" / "p.png", "does not exist")):
        with pytest.raises(SystemExit) as stop:
            plot_runs.main([str(out), *runs])
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_without_matplotlib_it_says_how_to_install_it(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as stop:
        plot_runs.main([str(tmp_path / "p.png"), *runs])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert err == "error: matplotlib is not installed: pip install -r bench/requirements.txt\n"
