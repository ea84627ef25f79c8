"""The spo section of the config (docs/related.md §B): SPO-chain and SPO-tree keys and their checks.
Kept apart from config.py, which imports it (config.py holds the other sections)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pspo.config_check import check, parse_ints


@dataclass
class SPOConfig:
    """SPO, docs/related.md §B: only with algo.advantage spo_chain (the first two) or spo_tree (the rest)."""
    # chain: K, every K-th token with p_t < 0.9 is a cut ("int5"; §B chain 3)
    cutpoint_interval: int = 5
    # chain: N continuations per cut state, V(c) = their mean reward (9 rho-1.1B, 4 long CoT)
    num_mc: int = 9
    # tree: "b0,b1,b2", children per node at depths 0, 1, 2; b0 = rollout.num_generations
    branching: str = "6,6,6"
    # tree: M, the most new tokens of a depth-0 / depth-1 segment ("M0,M1" apart); depth 2 runs to
    # rollout.max_new_tokens (30 rho GSM8K, 100 MATH, 600 R1-Distill)
    segment_tokens: str = "30"
    # tree: A(n) / (population std of the siblings' V + 1e-8), the reference's "grpo" option
    tree_scale: bool = False
    # tree: an edge is trained within this many steps of its tree's growth, else dropped (§B tree 5)
    replay_iterations: int = 8
    # tree: at most this many of a question's buffered edges drawn (and removed) per step
    edges_per_question: int = 32
    # tree: at most this many drawn edges trained per step, a random subset (0 = all; the reference code: 512)
    edges_per_step: int = 0

    @property
    def branch_factors(self) -> tuple[int, ...]:
        """(b0, b1, b2), once validated."""
        return parse_ints(self.branching)

    @property
    def segments(self) -> tuple[int, int]:
        """(M0, M1): the token budgets of the depth-0 and depth-1 segments, once validated."""
        m = parse_ints(self.segment_tokens) or (0,)
        return (m[0], m[-1])


CHAIN_KEYS = ("cutpoint_interval", "num_mc")     # the rest of SPOConfig is the tree's


def validate_spo(s: SPOConfig, advantage: str, r: Any, pps_enabled: bool) -> None:
    """The spo section (docs/related.md §B) beside algo.advantage, the rollout section `r` and
    pps.enabled: its chain keys only with spo_chain, its tree keys only with spo_tree, the tree's
    shape consistent with the rollout section, and neither PPS nor the IS correction with the tree.
    Raises ConfigError (one line)."""
    default = SPOConfig()
    for f in dataclasses.fields(SPOConfig):
        owner = "spo_chain" if f.name in CHAIN_KEYS else "spo_tree"
        value = getattr(s, f.name)
        check(advantage == owner or value == getattr(default, f.name), f"spo.{f.name}",
              f"{getattr(default, f.name)!r} (unset) unless algo.advantage={owner}", value)
    if advantage == "spo_chain":
        check(s.cutpoint_interval >= 1, "spo.cutpoint_interval", ">= 1", s.cutpoint_interval)
        check(s.num_mc >= 1, "spo.num_mc", ">= 1", s.num_mc)
    if advantage != "spo_tree":
        return
    # Refused: PPS's IS weight belongs to the step its prompt was drawn, but a tree's edges are
    # trained over the next spo.replay_iterations steps, mixed with other steps' prompts.
    check(not pps_enabled, "pps.enabled", "false with algo.advantage=spo_tree (its edges are replayed in "
          "later steps, where the drawing step's IS weights do not apply)", pps_enabled)
    check(r.is_correction == "none", "rollout.is_correction", "none with algo.advantage=spo_tree (its "
          "replayed tree edges keep no engine log-probs)", r.is_correction)
    b, m = s.branch_factors, parse_ints(s.segment_tokens)
    check(len(b) == 3 and min(b) >= 1, "spo.branching", "three positive integers b0,b1,b2 (e.g. 6,6,6)",
          s.branching)
    check(r.num_generations == b[0], "rollout.num_generations", f"spo.branching's b0 = {b[0]} with "
          "algo.advantage=spo_tree (the root's children are the prompt's G completions)", r.num_generations)
    check(len(m) in (1, 2) and min(m) >= 1, "spo.segment_tokens", "one positive integer M, or two M0,M1",
          s.segment_tokens)
    check(sum(s.segments) < r.max_new_tokens, "spo.segment_tokens", f"M0 + M1 < rollout.max_new_tokens = "
          f"{r.max_new_tokens} (depth 2 continues to max_new_tokens)", s.segment_tokens)
    check(s.replay_iterations >= 1, "spo.replay_iterations", ">= 1 (1 = no replay)", s.replay_iterations)
    check(s.edges_per_question >= 1, "spo.edges_per_question", ">= 1", s.edges_per_question)
    check(s.edges_per_step >= 0, "spo.edges_per_step", ">= 0 (0 = every drawn edge)", s.edges_per_step)
