"""The run's prompt sampler: `build_sampler` picks uniform sampling (`UniformSampler`, below), PPS
(priority_sampler.py, docs/methods.md §3 and §3b) or the released code's sampler (reference_sampler.py,
§3a) from the config; `importance_weights` hands it the step's scores and returns the IS weights
(docs/methods.md §4); `sampler_metrics` its diagnostics.

The loop asks the sampler for the step's prompt indices and importance weights; the three samplers
answer the same call and keep their state in `state_dict` for exact resume.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pspo.advantages import group_advantages
from pspo.training.config import Config, ConfigError
from pspo.priority_sampler import PrioritySampler, check_resumed_prompts
from pspo.reference_sampler import ReferenceSampler


def build_sampler(cfg: Config, problems: list[str], label: str):
    """The run's sampler over the train set's problems: uniform epochs, PPS (§3 with the §3b
    options) or, with pps.mode=reference, the released code's (§3a; duplicate problems share the
    first row's priority). `label` names the data set in errors."""
    N, B, p, seed = len(problems), cfg.train.prompts_per_step, cfg.pps, cfg.train.seed
    if not p.enabled:
        return UniformSampler(N, seed)
    if B > N:
        raise ConfigError(f"train.prompts_per_step: PPS draws {B} prompts per step ("
                          f"{'of an epoch of N draws' if p.mode == 'reference' else 'distinct'}), "
                          f"{label} has {N}")
    if p.mode == "reference":
        first_row: dict[str, int] = {}
        leaf_of = torch.tensor([first_row.setdefault(problem, i) for i, problem in enumerate(problems)])
        return ReferenceSampler(N, alpha=p.alpha, beta=p.beta, seed=seed, leaf_of=leaf_of)
    return PrioritySampler(N, alpha=p.alpha, beta=p.beta, eps=p.eps, seed=seed,
                           beta_end=None if p.beta_end == -1 else p.beta_end,   # pps.beta_end -1: constant β
                           total_steps=cfg.train.max_steps, priority=p.priority,
                           posterior_decay=p.posterior_decay, is_norm=p.is_norm, uniform_mix=p.uniform_mix,
                           skip=p.skip, skip_rho=p.skip_rho, skip_min=p.skip_min)


def sampler_mode(cfg: Config) -> str:
    """The sampler a run trains with: uniform, or PPS's paper or reference mode (recorded in checkpoints)."""
    return cfg.pps.mode if cfg.pps.enabled else "uniform"


def importance_weights(sampler, cfg: Config, indices: Tensor, weights: Tensor, rewards: Tensor,
                       accuracy: Tensor) -> Tensor:
    """The step's importance weights per completion, (B, G), after the sampler has seen the scores.

    indices (B,) and weights (B,) as `sample` returned them; rewards and accuracy (B, G) of every
    rank. Uniform: the sampled weights (all 1). PPS (docs/methods.md §3): the scored prompts'
    priorities are set from the raw GRPO |A| (priority: posterior, from the accuracy r̂ in [0, 1])
    and the sampler returns the IS weights w (§3a: one per completion). The weight multiplies the
    policy-gradient term of whichever advantage method runs.
    """
    if not cfg.pps.enabled:
        return weights[:, None].expand_as(rewards)
    a = cfg.algo
    abs_advantages = group_advantages(rewards, a.scale_rewards, a.adv_eps).abs()       # (B, G)
    successes = accuracy if cfg.pps.priority == "posterior" else None
    return sampler.update(indices, abs_advantages, successes)


def sampler_metrics(sampler, cfg: Config) -> dict[str, float]:
    """PPS's diagnostics of the step (replicated: the same on every rank); {} for uniform sampling."""
    if not cfg.pps.enabled:
        return {}
    metrics = {f"pps_{k}": v for k, v in sampler.batch_stats().items()}
    skipped = metrics.get("pps_skipped", 0.0)                       # prompts skipped before generation
    metrics["rollouts_saved"] = skipped * cfg.rollout.num_generations
    return metrics


class UniformSampler:
    """Uniform prompt sampling, the GRPO baseline's data order: shuffled epochs over `num_prompts`
    prompts (permutation e seeded by (seed, e)), every prompt once per epoch, importance weights all 1.
    The state is two integers, so resuming reproduces the exact order, and every rank computes the
    same indices without communicating."""

    def __init__(self, num_prompts: int, seed: int = 0):
        if num_prompts < 1:
            raise ValueError("UniformSampler: the dataset has no prompts")
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_prompts, generator=g)

    def sample(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """Next batch_size prompt indices (B,) and weights (B,) (all 1: uniform sampling).

        A batch that crosses an epoch boundary continues into the next permutation; a batch
        larger than the dataset wraps around (a prompt can then appear twice in one batch).
        """
        taken: list[Tensor] = []
        need = batch_size
        while need > 0:
            order = self._order(self.epoch)
            part = order[self.position:self.position + need]
            taken.append(part)
            need -= len(part)
            self.position += len(part)
            if self.position == self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
        indices = torch.cat(taken)
        return indices, torch.ones(batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        check_resumed_prompts(state["num_prompts"], self.num_prompts)
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
