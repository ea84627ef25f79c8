"""The advantage methods: one function per method, chosen in one place (`method_for`).

Each method turns the step's scored rollouts (`StepRollouts`) into what the optimizer step consumes
(`UpdateBatch`: token advantages (N, T) times the PPS importance weight and the engine-mismatch
weight, the loss mask, and π_old / π_ref where the method or the loss needs them) plus this rank's
statistics:

    grpo                   GRPO / Dr. GRPO, per completion; ERS-smoothed             docs/methods.md §1, §2
                           with ers.enabled
    reinforce_pp           REINFORCE++, per token, KL in the reward, batch-whitened  docs/related.md §A
    reinforce_pp_baseline  the same from R_i - mean of its group                     docs/related.md §A
    spo_chain              SPO-chain: Monte Carlo values at cut points, per segment  docs/related.md §B
    spo_tree               SPO-tree: trees grown from the step's completions,        docs/related.md §B
                           replayed edges

The math lives in advantages.py and segments.py (pure tensor functions); SPO's extra generation in
spo.py. Adding a method: one function here, one line in `method_for`, one name in config.ADVANTAGES,
one preset, its tests. Two other places read algo.advantage, each for its own concern:
config.validate_method (the settings a method takes) and plan.step_shape (what it generates, for the
memory plan). PPS (docs/methods.md §3) is the sampler's, not a method's: its weights arrive
in `StepRollouts.is_weights` and multiply whatever advantages a method returns. So does the
truncated IS weight of rollout.is_correction (docs/methods.md §7), which corrects for an engine whose
log-probs differ from the trainer's π_old: both are multiplied in one place, `_weigh`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pspo.advantages import group_advantages, reinforce_pp_advantages, smoothed_advantages, zero_variance
from pspo.training import distributed
from pspo.training.config import Config
from pspo.training.distributed import Dist
from pspo.ema_stats import EMAStats
from pspo.is_correction import correction_weights, mismatch_sums
from pspo.training.logprobs import score_policy
from pspo.rewards import RewardResult
from pspo.engines.tokens import Rollout, batch_inputs
from pspo.training.micro_batches import UpdateBatch
from pspo.related.spo import Score, SPOTree, chain_advantages_of


@dataclass
class StepRollouts:
    """One step's completions, scored: what every method starts from."""
    step: int                 # the step being trained (0-based)
    indices: Tensor           # (B,) dataset rows of every rank's prompts, the same on all ranks
    rows: list[int]           # (N,) this rank's dataset row of each completion, prompt-major (N = B_local·G)
    seeds: Tensor             # (N,) the completions' seeds
    rollout: Rollout          # this rank's N completions
    scored: RewardResult      # their rewards and reward components, (N,) each
    rewards: Tensor           # (B, G) every rank's rewards
    is_weights: Tensor        # (B, G) the sampler's importance weights (ones without PPS)


@dataclass
class MethodState:
    """What a method keeps across steps, replicated on every rank and saved in checkpoints: ERS's
    statistics (grpo with ers.enabled, docs/methods.md §2) and SPO-tree's replay buffer (spo_tree,
    docs/related.md §B). A method with state of its own adds a field here and to the two functions
    below; train.py and checkpoint.py hand the object on as it is."""
    ers: EMAStats | None = None
    tree: SPOTree | None = None

    def state_dict(self) -> dict:
        return {"ers": self.ers.state_dict() if self.ers is not None else None,
                "spo_tree": self.tree.state_dict() if self.tree is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.ers is not None:
            self.ers.load_state_dict(state["ers"])
        if self.tree is not None and state.get("spo_tree") is not None:
            self.tree.load_state_dict(state["spo_tree"])


@dataclass
class Context:
    """What the methods need from the run beside the step: models, engine, data, ranks and state."""
    cfg: Config
    policy: torch.nn.Module
    ref: torch.nn.Module | None   # the frozen reference, when algo.needs_reference
    engine: object                # the counting engine: SPO's continuations count as generated tokens
    train_ids: list[list[int]]    # prompt token ids of every training row
    problems: list[str]           # problem text of every training row (ERS's key)
    pad_id: int
    dist: Dist
    mine: slice                   # this rank's rows of the (B, ...) batch
    lockstep: bool                # FSDP ranks generating with the policy itself: same forward passes
    score: Score                  # (dataset rows, texts) -> their RewardResult
    release_engine: Callable[[], None]   # the step generates nothing more: a separate engine frees its memory
    distinct_problems: int        # distinct problems of the train set (ERS's seen_frac)
    state: MethodState            # the chosen method's (Method.state)


@dataclass
class MethodOutput:
    batch: UpdateBatch                                         # on the rank's device
    sums: dict[str, float]                                     # this rank's statistics, summed over ranks
    metrics: dict[str, float] = field(default_factory=dict)   # replicated diagnostics, logged as they are
    # seconds spent on other phases' work (reward_s ...)
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class Method:
    """The chosen method: its function, the step's generation budget, and its replicated state."""
    name: str
    advantages: Callable[[StepRollouts, Context], MethodOutput]
    max_new_tokens: int                # tokens per completion of the step's rollout (SPO-tree: M0)
    state: MethodState = field(default_factory=MethodState)


# ---- the methods ----

def grpo(s: StepRollouts, ctx: Context) -> MethodOutput:
    """GRPO (Dr. GRPO with algo.scale_rewards false), docs/methods.md §1; with ERS, §2: the group's (μ, s)
    replaced by the prompt's smoothed (m_q, sqrt(v_q)) after this step's update. One value per
    completion, broadcast over its tokens."""
    a = ctx.cfg.algo
    start = time.perf_counter()
    advantages = group_advantages(s.rewards, a.scale_rewards, a.adv_eps)          # (B, G) §1
    metrics = {}
    if ctx.state.ers is not None:                                                  # §2
        problems = [ctx.problems[i] for i in s.indices.tolist()]
        ers_mean, ers_std = ctx.state.ers.update(problems, s.rewards)             # (B,), (B,)
        advantages = smoothed_advantages(s.rewards, ers_mean, ers_std, a.scale_rewards, a.adv_eps)
        stats = ctx.state.ers.batch_stats(problems, s.rewards, ers_mean, ctx.distinct_problems)
        metrics = {f"ers_{k}": v for k, v in stats.items()}
    bookkeeping_s = time.perf_counter() - start                                    # the advantages and ERS
    mine = advantages[ctx.mine]                                                    # (B_local, G)
    need_old = a.num_iterations > 1
    batch = _rollout_batch(s, ctx, s.rollout.mask, need_old)
    metrics |= _weigh(s, ctx, batch, mine.reshape(-1, 1).expand_as(batch.mask), keep_old=need_old)
    sums = {**_rollout_sums(s, ctx), "adv_abs": mine.abs().sum(), "adv_sq": (mine ** 2).sum(),
            "adv_count": mine.numel()}
    return MethodOutput(batch, sums, metrics, {"bookkeeping_s": bookkeeping_s})


def reinforce_pp(s: StepRollouts, ctx: Context) -> MethodOutput:
    """REINFORCE++, docs/related.md §A: r_t = -kl_coef·(logπ_old - logπ_ref)_t + [t = last]·clip(R),
    G_t = Σ_{t'≥t} r_t', whitened over every valid token of every rank."""
    return _reinforce(s, ctx, group_size=None)


def reinforce_pp_baseline(s: StepRollouts, ctx: Context) -> MethodOutput:
    """REINFORCE++-baseline, docs/related.md §A: R_i - the mean of its group, then as reinforce_pp."""
    return _reinforce(s, ctx, group_size=ctx.cfg.rollout.num_generations)


def spo_chain(s: StepRollouts, ctx: Context) -> MethodOutput:
    """SPO-chain, docs/related.md §B chain: segments cut where p_t < 0.9 (every K-th such token), Monte
    Carlo values V at the cuts, A(segment) = V(end) - V(start) on the tokens of M, whitened."""
    cfg, device = ctx.cfg, ctx.dist.device
    prompts = [ctx.train_ids[i] for i in s.rows]
    input_ids, attention_mask, mask = _step_inputs(s, ctx)
    old_logp, _ = score_policy(ctx.policy, None, input_ids, attention_mask, mask, cfg, need_old=True,
                               need_ref=False)                                     # the cuts come from π_old
    rewards = s.rewards[ctx.mine].reshape(-1)                                      # (N,) R
    advantages, loss_mask, counts = chain_advantages_of(ctx.engine, s.rollout, rewards, old_logp, prompts,
                                                        s.rows, ctx.score, cfg, s.step, device, ctx.lockstep)
    ctx.release_engine()
    _, ref_logp = score_policy(ctx.policy, ctx.ref, input_ids, attention_mask, mask, cfg, need_old=False,
                               need_ref=cfg.algo.needs_reference)
    advantages, loss_mask = advantages.to(device), loss_mask.to(device)           # (N, T) A, M
    zeros = torch.zeros_like(mask)                                                 # _weigh sets A
    batch = UpdateBatch(input_ids, attention_mask, mask, loss_mask, zeros, old_logp, ref_logp)
    metrics = _weigh(s, ctx, batch, advantages, keep_old=True)
    sums = {**_rollout_sums(s, ctx), **counts, **_token_adv_sums(advantages, loss_mask)}
    return MethodOutput(batch, sums, metrics)


def spo_tree(s: StepRollouts, ctx: Context) -> MethodOutput:
    """SPO-tree, docs/related.md §B tree: the step's completions (at most M0 tokens) are the trees'
    first level; the trees grow, their leaves are scored, every node's A = V(node) - V(parent), and
    the edges drawn from the replay buffer are trained (their π_old from when they were generated).
    PPS and rollout.is_correction are refused with this method (config.py): the edges are trained in
    later steps, and they keep no engine log-probs, so there is no IS weight to apply."""
    cfg, tree = ctx.cfg, ctx.state.tree
    local = s.indices[ctx.mine].tolist()
    grown = tree.step(ctx.engine, ctx.policy, local, s.rollout, s.seeds, s.scored, s.step, ctx.score)
    ctx.release_engine()
    b = grown.batch
    _, b.ref_logp = score_policy(ctx.policy, ctx.ref, b.input_ids, b.attention_mask, b.mask, cfg,
                                 need_old=False, need_ref=cfg.algo.needs_reference)
    sums = {**grown.sums, **_token_adv_sums(b.advantages, b.loss_mask)}
    return MethodOutput(b, sums, times={"reward_s": grown.reward_s})


# ---- the one place a method is chosen ----

def method_for(cfg: Config, train_ids: list[list[int]], pad_id: int, dist_: Dist, lockstep: bool) -> Method:
    """The method named by algo.advantage, with its generation budget and replicated state."""
    name = cfg.algo.advantage
    ers = EMAStats(cfg.ers.alpha) if cfg.ers.enabled else None      # config.py allows ERS with grpo only
    if name == "grpo":
        return Method(name, grpo, cfg.rollout.max_new_tokens, MethodState(ers=ers))
    if name == "reinforce_pp":
        return Method(name, reinforce_pp, cfg.rollout.max_new_tokens)
    if name == "reinforce_pp_baseline":
        return Method(name, reinforce_pp_baseline, cfg.rollout.max_new_tokens)
    if name == "spo_chain":
        return Method(name, spo_chain, cfg.rollout.max_new_tokens)
    if name == "spo_tree":
        tree = SPOTree(cfg, train_ids, pad_id, dist_, lockstep)
        return Method(name, spo_tree, cfg.spo.segments[0], MethodState(tree=tree))
    raise ValueError(f"algo.advantage: no method named {name!r}")   # config.py validates the name first


# ---- shared pieces ----

def _reinforce(s: StepRollouts, ctx: Context, group_size: int | None) -> MethodOutput:
    """REINFORCE++(-baseline): π_old and π_ref scored first (the KL reward needs both), then §A."""
    a = ctx.cfg.algo
    rewards = s.rewards[ctx.mine].reshape(-1)                                      # (N,) R
    need_old = a.num_iterations > 1 or a.kl_coef > 0
    batch = _rollout_batch(s, ctx, s.rollout.mask, need_old)
    advantages = reinforce_pp_advantages(rewards.to(batch.mask.device), batch.mask, batch.old_logp,
                                         batch.ref_logp, a.kl_coef, a.clip_score, group_size, a.whiten,
                                         reduce_sum=distributed.all_reduce_sum)   # (N, T)
    metrics = _weigh(s, ctx, batch, advantages, keep_old=need_old)
    sums = {**_rollout_sums(s, ctx), **_token_adv_sums(advantages, batch.loss_mask)}
    return MethodOutput(batch, sums, metrics)


def _rollout_batch(s: StepRollouts, ctx: Context, loss_mask: Tensor, need_old: bool) -> UpdateBatch:
    """The step's completions as an UpdateBatch on the rank's device, advantages zero (`_weigh` sets
    them); π_old scored if `need_old` or rollout.is_correction needs it, π_ref if the run has a
    reference."""
    cfg, device = ctx.cfg, ctx.dist.device
    ctx.release_engine()                                                           # nothing more to generate
    input_ids, attention_mask, mask = _step_inputs(s, ctx)
    score_old = need_old or cfg.rollout.is_correction != "none"
    old_logp, ref_logp = score_policy(ctx.policy, ctx.ref, input_ids, attention_mask, mask, cfg, score_old,
                                      need_ref=cfg.algo.needs_reference)
    zeros = torch.zeros_like(mask)
    return UpdateBatch(input_ids, attention_mask, mask, loss_mask.to(device), zeros, old_logp, ref_logp)


def _step_inputs(s: StepRollouts, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's prompts + completions on its device, left-padded: input ids and attention mask
    (N, P + T), and the completion mask (N, T)."""
    device = ctx.dist.device
    input_ids, attention_mask = batch_inputs([ctx.train_ids[i] for i in s.rows], s.rollout.completion_ids,
                                             s.rollout.mask, ctx.pad_id)
    return input_ids.to(device), attention_mask.to(device), s.rollout.mask.to(device)


def _weigh(s: StepRollouts, ctx: Context, batch: UpdateBatch, advantages: Tensor,
           keep_old: bool) -> dict[str, float]:
    """The one place a method's token advantages A (N, T) become the batch's: A · w_PPS (the sampler's
    weight of the completion, docs/methods.md §3) · w_TIS (rollout.is_correction, §7: min(π_old/π_engine,
    C) per token or per sequence, from the engine's log-probs of the step's rollout). Both multiply the
    policy-gradient term only: the loss adds its KL term unweighted. Returns the engine/trainer mismatch
    metrics over every rank, whenever π_old was scored. keep_old false: π_old served the correction
    alone and leaves the batch, so that ρ ≡ 1 stays exact with one iteration (docs/methods.md §1).
    Collective when π_old was scored."""
    r, device = ctx.cfg.rollout, batch.mask.device
    weights = s.is_weights[ctx.mine].reshape(-1, 1).to(device)                     # (N, 1) w_PPS
    metrics = {}
    if batch.old_logp is not None:
        engine_logp = s.rollout.logprobs.to(device)                                # (N, T) log π_engine
        metrics = _mismatch_metrics(batch.old_logp, engine_logp, batch.mask, r.is_correction, r.is_cap)
        if r.is_correction != "none":
            tis = correction_weights(batch.old_logp, engine_logp, batch.mask, r.is_correction, r.is_cap)
            weights = weights * tis                                                # (N, T) w_PPS · w_TIS
    batch.advantages = advantages.to(device) * weights                            # (N, T)
    if not keep_old:
        batch.old_logp = None
    return metrics


def _mismatch_metrics(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str,
                      cap: float) -> dict[str, float]:
    """Over every rank's tokens: the mean and largest |log π_old − log π_engine| (engine_gap_mean,
    engine_gap_max), and with a correction the mean TIS weight and the share of tokens it capped
    (tis_weight_mean, tis_capped_frac), docs/methods.md §7. Collective."""
    sums = mismatch_sums(old_logp, engine_logp, mask, mode, cap)
    gap_max = distributed.all_reduce_max(sums.pop("gap_max").float())
    totals = distributed.reduce_sums({k: float(v) for k, v in sums.items()}, mask.device)
    tokens = max(totals["tokens"], 1.0)
    metrics = {"engine_gap_mean": totals["gap_sum"] / tokens, "engine_gap_max": float(gap_max)}
    if mode != "none":
        metrics["tis_weight_mean"] = totals["weight_sum"] / tokens
        metrics["tis_capped_frac"] = totals["capped"] / tokens
    return metrics


def _rollout_sums(s: StepRollouts, ctx: Context) -> dict[str, float]:
    """This rank's statistics of its completions (the step_metrics means are taken over ranks)."""
    rewards, rollout, scored = s.rewards[ctx.mine], s.rollout, s.scored           # (B_local, G)
    return {"completions": rewards.numel(), "groups": rewards.shape[0],
            "completion_tokens": rollout.mask.sum(),
            "reward": rewards.sum(), "reward_sq": (rewards ** 2).sum(),
            "accuracy": scored.components["accuracy"].sum(), "format": scored.components["format"].sum(),
            "zero_std_groups": zero_variance(rewards).sum(), "truncated": rollout.truncated.sum(),
            "reward_failures": sum(scored.failures.values())}


def _token_adv_sums(advantages: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """|A| and A² summed over the tokens of the loss, and their count (before the IS weight)."""
    return {"adv_abs": float(advantages.abs().sum()), "adv_sq": float((advantages ** 2).sum()),
            "adv_count": float(loss_mask.sum())}
