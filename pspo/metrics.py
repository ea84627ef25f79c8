"""Step metrics: one JSON object per line in <output_dir>/metrics.jsonl, and TensorBoard scalars.

Only rank 0 writes; other ranks get a logger that does nothing, so the loop calls
`logger.log(step, metrics)` unconditionally. Keys are documented in README ("Metrics").
"""
from __future__ import annotations

import json
import math
import os


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
        self.writer = SummaryWriter(os.path.join(output_dir, "tb"), purge_step=resume_step + 1 if resume_step else None)

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
