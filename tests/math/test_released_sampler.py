"""pps.mode=released (docs/methods.md §3a): the released code's PERRepeatSampler, epoch-frozen draws
with replacement, last-sample priorities and unnormalised per-completion weights."""
import pytest
import torch

from pspo.released_sampler import ReleasedSampler


class RefSumTree:
    """An independent re-implementation of the released code's SumTree (ergrpo_trainer.py): a heap
    of 2·capacity - 1 nodes, leaves at [capacity-1, 2·capacity-1), a leaf write propagates its change
    up to the root. Plain Python floats (float64; the released code keeps a float32 tensor)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.nodes = [0.0] * (2 * capacity - 1)

    def write(self, leaf, value):
        node = leaf + self.capacity - 1
        change = value - self.nodes[node]
        self.nodes[node] = value
        while node != 0:
            node = (node - 1) // 2
            self.nodes[node] += change

    def leaf(self, leaf):
        return self.nodes[leaf + self.capacity - 1]

    def total(self):
        return self.nodes[0]


class RefPER:
    """The released PERRepeatSampler's priority/weight bookkeeping: every row starts at 1**α; a
    problem maps to its first row; each completion in turn writes (|A| + 1e-6)**α to that row, then
    reads its loss weight (1 / (N·p/(total + 1e-8) + 1e-8))**β."""

    def __init__(self, problems, alpha, beta):
        self.alpha, self.beta, self.n = alpha, beta, len(problems)
        self.tree = RefSumTree(self.n)
        self.first = {}
        for i, problem in enumerate(problems):
            self.tree.write(i, 1.0 ** alpha)
            self.first.setdefault(problem, i)

    def step(self, problems, abs_adv):
        """problems: the B·G completions' problems (prompt-major); abs_adv the same length."""
        weights = []
        for problem, a in zip(problems, abs_adv):
            row = self.first[problem]
            self.tree.write(row, (a + 1e-6) ** self.alpha)
            prob = self.tree.leaf(row) / (self.tree.total() + 1e-8)
            weights.append((1 / (self.n * prob + 1e-8)) ** self.beta)
        return weights


def test_weights_and_priorities_hand_worked():
    # N=2, G=2, α=1, β=.5, both rows at 1 (Σ = 2). Batch [0, 1], |A| = [[1, 3], [0, 1]], written
    # completion by completion, each weight (N·p/Σ + 1e-8)^-.5 read right after its own write:
    #   row 0 <- 1 + 1e-6:  Σ = 2.000001, P = .5000002,   w = (1.0000005)^-.5          = .99999975
    #   row 0 <- 3 + 1e-6:  Σ = 4.000001, P = .75,        w = 1.5^-.5                  = .81650
    #   row 1 <- 1e-6:      Σ = 3.000002, P = 3.33333e-7, w = (6.66666e-7 + 1e-8)^-.5  = 1215.66  (not normalised)
    #   row 1 <- 1 + 1e-6:  Σ = 4.000002, P = .25,        w = .5^-.5                   = 1.41421
    # priorities after: [3, 1] (+1e-6): the last completion's value stays (row 0's 1 was overwritten)
    s = ReleasedSampler(2, alpha=1.0, beta=0.5)
    assert s.priorities().tolist() == [1.0, 1.0]
    w = s.set_priorities(torch.tensor([0, 1]), torch.tensor([[1.0, 3.0], [0.0, 1.0]]))
    assert w.shape == (2, 2) and w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([[.99999975, .8164965], [1215.6617, 1.4142132]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(s.priorities(), torch.tensor([3.000001, 1.000001], dtype=torch.float64))
    torch.testing.assert_close(s.probabilities(), torch.tensor([.75, .25], dtype=torch.float64), rtol=1e-6, atol=0)
    # α = .6 shapes the written value: (0 + 1e-6)^.6 = 2.5119e-4
    t = ReleasedSampler(2, alpha=0.6, beta=0.4)
    t.set_priorities(torch.tensor([1]), torch.zeros(1, 3))
    assert t.priorities()[1].item() == pytest.approx(1e-6 ** 0.6, rel=1e-12)
    # from the scores: rewards [1, 0] give the raw GRPO |A| = .5 / (.70711 + 1e-4) = .70700 per completion,
    # so the last write is (.70700 + 1e-6)^.6 = .81218 (adv_eps .5: |A| = .5 / 1.20711 = .41421, .58930);
    # Dr. GRPO's |A| = .5 gives .5^.6 = .65975
    for scale, adv_eps, expected in ((True, 1e-4, 0.81218), (True, 0.5, 0.58930), (False, 0.5, 0.65975)):
        r = ReleasedSampler(2, alpha=0.6, beta=0.4, scale_rewards=scale, adv_eps=adv_eps)
        r.observe(torch.tensor([0]), torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]))
        assert r.priorities()[0].item() == pytest.approx(expected, rel=1e-4)


def test_update_matches_an_independent_reimplementation_of_the_released_code():
    # N = 20 rows, where row 13 repeats row 4's problem (one shared priority, the first row's).
    # Three steps of B = 6, G = 4 with random |A| (a quarter exact zeros, like zero-variance
    # groups) and a duplicated row in each batch; α, β the defaults .6, .4.
    N, B, G = 20, 6, 4
    problems = [f"problem {i}" for i in range(N)]
    problems[13] = problems[4]
    leaf_of = torch.tensor([problems.index(p) for p in problems])
    ours = ReleasedSampler(N, leaf_of=leaf_of)
    ref = RefPER(problems, alpha=0.6, beta=0.4)
    g = torch.Generator().manual_seed(0)
    batches = [[3, 7, 3, 13, 0, 19], [4, 13, 11, 11, 2, 5], [8, 8, 8, 1, 4, 6]]
    for batch in batches:
        adv = torch.rand(B, G, generator=g, dtype=torch.float64) * 2
        adv[torch.rand(B, G, generator=g) < 0.25] = 0.0
        adv[2] = 0.0                                                        # one all-zero group too
        w = ours.set_priorities(torch.tensor(batch), adv)
        expected = ref.step([problems[i] for i in batch for _ in range(G)], adv.reshape(-1).tolist())
        assert w.shape == (B, G)
        torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32).view(B, G), rtol=2e-6, atol=0)
        leaves = torch.tensor([ref.tree.leaf(i) for i in range(N)], dtype=torch.float64)
        torch.testing.assert_close(ours.priorities(), leaves, rtol=1e-12, atol=0)
        assert ours.priorities().sum().item() == pytest.approx(ref.tree.total(), rel=1e-12)
    # the shared priority: row 13 was never written (it stays 1), row 4 holds the group's last |A|
    assert ours.priorities()[13].item() == 1.0 and ours.priorities()[4].item() != 1.0
    assert (w > 0).all() and w.max() > 1                                     # not normalised: zeros weigh most


def test_epochs_draw_n_rows_serve_b_and_drop_the_tail():
    # N=5, B=2: an epoch draws 5 rows with replacement and serves rows [0:2], [2:4]; the 5th is
    # dropped and the third step starts a new epoch.
    s = ReleasedSampler(5, seed=0)
    i1 = s.sample(2)
    order = s.order.clone()
    assert len(order) == 5 and torch.equal(i1, order[:2])
    assert s.batch_stats()["epoch"] == 0
    i2 = s.sample(2)
    assert torch.equal(i2, order[2:4]) and torch.equal(s.order, order) and s.batch_stats()["epoch"] == 0
    i3 = s.sample(2)
    assert s.batch_stats()["epoch"] == 1 and s.position == 2 and len(s.order) == 5
    assert torch.equal(i3, s.order[:2])
    # the epoch's draws are the released code's multinomial over the priorities (all 1 here: uniform)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(order, torch.multinomial(torch.ones(5, dtype=torch.float64), 5, replacement=True, generator=g))
    with pytest.raises(ValueError, match="6 prompts per step asked of 5"):
        s.sample(6)


def test_priority_updates_change_only_the_next_epoch():
    # Two samplers with the same seed; after step 1, `a` puts almost all the mass on row 4
    # (|A| = 1 there, 0 elsewhere: α=1 -> 1 against 1e-6). Step 2 still serves the frozen epoch, the
    # same rows as `b`'s; step 3 starts a new epoch from the new priorities: row 4 only
    # (P(all 5 draws = 4) = (1/(1 + 4e-6))^5 > .9999).
    a, b = ReleasedSampler(5, alpha=1.0, seed=0), ReleasedSampler(5, alpha=1.0, seed=0)
    assert torch.equal(a.sample(2), b.sample(2))
    a.set_priorities(torch.arange(5), torch.tensor([[0.0, 0.0]] * 4 + [[1.0, 1.0]]))
    a2, b2 = a.sample(2), b.sample(2)
    assert torch.equal(a2, b2) and b2.tolist() != [4, 4]          # the frozen order, not the new priorities
    a3, b3 = a.sample(2), b.sample(2)
    assert a3.tolist() == [4, 4] and a.order.tolist() == [4] * 5
    assert b.order.tolist() != [4] * 5


def test_epoch_draws_follow_the_priorities_with_replacement_chi_square():
    # α=1, priorities 1, 2, 3, 4 (|A| = k - 1e-6), B = N = 4: every sample is a fresh epoch of 4
    # draws with replacement, P = k/10. 5,000 epochs = 20,000 draws; chi-square 3 dof < 16.27.
    # With replacement, a batch holds a repeated row with probability 1 - 4!·Πp = 1 - 24·.0024 = .9424.
    s = ReleasedSampler(4, alpha=1.0, seed=0)
    s.set_priorities(torch.arange(4), torch.tensor([[1.0], [2.0], [3.0], [4.0]]) - 1e-6)
    torch.testing.assert_close(s.probabilities(), torch.tensor([.1, .2, .3, .4], dtype=torch.float64))
    n = 5_000
    counts, repeats = torch.zeros(4), 0
    for _ in range(n):
        idx = s.sample(4)
        counts += torch.bincount(idx, minlength=4)
        repeats += s.batch_stats()["repeat_frac"] > 0
    expected = torch.tensor([.1, .2, .3, .4]) * 4 * n
    assert ((counts - expected) ** 2 / expected).sum().item() < 16.27, counts
    assert abs(repeats / n - 0.9424) < 4 * (0.9424 * 0.0576 / n) ** 0.5
    assert s.batch_stats()["epoch"] == n - 1


def test_batch_stats_repeat_fraction_hand_worked():
    # an epoch whose draws are [2, 2, 0, 2] (N = B = 4): 2 distinct of 4 -> repeat_frac 1 - 2/4 = .5
    s = ReleasedSampler(4)
    s.order, s.position = torch.tensor([2, 2, 0, 2]), 0
    assert s.sample(4).tolist() == [2, 2, 0, 2]
    assert s.batch_stats() == {"epoch": 0.0, "repeat_frac": 0.5}


def test_state_round_trip_mid_epoch(tmp_path):
    # Saved mid-epoch (N=5, B=2: after step 1, position 2): a sampler built with another seed and
    # loaded serves the same rest of the epoch, the same next epochs (RNG), the same weights.
    s = ReleasedSampler(5, seed=3)
    i = s.sample(2)
    s.set_priorities(i, torch.tensor([[0.5, 0.0], [1.5, 2.0]]))
    torch.save(s.state_dict(), tmp_path / "ref.pt")
    t = ReleasedSampler(5, seed=99)
    t.load_state_dict(torch.load(tmp_path / "ref.pt", weights_only=True))
    assert t.position == 2 and t.epoch == 0 and torch.equal(t.order, s.order)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):                                                     # crosses two epoch boundaries
        i1, i2 = s.sample(2), t.sample(2)
        assert torch.equal(i1, i2) and s.batch_stats() == t.batch_stats()
        adv = torch.rand(2, 2, generator=g)
        assert torch.equal(s.set_priorities(i1, adv), t.set_priorities(i2, adv))
        assert torch.equal(s.priorities(), t.priorities())
    assert s.epoch == 2
    # the last draw's statistics are the state's too (one step off, it is logged after the resume)
    torch.save(s.state_dict(), tmp_path / "ref.pt")
    t.load_state_dict(torch.load(tmp_path / "ref.pt", weights_only=True))
    assert t.batch_stats() == s.batch_stats()
