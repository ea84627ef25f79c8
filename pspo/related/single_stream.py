"""Single-stream PO's value tracker (Xu & Ding 2025, arXiv:2509.13232; docs/methods.md §10): per train prompt
x a Beta(α, β) of its success, v̂(x) = α / (α + β), kept across the prompt's visits, whose decay adapts to how
far the policy moved since the prompt's last visit. (Not SPO, the Segment Policy Optimization of spo.py.)

    prior, no offline samples:        α0 = β0 = 0.5
    prior, s successes in n offline samples (n ≤ N_eff), N_init = 1 / (1 - ρ_min):
                                      α0 = N_init·(s + 0.5)/(n + 1),   β0 = N_init·(n - s + 0.5)/(n + 1)
    a visit with rewards r_1..r_G:    α ← ρ·α + Σ_i r_i,               β ← ρ·β + Σ_i (1 - r_i)
    ρ = clip(2^(-D / D_half), ρ_min, ρ_max)            (single_stream.rho = kl; constant: ρ = rho_value)
    D = the mean over the tokens of the prompt's last completion of |log π_then - log π_now|

π_then is that completion's log-probs under the trainer's policy at its visit, before that step's update (the
step's π_old, which the method reads first); π_now the same completion scored at this visit, before this step's
update. A first visit has D = 0, so ρ = ρ_max. The method (methods.single_stream) reads v̂ before the visit:
A = r - v̂, normalised over the batch (estimators.single_stream_advantages).

State, replicated on every rank and saved in checkpoints: α, β and the visit count of every train row (N,), and
with rho = kl each visited prompt's last completion (its first of G): its token ids (int32) and π_then (float32),
at most N × T × 8 bytes on the CPU (T = rollout.max_new_tokens). Each rank scores the stored completions of its
own prompts of the step; the drifts D and the step's completions are gathered from every rank, so every rank
folds the same visits. Rows are keyed by their index in the train set, as the sampler's are.
"""
from __future__ import annotations

import json
import math

import torch
from torch import Tensor

from pspo.priority_sampler import check_resumed_prompts, occurrence
from pspo.training import distributed
from pspo.training.config import Config, ConfigError, first_line
from pspo.training.distributed import Dist
from pspo.training.logprobs import score_policy
from pspo.training.micro_batches import token_rows
from pspo.training.tokens import Rollout


def kl_rho(drift: Tensor, d_half: float, rho_min: float, rho_max: float) -> Tensor:
    """The decay of each visit, ρ = clip(2^(-D / D_half), ρ_min, ρ_max). drift (B,) D ≥ 0 -> (B,) float64"""
    return torch.pow(2.0, -drift.double() / d_half).clamp(rho_min, rho_max)


def prior_counts(successes: Tensor, samples: Tensor, rho_min: float) -> tuple[Tensor, Tensor]:
    """(α0, β0) (N,) of s successes in n offline samples (N,) each: the mean (s + 0.5)/(n + 1), worth
    N_init = 1/(1 - ρ_min) visits; a prompt without samples (n = 0) gets α0 = β0 = 0.5."""
    s, n = successes.double(), samples.double()
    weight = 1.0 / (1.0 - rho_min)                                              # N_init
    alpha = torch.where(n > 0, weight * (s + 0.5) / (n + 1), 0.5)
    beta = torch.where(n > 0, weight * (n - s + 0.5) / (n + 1), 0.5)
    return alpha, beta


def drift(then_logp: Tensor, now_logp: Tensor, mask: Tensor) -> Tensor:
    """D of each completion: the mean over its tokens of |log π_then - log π_now|, 0 for an empty one.
    (n, T) each -> (n,) float64"""
    keep = mask.bool()
    gap = torch.where(keep, (then_logp.double() - now_logp.double()).abs(), 0.0)   # padding may hold anything
    return gap.sum(1) / keep.sum(1).clamp(min=1)


def offline_prior(path: str, problems: list[str], samples: int, rho_min: float) -> tuple[Tensor, Tensor]:
    """The prior (α0, β0) (N,) of every train row from single_stream.prior_file, a JSON object {problem: [offline
    rewards]} (the recipe's offline_values.json): a reward > 0 is a success, the first `samples` (N_eff) of each
    count, and a problem the file lacks gets 0.5, 0.5. ConfigError (one line) for a file of another form."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"single_stream.prior_file: cannot read {path} ({first_line(e, 200)})") from None
    if not isinstance(table, dict) or not all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
                                              for v in table.values()):
        raise ConfigError(f"single_stream.prior_file: {path}: expected a JSON object of problem: [rewards]")
    table = {k.strip(): v[:samples] for k, v in table.items()}
    scores = [table.get(problem.strip(), []) for problem in problems]
    successes = torch.tensor([sum(x > 0 for x in v) for v in scores], dtype=torch.float64)
    counts = torch.tensor([len(v) for v in scores], dtype=torch.float64)
    return prior_counts(successes, counts, rho_min)


class ValueTracker:
    """Single-stream PO's per-prompt Beta(α, β) over the train rows (module docstring), with cfg.single_stream's
    settings; `train_ids` and `pad_id` rebuild a stored completion's inputs for scoring (rho = kl). `problems`
    (the rows' problem texts) find their offline rewards in single_stream.prior_file."""

    def __init__(self, cfg: Config, train_ids: list[list[int]], pad_id: int, dist_: Dist,
                 problems: list[str] | None = None):
        s = cfg.single_stream
        self.cfg, self.train_ids, self.pad_id, self.device = cfg, train_ids, pad_id, dist_.device
        self.kl = s.rho == "kl"
        N = len(train_ids)
        if s.prior_file:
            if problems is None:
                raise ValueError("single_stream.prior_file: the tracker needs the train rows' problems")
            self.alpha, self.beta = offline_prior(s.prior_file, problems, s.prior_samples, s.rho_min)
        else:
            self.alpha = torch.full((N,), 0.5, dtype=torch.float64)             # (N,) α
            self.beta = torch.full((N,), 0.5, dtype=torch.float64)              # (N,) β
        self.visits = torch.zeros(N, dtype=torch.int64)                         # (N,) visits so far
        self.last: dict[int, tuple[Tensor, Tensor]] = {}   # row -> its last completion's ids (L,), π_then (L,)

    def values(self, indices: Tensor) -> Tensor:
        """v̂ = α / (α + β) of each prompt (B,) as it stands, before the step's visits. (B,) float32"""
        rows = indices.cpu().long()
        return (self.alpha[rows] / (self.alpha[rows] + self.beta[rows])).float()

    def visit(self, policy, *, indices: Tensor, mine: slice, rewards: Tensor, rollout: Rollout,
              old_logp: Tensor | None) -> dict[str, float]:
        """Fold the step's visits in: each prompt's ρ (rho = kl: from the drift D of its stored last
        completion, scored now; constant: rho_value), then α ← ρα + Σr, β ← ρβ + Σ(1 - r), in batch order (a
        prompt drawn twice is folded twice); with rho = kl, the step's first completion of each prompt and its
        π_old are then stored for its next visit. indices (B,) and rewards (B, G) are every rank's; rollout and
        old_logp (N, T) this rank's, its prompts `mine`. Returns the step's diagnostics. Collective with rho = kl."""
        s = self.cfg.single_stream
        rows = indices.cpu().long()                                             # (B,)
        values = self.values(rows)                                              # (B,) v̂ before the visits
        revisit = self.visits[rows] > 0                                         # (B,)
        if self.kl:
            D, scored = self._drifts(policy, rows, mine, rollout)               # (B,) D, (B,) bool
            rho = kl_rho(D, s.d_half, s.rho_min, s.rho_max)                     # (B,)
        else:
            D, scored = torch.zeros(len(rows), dtype=torch.float64), torch.zeros(len(rows), dtype=torch.bool)
            rho = torch.full((len(rows),), s.rho_value, dtype=torch.float64)
        r = rewards.detach().double().cpu()                                     # (B, G)
        earlier = occurrence(rows)
        for k in range(int(earlier.max()) + 1 if len(rows) else 0):            # one pass when all are distinct
            at = earlier == k
            q = rows[at]
            self.alpha[q] = rho[at] * self.alpha[q] + r[at].sum(1)
            self.beta[q] = rho[at] * self.beta[q] + (1 - r[at]).sum(1)
            self.visits[q] += 1
        if self.kl:
            self._store(rows, rollout, old_logp, rewards.shape[1])
        return {"single_stream_value": float(values.mean()), "single_stream_rho": float(rho.mean()),
                "single_stream_revisit_frac": float(revisit.double().mean()),
                "single_stream_drift": float(D[scored].mean()) if scored.any() else math.nan}

    def _drifts(self, policy, rows: Tensor, mine: slice, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """D (B,) float64 of each prompt with a stored completion (0 for the others), and which those are (B,).
        This rank scores the stored completions of its own prompts under `policy` as it is now; the D are summed
        over ranks (each position comes from the one rank holding it). No prompt of the step has one: no
        scoring anywhere (every rank sees the same replicated store). Collective otherwise."""
        scored = torch.tensor([q in self.last for q in rows.tolist()], dtype=torch.bool)   # (B,)
        D = torch.zeros(len(rows), dtype=torch.float64)
        if not scored.any():
            return D, scored
        local = [j for j in range(mine.start, mine.stop) if scored[j]]          # batch positions this rank scores
        # a rank with none still takes part in the collective scoring: one stand-in row, its D unused
        first = rollout.mask[0].bool().cpu()
        stand_in = rollout.completion_ids[0].cpu()[first].int(), torch.zeros(int(first.sum()))
        stored = [self.last[int(rows[j])] for j in local] or [stand_in]
        width = max(1, max(len(ids) for ids, _ in stored))
        ids = torch.zeros(len(stored), width, dtype=torch.long)                 # (n, L)
        mask = torch.zeros(len(stored), width)                                  # (n, L)
        then = torch.zeros(len(stored), width)                                  # (n, L) log π_then
        for i, (tokens, logp) in enumerate(stored):
            ids[i, :len(tokens)], mask[i, :len(tokens)], then[i, :len(tokens)] = tokens.long(), 1.0, logp
        prompts = [self.train_ids[int(rows[j])] for j in local] or [self.train_ids[int(rows[mine.start])]]
        inputs = token_rows(prompts, ids, mask, self.pad_id, self.device)
        now, _ = score_policy(policy, None, inputs, cfg=self.cfg, need_old=True, need_ref=False)   # (n, L)
        mine_D = drift(then, now.cpu(), mask)                                  # (n,)
        D[local] = mine_D[:len(local)]
        return distributed.all_reduce_sum(D), scored

    def _store(self, rows: Tensor, rollout: Rollout, old_logp: Tensor, G: int) -> None:
        """Keep each prompt's first completion of the step and its π_old, gathered from every rank, for its
        next visit (a prompt in the batch twice keeps its later one)."""
        T = self.cfg.rollout.max_new_tokens

        def padded(x: Tensor) -> Tensor:                                        # (B_local, T) of every rank
            x = x[::G].detach().cpu()
            return torch.nn.functional.pad(x, (0, T - x.shape[1]))

        ids = distributed.all_gather_rows(padded(rollout.completion_ids.long()))   # (B, T)
        mask = distributed.all_gather_rows(padded(rollout.mask.float()))           # (B, T)
        logp = distributed.all_gather_rows(padded(old_logp.float()))               # (B, T) log π_old
        for b, q in enumerate(rows.tolist()):
            n = int(mask[b].sum())
            self.last[q] = (ids[b, :n].int().clone(), logp[b, :n].clone())

    def state_dict(self) -> dict[str, Tensor]:
        """α, β, the visits, and the stored completions flattened in row order (copies)."""
        kept = sorted(self.last)
        return {"alpha": self.alpha.clone(), "beta": self.beta.clone(), "visits": self.visits.clone(),
                "rows": torch.tensor(kept, dtype=torch.int64),
                "lengths": torch.tensor([len(self.last[q][0]) for q in kept], dtype=torch.int64),
                "ids": torch.cat([self.last[q][0] for q in kept] or [torch.zeros(0, dtype=torch.int32)]),
                "logp": torch.cat([self.last[q][1] for q in kept] or [torch.zeros(0)])}

    def load_state_dict(self, state: dict) -> None:
        """Adopt a saved state (copies); ValueError when it covers another number of train rows."""
        check_resumed_prompts(len(state["alpha"]), len(self.alpha))
        self.alpha, self.beta, self.visits = (state[k].clone() for k in ("alpha", "beta", "visits"))
        lengths = state["lengths"].tolist()
        ids, logp = state["ids"].split(lengths), state["logp"].split(lengths)
        self.last = {q: (i.clone(), p.clone()) for q, i, p in zip(state["rows"].tolist(), ids, logp)}
