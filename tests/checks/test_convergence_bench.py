"""The convergence study's summary numbers (bench/convergence.py), on hand-made curves."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("convergence", os.path.join(ROOT, "bench", "convergence.py"))
convergence = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convergence)


def test_curve_auc_and_rollouts_to_threshold():
    # evals at steps 0, 10, 20 with 512 rollouts/step -> x = [0, 5120, 10240]
    rows = [{"step": 0, "eval_accuracy": 0.4}, {"step": 5, "reward_mean": 0.1},
            {"step": 10, "eval_accuracy": 0.6}, {"step": 20, "eval_accuracy": 0.8}]
    x, y = convergence.curve(rows, 512)
    assert x == [0, 5120, 10240] and y == [0.4, 0.6, 0.8]
    # trapezoids: 5120·(.4+.6)/2 + 5120·(.6+.8)/2 = 2560 + 3584 = 6144; / 10240 = .6
    assert abs(convergence.auc(x, y) - 0.6) < 1e-12
    assert convergence.rollouts_to(x, y, 0.7) == 10240 and convergence.rollouts_to(x, y, 0.4) == 0
    assert convergence.rollouts_to(x, y, 0.9) is None


def test_curve_reads_the_sampled_metric_when_asked():
    # K&K's study reads mean@4: the same eval rows, the other key; greedy stays the default
    rows = [{"step": 0, "eval_accuracy": 0.10, "eval_mean@4": 0.07}, {"step": 5, "reward_mean": 0.1},
            {"step": 10, "eval_accuracy": 0.10, "eval_mean@4": 0.09}]
    assert convergence.curve(rows, 128, "eval_mean@4") == ([0, 1280], [0.07, 0.09])
    assert convergence.curve(rows, 128) == ([0, 1280], [0.10, 0.10])
    assert convergence.metric_name("eval_mean@4") == "test mean@4 (sampled)"
    assert convergence.metric_name("eval_accuracy") == "greedy test accuracy"


def test_auto_metric_is_mean_at_k_when_logged_and_a_missing_key_exits_2(tmp_path, capsys):
    sampled, greedy = tmp_path / "a", tmp_path / "b"
    for out, row in ((sampled, {"step": 0, "eval_accuracy": 0.1, "eval_mean@4": 0.07}),
                     (greedy, {"step": 0, "eval_accuracy": 0.1})):
        out.mkdir()
        (out / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert convergence.resolve_metric("auto", [str(sampled)]) == "eval_mean@4"
    assert convergence.resolve_metric("auto", [str(greedy)]) == "eval_accuracy"
    with pytest.raises(SystemExit) as stop:       # one run without the key: named, exit 2
        convergence.resolve_metric("eval_mean@4", [str(sampled), str(greedy)])
    assert stop.value.code == 2 and f"not in {greedy}/metrics.jsonl" in capsys.readouterr().err


def test_results_block_is_replaced_between_markers(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmarks\n\nsampler table\n")
    convergence.write_results(str(path), "first")
    convergence.write_results(str(path), "side study", "side")
    convergence.write_results(str(path), "second")
    text = path.read_text()
    begin, _ = convergence.markers("convergence")
    assert text.count(begin) == 1 and "second" in text and "first" not in text and "side study" in text
    assert text.startswith("# Benchmarks\n\nsampler table\n")


def test_token_curve_reads_generated_tokens_at_evaluations():
    # evals at steps 0, 2, 4: step 0 has generated nothing; a run logged before the count has no curve
    rows = [{"step": 0, "eval_accuracy": 0.4}, {"step": 1, "generated_tokens": 100.0},
            {"step": 2, "generated_tokens": 250.0, "eval_accuracy": 0.5},
            {"step": 4, "generated_tokens": 600.0, "eval_accuracy": 0.7}]
    assert convergence.token_curve(rows) == [0.0, 250.0, 600.0]
    assert convergence.token_curve([{"step": 0, "eval_accuracy": 0.4}, {"step": 2, "eval_accuracy": 0.5}]) is None


def test_knights_task_defaults_and_per_size_columns(tmp_path):
    args = convergence.parse_args(["--task", "knights", "--seeds", "0,1"])
    assert args.folder == "configs/knights" and args.threshold == 0.09 and args.section == "convergence-knights"
    assert args.methods == "grpo,reinforce_pp,reinforce_pp_baseline,pspo"
    # two seeds of one method; final per-size accuracies 2ppl (0.5, 0.7), 3ppl (0.1, 0.1)
    outs = []
    for seed, (two, three) in enumerate([(0.5, 0.1), (0.7, 0.1)]):
        out = tmp_path / f"grpo-s{seed}"
        out.mkdir()
        (out / "config.yaml").write_text("train: {prompts_per_step: 2}\nrollout: {num_generations: 4}\n")
        rows = [{"step": 0, "eval_accuracy": 0.1, "eval_greedy_2ppl": 0.3, "eval_greedy_3ppl": 0.0},
                {"step": 1, "step_time_s": 1.0, "bookkeeping_s": 0.01},
                {"step": 2, "step_time_s": 1.0, "bookkeeping_s": 0.01, "eval_accuracy": 0.3,
                 "eval_greedy_2ppl": two, "eval_greedy_3ppl": three}]
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        outs.append(str(out))
    table, _ = convergence.summarize({"grpo": outs}, args)
    header, _, row = table.splitlines()
    assert header.endswith(" 2ppl | 3ppl |")
    # 2ppl: mean (0.5 + 0.7) / 2 = 0.6, sample sd sqrt(2 · 0.1² / 1) = 0.1414; 3ppl: 0.1 ± 0
    assert row.endswith(" 0.600 ± 0.141 | 0.100 ± 0.000 |")


def test_speedup_is_undefined_when_the_baseline_does_not_rise(tmp_path):
    # grpo ends at 0.05 below its step-0 0.06: its target is met at 0 rollouts, R_X would be 0/0
    runs = {}
    for method, final in (("grpo", 0.05), ("pspo", 0.07)):
        out = tmp_path / f"{method}-s0"
        out.mkdir()
        (out / "config.yaml").write_text("train: {prompts_per_step: 2}\nrollout: {num_generations: 4}\n")
        rows = [{"step": 0, "eval_accuracy": 0.06}, {"step": 1, "step_time_s": 1.0},
                {"step": 2, "step_time_s": 1.0, "eval_accuracy": final}]
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        runs[method] = [str(out)]
    fast = convergence.speedups(runs, "grpo")
    assert fast["_target"] == "0.050"
    assert fast["grpo"] == fast["pspo"] == ("undefined: grpo's final ≤ its step 0", "-")


def test_a_sweep_method_adds_its_own_overrides_after_the_shared_ones(tmp_path, monkeypatch, capsys):
    assert convergence.split_method("ers@ers.alpha=0.5@train.lr=1e-5") == ("ers", ["--ers.alpha=0.5", "--train.lr=1e-5"])
    assert convergence.split_method("grpo") == ("grpo", [])
    args = convergence.parse_args(["--out", str(tmp_path), "--", "--ers.alpha=0.9"])
    seen = []
    monkeypatch.setattr(convergence.subprocess, "run",
                        lambda cmd, **kw: seen.append(cmd) or type("P", (), {"returncode": 1, "stdout": "", "stderr": ""}))
    with pytest.raises(RuntimeError):
        convergence.run_one("ers@ers.alpha=0.1", 0, args, 1)
    cmd = seen[0]
    assert cmd[cmd.index("--config") + 1] == "configs/ers.yaml"
    assert cmd[-2:] == ["--ers.alpha=0.9", "--ers.alpha=0.1"]       # the method's own value comes last and wins
    assert f"--train.output_dir={tmp_path}/ers-ers.alpha=0.1-s0" in cmd
    for bad, why in (("nosuch@ers.alpha=0.1", "configs/nosuch.yaml does not exist"), ("ers@alpha", "preset@section.key=value")):
        with pytest.raises(SystemExit) as e:
            convergence.main(["--methods", bad, "--out", str(tmp_path)])
        assert e.value.code == 2 and why in capsys.readouterr().err
