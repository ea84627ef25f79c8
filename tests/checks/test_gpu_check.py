"""The GPU check (bench/gpu_check.py, scripts/gpu_check.sh, bench/child_process.py): its default run fits
one lent GPU's 8-minute command with every section's cold estimate within its limit, the loop under test
before what it is compared with, a slow model build waited for by each section until its own deadline;
its dry run plans every section at an H100's memory, it refuses a machine it cannot run on in one line,
a section's processes all stop with it, one section's failure leaves the others running, and its summary
reads the figures the sections write. The sections themselves run on a
GPU only; `--small` rehearses them on CPU."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check                  # its dataclasses look their module up
spec.loader.exec_module(gpu_check)
from bench import child_process  # noqa: E402
from bench.micro_batches import peak_tflops  # noqa: E402


def running(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet collected, does not)."""
    return pid in child_process.process_table()


# ---- the time budget -----------------------------------------------------------------------------

def test_the_default_run_fits_one_gpu_slot(capsys):
    """The dry run prints the budget of the default run (the wheels, the start, the build beside the smoke
    test, each section's cold estimate, limit and margin) and it is at most 8 minutes; the headline sections
    run in priority order. The command line `bench/gpu_check.py --dry-run`, in this process: a dry run starts
    nothing and sets nothing up (main returns before the environment is read)."""
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    total = int(re.search(r"in all (\d+) s: fits in 8 minutes \(480 s\)", out).group(1))
    assert total <= 480 and total == gpu_check.budget_s(gpu_check.DEFAULT)
    assert gpu_check.DEFAULT == ["smoke", "numerics", "update", "decode", "recipe", "trl"]
    rows = re.findall(r"^\| ([^|]+) \| (-|\d+) \| (\d+) \| (-|-?\d+) \| (\d+) \|$", out, re.M)
    table = {step.strip(): (cold, int(limit), margin, int(end)) for step, cold, limit, margin, end in rows}
    assert list(table)[:3] == ["wheels: pip install --no-index --target (docs/gpu.md#wheels)",
                               "start-up: Python, torch, the environment", "build qwen15 (in the background)"]
    assert list(table)[3:9] == gpu_check.DEFAULT and rows[-1][4] == str(total)
    # each estimated step: its margin printed is its limit less its cold estimate, and none is negative
    for step in [gpu_check.BUILD_STEP] + gpu_check.DEFAULT:
        cold, limit, margin, _ = table[step]
        assert int(margin) == limit - int(cold) >= 0, step
    assert "every estimate within its limit: the smallest margin 5 s" in out
    # the sections that load the model start after the build's slot: build 36 s from the start-up's end
    ends = {step: end for step, (_, _, _, end) in table.items()}
    assert ends["numerics"] == ends["build qwen15 (in the background)"] + gpu_check.BY_NAME["numerics"].limit_s
    for name in gpu_check.DEFAULT:
        s = gpu_check.BY_NAME[name]
        assert f"[{name}] default, limit {s.limit_s} s (cold estimate {s.cold_s} s, margin " in out
        assert "sized from:" in out
    assert "every plan fits on one GPU of 79.2 GiB" in out


def test_every_default_section_holds_its_cold_estimate_with_a_margin():
    # a bare machine, compile caches cold: each default section's estimate (its parts in `estimate`, whose
    # sum is cold_s) fits its limit with at least 5 s to spare, so that every headline figure is written;
    # the build's slot too, and the smoke test beside the build ends within the build's slot
    for name in gpu_check.DEFAULT:
        s = gpu_check.BY_NAME[name]
        assert s.cold_s is not None and f"{s.cold_s} s" in s.estimate, name      # the text states the sum
        assert s.limit_s - s.cold_s >= 5, f"{name}: limit {s.limit_s} s, cold estimate {s.cold_s} s"
    assert gpu_check.BUILD_S - gpu_check.BUILD_COLD_S >= 5
    assert gpu_check.BY_NAME["smoke"].limit_s <= gpu_check.BUILD_S
    # the margins as the schedule gives them: 6 (build), 15 (smoke), 6, 6, 7, 7, 5
    margins = {slot.step: slot.margin_s for slot in gpu_check.schedule(gpu_check.DEFAULT)}
    assert [margins[n] for n in [gpu_check.BUILD_STEP] + gpu_check.DEFAULT] == [6, 15, 6, 6, 7, 7, 5]
    assert margins["start-up: Python, torch, the environment"] is None and margins["stop, last summary"] is None


def test_the_loop_under_test_runs_before_what_it_is_compared_with():
    # decode: the engine's length-aware loop (static) first, so a section cut short keeps its figures, then
    # the whole-cache loop it replaced (static-full), whose first call is cut to its one shape's compile;
    # the recipe's train.py before TRL's
    ctx = gpu_check.Context(out="OUT", models="M", runs="R", small=False)
    argv = gpu_check.commands(gpu_check.BY_NAME["decode"], ctx)[0].argv
    engines = argv[argv.index("--engines") + 1:argv.index("--engines") + 3]
    assert engines == ["static", "static-full"] and argv[argv.index("--engines") + 3].startswith("--")
    assert argv[argv.index("--warmup-tokens") + 1] == "32" and argv[argv.index("--repeats") + 1] == "1"
    assert argv[argv.index("--max-new-tokens") + 1] == "3584" and argv[argv.index("--cache-len") + 1] == "4096"
    assert gpu_check.DEFAULT.index("recipe") < gpu_check.DEFAULT.index("trl")


def test_the_docs_device_command_gives_the_check_its_budget():
    # docs/gpu.md's one command on a lent GPU: the wheels' install, then the check under `timeout` of the slot
    # less the wheels (480 - 10 = 470 s), which is at least the check's own budget (475 - 10 = 465 s), so that
    # the check ends itself and writes its summary before `timeout` would stop it
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        docs = f.read()
    timeout = gpu_check.COMMAND_TIMEOUT_S
    assert timeout == gpu_check.SLOT_S - gpu_check.WHEELS_S == 470
    assert f"timeout -k 10 {timeout} bash scripts/gpu_check.sh /tmp/gc" in docs
    assert re.findall(r"timeout -k \d+ (\d+) bash scripts/gpu_check.sh", docs) == [str(timeout)]
    assert gpu_check.budget_s(gpu_check.DEFAULT) - gpu_check.WHEELS_S <= timeout


def test_the_docs_budget_table_is_the_dry_runs(capsys):
    # docs/gpu.md's table of the default run: the same estimates, limits, margins and ends, in the same order
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        docs = f.read()
    section = docs[docs.index("**The budget** of the default run"):docs.index("**The estimates.**")]
    number = r"(-|-?\d+)"
    documented = re.findall(rf"^\| [^|]+ \| {number} \| {number} \| {number} \| {number} \|$", section, re.M)
    gpu_check.dry_run(gpu_check.DEFAULT, gpu_check.H100_GIB)
    printed = re.findall(rf"^\| [^|]+ \| {number} \| {number} \| {number} \| {number} \|$",
                         capsys.readouterr().out, re.M)
    assert documented == printed and len(printed) == 10


def test_a_budget_over_8_minutes_says_so(monkeypatch, capsys):
    # the wheels 10 + the start-up 8 + the build's slot 36 (the smoke test's 35 beside it) + numerics 30 +
    # update 67 + decode 146 + recipe 116 + trl 55 + the stop 7 = 475; one more minute for the update makes 535
    assert gpu_check.budget_s(gpu_check.DEFAULT) == 475
    slow = gpu_check.dataclasses.replace(gpu_check.BY_NAME["update"], limit_s=127)
    monkeypatch.setitem(gpu_check.BY_NAME, "update", slow)
    assert gpu_check.budget_s(gpu_check.DEFAULT) == 535
    gpu_check.dry_run(["update"], gpu_check.H100_GIB)
    out = capsys.readouterr().out
    assert "in all 188 s: fits" in out                              # 10 + 8 + 36 + 127 + 7, alone
    assert "| update | 61 | 127 | 66 | 181 |" in out                 # estimate, limit, margin, ends by 10 + 8 + 36 + 127
    monkeypatch.setattr(gpu_check, "plan_case", lambda case, gib: (1.0, True, "fits"))
    gpu_check.dry_run(gpu_check.DEFAULT, gpu_check.H100_GIB)
    assert "in all 535 s: does NOT fit in 8 minutes" in capsys.readouterr().out
    # an estimate over its limit is said with the section and by how much: decode's 139 s in 130 s
    monkeypatch.setitem(gpu_check.BY_NAME, "decode", gpu_check.dataclasses.replace(gpu_check.BY_NAME["decode"],
                                                                                   limit_s=130))
    gpu_check.dry_run(["decode"], gpu_check.H100_GIB)
    out = capsys.readouterr().out
    assert "| decode | 139 | 130 | -9 |" in out and "estimates over their limit: decode (-9 s)" in out


def test_the_dry_run_plans_every_section_within_an_h100(capsys):
    names = [s.name for s in gpu_check.SECTIONS]
    assert gpu_check.dry_run(names, gpu_check.H100_GIB) == 0
    out = capsys.readouterr().out
    for name in names:
        assert f"[{name}]" in out
    assert "does not fit" not in out and "every plan fits on one GPU of 79.2 GiB" in out
    assert "(4 layers): peak" in out                               # the 7B, truncated as built
    assert "torch.distributed.run" not in out and "torchrun" not in out   # one process: nothing escapes
    for s in gpu_check.SECTIONS:
        assert s.limit_s <= 540, "a section must fit one 10-minute call with margin"


def test_the_dry_run_catches_a_plan_that_does_not_fit(capsys):
    # the 7B at 4 layers plans 76.5 GiB: on a 40 GiB card it must be refused before anything runs
    assert gpu_check.dry_run(["rpp7b"], 40.0) == 1
    assert "1 plan(s) do not fit on one GPU of 40 GiB" in capsys.readouterr().out


# ---- what the check needs ------------------------------------------------------------------------

def test_the_script_refuses_a_machine_without_a_gpu_in_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "/tmp/pspo-gpu-check-refused", "update"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]          # one line
    assert proc.stderr.startswith("gpu_check: no CUDA device") and "--small" in proc.stderr
    assert proc.stdout.startswith("environment: python")                       # what it saw, first
    assert not os.path.exists("/tmp/pspo-gpu-check-refused")                  # nothing written


def test_missing_core_packages_are_named_with_the_way_to_bring_them(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "CORE", gpu_check.CORE + ("no_such_package_xyz",))
    assert gpu_check.main([str(tmp_path / "out"), "prm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: missing Python packages no_such_package_xyz") and "docs/gpu.md#wheels" in err
    assert gpu_check.main(["--dry-run", "no_such_section"]) == 2


def test_each_section_names_its_own_packages():
    # peft is lora's alone: without it the check starts and only lora is skipped
    assert "peft" not in gpu_check.CORE
    assert [s.name for s in gpu_check.SECTIONS if "peft" in s.needs] == ["lora"]
    assert "accelerate" in gpu_check.BY_NAME["lora"].needs            # peft imports it when it is imported
    assert {"trl", "accelerate"} <= set(gpu_check.BY_NAME["trl"].needs)
    assert "vllm" in gpu_check.BY_NAME["vllm"].needs
    assert gpu_check.BY_NAME["numerics"].needs == () and gpu_check.BY_NAME["update"].needs == ()


def test_a_section_missing_its_package_is_skipped_and_the_next_runs(tmp_path, monkeypatch):
    lacking = gpu_check.Section("lacking", "needs a package that is not there", 30, True,
                                needs=("no_such_package_xyz",))
    fine = gpu_check.Section("fine", "runs", 30, True)
    ctx = small_context(tmp_path, monkeypatch, {"fine": [sys.executable, "-c", "print('fine ran')"]})
    for s in (lacking, fine):
        gpu_check.run_section(s, ctx, 79.2, 30, None)
    sections = json.loads((tmp_path / "summary.json").read_text())["sections"]
    assert sections["lacking"]["status"] == "skipped: needs no_such_package_xyz (docs/gpu.md#wheels)"
    assert sections["fine"]["status"] == "ok" and "fine ran" in (tmp_path / "fine.log").read_text()


def test_versions_are_read_without_importing_the_package(tmp_path, monkeypatch):
    # a package whose import fails (as a broken vLLM install does) still has a version, and the
    # environment is read without importing vLLM
    site = tmp_path / "site"
    (site / "brokenpkg").mkdir(parents=True)
    (site / "brokenpkg" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    (site / "brokenpkg-1.2.3.dist-info").mkdir()
    (site / "brokenpkg-1.2.3.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\n"
                                                                 "Version: 1.2.3\n")
    monkeypatch.syspath_prepend(str(site))
    assert gpu_check.version("brokenpkg") == "1.2.3" and gpu_check.version("no-such-dist-xyz") is None
    vllm_before = "vllm" in sys.modules
    env = gpu_check.environment()
    assert ("vllm" in sys.modules) == vllm_before
    assert set(gpu_check.DISTRIBUTIONS) <= set(env) and env["transformers"]


def test_the_mfu_peak_by_card_name():
    # NVIDIA's datasheets list bf16 Tensor Core TFLOP/s with sparsity: dense is half (1,979 / 1,671 / 1,513)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 NVL") == 835.0 and peak_tflops("NVIDIA H200 NVL") == 835.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0 and peak_tflops("NVIDIA GH200 480GB") == 989.0


# ---- child processes -----------------------------------------------------------------------------

SPAWNER = textwrap.dedent("""
    import subprocess, sys, time
    # a grandchild under setsid, out of its parent's group (as torchrun starts its workers), then a line without its end
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print(f"grandchild {g.pid}", flush=True)
    sys.stdout.write("a partial line"); sys.stdout.flush()
    time.sleep(300)
""")


def grandchild(log: str) -> int:
    return int(log.rsplit("grandchild ", 1)[1].split()[0])


def test_a_timed_out_child_takes_every_process_it_started_down(tmp_path):
    """Past its limit, the child and its grandchild under setsid (which the child's process group does
    not reach) are stopped; the partial line (no newline, never finished) neither blocks the reader past
    the limit nor is lost."""
    log = tmp_path / "child.log"
    start = time.monotonic()
    with open(log, "w") as f:
        status = child_process.run_child([sys.executable, "-c", SPAWNER], f, 4.0, echo=False)
    elapsed = time.monotonic() - start
    text = log.read_text()
    pid = grandchild(text)
    try:
        assert status == "timed out" and elapsed < 4.0 + 2.5       # SIGTERM ends both at once, before the grace period
        assert not running(pid)
        assert "a partial line\n[killed: over its time limit]" in text and "stopped 2 process(es)" in text
    finally:
        if running(pid):
            os.kill(pid, 9)


def test_an_orphan_under_setsid_is_stopped_with_its_child(tmp_path):
    """A child that starts a process under setsid and exits at once leaves an orphan no parent link
    reaches: the check process, a subreaper (as `python bench/gpu_check.py` makes itself), gets it back
    and stops it. Run in a process of its own, so that this test process does not become a subreaper."""
    script = textwrap.dedent(f"""
        import io, sys
        sys.path.insert(0, {ROOT!r})
        from bench.child_process import become_subreaper, run_child, process_table
        assert become_subreaper()
        log = io.StringIO()
        status = run_child(["bash", "-c", "setsid sleep 300 & echo grandchild $!"], log, 20, echo=False)
        pid = int(log.getvalue().rsplit("grandchild ", 1)[1].split()[0])
        print(status, pid, pid in process_table())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    status, pid, alive = out.stdout.split()
    try:
        assert status == "ok" and alive == "False" and not running(int(pid))
    finally:
        if running(int(pid)):
            os.kill(int(pid), 9)


def test_the_check_becomes_its_descendants_subreaper_before_the_sections_run(tmp_path, monkeypatch):
    # `python bench/gpu_check.py OUT` (main): the subreaper first, then the sections, so that an orphan of
    # any section's children comes back to the check; a dry run starts no process and does not ask
    calls = []
    monkeypatch.setattr(gpu_check, "become_subreaper", lambda: calls.append("subreaper") or True)
    monkeypatch.setattr(gpu_check, "run_section", lambda section, *args: calls.append(section.name))
    assert gpu_check.main([str(tmp_path), "prm", "--small", "--models", str(tmp_path / "m")]) == 0
    assert calls == ["subreaper", "prm"]
    assert gpu_check.main(["--dry-run", "prm"]) == 0 and calls == ["subreaper", "prm"]


def test_done_ends_a_child_once_its_figures_are_in(tmp_path):
    # a child that would run for minutes (train.py saving its final checkpoint) ends as soon as done() says
    flag = tmp_path / "figures.json"
    child = f"import time, pathlib; pathlib.Path({str(flag)!r}).write_text('{{}}'); time.sleep(300)"
    start = time.monotonic()
    with open(tmp_path / "log", "w") as f:
        status = child_process.run_child([sys.executable, "-c", child], f, 60, done=flag.exists, echo=False)
    assert status == "ok" and time.monotonic() - start < 20
    assert "[stopped: its figures are in]" in (tmp_path / "log").read_text()


def test_child_exit_codes_are_reported(tmp_path):
    with open(tmp_path / "log", "w") as f:
        assert child_process.run_child([sys.executable, "-c", "import sys; sys.exit(3)"], f, 30, echo=False) \
            == "exit 3"
        assert child_process.run_child([sys.executable, "-c", "print('x' * 100000)"], f, 30, echo=False) == "ok"
    assert "x" * 100000 in (tmp_path / "log").read_text()            # a line longer than one read, whole


# ---- sections and the summary --------------------------------------------------------------------

def small_context(tmp_path, monkeypatch, argvs: dict[str, list[str]]):
    """A Context whose sections run the given commands (by name), its summary as main starts it."""
    ctx = gpu_check.Context(out=str(tmp_path), models=str(tmp_path / "m"), runs=str(tmp_path / "r"), small=True)
    ctx.summary = gpu_check.merged(str(tmp_path), list(argvs), {"gpu": None, "torch": "t"})
    os.makedirs(ctx.model(gpu_check.QWEN15))          # taken for built: these sections load no model
    real = gpu_check.commands

    def commands(section, ctx_):
        if section.name == "broken":
            raise RuntimeError("a bug in this section's commands")
        if section.name in argvs:
            return [gpu_check.Child(argvs[section.name])]
        return real(section, ctx_)
    monkeypatch.setattr(gpu_check, "commands", commands)
    return ctx


def test_an_exception_in_one_section_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    broken = gpu_check.Section("broken", "raises", 30, True)
    fine = gpu_check.Section("fine", "runs", 30, True)
    ctx = small_context(tmp_path, monkeypatch, {"fine": [sys.executable, "-c", "print('fine ran')"]})
    for s in (broken, fine):
        gpu_check.run_section(s, ctx, 79.2, 30, None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"]["broken"]["status"] == "error: RuntimeError: a bug in this section's commands"
    assert "Traceback" in (tmp_path / "broken.log").read_text()
    assert summary["sections"]["fine"]["status"] == "ok"
    assert "broken: error: RuntimeError: a bug in this section's commands" in summary["not_measured"]


def built_in_background(tmp_path, monkeypatch, code: str, limit: float):
    """A Build of the 1.5B whose child runs `code` (format fields: {path}, the model's folder) under the
    limit and cancel the real build gets, with a context whose sections load that model."""
    ctx = small_context(tmp_path, monkeypatch, {"early": [sys.executable, "-c", "print('early ran')"],
                                                "late": [sys.executable, "-c", "print('late ran')"]})
    os.rmdir(ctx.model(gpu_check.QWEN15))                        # not built yet

    def build_model(m, ctx_, log, limit_, cancel=None, echo=True):
        argv = [sys.executable, "-c", code.format(path=ctx_.model(m))]
        return child_process.run_child(argv, log, limit_, cancel=cancel, echo=echo)
    monkeypatch.setattr(gpu_check, "build_model", build_model)
    return ctx, gpu_check.Build(gpu_check.QWEN15, ctx, limit)


def test_a_slow_build_is_waited_for_until_each_sections_own_deadline(tmp_path, monkeypatch):
    # the build takes over 2 s: a section with 1 s left says the model is still building and ends at its own
    # deadline; the next, with 30 s, waits for the build and runs; nothing gives the build up early
    ctx, build = built_in_background(tmp_path, monkeypatch, "import os, time; time.sleep(2); os.makedirs({path!r})",
                                     60)
    early = gpu_check.Section("early", "loads the model", 30, True, models=(gpu_check.QWEN15,))
    late = gpu_check.Section("late", "loads the model", 30, True, models=(gpu_check.QWEN15,))
    start = time.monotonic()
    gpu_check.run_section(early, ctx, 79.2, 1.0, build)
    assert time.monotonic() - start < 2.0
    gpu_check.run_section(late, ctx, 79.2, 30, build)
    sections = json.loads((tmp_path / "summary.json").read_text())["sections"]
    assert sections["early"]["status"] == ("model qwen15 not built by this section's deadline (still building; "
                                           "build-qwen15.log)")
    assert sections["late"]["status"] == "ok" and "late ran" in (tmp_path / "late.log").read_text()
    assert 0.5 <= sections["early"]["build_wait_s"] <= 1.0 and sections["late"]["build_wait_s"] < 28
    assert build.status == "ok" and os.path.isdir(ctx.model(gpu_check.QWEN15))
    assert "early ran" not in (tmp_path / "early.log").read_text()


def test_a_failed_build_is_said_at_once_by_each_section_that_loads_it(tmp_path, monkeypatch):
    ctx, build = built_in_background(tmp_path, monkeypatch, "import sys; sys.exit(3)", 60)
    late = gpu_check.Section("late", "loads the model", 30, True, models=(gpu_check.QWEN15,))
    start = time.monotonic()
    gpu_check.run_section(late, ctx, 79.2, 30, build)
    assert time.monotonic() - start < 20                          # not its whole 30 s
    status = json.loads((tmp_path / "summary.json").read_text())["sections"]["late"]["status"]
    assert status == "model qwen15 not built (exit 3; build-qwen15.log)"


def test_the_build_may_run_until_the_last_section_that_loads_it_ends():
    # not until its own slot (36 s after the start-up): a build past it costs numerics' time, not every section
    ends = {slot.step: slot.ends_s for slot in gpu_check.schedule(gpu_check.DEFAULT)}
    assert gpu_check.build_ends_s(gpu_check.DEFAULT) == ends["trl"] == 458
    assert ends[gpu_check.BUILD_STEP] == 8 + 36
    numerics_only = {slot.step: slot.ends_s for slot in gpu_check.schedule(["smoke", "numerics", "prm"])}
    assert gpu_check.build_ends_s(["smoke", "numerics", "prm"]) == numerics_only["numerics"]
    assert gpu_check.build_ends_s(["smoke", "prm"]) is None


def killed_child(tmp_path, script: str, patch: str, argv: list[str]) -> list[str]:
    """A child that runs bench/SCRIPT's main(argv) with `patch` applied first: the patch kills the child
    (SIGKILL: nothing more is written) at some point of its run."""
    child = tmp_path / f"killed_{script}.py"
    child.write_text(f"import os, signal, sys\nsys.path.insert(0, {ROOT!r})\nimport bench.{script} as bench\n"
                     f"{textwrap.dedent(patch)}\nbench.main({argv!r})\n")
    return [sys.executable, str(child)]


@pytest.mark.slow
def test_a_decode_child_killed_after_its_first_engine_leaves_the_loop_under_tests_figures(tmp_path, monkeypatch):
    # bench/rollout.py at a tiny size (a random 2 x 64 Qwen2, 2 prompts x 2, budgets 10-16 in a 64-position
    # cache), its engines in the section's order: static's warm-up and timed call, then the child dies as
    # static-full's warm-up starts (a section cut short by its deadline). Its JSON, written after each call,
    # holds static's figures, the loop under test, which the summary reads.
    patch = textwrap.dedent("""
        timed, seen = bench.timed, []
        def timed_until_the_second_engine(engine, *args):
            seen.append(id(engine))
            if len(set(seen)) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return timed(engine, *args)
        bench.timed = timed_until_the_second_engine
    """)
    out = str(tmp_path / "decode.json")
    argv = ["--random", "2,64", "--engines", *gpu_check.DECODE, "--prompts", "2", "--n", "2", "--max-new-tokens",
            "16", "--cache-len", "64", "--lengths", "recipe", "--repeats", "1", "--warmup-tokens", "4", "--json", out]
    ctx = small_context(tmp_path, monkeypatch, {"decode": killed_child(tmp_path, "rollout", patch, argv)})
    gpu_check.run_section(gpu_check.BY_NAME["decode"], ctx, 79.2, 120, None)
    section = json.loads((tmp_path / "summary.json").read_text())["sections"]["decode"]
    assert section["status"] == "killed_rollout.py: exit -9", section["status"]
    [run] = section["figures"]["runs"]                              # static's; static-full never started
    assert run["engine"] == "static" and run["ms_per_step"] > 0 and run["first_call_s"] > 0
    assert run["rows_equal"] == 4 and run["first_call_max_new_tokens"] == 16     # its whole budgets
    assert 0 < run["cache_positions_per_step"] < 4 * 64            # windows and compaction: less than the cache
    assert not os.path.exists(out + ".tmp")                       # written whole, then renamed
    assert "| decode | 1 | killed_rollout.py: exit -9 |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_an_update_child_killed_at_the_eager_comparison_leaves_the_defaults_figures(tmp_path, monkeypatch):
    # bench/micro_batches.py at the check's small shape (3 sequences on a random 8 x 512 Qwen2, one packed
    # micro-batch): an untimed update, the timed one with the defaults, then the child dies as the eager
    # layers go in for the comparison. The defaults' update is in the summary.
    patch = "bench.eager_layers = lambda policy: os.kill(os.getpid(), signal.SIGKILL)"
    out = str(tmp_path / "update.json")
    argv = ["--sequences", "3", "--max-completion", "32", "--max-prompt", "16", "--budget", "256", "--warmup", "1",
            "--reps", "1", "--modes", "packed", "--against-eager", "--json", out]
    ctx = small_context(tmp_path, monkeypatch, {"update": killed_child(tmp_path, "micro_batches", patch, argv)})
    gpu_check.run_section(gpu_check.BY_NAME["update"], ctx, 79.2, 120, None)
    section = json.loads((tmp_path / "summary.json").read_text())["sections"]["update"]
    assert section["status"] == "killed_micro_batches.py: exit -9", section["status"]
    figures = section["figures"]
    assert figures["modes"]["packed"]["update_s"] > 0 and figures["modes"]["packed"]["micro_batches"] == 1
    assert figures["against_eager"] is None and figures["warmup"] == 1
    assert "packed, budget 256, checkpointing none" in (tmp_path / "summary.md").read_text()


def test_figures_of_an_unexpected_shape_are_said_and_the_next_section_runs(tmp_path, monkeypatch):
    # update.json holds a list; trl.json a step time of null (what the table formats as a number): each
    # section's figures say "figures unreadable: ...", the summary is still written and the next section runs
    ctx = small_context(tmp_path, monkeypatch, {
        "update": [sys.executable, "-c",
                   f"import json; json.dump([1, 2], open({str(tmp_path)!r} + '/update.json', 'w'))"],
        "trl": [sys.executable, "-c",
                f"import json; json.dump({{'times': [None]}}, open({str(tmp_path)!r} + '/trl.json', 'w'))"],
        "fine": [sys.executable, "-c", "print('fine ran')"]})
    for section in (gpu_check.BY_NAME["update"], gpu_check.BY_NAME["trl"], gpu_check.Section("fine", "runs", 30, True)):
        section = gpu_check.dataclasses.replace(section, needs=(), models=())      # TRL need not be installed
        gpu_check.run_section(section, ctx, 79.2, 30, None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = summary["sections"]
    assert [sections[n]["status"] for n in ("update", "trl", "fine")] == ["ok", "ok", "ok"]
    assert sections["update"]["figures_error"] == ("figures unreadable: ValueError: update.json holds a list, "
                                                   "not an object")
    assert "fine ran" in (tmp_path / "fine.log").read_text()
    md = (tmp_path / "summary.md").read_text()
    assert "| update | 1 | ok | " in md and "figures unreadable: ValueError: update.json holds a list" in md
    assert "| trl | 1 | ok | " in md
    assert "figures unreadable: TypeError: unsupported format string passed to NoneType" in md
    assert "update: figures unreadable: ValueError: update.json holds a list, not an object" in summary["not_measured"]


def test_a_failed_packed_check_runs_the_later_sections_unpacked(tmp_path, monkeypatch):
    # numerics writes packed_ok false: the update times token-budget micro-batches and the recipe step and
    # TRL's run train.py's config with packing off; the summary says why
    numerics = [sys.executable, "-c", f"import json; json.dump({{'packed_ok': False}}, open({str(tmp_path)!r} "
                "+ '/numerics.json', 'w'))"]
    ctx = small_context(tmp_path, monkeypatch, {"numerics": numerics})
    gpu_check.run_section(gpu_check.BY_NAME["numerics"], ctx, 79.2, 30, None)
    assert not ctx.packing and ctx.summary["packing"]["why"] == "numerics: packed_ok false"
    update = gpu_check.commands(gpu_check.BY_NAME["update"], ctx)[0].argv
    assert update[update.index("--modes") + 1] == "token budget"
    assert update[update.index("--checkpointing") + 1] == "auto"
    for name in ("recipe", "trl"):
        assert "--train.packing=false" in gpu_check.commands(gpu_check.BY_NAME[name], ctx)[0].argv
    assert "Packing: OFF: the sections after numerics ran unpacked (numerics: packed_ok false)" in \
        (tmp_path / "summary.md").read_text()
    # the verdicts: only a numerics run that wrote packed_ok true packs
    assert gpu_check.packing_verdict({"status": "ok", "figures": {"packed_ok": True}})[0]
    assert gpu_check.packing_verdict({"status": "ok", "figures": {}}) == (False, "numerics wrote no packed_ok")
    assert gpu_check.packing_verdict({"status": "timed out", "figures": {}}) == (False, "numerics: timed out")
    ctx.packing = True
    update = gpu_check.commands(gpu_check.BY_NAME["update"], ctx)[0].argv
    assert update[update.index("--modes") + 1] == "packed"


def test_the_recipe_step_and_trl_run_one_workload(tmp_path):
    # one list of overrides for both sides: train.py gets it as given, TRL's worker loads the same config
    ctx = gpu_check.Context(out=str(tmp_path), models="M", runs="R", small=False)
    recipe = gpu_check.commands(gpu_check.BY_NAME["recipe"], ctx)[0].argv
    trl = gpu_check.commands(gpu_check.BY_NAME["trl"], ctx)[0].argv
    overrides = trl[trl.index("--") + 1:]
    assert recipe[1:4] == ["train.py", "--config", "configs/qwen2.5-math-1.5b/grpo.yaml"]
    assert recipe[4:4 + len(overrides)] == overrides and "--model.name_or_path=M/qwen15-full" in overrides
    assert trl[trl.index("--config") + 1] == "configs/qwen2.5-math-1.5b/grpo.yaml"
    assert "--train.max_steps=2" in recipe and trl[trl.index("--steps") + 1] == "2"


def test_the_summary_reads_what_the_sections_wrote(tmp_path):
    ctx = gpu_check.Context(out=str(tmp_path), models="M", runs="R", small=False)
    mode = {"micro_batches": 2, "padded_share": 0.0, "update_s": 1.5, "real_tokens_per_s": 31273.0,
            "mfu": 0.301, "peak_allocated_gib": 30.0, "peak_reserved_gib": 35.0}
    profile = {"gemm": 0.5, "gemm_fp32": 0.0, "attention": 0.2, "elementwise": 0.1, "other": 0.1, "idle": 0.1,
               "attention_backend": "flash"}
    (tmp_path / "update.json").write_text(json.dumps({"budget": 36864, "checkpointing": "selective",
                                                      "modes": {"packed": mode}, "profile": profile}))
    (tmp_path / "numerics.json").write_text(json.dumps({"packed_ok": True, "packed_kernel": "varlen",
                                                        "logp_gap_packed_vs_unpacked": [1e-2, 1e-3]}))
    runs = [{"engine": "static", "ms_per_step": 1.8, "tokens_per_s": 20000.0, "first_call_s": 50.0,
             "max_new_tokens": 3584, "first_call_max_new_tokens": 3584, "compiles": 6, "recompiles": 0, "skips": 0,
             "rows_equal": 48},
            {"engine": "static-full", "ms_per_step": 4.5, "tokens_per_s": 9000.0, "first_call_s": 44.0,
             "max_new_tokens": 3584, "first_call_max_new_tokens": 32, "compiles": 2, "recompiles": 0, "skips": 0,
             "rows_equal": 48}]
    (tmp_path / "decode.json").write_text(json.dumps({"rows": 48, "cache_len": 4096, "reference": "static",
                                                      "runs": runs}))
    (tmp_path / "recipe.metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "step_time_s": t, "gen_s": 2.0, "reward_s": 0.1, "advantages_s": 1.0,
                    "update_s": 4.0, "peak_mem_gib": 34.6, "peak_reserved_gib": 43.0}) + "\n"
        for i, t in ((1, 50.0), (2, 8.0))) + '{"step": 3, "step_ti')                # a line being written
    (tmp_path / "trl.json").write_text(json.dumps({"times": [30.0, 20.0], "gen_s": [12.0, 11.0], "length": 256}))
    ctx.summary = {"calls": [{"gpu": "NVIDIA H100 80GB HBM3", "gpu_gib": 79.2, "torch": "2.11.0", "cuda": "13.0",
                              "transformers": "5.17.0", "trl": "1.16.0", "date": "2026-11-28", "commit": "abc1234"}],
                   "packing": {"packed": True, "why": "numerics: packed_ok", "call": 0}, "sections": {},
                   "notes": ["vLLM's ms per step: vLLM is not installed"]}
    for name in ("numerics", "update", "decode", "recipe", "trl"):
        ctx.summary["sections"][name] = {"status": "ok", "seconds": 10.0, "call": 0,
                                         "figures": gpu_check.figures(gpu_check.BY_NAME[name], ctx)}
    gpu_check.write_summary(ctx)
    md = (tmp_path / "summary.md").read_text()
    assert "GPU check, call 1: NVIDIA H100 80GB HBM3 (79.2 GiB), torch 2.11.0 (CUDA 13.0)" in md and "trl 1.16.0" in md
    assert "Packing: on (numerics: packed_ok)" in md
    assert "| packed_ok (packed forward and backward = unpacked within tolerance) | True |" in md
    assert "| packed kernel | varlen |" in md and "1.0e-02 / 1.0e-03" in md
    assert "packed, budget 36864, checkpointing selective" in md and "30.1% / 31,273 / 1.50 / 0.00 / 30.0, 35.0" in md
    assert "attention (flash)" in md and "50% / 20% / 10% / 10% / 10%" in md
    assert "1.80 / 20,000 / 50.0 / 6, 0, 0 / 48" in md and "| static-full / static ms per step | 2.50 |" in md
    assert "8.0 / 2.0 / 0.1 / 1.0 / 4.0; 34.6, 43.0" in md                    # step 2's split and peaks
    assert "| TRL step 2: step / generate s | 20.0 / 11.0 |" in md
    assert "| train.py / TRL, step 2 each (step 1 left out: train.py's compiles; goal <= 0.5) | 8.0 / 20.0 = " \
           "0.40 |" in md
    assert "| static-full, 48 rows, cache 4096: ms/step / tok/s / first call s / compiles, recompiles, graph " \
           "skips / rows equal to static's | 4.50 / 9,000 / 44.0 (32 tokens) / 2, 0, 0 / 48 |" in md
    assert "- vLLM's ms per step: vLLM is not installed" in md


def test_train_py_and_trl_are_compared_on_their_second_step_only():
    # the recipe stopped after its step 1 (50 s, the compiles): no ratio against TRL's step 2 (20 s), which
    # would be 2.50; with both second steps (8 s, 20 s): 8 / 20 = 0.40, step 1's 50 s and 30 s left out
    trl = {"status": "ok", "figures": {"times": [30.0, 20.0], "gen_s": [12.0, 11.0]}}
    recipe = {"status": "timed out", "figures": {"steps": [{"step_time_s": 50.0}]}}
    rows = dict(gpu_check.key_figures("trl", trl["figures"], {"sections": {"recipe": recipe, "trl": trl}}))
    ratio = "train.py / TRL, step 2 each (step 1 left out: train.py's compiles; goal <= 0.5)"
    assert rows[ratio] == "not measured: train.py logged 1 step(s), TRL 2"
    recipe["figures"]["steps"].append({"step_time_s": 8.0})
    rows = dict(gpu_check.key_figures("trl", trl["figures"], {"sections": {"recipe": recipe, "trl": trl}}))
    assert rows[ratio] == "8.0 / 20.0 = 0.40"
    trl["figures"]["times"] = [30.0]                                 # TRL stopped after its first step
    rows = dict(gpu_check.key_figures("trl", trl["figures"], {"sections": {"recipe": recipe, "trl": trl}}))
    assert rows[ratio] == "not measured: train.py logged 2 step(s), TRL 1"


def test_the_async_section_runs_sync_then_async_on_one_workload_and_sets_them_side_by_side(tmp_path):
    ctx = gpu_check.Context(out=str(tmp_path), models="M", runs="R", small=False)
    sync, one_off = (c.argv for c in gpu_check.commands(gpu_check.BY_NAME["async"], ctx))
    assert "--train.output_dir=R/async-baseline" in sync and "--train.output_dir=R/async" in one_off
    assert one_off[-3:-1] == ["--rollout.mode=async", "--rollout.sync_check_steps=1"]
    assert [a for a in one_off if "output_dir" not in a and a not in one_off[-3:-1]] == \
        [a for a in sync if "output_dir" not in a]                               # the same workload otherwise
    assert "--rollout.engine=vllm" in sync and "--rollout.is_correction=token" in sync
    (tmp_path / "async-baseline.metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "step_time_s": t, "gen_s": 5.0, "update_s": 4.0}) + "\n" for i, t in ((1, 60.0),
                                                                                                    (2, 10.0))))
    (tmp_path / "async.metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "step_time_s": t, "gen_s": 1.0, "engine_gen_s": 5.5, "engine_idle_s": 0.5,
                    "weight_sync_s": 0.8, "engine_load_s": 0.4, "weight_sync_bytes": 3.09e9, "sync_stale_rows": 0.0,
                    "rollout_lag": 1.0}) + "\n" for i, t in ((1, 70.0), (2, 7.0))))
    ctx.summary = {"calls": [], "sections": {"async": {"status": "ok", "seconds": 200.0, "call": 0,
                   "figures": gpu_check.figures(gpu_check.BY_NAME["async"], ctx)}}}
    md = gpu_check.markdown(ctx.summary)
    assert "| 10.0 / 7.0; 1.00 / 5.50 / 0.50 / 0.80 / 0.40, 3090, 0 |" in md
    assert "| async / sync step s, step 2 each | 7.0 / 10.0 = 0.70 |" in md
    ctx.summary["sections"]["async"]["figures"]["steps"].pop()       # the async run stopped after its step 1
    assert "async / sync step s" not in gpu_check.markdown(ctx.summary)    # not its step 1 beside sync's step 2


def test_calls_into_one_out_add_up_each_with_its_environment(tmp_path, monkeypatch):
    # a check split over two calls (two machines): the second call's summary keeps the first call's
    # sections and the environment they ran in; a section run again is replaced
    first = {"gpu": "NVIDIA H200", "torch": "2.11.0", "date": "d1", "commit": "aaa"}
    (tmp_path / "summary.json").write_text(json.dumps({
        "env": first, "sections": {"update": {"status": "ok", "seconds": 1.0, "figures": {}},
                                   "decode": {"status": "timed out", "seconds": 9.0, "figures": {}}}}))
    def run_section(section, ctx, gib, limit, build):
        ctx.summary["sections"][section.name] = {"status": "ok", "seconds": 2.0, "call": len(ctx.summary["calls"]) - 1,
                                                 "figures": {}}
    monkeypatch.setattr(gpu_check, "run_section", run_section)
    monkeypatch.setattr(gpu_check, "become_subreaper", lambda: True)      # not this test process
    assert gpu_check.main([str(tmp_path), "decode", "--small", "--models", str(tmp_path / "m")]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["sections"]) == {"update", "decode"} and "decode: timed out" not in summary["not_measured"]
    assert summary["calls"][0] == first and summary["calls"][1] == summary["env"]
    assert summary["sections"]["update"]["call"] == 0 and summary["sections"]["decode"]["call"] == 1
    md = (tmp_path / "summary.md").read_text()
    assert "GPU check, call 1: NVIDIA H200" in md and "GPU check, call 2: no GPU" in md


# ---- the rehearsal -------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_small_rehearsal_runs_the_default_sections(tmp_path):
    """--small: every default section at CPU stand-in widths, end to end, in priority order: the model built
    once in the background, the children run, their figures read into the summary, the models removed.
    TRL's section is skipped, saying so, where TRL is not installed."""
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--small", str(tmp_path / "out"),
                           "--models", str(tmp_path / "models")], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    status = {n: s["status"] for n, s in summary["sections"].items()}
    assert list(status) == gpu_check.DEFAULT and summary["builds"]["qwen15"]["status"] == "ok"
    assert status["smoke"] == status["numerics"] == status["recipe"] == "ok"
    assert status["update"] == status["decode"] == "ok", status
    update = summary["sections"]["update"]["figures"]
    assert update["against_eager"]["update_s"] > 0 and update["modes"][update["against_eager"]["mode"]]["update_s"] > 0
    runs = summary["sections"]["decode"]["figures"]["runs"]
    assert [r["engine"] for r in runs] == ["static", "static-full"]
    assert [r["first_call_max_new_tokens"] for r in runs] == [16, 4]          # static-full: its one shape
    if importlib.util.find_spec("trl") is None:
        assert status["trl"] == "skipped: needs trl (docs/gpu.md#wheels)"
    else:
        assert status["trl"] == "ok" and len(summary["sections"]["trl"]["figures"]["times"]) == 2
    packed = summary["sections"]["numerics"]["figures"].get("packed_ok") is True
    assert summary["packing"]["packed"] == packed
    steps = summary["sections"]["recipe"]["figures"]["steps"]
    assert len(steps) == 2 and all(s["gen_s"] > 0 and s["update_s"] > 0 for s in steps)
    recipe_log = (tmp_path / "out" / "recipe.log").read_text()
    assert ("--train.packing=false" in recipe_log) == (not packed)
    assert "torch.distributed.run" not in recipe_log
    assert (tmp_path / "out" / "summary.md").read_text().startswith("GPU check, call 1: no GPU")
    assert not os.path.exists(tmp_path / "models")                           # the models are removed
