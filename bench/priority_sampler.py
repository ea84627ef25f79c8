"""Cost of PPS bookkeeping per step: sample(B) and update(B) at N prompts (ALGORITHMS.md §3).

    python bench/priority_sampler.py            # prints two tables; CPU timings, median of 200 calls

Table 1: B = 64 and 256 at N = 10^3..10^6 with priorities touched by a few updates. Table 2: the
skewed cases that once made sampling slow (most of the mass on fewer than B prompts): half of N
at the floor priority, and geometric priorities p_q = 0.5^q. It also prints how many raw draws
and rounds a sample took.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.priority_sampler import PrioritySampler  # noqa: E402


def median_ms(fn, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def touched(n: int, batch: int, groups: int = 8) -> PrioritySampler:
    """A sampler whose priorities have been through 20 steps of random |A| (so the tree is not flat)."""
    s = PrioritySampler(n, seed=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx, _ = s.sample(batch)
        s.update(idx, torch.rand(batch, groups, generator=g) * 0.5)
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
            update = median_ms(lambda: s.update(s.sample(batch)[0], adv)) - sample
            p = s.probabilities()
            multinomial = median_ms(lambda: torch.multinomial(p, batch, replacement=False, generator=g), repeats=20)
            print(f"{n:>10} {batch:>4} {sample:>10.3f} {update:>10.3f} {multinomial:>15.3f}")
    print()
    print(f"{'priorities':>10} {'N prompts':>10} {'B':>4} {'sample ms':>10} {'raw draws':>10}")
    for kind, n, batch in (("half", 100, 100), ("half", 10**6, 256), ("geometric", 10**3, 256),
                           ("geometric", 10**6, 256)):
        s = skewed(n, kind)
        sample = median_ms(lambda: s.sample(batch), repeats=50)
        print(f"{kind:>10} {n:>10} {batch:>4} {sample:>10.3f} {s._last['draws']:>10}")


if __name__ == "__main__":
    main()
