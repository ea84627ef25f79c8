"""The optimizer and its learning-rate schedule: AdamW, linear warm-up, then cosine decay over every
optimizer step of the run (max_steps x algo.num_iterations)."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pspo.training.config import Config


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warm-up to optim.lr, then cosine decay to lr * min_lr_ratio over all optimizer steps."""
    total = cfg.train.max_steps * cfg.algo.num_iterations
    warmup, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def build_optimizer(policy: torch.nn.Module, cfg: Config) -> tuple[torch.optim.Optimizer,
                                                                    torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the policy's trainable parameters (with LoRA: the adapters only) and its warm-up +
    cosine schedule.

    On a GPU the fused kernel (one launch per parameter group instead of several per tensor; the
    same update to rounding); on CPU PyTorch's default (foreach).
    """
    o = cfg.optim
    params = [p for p in policy.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                  weight_decay=o.weight_decay, fused=fused or None)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def adopt_optim_config(optimizer: torch.optim.Optimizer, scheduler, cfg: Config) -> None:
    """After a resume, AdamW's settings come from the config like every other field (the saved
    optimizer state would otherwise restore its old lr, betas and weight decay), and the learning
    rate is the config's at the restored step of the schedule."""
    o = cfg.optim
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group.update(initial_lr=o.lr, lr=o.lr * factor, betas=(o.adam_beta1, o.adam_beta2),
                     weight_decay=o.weight_decay)
