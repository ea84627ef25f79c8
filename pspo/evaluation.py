"""Accuracy of a policy on a prompt set: greedy pass@1 and sampled mean@k (pass@1 from k samples).

Shared by eval.py (a checkpoint or any from_pretrained path) and train.py (periodic eval).
Each rank scores a strided slice of the prompts; slices are padded to equal length so that every
rank makes the same number of generate calls (required under FSDP), and padded rows are not
counted. Sums are reduced over ranks, so the result is the same for any number of ranks.

On knights-and-knaves puzzles (every gold a K&K solution, pspo/tasks/knights.py) accuracy is the K&K
exact match (rewards.accuracy_reward), and the greedy accuracy is also reported per number of
people, `greedy_{n}ppl` for each n present (2..8), as K&K results are reported.
"""
from __future__ import annotations

import math

import torch
from tqdm import tqdm

from pspo.training import distributed
from pspo.tasks.data import Example
from pspo.training.distributed import Dist
from pspo.tasks.knights_reward import knights_people
from pspo.tasks.reward_pool import RewardPool
from pspo.estimators import group_mean
from pspo.rewards import score_completions
from pspo.engines.sampling import sequence_seeds

EVAL_STEP_KEY = -1     # sampling-seed namespace of evaluation, apart from every training step


def evaluate(engine, prompt_ids: list[list[int]], prompts: list[str], examples: list[Example], *,
             max_new_tokens: int, num_samples: int, temperature: float, top_p: float, seed: int,
             dist_: Dist, batch_size: int, timeout_s: float = 5.0, progress: bool = True,
             pool: RewardPool | None = None) -> dict[str, float]:
    """Returns {"greedy_accuracy", and with num_samples = k > 0: f"mean@{k}", f"pass@{k}";
    on K&K puzzles also f"greedy_{n}ppl" for each number of people n present}.

    The prompts' token ids, chat texts and examples (one each per prompt); max_new_tokens per
    completion (rollout's); num_samples k, temperature, top_p and batch_size (prompts per generate
    call) from the eval section; seed: the run's, for the sampled completions; timeout_s: the
    reward's per-call limit. Completions are scored in `pool`'s worker processes if one is given
    (pspo/tasks/reward_pool.py), else here."""
    mine = list(range(dist_.rank, len(prompt_ids), dist_.world_size))
    per_rank = math.ceil(len(prompt_ids) / dist_.world_size)
    real = len(mine)
    mine += [mine[0] if mine else 0] * (per_rank - real)          # padding rows, not counted
    sums = {"greedy_correct": 0.0, "sampled_correct": 0.0, "any_correct": 0.0}
    people = [knights_people(ex.answer) for ex in examples]                 # None: not a K&K gold
    sizes = sorted(set(people)) if people and None not in people else []    # the same on every rank
    sums.update({f"{key}_{n}": 0.0 for n in sizes for key in ("correct", "count")})
    chunks = range(0, per_rank, batch_size)
    bar = tqdm(chunks, desc="eval", disable=not (progress and dist_.is_main), leave=False)
    for start in bar:
        idx = mine[start:start + batch_size]
        counted = max(0, min(len(idx), real - start))
        ids = [prompt_ids[i] for i in idx]
        texts = [prompts[i] for i in idx]
        golds = [examples[i].answer for i in idx]
        greedy = engine.generate(ids, 1, 1.0, 1.0, max_new_tokens, seeds=None)
        correct = _accuracy(texts, greedy.texts, golds, timeout_s, pool)
        sums["greedy_correct"] += correct[:counted].sum().item()
        for i, ok in zip(idx[:counted] if sizes else [], correct.tolist()):
            sums[f"correct_{people[i]}"] += ok
            sums[f"count_{people[i]}"] += 1
        if num_samples > 0:
            seeds = sequence_seeds(seed, EVAL_STEP_KEY, torch.tensor(idx), num_samples)
            sampled = engine.generate(ids, num_samples, temperature, top_p, max_new_tokens, seeds=seeds)
            reps = lambda xs: [x for x in xs for _ in range(num_samples)]  # noqa: E731 prompt-major rows
            correct = _accuracy(reps(texts), sampled.texts, reps(golds), timeout_s,
                                pool).view(-1, num_samples)
            sums["sampled_correct"] += group_mean(correct[:counted]).sum().item()
            sums["any_correct"] += correct[:counted].amax(1).sum().item()
    total = distributed.reduce_sums({**sums, "n": float(real)}, dist_.device)
    n = max(total["n"], 1.0)
    result = {"greedy_accuracy": total["greedy_correct"] / n}
    result.update({f"greedy_{k}ppl": total[f"correct_{k}"] / max(total[f"count_{k}"], 1.0) for k in sizes})
    if num_samples > 0:
        result[f"mean@{num_samples}"] = total["sampled_correct"] / n
        result[f"pass@{num_samples}"] = total["any_correct"] / n
    return result


def _accuracy(prompts: list[str], completions: list[str], golds: list[str], timeout_s: float,
              pool: RewardPool | None) -> torch.Tensor:
    scored = score_completions(prompts, completions, golds, weights={"accuracy": 1.0}, timeout_s=timeout_s, pool=pool)
    return scored.components["accuracy"]
