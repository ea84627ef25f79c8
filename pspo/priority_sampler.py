"""PPS: prompt-level prioritized sampling with importance weights (docs/methods.md §3).

Per prompt q a priority p_q; after its group is scored

    p_q = (mean_i |A_i^GRPO| + ε_p)^α                 (raw GRPO advantages; ε_p = 1e-6)

Every step draws B distinct prompts with P(q) = p_q / Σ_k p_k from the CURRENT priorities, and
weights them as prioritized experience replay does:

    w_q = (N·P(q))^(-β) / max over the drawn batch     (w ≤ 1; β annealed linearly to beta_end)

Departures from the released code, on purpose: sampling follows the live priorities every step
(the released code effectively froze them per epoch); the batch is B distinct prompts weighted by the
single-draw P(q), where prioritized replay and the released code draw B independently (`replacement`
does; §3 measures the error); the weights are normalized by the batch max (the released code's reach ~27;
`is_norm: none` keeps them so, `mean` divides by the batch mean);
the priority is the group's mean |A| (`priority: mean_abs`), the expected value of the
released code's last-sample |A| (`last_abs` keeps that, `max_abs` is offered).
Unseen prompts carry the running maximum priority (1.0 at the start), so every prompt is tried (Thompson's
are drawn from the prior like the others).

The fixes of docs/methods.md §3b, each off by default (the paper's method):
  uniform_mix u    P'(q) = (1-u)·P(q) + u/N: no prompt falls below u/N. Drawn as P' ∝ p_q + c with
                   c = u·Σp / ((1-u)·N), through a second tree that counts the live leaves.
  priority learnability   a_q <- λ·a_q + Σ_i r̂_i, b_q <- λ·b_q + Σ_i (1-r̂_i) (a = b = 1 at the start),
                   p̂ = a/(a+b), p_q = (p̂(1-p̂) + ε_p)^α: the prompt's learnability; one all-wrong
                   group lowers it without abandoning the prompt. r̂ is the accuracy in [0, 1].
                   λ applies when the prompt is scored (old evidence counts less than new).
  priority thompson    the same counts; each step draws θ_q ~ Beta(a_q, b_q) for every prompt (a numpy
                   generator seeded from the sampler's) and sets p_q = (θ_q(1-θ_q) + ε_p)^α.
  priority single_stream   the same counts, p_q = (sqrt(p̂(1-p̂)) + ε_p)^α: Single-stream PO's
                   prioritized sampling (docs/methods.md §10; its recipe: α = 1, ε_p = 0.05, β = 0).
  prior_reversion r    each step, before its draw, every prompt's counts move a share r back to the prior:
                   a <- 1 + (1-r)·(a-1), b likewise, so an abandoned prompt's learnability rises back.
                   Thompson's draw and the reversion rescore all N leaves and rebuild the tree: O(N)
                   vectorised per step (learnability alone updates the B scored leaves, O(B log N)).
  skip             a drawn prompt whose last k ≥ 1 groups all had zero variance is kept with
                   probability max(ρ^k, s_min), else skipped before any rollout and replaced by
                   another draw (GRESO-style); the skips are counted.
  replacement      B independent draws from P' (prioritized experience replay's own draw), for
                   which (N·P')^-β is the exact weight; a prompt may then be drawn twice in a batch,
                   and its groups are scored in batch order.

Priorities live in a sum-tree (one float64 array, leaves at [S, S+N)), so a draw is a
vectorized descent of log2(N) levels: B of N = 10^6 costs well under a millisecond
(bench/priority_sampler.py). When the running maximum rises, the unseen leaves are raised with it
and the tree is rebuilt in O(N); that happens only on a new maximum.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from pspo.estimators import group_advantages, group_mean

# pps.priority: a statistic of |A| | p̂(1-p̂) | θ(1-θ), θ ~ Beta(a, b) drawn each step | sqrt(p̂(1-p̂))
PRIORITIES = ("mean_abs", "max_abs", "last_abs", "learnability", "thompson", "single_stream")
BETA_PRIORITIES = ("learnability", "thompson", "single_stream")   # read the Beta counts of the accuracy
IS_NORMS = ("batch_max", "mean", "none")         # pps.is_norm: w / max over the batch | w / mean over it | w


def check_resumed_prompts(saved: int, num_prompts: int) -> None:
    """ValueError unless a checkpoint's sampler state (any of the three samplers') covers `saved` =
    num_prompts prompts, as many as the dataset has."""
    if saved != num_prompts:
        raise ValueError(f"checkpoint sampler has {saved} prompts, the dataset has {num_prompts}: "
                         "resume with the same data.train")


class PrioritySampler:
    """PPS over `num_prompts` prompts; the options are the pps section's (config.py), by keyword.

    alpha α, beta β (at the first step) and beta_end (at step total_steps; None keeps β), eps ε_p;
    priority (PRIORITIES) and, for BETA_PRIORITIES, posterior_decay λ and prior_reversion r; is_norm (IS_NORMS);
    uniform_mix u; skip with skip_rho ρ and skip_min s_min; replacement (B independent draws); seed of the
    draws; scale_rewards and adv_eps: the algo section's, for the raw GRPO |A| a group's rewards give
    (docs/methods.md §1).
    """

    def __init__(self, num_prompts: int, *, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6,
                 priority: str = "mean_abs", seed: int = 0, beta_end: float | None = None,
                 total_steps: int = 1, is_norm: str = "batch_max", uniform_mix: float = 0.0,
                 posterior_decay: float = 1.0, prior_reversion: float = 0.0, skip: bool = False, skip_rho: float = 0.5,
                 skip_min: float = 0.01, replacement: bool = False, scale_rewards: bool = True,
                 adv_eps: float = 1e-4):
        if priority not in PRIORITIES:
            raise ValueError(f"pps.priority: expected one of {', '.join(PRIORITIES)}, got {priority!r}")
        if is_norm not in IS_NORMS:
            raise ValueError(f"pps.is_norm: expected one of {', '.join(IS_NORMS)}, got {is_norm!r}")
        if num_prompts < 1:
            raise ValueError("PrioritySampler: the dataset has no prompts")
        if replacement and skip:
            raise ValueError("pps.replacement: false with pps.skip (a skip replaces a prompt among the "
                             "distinct ones)")
        self.num_prompts, self.alpha, self.beta, self.eps = num_prompts, alpha, beta, eps
        self.priority = priority
        if not 0 <= uniform_mix < 1:
            raise ValueError(f"pps.uniform_mix: expected a value in [0, 1), got {uniform_mix}")
        self.is_norm, self.uniform_mix, self.decay = is_norm, uniform_mix, posterior_decay
        self.reversion = prior_reversion
        self.skip, self.skip_rho, self.skip_min = skip, skip_rho, skip_min
        self.replacement = replacement
        self.scale_rewards, self.adv_eps = scale_rewards, adv_eps
        self.beta_end = beta if beta_end is None else beta_end
        self.total_steps = max(1, total_steps)
        self.size = 1 << max(0, (num_prompts - 1).bit_length())                 # S, a power of two ≥ N
        self.depth = self.size.bit_length() - 1
        self.tree = torch.zeros(2 * self.size, dtype=torch.float64)             # node i: children 2i, 2i+1
        self.count = torch.zeros(2 * self.size, dtype=torch.float64)            # live leaves under node i
        self.seen = torch.zeros(num_prompts, dtype=torch.bool)
        self.posterior_a = torch.ones(num_prompts, dtype=torch.float64)         # decayed Beta counts
        self.posterior_b = torch.ones(num_prompts, dtype=torch.float64)
        # zero-variance groups in a row
        self.zero_streak = torch.zeros(num_prompts, dtype=torch.int64)
        # Beta priorities: every prompt starts at the prior's learnability .25, the largest possible
        self.max_priority = (0.25 + eps) ** alpha if priority in BETA_PRIORITIES else 1.0
        if priority == "single_stream":                                         # sqrt(.25) = .5, likewise
            self.max_priority = (0.5 + eps) ** alpha
        self.steps = 0                                                          # steps drawn so far
        # the last draw (`sample`): its raw weights (N·P')^-β (B,) float64, the one source of its w, and its
        # statistics; part of the state, since at one step off the draw is observed after the checkpoint
        self.last_sample: dict | None = None
        self.generator = torch.Generator().manual_seed(seed)
        self.tree[self.size:self.size + num_prompts] = self.max_priority
        self.count[self.size:self.size + num_prompts] = 1.0
        self._rebuild()

    # ---- the sum-tree ----
    def _rebuild(self) -> None:
        lo = self.size
        while lo > 1:
            hi, lo = lo, lo // 2
            for t in (self.tree, self.count):
                t[lo:hi] = t[2 * lo:2 * hi:2] + t[2 * lo + 1:2 * hi:2]

    def _set(self, indices: np.ndarray, values: np.ndarray, live: float | None = None) -> None:
        """Set leaves (and, given `live`, their live counts) and re-sum their ancestors, one level
        at a time (numpy views of the trees).

        A parent shared by several leaves is written several times with the same sum: harmless.
        """
        nodes = np.asarray(indices, dtype=np.int64) + self.size
        for tree, leaf in ((self.tree.numpy(), values), (self.count.numpy(), live)):
            if leaf is None:
                continue
            tree[nodes] = leaf
            up = nodes
            for _ in range(self.depth):
                up = up // 2
                tree[up] = tree[2 * up] + tree[2 * up + 1]

    def _mix_constant(self) -> float:
        """c such that p_q + c ∝ P'(q) = (1-u)·p_q/Σp + u/N: c = u·Σp / ((1-u)·N)
        (0 without the mix)."""
        u = self.uniform_mix
        return u * float(self.tree[1]) / ((1 - u) * self.num_prompts) if u > 0 else 0.0

    def _draw(self, n: int, c: float = 0.0) -> Tensor:
        """n independent draws (with replacement) with P(q) ∝ p_q + c over the live leaves. (n,)

        The descent runs in numpy on views of the trees: the same float64 arithmetic as torch,
        at a fraction of the per-op overhead (log2 N tiny ops dominate the cost).
        """
        tree, count = self.tree.numpy(), self.count.numpy()                     # share memory
        u = torch.rand(n, dtype=torch.float64, generator=self.generator).numpy() * (tree[1] + c * count[1])
        node = np.ones(n, dtype=np.int64)
        for _ in range(self.depth):                                             # descend one level
            left = tree[2 * node] + c * count[2 * node]
            right = u >= left
            u = np.where(right, u - left, u)
            node = 2 * node + right
        return torch.from_numpy(node - self.size)

    # ---- the sampler ----
    def priorities(self) -> Tensor:
        """p_q for every prompt (unseen ones at the running max). (N,)"""
        return self.tree[self.size:self.size + self.num_prompts].clone()

    def probabilities(self) -> Tensor:
        """P'(q) = (p_q + c) / (Σp + c·N), the draw probability of each prompt (P(q) without the
        mix). (N,)"""
        c = self._mix_constant()
        return (self.priorities() + c) / (self.tree[1] + c * self.num_prompts)

    def current_beta(self, step: int | None = None) -> float:
        """β of step `step` (0-based; default: the next step's): linear from beta (the first step) to
        beta_end (step total_steps)."""
        step = self.steps if step is None else step
        frac = min(1.0, step / max(1, self.total_steps - 1))
        return self.beta + (self.beta_end - self.beta) * frac

    def _keep(self, drawn: np.ndarray) -> np.ndarray:
        """pps.skip: which drawn prompts are kept. A prompt whose last k groups all had zero
        variance is kept with probability max(ρ^k, s_min); k = 0 always. (n,) bool"""
        k = self.zero_streak[torch.from_numpy(drawn)].double()
        keep_prob = torch.where(k > 0, torch.clamp(self.skip_rho ** k, min=self.skip_min), torch.ones_like(k))
        return (torch.rand(len(drawn), dtype=torch.float64, generator=self.generator) < keep_prob).numpy()

    def sample(self, batch_size: int, *, same_step: bool = False) -> Tensor:
        """B prompt indices (B,): distinct ones (`_distinct`), or with pps.replacement B independent
        draws from P'. The draw fixes their raw IS weights (`self.last_sample`; normalised: `weights`),
        which `observe` hands to the loop per completion, normalised by `is_norm` (docs/methods.md §3b):
        batch_max w / max_b w (≤ 1, §3), mean w / mean_b w (the average step is GRPO's), none w as is
        (the released code's). same_step: a further draw of the step (dynamic sampling's extra rounds,
        §9), weighted with the step's β: β anneals per step, not per draw.
        """
        if not same_step and (self.priority == "thompson" or self.reversion > 0):
            self._rescore()                                                     # §3b: O(N), once per step
        c = self._mix_constant()                                                # from the full tree
        if self.replacement:                                                    # §3b: PER's draw
            taken, skipped, draws = self._draw(batch_size, c).tolist(), [], batch_size
        else:
            taken, skipped, draws = self._distinct(batch_size, c)
        indices = torch.tensor(taken, dtype=torch.int64)
        probs = (self.tree[indices + self.size] + c) / (self.tree[1] + c * self.num_prompts)   # P'(q)
        # Departure (§3): drawn without replacement, q is in the batch with probability π_q, not B·P'(q), so
        # (N·P')^-β is not (N·π/B)^-β: up to 14% apart on the demo by step 150 (bench/RESULTS.md §29)
        if not same_step:                                                       # the step's first draw
            self.steps += 1
        beta = self.current_beta(self.steps - 1)
        weights = (self.num_prompts * probs) ** (-beta)                         # (B,) (N·P')^-β
        self.last_sample = {"raw_weights": weights, "draws": draws, "distinct": len(set(taken)),
                     "revisit": float(self.seen[indices].float().mean()), "skipped": len(skipped)}
        return indices

    def _rescore(self) -> None:
        """The Beta priorities' pass before a step's draw (docs/methods.md §3b): the counts revert a share r
        toward the prior, a <- 1 + (1-r)·(a-1) and b likewise (pps.prior_reversion), then every leaf is
        rescored as (x(1-x) + ε_p)^α from x = p̂ = a/(a+b) (learnability; single_stream: (sqrt(x(1-x)) + ε_p)^α)
        or x = θ ~ Beta(a, b) (thompson), and the tree rebuilt: O(N) vectorised."""
        a, b, r = self.posterior_a, self.posterior_b, self.reversion
        if r > 0:
            a.sub_(1).mul_(1 - r).add_(1)
            b.sub_(1).mul_(1 - r).add_(1)
        if self.priority == "thompson":         # one seed from the sampler's generator: a resume draws the same θ
            seed = int(torch.randint(2**62, (1,), generator=self.generator))
            x = torch.from_numpy(np.random.default_rng(seed).beta(a.numpy(), b.numpy()))   # (N,) θ
        else:
            x = a / (a + b)                                                     # (N,) p̂
        stat = x * (1 - x)
        if self.priority == "single_stream":                                    # §10: its square root
            stat = stat.sqrt()
        self.tree[self.size:self.size + self.num_prompts] = (stat + self.eps) ** self.alpha
        self._rebuild()

    @property
    def weights(self) -> Tensor | None:
        """The last draw's IS weights w (B,) float32, normalised by is_norm; None before any draw."""
        if self.last_sample is None:
            return None
        return self.normalize(self.last_sample["raw_weights"][:, None])[:, 0]

    def _distinct(self, batch_size: int, c: float) -> tuple[list[int], list[int], int]:
        """B distinct prompts drawn with P' ∝ p_q + c: the batch, the skipped prompts, the raw draws.

        Successive sampling without replacement, in rounds: a round draws as many prompts as are
        still missing, keeps each new one in draw order (a repeat is discarded, which is the same
        as redrawing from the prompts not yet taken), then zeroes the kept leaves (value and live
        count) so that later rounds cannot hit them. Every round keeps at least one prompt and
        costs O(missing · log N), whatever the priorities. With pps.skip, a drawn prompt may be
        skipped instead: its leaf is zeroed too, so the next round replaces it; if the prompts
        run out first, the skipped ones are taken back in draw order. All leaves are restored
        at the end.
        """
        if batch_size > self.num_prompts:
            raise ValueError(f"train.prompts_per_step: {batch_size} distinct prompts asked of "
                             f"{self.num_prompts}")
        leaves = self.tree.numpy()[self.size:]                                  # views: zeroing shows here
        live = self.count.numpy()[self.size:]
        taken, skipped, draws = [], [], 0
        removed, values = [], []                                                # zeroed leaves, their values
        while len(taken) < batch_size:
            if self.tree[1] + c * self.count[1] <= 0:                           # nothing drawable is left
                if self.skip and skipped:
                    back = batch_size - len(taken)
                    taken.extend(skipped[:back])
                    skipped = skipped[back:]
                    continue
                self._set(np.array(removed, dtype=np.int64), np.array(values), 1.0)
                raise ValueError(f"PrioritySampler: {batch_size} distinct prompts asked, but only "
                                 f"{len(taken)} have a priority above 0")
            drawn = self._draw(batch_size - len(taken), c).numpy()              # (missing,)
            draws += len(drawn)
            # padding and taken ones (rounding)
            drawn = drawn[(leaves[drawn] + c * live[drawn]) > 0]
            # first occurrences, in draw order
            drawn = drawn[np.sort(np.unique(drawn, return_index=True)[1])]
            removed.extend(drawn.tolist())
            values.extend(leaves[drawn].tolist())
            self._set(drawn, np.zeros(len(drawn)), 0.0)
            keep = self._keep(drawn) if self.skip else np.ones(len(drawn), dtype=bool)
            taken.extend(drawn[keep].tolist())
            skipped.extend(drawn[~keep].tolist())
        self._set(np.array(removed, dtype=np.int64), np.array(values), 1.0)    # priorities back
        return taken, skipped, draws

    def batch_stats(self) -> dict[str, float]:
        """Diagnostics of the last `sample` and of the current priorities, logged with the step that trains
        the draw (read right after `observe`, so a draw made one step ahead is logged with its own step).

        entropy: H(P') / ln N, 1 for uniform priorities, lower as sampling concentrates.
        is_max / is_min: the unnormalized (N·P')^-β of the batch (the loss uses w = these / is_max).
        ess: effective sample size of the batch's weights, (Σw)² / Σw², out of B.
        repeat_frac: fraction of raw draws that hit a prompt already in the batch (redrawn, or with
        pps.replacement kept).
        revisit_frac: fraction of the batch's prompts that were scored in an earlier step.
        skipped: prompts drawn and skipped before generation (pps.skip; 0 without it).
        """
        last = self.last_sample
        raw = last["raw_weights"]
        probs = self.probabilities()
        probs = probs[probs > 0]
        entropy = (float(-(probs * probs.log()).sum()) / math.log(self.num_prompts)
                   if self.num_prompts > 1 else 1.0)
        ess = float(raw.sum() ** 2 / (raw ** 2).sum())
        repeat = 1.0 - (last["distinct"] + last["skipped"]) / last["draws"]
        return {"entropy": entropy, "is_max": float(raw.max()), "is_min": float(raw.min()), "ess": ess,
                "repeat_frac": repeat, "revisit_frac": last["revisit"], "skipped": float(last["skipped"])}

    def observe(self, indices: Tensor, rewards: Tensor, accuracy: Tensor, *, normalized: bool = True) -> Tensor:
        """The step's scores -> the scored prompts' priorities, and the batch's IS weights per completion.

        indices (B,) as `sample` drew them; rewards and accuracy (B, G) of every rank. The priority
        comes from the raw GRPO |A| of each group (whatever advantage the method trains on, ERS's
        included), or from the accuracy r̂ in [0, 1] with the Beta priorities. Returns (B, G): the
        weights the draw gave, one per completion, which multiply the policy-gradient term; normalized
        False: the raw (N·P')^-β (float64), for a step that trains groups of several draws and
        normalizes them together (`normalize`; dynamic sampling, docs/methods.md §9).
        """
        abs_advantages = group_advantages(rewards, self.scale_rewards, self.adv_eps).abs()   # (B, G) §1
        weights = self.set_priorities(indices, abs_advantages, accuracy if self.priority in BETA_PRIORITIES else None)
        if normalized:
            return weights
        last = self.last_sample
        raw = last["raw_weights"] if last is not None else torch.ones(len(indices), dtype=torch.float64)
        return raw[:, None].expand(-1, rewards.shape[1]).clone()                # (B, G) (N·P')^-β

    def normalize(self, raw: Tensor) -> Tensor:
        """Raw weights (P, G) float64 (a group's completions share its prompt's) -> the weights `sample` gives a
        batch of these P prompts: divided by their max (batch_max) or mean (mean), or as they are (none),
        float32 (docs/methods.md §3b)."""
        prompts = raw[:, 0]                                                     # (P,) one per prompt
        if not len(prompts):
            return raw.float()
        norm = {"batch_max": prompts.max(), "mean": prompts.mean(), "none": 1.0}[self.is_norm]
        return (raw / norm).float()

    def set_priorities(self, indices: Tensor, abs_advantages: Tensor, successes: Tensor | None = None) -> Tensor:
        """Set the scored prompts' priorities and return the batch's IS weights per completion (B, G).

        abs_advantages (B, G) ≥ 0, the raw GRPO |A|: p_q = (stat_i |A_i| + ε)^α; `successes` (B, G)
        in [0, 1] (the accuracy) feed the Beta counts instead with BETA_PRIORITIES. Zero-variance
        groups (every |A| = 0) lengthen the prompt's skip streak; any other group resets it. A prompt
        in the batch twice (pps.replacement) has its groups scored one after the other, in batch order.
        """
        a = abs_advantages.detach().double().cpu()
        indices = indices.cpu().long()
        # checked before any change
        weights = self._weights_for(len(indices), a.shape[1])                  # (B, G)
        if self.priority in BETA_PRIORITIES and successes is None:
            raise ValueError(f"pps.priority={self.priority}: set_priorities needs the completions' successes")
        earlier = occurrence(indices)                                          # (B,) rows of the same prompt before
        for k in range(int(earlier.max()) + 1 if len(indices) else 0):         # one pass when all are distinct
            rows = earlier == k
            self._score(indices[rows], a[rows], None if successes is None else successes[rows])
        return weights

    def _score(self, indices: Tensor, a: Tensor, successes: Tensor | None) -> None:
        """set_priorities for distinct indices (B',): |A| rows a (B', G) float64, successes (B', G)."""
        zero = a.amax(1) == 0
        self.zero_streak[indices] = torch.where(zero, self.zero_streak[indices] + 1, 0)
        self.seen[indices] = True
        if self.priority in BETA_PRIORITIES:                                    # §3b: decayed Beta counts
            r = successes.detach().double().cpu().clamp(0, 1)                   # (B, G)
            self.posterior_a[indices] = self.decay * self.posterior_a[indices] + r.sum(1)
            self.posterior_b[indices] = self.decay * self.posterior_b[indices] + (1 - r).sum(1)
            if self.priority == "thompson":     # its leaves stay the step's draw until the next step's (_rescore)
                return
            mean = self.posterior_a[indices] / (self.posterior_a[indices] + self.posterior_b[indices])
            stat = mean * (1 - mean)                                            # p̂(1 - p̂) ≤ .25
            if self.priority == "single_stream":                                # §10: its square root
                stat = stat.sqrt()
        else:
            stat = {"mean_abs": lambda: group_mean(a), "max_abs": lambda: a.amax(1),
                    "last_abs": lambda: a[:, -1]}[self.priority]()
        values = (stat + self.eps) ** self.alpha                                # (B,)
        self._set(indices.numpy(), values.numpy())
        new_max = float(values.max())
        # unseen prompts follow the max
        if new_max > self.max_priority:
            self.max_priority = new_max
            leaves = self.tree[self.size:self.size + self.num_prompts]
            leaves[~self.seen] = new_max
            self._rebuild()

    def _weights_for(self, batch: int, groups: int) -> Tensor:
        """The last sample's weights, one per completion (B, G): every completion of a group shares
        its prompt's.

        Ones when nothing was sampled yet (priorities set directly). An observation of another number of
        prompts than the last sample drew is a ValueError: its weights would belong to other prompts."""
        weights = self.weights
        if weights is None:
            return torch.ones(batch, groups)
        if len(weights) != batch:
            raise ValueError(f"PrioritySampler.observe: {batch} prompts scored, but the last sample drew "
                             f"{len(weights)}; observe the prompts of the last sample")
        return weights[:, None].expand(batch, groups).clone()

    def state_dict(self) -> dict:
        return {"priorities": self.priorities(), "seen": self.seen.clone(), "max_priority": self.max_priority,
                "steps": self.steps, "rng": self.generator.get_state(),
                "posterior_a": self.posterior_a.clone(), "posterior_b": self.posterior_b.clone(),
                "zero_streak": self.zero_streak.clone(), "last_sample": self.last_sample}

    def load_state_dict(self, state: dict) -> None:
        if "priorities" not in state:
            raise ValueError("pps.mode: the checkpoint was trained with pps.mode=released; "
                             "resume with the same mode")
        check_resumed_prompts(len(state["priorities"]), self.num_prompts)
        self.tree.zero_()
        self.tree[self.size:self.size + self.num_prompts] = state["priorities"]
        self._rebuild()
        self.seen, self.max_priority = state["seen"].clone(), state["max_priority"]
        self.steps = state["steps"]
        self.generator.set_state(state["rng"])
        for key in ("posterior_a", "posterior_b", "zero_streak"):              # absent in older checkpoints
            if key in state:
                setattr(self, key, state[key].clone())
        self.last_sample = state.get("last_sample")


def occurrence(indices: Tensor) -> Tensor:
    """For each position, how many earlier positions hold the same index: [5, 2, 5, 5, 2] -> [0, 0, 1, 2, 1].
    A stable sort puts equal indices in runs, in batch order; a position's occurrence is its distance to its
    run's start. O(B log B) time and O(B) memory (a (B, B) comparison would ask 34 GB at B = 65,536). (B,)"""
    B = len(indices)
    order = torch.sort(indices, stable=True).indices                             # (B,)
    ranked = indices[order]
    starts = torch.ones(B, dtype=torch.bool)
    starts[1:] = ranked[1:] != ranked[:-1]                                       # a run begins
    position = torch.arange(B)
    run_start = torch.cummax(torch.where(starts, position, 0), 0).values        # (B,) its run's first position
    earlier = torch.empty(B, dtype=torch.int64)
    earlier[order] = position - run_start
    return earlier
