"""Uniform prompt sampling, the GRPO baseline's data order: epochs of a seeded permutation, every
prompt once per epoch, importance weights all 1. The state is two integers, so resuming reproduces
the exact order, and every rank computes the same indices without communicating. It answers the same
`sample` call as PPS (priority_sampler.py, reference_sampler.py); sampler.py picks one of the three.
"""
from __future__ import annotations

import torch
from torch import Tensor


class UniformSampler:
    """Shuffled epochs over `num_prompts` prompts; permutation e is seeded by (seed, e)."""

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
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(f"checkpoint sampler has {state['num_prompts']} prompts, the dataset has "
                             f"{self.num_prompts}: resume with the same data.train")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
