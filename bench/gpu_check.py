"""The GPU check: the 1.5B recipe's architecture at real widths with random weights, section by section,
the headline figures in priority order, within one 8-minute command of a lent GPU (docs/gpu.md, "GPU check").

    bash scripts/gpu_check.sh OUT [SECTION ...]       # one NVIDIA GPU; default: the default sections
    bash scripts/gpu_check.sh --dry-run [--gpu-gib G] # any machine: the time budget, each section's plan and commands
    bash scripts/gpu_check.sh --small OUT [SECTION]   # any machine: the script itself, CPU stand-in widths

It prints the environment and refuses to start, in one line (exit 2), when a package the check itself
needs is missing or there is no CUDA device; a package only some sections need (peft, TRL, datasets,
math-verify, vLLM) skips those sections, each saying which (docs/gpu.md#wheels brings them). The 1.5B
is built once, in the background beside the smoke test, for every section; a section that loads it
waits for the build until its own deadline. The default sections run in priority order (smoke;
packed forward and backward against unpacked; the update; decoding, the engine's loop before the
one it replaced; one recipe step; TRL's step on the same workload), each as child processes under a
time limit, plain `python` on one process (no torchrun). Each limit holds the section's estimate on
a bare machine with cold compile caches plus a margin; a section that ends early leaves its time to
the next, and the last one ends within the budget (`--dry-run` prints it with every estimate and
margin: 8 minutes with the wheels' install).
Past its limit, a section's children and every process they started are stopped
(bench/child_process.py); one section's failure or exception is recorded and the next one runs.
When the packed check fails, the later sections run unpacked and the summary says so. OUT/summary.json
and OUT/summary.md (a table for bench/RESULTS.md) are written after every section, with what was not
measured and why; each section's children write their own JSON or metrics under OUT as they measure.
Calls into one OUT add up, each section keeping the environment of the call that ran it.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

STARTED = time.monotonic()         # the budget counts from the check's start (its imports included)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.child_process import become_subreaper, run_child  # noqa: E402
from bench.step_time import Workload, train_argv  # noqa: E402

H100_GIB = 79.2                 # what torch reports for an H100 80GB: the dry run's default card
R15 = "configs/qwen2.5-math-1.5b"
R7 = "configs/qwen2.5-7b-instruct-1m"
CORE = ("torch", "transformers", "yaml", "safetensors", "tqdm")   # what the check and every section import
DISTRIBUTIONS = ("datasets", "math-verify", "peft", "trl", "accelerate", "vllm")   # versions in the summary

# The time budget of one lent GPU: 15 minutes of device time with the machine's start, at most 10 per
# command; the check's command (the wheels' install, then the check) is planned at 8 minutes.
SLOT_S = 480
WHEELS_S = 10       # pip install --no-index --no-deps --target of ~3 MB of pure-Python wheels (estimated)
STARTUP_S = 8       # the check's own start: Python, torch's import, the environment (estimated)
# The 1.5B's build, beside the smoke test; the sections that load the model start after its slot. A longer
# build runs on: each such section waits for it until its own deadline, so an overrun costs the first one's time.
BUILD_S = 36        # its slot in the schedule
BUILD_COLD_S = 30   # its estimate: random bf16 init of 1.5B parameters on the CPU, 3 GB written (not timed apart)
MARGIN_S = 7        # stopping the last section's processes, the last summary
COMMAND_TIMEOUT_S = SLOT_S - WHEELS_S   # `timeout` around the check in docs/gpu.md's device command: the slot
                                        # less the wheels' install, at least the check's own budget
SMALL_LIMIT_S = 300  # --small: every section's limit on a CPU (stand-in widths, no budget)


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
    limit_s: int                  # its time limit: its child processes are stopped past it
    default: bool                 # in the default list (run in the order of SECTIONS)
    estimate: str = ""            # what the limit is sized from (measured figures, bench/RESULTS.md)
    models: tuple[Model, ...] = ()
    plans: tuple[PlanCase, ...] = ()
    needs: tuple[str, ...] = ()   # Python modules its children import beyond CORE
    cold_s: int | None = None     # `estimate`'s sum: its seconds on a bare machine, compile caches cold (an
                                  # estimate, parts of it measured; the dry run prints limit_s - cold_s)


QWEN15 = Model("qwen15", f"{R15}/model_config.json")
QWEN7B = Model("qwen7b-4", f"{R7}/model_config.json", layers=4)
STEP_GEN = 256                     # new tokens per completion of the recipe step and TRL's (random weights never stop)
GEN = 512                          # new tokens per completion in the on-request training sections
TRAIN = ("datasets", "math_verify")          # train.py on a JSONL data file, with its rewards
SAMPLES = "data/samples/open-rs.jsonl"
RECIPE = ("--data.train=data/samples/open-rs.jsonl", f"--rollout.max_new_tokens={GEN}", "--rollout.engine=hf")
STEP = (f"--data.train={SAMPLES}", f"--rollout.max_new_tokens={STEP_GEN}")   # + step_time.TIMED on both sides
WARM_STEP = 2                      # train.py's and TRL's steps compared: the first holds train.py's compiles
DECODE = ("static", "static-full")  # the loop under test first, then the one it replaced (the comparison)
WARMUP_TOKENS = 32                 # static-full's first call: its one shape compiled and its CUDA graph recorded

ASYNC_VLLM = ("--rollout.engine=vllm", "--rollout.gpu_memory_utilization=0.3", "--rollout.is_correction=token")
BASELINE = "-baseline"             # the async section's synchronous run: its folder's and metrics file's suffix

SECTIONS = (
    Section("smoke", "a torch.compile'd function (inductor, Triton, the host compiler), the bf16 matmul rate on "
            "8192^3, the attention kernel sdpa picks", 35, True,
            "Python and torch ~5 s, a cold compile ~10 s, the matmuls and one profile ~3 s: ~20 s; beside the build",
            cold_s=20),
    Section("numerics", "packed rows on CUDA (train.packing, the varlen kernel) against unpacked rows and float32, "
            "forward and backward, and sdpa's default kernel against its math kernel: the 1.5B's log-probs and "
            "gradients of 4 sequences up to 2048 tokens; its packed_ok decides whether the later sections pack",
            30, True, "start and the 1.5B's load ~15 s; 6 forward+backward passes of <= 8k tokens, < 1 s each, "
            "and cuDNN's plans (~0.5 s per new shape, ~3 s): ~24 s", (QWEN15,), cold_s=24),
    Section("update", "the update of the bench batch (48 sequences, completions 10-3523 tokens) at the recipe's "
            "token budget (grpo.yaml's train.micro_batch_tokens), packed, with the checkpointing the memory plan "
            "chooses and the CUDA defaults (compiled decoder layers and log-prob head): MFU, real tokens/s, peak "
            "memory; the same update with eager layers and head (--compile never --head eager) beside it, and "
            "their ratio: the defaults chosen by measurement; a profile of one more update: GEMM / attention / "
            "elementwise / idle shares, the attention kernel",
            67, True, "start and load ~15 s; an untimed update with the compiles of the layers (train, with "
            "grad) and the head and cuDNN's plans <= 30 s; one timed update <= 3.8 s (RESULTS §24: eager, "
            "unpacked), one eager <= 4 s; one profiled <= 8 s: <= 61 s", (QWEN15,),
            (PlanCase(f"{R15}/grpo.yaml", ("--rollout.engine=hf",)),), cold_s=61),
    Section("decode", "decoding 48 completions (8 prompts x 6) of the recipe's lengths, up to 3584 new tokens in "
            "the recipe's 4096-position cache: the engine's length-aware loop (static) first, then the loop it "
            "replaced, which reads the whole cache (static-full): ms per step, tokens/s, first call (its "
            "compiles), recompiles, CUDA-graph skips, rows equal to static's", 146, True,
            "load ~10 s and the compiled sampler's check ~5 s; static: its compiles <= 45 s and 2 calls of 3523 "
            "steps (the longest row's budget) at <= 2.3 ms (16 s); static-full: its compile <= 41 s (RESULTS §24, "
            "cold: possibly less after static's, not measured) in a first call of 32 tokens (its one shape), then "
            "one call of 3523 steps at 4.3-6 ms (15-21 s): <= 139 s", (QWEN15,),
            (PlanCase(f"{R15}/grpo.yaml", ("--rollout.engine=hf",)),), cold_s=139),
    Section("recipe", f"configs/qwen2.5-math-1.5b/grpo.yaml, train.py on one process, 2 steps of 48 completions of "
            f"{STEP_GEN} new tokens with the reference model (beta 0.04) and the recipe's rewards: each step's "
            "split generation / rewards / advantages / update, peak memory", 116, True,
            "start and two 1.5B loads ~20 s; step 1 with its compiles: the decoding step (rows and window "
            "dynamic, <= 45 s cold as decode's), the decoder layers for scoring (eval, no grad: pi_old, the "
            "reference) and the update (train) and the head (<= 30 s cold as update's), the attention probe "
            f"(< 1 s), then ~6 s; step 2 ~7 s ({STEP_GEN} steps at <= 6 ms, an update ~4 s): <= 109 s cold, less "
            "with inductor's on-disk caches (FX graph, AOTAutograd; on by default) warm from update and decode, "
            "which leave dynamo's tracing (not measured: step 1's step_time_s says); stopped once step 2 is "
            "logged (no final checkpoint)", (QWEN15,),
            (PlanCase(f"{R15}/grpo.yaml", STEP + ("--rollout.engine=hf",)),), TRAIN, cold_s=109),
    Section("trl", "TRL's GRPOTrainer on the recipe step's workload (the same config, prompts, rewards, 48 "
            f"completions of {STEP_GEN} tokens, beta 0.04 with its reference model) with transformers' generate, "
            f"2 steps: its step {WARM_STEP} beside train.py's (recipe), the first step of each left out", 55, True,
            f"imports and two 1.5B loads ~20 s; 2 steps of {STEP_GEN} plain-generate steps at 33-40 ms "
            "(RESULTS §24: 8.4-10.2 s) and an update of ~4 s, the first step's first CUDA calls ~1 s: <= 50 s "
            "(TRL has not run on a GPU here: its generate's rate is measured, the rest estimated)",
            (QWEN15,), (), ("trl", "accelerate") + TRAIN, cold_s=50),
    Section("prm", "PSPO*'s PRM (BERT-base size) scoring 48 completions x 20 steps: batched vs one at a time",
            120, False, "RESULTS §24: 1.1 s batched, 5.8 s one at a time, start ~10 s"),
    Section("lora", "configs/qwen2.5-math-1.5b/pspo_lora.yaml (rank-16 adapters, a frozen bf16 base, the reference "
            f"the base itself) for 2 steps of {STEP_GEN} new tokens: step split and peak memory against the full "
            "fine-tuning recipe step's (recipe)", 420, False, "", (QWEN15,),
            (PlanCase(f"{R15}/pspo_lora.yaml", STEP + ("--rollout.engine=hf",)),), ("peft", "accelerate") + TRAIN),
    Section("rpp7b", "configs/qwen2.5-7b-instruct-1m/reinforce_pp.yaml at the 7B's widths, 4 of 28 layers, "
            "2 steps of 64 K&K completions: peak memory against the plan", 480, False, "", (QWEN7B,),
            (PlanCase(f"{R7}/reinforce_pp.yaml", ("--data.eval=", f"--rollout.max_new_tokens={GEN}",
                                                  "--rollout.engine=hf"), layers=4),), TRAIN),
    Section("spo", "configs/qwen2.5-math-1.5b/spo_tree.yaml, 1 step (6-6-6 trees, 64-token segments): the "
            "share of the step spent growing trees", 420, False, "", (QWEN15,),
            (PlanCase(f"{R15}/spo_tree.yaml", RECIPE + ("--train.prompts_per_step=2", "--spo.segment_tokens=64")),),
            TRAIN),
    Section("vllm", "the sync check made to fail (bench/sync_check.py: peaked logits, one real step, stale vs "
            "synced), then the 1.5B recipe on vLLM (bf16, sleep, token TIS), 3 steps at lr 1e-5 with a sync check each "
            "at the default tolerance: weight sync s, engine gap, sync gap", 480, False, "", (QWEN15,),
            (PlanCase(f"{R15}/grpo.yaml", ("--data.train=data/samples/open-rs.jsonl", f"--rollout.max_new_tokens={GEN}",
                                           "--rollout.engine=vllm", "--rollout.sleep=true")),), ("vllm",) + TRAIN),
    Section("async", "one step off on one GPU (docs/gpu.md \"One step off\"): the recipe step's workload (48 "
            f"completions of {STEP_GEN} new tokens, token TIS) on vLLM at 0.3 of the GPU, 3 steps synchronous "
            "(vLLM in process), then 3 steps with rollout.mode=async (a vLLM engine process sharing the GPU, lag 1, "
            "a sync check at each version): step times side by side, the wait for generation, the engine's "
            "generation and idle seconds, the weight transfer's seconds and bytes", 480, False,
            "per run: start and the 1.5B's loads ~20 s, vLLM's start with its CUDA graphs ~60-90 s, 3 steps of "
            "~10-20 s", (QWEN15,), (PlanCase(f"{R15}/grpo.yaml", STEP + ASYNC_VLLM),), ("vllm",) + TRAIN),
)
BY_NAME = {s.name: s for s in SECTIONS}
DEFAULT = [s.name for s in SECTIONS if s.default]
BACKGROUND = QWEN15                # the model built beside the smoke test, for every section that loads it
BUILD_STEP = f"build {BACKGROUND.name} (in the background)"


@dataclass
class Child:
    """One child process of a section; `done()` true ends it early: its figures are in."""
    argv: list[str]
    done: Callable[[], bool] | None = None


@dataclass
class Context:
    out: str
    models: str                    # where the models are built
    runs: str                      # train.py's output folders
    small: bool                    # CPU rehearsal: stand-in widths, tiny shapes
    python: str = sys.executable
    packing: bool = True           # the later sections pack (numerics' packed_ok, or not checked)
    summary: dict = field(default_factory=dict)

    def model(self, m: Model) -> str:
        return os.path.join(self.models, f"{m.name}-{'small' if self.small else 'full'}")


def step_workload(ctx: Context) -> Workload:
    """The recipe step's workload, which train.py (`recipe`) and TRL (`trl`) both run."""
    overrides = [f"--model.name_or_path={ctx.model(QWEN15)}", *STEP]
    if ctx.small:
        overrides += ["--train.prompts_per_step=2", "--rollout.num_generations=2", "--rollout.max_new_tokens=16"]
    if not ctx.packing:
        overrides.append("--train.packing=false")
    return Workload(config=f"{R15}/grpo.yaml", overrides=tuple(overrides), steps=2)


def logged_steps(path: str) -> int:
    """How many steps a train.py metrics.jsonl holds."""
    return sum("step_time_s" in row for row in read_metrics(path))


def train_child(ctx: Context, section: Section, config: str, model: Model, steps: int, *overrides: str,
                gen: int = GEN, tag: str = "") -> Child:
    """train.py on one process (no torchrun), ended once its last step is logged (the final checkpoint,
    up to ~18 GB for the 1.5B, is not needed); its folder is the section's name + `tag`."""
    run = os.path.join(ctx.runs, section.name + tag)
    gen = "16" if ctx.small else str(gen)
    argv = [ctx.python, "train.py", "--config", config, f"--model.name_or_path={ctx.model(model)}",
            f"--train.output_dir={run}", f"--rollout.max_new_tokens={gen}", "--train.save_steps=0",
            "--train.report_to=none", "--train.progress=false", "--rollout.engine=hf", "--data.eval=",
            *([] if ctx.packing else ["--train.packing=false"]), *overrides, f"--train.max_steps={steps}"]
    return Child(argv, lambda: logged_steps(os.path.join(run, "metrics.jsonl")) >= steps)


def commands(section: Section, ctx: Context) -> list[Child]:
    """The child processes a section runs, in order (each writes its figures under ctx.out)."""
    py, small = ctx.python, ctx.small
    j = lambda tag="": os.path.join(ctx.out, f"{section.name}{tag}.json")   # noqa: E731
    if section.name == "smoke":
        return [Child([py, "bench/gpu_check.py", "--smoke", j(), *(["--small"] if small else [])])]
    if section.name == "numerics":
        shape = ["--rows", "2", "--max-len", "64"] if small else ["--rows", "4", "--max-len", "2048"]
        return [Child([py, "bench/attention_numerics.py", "--model", ctx.model(QWEN15), "--bf16", *shape,
                       "--json", j()])]
    if section.name == "update":
        shape = (["--sequences", "3", "--max-completion", "32", "--max-prompt", "16", "--budget", "256"] if small
                 else ["--sequences", "48", "--max-completion", "3584", "--max-prompt", "512",
                       "--budget", str(recipe_budget())])
        shape += ["--warmup", "1", "--reps", "1"]
        return [Child([py, "bench/micro_batches.py", "--model", ctx.model(QWEN15), "--bf16", *shape,
                       "--modes", "packed" if ctx.packing else "token budget", "--checkpointing", "auto",
                       "--against-eager", "--profile", "--json", j()])]
    if section.name == "decode":
        shape = (["--prompts", "2", "--n", "2", "--max-new-tokens", "16", "--cache-len", "64"] if small
                 else ["--prompts", "8", "--n", "6", "--max-new-tokens", "3584", "--cache-len", "4096"])
        warm = "4" if small else str(WARMUP_TOKENS)
        return [Child([py, "bench/rollout.py", "--model", ctx.model(QWEN15), "--bf16", "--engines", *DECODE,
                       *shape, "--lengths", "recipe", "--repeats", "1", "--warmup-tokens", warm, "--json", j()])]
    if section.name == "recipe":
        w = step_workload(ctx)
        run = os.path.join(ctx.runs, section.name)
        return [Child(train_argv(w, run, python=py),
                      lambda: logged_steps(os.path.join(run, "metrics.jsonl")) >= w.steps)]
    if section.name == "trl":
        w = step_workload(ctx)
        return [Child([py, "bench/step_time.py", "--config", w.config, "--steps", str(w.steps), "--trl-only", j(),
                       "--trl-micro", "6" if small else "16", "--", *w.overrides])]
    if section.name == "prm":
        return [Child([py, "bench/prm_scoring.py", *(["--small", "--completions", "8", "--steps", "5"] if small
                                                    else []), "--json", j()])]
    if section.name == "lora":
        return [train_child(ctx, section, f"{R15}/pspo_lora.yaml", QWEN15, 2, f"--data.train={SAMPLES}",
                            gen=STEP_GEN)]
    if section.name == "rpp7b":
        return [train_child(ctx, section, f"{R7}/reinforce_pp.yaml", QWEN7B, 2)]
    if section.name == "spo":
        return [train_child(ctx, section, f"{R15}/spo_tree.yaml", QWEN15, 1, f"--data.train={SAMPLES}",
                            "--train.prompts_per_step=2", f"--spo.segment_tokens={'4' if small else '64'}")]
    if section.name == "vllm":
        gen = "16" if small else str(GEN)
        return [Child([py, "bench/sync_check.py", "--model", ctx.model(QWEN15), "--bf16", "--max-new-tokens", gen,
                       "--json", j("-sync")]),
                train_child(ctx, section, f"{R15}/grpo.yaml", QWEN15, 3, f"--data.train={SAMPLES}",
                            "--rollout.engine=vllm", "--rollout.sleep=true", "--rollout.is_correction=token",
                            "--rollout.sync_check_steps=1", "--optim.lr=1e-5")]
    if section.name == "async":
        both = (f"{R15}/grpo.yaml", QWEN15, 3, f"--data.train={SAMPLES}", *ASYNC_VLLM)
        return [train_child(ctx, section, *both, gen=STEP_GEN, tag=BASELINE),
                train_child(ctx, section, *both, "--rollout.mode=async", "--rollout.sync_check_steps=1",
                            gen=STEP_GEN)]
    raise ValueError(section.name)


# ---- the time budget ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """One step of the time budget, in seconds: its cold estimate (None where the slot itself is one: the
    start-up, the stop; or for a section not estimated), its limit, and when it ends at the latest, from
    the check's start."""
    step: str
    cold_s: int | None
    limit_s: int
    ends_s: int

    @property
    def margin_s(self) -> int | None:
        return None if self.cold_s is None else self.limit_s - self.cold_s


def schedule(names: list[str]) -> list[Slot]:
    """The time budget of a run of these sections: the start-up, the background build (beside the
    sections that need no model), each section in order, the stop. A section that loads the background
    model starts after the build's slot in the plan; a section ends by its `ends_s` whenever it started."""
    rows, clock = [Slot("start-up: Python, torch, the environment", None, STARTUP_S, STARTUP_S)], STARTUP_S
    build = any(BACKGROUND in BY_NAME[n].models for n in names)
    built_by = clock + BUILD_S if build else clock
    if build:
        rows.append(Slot(BUILD_STEP, BUILD_COLD_S, BUILD_S, built_by))
    for name in names:
        s = BY_NAME[name]
        if BACKGROUND in s.models:
            clock = max(clock, built_by)
        clock += s.limit_s
        rows.append(Slot(name, s.cold_s, s.limit_s, clock))
    clock = max(clock, built_by) + MARGIN_S
    rows.append(Slot("stop, last summary", None, MARGIN_S, clock))
    return rows


def build_ends_s(names: list[str]) -> int | None:
    """When the background build must end at the latest, in seconds from the check's start: the deadline of
    the last section that loads the model (each waits for it until its own), not the build's slot; None
    when no section loads it."""
    ends = {slot.step: slot.ends_s for slot in schedule(names)}
    loading = [n for n in names if BACKGROUND in BY_NAME[n].models]
    return ends[loading[-1]] if loading else None


def budget_s(names: list[str]) -> int:
    """The whole command's seconds: the wheels' install, then the check."""
    return WHEELS_S + schedule(names)[-1].ends_s


def recipe_budget() -> int:
    """The 1.5B recipe's token budget (train.micro_batch_tokens of grpo.yaml): what the update section measures."""
    from pspo.training.config import load_config
    return load_config(f"{R15}/grpo.yaml", []).train.micro_batch_tokens


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


def dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def dry_run(names: list[str], gpu_gib: float) -> int:
    """Print the time budget, every section's plan and commands; 1 if a plan does not fit."""
    ctx = Context(out="OUT", models="MODELS", runs="RUNS", small=False, python="python3")
    total = budget_s(names)
    print(f"GPU check, dry run at {gpu_gib:g} GiB: {' '.join(names)}\n")
    print("Time budget of one command on a lent GPU: each section's estimate on a bare machine with cold compile "
          "caches (its parts below, \"sized from\"), its limit and the margin between them (a limit is a ceiling: "
          "a section that ends early leaves its time to the next):\n")
    print("| step | cold estimate s | limit s | margin s | ends by s |\n|---|---:|---:|---:|---:|")
    print(f"| wheels: pip install --no-index --target (docs/gpu.md#wheels) | - | {WHEELS_S} | - | {WHEELS_S} |")
    for slot in schedule(names):
        print(f"| {slot.step} | {dash(slot.cold_s)} | {slot.limit_s} | {dash(slot.margin_s)} | "
              f"{WHEELS_S + slot.ends_s} |")
    verdict = "fits" if total <= SLOT_S else "does NOT fit"
    print(f"\nin all {total} s: {verdict} in {SLOT_S // 60} minutes ({SLOT_S} s); the device command "
          f"(docs/gpu.md) runs the check under `timeout -k 10 {COMMAND_TIMEOUT_S}`, its own budget "
          f"{total - WHEELS_S} s")
    short = [f"{slot.step} ({slot.margin_s} s)" for slot in schedule(names) if (slot.margin_s or 0) < 0]
    estimated = [slot.margin_s for slot in schedule(names) if slot.margin_s is not None]
    if short:
        print(f"estimates over their limit: {', '.join(short)}")
    elif estimated:
        print(f"every estimate within its limit: the smallest margin {min(estimated)} s")
    bad = 0
    for name in names:
        s = BY_NAME[name]
        cold = f" (cold estimate {s.cold_s} s, margin {s.limit_s - s.cold_s} s)" if s.cold_s is not None else ""
        print(f"\n[{name}] {'default' if s.default else 'on request'}, limit {s.limit_s} s{cold}"
              f"{', needs ' + ', '.join(s.needs) if s.needs else ''}: {s.what}")
        if s.estimate:
            print(f"  sized from: {s.estimate}")
        for m in s.models:
            print(f"  model {m.name}: {m.config} at real widths{f', {m.layers} layers' if m.layers else ''}"
                  f"{' (built in the background)' if m == BACKGROUND else ''}")
        for case in s.plans:
            peak, fits, verdict = plan_case(case, gpu_gib)
            bad += not fits
            print(f"  plan {case.config} {' '.join(case.overrides)}"
                  f"{f' ({case.layers} layers)' if case.layers else ''}: {verdict}")
        for child in commands(s, ctx):
            print("  $ " + " ".join(child.argv))
    print(f"\n{'every plan fits' if not bad else f'{bad} plan(s) do not fit'} on one GPU of {gpu_gib:g} GiB")
    return 1 if bad else 0


# ---- the environment and the smoke test --------------------------------------------------------

def version(dist: str) -> str | None:
    """An installed distribution's version from its metadata (nothing imported: a broken package
    cannot stop the check); None if absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """What the machine has: versions, the GPU, the commit."""
    import torch
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": version("transformers"), "gpu": None, "gpu_gib": None,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_gib=round(props.total_memory / 2 ** 30, 1))
    env.update({dist: version(dist) for dist in DISTRIBUTIONS})
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
            name, _, version_ = line.split("#")[0].strip().partition("==")
            if version_:
                pins[name] = version_
    return pins


def smoke(path: str, small: bool) -> None:
    """The smoke test, in a child process: a compiled function, a bf16 matmul, sdpa's kernel (on CUDA;
    --small: the matmul on CPU at a small size, no compile (inductor's CPU path is not what a GPU runs)
    and no kernel names)."""
    import torch
    import torch.nn.functional as F
    device = "cpu" if small else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    figures: dict = {"device": device, "compile_ok": None, "compile_s": None}
    if device == "cuda":
        start = time.perf_counter()
        f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
        x = torch.randn(1024, device=device)
        figures["compile_ok"] = bool(torch.allclose(f(x), torch.sin(x) * 2 + 1, atol=1e-5))
        figures["compile_s"] = time.perf_counter() - start
    n = 512 if small else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    sync()
    figures["bf16_matmul_tflops"] = 10 * 2 * n ** 3 / (time.perf_counter() - t) / 1e12
    figures["sdpa_kernels"] = []
    if device == "cuda":
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
    compiled = {None: "not run", True: f"ok in {figures['compile_s'] or 0:.1f} s",
                False: "WRONG"}[figures["compile_ok"]]
    print(f"smoke: compile {compiled}; bf16 matmul {figures['bf16_matmul_tflops']:.1f} TFLOP/s on {device}; "
          f"sdpa ran {figures['sdpa_kernels']}")


# ---- figures and the summary -------------------------------------------------------------------

def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def read_metrics(path: str) -> list[dict]:
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:           # a line being written
                    pass
    except OSError:
        pass
    return rows


STEP_KEYS = ("step_time_s", "gen_s", "reward_s", "advantages_s", "update_s", "sync_s", "peak_mem_gib",
             "peak_reserved_gib", "update_tokens_per_s", "gen_tokens_per_s", "mc_gen_s", "weight_sync_s",
             "sync_gap_mean", "sync_gap_max", "engine_gap_mean", "engine_gap_max", "tis_weight_mean",
             "rollout_lag", "engine_gen_s", "engine_idle_s", "engine_load_s", "weight_sync_bytes", "sync_stale_rows")


def figures(section: Section, ctx: Context) -> dict:
    """The section's figures from the files its children wrote (absent ones are left out); ValueError
    for a file that holds no JSON object."""
    if section.name in ("smoke", "numerics", "update", "decode", "prm", "trl"):
        found = read_json(os.path.join(ctx.out, f"{section.name}.json")) or {}
        if not isinstance(found, dict):
            raise ValueError(f"{section.name}.json holds a {type(found).__name__}, not an object")
        return found
    sync = read_json(os.path.join(ctx.out, f"{section.name}-sync.json"))

    def rows(tag: str = "") -> list[dict]:
        kept = os.path.join(ctx.out, f"{section.name}{tag}.metrics.jsonl")
        return read_metrics(kept if os.path.isfile(kept) else os.path.join(ctx.runs, section.name + tag,
                                                                            "metrics.jsonl"))

    steps = lambda found: [{k: r[k] for k in STEP_KEYS if k in r} for r in found if "step_time_s" in r]  # noqa: E731
    found = rows()
    return {"steps": steps(found), "eval": [r for r in found if "eval_accuracy" in r],
            **({"sync_check": sync} if sync else {}),
            **({"baseline_steps": steps(rows(BASELINE))} if section.name == "async" else {})}


def unreadable(e: Exception) -> str:
    return f"figures unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def not_measured(summary: dict) -> list[str]:
    """What the summary lacks, and why: every section that did not end "ok" or whose figures could not be
    read, and the notes."""
    return [f"{name}: {s['status']}" for name, s in summary["sections"].items() if s["status"] != "ok"] \
        + [f"{name}: {s['figures_error']}" for name, s in summary["sections"].items() if s.get("figures_error")] \
        + summary.get("notes", [])


def env_line(env: dict) -> str:
    extra = ", ".join(f"{k} {env[k]}" for k in DISTRIBUTIONS if env.get(k))
    return (f"{env.get('gpu') or 'no GPU'} ({env.get('gpu_gib')} GiB), torch {env.get('torch')} (CUDA "
            f"{env.get('cuda')}), transformers {env.get('transformers')}{', ' + extra if extra else ''}; "
            f"{env.get('date')}, commit {env.get('commit')}")


def markdown(summary: dict) -> str:
    """The summary as Markdown, ready for bench/RESULTS.md."""
    calls = summary.get("calls", [])
    lines = [f"GPU check, call {i + 1}: {env_line(env)}" for i, env in enumerate(calls)]
    packing = summary.get("packing")
    if packing:
        lines.append(f"Packing: {'on' if packing['packed'] else 'OFF: the sections after numerics ran unpacked'} "
                     f"({packing['why']})")
    lines += ["", "| section | call | status | s | figure | value |", "|---|---:|---|---:|---|---|"]
    for name, s in summary["sections"].items():
        try:
            rows = list(key_figures(name, s.get("figures") or {}, summary)) or [("-", "-")]
        except Exception as e:              # figures of another shape than this table reads: said, not raised
            rows = [("-", unreadable(e))]
        if s.get("figures_error"):
            rows = [("-", s["figures_error"])]
        if s.get("plan_gib"):
            rows.append(("memory plan peak GiB (an upper bound)", " / ".join(map(str, s["plan_gib"]))))
        call = "" if s.get("call") is None else s["call"] + 1
        for i, (what, value) in enumerate(rows):
            head = f"| {name} | {call} | {s['status']} | {s['seconds']:.0f} |" if i == 0 else "| | | | |"
            lines.append(f"{head} {what} | {value} |")
    missing = not_measured(summary)
    if missing:
        lines += ["", "Not measured:"] + [f"- {n}" for n in missing]
    return "\n".join(lines) + "\n"


def number(value, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def key_figures(name: str, f: dict, summary: dict):
    """(figure, value) pairs of one section for the Markdown table."""
    if name == "smoke" and f:
        yield ("bf16 matmul TFLOP/s / compile ok, s / sdpa kernels",
               f"{number(f.get('bf16_matmul_tflops'), '.0f')} / {f.get('compile_ok')}, "
               f"{number(f.get('compile_s'), '.1f')} / {', '.join(f.get('sdpa_kernels') or [])[:80] or '-'}")
    elif name == "numerics" and f:
        yield ("packed_ok (packed forward and backward = unpacked within tolerance)", str(f.get("packed_ok", "-")))
        for key, value in f.items():
            if "kernel" in key:                          # which kernels ran: names, possibly long
                shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
                yield (key.replace("_", " "), shown.replace("|", "/")[:160])
        for key, value in f.items():
            if key.startswith(("logp_gap_", "grad_")):
                shown = " / ".join(number(v, ".1e") for v in value) if isinstance(value, list) else number(value, ".1e")
                yield (key.replace("_", " ") + (" (max / mean)" if isinstance(value, list) else ""), shown)
    elif name == "update" and f:
        for mode, m in f.get("modes", {}).items():
            yield (f"{mode}, budget {f.get('budget')}, checkpointing {f.get('checkpointing')}: MFU / real tok/s / "
                   "update s / padded / peak alloc, reserved GiB",
                   f"{number(m.get('mfu'), '.1%')} / {number(m.get('real_tokens_per_s'), ',.0f')} / "
                   f"{number(m.get('update_s'))} / {number(m.get('padded_share'))} / "
                   f"{number(m.get('peak_allocated_gib'), '.1f')}, {number(m.get('peak_reserved_gib'), '.1f')}")
        e = f.get("against_eager")
        if e:
            default = (f.get("modes") or {}).get(e.get("mode")) or {}
            yield (f"{e.get('mode')}, eager layers and head (--compile never --head eager): MFU / real tok/s / "
                   "update s / peak alloc, reserved GiB",
                   f"{number(e.get('mfu'), '.1%')} / {number(e.get('real_tokens_per_s'), ',.0f')} / "
                   f"{number(e.get('update_s'))} / {number(e.get('peak_allocated_gib'), '.1f')}, "
                   f"{number(e.get('peak_reserved_gib'), '.1f')}")
            yield (f"eager / defaults update s (layers {'compiled' if f.get('compiled') else 'eager'}, head "
                   f"{f.get('head')}; > 1: the defaults are faster)",
                   f"{number(e.get('update_s'))} / {number(default.get('update_s'))} = "
                   f"{number(e.get('eager_over_defaults'))}")
        p = f.get("profile") or {}
        if p:
            yield (f"profile: GEMM / attention ({p.get('attention_backend')}) / elementwise / other / idle",
                   " / ".join(number(p.get(k), ".0%") for k in ("gemm", "attention", "elementwise", "other", "idle")))
    elif name == "decode" and f:
        for r in f.get("runs", []):
            warm = r.get("first_call_max_new_tokens")
            cut = f" ({warm} tokens)" if warm and warm != r.get("max_new_tokens") else ""   # static-full's
            yield (f"{r.get('engine')}, {f.get('rows')} rows, cache {f.get('cache_len')}: ms/step / tok/s / first "
                   "call s / compiles, recompiles, graph skips / rows equal to "
                   f"{f.get('reference') or 'the first engine'}'s",
                   f"{number(r.get('ms_per_step'))} / {number(r.get('tokens_per_s'), ',.0f')} / "
                   f"{number(r.get('first_call_s'), '.1f')}{cut} / {r.get('compiles')}, {r.get('recompiles')}, "
                   f"{r.get('skips')} / {r.get('rows_equal')}")
        ms = {r.get("engine"): r.get("ms_per_step") for r in f.get("runs", [])}
        if ms.get("static") and ms.get("static-full"):
            yield ("static-full / static ms per step", f"{ms['static-full'] / ms['static']:.2f}")
    elif name == "prm" and f:
        yield ("steps/s batched / one at a time s / batched s", f"{number(f.get('steps_per_s'), ',.0f')} / "
               f"{number(f.get('one_at_a_time_s'))} / {number(f.get('batched_s'))}")
    elif name == "trl" and f:
        times, gen = f.get("times", []), f.get("gen_s", [])
        for i, t in enumerate(times, 1):
            generate = gen[i - 1] if i <= len(gen) else None
            yield (f"TRL step {i}: step / generate s", f"{t:.1f} / {number(generate, '.1f')}")
        ours = [r["step_time_s"] for r in (summary["sections"].get("recipe", {}).get("figures") or {}).get("steps", [])]
        what = f"train.py / TRL, step {WARM_STEP} each (step 1 left out: train.py's compiles; goal <= 0.5)"
        if len(ours) >= WARM_STEP and len(times) >= WARM_STEP:
            ours_s, trl_s = ours[WARM_STEP - 1], times[WARM_STEP - 1]
            yield (what, f"{ours_s:.1f} / {trl_s:.1f} = {ours_s / trl_s:.2f}")
        else:                       # never a first step set beside a second: no ratio
            yield (what, f"not measured: train.py logged {len(ours)} step(s), TRL {len(times)}")
    elif name == "async" and f:
        ours, base = f.get("steps", []), f.get("baseline_steps", [])
        for i in range(max(len(ours), len(base))):
            a, b = (ours[i] if i < len(ours) else {}), (base[i] if i < len(base) else {})
            yield (f"step {i + 1}: sync / async step s; async: wait for generation / engine generation / engine "
                   "idle / weight staging / engine load s, MB staged, stale rows",
                   f"{number(b.get('step_time_s'), '.1f')} / {number(a.get('step_time_s'), '.1f')}; "
                   + " / ".join(number(a.get(k)) for k in ("gen_s", "engine_gen_s", "engine_idle_s", "weight_sync_s",
                                                            "engine_load_s"))
                   + f", {number((a.get('weight_sync_bytes') or 0) / 1e6, '.0f')}, "
                   f"{number(a.get('sync_stale_rows'), '.0f')}")
        n = min(len(ours), len(base))             # the same step on both sides, never the first (its compiles)
        if n >= 2 and ours[n - 1].get("step_time_s") and base[n - 1].get("step_time_s"):
            a, b = ours[n - 1]["step_time_s"], base[n - 1]["step_time_s"]
            yield (f"async / sync step s, step {n} each", f"{a:.1f} / {b:.1f} = {a / b:.2f}")
    elif f.get("steps") or f.get("sync_check"):
        if f.get("sync_check"):
            c = f["sync_check"]
            yield (f"sync check on peaked logits (x{c['sharpen']:g}, p {c['mean_sampled_token_prob']:.2f}): mean gap "
                   "synced / stale / resynced; a stale engine caught", f"{c['synced'][1]:.1e} / {c['stale'][1]:.1e} / "
                   f"{c['resynced'][1]:.1e}; {'yes' if c['check_can_fail'] else 'NO'}")
        for i, r in enumerate(f["steps"], 1):
            split = " / ".join(number(r.get(k), ".1f") for k in ("step_time_s", "gen_s", "reward_s", "advantages_s",
                                                                  "update_s"))
            yield (f"step {i}: step / generation / rewards / advantages / update s; peak alloc, reserved GiB",
                   f"{split}; {number(r.get('peak_mem_gib'), '.1f')}, {number(r.get('peak_reserved_gib'), '.1f')}")
            if r.get("mc_gen_s"):
                yield (f"step {i}: tree growth share", f"{r['mc_gen_s'] / r['step_time_s']:.0%}")
            if "sync_gap_mean" in r:
                yield (f"step {i}: weight sync s / sync gap mean / engine gap mean",
                       f"{r.get('weight_sync_s', 0):.2f} / {r['sync_gap_mean']:.2e} / "
                       f"{r.get('engine_gap_mean', 0):.2e}")


def write_summary(ctx: Context) -> None:
    ctx.summary["not_measured"] = not_measured(ctx.summary)
    for name, text in (("summary.json", json.dumps(ctx.summary, indent=1)), ("summary.md", markdown(ctx.summary))):
        tmp = os.path.join(ctx.out, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(ctx.out, name))     # a kill mid-write leaves the previous one whole


def merged(out: str, names: list[str], env: dict) -> dict:
    """The summary of this call: the sections earlier calls into OUT measured and this one does not
    run, each with the environment of its call (summary["calls"]), then this call's."""
    earlier = read_json(os.path.join(out, "summary.json")) or {}
    calls = list(earlier.get("calls") or ([earlier["env"]] if earlier.get("env") else []))
    sections = {}
    for name, s in earlier.get("sections", {}).items():
        if name not in names:
            sections[name] = dict(s, call=s.get("call", len(calls) - 1 if calls else None))
    packing = earlier.get("packing") if "numerics" not in names else None
    return {"env": env, "calls": calls + [env], "packing": packing, "builds": earlier.get("builds", {}),
            "sections": sections, "notes": []}


# ---- running -----------------------------------------------------------------------------------

class Build:
    """The model built in a background thread beside the first sections, for at most `limit` seconds
    (until the last section that loads it has to end: a slow build is waited for, not given up on)."""

    def __init__(self, m: Model, ctx: Context, limit: float):
        self.m, self.ctx, self.status, self.seconds = m, ctx, "running", 0.0
        self.cancel = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(limit,), daemon=True)
        self.thread.start()

    def _run(self, limit: float) -> None:
        start = time.monotonic()
        with open(os.path.join(self.ctx.out, f"build-{self.m.name}.log"), "w") as log:
            self.status = build_model(self.m, self.ctx, log, limit, cancel=self.cancel, echo=False)
        self.seconds = time.monotonic() - start

    def wait(self, timeout: float) -> str:
        """The build's status once it ends, waiting at most `timeout` seconds: "running" if it still runs."""
        self.thread.join(max(0.0, timeout))
        return self.status


def build_model(m: Model, ctx: Context, log, limit: float, cancel: threading.Event | None = None,
                echo: bool = True) -> str:
    path = ctx.model(m)
    if os.path.isdir(path):
        return "ok"
    argv = [ctx.python, "-m", "pspo.offline.standin", m.config, path] + ([] if ctx.small else ["--full"]) \
        + ([] if m.layers is None else ["--layers", str(m.layers)])
    return run_child(argv, log, limit, cwd=ROOT, env=child_env(), cancel=cancel, echo=echo)


def child_env() -> dict:
    """The children's environment: unbuffered output, and offline (the check downloads nothing; a lent
    GPU reaches no network, where a hub lookup would wait for a time-out)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def missing_modules(section: Section) -> list[str]:
    return [m for m in section.needs if importlib.util.find_spec(m) is None]


def packing_verdict(record: dict) -> tuple[bool, str]:
    """Whether the sections after numerics pack, and why: only a numerics section that ran and wrote
    packed_ok true says they may."""
    if record["status"] != "ok":
        return False, f"numerics: {record['status']}"
    ok = record["figures"].get("packed_ok")
    if ok is True:
        return True, "packed forward and backward match unpacked and float32 on this GPU (numerics: packed_ok)"
    return False, "numerics wrote no packed_ok" if ok is None else "numerics: packed_ok false"


def run_section(section: Section, ctx: Context, gpu_gib: float, limit: float, build: Build | None) -> None:
    """Run one section under `limit` seconds and record it; an exception in it is recorded, not raised
    (KeyboardInterrupt and SystemExit, the check being stopped, are raised after the record)."""
    start = time.monotonic()
    record = {"status": "ok", "seconds": 0.0, "limit_s": round(limit), "call": len(ctx.summary["calls"]) - 1,
              "plan_gib": [], "figures": {}}
    ctx.summary["sections"][section.name] = record
    print(f"\n=== [{section.name}] {section.what} (limit {limit:.0f} s)", flush=True)
    try:
        with open(os.path.join(ctx.out, f"{section.name}.log"), "w") as log:
            try:
                _run_section(section, ctx, gpu_gib, start + limit, build, record, log)
            except Exception as e:          # a bug or a bad file in one section: the next one still runs
                log.write(traceback.format_exc())
                record["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    except BaseException:                   # the whole check was stopped: say so, then stop
        record["status"] = "interrupted (the check was stopped)"
        raise
    finally:
        for tag in ("", BASELINE):
            run = os.path.join(ctx.runs, section.name + tag)
            if os.path.isfile(os.path.join(run, "metrics.jsonl")):
                shutil.copy(os.path.join(run, "metrics.jsonl"),
                            os.path.join(ctx.out, f"{section.name}{tag}.metrics.jsonl"))
            shutil.rmtree(run, ignore_errors=True)         # checkpoints of a 1.5B or 7B model fill a disk
        record["seconds"] = time.monotonic() - start
        try:
            record["figures"] = figures(section, ctx)
        except Exception as e:              # a file of another shape: said in the summary, the next section runs
            record["figures"] = {}
            record["figures_error"] = unreadable(e)
        if section.name == "numerics":
            packed, why = packing_verdict(record)
            ctx.packing = packed
            ctx.summary["packing"] = {"packed": packed, "why": why, "call": record["call"]}
        print(f"=== [{section.name}] {record['status']} in {record['seconds']:.0f} s", flush=True)
        write_summary(ctx)


def _run_section(section: Section, ctx: Context, gpu_gib: float, deadline: float, build: Build | None,
                 record: dict, log) -> None:
    missing = missing_modules(section)
    if missing:
        record["status"] = f"skipped: needs {', '.join(missing)} (docs/gpu.md#wheels)"
        return
    if not ctx.small:
        for case in section.plans:
            peak, fits, verdict = plan_case(case, gpu_gib)
            record["plan_gib"].append(round(peak, 1))
            log.write(f"plan {case.config}: {verdict}\n")
            if not fits:
                record["status"] = f"skipped: its plan does not fit ({verdict})"
                return
    for m in section.models:
        if build is not None and m == build.m:                  # waited for until this section's own deadline
            waiting = time.monotonic()
            status = build.wait(deadline - waiting)
            record["build_wait_s"] = round(time.monotonic() - waiting, 1)     # of the section's seconds
            if status == "running":
                record["status"] = f"model {m.name} not built by this section's deadline (still building; " \
                                   f"build-{m.name}.log)"
                return
        else:
            status = build_model(m, ctx, log, deadline - time.monotonic())
        if status != "ok":
            record["status"] = f"model {m.name} not built ({status}; build-{m.name}.log)"
            return
    for child in commands(section, ctx):
        status = run_child(child.argv, log, deadline - time.monotonic(), cwd=ROOT, env=child_env(),
                           done=child.done)
        if status != "ok":
            script = child.argv[1] if child.argv[1] != "-m" else child.argv[2]
            record["status"] = f"{os.path.basename(script)}: {status}"
            return


def main(argv: list[str], started: float | None = None) -> int:
    """The check; `started`: the monotonic time its process started (default: now, less STARTUP_S)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="runs/gpu_check")
    ap.add_argument("sections", nargs="*", help=f"default: {' '.join(DEFAULT)}; "
                    f"on request: {' '.join(s.name for s in SECTIONS if not s.default)}")
    ap.add_argument("--dry-run", action="store_true", help="print the time budget, each section's plan and "
                    "commands; run nothing")
    ap.add_argument("--gpu-gib", type=float, default=None, help=f"the card's memory (dry run default {H100_GIB})")
    ap.add_argument("--small", action="store_true", help="CPU stand-in widths and tiny shapes: the script itself")
    ap.add_argument("--models", default="/tmp/pspo-gpu-models", help="where the models are built (removed after)")
    ap.add_argument("--keep-models", action="store_true")
    ap.add_argument("--smoke", default="", help=argparse.SUPPRESS)          # the child that runs the smoke test
    args = ap.parse_args(argv)
    if args.smoke:
        smoke(args.smoke, args.small)
        return 0
    if args.dry_run and args.out != "runs/gpu_check":          # --dry-run SECTION ...: no OUT folder
        args.sections = [args.out] + args.sections
    unknown = [n for n in args.sections if n not in BY_NAME]
    if unknown:
        print(f"gpu_check: unknown section {unknown[0]!r}; expected one of {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    names = [s.name for s in SECTIONS if s.name in args.sections] if args.sections else DEFAULT   # priority order
    if args.dry_run:
        return dry_run(names, args.gpu_gib or H100_GIB)
    missing = [m for m in CORE if importlib.util.find_spec(m) is None]
    if missing:
        print(f"gpu_check: missing Python packages {', '.join(missing)}: bring them as wheels "
              "(docs/gpu.md#wheels: scripts/gpu_wheels.sh here, then pip install --target there)", file=sys.stderr)
        return 2
    env = environment()
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    pins = pinned()
    for pkg in ("torch", "transformers"):
        if (env[pkg] or "").split("+")[0] != pins.get(pkg):
            print(f"note: {pkg} {env[pkg]} here, {pins.get(pkg)} pinned in requirements.txt")
    if env["gpu"] is None and not args.small:
        print(f"gpu_check: no CUDA device visible to torch {env['torch']} (CUDA {env['cuda']}); "
              "--small rehearses the script on CPU", file=sys.stderr)
        return 2
    for name in names:
        lacking = missing_modules(BY_NAME[name])
        if lacking:
            print(f"note: section {name} needs {', '.join(lacking)}, not installed: it will be skipped "
                  "(docs/gpu.md#wheels)")
    os.makedirs(args.out, exist_ok=True)
    ctx = Context(out=os.path.abspath(args.out), models=args.models, runs="/tmp/pspo-gpu-runs", small=args.small)
    ctx.summary = merged(ctx.out, names, env)
    if ctx.summary["packing"] is not None:
        ctx.packing = ctx.summary["packing"]["packed"]
    if not env.get("vllm"):
        ctx.summary["notes"].append("vLLM's ms per step and the sync check on a GPU: vLLM is not installed")
    write_summary(ctx)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # `timeout` around the check: still a summary
    become_subreaper()              # an orphan of a section's children comes here, to be stopped with them
    t0 = time.monotonic() - STARTUP_S if started is None else started
    ends = {slot.step: slot.ends_s for slot in schedule(names)}
    build = None
    try:
        build_ends = build_ends_s(names)
        if build_ends is not None:
            build = Build(BACKGROUND, ctx, SMALL_LIMIT_S * len(names) if args.small
                          else t0 + build_ends - time.monotonic())
        for name in names:
            limit = SMALL_LIMIT_S if args.small else t0 + ends[name] - time.monotonic()
            run_section(BY_NAME[name], ctx, env["gpu_gib"] or H100_GIB, limit, build)
    finally:
        if build is not None:
            build.cancel.set()
            build.thread.join(30)
            ctx.summary["builds"][BACKGROUND.name] = {"status": build.status, "seconds": round(build.seconds, 1),
                                                     "call": len(ctx.summary["calls"]) - 1}
        if not args.keep_models:
            shutil.rmtree(args.models, ignore_errors=True)
        shutil.rmtree(ctx.runs, ignore_errors=True)
        write_summary(ctx)
    print(f"\nsummary: {ctx.out}/summary.md, {ctx.out}/summary.json")
    print(markdown(ctx.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], started=STARTED))
