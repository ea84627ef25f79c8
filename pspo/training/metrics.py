"""Step metrics: one JSON object per line in <output_dir>/metrics.jsonl, and TensorBoard scalars; and the
prompts each step drew, one line per draw in <output_dir>/prompts.jsonl (`MetricsLogger.log_prompts`).

Only rank 0 writes; other ranks get a logger that does nothing, so the loop calls
`logger.log(step, metrics)` unconditionally. Keys are documented in README ("Metrics").
`StepClock` times the step's phases (the loop's one clock). The step's statistics are typed records,
one per producer: the advantage method's (`MethodStats`: its completions' `RolloutSums`, its
`AdvantageSums`, SPO's `ChainSums` / `TreeSums`), the optimizer step's (`UpdateSums`) and the counted
engine's (`GenerationCounts`); each holds this rank's sums, and `step_metrics` sums them over ranks and
turns them into the logged means. A field's name is its logged key where it is logged as a sum.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from pspo.estimators import group_mean
from pspo.loss import GATED
from pspo.training import distributed
from pspo.training.compiled import take_counts
from pspo.training.config import Config, report_sinks


class StepClock:
    """Wall-clock seconds of one step's phases (this rank's), keyed by metric name; a phase timed
    twice adds up."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, key: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t)

    def add(self, key: str, seconds: float) -> None:
        self.times[key] = self.times.get(key, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass
class RolloutSums:
    """This rank's sums over the completions a step scored (SPO-tree: its trees' leaves)."""
    completions: float            # n
    groups: float                 # prompts, G completions each (SPO-tree: trees)
    completion_tokens: float      # tokens the masks keep
    reward: float                 # Σ R
    reward_sq: float              # Σ R²
    accuracy: float               # Σ accuracy reward
    format: float                 # Σ format reward
    zero_std_groups: float        # groups whose rewards are all equal
    truncated: float              # completions that hit their token budget
    reward_failures: float        # reward calls that failed (timeout, error)
    overlong: float = 0.0         # Σ R_length, DAPO's soft overlong punishment (reward.overlong_cache)


@dataclass
class AdvantageSums:
    """|A| and A² summed over what a method's advantages are counted on (GRPO: completions; the
    token methods: the loss mask's tokens), and their count, before the IS weights."""
    adv_abs: float
    adv_sq: float
    adv_count: float


@dataclass
class ChainSums:
    """SPO-chain's counts on this rank (docs/related.md §B chain), logged as sums."""
    spo_cuts: float               # C cut points
    spo_states: float             # U distinct states continued
    spo_mask_tokens: float        # Σ M


@dataclass
class TreeSums:
    """SPO-tree's counts on this rank (docs/related.md §B tree), logged as sums; the buffer's two
    replicated counts are counted on rank 0 only."""
    spo_nodes: float              # nodes grown below the roots
    spo_new_edges: float          # edges added to the replay buffer
    spo_edges: float              # edges trained
    spo_buffer: float             # edges left in the buffer
    spo_expired: float            # edges that expired unused


@dataclass
class MethodStats:
    """What an advantage method reports of its step (methods.py)."""
    rollout: RolloutSums
    advantages: AdvantageSums
    spo: ChainSums | TreeSums | None = None


@dataclass
class UpdateSums:
    """The optimizer step's sums over its iterations and micro-batches (update.py; loss.policy_loss)."""
    skipped_steps: float          # optimizer steps skipped for a non-finite loss or gradient norm
    update_positions: float       # positions the micro-batches computed (rows x their longest row)
    update_tokens: float          # prompt + completion tokens among them
    grad_norm: float              # Σ over iterations of the gradient norm before clipping
    pg_loss: float                # Σ_i w_i Σ_t M·pg, weighted like the loss
    kl: float                     # Σ M·k3 (0 without π_ref)
    tokens: float                 # Σ M
    entropy: float                # Σ M·entropy
    ratio: float = 0.0            # Σ M·ρ
    clipped_tokens: float = 0.0   # Σ M·1[the objective's bound changed the token's term] (a clipping objective)
    clipped_seqs: float = 0.0     # completions holding a clipped token (a clipping objective)
    seqs: float = 0.0             # completions with a token in the loss (a clipping objective)
    gate: float = 0.0             # Σ M·gate (an objective of loss.GATED: SAPO's 4σ(1-σ))


@dataclass
class GenerationCounts:
    """The counted engine's tokens, calls and seconds since its last `take` (rollout.CountingEngine):
    fresh completions (rollout_) and continuations of a prefix (mc_)."""
    rollout_tokens: float = 0.0
    mc_tokens: float = 0.0
    rollout_calls: float = 0.0
    mc_calls: float = 0.0
    rollout_gen_s: float = 0.0
    mc_gen_s: float = 0.0


def step_metrics(method: MethodStats, update: UpdateSums, counts: GenerationCounts, cfg: Config,
                 device: torch.device) -> tuple[GenerationCounts, UpdateSums, dict[str, float]]:
    """This rank's records summed over ranks (one collective) -> (the generation counts and the update's
    sums of every rank, the logged means (docs/README.md, "Metrics") followed by SPO's counts, the generation
    counts and this process's compile counts since the last step (compiled.py) as sums)."""
    compiles = take_counts()
    records = [method.rollout, method.advantages, update, counts, compiles]
    if method.spo is not None:
        records.append(method.spo)
    gen_s = counts.rollout_gen_s + counts.mc_gen_s
    tokens_per_s = (counts.rollout_tokens + counts.mc_tokens) / max(gen_s, 1e-9)
    values = [float(getattr(r, f.name)) for r in records for f in dataclasses.fields(r)] + [tokens_per_s]
    totals = distributed.all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=device)).tolist()
    summed, start = [], 0
    for r in records:
        width = len(dataclasses.fields(r))
        summed.append(type(r)(*totals[start:start + width]))
        start += width
    rollout, adv, update, counts, compiles, *spo = summed
    # a step that trained no completion (dynamic sampling kept no group): its means are not numbers (null)
    n, groups = rollout.completions or math.nan, rollout.groups or math.nan
    iters, tok = cfg.algo.num_iterations, max(update.tokens, 1.0)
    reward_var = max(rollout.reward_sq / n - (rollout.reward / n) ** 2, 0.0)
    metrics = {
        "reward_mean": rollout.reward / n, "reward_std": math.sqrt(reward_var),
        "accuracy": rollout.accuracy / n, "format_rate": rollout.format / n,
        "adv_abs_mean": adv.adv_abs / max(adv.adv_count, 1.0),      # SPO: over M, which may be empty
        "adv_std": math.sqrt(max(adv.adv_sq / max(adv.adv_count, 1.0), 0.0)),
        # a group of one (G = 1, Single-stream PO) has no spread to lack: null rather than 1
        "zero_std_frac": rollout.zero_std_groups / groups if cfg.rollout.num_generations > 1 else math.nan,
        "loss": update.pg_loss / iters, "kl": update.kl / tok, "ratio_mean": update.ratio / tok,
        "entropy": update.entropy / tok, "response_length": rollout.completion_tokens / n,
        "truncation_rate": rollout.truncated / n, "grad_norm": update.grad_norm / iters,
        "reward_failures": rollout.reward_failures, "gen_tokens_per_s": totals[-1],
        "skipped_steps": round(update.skipped_steps),
        # padded positions / all positions of the update's micro-batches (prompt + completion columns)
        "padding_frac": 1.0 - update.update_tokens / max(update.update_positions, 1.0),
    }
    if cfg.algo.objective in GATED:                # the objective's diagnostic (docs/methods.md §11)
        metrics["gate_mean"] = update.gate / tok
    else:
        metrics["clip_frac"] = update.clipped_tokens / tok
        metrics["clip_seq_frac"] = update.clipped_seqs / max(update.seqs, 1.0)
    if cfg.reward.overlong_cache:
        metrics["overlong_penalty"] = rollout.overlong / n                # the mean R_length (§9)
    sums = {**dataclasses.asdict(counts), **dataclasses.asdict(compiles), **(dataclasses.asdict(spo[0]) if spo else {})}
    metrics.update(sorted(sums.items()))                             # as sums, in key order
    return counts, update, metrics


class MetricsLogger:
    """metrics.jsonl always; TensorBoard and Weights & Biases as train.report_to says (rank 0 only).

    W&B: one run per output folder (its id kept in wandb_id.txt, so a resumed run continues it),
    the resolved config attached, files under the output folder; WANDB_MODE=offline works offline.
    """

    def __init__(self, output_dir: str, enabled: bool, resume_step: int = 0, report_to: str = "tensorboard",
                 run_config: dict | None = None, project: str = "pspo"):
        self.enabled = enabled
        if not enabled:
            return
        sinks = report_sinks(report_to)
        self.file = _open_log(os.path.join(output_dir, "metrics.jsonl"), resume_step)
        self.prompts = _open_log(os.path.join(output_dir, "prompts.jsonl"), resume_step)     # log_prompts
        self.writer = self.wandb = None
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter  # imported late: tensorboard is slow to import
            self.writer = SummaryWriter(os.path.join(output_dir, "tb"),
                                        purge_step=resume_step + 1 if resume_step else None)
        if "wandb" in sinks:
            self.wandb = _wandb_run(output_dir, run_config or {}, project, resume_step > 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        values = {key: value for key, value in record.items() if key != "step" and value is not None}
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_prompts(self, step: int, indices: Tensor, accuracy: Tensor, num_prompts: int) -> None:
        """One draw of `step` (1-based, as in metrics.jsonl; dynamic sampling draws several) as a line of
        prompts.jsonl: the train rows generated (P,), each group's mean accuracy from accuracy (P, G), and the
        train set's size N, for the starvation measures of bench/selection.py (which prompts a run keeps
        drawing, which it leaves). A few bytes per prompt; every rank holds them after the rewards' gather."""
        if not self.enabled:
            return
        record = {"step": step, "prompts": num_prompts, "rows": indices.tolist(),
                  "accuracy": [round(a, 4) for a in group_mean(accuracy.float()).tolist()]}
        self.prompts.write(json.dumps(record) + "\n")
        self.prompts.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.prompts.close()
            if self.writer is not None:
                self.writer.close()
            if self.wandb is not None:
                self.wandb.finish()


def _wandb_run(output_dir: str, run_config: dict, project: str, resumed: bool):
    """A W&B run for this output folder: a resumed run continues the one its id file names; a fresh
    run starts a new one (and writes its id)."""
    import wandb
    id_file = os.path.join(output_dir, "wandb_id.txt")
    if resumed and os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
    return wandb.init(project=project, id=run_id, resume="allow", dir=output_dir, config=run_config,
                      name=os.path.basename(os.path.normpath(output_dir)))


def _clean(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _open_log(path: str, resume_step: int):
    """A JSON-lines log of the run: a fresh run starts a fresh file; a resumed one keeps the lines up to the
    step it resumed from and appends."""
    if resume_step > 0:
        _truncate_after(path, resume_step)          # drop lines logged after the resumed checkpoint
    return open(path, "a" if resume_step > 0 else "w")


def _truncate_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path, "w") as f:
        f.writelines(kept)


def gpu_memory(device) -> dict[str, float]:
    """This step's peak GPU memory held by PyTorch tensors (GiB), then the peak is reset; {} on CPU.

    `peak_mem_gib` is what the plan's `tensors` figure predicts (train.py's start-up line, `--plan`: the
    larger phase's PyTorch tensors); reserved adds the allocator's cached blocks.
    """
    if device.type != "cuda":
        return {}
    out = {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}
    torch.cuda.reset_peak_memory_stats(device)
    return out
