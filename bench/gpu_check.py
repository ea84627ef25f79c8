"""The GPU check: the recipes' architectures at real widths with random weights, section by section,
every figure the project has not measured yet in one summary (docs/gpu.md, "GPU check").

    bash scripts/gpu_check.sh OUT [SECTION ...]       # one NVIDIA GPU; default: the default sections
    bash scripts/gpu_check.sh --dry-run [--gpu-gib G] # any machine: each section's plan and commands
    bash scripts/gpu_check.sh --small OUT [SECTION]   # any machine: the script itself, CPU stand-in widths

It prints the environment and refuses to start, in one line (exit 2), when a package it needs is
missing (docs/gpu.md#wheels says how to bring them) or there is no CUDA device. A 20-second smoke
test runs first (a compiled function, a bf16 matmul, the attention kernel sdpa picks). Each section
runs as child processes under its own time limit, on models built once for all sections (removed at
the end); each writes OUT/<section>.log, and the figures go to OUT/summary.json and OUT/summary.md
(a table for bench/RESULTS.md) after every section, with what was not measured and why. Before a
section starts, its memory plan (pspo/training/plan.py) at the card's memory must fit: the dry run
prints every plan at 79 GiB (an H100) and a test runs it, so no section stops at start-up for memory.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

H100_GIB = 79.2                 # what torch reports for an H100 80GB: the dry run's default card
R15 = "configs/qwen2.5-math-1.5b"
R7 = "configs/qwen2.5-7b-instruct-1m"
NEEDS = ("torch", "transformers", "peft", "datasets", "math_verify", "yaml", "safetensors", "tqdm", "tensorboard")


@dataclass(frozen=True)
class Model:
    """A random-weight model built once from a recipe's config.json (pspo/offline/standin.py)."""
    name: str
    config: str                   # the real config.json
    layers: int | None = None     # keep only the first layers (a depth that fits one GPU)


@dataclass(frozen=True)
class PlanCase:
    """A training configuration whose per-GPU memory plan bounds what a section allocates."""
    config: str
    overrides: tuple[str, ...] = ()
    layers: int | None = None     # the model truncated to this many layers, as the section builds it


@dataclass(frozen=True)
class Section:
    name: str
    what: str
    limit_s: int                  # the section's time limit: its child processes are killed past it
    default: bool                 # in the default list
    models: tuple[Model, ...] = ()
    plans: tuple[PlanCase, ...] = ()
    needs: str = ""               # a module beyond the check's own (vllm)


QWEN15 = Model("qwen15", f"{R15}/model_config.json")
QWEN7B = Model("qwen7b-4", f"{R7}/model_config.json", layers=4)
GEN = 512                          # new tokens per completion in the training sections (random weights never stop)
RECIPE = ("--data.train=data/samples/open-rs.jsonl", f"--rollout.max_new_tokens={GEN}", "--rollout.engine=hf")

SECTIONS = (
    Section("update", "the 1.5B recipe's update: 48 sequences (completions 10-3584 tokens), token budget 36864 "
            "with checkpointing, unpacked and packed (a profile of packed), then packed at 4096 with checkpointing "
            "auto (the plan's choice for that batch); MFU, real tokens/s, peak memory", 420, True,
            (QWEN15,), (PlanCase(f"{R15}/grpo.yaml", ("--rollout.engine=hf",)),
                        PlanCase(f"{R15}/grpo.yaml", ("--rollout.engine=hf", "--model.gradient_checkpointing=auto",
                                                      "--train.micro_batch_tokens=4096")))),
    Section("decode", "decoding 48 completions of 512 tokens at the recipe's cache length (4096): the static-cache "
            "loop, transformers' static-cache generate, plain generate; ms per step, compiles, CUDA-graph skips",
            480, True, (QWEN15,), (PlanCase(f"{R15}/grpo.yaml", ("--rollout.engine=hf",)),)),
    Section("numerics", "log-probs and gradients of the 1.5B: the default attention kernel against sdpa's math "
            "kernel (bf16 autocast), both against float32; packed rows (varlen) against unpacked", 180, True, (QWEN15,),
            (PlanCase(f"{R15}/grpo.yaml", ("--rollout.engine=hf",)),)),
    Section("prm", "PSPO*'s PRM (BERT-base size) scoring 48 completions x 20 steps: batched vs one at a time",
            120, True),
    Section("recipe", "configs/qwen2.5-math-1.5b/grpo.yaml for 2 steps of 48 completions (512 new tokens), "
            "evaluation, a checkpoint reloaded by eval.py: the step split gen / score / update", 480, True,
            (QWEN15,), (PlanCase(f"{R15}/grpo.yaml", RECIPE),)),
    Section("lora", "configs/qwen2.5-math-1.5b/pspo_lora.yaml (rank-16 adapters, a frozen bf16 base, the reference "
            "the base itself) for 2 steps as `recipe` runs the full fine-tuning recipe: step split and peak memory "
            "against it", 420, True, (QWEN15,), (PlanCase(f"{R15}/pspo_lora.yaml", RECIPE),)),
    Section("rpp7b", "configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml at the 7B's widths, 4 of 28 layers, "
            "2 steps of 64 K&K completions: peak memory against the plan", 480, True, (QWEN7B,),
            (PlanCase(f"{R7}/reinforce_pp.yaml", ("--data.eval=", f"--rollout.max_new_tokens={GEN}",
                                                  "--rollout.engine=hf"), layers=4),)),
    Section("spo", "configs/qwen2.5-math-1.5b/spo_tree.yaml, 1 step (6-6-6 trees, 64-token segments): the "
            "share of the step spent growing trees", 420, False, (QWEN15,),
            (PlanCase(f"{R15}/spo_tree.yaml", RECIPE + ("--train.prompts_per_step=2", "--spo.segment_tokens=64")),)),
    Section("vllm", "the sync check made to fail (bench/sync_check.py: peaked logits, one real step, stale vs "
            "synced), then the 1.5B recipe on vLLM (bf16, sleep, token TIS), 3 steps at lr 1e-5 with a sync check each "
            "at the default tolerance: weight sync s, engine gap, sync gap", 480, False, (QWEN15,),
            (PlanCase(f"{R15}/grpo.yaml", ("--data.train=data/samples/open-rs.jsonl", f"--rollout.max_new_tokens={GEN}",
                                           "--rollout.engine=vllm", "--rollout.sleep=true")),), needs="vllm"),
)
BY_NAME = {s.name: s for s in SECTIONS}


@dataclass
class Context:
    out: str
    models: str                    # where the models are built
    runs: str                      # train.py's output folders
    small: bool                    # CPU rehearsal: stand-in widths, tiny shapes
    python: str = sys.executable
    summary: dict = field(default_factory=dict)

    def model(self, m: Model) -> str:
        return os.path.join(self.models, f"{m.name}-{'small' if self.small else 'full'}")


def commands(section: Section, ctx: Context) -> list[list[str]]:
    """The child processes a section runs, in order (each writes its figures under ctx.out)."""
    py, out, small = ctx.python, ctx.out, ctx.small
    j = lambda tag: os.path.join(out, f"{section.name}{tag}.json")   # noqa: E731
    if section.name == "update":
        base = [py, "bench/micro_batches.py", "--model", ctx.model(QWEN15), "--sequences", "48",
                "--max-completion", "3584", "--max-prompt", "512", "--bf16", "--modes", "token budget,packed",
                "--reps", "2"]
        if small:
            base = base[:4] + ["--sequences", "6", "--max-completion", "64", "--max-prompt", "32",
                               "--modes", "token budget,packed", "--reps", "1"]
        return [base + ["--checkpointing", "--budget", "512" if small else "36864", "--profile", "--json", j("-ckpt")],
                base + ["--checkpointing", "auto", "--budget", "256" if small else "4096", "--modes", "packed",
                        "--json", j("-nockpt")]]
    if section.name == "decode":
        shape = ["--prompts", "2", "--n", "2", "--max-new-tokens", "16", "--repeats", "1", "--cache-len", "64"] \
            if small else ["--prompts", "8", "--n", "6", "--max-new-tokens", "512", "--repeats", "2",
                           "--cache-len", "4096"]
        return [[py, "bench/rollout.py", "--model", ctx.model(QWEN15), "--bf16", "--engines", "static",
                 "generate-static", "generate", *shape, "--json", j("")]]
    if section.name == "numerics":
        shape = ["--rows", "2", "--max-len", "64"] if small else ["--rows", "4", "--max-len", "2048"]
        return [[py, "bench/attention_numerics.py", "--model", ctx.model(QWEN15), "--bf16", *shape, "--json", j("")]]
    if section.name == "prm":
        return [[py, "bench/prm_scoring.py", *(["--small", "--completions", "8", "--steps", "5"] if small else []),
                 "--json", j("")]]
    gen = "16" if small else str(GEN)
    run = os.path.join(ctx.runs, section.name)
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    common = [f"--train.output_dir={run}", f"--rollout.max_new_tokens={gen}", "--train.save_steps=0"]
    if section.name == "recipe":
        return [torchrun + ["--config", f"{R15}/grpo.yaml", f"--model.name_or_path={ctx.model(QWEN15)}", *common,
                            "--rollout.engine=hf", "--data.train=data/samples/open-rs.jsonl",
                            "--data.eval=data/samples/math500.jsonl", "--data.max_eval_examples=8",
                            "--train.max_steps=2", "--train.save_steps=2"],
                [py, "eval.py", "--config", f"{R15}/grpo.yaml", "--rollout.engine=hf",
                 f"--model.name_or_path={run}/checkpoint-2", "--data.eval=data/samples/math500.jsonl",
                 "--data.max_eval_examples=8", "--rollout.max_new_tokens=64"]]
    if section.name == "lora":
        return [torchrun + ["--config", f"{R15}/pspo_lora.yaml", f"--model.name_or_path={ctx.model(QWEN15)}", *common,
                            "--rollout.engine=hf", "--data.train=data/samples/open-rs.jsonl", "--data.eval=",
                            "--train.max_steps=2"]]
    if section.name == "rpp7b":
        return [torchrun + ["--config", f"{R7}/reinforce_pp.yaml", f"--model.name_or_path={ctx.model(QWEN7B)}",
                            *common, "--rollout.engine=hf", "--data.eval=", "--train.max_steps=2"]]
    if section.name == "spo":
        return [torchrun + ["--config", f"{R15}/spo_tree.yaml", f"--model.name_or_path={ctx.model(QWEN15)}", *common,
                            "--rollout.engine=hf", "--data.train=data/samples/open-rs.jsonl", "--data.eval=",
                            "--train.prompts_per_step=2", f"--spo.segment_tokens={'4' if small else '64'}",
                            "--train.max_steps=1"]]
    if section.name == "vllm":
        return [[py, "bench/sync_check.py", "--model", ctx.model(QWEN15), "--bf16", "--max-new-tokens", gen,
                 "--json", j("-sync")],
                torchrun + ["--config", f"{R15}/grpo.yaml", f"--model.name_or_path={ctx.model(QWEN15)}", *common,
                            "--rollout.engine=vllm", "--rollout.sleep=true", "--rollout.is_correction=token",
                            "--rollout.sync_check_steps=1", "--data.train=data/samples/open-rs.jsonl",
                            "--data.eval=", "--train.max_steps=3", "--optim.lr=1e-5"]]
    raise ValueError(section.name)


def plan_case(case: PlanCase, gpu_gib: float) -> tuple[float, bool, str]:
    """(peak GiB, fits, the verdict) of a PlanCase on one GPU of gpu_gib, with the engine it names."""
    from pspo.training.config import load_config
    from pspo.training.plan import GiB, load_arch, make_plan
    cfg = load_config(case.config, list(case.overrides))
    arch, _ = load_arch(cfg.model.name_or_path, case.config, cfg.model.trust_remote_code)
    if case.layers is not None:                                 # the first layers only
        cut = arch.layers - case.layers
        arch = dataclasses.replace(arch, layers=case.layers, params=arch.params - cut * arch.layer_params)
    engine = "vllm" if cfg.rollout.engine in ("auto", "vllm") else "hf"
    plan = make_plan(cfg, arch, gpus=1, gpu_bytes=int(gpu_gib * GiB), engine=engine)
    return plan.peak / GiB, plan.fits, plan.verdict()


def dry_run(names: list[str], gpu_gib: float) -> int:
    """Print every section's plan and commands; 1 if a plan does not fit."""
    ctx = Context(out="OUT", models="MODELS", runs="RUNS", small=False, python="python3")
    bad = 0
    total = sum(BY_NAME[n].limit_s for n in names)
    print(f"GPU check, dry run at {gpu_gib:g} GiB: {len(names)} sections, time limits {total // 60} min in all")
    for name in names:
        s = BY_NAME[name]
        print(f"\n[{name}] {'default' if s.default else 'on request'}, limit {s.limit_s} s"
              f"{', needs ' + s.needs if s.needs else ''}: {s.what}")
        for m in s.models:
            print(f"  model {m.name}: {m.config} at real widths{f', {m.layers} layers' if m.layers else ''}")
        for case in s.plans:
            peak, fits, verdict = plan_case(case, gpu_gib)
            bad += not fits
            print(f"  plan {case.config} {' '.join(case.overrides)}"
                  f"{f' ({case.layers} layers)' if case.layers else ''}: {verdict}")
        if not s.plans:
            print("  plan: none needed (the model is 0.1B)")
        for argv in commands(s, ctx):
            print("  $ " + " ".join(argv))
    print(f"\n{'every plan fits' if not bad else f'{bad} plan(s) do not fit'} on one GPU of {gpu_gib:g} GiB")
    return 1 if bad else 0


def environment() -> dict:
    """What the machine has: versions, the GPU, the commit."""
    import torch
    import transformers
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "gpu": None, "gpu_gib": None,
           "vllm": None, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_gib=round(props.total_memory / 2 ** 30, 1))
    for mod in ("datasets", "math_verify", "vllm", "peft"):
        if importlib.util.find_spec(mod):
            env[mod] = getattr(importlib.import_module(mod), "__version__", "installed")
    try:                                   # PSPO_COMMIT: a copy of the tree without .git
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10) if not os.environ.get("PSPO_COMMIT") else None
        env["commit"] = os.environ.get("PSPO_COMMIT") or git.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = None
    return env


def pinned() -> dict[str, str]:
    """requirements.txt's pins of the packages the GPU image brings itself."""
    pins = {}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            name, _, version = line.split("#")[0].strip().partition("==")
            if version:
                pins[name] = version
    return pins


def smoke(path: str) -> None:
    """The 20-second smoke test, in a child process: a compiled function, a bf16 matmul, sdpa's kernel."""
    import torch
    import torch.nn.functional as F
    figures: dict = {}
    start = time.perf_counter()
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    x = torch.randn(1024, device="cuda")
    figures["compile_ok"] = bool(torch.allclose(f(x), torch.sin(x) * 2 + 1, atol=1e-5))
    figures["compile_s"] = time.perf_counter() - start
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    figures["bf16_matmul_tflops"] = 10 * 2 * 8192 ** 3 / (time.perf_counter() - t) / 1e12
    from torch.profiler import ProfilerActivity, profile
    q = torch.randn(4, 12, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 2, 2048, 128, device="cuda", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    figures["sdpa_kernels"] = sorted(names, key=len)[:3]
    with open(path, "w") as fh:
        json.dump(figures, fh, indent=1)
    print(f"smoke: compile {'ok' if figures['compile_ok'] else 'WRONG'} in {figures['compile_s']:.1f} s; "
          f"bf16 matmul {figures['bf16_matmul_tflops']:.0f} TFLOP/s; sdpa (causal, GQA) ran {figures['sdpa_kernels']}")


def run_child(argv: list[str], log, limit: float) -> str:
    """Run one child in its own process group, its output appended to log; "ok", "exit N" or "timed out"."""
    log.write("$ " + " ".join(argv) + "\n")
    log.flush()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    deadline = time.monotonic() + limit
    try:
        return _follow(proc, log, deadline)
    except BaseException:                   # interrupted (SIGTERM, Ctrl-C): take the child's group down too
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group (torchrun passes it on to its workers, which it starts
    apart from that group), then SIGKILL after 10 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _follow(proc: subprocess.Popen, log, deadline: float) -> str:
    """Copy the child's output to stdout and the log until it exits or the deadline passes."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            stop(proc)
            log.write("[killed: over the section's time limit]\n")
            return "timed out"
        if sel.select(timeout=min(left, 5.0)):
            line = proc.stdout.readline()
            if not line:
                break
            sys.stdout.write(line)
            log.write(line)
    proc.wait()
    return "ok" if proc.returncode == 0 else f"exit {proc.returncode}"


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def read_metrics(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def figures(section: Section, ctx: Context) -> dict:
    """The section's figures from the files its children wrote (absent ones are left out)."""
    j = lambda tag: read_json(os.path.join(ctx.out, f"{section.name}{tag}.json"))   # noqa: E731
    if section.name == "update":
        return {k: v for k, v in (("checkpointing", j("-ckpt")), ("no_checkpointing", j("-nockpt"))) if v}
    if section.name in ("decode", "numerics", "prm"):
        return j("") or {}
    extra = {"sync_check": j("-sync")} if section.name == "vllm" and j("-sync") else {}
    rows = read_metrics(os.path.join(ctx.out, f"{section.name}.metrics.jsonl"))
    steps = [r for r in rows if "step_time_s" in r]
    keys = ("step_time_s", "gen_s", "advantages_s", "update_s", "reward_s", "sync_s", "peak_mem_gib",
            "peak_reserved_gib", "update_tokens_per_s", "gen_tokens_per_s", "mc_gen_s", "weight_sync_s",
            "sync_gap_mean", "sync_gap_max", "engine_gap_mean", "engine_gap_max", "tis_weight_mean")
    return {"steps": [{k: r[k] for k in keys if k in r} for r in steps],
            "eval": [r for r in rows if "eval_accuracy" in r], **extra}


def markdown(summary: dict) -> str:
    """The summary as Markdown, ready for bench/RESULTS.md."""
    env = summary["env"]
    lines = [f"GPU check on {env.get('gpu') or 'no GPU'} ({env.get('gpu_gib')} GiB), torch {env['torch']} "
             f"(CUDA {env['cuda']}), transformers {env['transformers']}, vLLM {env.get('vllm') or 'absent'}; "
             f"{env['date']}, commit {env.get('commit')}", "",
             "| section | status | s | figure | value |", "|---|---|---:|---|---|"]
    smoke_ = summary.get("smoke") or {}
    if smoke_:
        kernels = ", ".join(smoke_.get("sdpa_kernels", []))[:80]
        lines.append(f"| smoke | ok | | bf16 matmul / compile / sdpa kernels | "
                     f"{smoke_.get('bf16_matmul_tflops', 0):.0f} TFLOP/s / {smoke_.get('compile_s', 0):.1f} s / "
                     f"{kernels} |")
    for name, s in summary["sections"].items():
        rows = list(key_figures(name, s.get("figures") or {})) or [("-", "-")]
        if s.get("plan_gib"):
            rows.append(("memory plan peak GiB (an upper bound)", " / ".join(map(str, s["plan_gib"]))))
        for i, (what, value) in enumerate(rows):
            head = f"| {name} | {s['status']} | {s['seconds']:.0f} |" if i == 0 else "| | | |"
            lines.append(f"{head} {what} | {value} |")
    if summary.get("not_measured"):
        lines += ["", "Not measured:"] + [f"- {n}" for n in summary["not_measured"]]
    return "\n".join(lines) + "\n"


def key_figures(name: str, f: dict):
    """(figure, value) pairs of one section for the Markdown table."""
    if name == "update":
        for label, r in f.items():
            for mode, m in r["modes"].items():
                mfu = f"{m['mfu']:.1%}" if m.get("mfu") is not None else "-"
                yield (f"{label}, {mode}, budget {r['budget']}: MFU / real tok/s / update s / padded / "
                       "peak alloc, reserved GiB",
                       f"{mfu} / {m.get('real_tokens_per_s', 0):,.0f} / {m.get('update_s', 0):.2f} / "
                       f"{m.get('padded_share', 0):.2f} / {m.get('peak_allocated_gib') or 0:.1f}, "
                       f"{m.get('peak_reserved_gib') or 0:.1f}")
            if r.get("profile"):
                p = r["profile"]
                yield (f"{label}: GEMM / attention ({p['attention_backend']}) / elementwise / other / idle",
                       " / ".join(f"{p[k]:.0%}" for k in ("gemm", "attention", "elementwise", "other", "idle")))
    elif name == "decode":
        for r in f.get("runs", []):
            yield (f"{r['engine']}, {f.get('rows')} rows, cache {f.get('cache_len')}: ms/step / tok/s / first call s "
                   "/ compiles, recompiles, graph skips",
                   f"{r['ms_per_step']:.2f} / {r['tokens_per_s']:,.0f} / {r['first_call_s']:.1f} / "
                   f"{r['compiles']}, {r['recompiles']}, {r['skips']}")
        ms = {r["engine"]: r["ms_per_step"] for r in f.get("runs", [])}
        if "static" in ms and "generate-static" in ms:
            ratio = ms["generate-static"] / ms["static"]
            yield ("generate-static / static ms per step (keep the static loop at >= 1.5)", f"{ratio:.2f}")
    elif name == "numerics" and f:
        yield (f"default kernel {f['default_kernel']} vs math: max / mean |Δ log p|, grad rel Δ",
               f"{f['logp_gap_default_vs_math'][0]:.1e} / {f['logp_gap_default_vs_math'][1]:.1e}, "
               f"{f['grad_rel_default_vs_math']:.1e}")
        yield ("vs float32: default / math max |Δ log p|",
               f"{f['logp_gap_default_vs_fp32'][0]:.1e} / {f['logp_gap_math_vs_fp32'][0]:.1e}")
        if "logp_gap_packed_vs_unpacked" in f:
            yield (f"packed ({f['packed_kernel']}) vs unpacked / vs float32: max |Δ log p|",
                   f"{f['logp_gap_packed_vs_unpacked'][0]:.1e} / {f['logp_gap_packed_vs_fp32'][0]:.1e}")
    elif name == "prm" and f:
        yield ("steps/s batched / one at a time s / batched s", f"{f['steps_per_s']:,.0f} / "
               f"{f['one_at_a_time_s']:.2f} / {f['batched_s']:.2f}")
    elif f.get("steps") or f.get("sync_check"):
        if f.get("sync_check"):
            c = f["sync_check"]
            yield (f"sync check on peaked logits (x{c['sharpen']:g}, p {c['mean_sampled_token_prob']:.2f}): mean gap "
                   "synced / stale / resynced; a stale engine caught", f"{c['synced'][1]:.1e} / {c['stale'][1]:.1e} / "
                   f"{c['resynced'][1]:.1e}; {'yes' if c['check_can_fail'] else 'NO'}")
        for i, r in enumerate(f["steps"], 1):
            split = " / ".join(f"{r.get(k, 0):.1f}" for k in ("step_time_s", "gen_s", "advantages_s", "update_s"))
            peak = f"{r.get('peak_mem_gib', 0):.1f}, {r.get('peak_reserved_gib', 0):.1f}"
            yield (f"step {i}: step / gen / score+adv / update s; peak alloc, reserved GiB", f"{split}; {peak}")
            if r.get("mc_gen_s"):
                yield (f"step {i}: tree growth share", f"{r['mc_gen_s'] / r['step_time_s']:.0%}")
            if "sync_gap_mean" in r:
                yield (f"step {i}: weight sync s / sync gap mean / engine gap mean",
                       f"{r.get('weight_sync_s', 0):.2f} / {r['sync_gap_mean']:.2e} / "
                       f"{r.get('engine_gap_mean', 0):.2e}")


def write_summary(ctx: Context) -> None:
    with open(os.path.join(ctx.out, "summary.json"), "w") as f:
        json.dump(ctx.summary, f, indent=1)
    with open(os.path.join(ctx.out, "summary.md"), "w") as f:
        f.write(markdown(ctx.summary))


def build_model(m: Model, ctx: Context, log, limit: float) -> str:
    path = ctx.model(m)
    if os.path.isdir(path):
        return "ok"
    argv = [ctx.python, "-m", "pspo.offline.standin", m.config, path] + ([] if ctx.small else ["--full"]) \
        + ([] if m.layers is None else ["--layers", str(m.layers)])
    return run_child(argv, log, limit)


def run_section(section: Section, ctx: Context, gpu_gib: float) -> None:
    start = time.monotonic()
    try:
        _run_section(section, ctx, gpu_gib, start)
    except BaseException:                   # the whole check was stopped: say so in the summary
        record = ctx.summary["sections"][section.name]
        record.update(status="interrupted", seconds=time.monotonic() - start, figures=figures(section, ctx))
        ctx.summary["not_measured"].append(f"{section.name}: interrupted (the check was stopped)")
        raise


def _run_section(section: Section, ctx: Context, gpu_gib: float, start: float) -> None:
    record = {"status": "ok", "seconds": 0.0, "plan_gib": [], "figures": {}}
    ctx.summary["sections"][section.name] = record
    with open(os.path.join(ctx.out, f"{section.name}.log"), "w") as log:
        print(f"\n=== [{section.name}] {section.what} (limit {section.limit_s} s)", flush=True)
        if section.needs and importlib.util.find_spec(section.needs) is None:
            record["status"] = f"skipped: {section.needs} is not installed"
        if record["status"] == "ok" and not ctx.small:
            for case in section.plans:
                peak, fits, verdict = plan_case(case, gpu_gib)
                record["plan_gib"].append(round(peak, 1))
                log.write(f"plan {case.config}: {verdict}\n")
                if not fits:
                    record["status"] = f"skipped: its plan does not fit ({verdict})"
        for m in section.models if record["status"] == "ok" else ():
            status = build_model(m, ctx, log, section.limit_s - (time.monotonic() - start))
            if status != "ok":
                record["status"] = f"model {m.name}: {status}"
        for argv in commands(section, ctx) if record["status"] == "ok" else ():
            status = run_child(argv, log, section.limit_s - (time.monotonic() - start))
            if status != "ok":
                record["status"] = f"{os.path.basename(argv[1] if argv[1] != '-m' else argv[-1])}: {status}"
                break
        run = os.path.join(ctx.runs, section.name)
        if os.path.isfile(os.path.join(run, "metrics.jsonl")):
            shutil.copy(os.path.join(run, "metrics.jsonl"), os.path.join(ctx.out, f"{section.name}.metrics.jsonl"))
        shutil.rmtree(run, ignore_errors=True)             # checkpoints of a 1.5B or 7B model fill a disk
    record["seconds"] = time.monotonic() - start
    record["figures"] = figures(section, ctx)
    if record["status"] != "ok":
        ctx.summary["not_measured"].append(f"{section.name}: {record['status']}")
    print(f"=== [{section.name}] {record['status']} in {record['seconds']:.0f} s", flush=True)
    write_summary(ctx)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="runs/gpu_check")
    ap.add_argument("sections", nargs="*", help=f"default: {' '.join(s.name for s in SECTIONS if s.default)}; "
                    f"on request: {' '.join(s.name for s in SECTIONS if not s.default)}")
    ap.add_argument("--dry-run", action="store_true", help="print each section's plan and commands; run nothing")
    ap.add_argument("--gpu-gib", type=float, default=None, help=f"the card's memory (dry run default {H100_GIB})")
    ap.add_argument("--small", action="store_true", help="CPU stand-in widths and tiny shapes: the script itself")
    ap.add_argument("--models", default="/tmp/pspo-gpu-models", help="where the models are built (removed after)")
    ap.add_argument("--keep-models", action="store_true")
    ap.add_argument("--smoke", default="", help=argparse.SUPPRESS)          # the child that runs the smoke test
    args = ap.parse_args(argv)
    if args.smoke:
        smoke(args.smoke)
        return 0
    if args.dry_run and args.out != "runs/gpu_check":          # --dry-run SECTION ...: no OUT folder
        args.sections = [args.out] + args.sections
    names = args.sections or [s.name for s in SECTIONS if s.default]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"gpu_check: unknown section {unknown[0]!r}; expected one of {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(names, args.gpu_gib or H100_GIB)
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"gpu_check: missing Python packages {', '.join(missing)}: bring them as wheels "
              "(docs/gpu.md#wheels: scripts/gpu_wheels.sh here, then pip install --target there)", file=sys.stderr)
        return 2
    env = environment()
    pins = pinned()
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    for pkg in ("torch", "transformers"):
        if env[pkg].split("+")[0] != pins.get(pkg):
            print(f"note: {pkg} {env[pkg]} here, {pins.get(pkg)} pinned in requirements.txt")
    if env["gpu"] is None and not args.small:
        print(f"gpu_check: no CUDA device visible to torch {env['torch']} (CUDA {env['cuda']}); "
              "--small rehearses the script on CPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    ctx = Context(out=os.path.abspath(args.out), models=args.models, runs="/tmp/pspo-gpu-runs", small=args.small)
    ctx.summary = {"env": env, "smoke": None, "sections": {}, "not_measured": []}
    earlier = read_json(os.path.join(ctx.out, "summary.json"))      # calls into one OUT add up (10-minute calls)
    if earlier:
        ctx.summary["sections"] = {k: v for k, v in earlier.get("sections", {}).items() if k not in names}
        ctx.summary["not_measured"] = [n for n in earlier.get("not_measured", [])
                                       if n.split(":")[0] not in names and not n.startswith(("vLLM", "smoke"))]
    if importlib.util.find_spec("vllm") is None:
        ctx.summary["not_measured"].append("vLLM's ms per step and the sync check on a GPU: vLLM is not installed")
    if env["gpu"] is not None:
        with open(os.path.join(ctx.out, "smoke.log"), "w") as log:
            status = run_child([sys.executable, os.path.abspath(__file__), "--smoke",
                                os.path.join(ctx.out, "smoke.json")], log, 120)
        ctx.summary["smoke"] = read_json(os.path.join(ctx.out, "smoke.json"))
        if status != "ok":       # the sections still run: each fails on its own, and the log says why
            print(f"gpu_check: the smoke test failed ({status}); see {ctx.out}/smoke.log", file=sys.stderr)
            ctx.summary["not_measured"].append(f"smoke test: {status} (smoke.log)")
    gpu_gib = env["gpu_gib"] or H100_GIB
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # `timeout` around the check: still a summary
    try:
        for name in names:
            run_section(BY_NAME[name], ctx, gpu_gib)
    finally:
        if not args.keep_models:
            shutil.rmtree(args.models, ignore_errors=True)
        shutil.rmtree(ctx.runs, ignore_errors=True)
        write_summary(ctx)
    print(f"\nsummary: {ctx.out}/summary.md, {ctx.out}/summary.json")
    print(markdown(ctx.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
