"""SPO segment credit (pspo/related/spo_segments.py): docs/related.md §B's hand-worked chain and tree cases,
then independent loop-style references (written like SPO's released code) on random inputs."""
import math
import random
from fractions import Fraction

import pytest
import torch

from pspo.related.spo_segments import (add_children, chain_advantages, mc_values, probability_mask,
                                       segment_advantages, select_cuts, tree_advantages, tree_edges,
                                       tree_values, unique_prefixes)

P = torch.tensor([[.95, .5, .99, .3, .97, .8, .99]])       # §B's chain: candidates t = 1, 3, 5
ONES = torch.ones(1, 7)
a, b, c, R = 0.2, 0.6, 0.3, 1.0                            # V(0), V(2), V(4), the trajectory's reward


def V(cuts):
    return torch.tensor([{-1: 0.9, 0: a, 1: 0.25, 2: b, 4: c}[x] for x in cuts.tolist()])


# ---- SPO-chain: §B's hand-worked cases ----

def test_cuts_k1_hand_worked():
    # J = {1, 3, 5} (p < .9) -> cut states c = t - 1 = {0, 2, 4}; tokens 1-2 share A = b - a, 3-4 c - b,
    # 5-6 R - c; token 0 (before the first cut, no V(prompt)) gets 0; p >= .9 tokens (0, 2, 4, 6)
    # are masked: A = [0, b-a, 0, c-b, 0, R-c, 0] = [0, .4, 0, -.3, 0, .7, 0]
    rows, cuts = select_cuts(P, ONES, interval=1)
    assert rows.tolist() == [0, 0, 0] and cuts.tolist() == [0, 2, 4]
    assert probability_mask(P, ONES).tolist() == [[0, 1, 0, 1, 0, 1, 0]]
    adv = segment_advantages(rows, cuts, V(cuts), rewards=torch.tensor([R]), probs=P, mask=ONES)
    torch.testing.assert_close(adv, torch.tensor([[0, .4, 0, -.3, 0, .7, 0]]), atol=1e-6, rtol=0)


def test_cuts_k2_hand_worked():
    # K = 2 keeps J[::2] = {1, 5} -> cuts {0, 4}: tokens 1-4 share c - a = .1 (1 and 3 unmasked), 5-6 R - c
    rows, cuts = select_cuts(P, ONES, interval=2)
    assert cuts.tolist() == [0, 4]
    adv = segment_advantages(rows, cuts, V(cuts), rewards=torch.tensor([R]), probs=P, mask=ONES)
    torch.testing.assert_close(adv, torch.tensor([[0, .1, 0, .1, 0, .7, 0]]), atol=1e-6, rtol=0)
    assert select_cuts(P, ONES, interval=3)[1].tolist() == [0]            # J[::3] = {1}: one cut, A_t = R - a after it


def test_first_token_candidate_gives_a_prompt_baseline():
    # p = [.5, .95, .3, .99]: J = {0, 2} -> cuts {-1, 1}; V(prompt) = .9, V(1) = .25, R = 0:
    # tokens 0-1 get V(1) - V(prompt) = -.65 (token 1 masked), tokens 2-3 get R - V(1) = -.25 (3 masked)
    p, m = torch.tensor([[.5, .95, .3, .99]]), torch.ones(1, 4)
    rows, cuts = select_cuts(p, m, 1)
    assert cuts.tolist() == [-1, 1]
    adv = segment_advantages(rows, cuts, V(cuts), rewards=torch.tensor([0.0]), probs=p, mask=m)
    torch.testing.assert_close(adv, torch.tensor([[-.65, 0, -.25, 0]]), atol=1e-6, rtol=0)
    # the same completion with p_0 = .95: J = {2}, cut {1}, no V(prompt): token 0 gets 0 (and is masked)
    p0 = torch.tensor([[.95, .95, .3, .99]])
    assert select_cuts(p0, m, 1)[1].tolist() == [1]


def test_no_candidates_no_cuts_zero_advantage_and_padding_ignored():
    # all p >= .9: no cut, every A = 0; padding (mask 0) is never a candidate even with p < .9
    p, m = torch.tensor([[.95, .99, .9], [.5, .2, .1]]), torch.tensor([[1., 1, 1], [1, 0, 0]])
    rows, cuts = select_cuts(p, m, 1)
    assert rows.tolist() == [1] and cuts.tolist() == [-1]                 # row 1: only its valid token 0
    adv = segment_advantages(rows, cuts, torch.tensor([.5]), rewards=torch.tensor([1.0, 0.0]), probs=p, mask=m)
    torch.testing.assert_close(adv, torch.tensor([[0., 0, 0], [-.5, 0, 0]]), atol=1e-6, rtol=0)   # 0 - .5
    with pytest.raises(ValueError, match="spo.cutpoint_interval"):
        select_cuts(p, m, 0)


def test_whitening_over_the_probability_mask_only():
    # K = 1 case: masked A = [.4, -.3, .7], mean .26667, Bessel var (.01778 + .32111 + .18778)/2 = .26333,
    # std .51316 -> [.25983, -1.10427, .84444]; the four p >= .9 tokens stay 0 and do not enter the stats
    rows, cuts = select_cuts(P, ONES, 1)
    adv, M = chain_advantages(rows, cuts, V(cuts), rewards=torch.tensor([R]), probs=P, mask=ONES,
                              reduce_sum=lambda x: x)
    torch.testing.assert_close(adv, torch.tensor([[0, .25983, 0, -1.10427, 0, .84444, 0]]), atol=1e-4, rtol=0)
    assert torch.equal(M, probability_mask(P, ONES))


def test_unique_prefixes_and_mc_values():
    # rows 0 and 1 share prompt [1, 2] and the prefix [5, 6] at c = 1, and the empty prefix at c = -1;
    # row 2 has the same prefix under another prompt: 3 distinct states out of 5 cuts
    prompts = [[1, 2], [1, 2], [3]]
    completions = torch.tensor([[5, 6, 7], [5, 6, 8], [5, 6, 7]])
    rows, cuts = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([-1, 1, -1, 1, 1])
    owners, u_prefixes, inverse = unique_prefixes(prompts, completions, rows, cuts)
    assert owners.tolist() == [0, 0, 2] and u_prefixes == [[], [5, 6], [5, 6]]
    assert inverse.tolist() == [0, 1, 0, 1, 2]
    # 2 continuations per state: rewards [1, 0 | 1, 1 | 0, 0] -> V = [.5, 1, 0] -> per cut [.5, 1, .5, 1, 0]
    values = mc_values(torch.tensor([1., 0, 1, 1, 0, 0]), 2, inverse)
    assert values.tolist() == [.5, 1, .5, 1, 0]


def reference_chain(p: list[float], length: int, K: int, value_of, R: float) -> list[float]:
    """SPO's math_episode_generator_with_mc_advantages: np.where(p < .9) - 1, [::K], then
    _compute_token_advantages (token_values, backward fill, p > .9 zeroed), padded to len(p)."""
    cutpoints = [t - 1 for t in range(length) if p[t] < 0.9][::K]
    values = [value_of(c) for c in cutpoints]
    out = [0.0] * len(p)
    if not cutpoints:
        return out
    token_values = [None] * length
    token_values[-1] = R
    base = None
    if cutpoints[0] == -1:
        base, cutpoints, values = values[0], cutpoints[1:], values[1:]
    for idx, value in zip(cutpoints, values):
        token_values[idx] = value
    adv = [None] * length
    for i in range(length):
        if token_values[i] is not None:
            adv[i] = 0 if base is None else token_values[i] - base
            base = token_values[i]
    for i in range(length - 1, -1, -1):
        if adv[i] is None:
            adv[i] = adv[i + 1]
    for i in range(length):
        out[i] = 0.0 if not p[i] < 0.9 else adv[i]
    return out


@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_chain_against_a_loop_reference_on_random_rows(K):
    gen = torch.Generator().manual_seed(K)
    N, T = 12, 30
    # probabilities mostly near 1 with some low ones, as a confident policy gives
    probs = torch.where(torch.rand(N, T, generator=gen) < 0.3, torch.rand(N, T, generator=gen), 0.9 + 0.1 * torch.rand(N, T, generator=gen))
    lengths = torch.randint(0, T + 1, (N,), generator=gen)
    mask = (torch.arange(T) < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (N,), generator=gen).float()
    table = torch.rand(N, T + 1, generator=gen)                           # V(c) of row i at cut c: table[i, c+1]
    rows, cuts = select_cuts(probs, mask, K)
    adv = segment_advantages(rows, cuts, table[rows, cuts + 1], rewards=rewards, probs=probs, mask=mask)
    for i in range(N):
        ref = reference_chain(probs[i].tolist(), int(lengths[i]), K, lambda c: float(table[i, c + 1]), float(rewards[i]))
        torch.testing.assert_close(adv[i], torch.tensor(ref), atol=1e-6, rtol=0)
    assert adv.abs().sum() > 0                                            # the case is not vacuous


# ---- SPO-tree ----

def figure_tree():
    # §B: root -> (x, y, z) with leaves x: (1, 0, 1), y: (1, 1, 1), z: (0, 0, 0)
    parent = add_children(torch.tensor([-1]), torch.tensor([0]), 3)       # nodes 1-3 under the root
    parent = add_children(parent, torch.tensor([1, 2, 3]), 3)             # 4-6 under 1, 7-9 under 2, 10-12 under 3
    rewards = torch.tensor([float("nan")] * 4 + [1, 0, 1, 1, 1, 1, 0, 0, 0])
    return parent, rewards


def test_tree_hand_worked():
    # V(x, y, z) = (2/3, 1, 0), V(root) = 5/9; A(x, y, z) = (1/9, 4/9, -5/9); leaves under x get
    # (1/3, -2/3, 1/3); y's and z's leaves equal their parent's V: A = 0, dropped
    parent, rewards = figure_tree()
    assert parent.tolist() == [-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    values = tree_values(parent, rewards)
    torch.testing.assert_close(values[:4], torch.tensor([5 / 9, 2 / 3, 1, 0], dtype=torch.float64))
    adv = tree_advantages(parent, values)
    expected = [0, 1 / 9, 4 / 9, -5 / 9, 1 / 3, -2 / 3, 1 / 3] + [0] * 6
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    assert tree_edges(parent, adv).tolist() == [1, 2, 3, 4, 5, 6]


def test_tree_sibling_std_option():
    # root's children V (2/3, 1, 0): population std = sqrt((1/81 + 16/81 + 25/81)/3) = sqrt(14)/9 = .41574
    # -> (1/9, 4/9, -5/9)/.41574 = (.26726, 1.06904, -1.33631); x's leaves (1, 0, 1): std sqrt(2/9) = .47140
    # -> (1/3, -2/3, 1/3)/.47140 = (.70711, -1.41421, .70711); y's and z's leaves: 0/(0 + 1e-8) = 0
    parent, rewards = figure_tree()
    adv = tree_advantages(parent, tree_values(parent, rewards), scale=True)
    expected = [0, .26726, 1.06904, -1.33631, .70711, -1.41421, .70711] + [0] * 6
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)


def test_depth3_tree_with_an_early_leaf_takes_the_nested_mean():
    # root -> u (stopped early: a leaf, reward 1), w; w -> w1 (leaf 0), w2; w2 -> (1, 0).
    # V(w2) = .5, V(w) = (0 + .5)/2 = .25, V(root) = (1 + .25)/2 = .625 (the leaves' plain mean would be .5)
    # A: u .375, w -.375, w1 -.25, w2 .25, w2's leaves +-.5
    parent = torch.tensor([-1, 0, 0, 2, 2, 4, 4])                         # root, u, w, w1, w2, leaf, leaf
    rewards = torch.tensor([float("nan"), 1, float("nan"), 0, float("nan"), 1, 0])
    values = tree_values(parent, rewards)
    torch.testing.assert_close(values, torch.tensor([.625, 1, .25, 0, .5, 1, 0], dtype=torch.float64))
    adv = tree_advantages(parent, values)
    torch.testing.assert_close(adv, torch.tensor([0, .375, -.375, -.25, .25, .5, -.5], dtype=torch.float64))


def test_equal_non_dyadic_siblings_give_exact_zero_edges():
    # six leaves of .7: their float mean is not exactly .7, yet A must be 0 and the edges dropped
    parent = add_children(torch.tensor([-1]), torch.tensor([0]), 6)
    rewards = torch.tensor([float("nan")] + [0.7] * 6, dtype=torch.float64)
    adv = tree_advantages(parent, tree_values(parent, rewards))
    assert tree_edges(parent, adv).numel() == 0


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parent"):
        tree_values(torch.tensor([-1, 2, 0]), torch.zeros(3))             # a parent after its child
    with pytest.raises(ValueError, match="leaf"):
        tree_values(torch.tensor([-1, 0]), torch.tensor([1.0, float("nan")]))


def random_tree(rng: random.Random, depth: int = 0) -> dict:
    """Nested dicts: depths 0 and 1 branch 1-4 ways, a depth-1/2 node may stop early (a leaf);
    depth 3 is always a leaf. Rewards include non-dyadic ones (.7) to exercise float rounding."""
    if depth == 3 or (depth > 0 and rng.random() < 0.3):
        return {"reward": Fraction(rng.choice(["0", "1", "7/10", "-1/2"]))}
    return {"children": [random_tree(rng, depth + 1) for _ in range(rng.randint(1, 4))]}


def reference_tree(root: dict) -> None:
    """SPO's compute_score / extract_edges_from_tree, recursive, in exact fractions."""
    if "children" in root:
        for ch in root["children"]:
            reference_tree(ch)
        vals = [ch["value"] for ch in root["children"]]
        root["value"] = sum(vals) / len(vals)
        root["std"] = math.sqrt(sum((v - root["value"]) ** 2 for v in vals) / len(vals))   # np.std
        for ch in root["children"]:
            ch["adv"] = ch["value"] - root["value"]
            ch["scaled"] = float(ch["adv"]) / (root["std"] + 1e-8)
    else:
        root["value"] = root["reward"]


def flatten(root: dict) -> list[tuple[int, dict]]:
    """Pre-order (parent index, node): parents come before their children."""
    out = []

    def visit(node, parent):
        out.append((parent, node))
        me = len(out) - 1
        for ch in node.get("children", []):
            visit(ch, me)
    visit(root, -1)
    return out


def test_tree_against_a_recursive_reference_on_random_forests():
    rng = random.Random(0)
    trees = [random_tree(rng) for _ in range(40)]
    flat = []
    for tree in trees:                                                    # a forest: 40 roots in one array
        reference_tree(tree)
        offset = len(flat)
        flat += [(p + offset if p >= 0 else -1, node) for p, node in flatten(tree)]
    parent = torch.tensor([p for p, _ in flat])
    rewards = torch.tensor([float(n.get("reward", "nan")) for _, n in flat], dtype=torch.float64)
    values = tree_values(parent, rewards)
    torch.testing.assert_close(values, torch.tensor([float(n["value"]) for _, n in flat], dtype=torch.float64))
    adv = tree_advantages(parent, values)
    torch.testing.assert_close(adv, torch.tensor([float(n.get("adv", 0)) for _, n in flat], dtype=torch.float64))
    scaled = tree_advantages(parent, values, scale=True)
    torch.testing.assert_close(scaled, torch.tensor([n.get("scaled", 0.0) for _, n in flat], dtype=torch.float64))
    kept = [i for i, (p, n) in enumerate(flat) if p >= 0 and n["adv"] != 0]   # exact: no rounding
    assert tree_edges(parent, adv).tolist() == kept
    assert 0 < len(kept) < len(flat) - len(trees)                         # some edges kept, some dropped
