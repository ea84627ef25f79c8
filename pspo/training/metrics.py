"""Step metrics: one JSON object per line in <output_dir>/metrics.jsonl, and TensorBoard scalars.

Only rank 0 writes; other ranks get a logger that does nothing, so the loop calls
`logger.log(step, metrics)` unconditionally. Keys are documented in README ("Metrics").
`StepClock` times the step's phases; `step_record` sums this rank's statistics over ranks and
`step_metrics` turns the sums into the logged means.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator

from pspo.training import distributed
from pspo.training.config import Config


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


def step_record(local: dict[str, float], counts: dict[str, float], cfg: Config, device) -> tuple[dict, dict]:
    """This rank's statistics (the method's and the update's, `local`) and its generation counts
    (rollout.CountingEngine.take) summed over ranks -> (sums, metrics). Collective."""
    gen_s = counts["rollout_gen_s"] + counts["mc_gen_s"]
    tokens_per_s = (counts["rollout_tokens"] + counts["mc_tokens"]) / max(gen_s, 1e-9)
    sums = distributed.reduce_sums({**local, **counts, "gen_tokens_per_s": tokens_per_s}, device)
    metrics = step_metrics(sums, cfg)
    metrics.update({k: v for k, v in sums.items() if k.startswith("spo_") or k in counts})
    return sums, metrics


class MetricsLogger:
    def __init__(self, output_dir: str, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # imported late: tensorboard is slow to import

        path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step > 0:
            _truncate_after(path, resume_step)      # drop lines logged after the resumed checkpoint
        self.file = open(path, "a" if resume_step > 0 else "w")   # a fresh run starts a fresh file
        self.writer = SummaryWriter(os.path.join(output_dir, "tb"),
                                    purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for key, value in record.items():
            if key != "step" and value is not None:
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.writer.close()


def _clean(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _truncate_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path, "w") as f:
        f.writelines(kept)


def gpu_memory(device) -> dict[str, float]:
    """This step's peak GPU memory held by PyTorch tensors (GiB), then the peak is reset; {} on CPU.

    `peak_mem_gib` is what `train.py --plan` predicts (its update or generation total, less the
    constant it adds for the CUDA context and NCCL); reserved adds the allocator's cached blocks.
    """
    import torch

    if device.type != "cuda":
        return {}
    out = {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}
    torch.cuda.reset_peak_memory_stats(device)
    return out


def step_metrics(sums: dict[str, float], cfg: Config) -> dict[str, float]:
    """Turn rank-summed statistics into the logged means (README, "Metrics")."""
    n, groups, tok = sums["completions"], sums["groups"], max(sums["tokens"], 1.0)
    iters = cfg.algo.num_iterations
    reward_var = max(sums["reward_sq"] / n - (sums["reward"] / n) ** 2, 0.0)
    metrics = {
        "reward_mean": sums["reward"] / n, "reward_std": math.sqrt(reward_var),
        "accuracy": sums["accuracy"] / n, "format_rate": sums["format"] / n,
        "adv_abs_mean": sums["adv_abs"] / max(sums["adv_count"], 1.0),      # SPO: over M, which may be empty
        "adv_std": math.sqrt(max(sums["adv_sq"] / max(sums["adv_count"], 1.0), 0.0)),
        "zero_std_frac": sums["zero_std_groups"] / groups,
        "loss": sums["pg_loss"] / iters, "kl": sums["kl"] / tok, "clip_frac": sums["clipped_tokens"] / tok,
        "entropy": sums["entropy"] / tok, "response_length": sums["completion_tokens"] / n,
        "truncation_rate": sums["truncated"] / n, "grad_norm": sums["grad_norm"] / iters,
        "reward_failures": sums["reward_failures"], "gen_tokens_per_s": sums["gen_tokens_per_s"],
        "skipped_steps": round(sums["skipped_steps"]),
        # padded positions / all positions of the update's micro-batches (prompt + completion columns)
        "padding_frac": 1.0 - sums["update_tokens"] / max(sums["update_positions"], 1.0),
    }
    return metrics
