"""The GPU check (bench/gpu_check.py, scripts/gpu_check.sh): its dry run plans every section at an H100's
memory, it refuses a machine it cannot run on in one line, and its summary reads the figures the
sections write. The sections themselves run on a GPU only; `--small` rehearses them on CPU."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check                  # its dataclasses look their module up
spec.loader.exec_module(gpu_check)


def test_the_dry_run_plans_every_section_within_an_h100(capsys):
    names = [s.name for s in gpu_check.SECTIONS]
    assert gpu_check.dry_run(names, gpu_check.H100_GIB) == 0
    out = capsys.readouterr().out
    for name in names:
        assert f"[{name}]" in out
    assert "does not fit" not in out and "every plan fits on one GPU of 79.2 GiB" in out
    # every training section plans its own command's configuration, with the layers it builds
    assert "(4 layers): peak" in out                               # the 7B, truncated as built
    for s in gpu_check.SECTIONS:
        assert s.limit_s <= 540, "a section must fit one 10-minute call with margin"
    default = sum(s.limit_s for s in gpu_check.SECTIONS if s.default)
    assert default <= 45 * 60                   # the limits are ceilings; the default sections take ~20 min


def test_the_dry_run_catches_a_plan_that_does_not_fit(capsys):
    # the 7B at 4 layers plans 77.5 GiB: on a 40 GiB card it must be refused before anything runs
    assert gpu_check.dry_run(["rpp7b"], 40.0) == 1
    assert "1 plan(s) do not fit on one GPU of 40 GiB" in capsys.readouterr().out


def test_the_script_refuses_a_machine_without_a_gpu_in_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "/tmp/pspo-gpu-check-refused", "update"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]          # one line
    assert proc.stderr.startswith("gpu_check: no CUDA device") and "--small" in proc.stderr
    assert proc.stdout.startswith("environment: python")                       # what it saw, first
    assert not os.path.exists("/tmp/pspo-gpu-check-refused")                  # nothing written


def test_missing_packages_are_named_with_the_way_to_bring_them(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "NEEDS", gpu_check.NEEDS + ("no_such_package_xyz",))
    assert gpu_check.main([str(tmp_path / "out"), "prm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: missing Python packages no_such_package_xyz") and "docs/gpu.md#wheels" in err
    assert gpu_check.main(["--dry-run", "no_such_section"]) == 2


def test_the_summary_reads_what_the_sections_wrote(tmp_path):
    # an update section's two JSON files and a training section's metrics, as the children write them
    ctx = gpu_check.Context(out=str(tmp_path), models="M", runs="R", small=False)
    mode = {"micro_batches": 3, "padded_share": 0.38, "update_s": 4.0, "real_tokens_per_s": 20000.0,
            "mfu": 0.123, "peak_allocated_gib": 30.0, "peak_reserved_gib": 35.0}
    profile = {"gemm": 0.5, "gemm_fp32": 0.0, "attention": 0.2, "elementwise": 0.1, "other": 0.1, "idle": 0.1,
               "attention_backend": "cudnn"}
    for tag, budget in (("-ckpt", 36864), ("-nockpt", 4096)):
        (tmp_path / f"update{tag}.json").write_text(json.dumps(
            {"budget": budget, "modes": {"packed": mode}, "profile": profile if tag == "-ckpt" else {}}))
    (tmp_path / "recipe.metrics.jsonl").write_text(
        json.dumps({"step": 0, "eval_accuracy": 0.0}) + "\n"
        + json.dumps({"step": 1, "step_time_s": 30.0, "gen_s": 20.0, "advantages_s": 1.0, "update_s": 4.0,
                      "peak_mem_gib": 34.6, "peak_reserved_gib": 43.0}) + "\n")
    ctx.summary = {"env": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_gib": 79.2, "torch": "2.11.0", "cuda": "13.0",
                           "transformers": "5.17.0", "date": "2026-11-26", "commit": "abc1234"},
                   "smoke": None, "sections": {}, "not_measured": ["vllm: vLLM is not installed"]}
    for name in ("update", "recipe"):
        ctx.summary["sections"][name] = {"status": "ok", "seconds": 10.0,
                                         "figures": gpu_check.figures(gpu_check.BY_NAME[name], ctx)}
    gpu_check.write_summary(ctx)
    md = (tmp_path / "summary.md").read_text()
    assert "12.3% / 20,000 / 4.00 / 0.38 / 30.0, 35.0" in md                   # MFU / tok/s / s / padded / peaks
    assert "attention (cudnn)" in md and "50% / 20% / 10% / 10% / 10%" in md
    assert "30.0 / 20.0 / 1.0 / 4.0; 34.6, 43.0" in md                          # the step split and peaks
    assert "- vllm: vLLM is not installed" in md
    assert json.loads((tmp_path / "summary.json").read_text())["sections"]["recipe"]["figures"]["eval"] == \
        [{"step": 0, "eval_accuracy": 0.0}]


@pytest.mark.slow
def test_the_small_rehearsal_runs_the_bench_sections(tmp_path):
    """--small: the update section at CPU stand-in widths, end to end: the model built once, the children
    run, their figures read into the summary, the models removed (the other sections' figures are read by
    test_the_summary_reads_what_the_sections_wrote; decode's transformers static-cache loop is
    tests/components/test_decode.py's)."""
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--small", str(tmp_path / "out"), "update",
                           "--models", str(tmp_path / "models")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {n: s["status"] for n, s in summary["sections"].items()} == {"update": "ok"}
    modes = summary["sections"]["update"]["figures"]["checkpointing"]["modes"]
    assert set(modes) == {"token budget", "packed"} and modes["packed"]["padded_share"] == 0
    assert not os.path.exists(tmp_path / "models")                           # the models are removed


def test_calls_into_one_out_add_up(tmp_path, monkeypatch):
    # a check split over two calls: the second call's summary keeps the first call's sections
    (tmp_path / "summary.json").write_text(json.dumps({"sections": {"update": {"status": "ok", "seconds": 1.0,
                                                                              "figures": {}}},
                                                       "not_measured": ["decode: timed out"]}))
    monkeypatch.setattr(gpu_check, "run_section", lambda section, ctx, gib: ctx.summary["sections"].update(
        {section.name: {"status": "ok", "seconds": 2.0, "figures": {}}}))
    assert gpu_check.main([str(tmp_path), "decode", "--small", "--models", str(tmp_path / "m")]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["sections"]) == {"update", "decode"} and "decode: timed out" not in summary["not_measured"]
