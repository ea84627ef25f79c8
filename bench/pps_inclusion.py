"""How far PPS's importance weights are from the ones its batch draw calls for (docs/methods.md §3).

    python bench/pps_inclusion.py RUN/checkpoint-50 [RUN/checkpoint-100 ...]   # two tables
    python bench/pps_inclusion.py RUN/checkpoint-50 --draws 1000000 --code-draws 100000 --seed 0

PPS draws B distinct prompts per step (successive sampling without replacement) but weights each by its
single-draw probability, w = (N·P'(q))^-β; the inclusion probability of that draw is π_q = P(q in the batch),
below B·P'(q) where P'(q) is large and above it where P'(q) is small (Σ_q π_q = B = Σ_q B·P'(q)). For each
checkpoint's sampler state (its run's pps section, from the run's config.yaml), this estimates π_q:

- the fast draw, `--draws` batches (default 10^6): B distinct prompts by an exponential race (arrival
  times E_q / P'(q), E_q ~ Exp(1); the first B to arrive), the same distribution as the sampler's rounds
  of successive sampling; π_q is estimated Rao-Blackwellized: given the other prompts' times, q is in the
  batch iff it arrives before the B-th of them, with probability 1 - exp(-P'(q)·t_B(-q)), averaged over
  the races (unbiased, and precise for rarely drawn prompts too); standard errors from the races' spread;
- the sampler's own code path, `--code-draws` batches (default 10^5): PrioritySampler.sample on the
  restored state, its generator re-seeded with --seed; max |z| compares its inclusion counts with the
  fast draw's π_q over every prompt (about 3 to 4 is chance for N normals; far more means the two
  draws differ).

Table 1, inclusion: N, B, β, the largest B·P'(q) and that prompt's π_q, and over the code path's draws
(each drawn prompt counted as often as it is drawn) the quantiles of π_q / (B·P'(q)).

Table 2, weights, for each is_norm: over the code path's drawn prompts, the relative error of the weight
the code uses against the one the inclusion probability gives, both normalised the same way on the same
batch:
    w_code = (N·P'(q))^-β / norm_b       w_true = (N·π_q / B)^-β / norm_b'      error = w_code / w_true - 1
(norm_b: the batch max, the batch mean, or 1 for none). Quantiles of |error| (50/90/99%), its max, and
the share of drawn prompts with |error| > 10% ± its standard error over batches. `noise` is the largest
β·SE(π_q)/π_q among drawn prompts: the error the estimate of π itself can put in a weight.
The run's own is_norm is checked: its w_code equals the sampler's `weights`.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.priority_sampler import IS_NORMS, PrioritySampler  # noqa: E402
from pspo.sampler import build_sampler  # noqa: E402
from pspo.training.config import load_config  # noqa: E402


def load_snapshot(checkpoint: str) -> tuple[PrioritySampler, int]:
    """The run's PPS sampler (its config.yaml beside the checkpoint folders) with the checkpoint's state,
    and B."""
    cfg = load_config(os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "config.yaml"))
    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=True)["sampler"]
    if not cfg.pps.enabled or cfg.pps.mode != "paper" or "priorities" not in state:
        sys.exit(f"{checkpoint}: not a PPS run (pps.enabled with pps.mode=paper)")
    if cfg.pps.skip:
        sys.exit(f"{checkpoint}: pps.skip is on; the race below draws without skipping")
    n = len(state["priorities"])
    sampler = build_sampler(cfg, [str(i) for i in range(n)], checkpoint)   # the problems' text only counts N
    sampler.load_state_dict(state)
    return sampler, cfg.train.prompts_per_step


def race_batches(probs: torch.Tensor, batch: int, draws: int, generator: torch.Generator,
                 chunk: int = 4096):
    """`draws` batches of `batch` distinct prompts with successive sampling from probs (N,), in chunks:
    yields (indices (C, B), t_B (C,), t_B+1 (C,)), the first B arrivals and the B-th and (B+1)-th times."""
    rate = probs.double()
    while draws > 0:
        rows = min(chunk, draws)
        times = torch.empty(rows, len(rate), dtype=torch.float64).exponential_(generator=generator) / rate
        first, idx = torch.topk(times, min(batch + 1, len(rate)), dim=1, largest=False, sorted=True)
        t_next = first[:, batch] if batch < len(rate) else torch.full((rows,), float("inf"), dtype=torch.float64)
        yield idx[:, :batch], first[:, batch - 1], t_next
        draws -= rows


def inclusion(probs: torch.Tensor, batch: int, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """π_q, Rao-Blackwellized over `draws` races, and its standard error. (N,), (N,)"""
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros(len(probs), dtype=torch.float64)
    total_sq = torch.zeros(len(probs), dtype=torch.float64)
    rate = probs.double()
    for idx, t_b, t_next in race_batches(probs, batch, draws, g):
        # q in the batch: the B-th arrival among the others is the (B+1)-th overall; else the B-th
        t_other = t_b[:, None].expand(-1, len(rate)).clone()                  # (C, N)
        t_other.scatter_(1, idx, t_next[:, None].expand(-1, batch))
        cond = -torch.expm1(-rate[None, :] * t_other)                          # P(q in | the others' times)
        total += cond.sum(0)
        total_sq += (cond ** 2).sum(0)
    mean = total / draws
    se = ((total_sq / draws - mean ** 2).clamp(min=0) / max(1, draws - 1)).sqrt()
    return mean, se


def code_draws(sampler: PrioritySampler, batch: int, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`draws` batches from PrioritySampler.sample itself, generator re-seeded: (M, B) indices, and the
    sampler's own weights (M, B) (under the run's is_norm). The priorities are the same for every draw
    (sample restores its leaves); only the step counter moves, which is put back."""
    sampler.generator.manual_seed(seed)
    steps = sampler.steps
    indices = torch.empty(draws, batch, dtype=torch.int64)
    weights = torch.empty(draws, batch, dtype=torch.float32)
    for m in range(draws):
        sampler.steps = steps                                                  # β as at the snapshot
        indices[m] = sampler.sample(batch)
        weights[m] = sampler.weights
    sampler.steps = steps
    return indices, weights


def agreement(counts: torch.Tensor, pi: torch.Tensor, pi_se: torch.Tensor, draws: int, least: float = 10.0) -> float:
    """max |z| of the code path's inclusion counts (N,) over `draws` batches against π (N,): one cell per
    prompt expected at least `least` times, the rarer prompts pooled into one cell (a single hit of a
    prompt expected 10^-3 times is no evidence of a difference, but its own z would be ~30). A cell's
    variance: draws·Σπ(1-π) (an upper bound for the pooled cell: the draw's inclusions are negatively
    correlated) plus draws²·ΣSE(π)²."""
    expected, var = draws * pi, draws * pi * (1 - pi) + draws ** 2 * pi_se ** 2
    common = expected >= least
    diff, spread = counts[common] - expected[common], var[common]
    if (~common).any():
        rare = ~common
        diff = torch.cat([diff, (counts[rare] - expected[rare]).sum()[None]])
        spread = torch.cat([spread, var[rare].sum()[None]])
    return float((diff / spread.sqrt()).abs().max())


def normalise(raw: torch.Tensor, norm: str) -> torch.Tensor:
    """(M, B) raw weights divided per batch as is_norm says."""
    if norm == "batch_max":
        return raw / raw.amax(1, keepdim=True)
    if norm == "mean":
        return raw / raw.mean(1, keepdim=True)
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint folders of PPS runs (RUN/checkpoint-STEP)")
    parser.add_argument("--draws", type=int, default=200_000, help="batches of the fast draw: π_q, then the errors")
    parser.add_argument("--code-draws", type=int, default=10_000,
                        help="batches of PrioritySampler.sample (the check)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows_inc, rows_w = [], []
    for checkpoint in args.checkpoints:
        sampler, batch = load_snapshot(checkpoint)
        name = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(checkpoint))),
                            os.path.basename(os.path.normpath(checkpoint)))
        n, beta = sampler.num_prompts, sampler.current_beta()
        probs = sampler.probabilities()                                        # (N,) P'(q), the mix included
        pi, pi_se = inclusion(probs, batch, args.draws, args.seed + 1)         # (N,), (N,)
        g = torch.Generator().manual_seed(args.seed + 2)
        idx = torch.cat([i for i, _, _ in race_batches(probs, batch, args.draws, g)])   # (M, B) fresh batches
        code_idx, code_w = code_draws(sampler, batch, args.code_draws, args.seed)     # (M', B)
        z = agreement(torch.bincount(code_idx.flatten(), minlength=n).double(), pi, pi_se, args.code_draws)
        raw = (n * probs[code_idx]) ** (-beta)
        if not torch.allclose(normalise(raw, sampler.is_norm).float(), code_w, rtol=1e-5, atol=0):
            sys.exit(f"{checkpoint}: the weights computed here differ from the sampler's")
        ratio = pi / (batch * probs)                                           # (N,) π / (B·P')
        top = int(torch.argmax(probs))
        rows_inc.append((name, n, batch, beta, float(sampler.seen.double().mean()), float(batch * probs[top]),
                         float(pi[top]), float(pi_se[top]),
                         *np.quantile(ratio[idx].flatten().numpy(), [0.0, 0.01, 0.5, 0.99, 1.0]),
                         z))
        raw_code = (n * probs[idx]) ** (-beta)                                 # (M, B) (N·P')^-β, the code's
        raw_true = (n * pi[idx] / batch) ** (-beta)                            # (M, B) (N·π/B)^-β
        noise = float((beta * pi_se[idx] / pi[idx]).max())
        for norm in IS_NORMS:
            error = (normalise(raw_code, norm) / normalise(raw_true, norm) - 1).abs()   # (M, B)
            over = (error > 0.1).double().mean(1)                                  # per batch
            q50, q90, q99 = np.quantile(error.flatten().numpy(), [0.5, 0.9, 0.99])
            rows_w.append((name, norm, q50, q90, q99, float(error.max()), float(over.mean()),
                           float(over.std() / args.draws ** 0.5), noise))
    print(f"π_q from {args.draws:,} raced batches; {args.code_draws:,} batches of PrioritySampler.sample "
          f"(seed {args.seed})")
    print(f"{'snapshot':<28} {'N':>5} {'B':>4} {'β':>5} {'seen':>5} {'max BP':>7} {'π there':>15} "
          f"{'π/BP min':>8} {'1%':>6} {'50%':>6} {'99%':>6} {'max':>6} {'max|z|':>6}")
    for r in rows_inc:
        print(f"{r[0]:<28} {r[1]:>5} {r[2]:>4} {r[3]:>5.2f} {r[4]:>5.2f} {r[5]:>7.4f} {r[6]:>7.4f}±{r[7]:.1e} "
              f"{r[8]:>8.3f} {r[9]:>6.3f} {r[10]:>6.3f} {r[11]:>6.3f} {r[12]:>6.3f} {r[13]:>6.2f}")
    print()
    print(f"{'snapshot':<28} {'is_norm':>9} {'|err| 50%':>9} {'90%':>7} {'99%':>7} {'max':>7} "
          f"{'share >10%':>16} {'noise':>7}")
    for r in rows_w:
        print(f"{r[0]:<28} {r[1]:>9} {r[2]:>9.4f} {r[3]:>7.4f} {r[4]:>7.4f} {r[5]:>7.4f} "
              f"{r[6]:>8.4f}±{r[7]:.4f} {r[8]:>7.4f}")


if __name__ == "__main__":
    main()
