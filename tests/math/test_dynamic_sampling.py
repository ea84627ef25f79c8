"""DAPO's dynamic sampling (pspo/dynamic_sampling.py, docs/methods.md §9) with a stub round in place of
generation: which groups a step trains on, from which rounds, on which rank, with what counts, and that
the sampler observes every scored group. Hand-worked: each prompt's G = 2 rewards come from a table,
[0.5, 0.5] (all equal) for the prompts in FLAT, [i + 1, 0] for the others."""
import pytest
import torch

from pspo.dynamic_sampling import Draw, dynamic_sampling, keep
from pspo.engines.sampling import prompt_keys
from pspo.estimators import zero_variance
from pspo.priority_sampler import PrioritySampler
from pspo.rewards import RewardResult
from pspo.training.tokens import Rollout

G, PAD = 2, -7


class InOrder:
    """A sampler that draws 0, 1, 2, ... and weights prompt i by i/100; it records what it observed."""

    def __init__(self):
        self.next, self.observed = 0, []

    def sample(self, n):
        out = torch.arange(self.next, self.next + n)
        self.next += n
        return out

    def observe(self, indices, rewards, accuracy, *, normalized=True):
        self.observed += indices.tolist()
        return (indices.float() / 100)[:, None].expand(-1, G).clone()

    @staticmethod
    def normalize(raw):
        """batch_max over the trained prompts (none: nothing to scale)."""
        return raw / raw[:, 0].max() if len(raw) else raw


def table(flat):
    return lambda i: torch.tensor([0.5, 0.5]) if i in flat else torch.tensor([i + 1.0, 0.0])


def stub_round(sampler, rewards_of, *, rank=0, world=1, B=4):
    """draw(k, P) as train.py's Run.draw makes it: P prompts from the sampler, this rank's share
    'generated' (round k's completions are k + 2 tokens wide, token = 10·prompt + k), scored from the
    table, observed by the sampler."""
    def draw(k, prompts):
        indices = sampler.sample(prompts)
        rewards = torch.stack([rewards_of(int(i)) for i in indices])                # (P, G)
        mine = slice(rank * prompts // world, (rank + 1) * prompts // world)
        local = indices[mine].tolist()
        rows = [i for i in local for _ in range(G)]
        N, T = len(rows), k + 2
        ids = torch.tensor([[10 * i + k] * T for i in rows]).reshape(N, T)
        rollout = Rollout(ids, torch.ones(N, T), torch.full((N, T), -1.0), torch.zeros(N, dtype=torch.bool),
                          [f"{i}@{k}" for i in rows], 1.0)
        flat = rewards[mine].reshape(-1)
        scored = RewardResult(flat, {"accuracy": flat, "format": torch.zeros(N)}, {"accuracy": 1})
        is_weights = sampler.observe(indices, rewards, rewards.clamp(max=1), normalized=False)
        seeds = prompt_keys(k, prompts, B, mine).repeat_interleave(G)              # (N,) stand-ins for seeds
        return Draw(indices=indices, rows=rows, seeds=seeds, rollout=rollout,
                    scored=scored, rewards=rewards, is_weights=is_weights)
    return draw


def run(flat, *, max_rounds=4, rank=0, world=1, B=4, sampler=None):
    sampler = sampler or InOrder()
    draw = stub_round(sampler, table(flat), rank=rank, world=world, B=B)
    out = dynamic_sampling(draw(0, B), draw, world=world, rank=rank, max_rounds=max_rounds, pad_id=PAD,
                           normalize=sampler.normalize)
    return out, sampler


def test_one_rank_draws_the_shortfall_until_the_step_is_full():
    # B = 4, FLAT = {1, 2, 5}. Round 0: prompts 0-3, 1 and 2 set aside -> 2 short; round 1 draws 2:
    # prompts 4, 5 -> 5 set aside, 1 short; round 2 draws 1: prompt 6. Trained: 0, 3, 4, 6.
    out, sampler = run({1, 2, 5})
    assert out.indices.tolist() == [0, 3, 4, 6]
    assert out.rewards.tolist() == [[1, 0], [4, 0], [5, 0], [7, 0]] and not zero_variance(out.rewards).any()
    assert out.metrics == {"ds_rounds": 3.0, "ds_scored_groups": 7.0, "ds_set_aside_groups": 3.0,
                           "ds_trained_groups": 4.0, "ds_unused_groups": 0.0, "ds_short": 0.0}
    assert sampler.observed == [0, 1, 2, 3, 4, 5, 6]                     # every scored group, set-aside ones too
    # the kept groups' raw weights (observe's, here i/100: 0, .03, .04, .06), normalized together as one
    # batch (the stub's batch_max): / .06 -> 0, .5, .666667, 1
    torch.testing.assert_close(out.is_weights, torch.tensor([[0.0, 0], [.5, .5], [2 / 3, 2 / 3], [1.0, 1]]))
    # this rank's completions: rows, texts, seeds and rewards of the same groups, in the same order
    assert out.rows == [0, 0, 3, 3, 4, 4, 6, 6] and out.rollout.texts == ["0@0", "0@0", "3@0", "3@0", "4@1", "4@1",
                                                                          "6@2", "6@2"]
    assert out.scored.rewards.tolist() == out.rewards.reshape(-1).tolist()
    # their seeds' prompt keys: round 0's positions 0 and 3, round 1's 4 + 0, round 2's 8 + 0 (prompt_keys)
    assert out.seeds.tolist() == [0, 0, 3, 3, 4, 4, 8, 8]
    # round 0's completions are 2 tokens wide, round 1's 3, round 2's 4: padded to 4 with PAD, mask 0
    assert out.rollout.completion_ids[0].tolist() == [0, 0, PAD, PAD] and out.rollout.mask[0].tolist() == [1, 1, 0, 0]
    assert out.rollout.completion_ids[4].tolist() == [41, 41, 41, PAD] and out.rollout.mask[6].sum() == 4
    assert out.rollout.logprobs[0].tolist() == [-1, -1, 0, 0] and out.rollout.gen_time_s == 3.0
    assert out.scored.failures == {"accuracy": 3}                          # every round's calls
    assert out.mine(0, 1) == slice(0, 4)


def test_prompt_keys_of_later_rounds_are_new():
    # B = 4 on 2 ranks: round 0 keys 0-3 (as without dynamic sampling: positions), round 1 of 2 prompts
    # 4-5, round 2 of 4 prompts 8-11; rank 1 holds the second half of each
    assert prompt_keys(0, 4, 4, slice(2, 4)).tolist() == [2, 3]
    assert prompt_keys(1, 2, 4, slice(1, 2)).tolist() == [5]
    assert prompt_keys(2, 4, 4, slice(0, 2)).tolist() == [8, 9]


def test_a_short_step_trains_on_fewer_groups_and_says_so():
    # max_rounds 2, FLAT = {1, 2, 4, 5}: round 0 keeps 0 and 3, round 1's prompts 4 and 5 are set aside:
    # 2 of B = 4 trained, the step is short
    out, _ = run({1, 2, 4, 5}, max_rounds=2)
    assert out.indices.tolist() == [0, 3] and out.rows == [0, 0, 3, 3]
    assert out.metrics == {"ds_rounds": 2.0, "ds_scored_groups": 6.0, "ds_set_aside_groups": 4.0,
                           "ds_trained_groups": 2.0, "ds_unused_groups": 0.0, "ds_short": 1.0}
    # every group equal in every round: nothing to train (train.py: Run.idle_step), the counts say so
    out, sampler = run(set(range(100)), max_rounds=3)
    assert out.groups == 0 and out.rollout.completion_ids.shape[0] == 0 and out.rewards.shape == (0, G)
    assert out.metrics["ds_set_aside_groups"] == 12 and out.metrics["ds_short"] == 1 and len(sampler.observed) == 12
    # one round (max_sampling_rounds 1): the plain step with its all-equal groups left out
    out, _ = run({2}, max_rounds=1)
    assert out.indices.tolist() == [0, 1, 3] and out.metrics["ds_rounds"] == 1


def test_keep_fills_each_ranks_own_shortfall_from_its_own_share():
    # 2 ranks, 6 groups: rank 0 holds 0-2, rank 1 holds 3-5; rank 0 needs 1, rank 1 needs 3
    informative = torch.tensor([False, True, True, True, False, True])
    assert keep(informative, [1, 3]) == [[1], [3, 5]]


def test_two_ranks_decide_alike_and_split_the_kept_groups_evenly():
    # B = 4 on W = 2 (2 prompts each), FLAT = {1, 2, 3}. Round 0: rank 0 (0, 1) keeps 0, rank 1 (2, 3) none:
    # shortfalls 1 and 2 -> round 1 draws 2·2 = 4: rank 0's 4, 5 (keeps 4), rank 1's 6, 7 (keeps both).
    # Trained [0, 4 | 6, 7]; 5 has a spread but is not needed (unused).
    outs = [run({1, 2, 3}, rank=r, world=2)[0] for r in (0, 1)]
    for out in outs:
        assert out.indices.tolist() == [0, 4, 6, 7] and out.metrics["ds_unused_groups"] == 1
        assert out.metrics["ds_rounds"] == 2 and out.metrics["ds_scored_groups"] == 8
    assert outs[0].rows == [0, 0, 4, 4] and outs[1].rows == [6, 6, 7, 7]
    assert outs[0].mine(0, 2) == slice(0, 2) and outs[1].mine(1, 2) == slice(2, 4)
    for r, out in enumerate(outs):                                          # the rank's rows of the replicated rewards
        assert out.rewards[out.mine(r, 2)].reshape(-1).tolist() == out.scored.rewards.tolist()
    # short on two ranks: one round, FLAT = {1}: rank 0 keeps 0, rank 1 keeps 2 and 3 -> each trains 1
    # (the ranks hold equal numbers of completions): [0 | 2], prompt 3 unused
    outs = [run({1}, rank=r, world=2, max_rounds=1)[0] for r in (0, 1)]
    assert outs[0].indices.tolist() == [0, 2] == outs[1].indices.tolist()
    assert outs[0].rows == [0, 0] and outs[1].rows == [2, 2]
    assert outs[0].metrics["ds_unused_groups"] == 1 and outs[0].metrics["ds_short"] == 1


def test_pps_priorities_are_set_for_every_scored_group():
    # PPS over 8 prompts, B = 4; even prompts all-equal ([.5, .5]: mean |A| = 0 -> p = (0 + 1e-6)^.6 = 2.5e-4),
    # odd ones [i + 1, 0]: |A| = (i+1)/2 / (s + 1e-4) with s = (i+1)/sqrt(2): .70706 (i = 1) to .70710,
    # p = .7071^.6 = .8122 (to 1e-4). Every scored prompt, kept or set aside, has its priority written.
    sampler = PrioritySampler(8, alpha=0.6, beta=0.4, seed=0)
    scored = []
    draw = stub_round(sampler, table({0, 2, 4, 6}))

    def recording(k, prompts):
        d = draw(k, prompts)
        scored.append(d)
        return d
    out = dynamic_sampling(recording(0, 4), recording, world=1, rank=0, max_rounds=4, pad_id=PAD,
                           normalize=sampler.normalize)
    seen = torch.cat([d.indices for d in scored])
    assert out.metrics["ds_scored_groups"] == len(seen) and bool(sampler.seen[seen].all())
    priorities = sampler.priorities()
    for i in seen.tolist():
        assert float(priorities[i]) == pytest.approx(1e-6 ** 0.6 if i % 2 == 0 else 0.8122, rel=1e-3), i
    assert all(i % 2 == 1 for i in out.indices.tolist()) and not zero_variance(out.rewards).any()
    # the kept groups' weights: their own round's raw draw weights (observe's), normalized over the kept
    # groups together (batch_max: the largest is 1), not round by round
    raw = torch.stack([next(d for d in scored if i in d.indices.tolist()).is_weights[
        next(d for d in scored if i in d.indices.tolist()).indices.tolist().index(i)] for i in out.indices.tolist()])
    torch.testing.assert_close(out.is_weights, (raw / raw[:, 0].max()).float())
    assert float(out.is_weights.max()) == 1.0
