"""Cost of PPS bookkeeping per step: sample(B) and update(B) at N prompts (ALGORITHMS.md §3).

    python bench/priority_sampler.py            # prints a table; CPU timings, median of 200 calls
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


def main() -> None:
    B, G = 64, 8
    print(f"{'N prompts':>10} {'sample(B=64) ms':>16} {'update(B=64) ms':>16} {'multinomial ms':>15}")
    for n in (10**3, 10**5, 10**6):
        s = PrioritySampler(n, seed=0)
        g = torch.Generator().manual_seed(0)
        for _ in range(20):                          # touch some priorities so the tree is not flat
            idx, _ = s.sample(B)
            s.update(idx, torch.rand(B, G, generator=g) * 0.5)
        sample = median_ms(lambda: s.sample(B))
        adv = torch.rand(B, G, generator=g) * 0.5
        update = median_ms(lambda: s.update(s.sample(B)[0], adv)) - sample
        p = s.probabilities()
        multinomial = median_ms(lambda: torch.multinomial(p, B, replacement=False, generator=g), repeats=20)
        print(f"{n:>10} {sample:>16.3f} {update:>16.3f} {multinomial:>15.3f}")


if __name__ == "__main__":
    main()
