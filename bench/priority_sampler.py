"""Cost of PPS bookkeeping per step: sample(B) and the priority update of observe(B) at N prompts
(docs/methods.md §3).

    python bench/priority_sampler.py            # prints four tables; CPU timings, median of 200 calls

Table 1: B = 64 and 256 at N = 10^3..10^6 with priorities touched by a few updates. Table 2: the
skewed cases that once made sampling slow (most of the mass on fewer than B prompts): half of N
at the floor priority, and geometric priorities p_q = 0.5^q. It also prints how many raw draws
and rounds a sample took. Table 3: the §3b options and §3a's released mode at N = 10^6, B = 256:
sample + update per step (the released mode's per-epoch draw of N rows is amortised over the
N/B steps of an epoch and shown apart). Table 4: set_priorities' count of a batch's repeated prompts
(draws with replacement) at B up to 65,536, against the (B, B) comparison it replaced.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.priority_sampler import PrioritySampler, occurrence  # noqa: E402
from pspo.released_sampler import ReleasedSampler  # noqa: E402


def median_ms(fn, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def touched(n: int, batch: int, groups: int = 8, **options) -> PrioritySampler:
    """A sampler whose priorities have been through 20 steps of random |A| (so the tree is not flat)."""
    s = PrioritySampler(n, seed=0, **options)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx = s.sample(batch)
        s.set_priorities(idx, torch.rand(batch, groups, generator=g) * 0.5,
                         torch.rand(batch, groups, generator=g).round())
    return s


def skewed(n: int, kind: str) -> PrioritySampler:
    """half: the first n/2 prompts at the floor (1e-6)^0.6, the rest at 1; geometric: p_q = 0.5^q."""
    s = PrioritySampler(n, alpha=1.0, eps=0.0, seed=0)
    if kind == "half":
        values = torch.where(torch.arange(n) < n // 2, torch.tensor(1e-6 ** 0.6, dtype=torch.float64), 1.0)
    else:
        values = 0.5 ** torch.arange(n, dtype=torch.float64)
    s.seen[:] = True
    s._set(torch.arange(n), values)
    return s


def main() -> None:
    G = 8
    print(f"{'N prompts':>10} {'B':>4} {'sample ms':>10} {'update ms':>10} {'multinomial ms':>15}")
    for n in (10**3, 10**5, 10**6):
        for batch in (64, 256):
            s = touched(n, batch)
            g = torch.Generator().manual_seed(1)
            sample = median_ms(lambda: s.sample(batch))
            adv = torch.rand(batch, G, generator=g) * 0.5
            update = median_ms(lambda: s.set_priorities(s.sample(batch), adv)) - sample
            p = s.probabilities()
            multinomial = median_ms(lambda: torch.multinomial(p, batch, replacement=False, generator=g), repeats=20)
            print(f"{n:>10} {batch:>4} {sample:>10.3f} {update:>10.3f} {multinomial:>15.3f}")
    print()
    print(f"{'priorities':>10} {'N prompts':>10} {'B':>4} {'sample ms':>10} {'raw draws':>10}")
    for kind, n, batch in (("half", 100, 100), ("half", 10**6, 256), ("geometric", 10**3, 256),
                           ("geometric", 10**6, 256)):
        s = skewed(n, kind)
        sample = median_ms(lambda: s.sample(batch), repeats=50)
        print(f"{kind:>10} {n:>10} {batch:>4} {sample:>10.3f} {s.last_sample['draws']:>10}")
    print()
    n, batch = 10**6, 256
    g = torch.Generator().manual_seed(2)
    adv, acc = torch.rand(batch, G, generator=g) * 0.5, torch.rand(batch, G, generator=g).round()
    print(f"{'option (N = 10^6, B = 256)':>42} {'sample + update ms':>19}")
    for name, options in (("paper (mean_abs, batch_max)", {}), ("uniform_mix 0.2", {"uniform_mix": 0.2}),
                          ("priority learnability", {"priority": "learnability", "posterior_decay": 0.9}),
                          ("priority thompson (O(N) per step)", {"priority": "thompson", "posterior_decay": 0.9}),
                          ("learnability, prior_reversion 0.01 (O(N))",
                           {"priority": "learnability", "prior_reversion": 0.01}),
                          ("skip, half the prompts at streak 3", {"skip": True})):
        s = touched(n, batch, **options)
        if "skip" in options:
            s.zero_streak[: n // 2] = 3
        step = median_ms(lambda: s.set_priorities(s.sample(batch), adv, acc))
        print(f"{name:>42} {step:>19.3f}")
    r = ReleasedSampler(n, seed=0)
    step = median_ms(lambda: r.set_priorities(r.sample(batch), adv), repeats=200)
    epoch = median_ms(lambda: ReleasedSampler(n, seed=0).sample(batch), repeats=5)
    print(f"{'released (pps.mode), per step':>42} {step:>19.3f}")
    print(f"{'released: one epoch draw of N rows':>42} {epoch:>19.3f}")
    print()
    # Table 4: a batch drawn with replacement counts each row's earlier rows of the same prompt (occurrence):
    # sorted runs, O(B log B) time and O(B) memory, against the (B, B) comparison it replaced
    print(f"{'B (with replacement)':>20} {'occurrence ms':>14} {'(B, B) comparison ms':>21} {'its matrix GiB':>15}")
    for batch in (1024, 16_384, 65_536):
        indices = torch.randint(0, batch // 2, (batch,), generator=torch.Generator().manual_seed(3))
        fast = median_ms(lambda: occurrence(indices), repeats=20)
        matrix_gib = batch * batch * 8 / 2**30          # the int64 cumulative count of a (B, B) equality matrix
        if batch <= 16_384:
            square = median_ms(lambda: (indices[:, None] == indices[None, :]).tril(-1).sum(1), repeats=3)
            shown = f"{square:.1f}"
        else:
            shown = "not run"
        print(f"{batch:>20} {fast:>14.1f} {shown:>21} {matrix_gib:>15.1f}")


if __name__ == "__main__":
    main()
