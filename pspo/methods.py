"""The advantage methods: one function per method, chosen in one place (`method_for`), and the calls
they all share around them.

A method is a function from the step's scored rollouts (`StepRollouts`: the rewards (B, G), and what it
declares it reads) to the token advantages A (N, T) and the loss mask M (N, T) of the rows the update
trains, with this rank's statistics (`MethodOutput`):

    grpo                   GRPO / Dr. GRPO, per completion                            docs/methods.md §1
    rloo                   RLOO: r_i - the mean of the other G - 1, per completion    docs/methods.md §1
    maxrl                  MaxRL: (r_i - μ)/(μ + ε), weighs a prompt ∝ 1/p, per completion  docs/methods.md §1
    reinforce_pp           REINFORCE++, per token, KL in the reward, batch-whitened   docs/related.md §A
    reinforce_pp_baseline  the same from R_i - the mean of its group                  docs/related.md §A
    spo_chain              SPO-chain: Monte Carlo values at cut points, per segment   docs/related.md §B
    spo_tree               SPO-tree: trees grown from the step's completions,         docs/related.md §B
                           replayed edges
    single_stream          Single-stream PO: r - the prompt's tracked value v̂,        docs/methods.md §10
                           normalised over the batch, per completion

Besides the rewards, a method reads what it declares in `method_for` (`Method`): π_old / π_ref of the
step's completions (`reads_old`, `reads_ref`) and its group's reward statistics (`reads_group`: the
methods of config.GROUP_BASELINES, whose baseline is the group; ERS may smooth them); and it says
whether it generates (`generates`). The math lives in estimators.py, ema_stats.py (ERS) and
related/spo_segments.py (pure tensor functions); SPO's extra generation in related/spo.py (imported
when an SPO method is chosen), Single-stream PO's value tracker in related/single_stream.py (likewise).
The loop (train.py) makes the shared calls, once each, in this order:
1. `engine.release()` (rollout.py) as soon as the step generates nothing more: before the method,
   or after it for a method that generates (SPO-chain's Monte Carlo continuations, SPO-tree's
   branches);
2. `score_first`: the π_old / π_ref of the step's completions that the method reads:
   REINFORCE++'s KL reward reads both (with algo.kl_coef > 0, docs/related.md §A), SPO-chain's cuts
   read π_old (p_t, §B chain 2), Single-stream PO's tracker stores it (π_then, docs/methods.md §10);
3. `group_baseline`, ERS's step (docs/methods.md §2), for a method that reads its group: each
   prompt's reward mean and std, its group's (μ, s), or with ers.enabled the smoothed (m_q, sqrt(v_q))
   after this step's visit; the method centres (and scales) by whichever it is handed;
4. the method (`Method.estimate`);
5. `training_batch`: the π_old / π_ref the update or the IS correction still needs, scored, and
   `weigh`, the one place A becomes A·w_PPS·w_IS: the sampler's importance weight (docs/methods.md
   §3; PPS is the sampler's, not a method's) and the IS weight of rollout.is_correction, truncated or
   masked (§7), which corrects for an engine whose log-probs differ from the trainer's π_old. π_old stays in
   the batch with algo.num_iterations > 1 or when the method read it; otherwise it served the
   correction alone and leaves, so that ρ ≡ 1 exactly with one iteration (docs/methods.md §1). With
   algo.overlong_filter, DAPO's overlong filtering zeroes the loss mask of truncated completions
   (`overlong_filtered`, §9), whatever the method.
SPO-tree trains edges drawn from its replay buffer instead of the step's completions
(`MethodOutput.rows`). Each edge carries its π_old from when it was generated: the trainer scores the
new edges inside the method, between its generate calls (related/spo.py), so it reads nothing first.
`training_batch` scores π_ref on the edges and applies no IS weight: config.py refuses PPS and
rollout.is_correction with it (the edges train in later steps, and they keep no engine log-probs).

Adding a method (docs/methods.md, "Adding a method", with RLOO as the example): its function here
(`per_completion` or `per_token` wraps its values; its formula in estimators.py with a hand-worked
test), one entry in `method_for`, its name in config.ADVANTAGES (and in config.GROUP_BASELINES when
its baseline is its group's statistics: ERS then applies to it; in TOKEN_ADVANTAGES when per token), a
preset. Two other places read algo.advantage, each for its own concern: config.validate_method (the
settings a method takes) and plan.step_shape (what it generates, for the memory plan).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pspo.estimators import (group_statistics, grpo_advantages, maxrl_advantages, reinforce_pp_advantages,
                             rloo_advantages, single_stream_advantages, zero_variance)
from pspo.training import distributed
from pspo.training.config import GROUP_BASELINES, Config, RolloutConfig
from pspo.training.distributed import Dist
from pspo.ema_stats import EMAStats
from pspo.is_correction import correction_weights, mismatch_sums
from pspo.training.logprobs import score_policy
from pspo.training.metrics import AdvantageSums, ChainSums, MethodStats, RolloutSums
from pspo.rewards import RewardResult, Score
from pspo.training.tokens import Rollout
from pspo.training.micro_batches import TokenRows, UpdateBatch

if TYPE_CHECKING:                 # SPO's machinery is imported by the SPO methods alone, when they run
    from pspo.related.single_stream import ValueTracker
    from pspo.related.spo import SPOTree


@dataclass
class GroupBaseline:
    """Each prompt's reward statistics that a method whose baseline is its group centres (and scales)
    by: the group's own (μ, s), or with ERS the prompt's smoothed (m_q, sqrt(v_q)) after this step's
    visit (docs/methods.md §2). Set by `group_baseline`."""
    mean: Tensor                          # (B,) μ or m_q
    std: Tensor                           # (B,) s or sqrt(v_q)
    metrics: dict[str, float] = field(default_factory=dict)   # ERS's diagnostics, logged as they are


@dataclass(kw_only=True)
class StepRollouts:
    """One step's completions, scored: what every method starts from."""
    step: int                 # the step being trained (0-based)
    indices: Tensor           # (B,) dataset rows of every rank's prompts, the same on all ranks
    rows: list[int]           # (N,) this rank's dataset row of each completion, prompt-major (N = B_local·G)
    seeds: Tensor             # (N,) the completions' seeds
    rollout: Rollout          # this rank's N completions
    scored: RewardResult      # their rewards and reward components, (N,) each
    rewards: Tensor           # (B, G) every rank's rewards
    is_weights: Tensor        # (B, G) the sampler's importance weights (sampler.observe; ones without PPS)
    inputs: TokenRows         # the N prompts + completions as the model reads them, on the rank's device
    old_logp: Tensor | None = None   # (N, T) log π_old of the completions, where the method reads it
    ref_logp: Tensor | None = None   # (N, T) log π_ref, likewise (both set by score_first)
    baseline: GroupBaseline | None = None   # every prompt's (mean, std), where the method reads its group


@dataclass
class MethodState:
    """What a method keeps across steps, replicated on every rank and saved in checkpoints: ERS's
    statistics (ers.enabled, any method that reads its group, docs/methods.md §2), SPO-tree's replay
    buffer (spo_tree, docs/related.md §B) and Single-stream PO's value tracker (single_stream, docs/methods.md
    §10). A method with state of its own adds a field here and to the two functions below; train.py and
    checkpoint.py hand the object on as it is."""
    ers: EMAStats | None = None
    tree: SPOTree | None = None
    single_stream: ValueTracker | None = None

    def state_dict(self) -> dict:
        return {"ers": self.ers.state_dict() if self.ers is not None else None,
                "spo_tree": self.tree.state_dict() if self.tree is not None else None,
                "single_stream": self.single_stream.state_dict() if self.single_stream is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.ers is not None:
            self.ers.load_state_dict(state["ers"])
        if self.tree is not None and state.get("spo_tree") is not None:
            self.tree.load_state_dict(state["spo_tree"])
        if self.single_stream is not None:
            self.single_stream.load_state_dict(state["single_stream"])


@dataclass(kw_only=True)
class Context:
    """What the methods and the shared calls around them read from the run, beside the step."""
    cfg: Config
    policy: torch.nn.Module       # π_old (score_first, training_batch; SPO-tree's new edges)
    ref: torch.nn.Module | None   # the frozen reference, when algo.needs_reference
    engine: object                # the counting engine: SPO's continuations count as generated tokens
    train_ids: list[list[int]]    # prompt token ids of every training row
    problems: list[str]           # problem text of every training row (ERS's key)
    dist: Dist
    mine: slice                   # this rank's rows of the (B, ...) batch
    lockstep: bool                # FSDP ranks generating with the policy itself: same forward passes
    score: Score                  # (dataset rows, texts) -> their RewardResult
    distinct_problems: int        # distinct problems of the train set (ERS's seen_frac)
    state: MethodState            # the chosen method's (Method.state)


@dataclass
class MethodOutput:
    """What a method returns: the token advantages and the loss mask of the rows the update trains."""
    advantages: Tensor                    # (N, T) A, before the IS weights
    loss_mask: Tensor                     # (N, T) M, the tokens the loss aggregates over (within the mask)
    stats: MethodStats                    # this rank's sums, summed over ranks when logged
    metrics: dict[str, float] = field(default_factory=dict)   # replicated diagnostics, logged as they are
    rows: TokenRows | None = None         # SPO-tree: the edges it trains; None: the step's completions
    old_logp: Tensor | None = None        # (N, T) π_old of `rows`, from when they were generated


@dataclass
class Method:
    """The chosen method: its function, the step's generation budget, its replicated state, and what
    it reads or generates, which places the shared calls around it (module docstring)."""
    name: str
    estimate: Callable[[StepRollouts, Context], MethodOutput]   # the method's function
    max_new_tokens: int                # tokens per completion of the step's rollout (SPO-tree: M0)
    state: MethodState = field(default_factory=MethodState)
    reads_old: bool = False            # it reads π_old of the step's completions
    reads_ref: bool = False            # it reads π_ref of the step's completions
    generates: bool = False            # it generates: the engine is released after it

    @property
    def reads_group(self) -> bool:
        """Its baseline is its group's reward statistics (config.GROUP_BASELINES): `group_baseline`
        hands them over, ERS's when ers.enabled."""
        return self.name in GROUP_BASELINES


# ---- the methods ----

def grpo(s: StepRollouts, ctx: Context) -> MethodOutput:
    """GRPO (Dr. GRPO with algo.scale_rewards false), docs/methods.md §1: A_i = (r_i - μ) / (s + ε) from
    the group's (μ, s), or ERS's (m_q, sqrt(v_q)), §2. One value per completion, broadcast over its tokens."""
    a, b = ctx.cfg.algo, s.baseline
    return per_completion(s, ctx, grpo_advantages(s.rewards, b.mean, b.std, a.scale_rewards, a.adv_eps))


def rloo(s: StepRollouts, ctx: Context) -> MethodOutput:
    """RLOO, docs/methods.md §1: A_i = r_i - mean_{j≠i} r_j = G/(G-1)·(r_i - μ); ERS's m_q in place of μ,
    §2. One value per completion, broadcast over its tokens."""
    return per_completion(s, ctx, rloo_advantages(s.rewards, s.baseline.mean))


def maxrl(s: StepRollouts, ctx: Context) -> MethodOutput:
    """MaxRL, docs/methods.md §1: A_i = (r_i - μ)/(μ + ε), the group's mean in place of its std (ERS's m_q, §2).
    One value per completion, broadcast over its tokens."""
    return per_completion(s, ctx, maxrl_advantages(s.rewards, s.baseline.mean, ctx.cfg.algo.adv_eps))


def reinforce_pp(s: StepRollouts, ctx: Context) -> MethodOutput:
    """REINFORCE++, docs/related.md §A: r_t = -kl_coef·(logπ_old - logπ_ref)_t + [t = last]·clip(R),
    G_t = Σ_{t'≥t} r_t', whitened over every valid token of every rank."""
    return _reinforce(s, ctx, baseline=None)


def reinforce_pp_baseline(s: StepRollouts, ctx: Context) -> MethodOutput:
    """REINFORCE++-baseline, docs/related.md §A: R_i - the mean of its group (ERS's m_q, docs/methods.md
    §2), then as reinforce_pp."""
    G = s.rewards.shape[1]
    return _reinforce(s, ctx, baseline=s.baseline.mean[ctx.mine].repeat_interleave(G))     # (N,)


def spo_chain(s: StepRollouts, ctx: Context) -> MethodOutput:
    """SPO-chain, docs/related.md §B chain: segments cut where p_t < 0.9 (every K-th such token, p_t from
    π_old, read first), Monte Carlo values V at the cuts, A(segment) = V(end) - V(start) on the tokens
    of M, whitened."""
    from pspo.related.spo import chain_advantages_of
    device = ctx.dist.device
    prompts = [ctx.train_ids[i] for i in s.rows]
    rewards = s.rewards[ctx.mine].reshape(-1)                                      # (N,) R
    advantages, loss_mask, counts = chain_advantages_of(ctx.engine, s.rollout, rewards=rewards, old_logp=s.old_logp,
                                                        prompt_ids=prompts, examples=s.rows, score=ctx.score,
                                                        cfg=ctx.cfg, step=s.step, device=device,
                                                        lockstep=ctx.lockstep)
    return per_token(s, ctx, advantages.to(device), loss_mask.to(device), spo=counts)   # (N, T) A, M


def spo_tree(s: StepRollouts, ctx: Context) -> MethodOutput:
    """SPO-tree, docs/related.md §B tree: the step's completions (at most M0 tokens) are the trees'
    first level; the trees grow, their leaves are scored, every node's A = V(node) - V(parent), and
    the edges drawn from the replay buffer are trained (their π_old from when they were generated).
    The statistics of the step's completions are those of its trees' leaves."""
    local = s.indices[ctx.mine].tolist()
    grown = ctx.state.tree.step(ctx.engine, ctx.policy, examples=local, rollout=s.rollout, seeds=s.seeds,
                                scored=s.scored, step=s.step, score=ctx.score)
    stats = MethodStats(grown.leaves, _token_adv_sums(grown.advantages, grown.loss_mask), grown.counts)
    return MethodOutput(grown.advantages, grown.loss_mask, stats, rows=grown.rows, old_logp=grown.old_logp)


def single_stream(s: StepRollouts, ctx: Context) -> MethodOutput:
    """Single-stream PO, docs/methods.md §10: A = r - v̂(x), the prompt's tracked value before this visit,
    normalised over every completion of the batch; then the tracker folds the visit in, its decay from how far
    the policy moved since the prompt's last visit (related/single_stream.py; π_old read first)."""
    tracker = ctx.state.single_stream
    advantages = single_stream_advantages(s.rewards, tracker.values(s.indices), ctx.cfg.algo.adv_eps)   # (B, G)
    out = per_completion(s, ctx, advantages)
    out.metrics = tracker.visit(ctx.policy, indices=s.indices, mine=ctx.mine, rewards=s.rewards, rollout=s.rollout,
                                old_logp=s.old_logp)
    return out


# ---- the one place a method is chosen ----

def method_for(cfg: Config, train_ids: list[list[int]], pad_id: int, dist_: Dist, lockstep: bool,
               problems: list[str] | None = None) -> Method:
    """The method named by algo.advantage, with its generation budget, its replicated state, and what
    it reads first or generates. `problems`: the train rows' texts (Single-stream PO's offline prior)."""
    name, T = cfg.algo.advantage, cfg.rollout.max_new_tokens
    kl = cfg.algo.kl_coef > 0                            # REINFORCE++'s KL reward (config.py: its methods only)
    ers = EMAStats(cfg.ers.alpha) if cfg.ers.enabled else None     # config.py: with GROUP_BASELINES only
    # the methods computed from the step's rewards (REINFORCE++'s KL reward: and π_old, π_ref), generating nothing
    from_rewards = {"grpo": grpo, "rloo": rloo, "maxrl": maxrl, "reinforce_pp": reinforce_pp,
                    "reinforce_pp_baseline": reinforce_pp_baseline}
    if name in from_rewards:
        return Method(name, from_rewards[name], T, MethodState(ers=ers), reads_old=kl, reads_ref=kl)
    if name == "spo_chain":
        return Method(name, spo_chain, T, reads_old=True, generates=True)
    if name == "spo_tree":
        from pspo.related.spo import SPOTree
        tree = SPOTree(cfg, train_ids, pad_id, dist_, lockstep)
        return Method(name, spo_tree, cfg.spo.segments[0], MethodState(tree=tree), generates=True)
    if name == "single_stream":                          # its tracker's drift reads π_old (rho = kl)
        from pspo.related.single_stream import ValueTracker
        tracker = ValueTracker(cfg, train_ids, pad_id, dist_, problems)
        return Method(name, single_stream, T, MethodState(single_stream=tracker), reads_old=tracker.kl)
    raise ValueError(f"algo.advantage: no method named {name!r}")   # config.py validates the name first


# ---- the calls every method shares (module docstring) ----

def score_first(method: Method, s: StepRollouts, ctx: Context) -> tuple[Tensor | None, Tensor | None]:
    """(π_old, π_ref) log-probs (N, T) of the step's completions that the method reads, each None where
    it does not. Collective when it scores."""
    return score_policy(ctx.policy, ctx.ref, s.inputs, cfg=ctx.cfg, need_old=method.reads_old,
                        need_ref=method.reads_ref)


def group_baseline(method: Method, s: StepRollouts, ctx: Context) -> GroupBaseline | None:
    """ERS's step, docs/methods.md §2: every prompt's reward (mean, std) (B,) for a method whose baseline
    is its group (`Method.reads_group`), None for the others. Without ERS the group's own (μ, s); with
    ers.enabled each prompt's group is folded into its statistics first and the smoothed (m_q, sqrt(v_q))
    replace them, with ERS's diagnostics. The same on every rank (the rewards are every rank's)."""
    if not method.reads_group:
        return None
    ers = ctx.state.ers
    if ers is None:
        return GroupBaseline(*group_statistics(s.rewards))                         # (B,) μ, s  §1
    problems = [ctx.problems[i] for i in s.indices.tolist()]
    mean, std = ers.smooth(problems, s.rewards)                                    # (B,) m_q, sqrt(v_q)
    stats = ers.batch_stats(problems, s.rewards, mean, ctx.distinct_problems)
    return GroupBaseline(mean, std, {f"ers_{k}": v for k, v in stats.items()})


def training_batch(out: MethodOutput, s: StepRollouts, ctx: Context) -> tuple[UpdateBatch, dict[str, float]]:
    """The batch the optimizer step trains on: the method's advantages and loss mask on its rows (the
    step's completions, or SPO-tree's edges), π_ref scored where the loss needs it (algo.beta > 0),
    π_old where the update (num_iterations > 1) or the correction (rollout.is_correction) needs it and
    the method did not read it first, and A·w_PPS·w_IS (`weigh`). Returns it with the engine/trainer
    mismatch metrics (`weigh`). Collective when it scores."""
    cfg = ctx.cfg
    need_ref = cfg.algo.needs_reference
    if out.rows is not None:                      # SPO-tree's edges: their own π_old, no IS weight
        rows = out.rows
        _, ref_logp = score_policy(ctx.policy, ctx.ref, rows, cfg=cfg, need_old=False, need_ref=need_ref)
        return UpdateBatch(rows.input_ids, rows.attention_mask, rows.mask, out.loss_mask, out.advantages,
                           out.old_logp, ref_logp), {}
    rows, r = s.inputs, cfg.rollout
    keep_old = s.old_logp is not None or cfg.algo.num_iterations > 1
    score_old = s.old_logp is None and (keep_old or r.is_correction != "none")
    old_logp, ref_logp = score_policy(ctx.policy, ctx.ref, rows, cfg=cfg, need_old=score_old,
                                      need_ref=need_ref and s.ref_logp is None)
    old_logp = s.old_logp if s.old_logp is not None else old_logp
    ref_logp = s.ref_logp if s.ref_logp is not None else ref_logp
    pps = s.is_weights[ctx.mine].reshape(-1, 1)                                    # (N, 1) w_PPS
    advantages, metrics = weigh(out.advantages, pps_weights=pps, old_logp=old_logp, engine_logp=s.rollout.logprobs,
                                mask=rows.mask, r=r)
    loss_mask = out.loss_mask
    if cfg.algo.overlong_filter:
        loss_mask, metrics["overlong_filtered_frac"] = overlong_filtered(loss_mask, s.rollout.truncated)
    return UpdateBatch(rows.input_ids, rows.attention_mask, rows.mask, loss_mask, advantages,
                       old_logp if keep_old else None, ref_logp), metrics


def overlong_filtered(loss_mask: Tensor, truncated: Tensor) -> tuple[Tensor, float]:
    """DAPO's overlong filtering, docs/methods.md §9: the loss mask (N, T) with the rows of truncated
    completions (N,) bool zeroed, and the share of every rank's completions so filtered. Their rewards
    already entered their groups' statistics; the method's statistics still count them. Collective."""
    keep = (~truncated).to(loss_mask.device, loss_mask.dtype)                     # (N,)
    sums = distributed.reduce_sums({"filtered": float(truncated.sum()), "completions": float(len(truncated))},
                                   loss_mask.device)
    return loss_mask * keep[:, None], sums["filtered"] / max(sums["completions"], 1.0)


def weigh(advantages: Tensor, *, pps_weights: Tensor, old_logp: Tensor | None, engine_logp: Tensor, mask: Tensor,
          r: RolloutConfig) -> tuple[Tensor, dict[str, float]]:
    """The one place a method's token advantages A (N, T) are weighted: A · w_PPS (the sampler's weight of
    the completion, (N, 1), docs/methods.md §3) · w_IS (rollout.is_correction, §7: r = π_old/π_engine per
    token or per sequence, from the engine's log-probs (N, T) of the step's rollout, truncated to
    [C_low, C] or, in the `_mask` modes, 0 outside it). Both multiply the policy-gradient term only: the
    loss adds its KL term unweighted, and a masked token stays in the loss mask (TRL's masking, not
    verl's rejection). Returns the weighted A on the mask's device and the engine/trainer mismatch
    metrics over every rank, whenever π_old was scored ({} otherwise). Collective when π_old was scored."""
    device = mask.device
    weights = pps_weights.to(device)                                               # (N, 1) w_PPS
    metrics = {}
    if old_logp is not None:
        engine_logp = engine_logp.to(device)                                       # (N, T) log π_engine
        metrics = _mismatch_metrics(old_logp, engine_logp, mask, r)
        if r.is_correction != "none":
            w_is = correction_weights(old_logp, engine_logp, mask, r.is_correction, cap=r.is_cap,
                                      floor=r.is_floor)
            weights = weights * w_is                                               # (N, T) w_PPS · w_IS
    return advantages.to(device) * weights, metrics                               # (N, T)


# ---- shared pieces ----

def per_completion(s: StepRollouts, ctx: Context, advantages: Tensor) -> MethodOutput:
    """A method's one value per completion of every rank's groups (B, G): this rank's, broadcast over
    each completion's tokens; the loss mask is the completion mask. Its statistics count completions."""
    mine = advantages[ctx.mine]                                                    # (B_local, G)
    mask = s.inputs.mask                                                           # (N, T)
    sums = AdvantageSums(float(mine.abs().sum()), float((mine ** 2).sum()), float(mine.numel()))
    return MethodOutput(mine.reshape(-1, 1).expand_as(mask), mask, MethodStats(_rollout_sums(s, ctx), sums))


def per_token(s: StepRollouts, ctx: Context, advantages: Tensor, loss_mask: Tensor,
              spo: ChainSums | None = None) -> MethodOutput:
    """A method's token advantages (N, T) on the loss mask's tokens (N, T) of this rank's completions;
    its statistics count those tokens (and SPO-chain's counts)."""
    stats = MethodStats(_rollout_sums(s, ctx), _token_adv_sums(advantages, loss_mask), spo)
    return MethodOutput(advantages, loss_mask, stats)


def _reinforce(s: StepRollouts, ctx: Context, baseline: Tensor | None) -> MethodOutput:
    """REINFORCE++(-baseline), §A, from π_old and π_ref read first (the KL reward, when kl_coef > 0);
    baseline (N,) b_i subtracted from each R_i first, or None."""
    a = ctx.cfg.algo
    mask = s.inputs.mask                                                           # (N, T)
    rewards = s.rewards[ctx.mine].reshape(-1).to(mask.device)                      # (N,) R
    baseline = baseline.to(mask.device) if baseline is not None else None
    advantages = reinforce_pp_advantages(rewards, mask, old_logp=s.old_logp, ref_logp=s.ref_logp, kl_coef=a.kl_coef,
                                         clip_score=a.clip_score, baseline=baseline, variance=a.whiten,
                                         reduce_sum=distributed.all_reduce_sum)   # (N, T)
    return per_token(s, ctx, advantages, mask)


def _mismatch_metrics(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, r: RolloutConfig) -> dict[str, float]:
    """Over every rank's tokens: the mean and largest |log π_old − log π_engine| (engine_gap_mean,
    engine_gap_max), and with a correction the mean IS weight (tis_weight_mean) and, truncated, the
    share of tokens whose ratio it moved to a bound (tis_capped_frac) or, masked, the share of tokens
    whose weight it zeroed (tis_masked_frac) and of completions with such a token (tis_masked_seq_frac),
    docs/methods.md §7. Collective."""
    sums = mismatch_sums(old_logp, engine_logp, mask, r.is_correction, cap=r.is_cap, floor=r.is_floor)
    gap_max = distributed.all_reduce_max(sums.pop("gap_max").float())
    totals = distributed.reduce_sums({k: float(v) for k, v in sums.items()}, mask.device)
    tokens = max(totals["tokens"], 1.0)
    metrics = {"engine_gap_mean": totals["gap_sum"] / tokens, "engine_gap_max": float(gap_max)}
    if r.is_correction != "none":
        metrics["tis_weight_mean"] = totals["weight_sum"] / tokens
    if "capped" in totals:
        metrics["tis_capped_frac"] = totals["capped"] / tokens
    if "masked" in totals:
        metrics["tis_masked_frac"] = totals["masked"] / tokens
        metrics["tis_masked_seq_frac"] = totals["masked_seqs"] / max(totals["seqs"], 1.0)
    return metrics


def _rollout_sums(s: StepRollouts, ctx: Context) -> RolloutSums:
    """This rank's statistics of its completions (the logged means are taken over ranks)."""
    rewards, rollout, scored = s.rewards[ctx.mine], s.rollout, s.scored           # (B_local, G)
    return RolloutSums(completions=float(rewards.numel()), groups=float(rewards.shape[0]),
                       completion_tokens=float(rollout.mask.sum()), reward=float(rewards.sum()),
                       reward_sq=float((rewards ** 2).sum()),
                       accuracy=float(scored.components["accuracy"].sum()),
                       format=float(scored.components["format"].sum()),
                       zero_std_groups=float(zero_variance(rewards).sum()),
                       truncated=float(rollout.truncated.sum()),
                       reward_failures=float(sum(scored.failures.values())),
                       overlong=float(scored.components["overlong"].sum()) if "overlong" in scored.components else 0.0)


def _token_adv_sums(advantages: Tensor, loss_mask: Tensor) -> AdvantageSums:
    """|A| and A² summed over the tokens of the loss, and their count (before the IS weights)."""
    return AdvantageSums(adv_abs=float(advantages.abs().sum()), adv_sq=float((advantages ** 2).sum()),
                         adv_count=float(loss_mask.sum()))
