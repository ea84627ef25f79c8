"""The run's prompt sampler: `build_sampler` picks uniform sampling (`UniformSampler`, below), PPS
(priority_sampler.py, docs/methods.md §3 and §3b) or the released code's sampler (released_sampler.py,
§3a) from the config; `sampler_metrics` gives its diagnostics.

The three samplers answer the loop's two calls alike: `sample(B)` -> the step's prompt indices (B,);
`observe(indices, rewards, accuracy)` -> after scoring, the scored groups set PPS's priorities, and the
importance weight of each completion (B, G) comes back: the one place the loop gets them (PPS: the
draw's, fixed by `sample`, §3; the released code's: each completion's own, after its write, §3a; uniform
sampling: ones). Each keeps its state in `state_dict` for exact resume.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pspo.training.config import Config, ConfigError
from pspo.priority_sampler import PrioritySampler, check_resumed_prompts
from pspo.released_sampler import ReleasedSampler


def check_prompts_per_step(cfg: Config, num_prompts: int, label: str) -> None:
    """ConfigError (one line) when PPS cannot draw train.prompts_per_step prompts from `num_prompts`.
    train.py runs it first on the rows with a usable gold (data_rows), before a model is built, then
    build_sampler on the prompts kept (fewer when some are too long)."""
    B, p = cfg.train.prompts_per_step, cfg.pps
    if p.enabled and B > num_prompts and not p.replacement:       # with replacement: any B
        raise ConfigError(f"train.prompts_per_step: PPS draws {B} prompts per step ("
                          f"{'of an epoch of N draws' if p.mode == 'released' else 'distinct'}), "
                          f"{label} has {num_prompts}")


def build_sampler(cfg: Config, problems: list[str], label: str):
    """The run's sampler over the train set's problems: uniform epochs, PPS (§3 with the §3b
    options) or, with pps.mode=released, the released code's (§3a; duplicate problems share the
    first row's priority). `label` names the data set in errors."""
    N, p, a, seed = len(problems), cfg.pps, cfg.algo, cfg.train.seed
    check_prompts_per_step(cfg, N, label)
    if not p.enabled:
        return UniformSampler(N, seed)
    if p.mode == "released":
        first_row: dict[str, int] = {}
        leaf_of = torch.tensor([first_row.setdefault(problem, i) for i, problem in enumerate(problems)])
        return ReleasedSampler(N, alpha=p.alpha, beta=p.beta, seed=seed, leaf_of=leaf_of,
                                scale_rewards=a.scale_rewards, adv_eps=a.adv_eps)
    return PrioritySampler(N, alpha=p.alpha, beta=p.beta, eps=p.eps, seed=seed,
                           beta_end=None if p.beta_end == -1 else p.beta_end,   # pps.beta_end -1: constant β
                           total_steps=cfg.train.max_steps, priority=p.priority,
                           posterior_decay=p.posterior_decay, prior_reversion=p.prior_reversion,
                           is_norm=p.is_norm, uniform_mix=p.uniform_mix,
                           skip=p.skip, skip_rho=p.skip_rho, skip_min=p.skip_min, replacement=p.replacement,
                           scale_rewards=a.scale_rewards, adv_eps=a.adv_eps)


def sampler_mode(cfg: Config) -> str:
    """The sampler a run trains with: uniform, or PPS's paper or released mode (recorded in checkpoints)."""
    return cfg.pps.mode if cfg.pps.enabled else "uniform"


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

    def sample(self, batch_size: int, *, same_step: bool = False) -> Tensor:
        """Next batch_size prompt indices (B,) (same_step, a further draw of the step: no difference here).

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
        return torch.cat(taken)

    def observe(self, indices: Tensor, rewards: Tensor, accuracy: Tensor, *, normalized: bool = True) -> Tensor:
        """Nothing to learn from the scores: importance weights all 1, (B, G) as rewards (raw or not)."""
        return torch.ones(rewards.shape)

    def normalize(self, raw: Tensor) -> Tensor:
        """Weights of several draws, trained together: all 1 already. (P, G)"""
        return raw.float()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        check_resumed_prompts(state["num_prompts"], self.num_prompts)
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
